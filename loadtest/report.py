"""Write results: JSON, a PNG plot (latency CDF + client buffer levels), text tables."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.metrics import utterance_rows


def write_json(result: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    return path


def _fmt(v: Any, nd: int = 0) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def summary_table(result: dict[str, Any]) -> str:
    """A per-role table of one run."""
    m = result["metrics"]
    since = m["all"].get("since_s")
    head = ("role", "sess", "utt", "done", "cancel", "err", "TTFA p50", "p95", "p99", "seg-TTFA p50", "p99",
            "underruns", "underrun ms", *(("after burst", "ms after") if since is not None else ()),
            "gaps heard", "boundary buf p5", "cancel->silence p50", "p95", "QPS")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    groups = [("all" if "slow" not in m["roles"] else "all but slow", m["all"])] + sorted(m["roles"].items())
    for role, g in groups:
        t, ts, cs = g["ttfa_ms"], g["ttfa_segment_ms"], g["cancel_to_silence_ms"]
        gap_b = g["boundary_buffer_ms"].get("p5")
        lines.append("| " + " | ".join([
            role, _fmt(g["sessions"]), _fmt(g["utterances"]), _fmt(g["completed"]), _fmt(g["cancelled"]),
            _fmt(sum(g["errors"].values())), _fmt(t["p50"]), _fmt(t["p95"]), _fmt(t["p99"]),
            _fmt(ts["p50"]), _fmt(ts["p99"]), _fmt(g["underruns"]), _fmt(g["underrun_ms"]),
            *((_fmt(g["underruns_since"]), _fmt(g["underrun_ms_since"])) if since is not None else ()),
            _fmt(g["segment_gaps_heard"]), _fmt(gap_b),
            _fmt(cs["p50"]), _fmt(cs["p95"]), _fmt(g["qps"], 2),
        ]) + " |")
    extra = []
    if m.get("slow_readers"):
        for s in m["slow_readers"]:
            if s["stop_to_close_ms"] is None:
                extra.append(f"slow reader {s['session']}: still open at the end (not evicted: what the "
                             "server sent still fit in socket buffers)")
            else:
                extra.append(f"slow reader {s['session']}: closed {s['close_code']} {s['close_reason']!r} "
                             f"{_fmt(s['stop_to_close_ms'])} ms after it stopped reading")
    if m["all"]["errors"]:
        extra.append(f"errors: {m['all']['errors']}")
    sb = result.get("server_breakdown") or {}
    if sb.get("ttfa_parts"):
        parts = sb["ttfa_parts"]
        extra.append("server TTFA split (/metrics, mean/p95 ms): " + ", ".join(
            f"{k} {_fmt(v['mean_ms'], 0)}/{_fmt(v['p95_ms'], 0)}"
            for k, v in sorted(parts.items(), key=lambda kv: ["text_wait", "queue", "engine", "send"].index(kv[0])
                               if kv[0] in ("text_wait", "queue", "engine", "send") else 9)))
    if m["all"]["engine"]:
        extra.append("engine (utterance.done, p50/p95): " + ", ".join(
            f"{k} {_fmt(v['p50'], 1)}/{_fmt(v['p95'], 1)}" for k, v in m["all"]["engine"].items()))
    return "\n".join(lines + extra)


def plot(runs: Sequence[tuple[str, dict[str, Any]]], path: str | Path, title: str = "",
         marker_s: float | None = None) -> Path:
    """Two panels: TTFA CDF per run and role; client buffer level over time per session."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    styles = ["-", "--", ":", "-."]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ri, (label, result) in enumerate(runs):
        rows = utterance_rows(result["sessions"])
        roles = sorted({r["role"] for r in rows})
        for ci, role in enumerate(roles):
            v = np.sort([r["ttfa_ms"] for r in rows if r["role"] == role and r["ttfa_ms"] is not None])
            if v.size:
                ax1.plot(v, np.arange(1, v.size + 1) / v.size, styles[ri % 4], color=colors[ci % len(colors)],
                         label=f"{label}: {role} (n={v.size})", drawstyle="steps-post")
        for s in result["sessions"]:
            if not s["levels"]:
                continue
            t, lv = zip(*s["levels"], strict=True)
            role_i = roles.index(s["role"]) if s["role"] in roles else 0
            ax2.plot(t, lv, styles[ri % 4], color=colors[role_i % len(colors)], lw=0.7, alpha=0.6)
    all_v = [r["ttfa_ms"] for _, res in runs for r in utterance_rows(res["sessions"]) if r["ttfa_ms"]]
    if all_v and max(all_v) / max(1.0, min(all_v)) > 30:
        ax1.set_xscale("log")
    if not any(lv for _, res in runs for s in res["sessions"] for _, lv in s["levels"]):
        ax2.text(0.5, 0.5, "clients consumed audio at once (instant playback):\nno buffer to show",
                 ha="center", va="center", transform=ax2.transAxes)
    ax1.set_xlabel("time to first audio (ms)")
    ax1.set_ylabel("fraction of utterances")
    ax1.set_title("TTFA CDF")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    ax2.set_xlabel("time since start (s)")
    ax2.set_ylabel("client buffer (ms)")
    ax2.set_title("client buffer levels (line style = run, colour = role)")
    ax2.grid(alpha=0.3)
    if marker_s is not None:
        ax2.axvline(marker_s, color="k", lw=0.8, ls=":")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

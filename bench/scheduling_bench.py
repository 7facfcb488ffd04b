"""Scheduling benchmark: the ``burst`` scenario under deadline priorities vs vLLM's FCFS.

    flock /tmp/voicegw-heavy.lock python -m bench.scheduling_bench            # real stack, tiny ckpt
    python -m bench.scheduling_bench --engine sim --repeats 5                # model-free, seconds

For each policy (default ``priority,fcfs``) one gateway subprocess is started with the same
engine settings (``engine.scheduling_policy`` "priority" or "fcfs"; ``engine.max_num_seqs``
small so that a burst must queue on this CPU), then the burst scenario runs ``--repeats``
times against it (different seeds; records merged). Reported per policy:

* TTFA p50/p95/p99 of the burst sessions (first audio byte minus first text sent) and of the
  server's own share (from the text that completed the first segment);
* underruns of the streams ALREADY PLAYING when a burst comes (``background`` sessions, after
  the first burst) -- must not get worse than FCFS -- and of the burst sessions themselves;
* the ratio FCFS TTFA p99 / priority TTFA p99.

Writes ``<out>/scheduling.json``, ``<out>/scheduling.png`` (TTFA CDFs, buffer levels) and
replaces the ``## Scheduling (CPU, tiny checkpoint)`` section of ``bench/RESULTS.md`` (sim runs
go to ``## Scheduling (sim engine)``); other sections are kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "RESULTS.md"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="voicegw bench scheduling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=("vllm", "sim", "fake"), default="vllm")
    p.add_argument("--model-dir", default="", help="checkpoint (default: random, of --model-size, generated here)")
    p.add_argument("--model-size", choices=("tiny", "small"), default="tiny",
                   help="random checkpoint when no --model-dir: tiny (fast: bursts rarely meet full slots on a "
                        "fast CPU) or small (near real time at a few streams: the contended regime)")
    p.add_argument("--policies", default="priority,fcfs",
                   help="comma list of priority|fcfs; priority:lead=MS:slack=MS sets deadline-mode knobs, "
                        "(dispatch, preemption, rescues, requeueing and gen=0 were measured to lose and are gone)")
    p.add_argument("--first-lead-ms", type=float, default=None, help="deadline policy: first segment lead")
    p.add_argument("--slack-ms", type=float, default=None, help="deadline policy: continuing-segment slack")
    p.add_argument("--max-num-seqs", type=int, default=4, help="engine batch limit (small: bursts must queue)")
    p.add_argument("--background", type=int, default=3, help="sessions already speaking")
    p.add_argument("--sessions", type=int, default=3, help="sessions per burst")
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--burst-at", type=float, default=6.0)
    p.add_argument("--burst-every", type=float, default=8.0)
    p.add_argument("--duration", type=float, default=8.0, help="seconds after the last burst")
    p.add_argument("--utterance-chars", type=int, default=120)
    p.add_argument("--background-chars", type=int, default=600)
    p.add_argument("--tokens-per-s", type=float, default=40.0)
    p.add_argument("--repeats", type=int, default=1, help="scenario runs per server start")
    p.add_argument("--rounds", type=int, default=1,
                   help="server starts per policy, interleaved across policies (P1 P2 P1 P2 ...)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--admission", action="store_true",
                   help="keep scheduler.admission on (default off here: refusals would hide latency)")
    p.add_argument("--server-arg", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.add_argument("--out", default="out/bench/scheduling")
    p.add_argument("--results", default=str(RESULTS), help="Markdown file to update ('' = do not)")
    p.add_argument("--from-raw", default="", metavar="DIR",
                   help="run nothing: rebuild the table from DIR/raw-<policy>-run<k>.json of an earlier run "
                        "(records without client stall probes get stalls from gaps in their buffer-level samples)")
    return p


#: ``--from-raw`` on records made before the client stall probe: a gap longer than this between
#: consecutive buffer-level samples (taken every 0.25 s by every session's reporter) is a stall.
LEVEL_GAP_STALL_S = 0.6


def stalls_from_levels(sessions: list[dict[str, Any]], gap_s: float = LEVEL_GAP_STALL_S) -> list[list[float]]:
    """Client stalls of one worker's sessions inferred from their level samples: every session's
    reporter appends one every 0.25 s, so a gap in the union of samples is a time the worker's
    event loop did not run."""
    ts = sorted({float(lv[0]) for s in sessions for lv in s.get("levels", [])})
    return [[a, b] for a, b in zip(ts, ts[1:], strict=False) if b - a > gap_s]


def load_raw(directory: Path, policies: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Raw scenario results of an earlier run, by policy in run order (``--from-raw``)."""
    found: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for path in directory.glob("raw-*-run*.json"):
        m = re.fullmatch(r"raw-(.+)-run(\d+)\.json", path.name)
        if m is None or (policies and m.group(1) not in policies):
            continue
        r = json.loads(path.read_text())
        sessions = r["sessions"]
        if sessions and all("client_stalls" not in x for x in sessions):
            stalls = stalls_from_levels(sessions)  # the run's workers together (one in these runs)
            for x in sessions:
                x["client_stalls"] = stalls
        found.setdefault(m.group(1), []).append((int(m.group(2)), r))
    return {k: [r for _, r in sorted(v, key=lambda t: t[0])] for k, v in found.items()}


def _flag(v: str) -> str:
    return "true" if v in ("", "1", "true", "on") else "false"


#: policy option -> (server setting, value converter)
_POLICY_OPTIONS: dict[str, tuple[str, Callable[[str], str]]] = {
}


def _policy_spec(spec: str, lead: float | None, slack: float | None
                 ) -> tuple[str, float | None, float | None, dict[str, str]]:
    """``priority``, ``fcfs`` or ``priority:lead=0:slack=2000``.

    ``lead``/``slack``: deadline-mode knobs (gateway-side dispatch, preemption, rescues,
    requeueing and ``gen=0`` were measured to lose and are gone: bench/RESULTS.md).
    Returns (policy, lead, slack, server overrides)."""
    name, *opts = spec.split(":")
    extra: dict[str, str] = {}
    for opt in opts:
        k, _, v = opt.partition("=")
        if k == "lead":
            lead = float(v)
        elif k == "slack":
            slack = float(v)
        elif k in _POLICY_OPTIONS:
            key, conv = _POLICY_OPTIONS[k]
            extra[key] = conv(v)
        else:
            raise SystemExit(f"unknown policy option {opt!r} in {spec!r} (lead=MS, slack=MS, dispatch=1, "
                             "reserve=F, dlead=MS, preempt=1, pbuf=MS, pmax=N, rescue=MS, rqueued=1, pwait=MS, gen=0|1, requeue=0|1)")
    if name != "priority":
        lead = slack = None
        extra = {}
    return name, lead, slack, extra


def _merge(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    sessions: list[dict[str, Any]] = []
    for i, r in enumerate(results):
        for s in r["sessions"]:
            sessions.append(dict(s, session_id=i * 10_000 + s["session_id"]))
    return sessions


def _summary(policy: str, results: list[dict[str, Any]], burst_at_s: float, sample_rate_hz: int,
             server: dict[str, Any]) -> dict[str, Any]:
    from loadtest import metrics

    sessions = _merge(results)
    m = metrics.compute(sessions, wall_s=sum(r["wall_s"] for r in results), sample_rate_hz=sample_rate_hz,
                        since_s=burst_at_s)
    burst = m["roles"].get("burst", {})
    bg = m["roles"].get("background", {})
    return {
        "policy": policy,
        "runs": len(results),
        "burst_ttfa_ms": burst.get("ttfa_ms"),
        "burst_ttfa_segment_ms": burst.get("ttfa_segment_ms"),
        "burst_completed": burst.get("completed"),
        "burst_utterances": burst.get("utterances"),
        "burst_underruns": burst.get("underruns"),
        "burst_underrun_ms": burst.get("underrun_ms"),
        "burst_gaps_heard": burst.get("segment_gaps_heard"),
        "playing_underruns_after_burst": bg.get("underruns_since"),
        "playing_underrun_ms_after_burst": bg.get("underrun_ms_since"),
        "playing_private_underruns_after_burst": bg.get("private_underruns_since"),
        "playing_private_underrun_ms_after_burst": bg.get("private_underrun_ms_since"),
        "burst_private_underruns": burst.get("private_underruns_since"),
        "shared_underruns": m.get("shared_underruns"),
        "client_stalls": m.get("client_stalls"),
        "burst_ttfa_unstalled_ms": burst.get("ttfa_ms_unstalled"),
        "burst_client_stalled": burst.get("client_stalled_utterances"),
        "playing_underruns_unstalled": bg.get("underruns_since_unstalled"),
        "playing_underrun_ms_unstalled": bg.get("underrun_ms_since_unstalled"),
        "errors": m["all"]["errors"],
        "missing_sessions": sum(len(r["missing_sessions"]) for r in results),
        "server": server,
        "metrics": m,
    }


def _table(rows: list[dict[str, Any]]) -> str:
    head = ["policy", "runs", "burst TTFA p50 ms", "p95", "p99", "server share p50", "p99",
            "playing streams: underruns after burst (private)", "underrun ms (private)",
            "burst streams: underruns (private)", "underrun ms", "all-stream stalls", "errors",
            "client stalls s", "outside client stalls: burst TTFA p50 / p95 / p99 (n)",
            "playing underruns / ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def f(v: Any) -> str:
        return "-" if v is None else (f"{v:.0f}" if isinstance(v, float) else str(v))

    for r in rows:
        t, ts = r["burst_ttfa_ms"] or {}, r["burst_ttfa_segment_ms"] or {}
        tu = r.get("burst_ttfa_unstalled_ms") or {}
        lines.append("| " + " | ".join([
            r["policy"], str(r["runs"]), f(t.get("p50")), f(t.get("p95")), f(t.get("p99")),
            f(ts.get("p50")), f(ts.get("p99")),
            f"{f(r['playing_underruns_after_burst'])} ({f(r['playing_private_underruns_after_burst'])})",
            f"{f(r['playing_underrun_ms_after_burst'])} ({f(r['playing_private_underrun_ms_after_burst'])})",
            f"{f(r['burst_underruns'])} ({f(r['burst_private_underruns'])})", f(r["burst_underrun_ms"]),
            f(r["shared_underruns"]), str(sum(r["errors"].values()) if r["errors"] else 0),
            f((r.get("client_stalls") or {}).get("total_s")),
            "{} / {} / {} ({})".format(f(tu.get("p50")), f(tu.get("p95")), f(tu.get("p99")), f(tu.get("n"))),
            f"{f(r.get('playing_underruns_unstalled'))} / {f(r.get('playing_underrun_ms_unstalled'))}",
        ]) + " |")
    return "\n".join(lines)


def _update_results(path: Path, heading: str, body: str) -> None:
    text = path.read_text() if path.exists() else "# Benchmark results\n\nOne section per benchmark.\n"
    section = f"{heading}\n\n{body.strip()}\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _m: section + "\n", text, count=1)
    else:
        text = text.rstrip() + "\n\n" + section
    path.write_text(text.rstrip() + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from loadtest import report
    from loadtest.plan import ScenarioParams
    from loadtest.runner import run_scenario
    from loadtest.serve import ServerProcess, generated_model_dir

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = f"checkpoint {args.model_dir}"
    if args.engine == "vllm" and not args.model_dir and not args.from_raw:
        args.model_dir = generated_model_dir(args.model_size)
        ckpt = f"{args.model_size} random ChatTTS checkpoint"
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    base = ScenarioParams(
        scenario="burst", sessions=args.sessions, background=args.background, bursts=args.bursts,
        burst_at_s=args.burst_at, burst_every_s=args.burst_every, duration_s=args.duration,
        utterance_chars=args.utterance_chars, background_chars=args.background_chars,
        tokens_per_s=args.tokens_per_s, seed=args.seed,
    )
    # admission would refuse part of a burst (errors instead of latency): off unless asked, so that
    # every policy serves every utterance and TTFA compares like with like
    overrides = {"engine.max_num_seqs": str(args.max_num_seqs),
                 "scheduler.admission": "true" if args.admission else "false"}
    for item in args.server_arg:
        k, _, v = item.partition("=")
        overrides[k] = v
    rows: list[dict[str, Any]] = []
    runs: list[tuple[str, dict[str, Any]]] = []
    all_results: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    servers: dict[str, dict[str, Any]] = {p: {} for p in policies}
    if args.from_raw:
        all_results = load_raw(Path(args.from_raw), policies)
        missing = [p for p in policies if p not in all_results]
        if missing:
            raise SystemExit(f"no raw results for {missing} in {args.from_raw}")
    for rnd in range(0 if args.from_raw else args.rounds):  # rounds interleave the policies: slow drifts of a shared machine hit all
        for policy in policies:
            name, lead, slack, extra = _policy_spec(policy, args.first_lead_ms, args.slack_ms)
            with ServerProcess(args.engine, model_dir=args.model_dir, policy=name, overrides={**overrides, **extra},
                               first_lead_ms=lead, slack_ms=slack) as srv:
                for rep in range(args.repeats):
                    k = rnd * args.repeats + rep
                    params = dataclasses.replace(base, seed=args.seed + k)
                    r = run_scenario(params, srv.url)
                    all_results[policy].append(r)
                    report.write_json(r, out / f"raw-{policy}-run{k}.json")
                    print(f"{policy} run {k + 1}/{args.repeats * args.rounds}: burst TTFA p99 "
                          f"{r['metrics']['roles'].get('burst', {}).get('ttfa_ms', {}).get('p99')} ms", flush=True)
                servers[policy] = srv.info()
    for policy in policies:
        results = all_results[policy]
        rows.append(_summary(policy, results, base.burst_at_s, base.sample_rate_hz, servers[policy]))
        runs.append((policy, {"sessions": _merge(results)}))
    table = _table(rows)
    by = {r["policy"]: r for r in rows}
    lines = [table, ""]
    prio = next((p for p in policies if p.startswith("priority")), None)
    if prio is not None and "fcfs" in by:
        by["priority"] = by[prio]
        p99p = (by["priority"]["burst_ttfa_ms"] or {}).get("p99")
        p99f = (by["fcfs"]["burst_ttfa_ms"] or {}).get("p99")
        if p99p and p99f:
            ratio = p99f / p99p
            lines.append(f"TTFA p99 ratio FCFS / {prio}: **{ratio:.2f}x**; playing streams' underruns after "
                         f"the first burst: priority {by['priority']['playing_underruns_after_burst']} "
                         f"({by['priority']['playing_underrun_ms_after_burst']} ms) vs FCFS "
                         f"{by['fcfs']['playing_underruns_after_burst']} "
                         f"({by['fcfs']['playing_underrun_ms_after_burst']} ms).")
        u99p = (by["priority"].get("burst_ttfa_unstalled_ms") or {}).get("p99")
        u99f = (by["fcfs"].get("burst_ttfa_unstalled_ms") or {}).get("p99")
        if u99p and u99f:
            lines.append(f"Outside client stalls: TTFA p99 ratio FCFS / {prio} **{u99f / u99p:.2f}x**; playing "
                         f"streams' underruns {by['priority']['playing_underruns_unstalled']} "
                         f"({by['priority']['playing_underrun_ms_unstalled']} ms) vs FCFS "
                         f"{by['fcfs']['playing_underruns_unstalled']} ({by['fcfs']['playing_underrun_ms_unstalled']} ms); "
                         f"client stalls {(by['priority'].get('client_stalls') or {}).get('total_s')} s vs "
                         f"{(by['fcfs'].get('client_stalls') or {}).get('total_s')} s.")
    text = "\n".join(lines)
    print(text)
    png = report.plot(runs, out / "scheduling.png", title=f"burst: {' vs '.join(policies)} ({args.engine})",
                      marker_s=base.burst_at_s)
    (out / "scheduling.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1, default=str))
    print(f"wrote {out / 'scheduling.json'} and {png}")
    if args.results and not args.from_raw:
        heading = "## Scheduling (CPU, tiny checkpoint)" if args.engine == "vllm" else f"## Scheduling ({args.engine} engine)"
        cmd = "python -m bench.scheduling_bench " + " ".join(sys.argv[1:] if argv is None else argv)
        body = "\n".join([
            f"Run {datetime.date.today().isoformat()} on {platform.machine()} with {os.cpu_count()} CPUs "
            f"(shared with other work), engine `{args.engine}`"
            + (f" ({ckpt}, vLLM CPU)" if args.engine == "vllm" else "") + ".",
            f"Command: `{cmd.strip()}`",
            "",
            f"Scenario: {args.background} sessions speaking long answers back to back; {args.bursts} bursts of "
            f"{args.sessions} new sessions (first burst at {args.burst_at:.0f} s, every {args.burst_every:.0f} s), "
            f"LLM text at {args.tokens_per_s:.0f} tokens/s; engine.max_num_seqs={args.max_num_seqs}; "
            f"{args.rounds} round(s) x {args.repeats} run(s) per policy, rounds interleaved. TTFA = first audio byte at the client minus first text sent; "
            "server share = from the text that completed the first segment. Playing streams = the background "
            "sessions, counted from the first burst on. (private) = underruns that did not hit at least half "
            "of the other playing streams at the same moment; all-stream stalls = those that did (the whole "
            "server or machine stalled: CPU contention on this shared 2-core machine), which no scheduling "
            "policy can fix.",
            "",
            text,
            "",
            f"Plot: `{png}` (left: TTFA CDF per policy and role; right: client buffer levels). "
            f"Raw: `{out / 'scheduling.json'}`.",
        ])
        _update_results(Path(args.results), heading, body)
        print(f"updated {args.results} ({heading})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Side-by-side: our engine vs the native-pipeline baseline, same gateway, protocol and clients.

For each engine (``--serve``, default ``vllm``; ``--baseline``, default ``native``) one gateway
subprocess is started; for each concurrency ``c`` the ``closed-loop`` scenario runs ``c``
sessions speaking back to back for ``--duration`` seconds. Reported per (engine, c):

* QPS: utterances completed per second of the active period;
* TTFA mean / p99 (first audio byte minus first text sent) and full-utterance latency mean /
  p99 (``utterance.done`` minus first text sent);
* peak RSS of the server process tree during that level (the vLLM engine core is a child);
* underruns (clients play in real time) and errors.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loadtest.plan import ScenarioParams


def _row(engine: str, c: int, result: dict[str, Any], rss_peak_mib: float | None) -> dict[str, Any]:
    g = result["metrics"]["all"]
    return {
        "engine": engine,
        "concurrency": c,
        "qps": g["qps"],
        "completed": g["completed"],
        "ttfa_mean_ms": g["ttfa_ms"]["mean"],
        "ttfa_p50_ms": g["ttfa_ms"]["p50"],
        "ttfa_p99_ms": g["ttfa_ms"]["p99"],
        "latency_mean_ms": g["total_ms"]["mean"],
        "latency_p99_ms": g["total_ms"]["p99"],
        "rss_peak_mib": rss_peak_mib,
        "underruns": g["underruns"],
        "underrun_ms": g["underrun_ms"],
        "errors": sum(g["errors"].values()) + g["timed_out"],
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = ["engine", "conc.", "QPS", "done", "TTFA mean ms", "TTFA p99 ms", "latency mean ms", "latency p99 ms",
            "server RSS peak MiB", "underruns", "errors"]
    keys = ["engine", "concurrency", "qps", "completed", "ttfa_mean_ms", "ttfa_p99_ms", "latency_mean_ms",
            "latency_p99_ms", "rss_peak_mib", "underruns", "errors"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(rows, key=lambda r: (r["concurrency"], r["engine"])):
        cells = []
        for k in keys:
            v = r[k]
            cells.append("-" if v is None else (f"{v:.0f}" if isinstance(v, float) and k != "qps" else
                                                 f"{v:.2f}" if isinstance(v, float) else str(v)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_compare(args: argparse.Namespace, levels: list[int],
                params_fn: Callable[..., ScenarioParams], overrides: dict[str, str]) -> int:
    from loadtest import report
    from loadtest.runner import run_scenario
    from loadtest.serve import ServerProcess

    if args.url:
        print("compare starts its own servers: --url is not used", flush=True)
    out = Path(args.out)
    rows: list[dict[str, Any]] = []
    runs: list[tuple[str, dict[str, Any]]] = []
    servers: dict[str, Any] = {}
    for engine in (args.serve, args.baseline):
        saved = [out / f"compare-{engine}-c{c}.json" for c in levels]
        if getattr(args, "reuse", False) and all(p.exists() for p in saved):
            for c, path in zip(levels, saved, strict=True):
                result = json.loads(path.read_text())
                rows.append(_row(engine, c, result, result["server"].get("rss_peak_mib")))
                runs.append((f"{engine} c={c}", result))
                servers[engine] = result["server"]
            print(f"{engine}: reused {', '.join(map(str, saved))}", flush=True)
            continue
        with ServerProcess(engine, model_dir=args.model_dir, overrides=overrides) as srv:
            servers[engine] = srv.info()
            for c in levels:
                assert srv.sampler is not None
                srv.sampler.sample()
                srv.sampler.reset_peak()
                params = params_fn(args, scenario="closed-loop", sessions=c)
                result = run_scenario(params, srv.url, args.workers)
                srv.sampler.sample()
                rss = round(srv.sampler.peak_bytes / 2**20, 1)
                result["server"] = srv.info() | {"rss_peak_mib": rss}
                report.write_json(result, out / f"compare-{engine}-c{c}.json")
                rows.append(_row(engine, c, result, rss))
                runs.append((f"{engine} c={c}", result))
                print(f"{engine} c={c}: QPS {rows[-1]['qps']} TTFA p99 {rows[-1]['ttfa_p99_ms']} ms", flush=True)
    text = table(rows)
    print(text)
    report.write_json({"rows": rows, "servers": servers, "levels": levels}, out / "compare.json")
    png = report.plot(runs, out / "compare.png", title="closed loop: " + " vs ".join((args.serve, args.baseline)))
    print(f"wrote {out / 'compare.json'} and {png}")
    return 0

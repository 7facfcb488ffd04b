"""Command line of the load generator.

    python -m loadtest run --scenario burst --serve fake            # server started here
    python -m loadtest run --scenario steady --url ws://127.0.0.1:8765/ws --sessions 32
    python -m loadtest compare --concurrency 10,20 --serve vllm --baseline native

``run`` writes ``<out>/<scenario>.json`` and ``<out>/<scenario>.png`` and prints a table per
session role. ``compare`` runs the closed-loop scenario at each concurrency against two server
setups and prints the side-by-side table (QPS, mean/p99 latency, server RSS).
Traffic goes to 127.0.0.1 only; sessions, duration and text are capped (``loadtest.plan``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.plan import MAX_DURATION_S, MAX_SESSIONS, SCENARIOS, WORKLOADS, ScenarioParams
from loadtest.serve import ENGINES


def _scenario_flags(p: argparse.ArgumentParser) -> None:
    d = ScenarioParams()
    g = p.add_argument_group("scenario")
    g.add_argument("--scenario", choices=SCENARIOS, default=d.scenario)
    g.add_argument("--workload", choices=WORKLOADS, default=d.workload,
                   help="what the answers are like: short stock sentences, or a real assistant's answers "
                        "(120-600 varied characters in 2-6-character deltas, 0.5-2 s think time, 100 ms prebuffer)")
    g.add_argument("--sessions", type=int, default=d.sessions,
                   help=f"sessions (burst: sessions starting at once) [max {MAX_SESSIONS}]")
    g.add_argument("--background", type=int, default=d.background, help="burst: sessions already mid-utterance")
    g.add_argument("--duration", type=float, default=d.duration_s, dest="duration_s",
                   help=f"seconds of load (burst: after the burst) [max {MAX_DURATION_S:.0f}]")
    g.add_argument("--ramp", type=float, default=d.ramp_s, dest="ramp_s", help="seconds over which sessions start")
    g.add_argument("--burst-at", type=float, default=d.burst_at_s, dest="burst_at_s")
    g.add_argument("--bursts", type=int, default=d.bursts, help="burst: number of bursts")
    g.add_argument("--burst-every", type=float, default=d.burst_every_s, dest="burst_every_s")
    g.add_argument("--tokens-per-s", type=float, default=d.tokens_per_s, dest="tokens_per_s",
                   help="LLM token rate per session")
    g.add_argument("--token-chars", type=float, default=d.token_chars, dest="token_chars",
                   help="mean characters per token")
    g.add_argument("--utterance-chars", type=int, default=d.utterance_chars, dest="utterance_chars")
    g.add_argument("--background-chars", type=int, default=d.background_chars, dest="background_chars")
    g.add_argument("--think", type=float, default=d.think_s, dest="think_s", help="mean pause between turns (s)")
    g.add_argument("--cancel-prob", type=float, default=d.cancel_prob, dest="cancel_prob")
    g.add_argument("--slow-after", type=float, default=d.slow_after_s, dest="slow_after_s")
    g.add_argument("--sample-rate", type=int, default=d.sample_rate_hz, dest="sample_rate_hz")
    g.add_argument("--settle", type=float, default=d.settle_s, dest="settle_s")
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--realtime-playback", dest="instant_playback", action="store_false",
                   help="closed-loop: play audio in real time instead of consuming it at once")


def _server_flags(p: argparse.ArgumentParser, default_engine: str | None) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--url", default=None, help="WebSocket URL of a running gateway (127.0.0.1 only)")
    g.add_argument("--serve", choices=ENGINES, default=default_engine,
                   help="start a gateway subprocess with this engine for the run")
    g.add_argument("--model-dir", default="", help="ChatTTS checkpoint (vllm/native); empty: a tiny random one")
    g.add_argument("--server-arg", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="extra gateway setting for the served gateway (repeatable)")
    g.add_argument("--workers", type=int, default=None, help="client worker processes [auto]")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="voicegw loadtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command")
    r = sub.add_parser("run", help="run one scenario")
    _scenario_flags(r)
    _server_flags(r, None)
    r.add_argument("--out", default="out/loadtest", help="output directory for JSON and PNG")
    r.add_argument("--name", default=None, help="file name stem [scenario]")
    r.add_argument("--no-plot", action="store_true")
    c = sub.add_parser("compare", help="closed-loop comparison against the native pipeline baseline")
    _scenario_flags(c)
    _server_flags(c, "vllm")
    c.add_argument("--baseline", choices=ENGINES, default="native", help="the other engine")
    c.add_argument("--concurrency", default="10,20", help="comma-separated session counts")
    c.add_argument("--reuse", action="store_true",
                   help="reuse per-level results already in --out (compare-<engine>-c<N>.json) instead of rerunning")
    c.add_argument("--out", default="out/loadtest", help="output directory")
    return p


def _params(args: argparse.Namespace, **over: Any) -> ScenarioParams:
    names = {f.name for f in dataclasses.fields(ScenarioParams)}
    kw = {k: v for k, v in vars(args).items() if k in names}
    kw.update(over)
    return ScenarioParams(**kw)


def _overrides(args: argparse.Namespace) -> dict[str, str]:
    out = {}
    for item in args.server_arg:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise SystemExit(f"--server-arg {item!r}: expected SECTION.FIELD=VALUE")
        out[key] = value
    return out


def cmd_run(args: argparse.Namespace) -> int:
    from loadtest import report
    from loadtest.runner import run_scenario
    from loadtest.serve import ServerProcess

    params = _params(args)
    if not args.url and not args.serve:
        print("voicegw loadtest: give --url ws://127.0.0.1:PORT/ws or --serve ENGINE", file=sys.stderr)
        return 2
    out = Path(args.out)
    stem = args.name or params.scenario
    server_info: dict[str, Any] = {}
    if args.serve:
        with ServerProcess(args.serve, model_dir=args.model_dir, overrides=_overrides(args)) as srv:
            result = run_scenario(params, srv.url, args.workers)
            server_info = srv.info()
    else:
        result = run_scenario(params, args.url, args.workers)
    result["server"] = server_info
    path = report.write_json(result, out / f"{stem}.json")
    print(report.summary_table(result))
    if server_info:
        print(f"server: {server_info.get('engine')} peak RSS {server_info.get('rss_peak_mib')} MiB")
    print(f"wrote {path}")
    if not args.no_plot:
        marker = params.burst_at_s if params.scenario == "burst" else None
        png = report.plot([(stem, result)], out / f"{stem}.png", title=f"voicegw loadtest: {stem}", marker_s=marker)
        print(f"wrote {png}")
    return 0 if not result["missing_sessions"] else 1


def cmd_compare(args: argparse.Namespace) -> int:
    from loadtest.compare import run_compare

    levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    return run_compare(args, levels, _params, _overrides(args))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in ("run", "compare", "-h", "--help"):
        argv = ["run", *argv]
    if not argv:
        argv = ["run", "--help"]
    args = build_parser().parse_args(argv)
    if args.command == "compare":
        return cmd_compare(args)
    return cmd_run(args)

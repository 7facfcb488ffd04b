"""Arguments, defaults and the run: ``python -m bench.gpu_e2e``."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.gpu_e2e.host import (
    PHASES,
    SCHEMA,
    Budget,
    GpuSampler,
    Results,
    _ints,
    host_info,
    kill_stale_children,
    prepare_environment,
)
from bench.gpu_e2e.phases import (
    dp_levels,
    ensure_checkpoint,
    phase_floor,
    phase_gateway,
    phase_native,
    serve_native_main,
)
from bench.gpu_e2e.report import headline, latest_figures, render_markdown


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_e2e", description=sys.modules["bench.gpu_e2e"].__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", default="floor,e2e,native,dp", help="comma list of: " + ", ".join(PHASES))
    ap.add_argument("--out", default=None, help="output directory [$OUT, else out/gpu]")
    ap.add_argument("--state", default=str(Path(tempfile.gettempdir()) / "voicegw-gpu-e2e" / "results.json"),
                    help="results merged across calls on one machine ('' = none)")
    ap.add_argument("--fresh", action="store_true", help="ignore an existing state file")
    ap.add_argument("--report-from", nargs="+", metavar="JSON", help="only merge these result files and write the report")
    ap.add_argument("--max-minutes", type=float, default=9.3, help="wall-clock cap of this call")
    ap.add_argument("--phase-minutes", default="", help="per-phase caps, e.g. floor=2.5,native=3")
    g = ap.add_argument_group("model and engine")
    g.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    g.add_argument("--size", default="full", choices=["full", "tiny"], help="random checkpoint size when one is made")
    g.add_argument("--model-dir", default=None, help="checkpoint dir [/tmp/ckfull or /tmp/voicegw-ck-tiny]; made if missing")
    g.add_argument("--dtype", default=None, help="engine.dtype [bfloat16 on GPU, auto on CPU]")
    g.add_argument("--eager", action="store_true", help="GPU: enforce_eager (no CUDA graphs)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="engine.max_num_seqs [GPU 512, CPU 16]")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="[GPU 8192, CPU 2048]")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.80)
    g.add_argument("--async-scheduling", default="true", choices=["true", "false"],
                   help="GPU: engine.async_scheduling (retried without it if the gateway fails to start)")
    g.add_argument("--max-gateway-attempts", type=int, default=3,
                   help="GPU: configurations tried when a gateway fails to start or to warm up: as asked, "
                        "then without async scheduling, then eager")
    g.add_argument("--decoder-max-batch", type=int, default=None, help="engine.decoder_max_batch [GPU 256]")
    g.add_argument("--kv-cache-gib", type=float, default=1.0, help="CPU only")
    g.add_argument("--max-sessions-limit", type=int, default=2048, help="gateway limits.max_sessions")
    g.add_argument("--gateway-arg", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="extra gateway setting (repeatable)")
    g.add_argument("--start-timeout", type=float, default=420.0, help="seconds for a gateway to become healthy")
    g.add_argument("--start-estimate-s", type=float, default=0.0,
                   help="seconds a gateway start is expected to take: a gateway is not started when that "
                        "and its first level do not fit the time left (0: always start)")
    g = ap.add_argument_group("floor")
    g.add_argument("--floor-concurrency", default=None, help="[GPU 1,64,256; CPU 1,4]")
    g.add_argument("--floor-steps", type=int, default=None, help="GPT steps per request [GPU 128, CPU 24]")
    g.add_argument("--floor-max-seconds", type=float, default=60.0, help="cap per burst")
    g.add_argument("--floor-reference", default="", help="also the upstream reference backend at these concurrencies")
    g = ap.add_argument_group("load (e2e and dp)")
    g.add_argument("--sessions", default=None,
                   help="steady levels [GPU 1,10,20,64,128,256,512; CPU 1,4]; N/R: also N sessions connecting "
                        "over R s instead of --ramp (after the others; not counted in the largest real-time level)")
    g.add_argument("--duration", type=float, default=None, help="seconds of load per level [GPU 15, CPU 8]")
    g.add_argument("--settle", type=float, default=None, help="seconds to finish after it [GPU 6, CPU 4]")
    g.add_argument("--ramp", type=float, default=2.0, help="steady: seconds over which sessions connect")
    g.add_argument("--level1-duration", type=float, default=None,
                   help="steady: seconds of load at 1 session (several answers for its TTFA) [30; conversation 40]")
    g.add_argument("--min-audio-ms-per-unit", type=float, default=32.0,
                   help="gateway session.min_audio_ms_per_unit: random-weight checkpoints stop at random; "
                        "this floor (half of typical speech) gives segments of speech-like length. 0: off")
    g.add_argument("--workload", default="conversation", choices=["conversation", "short"],
                   help="conversation (the headline): answers of 120-600 varied characters in 2-6-character "
                        "deltas at --tokens-per-s with +-50%% jitter, 0.5-2 s think time, 100 ms client prebuffer, "
                        "levels of --duration [40] s; short: --utterance-chars answers of stock sentences, "
                        "exponential think time of mean --think, 80 ms prebuffer (loadtest.plan)")
    g.add_argument("--think", type=float, default=1.0, help="short workload: mean pause between turns")
    g.add_argument("--tokens-per-s", type=float, default=None, help="[conversation 30, short 40]")
    g.add_argument("--utterance-chars", type=int, default=160, help="short workload: answer length")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--workers", type=int, default=None, help="load-generator processes [auto]")
    g.add_argument("--warmup-s", type=float, default=None, help="closed-loop warm-up before measuring [GPU 6, CPU 0]")
    g.add_argument("--warmup-sessions", type=int, default=64)
    g.add_argument("--compare-concurrency", default="10,20", help="e2e: closed-loop levels (vs native)")
    g.add_argument("--compare-duration", type=float, default=None, help="[GPU 20, CPU 6]")
    g.add_argument("--throughput-sessions", type=int, default=None,
                   help="closed-loop aggregate throughput level in e2e and dp [GPU 512, CPU 0 = off]")
    g.add_argument("--stop-after-failures", type=int, default=0,
                   help="skip higher steady levels after this many non-real-time ones (0 = never)")
    g.add_argument("--burst-sessions", type=int, default=64, help="burst: newcomers arriving at once")
    g.add_argument("--burst-background", type=int, default=192, help="burst: sessions already playing")
    g.add_argument("--burst-at", type=float, default=6.0, help="burst: seconds after the background starts")
    g.add_argument("--with-burst", action="store_true",
                   help="e2e: run the burst level on the e2e gateway after its steady levels (no second start)")
    g.add_argument("--burst-background-chars", type=int, default=900, help="burst: background answer length")
    g = ap.add_argument_group("native baseline")
    g.add_argument("--native-concurrency", default="10,20")
    g.add_argument("--native-duration", type=float, default=None, help="[GPU 20, CPU 6]")
    g.add_argument("--native-settle", type=float, default=None, help="[GPU 10, CPU 4]")
    g = ap.add_argument_group("data parallelism")
    g.add_argument("--dp", type=int, default=2, help="data_parallel_size of the dp phase")
    g.add_argument("--dp-sessions", default=None,
                   help="steady levels [--sessions from the largest real-time one with one engine upwards; "
                        "+768,1024 if one engine passed all]")
    g = ap.add_argument_group("debugging")
    g.add_argument("--force-numba-shim", action="store_true", help="use the numba shim even if numba imports")
    g.add_argument("--allow-cpu-dp", action="store_true", help="run the dp phase without GPUs (code-path check)")
    g.add_argument("--keep-raw", action="store_true", help="also write every level's raw loadtest JSON (gzip)")
    g.add_argument("--keep-full-logs", action="store_true", help="keep whole server logs, not only their tails")
    return ap


def apply_defaults(args: argparse.Namespace) -> None:
    gpu = args.device != "cpu"

    def d(name: str, g: Any, c: Any) -> None:
        if getattr(args, name) is None:
            setattr(args, name, g if gpu else c)

    d("max_num_seqs", 512, 16)
    d("decoder_max_batch", 256, 0)
    d("max_num_batched_tokens", 8192, 2048)
    d("floor_concurrency", "1,64,256", "1,4")
    d("floor_steps", 128, 24)
    d("sessions", "1,10,20,64,128,256,512", "1,4")
    conv = args.workload == "conversation"
    d("duration", 40.0 if conv else 15.0, 8.0)
    d("settle", 10.0 if conv else 6.0, 4.0)
    if args.tokens_per_s is None:
        args.tokens_per_s = 30.0 if conv else 40.0
    if args.level1_duration is None:
        args.level1_duration = 40.0 if conv else 30.0
    d("warmup_s", 6.0, 0.0)
    d("compare_duration", 20.0, 6.0)
    d("throughput_sessions", 512, 0)
    d("native_duration", 20.0, 6.0)
    d("native_settle", 10.0, 4.0)
    if args.model_dir is None:
        args.model_dir = "/tmp/ckfull" if args.size == "full" else str(Path(tempfile.gettempdir()) / "voicegw-ck-tiny")
    args.model_dir = Path(args.model_dir).expanduser().resolve()
    args.async_scheduling = args.async_scheduling == "true"
    items = [x.strip() for x in str(args.sessions).split(",") if x.strip()]
    args.sessions_list = [int(x) for x in items if "/" not in x]
    args.ramp_levels = [(int(n), float(r)) for n, _, r in (x.partition("/") for x in items if "/" in x)]
    args.compare_list = _ints(args.compare_concurrency)
    args.native_concurrency = _ints(args.native_concurrency)
    args.warmup_sessions = min(args.warmup_sessions, max(args.sessions_list, default=1))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_serve-native":
        return serve_native_main(argv[1:])
    caller_env = {k: os.environ[k] for k in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES") if k in os.environ}
    caller_env |= {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}
    args = build_parser().parse_args(argv)
    out = Path(args.out or os.environ.get("OUT") or "out/gpu").resolve()
    out.mkdir(parents=True, exist_ok=True)
    args.out = out
    if args.report_from:
        merged: dict[str, Any] = {"schema": SCHEMA, "runs": []}
        for path in args.report_from:
            d = json.loads(Path(path).read_text())
            runs = merged["runs"] + [r for r in d.get("runs", []) if r not in merged["runs"]]
            merged.update(d)
            merged["runs"] = runs
        res = Results(out, None, True)
        res.data = merged
        res.save()
        print(render_markdown(merged))
        return 0
    phases = [p for p in args.phases.split(",") if p]
    bad = [p for p in phases if p not in PHASES]
    if bad:
        print(f"unknown phases {bad}; known: {', '.join(PHASES)}", file=sys.stderr)
        return 2
    apply_defaults(args)
    budget = Budget(args.max_minutes)
    args._budget = budget
    phase_caps: dict[str, float] = {}
    for item in filter(None, args.phase_minutes.split(",")):
        k, _, v = item.partition("=")
        phase_caps[k.strip()] = float(v)
    state = Path(args.state) if args.state else None
    state_dir = state.parent if state else Path(tempfile.gettempdir()) / "voicegw-gpu-e2e"
    stale = kill_stale_children(state_dir)
    env_info = prepare_environment(args.force_numba_shim, args.device)
    res = Results(out, state, args.fresh)
    res.data["host"] = host_info()
    run_info: dict[str, Any] = {"date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                "command": "python -m bench.gpu_e2e " + shlex.join(argv), "caller_env": caller_env,
                "phases": phases, "environment": env_info, "stale_children_killed": stale,
                "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                             if not k.startswith("_")}}
    res.data.setdefault("runs", []).append(run_info)
    print(f"gpu_e2e: phases {phases}, device {args.device}, GPUs visible {res.data['host']['gpu_count']}, "
          f"budget {args.max_minutes} min, out {out}", flush=True)
    if env_info.get("numba_shim"):
        print(f"numba shim: {env_info['numba_shim']}", flush=True)
    gpu = GpuSampler().start()
    t_all = time.monotonic()
    try:
        res.save()
        ensure_checkpoint(args, res)
        res.save()
        for phase in phases:
            budget.start_phase(phase_caps.get(phase))
            t = time.monotonic()
            print(f"\n=== phase {phase} ({max(0.0, budget.left()):.0f} s usable) ===", flush=True)
            if budget.left() < 30:
                run_info.setdefault("phases_skipped", []).append(phase)
                print(f"skip phase {phase}: time budget", flush=True)
                continue
            try:
                if phase == "floor":
                    phase_floor(args, res, budget, state_dir)
                elif phase == "e2e":
                    phase_gateway(args, res, budget, state_dir, gpu, "e2e", 1, args.sessions_list,
                                  args.compare_list, args.throughput_sessions or None)
                elif phase == "burst":
                    phase_gateway(args, res, budget, state_dir, gpu, "burst", 1, [], [], None)
                elif phase == "native":
                    phase_native(args, res, budget, state_dir, gpu)
                elif phase == "dp":
                    n_gpu = res.data["host"]["gpu_count"]
                    if args.dp < 2 or (n_gpu < args.dp and not args.allow_cpu_dp):
                        res.data["dp"] = {"data_parallel_size": args.dp,
                                          "error": f"needs {args.dp} >= 2 GPUs; {n_gpu} visible (device {args.device})"}
                        print(f"skip phase dp: {res.data['dp']['error']}", flush=True)
                    else:
                        levels = dp_levels(args, res.data.get("e2e"))
                        print(f"dp levels: {levels}", flush=True)
                        phase_gateway(args, res, budget, state_dir, gpu, "dp", args.dp, levels, [],
                                      args.throughput_sessions or None)
            except Exception as exc:  # noqa: BLE001 - keep the other phases and the results
                import traceback

                run_info.setdefault("phase_errors", {})[phase] = traceback.format_exc()[-3000:]
                print(f"phase {phase} failed: {exc!r}", flush=True)
            run_info.setdefault("phase_seconds", {})[phase] = round(time.monotonic() - t, 1)
            res.save()
    finally:
        gpu.stop()
        run_info["total_seconds"] = round(time.monotonic() - t_all, 1)
        if res.data.get("e2e"):
            res.data["headline"] = hl = headline(res.data)
            _write_run_file(args, res.data, run_info, hl)
        res.save()
    md = render_markdown(res.data)
    print("\n" + md)
    print(f"wrote {out / 'gpu_e2e.json'} and {out / 'gpu_e2e.md'}", flush=True)
    return 0


def _write_run_file(args: argparse.Namespace, data: dict[str, Any], run_info: dict[str, Any],
                    hl: dict[str, Any]) -> None:
    """The run as data (``bench.results`` schema) in the output directory, beside gpu_e2e.json:
    copy it to bench/results/runs/ to make it count for gpu-latest.json."""
    from bench.results import write_run

    gpus = (data.get("host") or {}).get("gpus") or []
    device = gpus[0]["name"] if gpus else f"{os.cpu_count()}-core CPU"
    try:
        path = write_run(args.out, command=run_info["command"], device=device, figures=latest_figures(hl),
                         detail={"headline": hl}, slug=f"gpu-e2e-{args.workload}")
    except ValueError as exc:  # no git checkout (a copied tree): the run file needs its commit
        print(f"no run file written: {exc}", flush=True)
        return
    print(f"run file: {path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())

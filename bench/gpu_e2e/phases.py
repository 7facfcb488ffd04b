"""The phases: ``floor`` (engine alone), ``e2e``/``burst`` (the gateway), ``native`` (upstream ChatTTS behind the gateway), ``dp``."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.gpu_e2e.host import (
    REPO_ROOT,
    Budget,
    GpuSampler,
    Results,
    _ints,
    _kill_group,
    _note_child,
    _pdeathsig,
    free_port,
    grep_log,
    query_gpus,
    tail_text,
)
from bench.gpu_e2e.levels import Gateway, decoder_jobs, gateway_cmd, level_estimate_s, run_level
from bench.gpu_e2e.report import max_realtime


def _has_upstream() -> bool:
    """``make_checkpoint`` needs upstream ChatTTS (and its vector-quantize, vocos) importable."""
    code = "import ChatTTS.model.dvae, vocos"
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, check=False).returncode == 0


def ensure_checkpoint(args: argparse.Namespace, res: Results) -> None:
    model_dir = Path(args.model_dir)
    t = time.monotonic()
    code = ("import sys; from engine.checkpoint import make_checkpoint, missing_files; from pathlib import Path; "
            "p = Path(sys.argv[1]); m = missing_files(p); "
            "print('reuse' if not m else 'made'); "
            "m and make_checkpoint(p, sys.argv[2], seed=0)") if _has_upstream() else (
            "import sys; from engine._compat import ensure_torch_companions; ensure_torch_companions(); "
            "from engine.checkpoint import make_gpt_checkpoint, make_decoder_assets, missing_files; "
            "from pathlib import Path; p = Path(sys.argv[1]); m = missing_files(p); "
            "print('reuse' if not m else 'made without upstream'); "
            "m and (make_gpt_checkpoint(p, sys.argv[2], seed=0), make_decoder_assets(p, sys.argv[2], seed=0))")
    proc = subprocess.run([sys.executable, "-c", code, str(model_dir), args.size], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=max(60.0, res_budget_left(args)), check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"checkpoint {model_dir}: {proc.stderr[-2000:]}")
    how = (proc.stdout.strip().splitlines() or ["?"])[0]
    res.data["checkpoint"] = {"dir": str(model_dir), "size": args.size, "how": how,
                              "seconds": round(time.monotonic() - t, 1)}
    print(f"checkpoint {model_dir} ({args.size}): {how} in {time.monotonic() - t:.0f} s", flush=True)


def res_budget_left(args: argparse.Namespace) -> float:
    b: Budget = args._budget
    return max(30.0, b.deadline - time.monotonic())


_ROW_RX = re.compile(r"^(vllm|reference)\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\d+)\s*$")


def parse_engine_bench(text: str) -> dict[str, Any]:
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    starts: dict[str, float] = {}
    for line in text.splitlines():
        m = _ROW_RX.match(line.strip())
        if m:
            def num(s: str) -> float | None:
                try:
                    v = float(s)
                except ValueError:
                    return None
                return None if math.isnan(v) else v

            b, c = m.group(1), int(m.group(2))
            rows[(b, c)] = {"backend": b, "concurrency": c, "ttft_p50_ms": num(m.group(3)),
                            "ttft_p99_ms": num(m.group(4)), "steps_per_s_per_stream": num(m.group(5)),
                            "x_realtime_per_stream": num(m.group(6)), "aggregate_steps_per_s": num(m.group(7)),
                            "unfinished": int(m.group(8))}
        sm = re.match(r"^(vllm|reference): started in ([\d.]+) s", line.strip())
        if sm:
            starts[sm.group(1)] = float(sm.group(2))
    return {"rows": sorted(rows.values(), key=lambda r: (r["backend"], r["concurrency"])), "start_s": starts}


def run_engine_bench(args: argparse.Namespace, backend: str, concurrency: str, budget: Budget,
                     log_path: Path, state_dir: Path, *, compile_: bool) -> dict[str, Any]:
    gpu = args.device != "cpu"
    cmd = [sys.executable, "-m", "bench.engine_bench", "--model-dir", str(args.model_dir), "--size", args.size,
           "--backends", backend, "--concurrency", concurrency, "--steps", str(args.floor_steps),
           "--max-seconds", str(args.floor_max_seconds), "--device", args.device,
           "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if compile_:
        cmd.append("--compile")
    if not gpu:
        cmd += ["--kv-gib", str(args.kv_cache_gib)]
    timeout = max(10.0, budget.left())
    print(f"floor ({backend}): {shlex.join(cmd[1:])} [timeout {timeout:.0f} s]", flush=True)
    t = time.monotonic()
    timed_out = False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=dict(os.environ),
                                start_new_session=True, preexec_fn=_pdeathsig)
        _note_child(state_dir, proc.pid, True)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(proc, 20.0)
            _note_child(state_dir, proc.pid, False)
    text = log_path.read_text(errors="replace")
    parsed = parse_engine_bench(text)
    if not args.keep_full_logs:
        log_path.write_text(tail_text(log_path, 120) + "\n")
    out = {"backend": backend, "compiled": compile_, "command": "python " + shlex.join(cmd[1:]),
           "returncode": proc.returncode,
           "timed_out": timed_out, "wall_s": round(time.monotonic() - t, 1), **parsed}
    if proc.returncode not in (0, None) or not parsed["rows"]:
        out["log_tail"] = tail_text(log_path, 30)
    for r in parsed["rows"]:
        print(f"  {r['backend']} c={r['concurrency']}: TTFT p50 {r['ttft_p50_ms']} ms p99 {r['ttft_p99_ms']} ms, "
              f"{r['steps_per_s_per_stream']} steps/s/stream (x{r['x_realtime_per_stream']}), "
              f"aggregate {r['aggregate_steps_per_s']} steps/s", flush=True)
    return out


def phase_floor(args: argparse.Namespace, res: Results, budget: Budget, state_dir: Path) -> None:
    floor: dict[str, Any] = {"steps": args.floor_steps, "concurrency": args.floor_concurrency,
                             "max_num_batched_tokens": args.max_num_batched_tokens,
                             "cuda_graphs": args.device != "cpu" and not args.eager, "runs": []}
    res.data["floor"] = floor
    run = run_engine_bench(args, "vllm", args.floor_concurrency, budget, args.out / "floor-vllm.log", state_dir,
                           compile_=args.device != "cpu" and not args.eager)
    floor["runs"].append(run)
    res.save()
    wait_gpu_released(GpuSampler())
    if run["compiled"] and not run["rows"] and budget.fits(120):
        print("floor: the compiled engine produced no results; again in eager mode", flush=True)
        floor["compiled_failed"] = True
        floor["runs"].append(run_engine_bench(args, "vllm", args.floor_concurrency, budget,
                                              args.out / "floor-vllm-eager.log", state_dir, compile_=False))
        res.save()
        wait_gpu_released(GpuSampler())
    if args.floor_reference:
        if budget.fits(60):
            floor["runs"].append(run_engine_bench(args, "reference", args.floor_reference, budget,
                                                  args.out / "floor-reference.log", state_dir, compile_=False))
        else:
            floor["skipped_reference"] = "time budget"
        res.save()


def gateway_attempts(args: argparse.Namespace) -> list[tuple[bool, bool]]:
    """(enforce_eager, async_scheduling) to try in order: as asked, then without async
    scheduling, then eager (the configuration measured to work on the H200 before)."""
    if args.device == "cpu":
        return [(True, False)]
    out = [(args.eager, args.async_scheduling)]
    if args.async_scheduling:
        out.append((args.eager, False))
    if not args.eager:
        out.append((True, False))
    return out[: max(1, args.max_gateway_attempts)]


def _start_gateway(args: argparse.Namespace, budget: Budget, dp: int, name: str, state_dir: Path,
                   info: dict[str, Any], gpu: GpuSampler, attempt: int, eager: bool,
                   async_sched: bool) -> Gateway | None:
    """Start the vLLM gateway with these engine settings; None when it does not become healthy."""
    port = free_port()
    cmd = gateway_cmd(args, port, dp, async_sched, eager)
    log = args.out / f"gateway-{name}{'' if attempt == 0 else f'-attempt{attempt + 1}'}.log"
    info["command"] = "python " + shlex.join(cmd[1:])
    info["async_scheduling"] = async_sched if args.device != "cpu" else None
    info["cuda_graphs"] = (not eager) if args.device != "cpu" else None
    timeout = min(args.start_timeout, budget.left())
    if timeout < 30:
        info["error"] = "no time left to start the gateway"
        return None
    first_level_s = level_estimate_s(args.duration, args.settle, 1)
    if args.start_estimate_s and not budget.fits(args.start_estimate_s + first_level_s):
        info["error"] = (f"not started: a start (~{args.start_estimate_s:.0f} s) and one level (~{first_level_s:.0f} s) "
                         f"do not fit the {max(0.0, budget.left()):.0f} s left")
        print(f"gateway ({name}): {info['error']}", flush=True)
        return None
    wait_gpu_released(gpu)
    print(f"gateway ({name}): starting [timeout {timeout:.0f} s]\n  {info['command']}", flush=True)
    gw = Gateway(cmd, port, log, state_dir)
    try:
        gw.start(timeout)
    except (RuntimeError, TimeoutError) as exc:
        why, _, tail = str(exc).partition("\n")
        info.setdefault("attempt_failures", []).append(
            {"cuda_graphs": not eager, "async_scheduling": async_sched, "stage": "start", "error": why,
             "log_tail": tail[-3000:]})
        print(f"gateway ({name}) failed to start: {why}\n{tail[-1500:]}", flush=True)
        _gateway_log_facts(log, info)
        if isinstance(exc, TimeoutError):  # slow, not faulty: other engine settings would not start sooner
            info["error"] = why
        return None
    info["start_s"] = round(gw.start_s or 0.0, 1)
    info["healthz"] = gw.health
    info["log"] = str(log)
    print(f"gateway ({name}) healthy in {info['start_s']} s: {gw.health}", flush=True)
    return gw


def _gateway_log_facts(log: Path, info: dict[str, Any]) -> None:
    info["log_facts"] = {
        "dropped_engine_args": grep_log(log, r"lacks engine args"),
        "async_scheduling_lines": grep_log(log, r"(?i)async[ _-]?sched"),
        "engine_ready": grep_log(log, r"code engine ready in"),
        "decoder_warm_up": grep_log(log, r"decoder process \d+: warmed up in", 4),
        "resolved_settings": grep_log(log, r"ChatTTS on vLLM on CUDA:|start phases:", 4),
        "cuda_mps": grep_log(log, r"CUDA MPS", 4),
        "cudagraph_lines": grep_log(log, r"(?i)cuda ?graph", 4),
        "data_parallel_lines": grep_log(log, r"(?i)^(?!.*Initializing a V1).*(DP rank|DPLB|coordinator|data.parallel)", 6),
        "errors": grep_log(log, r"(?i)traceback|\bERROR\b|engine died|EngineDead", 12),
    }
    tail = args_out_tail(log)
    if tail is not None:
        info["log_tail_file"] = str(tail)
    with contextlib.suppress(OSError):  # the once-a-second ``load`` lines (gateway.monitor)
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if " load sessions=" in ln]
        if lines:
            log.with_suffix(".load.txt").write_text("\n".join(lines) + "\n")
            info["load_lines_file"] = str(log.with_suffix(".load.txt"))
            for row in info.get("levels", []):  # the decoder's share of each level
                if row.get("mono_s"):
                    row.update(decoder_jobs(lines, *row["mono_s"]))


def args_out_tail(log: Path, lines: int = 150) -> Path | None:
    """Keep only the tail of a server log (small files come back from the device)."""
    if not log.exists():
        return None
    tail = log.with_suffix(".tail.log")
    tail.write_text(tail_text(log, lines) + "\n")
    return tail


def _drive_gateway(args: argparse.Namespace, res: Results, budget: Budget, gw: Gateway, key: str,
                   steady_levels: list[int], gpu: GpuSampler, info: dict[str, Any], *,
                   compare: list[int], throughput: int | None) -> None:
    rows: list[dict[str, Any]] = info.setdefault("levels", [])
    raw_dir = args.out / "raw" if args.keep_raw else None
    skipped: list[str] = info.setdefault("skipped", [])
    plan: list[tuple[str, int, float, float, float | None]] = [
        ("steady", n, max(args.duration, args.level1_duration) if n == 1 else args.duration, args.settle, None)
        for n in steady_levels]
    if key == "e2e":
        plan += [("steady", n, args.duration, args.settle, r) for n, r in args.ramp_levels]
        if args.with_burst:
            plan.append(("burst", args.burst_sessions, args.duration, args.settle, None))
    plan += [("closed-loop", n, args.compare_duration, args.settle, None) for n in compare]
    if key == "burst":
        plan = [("burst", args.burst_sessions, args.duration, args.settle, None)]
    if throughput:
        # dp phase: the aggregate-throughput run first (the capacity ratio needs it most)
        t_level = ("closed-loop", throughput, args.duration, args.settle, None)
        plan = [t_level, *plan] if key == "dp" else [*plan, t_level]
    seen_fail = 0
    for scenario, n, dur, settle, ramp in plan:
        name = f"{key}-{ {'steady': 'steady', 'burst': 'burst'}.get(scenario, 'closed')}-{n}"
        if ramp is not None:
            name += f"-ramp{ramp:g}"
        if not gw.alive():
            skipped.append(f"{name} (gateway died)")
            continue
        if scenario == "steady" and ramp is None and args.stop_after_failures and seen_fail >= args.stop_after_failures:
            skipped.append(f"{name} (already {seen_fail} non-real-time levels below)")
            continue
        est = level_estimate_s(dur, settle, n)
        if not budget.fits(est):
            skipped.append(f"{name} (time budget: needs ~{est:.0f} s, {max(0.0, budget.left()):.0f} s left)")
            print(f"  skip {name}: time budget", flush=True)
            continue
        print(f"{key}: {scenario} {n} sessions, {dur:.0f} s", flush=True)
        try:
            row = run_level(gw.url, scenario, n, args, duration_s=dur, settle_s=settle, gw=gw, gpu=gpu,
                            raw_dir=raw_dir, name=name, ramp_s=ramp)
        except Exception as exc:  # noqa: BLE001 - one broken level must not lose the others
            row = {"name": name, "scenario": scenario, "sessions": n, "failed": repr(exc)[:500], "realtime": False}
            print(f"  {name} failed: {exc!r}", flush=True)
        if ramp is not None:
            row["ramp_level"] = True
        rows.append(row)
        if scenario == "steady" and ramp is None and not row.get("realtime"):
            seen_fail += 1
        info["summary"] = max_realtime([r for r in rows if "failed" not in r])
        res.save()
    info["summary"] = max_realtime([r for r in rows if "failed" not in r])


def _warm_up(args: argparse.Namespace, budget: Budget, gw: Gateway, key: str, gpu: GpuSampler,
             info: dict[str, Any]) -> str | None:
    """Closed-loop warm-up (first-use costs of batch shapes off the clock); returns why the engine
    is not usable (errors, no audio, gateway died) or None."""
    if args.warmup_s <= 0 or not budget.fits(level_estimate_s(args.warmup_s, 2.0, args.warmup_sessions)):
        return None
    print(f"{key}: warm-up, closed loop, {args.warmup_sessions} sessions, {args.warmup_s:.0f} s", flush=True)
    w = run_level(gw.url, "closed-loop", args.warmup_sessions, args, duration_s=args.warmup_s, settle_s=2.0,
                  gw=gw, gpu=gpu, raw_dir=None, name=f"{key}-warmup")
    info["warmup"] = {k: w.get(k) for k in ("sessions", "completed", "n_errors", "errors", "ttfa_ms",
                                            "aggregate_x_realtime", "sessions_no_audio")}
    if not gw.alive():
        return "gateway died during the warm-up"
    if w["n_errors"] or w["sessions_no_audio"] == w["sessions"]:
        return f"warm-up: {w['n_errors']} errors {w['errors']}, {w['sessions_no_audio']} sessions without audio"
    return None


def phase_gateway(args: argparse.Namespace, res: Results, budget: Budget, state_dir: Path, gpu: GpuSampler,
                  key: str, dp: int, levels: list[int], compare: list[int], throughput: int | None) -> None:
    info: dict[str, Any] = {"data_parallel_size": dp, "steady": {"duration_s": args.duration, "settle_s": args.settle,
                                                                  "think_s": args.think, "ramp_s": args.ramp,
                                                                  "tokens_per_s": args.tokens_per_s,
                                                                  "utterance_chars": args.utterance_chars,
                                                                  "workload": args.workload}}
    res.data[key] = info
    res.save()
    gw: Gateway | None = None
    for attempt, (eager, async_sched) in enumerate(gateway_attempts(args)):
        gw = _start_gateway(args, budget, dp, key, state_dir, info, gpu, attempt, eager, async_sched)
        if gw is None:
            res.save()
            if info.get("error"):
                break
            continue
        gpu.sample()
        info["gpu_after_start"] = query_gpus()
        problem = _warm_up(args, budget, gw, key, gpu, info)
        if problem is None:
            break
        print(f"gateway ({key}) unusable: {problem}", flush=True)
        info.setdefault("attempt_failures", []).append(
            {"cuda_graphs": not eager, "async_scheduling": async_sched, "stage": "warm-up", "error": problem})
        gw.stop()
        _gateway_log_facts(gw.log_path, info)
        gw = None
        res.save()
    if gw is None:
        info["error"] = info.get("error") or "no gateway configuration started and passed the warm-up"
        res.save()
        return
    try:
        _drive_gateway(args, res, budget, gw, key, levels, gpu, info, compare=compare, throughput=throughput)
    finally:
        info["gateway_alive_at_end"] = gw.alive()
        gw.stop()
        _gateway_log_facts(gw.log_path, info)
        if not args.keep_full_logs:
            for f in args.out.glob(f"gateway-{key}*.log"):
                if not f.name.endswith(".tail.log"):
                    with contextlib.suppress(OSError):
                        f.unlink()
        res.save()
        wait_gpu_released(gpu)


def wait_gpu_released(gpu: GpuSampler, timeout_s: float = 30.0, below_mib: float = 4096.0) -> None:
    if not gpu.enabled:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        gpus = query_gpus()
        if all(g["memory_used_mib"] < below_mib for g in gpus):
            return
        time.sleep(1.0)


def phase_native(args: argparse.Namespace, res: Results, budget: Budget, state_dir: Path, gpu: GpuSampler) -> None:
    info: dict[str, Any] = {"engine": "upstream ChatTTS Chat.infer(stream=True), one request at a time",
                            "device": args.device, "duration_s": args.native_duration, "levels": []}
    res.data["native"] = info
    port = free_port()
    cmd = [sys.executable, "-m", "bench.gpu_e2e", "_serve-native", "--model-dir", str(args.model_dir),
           "--device", args.device, "--port", str(port), "--max-sessions", str(args.max_sessions_limit)]
    info["command"] = "python " + shlex.join(cmd[1:])
    log = args.out / "gateway-native.log"
    timeout = min(args.start_timeout, budget.left())
    if timeout < 30:
        info["error"] = "no time left"
        res.save()
        return
    print(f"native: starting [timeout {timeout:.0f} s]\n  {info['command']}", flush=True)
    gw = Gateway(cmd, port, log, state_dir)
    try:
        gw.start(timeout)
    except (RuntimeError, TimeoutError) as exc:
        info["error"] = str(exc)[-3000:]
        print(f"native gateway failed: {exc}", flush=True)
        args_out_tail(log)
        res.save()
        return
    info["start_s"] = round(gw.start_s or 0.0, 1)
    try:
        for n in args.native_concurrency:
            name = f"native-closed-{n}"
            est = level_estimate_s(args.native_duration, args.native_settle, n)
            if not budget.fits(est):
                info.setdefault("skipped", []).append(f"{name} (time budget)")
                continue
            print(f"native: closed loop {n} sessions, {args.native_duration:.0f} s", flush=True)
            try:
                row = run_level(gw.url, "closed-loop", n, args, duration_s=args.native_duration,
                                settle_s=args.native_settle, gw=gw, gpu=gpu,
                                raw_dir=args.out / "raw" if args.keep_raw else None, name=name)
            except Exception as exc:  # noqa: BLE001
                row = {"name": name, "scenario": "closed-loop", "sessions": n, "failed": repr(exc)[:500]}
            info["levels"].append(row)
            res.save()
    finally:
        gw.stop()
        info["log_facts"] = {"errors": grep_log(log, r"(?i)traceback|\bERROR\b", 12)}
        args_out_tail(log)
        if not args.keep_full_logs:
            with contextlib.suppress(OSError):
                log.unlink()
        res.save()
        wait_gpu_released(gpu)


# ---------------------------------------------------------------------------------- native child


def serve_native_main(argv: Sequence[str]) -> int:
    """Child: the gateway with ``NativePipelineSpeech`` on ``--device`` (``loadtest.serve``'s native
    engine always runs on CPU), FCFS priorities, healthy once warmed up."""
    p = argparse.ArgumentParser(prog="python -m bench.gpu_e2e _serve-native")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-sessions", type=int, default=2048)
    a = p.parse_args(argv)
    import asyncio
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("chattts").setLevel(logging.WARNING)

    async def main() -> None:
        from engine._compat import ensure_torch_companions

        ensure_torch_companions()  # before anything imports transformers, vocos or chattts
        from engine.api import SamplingParams, SpeechRequest
        from gateway.app import serve
        from loadtest.baseline import NativePipelineSpeech
        from voicegw.config import load_config

        cfg = load_config(env={}, overrides={"gateway.host": "127.0.0.1", "gateway.port": a.port,
                                             "engine.model_dir": a.model_dir,
                                             "limits.max_sessions": a.max_sessions,
                                             "gateway.shutdown_grace_s": 1.0})
        eng = NativePipelineSpeech(a.model_dir, default_speaker=cfg.engine.default_speaker, device=a.device)
        await eng.start()
        t = time.monotonic()
        warm = SpeechRequest(f"warmup-{time.monotonic_ns()}", "warm up.", speaker=None,
                             params=SamplingParams(max_new_tokens=80, min_new_tokens=1))
        async for _ in eng.synthesize(warm):
            pass
        logging.getLogger("voicegw").warning("native pipeline warmed up in %.1f s", time.monotonic() - t)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)

        try:
            await serve(cfg, eng, stop=stop)
        finally:
            await eng.close()

    asyncio.run(main())
    return 0


# ---------------------------------------------------------------------------------- markdown



def dp_levels(args: argparse.Namespace, e2e: dict[str, Any] | None) -> list[int]:
    """``--dp-sessions``, else the ``--sessions`` levels from the largest that was real time with
    one engine (state of the e2e phase) upwards, plus 768 and 1024 when one engine passed them all."""
    if args.dp_sessions:
        return _ints(args.dp_sessions)
    base = sorted(args.sessions_list)
    summ = (e2e or {}).get("summary") or {}
    best = int(summ.get("max_realtime_sessions") or 0)
    levels = [n for n in base if n >= best] if best else base
    if summ and summ.get("first_failing_sessions") is None and args.device != "cpu":
        levels += [n for n in (768, 1024) if n > max(base, default=0)]
    return levels or base

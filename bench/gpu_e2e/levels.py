"""One gateway process and one load level against it (``loadtest`` over loopback): TTFA, real-time factor, underruns."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from bench.gpu_e2e.host import (
    LEVEL_OVERHEAD_S,
    REPO_ROOT,
    GpuSampler,
    _kill_group,
    _note_child,
    _pdeathsig,
    tail_text,
)

#: GPT steps per second of audio (ChatTTS: one step = 512 samples at 24 kHz).
STEPS_PER_AUDIO_S = 24_000 / 512


class Gateway:
    """``python -m voicegw.cli serve`` (or the native-baseline child of this script) on 127.0.0.1,
    in its own process group; ready when ``/healthz`` says healthy."""

    def __init__(self, cmd: list[str], port: int, log_path: Path, state_dir: Path) -> None:
        self.cmd = cmd
        self.port = port
        self.log_path = log_path
        self.state_dir = state_dir
        self.proc: subprocess.Popen[Any] | None = None
        self.start_s: float | None = None
        self.health: dict[str, Any] = {}
        self.rss: Any = None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    def start(self, timeout_s: float) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")  # noqa: SIM115 - the child holds it; closed below
        t0 = time.monotonic()
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=REPO_ROOT, env=dict(os.environ), start_new_session=True,
                                         preexec_fn=_pdeathsig)
        finally:
            log.close()
        _note_child(self.state_dir, self.proc.pid, True)
        deadline = t0 + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode} before it was healthy:\n"
                                   + tail_text(self.log_path, 25))
            body = self.healthz()
            if body.get("healthy"):
                self.health = body
                break
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"gateway not healthy after {timeout_s:.0f} s:\n" + tail_text(self.log_path, 25))
            time.sleep(1.0)
        self.start_s = time.monotonic() - t0
        from loadtest.procmem import RssSampler

        self.rss = RssSampler(self.proc.pid).start()

    def healthz(self) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=3) as r:
                return dict(json.loads(r.read()))
        except urllib.error.HTTPError as exc:  # 503 while starting/draining carries the body too
            try:
                return dict(json.loads(exc.read()))
            except ValueError:
                return {}
        except (OSError, ValueError):
            return {}

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.rss is not None:
            self.rss.stop()
        if self.proc is not None:
            _kill_group(self.proc, 30.0)
            _note_child(self.state_dir, self.proc.pid, False)


def gateway_cmd(args: argparse.Namespace, port: int, dp: int, async_sched: bool, eager: bool) -> list[str]:
    gpu = args.device != "cpu"
    s: dict[str, Any] = {
        "gateway.host": "127.0.0.1",
        "gateway.port": port,
        "gateway.log_level": "INFO",
        "gateway.load_log_interval_s": 1.0,
        # random weights stop at random: a floor of half of typical speech gives speech-like segments
        "session.min_audio_ms_per_unit": args.min_audio_ms_per_unit,
        "engine.backend": "vllm",
        "engine.model_dir": str(args.model_dir),
        "engine.device": args.device,
        "engine.dtype": args.dtype or ("bfloat16" if gpu else "auto"),
        "engine.enforce_eager": "true" if eager or not gpu else "false",
        "engine.max_num_seqs": args.max_num_seqs,
        "engine.max_num_batched_tokens": args.max_num_batched_tokens,
        "engine.data_parallel_size": dp,
        "limits.max_sessions": args.max_sessions_limit,
    }
    if gpu:
        s["engine.gpu_memory_utilization"] = args.gpu_memory_utilization
        s["engine.async_scheduling"] = "true" if async_sched else "false"
        if args.decoder_max_batch:
            s["engine.decoder_max_batch"] = args.decoder_max_batch
    else:
        s["engine.kv_cache_gib"] = args.kv_cache_gib
    if gpu:  # what the product does by itself on a CUDA GPU is left to it (voicegw.config.GPU_DEFAULTS)
        from voicegw.config import GPU_DEFAULTS

        for k, v in GPU_DEFAULTS.items():
            if k in s and str(s[k]).lower() == str(v).lower():
                del s[k]
    for item in args.gateway_arg:
        k, sep, v = item.partition("=")
        if not sep or "." not in k:
            raise SystemExit(f"--gateway-arg {item!r}: expected SECTION.FIELD=VALUE")
        s[k] = v
    cmd = [sys.executable, "-m", "voicegw.cli", "serve"]
    for k, v in s.items():
        cmd += [f"--{k}", str(v)]
    return cmd


# ---------------------------------------------------------------------------------- load levels


def level_estimate_s(duration_s: float, settle_s: float, sessions: int) -> float:
    workers = max(1, min(os.cpu_count() or 1, -(-sessions // 64)))
    return duration_s + settle_s + 2.0 + 0.25 * workers + LEVEL_OVERHEAD_S


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return round(s[lo] + (s[hi] - s[lo]) * (k - lo), 3)


def stream_stats(sessions: list[dict[str, Any]], sample_rate_hz: int, min_audio_s: float = 1.0) -> dict[str, Any]:
    """Per answer: audio seconds received / (last audio - first audio); aggregate audio per wall
    second; sessions that got no audio; censored waits of answers that never got audio."""
    rtf: list[float] = []
    samples = 0
    firsts: list[float] = []
    lasts: list[float] = []
    no_audio_waits: list[float] = []
    sessions_no_audio = 0
    for s in sessions:
        got = False
        for u in s.get("utterances", []):
            samples += int(u.get("samples") or 0)
            fa, la, ft = u.get("t_first_audio"), u.get("t_last_audio"), u.get("t_first_text")
            if ft is not None:
                firsts.append(ft)
            if fa is not None:
                got = True
            if la is not None:
                lasts.append(la)
            audio_s = (u.get("samples") or 0) / sample_rate_hz
            if fa is not None and la is not None and la > fa and audio_s >= min_audio_s:
                rtf.append(audio_s / (la - fa))
            if ft is not None and fa is None:
                end = s.get("t_closed") or u.get("t_done")
                if end is not None:
                    no_audio_waits.append((end - ft) * 1000.0)
        if not got:
            sessions_no_audio += 1
    span = (max(lasts) - min(firsts)) if firsts and lasts and max(lasts) > min(firsts) else None
    audio_s = samples / sample_rate_hz
    return {
        "answers_measured": len(rtf),
        "rtf_p50": _pct(rtf, 50),
        "rtf_p5": _pct(rtf, 5),
        "rtf_min": round(min(rtf), 3) if rtf else None,
        "audio_s": round(audio_s, 2),
        "aggregate_x_realtime": round(audio_s / span, 2) if span else None,
        "sessions_no_audio": sessions_no_audio,
        "answers_no_audio": len(no_audio_waits),
        "no_audio_wait_min_ms": round(min(no_audio_waits)) if no_audio_waits else None,
    }


def run_level(url: str, scenario: str, sessions: int, args: argparse.Namespace, *, duration_s: float,
              settle_s: float, gw: Gateway | None, gpu: GpuSampler, raw_dir: Path | None,
              name: str, ramp_s: float | None = None) -> dict[str, Any]:
    from loadtest.plan import MAX_SESSIONS, ScenarioParams
    from loadtest.runner import run_scenario

    sessions = min(sessions, MAX_SESSIONS)
    params = ScenarioParams(
        scenario=scenario, sessions=sessions, duration_s=duration_s, settle_s=settle_s,
        ramp_s=ramp_s if ramp_s is not None else args.ramp if scenario != "closed-loop" else min(args.ramp, 1.0),
        think_s=args.think, tokens_per_s=args.tokens_per_s, utterance_chars=args.utterance_chars,
        seed=args.seed, instant_playback=True, workload=args.workload,
        **({"background": args.burst_background, "burst_at_s": args.burst_at,
            "background_chars": args.burst_background_chars} if scenario == "burst" else {}),
    )
    gpu.reset()
    gpu.sample()
    if gw is not None and gw.rss is not None:
        gw.rss.sample()
        gw.rss.reset_peak()
    t = time.monotonic()
    result = run_scenario(params, url, args.workers)
    t_end = time.monotonic()
    wall = t_end - t
    gpu.sample()
    g = result["metrics"]["all"]
    errors = dict(g["errors"])
    n_err = sum(errors.values()) + g["timed_out"]
    st = stream_stats(result["sessions"], params.sample_rate_hz)
    row: dict[str, Any] = {
        "name": name,
        "scenario": scenario,
        "sessions": sessions,
        "ramp_s": params.ramp_s,
        "duration_s": duration_s,
        "wall_s": round(wall, 1),
        "mono_s": [round(t, 3), round(t_end, 3)],
        "utterances": g["utterances"],
        "completed": g["completed"],
        "cut_at_end": g["cut_at_end"],
        "timed_out": g["timed_out"],
        "errors": errors,
        "n_errors": n_err,
        "missing_sessions": len(result["missing_sessions"]),
        "workers_killed": result["workers_killed"],
        "ttfa_ms": g["ttfa_ms"],
        "ttfa_segment_ms": g["ttfa_segment_ms"],
        "total_ms": g["total_ms"],
        "underruns": g["underruns"],
        "underruns_text_starved": g.get("underruns_text_starved"),
        "underrun_ms": g["underrun_ms"],
        "sessions_with_underruns": g["sessions_with_underruns"],
        "segment_gaps_heard": g["segment_gaps_heard"],
        "qps": g["qps"],
        "shared_underruns": result["metrics"].get("shared_underruns"),
        "client_stalls": result["metrics"].get("client_stalls") or {},
        "server_breakdown": result.get("server_breakdown") or {},
        "roles": {k: {m: v.get(m) for m in ("ttfa_ms", "ttfa_segment_ms", "underruns", "underrun_ms", "underruns_since",
                                           "underrun_ms_since", "sessions_with_underruns", "utterances", "completed")}
                  for k, v in (result["metrics"].get("roles") or {}).items()},
        **st,
        "workload": args.workload,
        # one GPT step is 512 samples at 24 kHz: audio delivered per wall second, in GPT steps
        "delivered_steps_per_s": (round(st["aggregate_x_realtime"] * STEPS_PER_AUDIO_S)
                                  if st["aggregate_x_realtime"] else None),
        "gpu": gpu.snapshot(),
        "server_rss_peak_mib": round(gw.rss.peak_bytes / 2**20, 1) if gw is not None and gw.rss else None,
        "gateway_alive": gw.alive() if gw is not None else None,
    }
    row["realtime"] = bool(
        scenario != "closed-loop" and row["underruns"] == 0 and n_err == 0 and row["missing_sessions"] == 0
        and st["sessions_no_audio"] == 0 and (g["ttfa_ms"].get("n") or 0) > 0
    )
    if raw_dir is not None:
        import gzip

        raw_dir.mkdir(parents=True, exist_ok=True)
        with gzip.open(raw_dir / f"{name}.json.gz", "wt") as f:
            json.dump(result, f, default=str)
    t50, t99 = g["ttfa_ms"].get("p50"), g["ttfa_ms"].get("p99")
    print(f"  {name}: TTFA p50 {t50} p99 {t99} ms, rtf p50 {st['rtf_p50']} p5 {st['rtf_p5']}, underruns "
          f"{row['underruns']}, errors {n_err}, no-audio sessions {st['sessions_no_audio']}"
          + (f", real time: {row['realtime']}" if scenario != "closed-loop" else
             f", QPS {row['qps']}, aggregate x{st['aggregate_x_realtime']}"), flush=True)
    return row


_LOAD_FIELD = re.compile(
    r"\b(steps_per_s|decode_jobs_per_s|decoder_busy|decoder_mean_batch|decoder_padding|mono)=([\d.]+)")


def decoder_jobs(load_lines: list[str], t0: float, t1: float) -> dict[str, float | None]:
    """From the gateway processes' once-a-second ``load`` lines (``gateway.monitor``; ``mono`` is
    the host's monotonic clock, which the bench reads too) between ``t0`` and ``t1``: decoder jobs
    (pushes, ``decode_jobs``) per second and GPT steps per job, all processes together. A job is
    one decoder row per ``chunk_steps`` or fewer steps, each row a whole window whatever its size:
    few steps per job is the decoder taking GPU time from the GPT. Also the decoder process's own
    figures (``decoder_busy``: share of the time in forwards, ``decoder_mean_batch``,
    ``decoder_padding``: share of computed rows that only filled a bucket), which every process
    reports alike: their mean over the lines."""
    steps = jobs = 0.0
    own: dict[str, list[float]] = {"decoder_busy": [], "decoder_mean_batch": [], "decoder_padding": []}
    for line in load_lines:
        f = {k: float(v) for k, v in _LOAD_FIELD.findall(line)}
        if "mono" in f and t0 <= f["mono"] <= t1:
            steps += f.get("steps_per_s", 0.0)
            jobs += f.get("decode_jobs_per_s", 0.0)
            for k, vals in own.items():
                if k in f:
                    vals.append(f[k])
    span = t1 - t0
    out: dict[str, float | None] = {
        "decoder_jobs_per_s": round(jobs / span, 1) if span > 0 and jobs else None,
        "steps_per_decoder_job": round(steps / jobs, 1) if jobs else None}
    for k, vals in own.items():
        out[k] = round(sum(vals) / len(vals), 3) if vals else None
    return out


# ---------------------------------------------------------------------------------- phases

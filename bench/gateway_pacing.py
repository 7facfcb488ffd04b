"""Gateway pacing timelines: synthetic code engine (or any backend) + real decoder + real gateway.

Runs the gateway in this process (``ChatTTSSpeech`` over ``SyntheticCodeEngine`` and the real
streaming decoder of ``--model-dir``), drives it with the load test's ``steady`` scenario (real
client worker processes), and records per stream: code frames taken from the engine (time, steps,
how late they were taken), audio chunks out of the decoder, decoder batches (start, end, size),
event-loop lag. Then it joins that with the client records (segment starts, first/last audio,
buffer level, underruns) and prints, for every underrun, what the server did around it.

    .venv/bin/python -m bench.gateway_pacing --model-dir /tmp/ck --sessions 10 \\
        [--set engine.decoder_lookahead_steps=4] [--trace out/pacing.json]

``--set engine.backend=vllm`` traces the real engine instead (its per-stream step rate inside the
gateway is then printed: the number that decides whether any chunking can stay real time).
Checkpoint with ChatTTS's decoder depth (52-step exact lookahead, tiny widths, cheap on CPU):
``python -m bench.gateway_pacing --make-checkpoint DIR``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any


def make_deep_tiny_checkpoint(out_dir: str) -> Path:
    """Tiny widths, full DVAE/Vocos depth: the exact lookahead (52 steps) of the real model."""
    from dataclasses import replace

    from engine._compat import ensure_torch_companions


    ensure_torch_companions()  # before anything imports transformers, vocos or chattts
    from engine.checkpoint import TINY, make_checkpoint

    return make_checkpoint(out_dir, size=replace(TINY, dvae_layers=12, vocos_layers=8), seed=0)


class Trace:
    """Append-only event lists (time.monotonic seconds); written from the loop and the decoder thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.frames: list[tuple[float, str, int, float]] = []
        """(t taken, request id, steps, lateness s of the oldest step in it)."""
        self.chunks: list[tuple[float, str, int, int, bool]] = []
        """(t, request id, samples, steps, finished)."""
        self.batches: list[tuple[float, float, int, int]] = []
        """(t start, t end, jobs, steps in)."""
        self.lag: list[tuple[float, float]] = []
        """(t, loop lag s) for lags over 5 ms."""
        self.submits: dict[str, float] = {}


def install(trace: Trace, speech: Any) -> None:
    """Wrap the code engine, the speech engine and the decoder core to record timelines."""
    code = speech._code
    orig_gen = code.generate

    def generate(request: Any) -> Any:
        t_submit = time.monotonic()
        trace.submits[request.request_id] = t_submit
        it = orig_gen(request)
        pace = getattr(code, "pace", None)  # synthetic engine: lateness against its schedule

        async def wrapped() -> Any:
            got = 0
            async for fr in it:
                now = time.monotonic()
                n = int(fr.codes.shape[0])
                late = now - (t_submit + pace.due_at_s(got)) if n and pace is not None else 0.0
                got += n
                trace.frames.append((now, request.request_id, n, late))
                yield fr

        return wrapped()

    code.generate = generate
    orig_syn = speech.synthesize

    def synthesize(request: Any) -> Any:
        it = orig_syn(request)

        async def wrapped() -> Any:
            async for ch in it:
                trace.chunks.append((time.monotonic(), request.request_id, len(ch.pcm) // 2, ch.steps,
                                     ch.finished))
                yield ch

        return wrapped()

    speech.synthesize = synthesize
    core = speech._decoder.core
    orig_decode = core.decode

    def decode(jobs: Any) -> Any:
        t0 = time.monotonic()
        out = orig_decode(jobs)
        with trace.lock:
            trace.batches.append((t0, time.monotonic(), len(jobs), sum(int(j.x.shape[0]) for j in jobs)))
        return out

    core.decode = decode


def _legacy_chunking() -> None:
    """The chunking before the lead-aware policy (for before/after runs): chunks doubling with the
    audio emitted up to ``chunk_steps``, everything pending in one forward."""
    from engine.decoder.window import ChunkPolicy

    def push_steps(self: ChunkPolicy, received_steps: int, decoded_steps: int, finished: bool,
                   lead_steps: float | None = None) -> int:
        return received_steps - decoded_steps if self.ready(received_steps, decoded_steps, finished) else 0

    ChunkPolicy.push_steps = push_steps  # type: ignore[method-assign]


async def _lag_monitor(trace: Trace, stop: asyncio.Event) -> None:
    period = 0.005
    while not stop.is_set():
        t = time.monotonic()
        await asyncio.sleep(period)
        lag = time.monotonic() - t - period
        if lag > 0.005:
            trace.lag.append((t, lag))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine._compat import ensure_torch_companions

    ensure_torch_companions()  # before anything imports transformers, vocos or chattts
    from gateway.app import serve
    from loadtest.plan import ScenarioParams
    from loadtest.runner import run_scenario
    from voicegw.config import load_config
    from voicegw.runtime import build_speech_engine

    over: dict[str, Any] = {"engine.backend": "synthetic", "engine.model_dir": args.model_dir,
                            "gateway.port": 0, "gateway.log_level": "WARNING", "limits.max_sessions": 2048}
    for item in args.set:
        k, _, v = item.partition("=")
        over[k] = v
    cfg = load_config(overrides=over)
    if args.legacy_chunking:
        _legacy_chunking()
    speech = build_speech_engine(cfg)
    trace = Trace()
    install(trace, speech)
    await speech.start()
    ready: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    task = asyncio.create_task(serve(cfg, speech, stop=stop, on_ready=ready.set_result))
    server = await ready
    mon = asyncio.create_task(_lag_monitor(trace, stop))
    params = ScenarioParams(scenario="steady", sessions=args.sessions, duration_s=args.duration, seed=args.seed)
    result = await asyncio.get_running_loop().run_in_executor(None, run_scenario, params, server.ws_url, None)
    stop.set()
    await task
    await mon
    await speech.close()
    return {"result": result, "trace": trace, "decoder": getattr(speech, "_decoder", None)}


def analyse(out: dict[str, Any], detail: int) -> None:
    result, trace = out["result"], out["trace"]
    sessions = result["sessions"]
    n_under = sum(len(s["underruns"]) for s in sessions)
    ms_under = sum(s["underrun_ms"] for s in sessions)
    from loadtest import report

    print("\n".join(report.summary_table(result).splitlines()[:3]))
    print(f"sessions {len(sessions)}: underruns {n_under}, {ms_under:.0f} ms")
    lates = [f[3] for f in trace.frames if f[2]]
    if lates:
        lates.sort()
        print(f"code frames taken late (consumer pulled after the step existed): p50 {1000*lates[len(lates)//2]:.0f} ms"
              f" p99 {1000*lates[int(len(lates)*0.99)]:.0f} ms max {1000*lates[-1]:.0f} ms")
    by_rid: dict[str, list[tuple[float, int]]] = {}
    for t, rid, n, _late in trace.frames:
        if n:
            by_rid.setdefault(rid, []).append((t, n))
    rates = sorted(sum(n for _, n in fr[1:]) / (fr[-1][0] - fr[0][0]) for fr in by_rid.values()
                   if len(fr) > 2 and fr[-1][0] - fr[0][0] > 0.5)
    if rates:
        # with a real engine this is the GPT's per-stream pace inside the gateway (< 46.9: under real
        # time, no chunking can help); lazy pulls make it a lower bound for paused streams
        print(f"code steps/s per stream as taken (first->last frame, streams > 0.5 s): p5 "
              f"{rates[len(rates) // 20]:.1f} p50 {rates[len(rates) // 2]:.1f} max {rates[-1]:.1f} "
              f"(real time = 46.9)")
    durs = sorted(b[1] - b[0] for b in trace.batches)
    if durs:
        print(f"decoder: {len(durs)} batches, mean jobs {statistics.mean(b[2] for b in trace.batches):.1f}, "
              f"forward p50 {1000*durs[len(durs)//2]:.1f} ms p99 {1000*durs[int(len(durs)*0.99)]:.1f} ms "
              f"max {1000*durs[-1]:.1f} ms")
    if trace.lag:
        lg = sorted(x[1] for x in trace.lag)
        print(f"event loop lag > 5 ms: {len(lg)} times, max {1000*lg[-1]:.0f} ms")
    shown = 0
    for s in sessions:
        if not s["underruns"] or shown >= detail:
            continue
        shown += 1
        t0 = s["t0"]
        print(f"\n== session {s['session_id']} underruns "
              + ", ".join(f"{a:.3f}-{b:.3f}" if b else f"{a:.3f}-" for a, b in s["underruns"]))
        for u in s["utterances"]:
            def rel(x: float | None, t0: float = t0) -> str:
                return "-" if x is None else f"{x - t0:.3f}"
            print(f" utt {u['index']} first_text {rel(u['t_first_text'])} text_end {rel(u['t_text_end'])} "
                  f"first_audio {rel(u['t_first_audio'])} done {rel(u['t_done'])}")
            for k, sg in sorted(u["segments"].items(), key=lambda kv: int(kv[0])):
                print(f"   seg {k} started {rel(sg['t_started'])} first {rel(sg['t_first_audio'])} last "
                      f"{rel(sg['t_last_audio'])} {sg['samples'] / 24:.0f} ms "
                      f"buf@first {sg['buffered_ms_at_first_audio']} {sg['info'].get('text', '')[:40]!r}")
        for a, _end in s["underruns"]:
            near = [lv for lv in s["levels"] if a - 0.8 <= lv[0] <= a + 0.5]
            print(f"  underrun {a:.3f}: client buffer {near}")
            ta = t0 + a
            bs = [(round(x[0] - t0, 3), round(1000 * (x[1] - x[0]), 1), x[2]) for x in trace.batches
                  if ta - 0.4 <= x[0] <= ta + 0.2]
            print(f"    decoder batches (t, ms, jobs) near: {bs}")
            lg = [(round(x[0] - t0, 3), round(1000 * x[1])) for x in trace.lag if ta - 0.5 <= x[0] <= ta + 0.2]
            print(f"    loop lag (t, ms) near: {lg}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--make-checkpoint", default=None, metavar="DIR")
    p.add_argument("--model-dir", default="")
    p.add_argument("--sessions", type=int, default=10)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.add_argument("--legacy-chunking", action="store_true",
                   help="the chunk policy before the lead-aware fix (before/after comparisons)")
    p.add_argument("--detail", type=int, default=3, help="sessions with underruns to print in detail")
    p.add_argument("--trace", default=None, help="write the raw trace + client records as JSON here")
    args = p.parse_args(argv)
    if args.make_checkpoint:
        print(make_deep_tiny_checkpoint(args.make_checkpoint))
        return 0
    if not args.model_dir:
        p.error("--model-dir is required")
    try:
        import uvloop

        out = uvloop.run(run(args))
    except ImportError:  # pragma: no cover
        out = asyncio.run(run(args))
    analyse(out, args.detail)
    if args.trace:
        tr = out["trace"]
        Path(args.trace).parent.mkdir(parents=True, exist_ok=True)
        with open(args.trace, "w") as f:
            json.dump({"sessions": out["result"]["sessions"], "frames": tr.frames, "chunks": tr.chunks,
                       "batches": tr.batches, "lag": tr.lag, "submits": tr.submits}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

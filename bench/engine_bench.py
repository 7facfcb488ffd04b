"""Code-engine benchmark: ChatTTS GPT on vLLM vs upstream chattts (the native pipeline).

Full-size random weights (``make_checkpoint(size="full")``, cached), bursts of N concurrent
requests of exactly ``--steps`` GPT steps each (EOS blocked), for each backend:

* TTFT p50/p99: request submitted -> first code frame;
* steps/s per stream (p50): frames / (last frame - first frame) of each request;
* aggregate steps/s: all frames / wall time of the burst;
* and the ratio vLLM / reference.

Real time is 46.875 steps/s per stream (one step = 512 samples at 24 kHz).

    python -m bench.engine_bench --concurrency 1,8,32 --steps 64

Bounded: ``--max-seconds`` caps each burst (unfinished requests are aborted and counted as
they stand). Run it alone (``flock /tmp/voicegw-heavy.lock ...`` on shared machines).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REAL_TIME_STEPS_PER_S = 46.875


@dataclass
class RunResult:
    backend: str
    concurrency: int
    ttft_s: list[float] = field(default_factory=list)
    stream_steps_per_s: list[float] = field(default_factory=list)
    frames: int = 0
    wall_s: float = 0.0
    unfinished: int = 0

    @property
    def aggregate(self) -> float:
        return self.frames / self.wall_s if self.wall_s > 0 else 0.0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


async def burst(engine: Any, backend: str, n: int, steps: int, text: str, temperature: float, max_s: float) -> RunResult:
    from engine.api import SamplingParams, SpeechRequest

    res = RunResult(backend, n)
    params = SamplingParams(temperature=temperature, max_new_tokens=steps, min_new_tokens=steps, ignore_eos=True, seed=None)
    t0 = time.monotonic()

    async def one(i: int) -> None:
        rid = f"bench-{backend}-{n}-{i}-{time.monotonic_ns()}"
        req = SpeechRequest(rid, text, speaker=1000 + i, params=params)
        t_first = t_last = None
        frames = 0
        async for fr in engine.generate(req):
            if len(fr.codes):
                now = time.monotonic()
                if t_first is None:
                    t_first = now
                    res.ttft_s.append(now - t0)
                t_last = now
                frames += len(fr.codes)
        res.frames += frames
        if t_first is not None and t_last is not None and frames > 1 and t_last > t_first:
            res.stream_steps_per_s.append((frames - 1) / (t_last - t_first))

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    done, pending = await asyncio.wait(tasks, timeout=max_s)
    res.unfinished = len(pending)
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    for t in done:
        if t.exception() is not None:
            raise t.exception()  # type: ignore[misc]
    res.wall_s = time.monotonic() - t0
    return res


def table(results: list[RunResult], starts: dict[str, float]) -> str:
    lines = [
        f"{'backend':<18} {'conc':>4} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'steps/s/stream':>15} "
        f"{'x real time':>11} {'aggregate steps/s':>18} {'unfinished':>10}",
    ]
    for r in results:
        per = statistics.median(r.stream_steps_per_s) if r.stream_steps_per_s else float("nan")
        lines.append(
            f"{r.backend:<18} {r.concurrency:>4} {pct(r.ttft_s, 50) * 1e3:>12.0f} {pct(r.ttft_s, 99) * 1e3:>12.0f} "
            f"{per:>15.1f} {per / REAL_TIME_STEPS_PER_S:>11.2f} {r.aggregate:>18.1f} {r.unfinished:>10}"
        )
    by = {(r.backend, r.concurrency): r for r in results}
    conc = sorted({r.concurrency for r in results})
    if any(b == "vllm" for b, _ in by) and any(b == "reference" for b, _ in by):
        lines.append("")
        lines.append(f"{'ratio vllm/reference':<22} {'conc':>4} {'TTFT p50':>10} {'steps/s/stream':>15} {'aggregate':>10}")
        for c in conc:
            v, ref = by.get(("vllm", c)), by.get(("reference", c))
            if v is None or ref is None:
                continue
            vs = statistics.median(v.stream_steps_per_s) if v.stream_steps_per_s else float("nan")
            rs = statistics.median(ref.stream_steps_per_s) if ref.stream_steps_per_s else float("nan")
            lines.append(
                f"{'':<22} {c:>4} {pct(v.ttft_s, 50) / pct(ref.ttft_s, 50):>10.2f} {vs / rs:>15.2f} "
                f"{v.aggregate / ref.aggregate if ref.aggregate else float('nan'):>10.2f}"
            )
    if starts:
        lines.append("")
        lines.append("start-up: " + ", ".join(f"{k} {v:.1f} s" for k, v in starts.items()))
    return "\n".join(lines)


def ensure_checkpoint(args: argparse.Namespace) -> Path:
    import engine  # noqa: F401  (torch companion shim)
    from engine.checkpoint import make_checkpoint, missing_files

    model_dir = Path(args.model_dir).expanduser()
    if missing_files(model_dir):
        print(f"writing a {args.size} random checkpoint to {model_dir} ...", flush=True)
        t = time.monotonic()
        make_checkpoint(model_dir, args.size, seed=0)
        print(f"  done in {time.monotonic() - t:.0f} s", flush=True)
    return model_dir


async def run(args: argparse.Namespace, model_dir: Path) -> int:
    import logging

    from voicegw.config import EngineConfig

    logging.getLogger("chattts").setLevel(logging.ERROR)  # "incomplete result" per request
    concurrency = [int(c) for c in args.concurrency.split(",") if c]
    backends = [b for b in args.backends.split(",") if b]
    results: list[RunResult] = []
    starts: dict[str, float] = {}
    for backend in backends:
        cfg = EngineConfig(
            backend=backend,
            device="cpu" if args.device == "cpu" else args.device,
            max_num_seqs=max(concurrency),
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_gib=args.kv_gib,
            enforce_eager=not args.compile,
            max_model_len=1024,
            cpu_reserved_cores=0,  # GPT alone: every core to the worker (figures in RESULTS.md)
        )
        t = time.monotonic()
        if backend == "vllm":
            from engine.vllm.engine import VllmCodeEngine

            eng: Any = VllmCodeEngine(model_dir, cfg)
        elif backend == "reference":
            from engine.reference import ReferenceCodeEngine

            eng = ReferenceCodeEngine(model_dir, cfg)
        else:
            print(f"unknown backend {backend}", file=sys.stderr)
            return 2
        await eng.start()
        if backend == "reference":  # first-use costs (allocator, kernels) off the clock
            await burst(eng, backend, 1, 4, args.text, args.temperature, args.max_seconds)
        starts[backend] = time.monotonic() - t
        print(f"{backend}: started in {starts[backend]:.1f} s", flush=True)
        try:
            for c in concurrency:
                r = await burst(eng, backend, c, args.steps, args.text, args.temperature, args.max_seconds)
                results.append(r)
                print(table([r], {}).splitlines()[1], flush=True)
        finally:
            await eng.close()
    print()
    print(f"steps per request: {args.steps}; text: {args.text!r}; temperature {args.temperature}")
    print(table(results, starts))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engine_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=str(Path.home() / ".cache" / "voicegw" / "bench-full-seed0"),
                    help="checkpoint directory (upstream layout); created with random weights if missing")
    ap.add_argument("--size", default="full", choices=["full", "tiny"], help="size of a generated checkpoint")
    ap.add_argument("--backends", default="vllm,reference", help="comma list: vllm, reference")
    ap.add_argument("--concurrency", default="1,8,32", help="comma list of burst sizes")
    ap.add_argument("--steps", type=int, default=64, help="GPT steps per request (EOS blocked)")
    ap.add_argument("--temperature", type=float, default=0.3, help="sampling temperature (0 = greedy)")
    ap.add_argument("--text", default="hello world, this is a test of the voice gateway.", help="text of every request")
    ap.add_argument("--max-seconds", type=float, default=240.0, help="cap per burst; the rest is aborted")
    ap.add_argument("--kv-gib", type=float, default=1.0, help="vLLM KV cache size on CPU (GiB)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="vLLM token budget per step")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    ap.add_argument("--compile", action="store_true", help="vLLM without enforce_eager (torch.compile / CUDA graphs)")
    args = ap.parse_args(argv)
    return asyncio.run(run(args, ensure_checkpoint(args)))


if __name__ == "__main__":
    sys.exit(main())

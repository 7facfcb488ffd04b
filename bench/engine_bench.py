"""Code-engine benchmark: ChatTTS GPT on vLLM vs stock vLLM and upstream chattts.

Full-size random weights (``make_checkpoint(size="full")``, cached), bursts of N concurrent
requests of exactly ``--steps`` GPT steps each (EOS blocked), for each backend:

* ``vllm``: the ChatTTS plugin (``VllmCodeEngine``);
* ``stock``: the baseline, stock vLLM on a plain Llama of the GPT's shape (layers, hidden,
  heads, MLP, positions) and the unified vocabulary, random weights in the plugin's dtype, the
  same prompt token ids, steps and engine arguments, EOS blocked, vLLM's own sampler at the
  same temperature: what vLLM costs per step without anything ChatTTS adds;
* ``reference``: upstream chattts in-process (the native pipeline).

Measured, per backend and concurrency:

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
import json
import os
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


def per_stream(r: RunResult) -> float:
    return statistics.median(r.stream_steps_per_s) if r.stream_steps_per_s else float("nan")


def ratios(results: list[RunResult], base: str) -> dict[int, dict[str, float]]:
    """Per concurrency: vllm / ``base`` of TTFT p50, per-stream steps/s and aggregate steps/s."""
    by = {(r.backend, r.concurrency): r for r in results}
    out: dict[int, dict[str, float]] = {}
    for c in sorted({r.concurrency for r in results}):
        v, ref = by.get(("vllm", c)), by.get((base, c))
        if v is None or ref is None:
            continue
        out[c] = {
            "ttft_p50": pct(v.ttft_s, 50) / pct(ref.ttft_s, 50),
            "per_stream": per_stream(v) / per_stream(ref),
            "aggregate": v.aggregate / ref.aggregate if ref.aggregate else float("nan"),
        }
    return out


def summary(results: list[RunResult], starts: dict[str, float], args: argparse.Namespace) -> dict[str, Any]:
    """Every figure of the run, for ``--json-out``."""
    return {
        "steps": args.steps, "temperature": args.temperature, "device": args.device,
        "compile": bool(args.compile), "async_scheduling": bool(args.async_scheduling),
        "runs": [
            {"backend": r.backend, "concurrency": r.concurrency, "ttft_p50_ms": pct(r.ttft_s, 50) * 1e3,
             "ttft_p99_ms": pct(r.ttft_s, 99) * 1e3, "steps_per_s_per_stream": per_stream(r),
             "aggregate_steps_per_s": r.aggregate, "unfinished": r.unfinished}
            for r in results
        ],
        "ratio_vs_stock": {str(c): v for c, v in ratios(results, "stock").items()},
        "ratio_vs_reference": {str(c): v for c, v in ratios(results, "reference").items()},
        "start_s": starts,
    }


def table(results: list[RunResult], starts: dict[str, float]) -> str:
    lines = [
        f"{'backend':<18} {'conc':>4} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'steps/s/stream':>15} "
        f"{'x real time':>11} {'aggregate steps/s':>18} {'unfinished':>10}",
    ]
    for r in results:
        per = per_stream(r)
        lines.append(
            f"{r.backend:<18} {r.concurrency:>4} {pct(r.ttft_s, 50) * 1e3:>12.0f} {pct(r.ttft_s, 99) * 1e3:>12.0f} "
            f"{per:>15.1f} {per / REAL_TIME_STEPS_PER_S:>11.2f} {r.aggregate:>18.1f} {r.unfinished:>10}"
        )
    for base in ("stock", "reference"):
        rows = ratios(results, base)
        if not rows:
            continue
        lines.append("")
        lines.append(f"{'ratio vllm/' + base:<22} {'conc':>4} {'TTFT p50':>10} {'steps/s/stream':>15} {'aggregate':>10}")
        for c, row in sorted(rows.items()):
            lines.append(
                f"{'':<22} {c:>4} {row['ttft_p50']:>10.2f} {row['per_stream']:>15.2f} {row['aggregate']:>10.2f}"
            )
    if starts:
        lines.append("")
        lines.append("start-up: " + ", ".join(f"{k} {v:.1f} s" for k, v in starts.items()))
    return "\n".join(lines)


class StockEngine:
    """Stock vLLM ``AsyncLLM`` on a Llama of the ChatTTS GPT's shape (the baseline)."""

    name = "stock-vllm"

    def __init__(self, model_dir: Path, cfg: Any, *, async_scheduling: bool | None) -> None:
        from engine.prompt import PromptBuilder

        self.model_dir = model_dir
        self.cfg = cfg
        self.prompts = PromptBuilder(model_dir)
        self.async_scheduling = async_scheduling
        self.llm: Any = None

    def llama_dir(self) -> Path:
        """A random-weight ``LlamaForCausalLM`` with the GPT's shape (written once, cached)."""
        import json

        gpt = json.loads((self.model_dir / "asset" / "gpt" / "config.json").read_text())
        info = self.prompts.info
        out = self.model_dir.parent / f"{self.model_dir.name}-stock-llama"
        if (out / "config.json").exists():
            return out
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        lc = LlamaConfig(
            hidden_size=int(gpt["hidden_size"]), intermediate_size=int(gpt["intermediate_size"]),
            num_attention_heads=int(gpt["num_attention_heads"]),
            num_key_value_heads=int(gpt.get("num_key_value_heads") or gpt["num_attention_heads"]),
            num_hidden_layers=int(gpt["num_hidden_layers"]), max_position_embeddings=info.max_positions,
            rms_norm_eps=float(gpt.get("rms_norm_eps", 1e-6)), rope_theta=float(gpt.get("rope_theta", 1e4)),  # type: ignore[call-arg]
            vocab_size=info.unified_vocab_size, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        )
        LlamaForCausalLM(lc).save_pretrained(str(out), safe_serialization=True)
        return out

    async def start(self) -> None:
        from engine.vllm._env import child_env, prepare

        prepare()
        os.environ.update(child_env())  # vLLM's model-inspection subprocess needs the boot shim
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        device = "cpu" if self.cfg.device == "cpu" else "cuda"
        dtype = "float32" if device == "cpu" else "bfloat16"
        args: dict[str, Any] = dict(
            model=str(self.llama_dir()), skip_tokenizer_init=True, dtype=dtype,
            max_model_len=self.cfg.max_model_len, max_num_seqs=self.cfg.max_num_seqs,
            max_num_batched_tokens=self.cfg.max_num_batched_tokens, enable_prefix_caching=True,
            enforce_eager=self.cfg.enforce_eager, generation_config="vllm", disable_log_stats=True, seed=0,
        )
        if device == "cpu":
            args["kv_cache_memory_bytes"] = int(self.cfg.kv_cache_gib * 2**30)
        else:
            args["gpu_memory_utilization"] = self.cfg.gpu_memory_utilization
            args["async_scheduling"] = self.async_scheduling
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # as the plugin runs
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        self.llm = await asyncio.to_thread(AsyncLLM.from_engine_args, AsyncEngineArgs(**args))

    async def generate(self, request: Any) -> Any:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        from engine.api import CodeFrames

        p = request.params
        ids = self.prompts.code_prompt_ids(request.text, True)
        sp = VSamplingParams(
            max_tokens=p.max_new_tokens, ignore_eos=True, temperature=p.temperature,
            output_kind=RequestOutputKind.DELTA, detokenize=False,
        )
        import numpy as np

        async for out in self.llm.generate({"prompt_token_ids": ids}, sp, request.request_id):
            n = len(out.outputs[0].token_ids)
            yield CodeFrames(request.request_id, np.zeros((n, 4), np.int64), finished=bool(out.finished))

    async def close(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None


def ensure_checkpoint(args: argparse.Namespace) -> Path:
    """The checkpoint's code-engine files (GPT, Embed, tokenizer): written with random weights
    when missing; without the upstream package (bare GPU hosts) only those files."""
    from engine._compat import ensure_torch_companions

    ensure_torch_companions()  # before anything imports transformers, vocos or chattts
    from engine.checkpoint import GPT_FILES, make_checkpoint, make_gpt_checkpoint

    model_dir = Path(args.model_dir).expanduser()
    if any(not (model_dir / f).exists() for f in GPT_FILES):
        t = time.monotonic()
        try:
            import ChatTTS  # noqa: F401

            print(f"writing a {args.size} random checkpoint to {model_dir} ...", flush=True)
            make_checkpoint(model_dir, args.size, seed=0)
        except Exception:  # noqa: BLE001 - upstream or its dependencies missing/broken here
            print(f"writing the GPT part of a {args.size} random checkpoint to {model_dir} ...", flush=True)
            make_gpt_checkpoint(model_dir, args.size, seed=0)
        print(f"  done in {time.monotonic() - t:.0f} s", flush=True)
    return model_dir


async def start_spy(args: argparse.Namespace, backend: str, concurrency: int) -> Any:
    """``--spy-at``: py-spy on this process and its children (the vLLM front end here, the
    engine core spawned) during those bursts, raw stacks with process frames."""
    levels = {int(x) for x in str(args.spy_at).split(",") if x.strip() and x.strip() != "0"}
    if concurrency not in levels or backend not in args.spy_backends.split(","):
        return None
    out = f"{args.spy_out}-{backend}-c{concurrency}.txt"
    cmd = [args.spy_bin, "record", "--pid", str(os.getpid()), "--subprocesses", "--nonblocking", "-r", "40",
           "-f", "raw", "-o", out, "--duration", str(int(args.spy_seconds))]
    print(f"spy: {' '.join(cmd)}", flush=True)
    return await asyncio.create_subprocess_exec(*cmd)


async def run(args: argparse.Namespace, model_dir: Path) -> int:
    import logging

    from engine.build import CODE_ENGINES, build_code_engine
    from engine.config import EngineConfig

    logging.getLogger("chattts").setLevel(logging.ERROR)  # "incomplete result" per request
    concurrency = [int(c) for c in args.concurrency.split(",") if c]
    backends = [b for b in args.backends.split(",") if b]
    results: list[RunResult] = []
    starts: dict[str, float] = {}
    for backend in backends:
        cfg = EngineConfig(
            backend="vllm" if backend == "stock" else backend,  # stock: vLLM's own model path
            device="cpu" if args.device == "cpu" else args.device,
            max_num_seqs=args.max_num_seqs or max(concurrency),
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_gib=args.kv_gib,
            enforce_eager=not args.compile,
            async_scheduling=args.async_scheduling,
            max_model_len=1024,
            cpu_reserved_cores=0,  # GPT alone: every core to the worker (figures in RESULTS.md)
        )
        t = time.monotonic()
        if backend == "stock":
            eng: Any = StockEngine(model_dir, cfg, async_scheduling=cfg.async_scheduling)
        elif backend in CODE_ENGINES:
            extra = {"compilation_config": {"cudagraph_mode": args.cudagraph_mode}} if args.cudagraph_mode else None
            eng = build_code_engine(cfg, model_dir, **({"engine_args": extra} if backend == "vllm" else {}))
        else:
            print(f"unknown backend {backend}", file=sys.stderr)
            return 2
        await eng.start()
        if backend != "vllm":  # first-use costs off the clock (the plugin warms itself at start)
            await burst(eng, backend, 1, 4, args.text, args.temperature, args.max_seconds)
            await burst(eng, backend, 8, 4, args.text, args.temperature, args.max_seconds)
        starts[backend] = time.monotonic() - t
        print(f"{backend}: started in {starts[backend]:.1f} s", flush=True)
        try:
            for c in concurrency:
                spy = await start_spy(args, backend, c)
                r = await burst(eng, backend, c, args.steps, args.text, args.temperature, args.max_seconds)
                for _ in range(args.single_repeats - 1 if c == 1 else 0):  # a TTFT of one sample is noise
                    more = await burst(eng, backend, c, args.steps, args.text, args.temperature, args.max_seconds)
                    r.ttft_s += more.ttft_s
                    r.stream_steps_per_s += more.stream_steps_per_s
                    r.frames += more.frames
                    r.wall_s += more.wall_s
                    r.unfinished += more.unfinished
                if spy is not None:
                    await asyncio.wait_for(spy.wait(), timeout=args.spy_seconds + 30)
                results.append(r)
                print(table([r], {}).splitlines()[1], flush=True)
        finally:
            await eng.close()
    print()
    print(f"steps per request: {args.steps}; text: {args.text!r}; temperature {args.temperature}")
    print(table(results, starts))
    if args.json_out:
        await asyncio.to_thread(Path(args.json_out).write_text, json.dumps(summary(results, starts, args), indent=1))
    if args.run_dir:
        path = write_engine_run(args.run_dir, results, starts, args)
        print(f"run file: {path}", flush=True)
    return 0


def engine_figures(results: list[RunResult]) -> dict[str, float | None]:
    """The plugin's (backend vllm) figures under bench.results' names: per C streams
    ``engine_stream_steps_per_s_cC``, ``engine_aggregate_cC``, ``engine_ttft_p50_ms_cC``."""
    out: dict[str, float | None] = {}
    for r in results:
        if r.backend == "vllm":
            c = r.concurrency
            out[f"engine_stream_steps_per_s_c{c}"] = round(per_stream(r), 1)
            out[f"engine_aggregate_c{c}"] = round(r.aggregate, 1)
            out[f"engine_ttft_p50_ms_c{c}"] = round(pct(r.ttft_s, 50) * 1e3, 1)
    return {k: (v if v == v else None) for k, v in out.items()}  # NaN (no sample) -> null


def write_engine_run(run_dir: str, results: list[RunResult], starts: dict[str, float], args: argparse.Namespace) -> Path:
    """Write this run as a bench.results run file (figures: ``engine_figures``; detail: ``summary``)."""
    import shlex
    from importlib import metadata

    from bench.results import write_run

    device = args.device
    if args.device != "cpu":
        import torch

        if torch.cuda.is_available():
            device = f"1x {torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    try:
        device += f", vLLM {metadata.version('vllm')}"
    except metadata.PackageNotFoundError:
        pass
    return write_run(run_dir, command="python3 -m bench.engine_bench " + shlex.join(args.argv), device=device,
                     figures=engine_figures(results), detail=summary(results, starts, args), slug="engine")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engine_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=str(Path.home() / ".cache" / "voicegw" / "bench-full-seed0"),
                    help="checkpoint directory (upstream layout); created with random weights if missing")
    ap.add_argument("--size", default="full", choices=["full", "tiny"], help="size of a generated checkpoint")
    ap.add_argument("--backends", default="vllm,stock", help="comma list: vllm, stock, reference")
    ap.add_argument("--concurrency", default="1,8,32", help="comma list of burst sizes")
    ap.add_argument("--steps", type=int, default=64, help="GPT steps per request (EOS blocked)")
    ap.add_argument("--temperature", type=float, default=0.3, help="sampling temperature (0 = greedy)")
    ap.add_argument("--text", default="hello world, this is a test of the voice gateway.", help="text of every request")
    ap.add_argument("--max-seconds", type=float, default=240.0, help="cap per burst; the rest is aborted")
    ap.add_argument("--kv-gib", type=float, default=1.0, help="vLLM KV cache size on CPU (GiB)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="vLLM token budget per step")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    ap.add_argument("--compile", action="store_true", help="vLLM without enforce_eager (torch.compile / CUDA graphs)")
    ap.add_argument("--async-scheduling", type=int, default=None,
                    help="vLLM async scheduling on GPU: 1 / 0 (default: on for cuda); ignored on CPU")
    ap.add_argument("--max-num-seqs", type=int, default=0, help="vLLM max_num_seqs (default: the largest burst)")
    ap.add_argument("--json-out", default="", help="write every figure here (JSON)")
    ap.add_argument("--run-dir", default="",
                    help="also write a bench.results run file here (e.g. bench/results/runs)")
    ap.add_argument("--single-repeats", type=int, default=10,
                    help="the 1-stream burst runs this many times, one after another (pooled figures)")
    ap.add_argument("--cudagraph-mode", default="", help="the plugin's vLLM cudagraph_mode (default: vLLM's)")
    ap.add_argument("--spy-at", default="", help="comma list of burst sizes to py-spy (front end + engine core)")
    ap.add_argument("--spy-backends", default="vllm", help="comma list of backends to spy on")
    ap.add_argument("--spy-bin", default="py-spy", help="py-spy executable")
    ap.add_argument("--spy-out", default="spy", help="raw output prefix (-BACKEND-cC.txt is appended)")
    ap.add_argument("--spy-seconds", type=float, default=5.0, help="seconds of sampling")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.async_scheduling is None:
        args.async_scheduling = args.device != "cpu"
    else:
        args.async_scheduling = bool(args.async_scheduling)
    return asyncio.run(run(args, ensure_checkpoint(args)))


if __name__ == "__main__":
    sys.exit(main())

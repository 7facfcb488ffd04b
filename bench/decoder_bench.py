"""The streaming decoder alone: speed of the static-shape forward, and the lookahead table.

1. **speed** (``WindowDecoder``, the default window: ``--left-steps`` of left context,
   ``--chunk-steps`` new steps, ``--lookahead`` steps after; beside it, the same window with the
   exact left reach, in the same run): ms per forward at each ``--batches`` (inputs copied in,
   samples copied out, as the decoder process does), and the audio it makes in multiples of real
   time (``B x chunk_steps / 46.875 / t``). On CUDA the forward is the bucket's CUDA graph in TF32;
   the baseline in the same run is the same window eager (what every forward cost before static
   shapes: the host launching each kernel), and a whole-utterance decode of 128 x 200 steps.
2. **dtype** (``--dtypes``): the same window and batches with the stages computed in each dtype
   (``engine.decoder_dtype``; ``DTYPE+compile``: the forward compiled too, ``engine.decoder_compile``),
   against float32 (TF32 on CUDA) in the same run: ms per forward, the
   speed ratio, and the samples' SNR in dB and max deviation relative to the float32 peak.
3. **contention** (CUDA; ``--contention-batches``, ``--contention-hogs``): ms per forward of the
   float16 graph alone and while ``--contention-hogs`` other processes keep the GPU busy with
   matmuls and a synchronize every few ms (what the engine cores do beside the decoder process:
   the GPU time-slices between processes unless they run under MPS): the slowdown against alone,
   in the same run.
4. **lookahead table** (``--lookaheads``): utterances of ``--steps`` steps streamed the way the
   gateway streams them (first chunk ``--first-chunk-steps``, then ``--chunk-steps``; the decoder
   process's own core, ``WorkerCore``), compared with the whole-utterance decode of the same
   codes: max absolute deviation (and relative to the whole decode's peak), SNR in dB, and the GPT
   steps before the first audio (first_chunk + lookahead), in ms at ``--step-ms`` per step.

Random weights of the released model's shapes (``--model-dir``, else a checkpoint is made in a
temporary directory), with the layer scales randomised in U(0.2, 1) (``--spice``, the default):
upstream's random init (DVAE layer scale 1e-6) makes the deep stack nearly an identity and every
lookahead would look perfect.

    python -m bench.decoder_bench --device cuda --json-out out/decoder.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

STEPS_PER_S = 24_000 / 512  # 46.875 GPT steps per second of audio


def make_model(root: Path, spice: bool) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    from engine._compat import ensure_torch_companions
    from engine.checkpoint import FULL, make_decoder_assets

    ensure_torch_companions()
    spec = dataclasses.replace(FULL, gpt_layers=1, gpt_intermediate=256, gpt_vocab=256, dvae_enc_layers=1, dvae_enc_hidden=32)
    d = make_decoder_assets(root / "full", spec, seed=0)  # the decoder's files only (no upstream needed)
    if spice:
        gen = torch.Generator().manual_seed(2)
        for name in ["DVAE", "Vocos"]:
            path = d / f"asset/{name}.safetensors"
            state = load_file(str(path))
            for k, v in state.items():
                parts = k.split(".")
                if (len(parts) == 4 and parts[1] == "decoder_block" and parts[3] == "weight") or parts[-1] == "gamma":
                    state[k] = 0.2 + 0.8 * torch.rand(v.shape, generator=gen)
            save_file(state, str(path))
    return Path(d)


def _timed(fn: Any, sync: Any, n: int) -> float:
    for _ in range(3):
        fn()
    sync()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _default_window(voc: Any, args: argparse.Namespace) -> Any:
    """The window the speed, dtype and contention sections time: ``--left-steps`` of left context,
    ``--chunk-steps`` new steps, ``--lookahead`` steps after (-1: exact)."""
    from engine.decoder.window import WindowSpec

    g = voc.geometry
    la = g.exact_lookahead_steps if args.lookahead < 0 else args.lookahead
    return WindowSpec(g, args.chunk_steps, la, left_context_steps=args.left_steps)


def _random_rows(spec: Any, batches: list[int], seed: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per batch size, random codes of whole windows with their starts and ends (``WindowDecoder.run``'s inputs)."""
    rng = np.random.default_rng(seed)
    out = []
    for b in batches:
        start = rng.integers(0, 400, b)
        out.append((rng.integers(0, 625, (b, spec.window_steps, 4)), start, start + spec.window_steps))
    return out


def speed(voc: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from engine.decoder.window import WindowSpec
    from engine.decoder.windowed import WindowDecoder

    g = voc.geometry
    spec = _default_window(voc, args)
    la = spec.lookahead_steps
    batches = [int(b) for b in args.batches.split(",")]
    dec = WindowDecoder(voc, spec, max(batches))
    t0 = time.perf_counter()
    dec.warm_up()
    warm_s = time.perf_counter() - t0
    full = None  # the baseline: the same window with the exact left reach
    if spec.left_steps != g.exact_left_steps:
        full = WindowDecoder(voc, WindowSpec(g, args.chunk_steps, la), max(batches))
        full.warm_up()
    sync = torch.cuda.synchronize if dec.cuda else (lambda: None)
    rng = np.random.default_rng(0)
    rows = []
    for b in batches:
        x = rng.integers(0, 625, (b, g.exact_left_steps + args.chunk_steps + la, 4))
        start = rng.integers(0, 400, b)
        end = start + spec.window_steps
        t_full = None
        if full is not None:
            t_full = _timed(lambda x=x, start=start, end=end, d=full: d.run(x, start, end), sync, args.repeats)
        x = x[:, : spec.window_steps]
        t_graph = _timed(lambda x=x, start=start, end=end: dec.run(x, start, end), sync, args.repeats)
        xt = torch.from_numpy(x).to(dec.device)
        st, en = torch.from_numpy(start).to(dec.device), torch.from_numpy(end).to(dec.device)
        with torch.inference_mode():
            t_eager = _timed(lambda xt=xt, st=st, en=en: dec._compute(xt, st, en).cpu(), sync, args.repeats)
        row = {"batch": b, "window_steps": spec.window_steps, "chunk_steps": spec.chunk_steps, "lookahead_steps": la,
               "ms": round(1e3 * t_graph, 3), "x_real_time": round(b * spec.chunk_steps / STEPS_PER_S / t_graph, 1),
               "eager_ms": round(1e3 * t_eager, 3), "speedup_vs_eager": round(t_eager / t_graph, 2),
               "graphs": dec.cuda}
        if t_full is not None:
            row.update({"exact_left_window_steps": g.exact_left_steps + args.chunk_steps + la,
                        "exact_left_ms": round(1e3 * t_full, 3), "speedup_vs_exact_left": round(t_full / t_graph, 2)})
        rows.append(row)
        print(json.dumps(row), flush=True)
    with torch.inference_mode():
        xw = torch.from_numpy(rng.integers(0, 625, (128 if dec.cuda else 4, 200, 4))).to(dec.device)

        def whole() -> None:
            for i in range(xw.shape[0]):
                voc.decode_whole(xw[i])

        t = _timed(whole, sync, 3)
    w = {"whole_utterances": int(xw.shape[0]), "steps": 200, "x_real_time": round(xw.shape[0] * 200 / STEPS_PER_S / t, 1),
         "warm_up_s": round(warm_s, 2)}
    print(json.dumps(w), flush=True)
    rows.append(w)
    return rows


def dtype_table(voc: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from engine.decoder.windowed import WindowDecoder

    spec = _default_window(voc, args)
    batches = [int(b) for b in args.batches.split(",")]
    inputs = _random_rows(spec, batches, 1)
    base: dict[int, tuple[float, np.ndarray]] = {}
    rows = []
    for dt in ["float32", *[d for d in args.dtypes.split(",") if d and d != "float32"]]:
        dtype, _, compiled = dt.partition("+")
        t0 = time.perf_counter()
        dec = WindowDecoder(voc, spec, max(batches), compute_dtype=dtype, compile_forward=compiled == "compile")
        dec.warm_up()
        warm_s = time.perf_counter() - t0
        sync = torch.cuda.synchronize if dec.cuda else (lambda: None)
        for b, (x, start, end) in zip(batches, inputs, strict=True):
            t = _timed(lambda x=x, start=start, end=end, dec=dec: dec.run(x, start, end), sync, args.repeats)
            out = dec.run(x, start, end).copy()  # on CUDA run returns a view the next call overwrites
            if dt == "float32":
                base[b] = (t, out)
            t0, ref = base[b]
            err = out.astype(np.float64) - ref
            snr = 10 * np.log10(float((ref.astype(np.float64) ** 2).sum()) / max(float((err ** 2).sum()), 1e-30))
            row = {"dtype": dt, "batch": b, "warm_up_s": round(warm_s, 1), "ms": round(1e3 * t, 3), "speed_vs_float32": round(t0 / t, 2),
                   "snr_db": round(min(snr, 300.0), 1),
                   "max_dev_of_peak": round(float(np.abs(err).max() / max(np.abs(ref).max(), 1e-12)), 5)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del dec
    return rows


_HOG = """
import sys, torch
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
print("ready", flush=True)
while True:
    for _ in range(40):
        a = torch.tanh(a @ a)
    torch.cuda.synchronize()
"""


def contention(voc: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    import subprocess

    import torch

    from engine.decoder.windowed import WindowDecoder

    spec = _default_window(voc, args)
    batches = [int(b) for b in args.contention_batches.split(",")]
    dec = WindowDecoder(voc, spec, max(batches), compute_dtype="float16")
    dec.warm_up()
    inputs = _random_rows(spec, batches, 2)

    def measure() -> dict[int, float]:
        return {b: _timed(lambda x=x, start=start, end=end: dec.run(x, start, end), torch.cuda.synchronize, args.repeats)
                for b, (x, start, end) in zip(batches, inputs, strict=True)}

    alone = measure()
    hogs = [subprocess.Popen([sys.executable, "-c", _HOG], stdout=subprocess.PIPE, text=True)
            for _ in range(args.contention_hogs)]
    try:
        for h in hogs:
            assert h.stdout is not None
            if h.stdout.readline().strip() != "ready":
                raise RuntimeError("a GPU load process did not start")
        time.sleep(1.0)
        loaded = measure()
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    rows = []
    for b in batches:
        row = {"batch": b, "hogs": args.contention_hogs, "alone_ms": round(1e3 * alone[b], 3),
               "loaded_ms": round(1e3 * loaded[b], 3), "loaded_slowdown": round(loaded[b] / alone[b], 2)}
        rows.append(row)
        print("contention", row, flush=True)
    return rows


def _left_only_spec() -> Any:
    from engine.decoder.window import WindowSpec

    class LeftOnly(WindowSpec):
        """The exact lookahead with a shorter left context: the left context's own error, alone."""

        @property
        def left_steps(self) -> int:
            return min(self.left_context_steps, self.geometry.exact_left_steps)

    return LeftOnly


def lookahead_table(voc: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from engine.decoder.window import ChunkPolicy, WindowSpec
    from engine.decoder.windowed import WindowDecoder
    from engine.decoder.worker import WorkerCore

    g = voc.geometry
    left_only = _left_only_spec()
    rng = np.random.default_rng(1)
    utts = [rng.integers(0, 625, (args.steps, 4)) for _ in range(args.utterances)]
    wholes = [voc.decode_whole(torch.from_numpy(x).to(next(voc.parameters()).device)).cpu().numpy() for x in utts]
    out = []
    exact_la = g.exact_lookahead_steps
    pairs = [(min(int(v), exact_la), args.left_steps) for v in args.lookaheads.split(",")]
    for la in (exact_la, exact_la if args.lookahead < 0 else args.lookahead):
        pairs += [(la, int(v)) for v in args.lefts.split(",") if (la, int(v)) not in pairs]
    for la, left in pairs:
        spec = WindowSpec(g, args.chunk_steps, la, left_context_steps=left)
        if la >= exact_la and left != -1:  # exact mode ignores the setting: the left context's own error
            spec = left_only(g, args.chunk_steps, la, left_context_steps=left)
        dec = WindowDecoder(voc, spec, 8)
        dec.warm_up()
        buf = np.zeros((1, 4 * args.chunk_steps * g.samples_per_step), np.float32)
        core = WorkerCore(spec, dec.run, buf, 4, np.int64, 8, 4096, 625)
        policy = ChunkPolicy(args.first_chunk_steps, args.chunk_steps, la)
        devs, snrs, rels = [], [], []
        for x, whole in zip(utts, wholes, strict=True):
            parts: list[np.ndarray] = []
            decoded = emitted = 0
            for received in range(1, len(x) + 1):
                final = received == len(x)
                while True:  # engine.speech's loop
                    n = policy.push_steps(received, decoded, final, None)
                    last = final and decoded + n == received
                    if not n and not last:
                        break
                    target = received if last else max(emitted, policy.emit_steps(decoded + n))
                    emitted = _push(core, buf, parts, x[decoded : decoded + n], emitted, target, last, decoded == 0)
                    decoded += n
                    if last:
                        break
            s = np.concatenate(parts)
            assert s.shape == whole.shape, (s.shape, whole.shape)
            err = s - whole
            devs.append(float(np.abs(err).max()))
            rels.append(float(np.abs(err).max() / max(1e-12, np.abs(whole).max())))
            snrs.append(float(10 * np.log10(np.sum(whole**2) / max(1e-30, np.sum(err**2)))))
        first_steps = args.first_chunk_steps + la
        row = {"lookahead_steps": la, "left_steps": spec.left_steps,
               "exact": spec.exact and spec.left_steps == g.exact_left_steps, "max_dev": round(max(devs), 6),
               "max_dev_rel_peak": round(max(rels), 5), "snr_db_min": round(min(snrs), 1),
               "snr_db_median": round(statistics.median(snrs), 1), "first_audio_steps": first_steps,
               "first_audio_gpt_ms": round(first_steps * args.step_ms, 1), "window_steps": spec.window_steps}
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def _push(core: Any, buf: np.ndarray, parts: list[np.ndarray], x: np.ndarray, emitted: int, target: int,
          final: bool, first: bool) -> int:
    """One ``DecoderStream.push``: the inputs with the first job, jobs of at most ``out_cap`` steps."""
    from engine.decoder.worker import FLAG_FINAL, FLAG_RESET

    while True:
        tgt = min(target, emitted + core.out_cap_steps)
        flags = (FLAG_FINAL if final and tgt == target else 0) | (FLAG_RESET if first else 0)
        res = core.submit(1, 0, x, tgt, flags)
        x, first = x[:0], False
        if res is None:
            done: list[tuple[int, int, int]] = []
            while not done:
                done = core.step()
            n = done[0][2]
        else:
            n = res[1]
        parts.append(buf[0, :n].copy())
        emitted = tgt
        if tgt >= target:
            return emitted


async def _lag_probe(stop: Any, lags: list[float], period_s: float = 0.001) -> None:
    import asyncio

    loop = asyncio.get_running_loop()
    while not stop.is_set():
        t = loop.time()
        await asyncio.sleep(period_s)
        lags.append(loop.time() - t - period_s)


def placement(voc: Any, args: argparse.Namespace, model_dir: Path) -> list[dict[str, Any]]:
    """Where the decoder runs, seen from the gateway's event loop: the same windows decoded (a) in
    a worker thread of this process (what the gateway did before: its forwards hold the GIL for
    their Python and kernel launches) and (b) in the decoder process (``DecoderClient``). Streams
    push ``chunk_steps`` steps each round; reported: audio decoded (x real time) and the lateness
    of a 1 ms timer on the loop (p50 / p99 / max), i.e. what every session's sends wait."""
    import asyncio

    from engine.decoder.client import DecoderClient, DecoderSettings
    from engine.decoder.window import WindowSpec
    from engine.decoder.windowed import WindowDecoder

    g = voc.geometry
    la = g.exact_lookahead_steps if args.lookahead < 0 else args.lookahead
    streams = int(args.placement_streams)
    rounds = int(args.placement_rounds)
    rng = np.random.default_rng(3)
    xs = [rng.integers(0, 625, (rounds * args.chunk_steps + la, 4)) for _ in range(streams)]
    out = []

    async def drive(push: Any) -> dict[str, Any]:
        stop, lags = asyncio.Event(), list[float]()
        probe = asyncio.create_task(_lag_probe(stop, lags))
        t0 = time.perf_counter()
        await asyncio.gather(*(push(i) for i in range(streams)))
        dt = time.perf_counter() - t0
        stop.set()
        await probe
        lag = sorted(lags)
        return {"x_real_time": round(streams * rounds * args.chunk_steps / STEPS_PER_S / dt, 1),
                "loop_lag_p50_ms": round(1e3 * lag[len(lag) // 2], 2),
                "loop_lag_p99_ms": round(1e3 * lag[int(len(lag) * 0.99)], 2), "loop_lag_max_ms": round(1e3 * lag[-1], 2)}

    async def in_thread() -> dict[str, Any]:
        from concurrent.futures import ThreadPoolExecutor

        spec = WindowSpec(g, args.chunk_steps, la, left_context_steps=args.left_steps)
        dec = WindowDecoder(voc, spec, streams)
        dec.warm_up()
        ex = ThreadPoolExecutor(1)
        loop = asyncio.get_running_loop()
        w, left = spec.window_steps, spec.left_steps
        batches = []
        for r in range(rounds):  # every stream's row of a round in one forward (the best case)
            a = la + r * args.chunk_steps
            x = np.zeros((streams, w, 4), np.int64)
            for i in range(streams):
                lo = max(0, a - left)
                seg = xs[i][lo : a - left + w]
                x[i, lo - (a - left) : lo - (a - left) + len(seg)] = seg
            batches.append((x, np.full(streams, a - left), np.full(streams, a + args.chunk_steps + la)))

        async def push(i: int) -> None:
            if i:
                return
            for x, st, en in batches:
                await loop.run_in_executor(ex, dec.run, x, st, en)

        res = await drive(push)
        ex.shutdown()
        return res

    async def in_process() -> dict[str, Any]:
        c = DecoderClient(DecoderSettings(model_dir=str(model_dir), device=args.device,
                                          chunk_steps=args.chunk_steps, lookahead_steps=la, max_batch=streams,
                                          slots=streams, torch_threads=0))
        await c.start()
        try:
            async def push(i: int) -> None:
                s = c.open_stream()
                await s.push(xs[i][:la])
                for r in range(rounds):
                    a = la + r * args.chunk_steps
                    await s.push(xs[i][a : a + args.chunk_steps], final=r == rounds - 1)

            return await drive(push)
        finally:
            await c.close()

    for name, fn in (("thread", in_thread), ("process", in_process)):
        row = {"placement": name, "streams": streams, **asyncio.run(fn())}
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    from engine.config import EngineConfig

    ap = argparse.ArgumentParser(prog="python -m bench.decoder_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--no-spice", dest="spice", action="store_false", help="keep the checkpoint's layer scales")
    ap.add_argument("--device", default="cuda" if os.environ.get("CUDA_VISIBLE_DEVICES", "x") != "" else "cpu")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--chunk-steps", type=int, default=16)
    ap.add_argument("--first-chunk-steps", type=int, default=4)
    ap.add_argument("--lookahead", type=int, default=8, help="window of the speed section [8: the default; -1: exact]")
    ap.add_argument("--lookaheads", default="0,2,4,8,16,52")
    ap.add_argument("--left-steps", type=int, default=EngineConfig().decoder_left_steps,
                    help="left context in lookahead mode (-1: the exact reach)")
    ap.add_argument("--lefts", default="52,32,24,16,8",
                    help="table: left contexts, at the exact lookahead (their own error) and at --lookahead")
    ap.add_argument("--dtypes", default="float16,float16+compile",
                    help="dtype section: variants compared with float32 (DTYPE or DTYPE+compile: torch.compile'd)")
    ap.add_argument("--steps", type=int, default=200, help="steps per utterance (table)")
    ap.add_argument("--utterances", type=int, default=8)
    ap.add_argument("--step-ms", type=float, default=2.0, help="GPT ms per step at 1 stream (table's ms column)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--sections", default="speed,table,placement",
                    help="any of speed, dtype, contention (CUDA), table, placement")
    ap.add_argument("--contention-batches", default="4,16,64")
    ap.add_argument("--contention-hogs", type=int, default=2, help="GPU load processes beside the decoder")
    ap.add_argument("--placement-streams", type=int, default=64)
    ap.add_argument("--placement-rounds", type=int, default=10)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    import torch

    from engine.decoder.nets import load_vocoder

    if args.device == "cpu":
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    tmp = tempfile.TemporaryDirectory(prefix="decoder_bench_")
    model_dir = Path(args.model_dir) if args.model_dir else make_model(Path(tmp.name), args.spice)
    voc = load_vocoder(model_dir, device=args.device)
    res: dict[str, Any] = {"device": args.device, "model_dir": str(model_dir), "spiced": args.spice and not args.model_dir}
    if args.device.startswith("cuda"):
        res["gpu"] = torch.cuda.get_device_name(0)
    sections = set(args.sections.split(","))
    if "speed" in sections:
        res["speed"] = speed(voc, args)
    if "dtype" in sections:
        res["dtype"] = dtype_table(voc, args)
    if "contention" in sections and args.device.startswith("cuda"):
        res["contention"] = contention(voc, args)
    if "table" in sections:
        res["lookahead"] = lookahead_table(voc, args)
    if "placement" in sections:
        res["placement"] = placement(voc, args, model_dir)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(res, indent=1))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Streaming decoder benchmark: our decoder vs upstream ChatTTS's re-decode streaming.

Measured on random weights of the released model's shapes (a checkpoint is generated in a
temporary directory unless ``--model-dir`` is given). Per vocoding path (codes -> DVAE,
hidden states -> Decoder):

1. utterance cost: one ``--seconds`` utterance decoded (a) whole, once; (b) by our streaming
   decoder, steps arriving one at a time and pushed by the chunk policy; (c) the way upstream
   ``Chat.infer(stream=True)`` does it: every 24 steps re-decode the whole prefix and slice
   off the new tail (first audio after 72 steps; ``stream_speed`` 12000), with upstream's own
   modules when ``chattts`` is importable (else our whole decode). Ratio (c)/(b), and each
   output's max deviation from (a).
2. first audio: GPT steps before the first chunk and the decode time of the forward that
   emits it, per ``first_chunk_steps``; decode cost per push size (the per-forward overhead).
3. batched throughput: B streams of ``--seconds`` each, pushed in lockstep (``chunk_steps``
   per push), one batched forward per round: seconds of audio decoded per wall second.

Bounded: sizes are capped and ``--budget-s`` stops optional sections when exceeded. Run
under the shared heavy lock: ``flock /tmp/voicegw-heavy.lock python -m bench.decoder_bench``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

STEPS_PER_S = 24_000 / 512  # 46.875 GPT steps per second of audio


def _make_model(tmp: Path) -> Path:
    from engine.checkpoint import FULL, make_checkpoint

    spec = dataclasses.replace(
        FULL, gpt_layers=1, gpt_intermediate=256, gpt_vocab=256, dvae_enc_layers=1, dvae_enc_hidden=32
    )
    return make_checkpoint(tmp / "full", spec, seed=0)


def _inputs(uses_codes: bool, step_dim: int, steps: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if uses_codes:
        return rng.integers(0, 625, (steps, 4))
    return rng.normal(size=(steps, step_dim)).astype(np.float32)


T = TypeVar("T")


def _timed(fn: Callable[..., T], *args: Any) -> tuple[float, T]:
    t = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t, out


def stream_ours(sv, policy, x: np.ndarray) -> tuple[float, np.ndarray, int, float]:  # type: ignore[no-untyped-def]
    """Steps arrive one at a time; push when the policy says. Returns (decode seconds, audio,
    steps before first audio, decode seconds of the forward that emitted the first audio)."""
    from engine.decoder.streaming import DecodeJob

    st = sv.open()
    exact = policy.lookahead_steps >= sv.geometry.exact_lookahead_steps
    total = 0.0
    parts = []
    decoded = 0
    first_steps, first_dt = -1, 0.0
    n = len(x)
    for received in range(1, n + 1):
        final = received == n
        if not policy.ready(received, decoded, final):
            continue
        emit = None if (exact or final) else policy.emit_steps(received)
        dt, outs = _timed(sv.decode, [DecodeJob(st, x[decoded:received], final, emit)])
        out = outs[0]
        decoded = received
        total += dt
        parts.append(out)
        if first_steps < 0 and len(out):
            first_steps, first_dt = received, dt
    return total, np.concatenate(parts), first_steps, first_dt


def stream_upstream(decode_whole: Callable[[np.ndarray], np.ndarray], x: np.ndarray) -> tuple[float, np.ndarray, float]:
    """Upstream ``infer(stream=True)``: decode the prefix every 24 steps (and at the end),
    skip the first 2 yields, emit ``wavs[length : length + 12000]``, finally the rest."""
    stream_batch, stream_speed, pass_first = 24, 12000, 2
    n = len(x)
    total = 0.0
    length = 0
    count = 0
    parts = []
    first_dt = 0.0
    ends = list(range(stream_batch, n + 1, stream_batch))
    if not ends or ends[-1] != n:
        ends.append(n)  # the generator's final yield with the whole result
    wav = np.zeros(0, np.float32)
    for k, end in enumerate(ends):
        dt, wav = _timed(decode_whole, x[:end])
        total += dt
        last = k == len(ends) - 1
        count += 1
        if count <= pass_first and not last:
            continue
        a, b = length, min(length + stream_speed, len(wav))
        if not first_dt:
            first_dt = dt
        parts.append(wav[a:b])
        length = b
    parts.append(wav[length:])  # after the generator: the remaining tail of the last decode
    return total, np.concatenate(parts), first_dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.decoder_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", help="checkpoint (upstream layout); default: random full-size in a temp dir")
    ap.add_argument("--seconds", type=float, default=10.0, help="utterance length (default 10, max 60)")
    ap.add_argument("--paths", default="codes,hidden", help="vocoding paths: codes (DVAE), hidden (Decoder)")
    ap.add_argument("--first-chunk-steps", type=int, default=6)
    ap.add_argument("--chunk-steps", type=int, default=16)
    ap.add_argument("--lookahead-steps", type=int, default=-1, help="-1: exact (derived receptive field)")
    ap.add_argument("--alt-lookaheads", default="0,8,16",
                    help="provisional lookaheads (steps) also shown in the first-audio table")
    ap.add_argument("--batches", default="1,8,32", help="batch sizes for the throughput table (max 64)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--repeats", type=int, default=3, help="repeats of the utterance table (median)")
    ap.add_argument("--budget-s", type=float, default=600.0, help="skip remaining optional sections after this")
    args = ap.parse_args(argv)
    if not 0 < args.seconds <= 60:
        ap.error("--seconds must be in (0, 60]")
    batches = [int(b) for b in args.batches.split(",") if b]
    if any(not 1 <= b <= 64 for b in batches):
        ap.error("--batches: each in 1..64")

    import torch

    from engine._compat import ensure_torch_companions


    ensure_torch_companions()  # before anything imports transformers, vocos or chattts
    from engine.decoder.nets import load_vocoder
    from engine.decoder.streaming import DecodeJob, StreamingVocoder
    from engine.decoder.window import ChunkPolicy

    logging.disable(logging.WARNING)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    tmp = tempfile.TemporaryDirectory(prefix="decoder_bench_")
    model_dir = Path(args.model_dir) if args.model_dir else _make_model(Path(tmp.name))
    steps = int(round(args.seconds * STEPS_PER_S))
    chat: Any = None
    try:
        from tests.upstream import load_upstream_chat

        chat = load_upstream_chat(model_dir)
    except Exception as exc:  # noqa: BLE001 - optional oracle
        print(f"(upstream chattts unavailable: {exc!r}; emulating with our whole decode)")

    print(f"# decoder bench: {args.seconds:g} s utterances = {steps} steps; torch threads {args.threads}; "
          f"model {model_dir}")
    print(f"# our policy: first_chunk_steps {args.first_chunk_steps}, chunk_steps {args.chunk_steps}, "
          f"lookahead {'exact' if args.lookahead_steps < 0 else args.lookahead_steps}")
    paths = [p for p in args.paths.split(",") if p]
    summary: dict[str, dict[str, float]] = {}
    alt_rows: dict[str, list[tuple[int, int, float, float, float, float]]] = {}
    vocs = {}
    for path in paths:
        voc = load_vocoder(model_dir, use_hidden=(path == "hidden"))
        vocs[path] = voc
        g = voc.geometry
        la = g.exact_lookahead_steps if args.lookahead_steps < 0 else min(args.lookahead_steps, g.exact_lookahead_steps)
        policy = ChunkPolicy(args.first_chunk_steps, args.chunk_steps, la)
        sv = StreamingVocoder(voc)
        x = _inputs(voc.uses_codes, voc.front.step_dim, steps, seed=1)
        params = sum(p.numel() for p in voc.parameters())

        def whole(xx: np.ndarray, voc=voc) -> np.ndarray:
            return voc.decode_whole(torch.from_numpy(xx)).numpy()

        def ups_whole(xx: np.ndarray, path: str = path, whole: Callable[[np.ndarray], np.ndarray] = whole) -> np.ndarray:
            if chat is None:
                return whole(xx)
            return chat._decode_to_wavs([torch.from_numpy(xx)], path == "hidden")[0]  # type: ignore[no-any-return]

        rows = []
        for _ in range(max(1, args.repeats)):
            t_whole, ref = _timed(whole, x)
            t_ours, out, first_steps, first_dt = stream_ours(sv, policy, x)
            t_ups, ups, ups_first_dt = stream_upstream(ups_whole, x)
            rows.append((t_whole, t_ours, t_ups, first_dt, ups_first_dt))
        med = [statistics.median(r[i] for r in rows) for i in range(5)]
        ref = np.asarray(ref)
        alts = []
        for alt in [int(a) for a in args.alt_lookaheads.split(",") if a]:
            if alt >= g.exact_lookahead_steps:
                continue
            p_alt = ChunkPolicy(args.first_chunk_steps, args.chunk_steps, alt)
            t_alt, o_alt, fs_alt, fd_alt = stream_ours(StreamingVocoder(voc), p_alt, x)
            err = o_alt - ref
            snr = 10 * np.log10(float((ref**2).sum()) / max(float((err**2).sum()), 1e-30))
            alts.append((alt, fs_alt, fd_alt * 1e3, t_alt * 1e3, float(np.abs(err).max()), snr))
        summary[path] = dict(
            params_m=params / 1e6, whole=med[0], ours=med[1], ups=med[2], first_steps=first_steps,
            first_ms=med[3] * 1e3, ups_first_ms=med[4] * 1e3,
            err_ours=float(np.abs(out - ref).max()) if out.shape == ref.shape else float("nan"),
            err_ups=float(np.abs(ups - ref).max()) if ups.shape == ref.shape else float("nan"),
            len_ok=float(out.shape == ref.shape), ups_len_ok=float(ups.shape == ref.shape),
            reach=float(g.reach.right), la=float(la),
        )
        alt_rows[path] = alts

    print(f"\n## 1. One utterance: total decode time (median of {max(1, args.repeats)})")
    print("| path | params | reach (frames) | whole once | ours streaming | upstream re-decode | upstream/ours "
          "| ours/whole | max err ours | max err upstream |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for path, s in summary.items():
        print(f"| {path} | {s['params_m']:.1f} M | ±{s['reach']:.0f} | {s['whole']*1e3:.0f} ms | {s['ours']*1e3:.0f} ms "
              f"| {s['ups']*1e3:.0f} ms | {s['ups']/s['ours']:.1f}x | {s['ours']/s['whole']:.2f}x "
              f"| {s['err_ours']:.1e} | {s['err_ups']:.1e} |")
    print("\n## 2. First audio")
    print("| path | ours: steps before first audio | ours: decode ms of that forward | upstream: steps "
          "| upstream: decode ms of that re-decode |")
    print("|---|---|---|---|---|")
    for path, s in summary.items():
        print(f"| {path} | {s['first_steps']:.0f} ({args.first_chunk_steps} + lookahead {s['la']:.0f}) "
              f"| {s['first_ms']:.1f} | 72 | {s['ups_first_ms']:.1f} |")
    if any(alt_rows.values()):
        print("\n### 2a. Provisional mode (lookahead below exact; random weights: error numbers are NOT "
              "indicative of real-model quality)")
        print("| path | lookahead steps | steps before first audio | decode ms of that forward | total decode ms "
              "| max err vs whole | SNR vs whole |")
        print("|---|---|---|---|---|---|---|")
        for path, alts in alt_rows.items():
            for alt, fs, fd, tt, me, snr in alts:
                print(f"| {path} | {alt} | {fs} | {fd:.1f} | {tt:.0f} | {me:.1e} | {snr:.0f} dB |")

    # first_chunk_steps and push size: cost of one forward in steady state
    path0 = paths[0]
    voc = vocs[path0]
    sv = StreamingVocoder(voc)
    x = _inputs(voc.uses_codes, voc.front.step_dim, 400, seed=2)
    print(f"\n## 2b. Cost of one forward by push size ({path0}, steady state, median of 5)")
    print("| steps per push | ms per forward | ms per step of audio | x real time |")
    print("|---|---|---|---|")
    for k in (1, 2, 4, 6, 8, 12, 16, 24, 32):
        st = sv.open()
        sv.decode([DecodeJob(st, x[:120])])  # warm state past the lookahead
        times = []
        pos = 120
        for _ in range(5):
            dt, _o = _timed(sv.decode, [DecodeJob(st, x[pos : pos + k])])
            times.append(dt)
            pos += k
        m = statistics.median(times)
        print(f"| {k} | {m*1e3:.2f} | {m*1e3/k:.2f} | {(k / STEPS_PER_S) / m:.0f} |")

    print("\n## 3. Batched throughput (lockstep pushes of chunk_steps; audio s decoded per wall s)")
    print("| path | batch | forwards | wall s | audio s | audio s / s | mean ms per forward |")
    print("|---|---|---|---|---|---|---|")
    for path in paths:
        voc = vocs[path]
        sv = StreamingVocoder(voc)
        for b in batches:
            if time.perf_counter() - t_start > args.budget_s:
                print(f"| {path} | {b} | (skipped: budget {args.budget_s:.0f} s spent) |||||")
                continue
            xs = [_inputs(voc.uses_codes, voc.front.step_dim, steps, seed=10 + i) for i in range(b)]
            states = [sv.open() for _ in range(b)]
            wall = 0.0
            samples = 0
            forwards = 0
            for a in range(0, steps, args.chunk_steps):
                fin = a + args.chunk_steps >= steps
                jobs = [DecodeJob(s, xx[a : a + args.chunk_steps], fin) for s, xx in zip(states, xs, strict=True)]
                dt, outs = _timed(sv.decode, jobs)
                wall += dt
                forwards += 1
                samples += sum(len(o) for o in outs)
            audio_s = samples / 24000
            print(f"| {path} | {b} | {forwards} | {wall:.2f} | {audio_s:.0f} | {audio_s / wall:.0f} "
                  f"| {wall / forwards * 1e3:.1f} |")
    print(f"\n(total bench time {time.perf_counter() - t_start:.0f} s)")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Streaming decoder, this tree vs an older ``engine/decoder/streaming.py``, in one process.

Times one batched forward (``StreamingVocoder.decode``) of B streams pushing S steps each, after
the streams are primed past the lookahead, for both implementations, twice each (interleaved:
old, new, old, new), on the same vocoder weights. Prints ms per forward and seconds of audio
decoded per second (x real time); ratios are against the baseline measured in the same run.

    git show 5ad2b60:engine/decoder/streaming.py > /tmp/old_streaming.py
    python -m bench.decoder_compare --model-dir /tmp/ckfull --baseline /tmp/old_streaming.py \\
        --device cuda --out out/decoder_compare.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

STEPS_PER_S = 46.875


def load_baseline(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("voicegw_baseline_streaming", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def time_forward(mod: ModuleType, voc: Any, batch: int, steps: int, repeats: int, device: str) -> float:
    """Mean seconds per forward of ``batch`` streams pushing ``steps`` steps each."""
    sv = mod.StreamingVocoder(voc)
    cb = voc.front.vq_layer.quantizer.codebook_size
    rng = np.random.default_rng(0)
    states = [sv.open() for _ in range(batch)]

    def push(n: int) -> None:
        sv.decode([mod.DecodeJob(st, rng.integers(0, cb, size=(n, 4))) for st in states])

    push(60)  # past the exact lookahead: every later push emits audio
    push(steps)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        push(steps)
    return (time.perf_counter() - t0) / repeats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--baseline", required=True, help="an older engine/decoder/streaming.py")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,32,128,256")
    ap.add_argument("--chunks", default="3,16", help="steps per push")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    from engine.decoder import streaming as current
    from engine.decoder.nets import load_vocoder

    base = load_baseline(args.baseline)
    voc = load_vocoder(args.model_dir, use_hidden=False, device=args.device)
    batches = [int(b) for b in args.batches.split(",")]
    chunks = [int(c) for c in args.chunks.split(",")]
    times: dict[tuple[str, int, int], list[float]] = {}
    for _ in range(2):
        for name, mod in (("baseline", base), ("current", current)):
            for b in batches:
                for s in chunks:
                    times.setdefault((name, b, s), []).append(time_forward(mod, voc, b, s, args.repeats, args.device))
    rows: list[dict[str, Any]] = []
    print("| batch | steps per push | baseline ms/forward | current ms/forward | baseline x real time | current x real time | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for b in batches:
        for s in chunks:
            old = statistics.median(times[("baseline", b, s)])
            new = statistics.median(times[("current", b, s)])
            row = {"batch": b, "steps": s, "baseline_ms": round(old * 1e3, 2), "current_ms": round(new * 1e3, 2),
                   "baseline_x_realtime": round(b * s / STEPS_PER_S / old, 1),
                   "current_x_realtime": round(b * s / STEPS_PER_S / new, 1), "speedup": round(old / new, 2)}
            rows.append(row)
            print(f"| {b} | {s} | {row['baseline_ms']} | {row['current_ms']} | {row['baseline_x_realtime']} | "
                  f"{row['current_x_realtime']} | {row['speedup']}x |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"device": args.device, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

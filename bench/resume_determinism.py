"""Where resume inside a segment is exact: the same segment (text, voice, seed) generated
  (a) alone, (b) again alone, (c) beside ``--crowd`` other requests, and (d) resumed from its first
  ``k`` frames (``SpeechRequest.prefix_codes``) beside the crowd, compared frame for frame with (a).

Sampled (temperature 0.3, top-p 0.7, the product's defaults) with an explicit seed, as the gateway
samples every segment. Prints one JSON object: per case, the frames compared and the first frame
that differs (None: equal throughout).

    python3 -m bench.resume_determinism --device cuda --model-dir /tmp/ckfull --crowd 63 --out r.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from contextlib import aclosing
from pathlib import Path
from typing import Any

import numpy as np

TEXT = "good morning, the weather today is okay, and the rest of the week looks fine as well."
OTHER = "this request only keeps the batch busy while the measured one runs beside it."


async def _run(engine: Any, rid: str, text: str, seed: int, frames: int, prefix: np.ndarray | None = None) -> np.ndarray:
    from engine.api import SamplingParams, SpeechRequest

    params = SamplingParams(seed=seed, min_new_tokens=frames, max_new_tokens=frames)
    req = SpeechRequest(rid, text, speaker=11, params=params, prefix_codes=prefix)
    parts: list[np.ndarray] = []
    async with aclosing(engine.generate(req)) as stream:
        async for fr in stream:
            parts.append(fr.codes)
            if fr.finished:
                break
    return np.concatenate(parts) if parts else np.zeros((0, 4), np.int64)


def _first_diff(a: np.ndarray, b: np.ndarray) -> int | None:
    n = min(len(a), len(b))
    bad = np.nonzero((a[:n] != b[:n]).any(axis=1))[0]
    return int(bad[0]) if bad.size else (None if len(a) == len(b) else n)


async def main_async(a: argparse.Namespace) -> dict[str, Any]:
    from engine.build import build_code_engine
    from engine.config import EngineConfig

    cfg = EngineConfig(backend="vllm", device=a.device, max_num_seqs=max(64, a.crowd + 2),
                       enforce_eager=a.device == "cpu", max_model_len=1024)
    engine = build_code_engine(cfg, a.model_dir)
    t0 = time.monotonic()
    await engine.start()
    out: dict[str, Any] = {"device": a.device, "frames": a.frames, "crowd": a.crowd, "start_s": round(time.monotonic() - t0, 1)}
    try:
        seed = 1234
        alone = await _run(engine, "alone", TEXT, seed, a.frames)
        again = await _run(engine, "again", TEXT, seed, a.frames)

        async def beside(main: Any) -> Any:
            crowd = [asyncio.create_task(_run(engine, f"crowd-{i}", OTHER, 100 + i, a.frames)) for i in range(a.crowd)]
            await asyncio.sleep(0.05)  # the crowd is decoding when the measured request joins
            got = await main
            await asyncio.gather(*crowd)
            return got

        crowded = await beside(_run(engine, "crowded", TEXT, seed, a.frames))
        cases: dict[str, Any] = {
            "again_alone": _first_diff(alone, again),
            "beside_crowd": _first_diff(alone, crowded),
        }
        for k in a.k:
            tail = await beside(_run(engine, f"resume-{k}", TEXT, seed, a.frames, prefix=alone[:k]))
            cases[f"resumed_at_{k}_beside_crowd"] = _first_diff(alone[k:], tail)
            tail = await _run(engine, f"resume-alone-{k}", TEXT, seed, a.frames, prefix=alone[:k])
            cases[f"resumed_at_{k}_alone"] = _first_diff(alone[k:], tail)
        out["first_differing_frame"] = cases
        out["frames_alone"] = int(len(alone))
    finally:
        await engine.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default="/tmp/ckfull")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--frames", type=int, default=300)
    ap.add_argument("--crowd", type=int, default=63)
    ap.add_argument("--k", type=int, nargs="*", default=[16, 100])
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    res = asyncio.run(main_async(a))
    text = json.dumps(res, indent=1)
    print(text, flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

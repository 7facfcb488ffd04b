"""What a listener heard at a resume inside a segment: the segment's audio as the client received
it (before the drop and after the resume) held against a whole decode of the segment's codes (the
client has them all: ``segment.codes``), to find where the audio after the join really continues.

``join(...)`` (given the reference: ``reference_pcm`` of the codes) slides the audio after the join over the reference, ±300 ms, and takes the best
match: an offset of 0 means the listener went on at the next sample; ``d`` > 0 samples means ``d``
were skipped, ``d`` < 0 that ``-d`` were heard twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_VOCODERS: dict[str, Any] = {}


@dataclass(frozen=True)
class Join:
    offset_samples: int
    """Where the audio after the join matches the reference, relative to the next sample."""
    repeated_ms: float
    skipped_ms: float
    error_after: float
    """Relative error of the audio after the join against the reference at the best offset."""
    error_before: float
    """The same for the audio before the join at offset 0 (what was received before the drop)."""
    reference_samples: int


def reference_pcm(codes: np.ndarray, model_dir: Path, rate_hz: int) -> np.ndarray:
    """The segment's whole decode (codes -> DVAE -> Vocos), at ``rate_hz``, int16 scale."""
    import torch

    from engine.audio_format import StreamResampler, float_to_pcm16
    from engine.decoder.nets import load_vocoder

    key = str(model_dir)
    if key not in _VOCODERS:
        _VOCODERS[key] = load_vocoder(model_dir)
    with torch.inference_mode():
        audio = _VOCODERS[key].decode_whole(torch.from_numpy(codes)).numpy()
    pcm = float_to_pcm16(StreamResampler(24_000, rate_hz).process(audio, last=True))
    return np.asarray(pcm, dtype=np.float64)


def join(received: np.ndarray, heard: int, ref: np.ndarray, rate_hz: int,
         window_ms: float = 300.0, reach_ms: float = 300.0) -> Join:
    """``received``: the segment's samples in the order the client got them; the first ``heard``
    came before the drop. ``ref``: the segment's audio, uninterrupted (``reference_pcm`` of its
    codes; for an engine that makes the same samples again, another run's)."""
    ref = np.asarray(ref, dtype=np.float64)
    x = np.asarray(received, dtype=np.float64)
    n = int(min(window_ms * rate_hz / 1000, len(x) - heard))
    reach = int(reach_ms * rate_hz / 1000)
    after = x[heard:heard + n]
    best_d, best_err = 0, float("inf")
    for d in range(-min(reach, heard), reach + 1):
        seg = ref[heard + d:heard + d + n]
        if len(seg) < n:
            break
        err = float(np.linalg.norm(after - seg) / max(1.0, np.linalg.norm(seg)))
        if err < best_err:
            best_d, best_err = d, err
    m = min(heard, n)
    before = x[heard - m:heard]
    ref_before = ref[heard - m:heard]
    err_before = float(np.linalg.norm(before - ref_before) / max(1.0, np.linalg.norm(ref_before))) if m else 0.0
    ms = 1000.0 / rate_hz
    return Join(best_d, round(max(0, -best_d) * ms, 2), round(max(0, best_d) * ms, 2), round(best_err, 4),
                round(err_before, 4), len(ref))

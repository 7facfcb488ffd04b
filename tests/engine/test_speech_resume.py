"""A segment resumed from its codes (``ChatTTSSpeech``, vLLM on the tiny checkpoint): the
codes the engine hands out with its audio, given back as the request's prefix, make the audio go
on at any sample a client has: the samples from there equal the uninterrupted run's (seeded
sampling: the same new frames), at the native rate and resampled."""

from __future__ import annotations

from contextlib import aclosing
from typing import Any

import numpy as np
import pytest

from engine.api import SAMPLES_PER_STEP, ResumeMode, SamplingParams, SpeechRequest, codes_from_bytes

pytestmark = pytest.mark.vllm

TEXT = "then choose the network tab, near the top of the page."
FRAMES = 120


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.3, seed=1234, min_new_tokens=FRAMES, max_new_tokens=FRAMES)


async def _run(engine: Any, rid: str, rate: int, prefix: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    req = SpeechRequest(rid, TEXT, speaker=2222, params=_params(), sample_rate_hz=rate, prefix_codes=prefix)
    pcm, codes = b"", b""
    async with aclosing(engine.synthesize(req)) as stream:
        async for chunk in stream:
            pcm += chunk.pcm
            codes += chunk.codes
            if chunk.finished:
                break
    return np.frombuffer(pcm, "<i2").astype(np.int32), codes_from_bytes(codes)


@pytest.mark.parametrize("rate", [24_000, 16_000])
async def test_resumed_segment_goes_on_at_the_next_sample(speech_engine: Any, rate: int) -> None:
    if speech_engine.resume_mode is not ResumeMode.CODES:
        pytest.skip("the test engine does not resume from codes")
    full, codes = await _run(speech_engine, f"full-{rate}", rate)
    assert codes.shape == (FRAMES, 4), "every frame's codes come with the audio"
    per_frame = SAMPLES_PER_STEP * rate / 24_000
    assert abs(len(full) - FRAMES * per_frame) <= per_frame  # the last step is shorter (the STFT tail)
    for k, heard in ((40, 37 * SAMPLES_PER_STEP + 100), (80, 80 * SAMPLES_PER_STEP - 1)):
        skip = int(heard * rate / 24_000)
        tail, new = await _run(speech_engine, f"resume-{rate}-{k}", rate, prefix=codes[:k])
        np.testing.assert_array_equal(new, codes[k:], "seeded: the same frames as uninterrupted")
        assert len(tail) == len(full), "the audio is the whole segment's again"
        a, b = full[skip:], tail[skip:]
        err = np.abs(a - b)
        scale = max(1, int(np.abs(full).max()))
        assert err.max() <= 0.02 * scale, f"k={k}: the resumed audio departs from the uninterrupted by {err.max()}"

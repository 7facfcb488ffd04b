"""The synthetic code engine: pace, length, late consumers, abort (fast, no model)."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from engine.api import AUDIO_EOS, NUM_CODEBOOKS, SamplingParams, SpeechRequest
from engine.synthetic import STEP_MS, SyntheticCodeEngine, SyntheticPace


def test_pace_arithmetic() -> None:
    p = SyntheticPace(ttft_ms=40.0, steps_per_s=100.0, ms_per_char=STEP_MS)
    assert p.steps_due(0.039) == 0 and p.steps_due(0.040) == 1 and p.steps_due(0.0501) == 2
    assert p.due_at_s(0) == 0.04 and abs(p.due_at_s(10) - 0.14) < 1e-9
    assert p.steps_for(SpeechRequest("a", "ab cd")) == 4  # one step per non-space character
    assert p.steps_for(SpeechRequest("a", "x", params=SamplingParams(ignore_eos=True, max_new_tokens=7))) == 7


async def test_generate_paced_and_merged_when_late() -> None:
    eng = SyntheticCodeEngine(SyntheticPace(ttft_ms=10.0, steps_per_s=200.0, ms_per_char=STEP_MS))
    await eng.start()
    t0 = time.monotonic()
    frames = []
    async for f in eng.generate(SpeechRequest("a", "x" * 20, params=SamplingParams(seed=1))):
        frames.append(f)
        if len(frames) == 1:
            await asyncio.sleep(0.05)  # a late consumer gets what exists by then, in one frame
    took = time.monotonic() - t0
    codes = np.concatenate([f.codes for f in frames])
    assert codes.shape == (20, NUM_CODEBOOKS) and codes.min() >= 0 and codes.max() < AUDIO_EOS
    assert frames[-1].finished and frames[-1].finish_reason == "eos"
    assert not any(f.finished for f in frames[:-1])
    assert max(f.codes.shape[0] for f in frames) > 1  # the late pull took several steps at once
    assert took >= 0.01 + 19 / 200.0 - 0.005  # never faster than the pace
    assert eng.health().running_requests == 0
    await eng.close()


async def test_abort() -> None:
    eng = SyntheticCodeEngine(SyntheticPace(ttft_ms=0.0, steps_per_s=50.0))
    await eng.start()
    it = eng.generate(SpeechRequest("b", "hello world " * 20))
    first = await anext(it)
    assert not first.finished
    await eng.abort("b")
    last = None
    async for f in it:
        last = f
    assert last is not None and last.finished and last.finish_reason == "abort"
    assert eng.health().running_requests == 0

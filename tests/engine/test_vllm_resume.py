"""Resumable requests (``SpeechRequest.prefix_codes``): abort a segment after k frames, resume it
with those k frames as the prefix, and the concatenation equals the uninterrupted run frame for
frame (greedy; k inside the first 16-frame repetition window and beyond it, and past a full
128-token KV block, where a prefix-cache mix-up would show).

Negative control: the same resume with codebooks 1..3 of the prefix zeroed (codebook-0 tokens
unchanged, so vLLM's token ids are identical) must differ: the side codes reach the model
through the request state, and the cache salt keeps the two prompts' KV blocks apart.
"""

from __future__ import annotations

from contextlib import aclosing
from typing import Any

import numpy as np
import pytest

from engine.api import EngineError, SamplingParams, SpeechRequest

pytestmark = pytest.mark.vllm

TEXT = "good morning, the weather today is okay."
SPEAKER = 11
FRAMES = 200


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, min_new_tokens=FRAMES, max_new_tokens=FRAMES)


async def _run(engine: Any, rid: str, prefix: np.ndarray | None = None, stop_after: int | None = None) -> np.ndarray:
    req = SpeechRequest(rid, TEXT, speaker=SPEAKER, params=_params(), prefix_codes=prefix)
    parts: list[np.ndarray] = []
    got = 0
    aborted = False
    async with aclosing(engine.generate(req)) as stream:
        async for fr in stream:
            parts.append(fr.codes)
            got += len(fr.codes)
            if stop_after is not None and got >= stop_after and not aborted:
                aborted = True
                await engine.abort(rid)
            if fr.finished:
                if stop_after is None:
                    assert fr.finish_reason == "length"
                break
    codes = np.concatenate(parts) if parts else np.zeros((0, 4), np.int64)
    return codes if stop_after is None else codes[:stop_after]


_full: dict[str, np.ndarray] = {}


async def _uninterrupted(engine: Any) -> np.ndarray:
    if "codes" not in _full:
        _full["codes"] = await _run(engine, "resume-full")
        assert _full["codes"].shape == (FRAMES, 4)
    return _full["codes"]


@pytest.mark.parametrize("k", [1, 5, 16, 40, 150])
async def test_resume_continues_frame_for_frame(vllm_engine: Any, k: int) -> None:
    full = await _uninterrupted(vllm_engine)
    head = await _run(vllm_engine, f"resume-head-{k}", stop_after=k)
    assert head.shape == (k, 4)
    np.testing.assert_array_equal(head, full[:k])
    tail = await _run(vllm_engine, f"resume-tail-{k}", prefix=head)
    assert tail.shape == (FRAMES - k, 4), "the resumed request yields only the new frames"
    bad = np.nonzero((tail != full[k:]).any(axis=1))[0]
    assert bad.size == 0, f"k={k}: resumed frames differ first at {k + bad[0]}: {tail[bad[0]]} vs {full[k + bad[0]]}"
    assert vllm_engine.health().running_requests == 0


@pytest.mark.parametrize("k", [16, 150])
async def test_resume_negative_control_side_codes_zeroed(vllm_engine: Any, k: int) -> None:
    full = await _uninterrupted(vllm_engine)
    # The correct resume first: its blocks are in the prefix cache when the wrong one runs.
    ok = await _run(vllm_engine, f"resume-ok-{k}", prefix=full[:k])
    np.testing.assert_array_equal(ok, full[k:])
    wrong = full[:k].copy()
    wrong[:, 1:] = 0
    tail = await _run(vllm_engine, f"resume-wrong-{k}", prefix=wrong)
    assert tail.shape == (FRAMES - k, 4)
    assert (tail != full[k:]).any(), "zeroed side codes in the prefix did not change the continuation"


async def test_resume_rejects_bad_prefix(vllm_engine: Any) -> None:
    with pytest.raises(EngineError):
        vllm_engine.build(SpeechRequest("bad-1", TEXT, params=_params(), prefix_codes=np.zeros((3, 2), np.int64)))
    with pytest.raises(EngineError):
        vllm_engine.build(SpeechRequest("bad-2", TEXT, params=_params(), prefix_codes=np.zeros((FRAMES, 4), np.int64)))
    with pytest.raises(EngineError):
        vllm_engine.build(SpeechRequest("bad-3", TEXT, params=_params(), prefix_codes=np.full((2, 4), 999, np.int64)))


async def test_resume_of_a_segment_that_ran_to_its_length_generates_nothing(vllm_engine: Any) -> None:
    req = SpeechRequest("full-prefix", TEXT, params=_params(), prefix_codes=np.zeros((FRAMES, 4), np.int64))
    frames = [f async for f in vllm_engine.generate(req)]
    assert [(len(f.codes), f.finished, f.finish_reason) for f in frames] == [(0, True, "length")]
    assert vllm_engine.health().running_requests == 0

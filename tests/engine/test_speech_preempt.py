"""``ChatTTSSpeech.preempt``: a running segment's code request is aborted and resumed (prefix =
the frames received so far) at another priority; the audio the consumer gets is the same PCM as
an uninterrupted run (greedy, exact decoder), without gap or duplicate frames.

Runs on the session's vLLM engine (``speech_engine`` with ``VOICEGW_TEST_ENGINE=vllm``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from engine.api import SamplingParams, SpeechRequest

pytestmark = pytest.mark.vllm

TEXT = "hello world, this is a test."
FRAMES = 240


def _request(rid: str) -> SpeechRequest:
    return SpeechRequest(
        rid, TEXT, speaker=3, params=SamplingParams(temperature=0.0, min_new_tokens=FRAMES, max_new_tokens=FRAMES)
    )


async def _pcm(speech: Any, rid: str, preempt_after_chunks: tuple[int, ...] = ()) -> tuple[bytes, int, int]:
    """(PCM, steps, preemptions seen); the segment's code frames go to ``_CODES[rid]``."""
    chunks = 0
    steps = 0
    out = bytearray()
    seen_preemptions = 0
    todo = list(preempt_after_chunks)
    it = speech.synthesize(_request(rid))
    async for ch in it:
        out += ch.pcm
        steps += ch.steps
        chunks += 1
        if ch.steps and len(todo) == len(preempt_after_chunks) and not ch.finished:
            assert not speech.awaiting_slot(rid), "a segment that produces is not waiting for a slot"
        if todo and chunks >= todo[0] and speech.can_preempt(rid):  # a resumed one: once it runs again
            todo.pop(0)
            assert await speech.preempt(rid, 7 + chunks), "preempt refused on a running segment"
        n = speech.preemptions(rid)
        if n is not None:
            seen_preemptions = max(seen_preemptions, n)
            _STREAMS[rid] = speech._codes[rid]
        if ch.finished:
            break
    await it.aclose()
    return bytes(out), steps, seen_preemptions


_STREAMS: dict[str, Any] = {}


def _codes(rid: str) -> np.ndarray:
    return np.concatenate(_STREAMS[rid]._parts)


def _assert_same_pcm(got: bytes, want: bytes) -> None:
    """Same samples up to the decoder's float rounding (chunk boundaries follow arrival timing;
    the streaming decoder equals the whole decode within float tolerance: 1-2 LSB of int16)."""
    a = np.frombuffer(got, dtype=np.int16).astype(np.int32)
    b = np.frombuffer(want, dtype=np.int16).astype(np.int32)
    assert a.shape == b.shape
    assert int(np.abs(a - b).max()) <= 2


@pytest.fixture
def speech(speech_engine: Any) -> Iterator[Any]:
    if not getattr(speech_engine, "supports_preempt", False):
        pytest.skip("preemption needs the vLLM code engine (VOICEGW_TEST_ENGINE=vllm)")
    speech_engine.enable_preemption(True)
    try:
        yield speech_engine
    finally:
        speech_engine.enable_preemption(False)


async def test_preempted_segment_gives_the_same_pcm(speech: Any) -> None:
    want, steps, _ = await _pcm(speech, "pre-ref")
    assert steps == FRAMES
    got, steps2, n = await _pcm(speech, "pre-once", preempt_after_chunks=(1,))
    assert n == 1, "the segment was not resumed"
    assert steps2 == FRAMES
    np.testing.assert_array_equal(_codes("pre-once"), _codes("pre-ref"))
    assert _codes("pre-ref").shape == (FRAMES, 4)
    _assert_same_pcm(got, want)
    got2, _, n2 = await _pcm(speech, "pre-twice", preempt_after_chunks=(1, 3))
    assert n2 == 2
    np.testing.assert_array_equal(_codes("pre-twice"), _codes("pre-ref"))
    _assert_same_pcm(got2, want)
    assert speech.health().running_requests == 0


async def test_preempt_unknown_or_finished_segment_is_refused(speech: Any) -> None:
    assert not await speech.preempt("no-such-segment", 5)
    pcm, _, _ = await _pcm(speech, "pre-done")
    assert pcm
    assert not await speech.preempt("pre-done", 5)


async def test_abort_during_resumed_segment(speech: Any) -> None:
    rid = "pre-abort"
    it = speech.synthesize(_request(rid))
    chunks = []
    async for ch in it:
        chunks.append(ch)
        if len(chunks) == 1:
            assert await speech.preempt(rid, 9)
        elif len(chunks) == 2:
            await speech.abort(rid)
        if ch.finished:
            break
    await it.aclose()
    assert chunks[-1].finished
    assert sum(c.steps for c in chunks) <= FRAMES
    assert speech.health().running_requests == 0
    assert speech.preemptions(rid) is None  # forgotten once the stream is closed



async def test_requeue_right_after_submission_gives_the_same_codes(speech: Any) -> None:
    """``reprioritize`` on the real engine: called as soon as the segment's code request is
    submitted (before its first frame, as a rule), it restarts the request; frames that raced in
    become the prefix. Either way the codes and audio equal an uninterrupted run."""
    import asyncio

    target = asyncio.create_task(_pcm(speech, "rq-target"))
    for _ in range(3000):
        if speech.submitted("rq-target"):
            break
        await asyncio.sleep(0.001)
    waiting = speech.awaiting_slot("rq-target")
    requeued = await speech.reprioritize("rq-target", -5)
    assert requeued or not waiting
    codes = speech._codes["rq-target"]
    got, steps, _ = await target
    assert codes.requeues == int(requeued) and codes.preemptions == 0
    want, _, _ = await _pcm(speech, "rq-ref")
    assert steps == FRAMES
    np.testing.assert_array_equal(_codes("rq-target"), _codes("rq-ref"))
    _assert_same_pcm(got, want)
    assert not await speech.reprioritize("rq-ref", 1), "a finished segment is not requeued"
    assert not await speech.reprioritize("no-such-segment", 1)
    assert speech.health().running_requests == 0

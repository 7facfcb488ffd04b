"""``engine.speech.ResumableCodes.requeue`` over a gated fake code engine (no model): a request
that waits for a batch slot is aborted and resubmitted at the new priority; its consumer sees
one uninterrupted stream of frames."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import numpy as np

from engine.api import CodeFrames, SpeechRequest
from engine.speech import ResumableCodes


async def _until(cond: Callable[[], bool], within_s: float = 5.0) -> None:
    for _ in range(int(within_s * 1000)):
        if cond():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("timed out")


class GatedCodeEngine:
    """A request produces nothing until ``grant`` (its batch slot); abort ends it at once."""

    def __init__(self, frames: int) -> None:
        self.codes = np.arange(frames * 4, dtype=np.int64).reshape(frames, 4)
        self.slots = asyncio.Event()
        self.aborted: set[str] = set()
        self.submitted: list[tuple[str, int, int]] = []
        """(engine request id, priority, prefix frames) per ``generate``."""

    async def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    async def generate(self, request: SpeechRequest) -> AsyncIterator[CodeFrames]:
        rid = request.request_id
        prefix = 0 if request.prefix_codes is None else len(request.prefix_codes)
        self.submitted.append((rid, request.priority, prefix))
        await _until(lambda: self.slots.is_set() or rid in self.aborted)
        for pos in range(prefix, len(self.codes)):
            if rid in self.aborted:
                yield CodeFrames(rid, self.codes[:0], finished=True, finish_reason="abort")
                return
            fin = pos + 1 == len(self.codes)
            yield CodeFrames(rid, self.codes[pos : pos + 1], finished=fin, finish_reason="eos" if fin else None)
            await asyncio.sleep(0)


async def test_requeue_while_waiting_then_frames_flow() -> None:
    code = GatedCodeEngine(frames=5)
    codes = ResumableCodes(code, SpeechRequest("s-1-1", "text", priority=40))  # type: ignore[arg-type]
    got: list[np.ndarray] = []

    async def consume() -> None:
        async for fr in codes:
            got.append(fr.codes)
            assert fr.request_id == "s-1-1"

    task = asyncio.create_task(consume())
    await _until(codes.awaiting_frames)
    assert await codes.requeue(7)
    assert not await codes.requeue(6), "a requeue in flight is not repeated"
    await _until(lambda: len(code.submitted) >= 2)
    assert code.submitted == [("s-1-1", 40, 0), ("s-1-1.p1", 7, 0)]
    assert codes.awaiting_frames() and not codes.preemptible()
    code.slots.set()
    await asyncio.wait_for(task, 5)
    np.testing.assert_array_equal(np.concatenate(got), code.codes)
    assert codes.requeues == 1 and codes.preemptions == 0
    assert not await codes.requeue(5), "a finished request is not requeued"
    await codes.aclose()


async def test_requeue_refused_once_producing() -> None:
    code = GatedCodeEngine(frames=50)
    code.slots.set()
    codes = ResumableCodes(code, SpeechRequest("s-2-1", "text"))  # type: ignore[arg-type]
    it = aiter(codes)
    first = await anext(it)
    assert first.codes.shape == (1, 4)
    assert not codes.awaiting_frames()
    assert not await codes.requeue(1)
    assert code.submitted == [("s-2-1", 0, 0)]
    await codes.aclose()


class LateAbortCodeEngine:
    """Every frame arrives, and only then the abort takes effect (reported as ``abort``): a
    requeue that lost the race against the request's last step."""

    def __init__(self, frames: int) -> None:
        self.codes = np.arange(frames * 4, dtype=np.int64).reshape(frames, 4)
        self.submitted: list[str] = []
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def abort(self, request_id: str) -> None:
        self.release.set()

    async def generate(self, request: SpeechRequest) -> AsyncIterator[CodeFrames]:
        rid = request.request_id
        self.submitted.append(rid)
        self.started.set()
        await self.release.wait()
        yield CodeFrames(rid, self.codes, finished=False)
        yield CodeFrames(rid, self.codes[:0], finished=True, finish_reason="abort")


async def test_requeue_that_loses_the_race_to_the_last_step_finishes() -> None:
    """All steps arrived before the abort: the segment ends ("length"), it is not resubmitted
    with a prefix that leaves no step (the engine would refuse it)."""
    from engine.api import SamplingParams

    code = LateAbortCodeEngine(frames=6)
    req = SpeechRequest("s-2-1", "text", priority=40, params=SamplingParams(max_new_tokens=6, min_new_tokens=6))
    codes = ResumableCodes(code, req)  # type: ignore[arg-type]
    got: list[CodeFrames] = []

    async def consume() -> None:
        async for fr in codes:
            got.append(fr)

    task = asyncio.create_task(consume())
    await asyncio.wait_for(code.started.wait(), 5)
    await _until(lambda: codes.awaiting_frames())
    assert await codes.requeue(10)
    await asyncio.wait_for(task, 5)
    assert code.submitted == ["s-2-1"], "resubmitted although every step had arrived"
    assert sum(len(f.codes) for f in got) == 6
    assert got[-1].finished and got[-1].finish_reason == "length"

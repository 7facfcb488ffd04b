"""A simulated batch engine with vLLM's scheduling semantics (for policy experiments and tests).

Not a benchmark of anything real: it lets the load test show what a scheduling policy does in
seconds, without a model. It mimics the parts of vLLM v1 (0.32) that decide time to first
audio:

* every ``step`` all RUNNING requests advance one GPT step together; a step takes
  ``step_ms_base + step_ms_per_seq * batch`` (+ ``prefill_ms`` when a request joins);
* at most ``max_num_seqs`` run; the others WAIT in a queue ordered by ``(priority, arrival)``
  (policy ``priority``) or by arrival (``fcfs``); running requests are never preempted
  (no KV pressure modelled);
* a request makes ``ms_per_char * len(text)`` of audio, ``SAMPLES_PER_STEP`` per step; audio
  is handed out by the streaming decoder's own rule (``engine.decoder.window.ChunkPolicy`` fed
  with the stream's ``StreamLead``, no lookahead): ``first_chunk_steps``, then chunks that
  follow the audio the listener still has ahead, up to ``chunk_steps``; PCM is silence.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.api import (
    NATIVE_SAMPLE_RATE_HZ,
    SAMPLES_PER_STEP,
    AudioChunk,
    EngineError,
    EngineHealth,
    SpeechRequest,
)
from engine.decoder.window import ChunkPolicy, StreamLead


@dataclass
class _Req:
    request: SpeechRequest
    arrival: int
    total_steps: int
    queue: asyncio.Queue[AudioChunk | None]
    lead: StreamLead
    steps: int = 0
    emitted_steps: int = 0


@dataclass
class SimBatchEngine:
    name: str = "sim-batch"
    native_sample_rate_hz: int = NATIVE_SAMPLE_RATE_HZ
    policy: str = "priority"
    max_num_seqs: int = 8
    step_ms_base: float = 8.0
    step_ms_per_seq: float = 0.5
    prefill_ms: float = 4.0
    ms_per_char: float = 60.0
    first_chunk_steps: int = 6
    chunk_steps: int = 16
    running: list[_Req] = field(default_factory=list)
    waiting: list[_Req] = field(default_factory=list)
    steps_run: int = 0
    _counter: itertools.count[int] = field(default_factory=itertools.count)
    _wake: asyncio.Event | None = None
    _task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._task = None

    def health(self) -> EngineHealth:
        return EngineHealth(self.name, self._task is not None, len(self.running) + len(self.waiting))

    async def abort(self, request_id: str) -> None:
        for lst in (self.running, self.waiting):
            for r in list(lst):
                if r.request.request_id == request_id:
                    lst.remove(r)
                    r.queue.put_nowait(None)

    def synthesize(self, request: SpeechRequest) -> AsyncIterator[AudioChunk]:
        return self._gen(request)

    async def _gen(self, request: SpeechRequest) -> AsyncIterator[AudioChunk]:
        if self._task is None or self._wake is None:
            raise EngineError("sim engine not started")
        total = max(1, round(len(request.text) * self.ms_per_char / (SAMPLES_PER_STEP / 24.0)))
        req = _Req(request, next(self._counter), total, asyncio.Queue(), StreamLead(SAMPLES_PER_STEP / NATIVE_SAMPLE_RATE_HZ))
        self.waiting.append(req)
        self._wake.set()
        try:
            while True:
                chunk = await req.queue.get()
                if chunk is None:
                    return
                yield chunk
                if chunk.finished:
                    return
        finally:
            await self.abort(request.request_id)

    def _admit(self) -> int:
        admitted = 0
        key = (lambda r: (r.request.priority, r.arrival)) if self.policy == "priority" else (lambda r: r.arrival)
        self.waiting.sort(key=key)
        while self.waiting and len(self.running) < self.max_num_seqs:
            self.running.append(self.waiting.pop(0))
            admitted += 1
        return admitted

    async def _loop(self) -> None:
        assert self._wake is not None
        policy = ChunkPolicy(self.first_chunk_steps, self.chunk_steps, 0)
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
            admitted = self._admit()
            step_ms = self.step_ms_base + self.step_ms_per_seq * len(self.running) + self.prefill_ms * admitted
            await asyncio.sleep(step_ms / 1000.0)
            self.steps_run += 1
            now = asyncio.get_running_loop().time()
            for r in list(self.running):
                r.steps += 1
                done = r.steps >= r.total_steps
                pending = r.steps - r.emitted_steps
                due = policy.next_chunk_steps(r.emitted_steps, r.lead.lead_steps(now))
                if done or pending >= due:
                    r.lead.emitted(pending, now)
                    rate = r.request.sample_rate_hz
                    n = pending * SAMPLES_PER_STEP * rate // NATIVE_SAMPLE_RATE_HZ
                    r.emitted_steps = r.steps
                    r.queue.put_nowait(AudioChunk(r.request.request_id, bytes(2 * n), rate, finished=done,
                                                  steps=pending))
                if done:
                    self.running.remove(r)

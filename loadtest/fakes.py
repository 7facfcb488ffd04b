"""Simulated speech engines: no model, for tests and the load test.

``FakeSpeechEngine``: a sine tone paced like a real engine, lazily generated (the tests' engine
double, and ``loadtest.serve --engine fake``).

* Audio length is proportional to the text (``ms_per_char``), so tests can predict it.
* Generation is lazy: a chunk is made only when the consumer asks for it (like the real engine,
  whose decoder runs when the iterator is pulled), after ``first_chunk_delay_s`` for the first
  chunk and ``chunk_ms / speed`` for later ones.
* ``running_requests`` counts requests whose iterator started and has neither finished, been
  aborted nor been closed/cancelled: it must return to 0 after aborts and disconnects.
* Failure injection: text containing ``fail_marker`` raises a recoverable EngineError after the
  first chunk; ``overload_marker`` raises EngineOverloaded before any audio; ``crash_marker``
  raises an unrecoverable EngineError; ``cancel_marker`` raises CancelledError from a future
  cancelled under the stream (its task is not cancelled).

``SimBatchEngine``: a batch engine with vLLM's scheduling semantics (``--engine sim``).

``CountingEngine``: wraps any ``SpeechEngine``, counts each request's samples (the dialect tests).
``FakeCodeEngine``: a ``CodeEngine`` that yields predetermined codes in pieces (the streaming
decoder's tests under ``ChatTTSSpeech``).

Not a benchmark of anything real: it lets the load test show what batching and admission do
in seconds, without a model. It mimics the parts of vLLM v1 (0.32) that decide time to first
audio:

* every ``step`` all RUNNING requests advance one GPT step together; a step takes
  ``step_ms_base + step_ms_per_seq * batch`` (+ ``prefill_ms`` when a request joins);
* at most ``max_num_seqs`` run; the others WAIT in arrival order (vLLM's ``fcfs``); running
  requests are never preempted (no KV pressure modelled);
* a request makes ``ms_per_char * len(text)`` of audio, ``SAMPLES_PER_STEP`` per step; audio
  is handed out by the streaming decoder's own rule (``engine.decoder.window.ChunkPolicy`` fed
  with the stream's ``StreamLead``, no lookahead): ``first_chunk_steps``, then chunks that
  follow the audio the listener still has ahead, up to ``chunk_steps``; PCM is silence.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from engine.api import (
    NATIVE_SAMPLE_RATE_HZ,
    SAMPLES_PER_STEP,
    AudioChunk,
    CodeFrames,
    EngineError,
    EngineErrorKind,
    EngineHealth,
    EngineOverloaded,
    ResumeMode,
    SpeechEngine,
    SpeechRequest,
)
from engine.decoder.window import ChunkPolicy, StreamLead


@dataclass
class _Req:
    request: SpeechRequest
    total_steps: int
    queue: asyncio.Queue[AudioChunk | None]
    lead: StreamLead
    steps: int = 0
    emitted_steps: int = 0


@dataclass
class SimBatchEngine:
    name: str = "sim-batch"
    native_sample_rate_hz: int = NATIVE_SAMPLE_RATE_HZ
    resume_mode: ResumeMode = ResumeMode.SAMPLES
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
    _wake: asyncio.Event | None = None
    _task: asyncio.Task[None] | None = None

    def check_voice(self, voice: str | int) -> str | None:
        return None

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
        req = _Req(request, total, asyncio.Queue(), StreamLead(SAMPLES_PER_STEP / NATIVE_SAMPLE_RATE_HZ))
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


@dataclass
class FakeSpeechEngine:
    name: str = "fake-sine"
    native_sample_rate_hz: int = 24_000
    resume_mode: ResumeMode = ResumeMode.SAMPLES
    """The same request gives the same samples."""
    ms_per_char: float = 20.0
    first_chunk_delay_s: float = 0.02
    chunk_ms: float = 100.0
    speed: float = 20.0
    """Real-time factor of generation after the first chunk (20 = 20x faster than real time)."""
    fail_marker: str = "#FAIL#"
    overload_marker: str = "#OVERLOAD#"
    crash_marker: str = "#CRASH#"
    cancel_marker: str = "#CANCELLED#"
    healthy: bool = True
    requests: list[SpeechRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    _running: set[str] = field(default_factory=set)
    _abort_flags: set[str] = field(default_factory=set)
    started: bool = False
    chunks_made: int = 0

    def check_voice(self, voice: str | int) -> str | None:
        return None

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.started = False

    def health(self) -> EngineHealth:
        return EngineHealth(name=self.name, healthy=self.healthy, running_requests=len(self._running))

    @property
    def running(self) -> set[str]:
        return set(self._running)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self._abort_flags.add(request_id)
        self._running.discard(request_id)

    def expected_samples(self, text: str, sample_rate_hz: int) -> int:
        return int(len(text) * self.ms_per_char * sample_rate_hz / 1000.0)

    def synthesize(self, request: SpeechRequest) -> AsyncIterator[AudioChunk]:
        return self._gen(request)

    async def _gen(self, request: SpeechRequest) -> AsyncIterator[AudioChunk]:
        rid = request.request_id
        rate = request.sample_rate_hz
        self.requests.append(request)
        self._running.add(rid)
        try:
            await asyncio.sleep(self.first_chunk_delay_s)
            if self.overload_marker in request.text:
                raise EngineOverloaded("fake overload")
            if self.crash_marker in request.text:
                raise EngineError("fake crash", EngineErrorKind.UNRECOVERABLE)
            if self.cancel_marker in request.text:  # a future cancelled under it, not its task
                cancelled: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                cancelled.cancel()
                await cancelled
            total = self.expected_samples(request.text, rate)
            per_chunk = max(1, int(self.chunk_ms * rate / 1000.0))
            done = 0
            freq = 220.0 + 10.0 * (hash(rid) % 20)
            while done < total:
                if rid in self._abort_flags:
                    return
                n = min(per_chunk, total - done)
                t = (np.arange(done, done + n) / rate).astype(np.float64)
                pcm = (0.3 * 32767 * np.sin(2 * math.pi * freq * t)).astype("<i2").tobytes()
                done += n
                self.chunks_made += 1
                yield AudioChunk(rid, pcm, rate, finished=done >= total)
                if done > 0 and self.fail_marker in request.text:
                    raise EngineError("fake failure")
                if done < total:
                    await asyncio.sleep(self.chunk_ms / 1000.0 / self.speed)
            if total == 0:
                yield AudioChunk(rid, b"", rate, finished=True)
        finally:
            self._running.discard(rid)
            self._abort_flags.discard(rid)


@dataclass
class CountingEngine:
    """Delegates to ``inner``; counts the samples of each request and when the last chunk came."""

    inner: SpeechEngine
    samples: dict[str, int] = field(default_factory=dict)
    requests: list[SpeechRequest] = field(default_factory=list)
    last_chunk_s: float = 0.0

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def native_sample_rate_hz(self) -> int:
        return self.inner.native_sample_rate_hz

    @property
    def resume_mode(self) -> ResumeMode:
        return self.inner.resume_mode

    def check_voice(self, voice: str | int) -> str | None:
        return self.inner.check_voice(voice)

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def health(self) -> EngineHealth:
        return self.inner.health()

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    def synthesize(self, request: SpeechRequest) -> AsyncIterator[AudioChunk]:
        return self._gen(request)

    async def _gen(self, request: SpeechRequest) -> AsyncIterator[AudioChunk]:
        import time

        self.requests.append(request)
        self.samples[request.request_id] = 0
        it = self.inner.synthesize(request)
        try:
            async for chunk in it:
                self.samples[request.request_id] += len(chunk.pcm) // 2
                self.last_chunk_s = time.monotonic()
                yield chunk
        finally:
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                await aclose()

    @property
    def total_samples(self) -> int:
        return sum(self.samples.values())

    @property
    def rates(self) -> set[int]:
        return {r.sample_rate_hz for r in self.requests}


class FakeCodeEngine:
    """Yields predetermined codes (and hidden states) in pieces; records what was pulled.
    ``step_s`` > 0: a piece of ``k`` steps comes ``k * step_s`` after the previous one (an engine
    at ``1 / (step_s * 46.875)`` times real time per stream); 0: as fast as it is read."""

    name = "chattts-fake"

    def __init__(self, utterances: dict[str, np.ndarray], piece: int = 1, hidden: dict[str, np.ndarray] | None = None,
                 step_s: float = 0.0):
        self.utterances = utterances
        self.hidden = hidden or {}
        self.piece = piece
        self.step_s = step_s
        self.pulled: dict[str, int] = {}
        self.aborted: set[str] = set()
        self.closed_iters: set[str] = set()
        self.running = 0

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def health(self) -> EngineHealth:
        return EngineHealth(self.name, True, self.running)

    async def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    async def generate(self, request: SpeechRequest) -> AsyncIterator[CodeFrames]:
        rid = request.request_id
        codes = self.utterances[rid]
        hid = self.hidden.get(rid)
        self.running += 1
        self.pulled[rid] = 0
        try:
            pos = 0
            while True:
                if rid in self.aborted:
                    yield CodeFrames(rid, codes[:0], None, finished=True, finish_reason="abort")
                    return
                k = min(self.piece, len(codes) - pos)
                fin = pos + k >= len(codes)
                self.pulled[rid] = pos + k
                yield CodeFrames(
                    rid,
                    codes[pos : pos + k],
                    None if hid is None else hid[pos : pos + k],
                    finished=fin,
                    finish_reason="eos" if fin else None,
                )
                pos += k
                if fin:
                    return
                await asyncio.sleep(self.step_s * k)
        finally:
            self.running -= 1
            self.closed_iters.add(rid)

"""A SpeechEngine test double: a sine tone paced like a real engine, lazily generated.

* Audio length is proportional to the text (``ms_per_char``), so tests can predict it.
* Generation is lazy: a chunk is made only when the consumer asks for it (like the real engine,
  whose decoder runs when the iterator is pulled), after ``first_chunk_delay_s`` for the first
  chunk and ``chunk_ms / speed`` for later ones.
* ``running_requests`` counts requests whose iterator started and has neither finished, been
  aborted nor been closed/cancelled: it must return to 0 after aborts and disconnects.
* Failure injection: text containing ``fail_marker`` raises a recoverable EngineError after the
  first chunk; ``overload_marker`` raises EngineOverloaded before any audio; ``crash_marker``
  raises an unrecoverable EngineError.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from engine.api import (
    AudioChunk,
    EngineError,
    EngineErrorKind,
    EngineHealth,
    EngineOverloaded,
    SpeechRequest,
)


@dataclass
class FakeSpeechEngine:
    name: str = "fake-sine"
    native_sample_rate_hz: int = 24_000
    ms_per_char: float = 20.0
    first_chunk_delay_s: float = 0.02
    chunk_ms: float = 100.0
    speed: float = 20.0
    """Real-time factor of generation after the first chunk (20 = 20x faster than real time)."""
    fail_marker: str = "#FAIL#"
    overload_marker: str = "#OVERLOAD#"
    crash_marker: str = "#CRASH#"
    healthy: bool = True
    requests: list[SpeechRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    _running: set[str] = field(default_factory=set)
    _abort_flags: set[str] = field(default_factory=set)
    started: bool = False
    chunks_made: int = 0

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

"""``SyntheticCodeEngine``: a ``CodeEngine`` that emits random valid code frames at a set pace.

For measuring everything *around* the GPT without a GPU: ``voicegw serve --engine.backend
synthetic --model-dir <checkpoint>`` runs the real streaming decoder (``ChatTTSSpeech``), the
real gateway, flow control and segmenter, while the code frames come from here at the pace of a
real engine (defaults: the vLLM engine on one H200 at 10 streams, 40 ms to the first step then
86 steps/s per stream; see bench/results/gpu-2026-11-30).

Timing model (per request, independent of the other requests):

* step ``k`` (0-based) exists at ``submit + ttft_ms + k / steps_per_s``;
* like vLLM's ``RequestOutputKind.DELTA`` collector, a consumer that pulls late gets every step
  that exists by then in one ``CodeFrames`` (the engine does not wait for the consumer);
* the utterance has ``round(units(text) * ms_per_char / 21.33 ms)`` steps (ChatTTS speaks about
  ``ms_per_char`` per character), capped by ``max_new_tokens``; ``ignore_eos`` runs exactly
  ``max_new_tokens`` steps. The last frame has ``finished=True, finish_reason="eos"``.

Codes are uniform in ``[0, AUDIO_EOS)`` from a generator seeded by the request's seed (or its
id), so the decoder does real work on valid input. No torch, no threads.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

from engine.api import (
    AUDIO_EOS,
    NATIVE_SAMPLE_RATE_HZ,
    NUM_CODEBOOKS,
    SAMPLES_PER_STEP,
    CodeFrames,
    EngineError,
    EngineErrorKind,
    EngineHealth,
    SpeechRequest,
)

STEP_MS = SAMPLES_PER_STEP * 1000.0 / NATIVE_SAMPLE_RATE_HZ
"""Audio per GPT step (21.33 ms)."""


@dataclass(frozen=True)
class SyntheticPace:
    """How fast the synthetic engine produces steps (per stream)."""

    ttft_ms: float = 40.0
    """Submit -> first step."""
    steps_per_s: float = 86.0
    """Steps per second per stream after the first (46.9 is real time)."""
    ms_per_char: float = 70.0
    """Speech per text unit (non-space character): sets the utterance length in steps."""

    def __post_init__(self) -> None:
        if self.ttft_ms < 0 or self.steps_per_s <= 0 or self.ms_per_char <= 0:
            raise ValueError(f"bad synthetic pace {self}")

    def steps_for(self, request: SpeechRequest) -> int:
        p = request.params
        if p.ignore_eos:
            return max(1, p.max_new_tokens)
        units = sum(1 for c in request.text if not c.isspace())
        n = max(1, round(units * self.ms_per_char / STEP_MS))
        return max(1, min(n, p.max_new_tokens))

    def steps_due(self, elapsed_s: float) -> int:
        """Steps that exist ``elapsed_s`` after submission."""
        t = elapsed_s - self.ttft_ms / 1000.0
        if t < 0:
            return 0
        return int(t * self.steps_per_s + 1e-9) + 1

    def due_at_s(self, step: int) -> float:
        """Seconds after submission at which step ``step`` (0-based) exists."""
        return self.ttft_ms / 1000.0 + step / self.steps_per_s


class SyntheticCodeEngine:
    """``CodeEngine`` with synthetic timing (see the module docstring)."""

    def __init__(self, pace: SyntheticPace | None = None, *, name: str = "chattts-synthetic",
                 device: str = "cpu") -> None:
        self.pace = pace or SyntheticPace()
        self.name = name
        self.device = device
        """Where the decoder runs (``build_speech_engine`` reads it)."""
        self._started = False
        self._live: dict[str, asyncio.Event] = {}

    async def start(self) -> None:
        self._started = True

    async def close(self) -> None:
        for ev in self._live.values():
            ev.set()
        self._started = False

    def health(self) -> EngineHealth:
        return EngineHealth(self.name, self._started, len(self._live),
                            f"synthetic: ttft {self.pace.ttft_ms:g} ms, {self.pace.steps_per_s:g} steps/s")

    async def abort(self, request_id: str) -> None:
        ev = self._live.get(request_id)
        if ev is not None:
            ev.set()

    def generate(self, request: SpeechRequest) -> AsyncIterator[CodeFrames]:
        if not self._started:
            raise EngineError("synthetic engine not started", EngineErrorKind.UNRECOVERABLE)
        if request.request_id in self._live:
            raise EngineError(f"duplicate request id {request.request_id}")
        aborted = asyncio.Event()
        self._live[request.request_id] = aborted
        return self._generate(request, aborted, time.monotonic())

    async def _generate(self, request: SpeechRequest, aborted: asyncio.Event,
                        t_submit: float) -> AsyncIterator[CodeFrames]:
        rid = request.request_id
        pace = self.pace
        total = pace.steps_for(request)
        seed = request.params.seed
        rng = np.random.default_rng(seed if seed is not None else zlib.crc32(rid.encode()))
        sent = 0
        try:
            while sent < total:
                if aborted.is_set():
                    yield CodeFrames(rid, np.zeros((0, NUM_CODEBOOKS), np.int64), finished=True,
                                     finish_reason="abort")
                    return
                due = min(total, pace.steps_due(time.monotonic() - t_submit))
                if due <= sent:
                    wait_s = t_submit + pace.due_at_s(sent) - time.monotonic()
                    if wait_s > 0:
                        try:
                            await asyncio.wait_for(aborted.wait(), wait_s)
                        except TimeoutError:
                            pass
                    continue
                codes = rng.integers(0, AUDIO_EOS, size=(due - sent, NUM_CODEBOOKS), dtype=np.int64)
                sent = due
                done = sent >= total
                reason = ("length" if request.params.ignore_eos else "eos") if done else None
                yield CodeFrames(rid, codes, finished=done, finish_reason=reason)
        finally:
            self._live.pop(rid, None)

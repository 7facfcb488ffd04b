"""``VllmCodeEngine._admission_tick``: under load a new request waits for the next tick of the
shared monotonic clock; light load or an interval of 0 submits at once."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from engine.vllm.engine import _TICK_MIN_RUNNING, VllmCodeEngine


def _tick(interval_ms: float, running: int) -> float:
    fake = SimpleNamespace(cfg=SimpleNamespace(admit_interval_ms=interval_ms), running_requests=lambda: running)

    async def go() -> float:
        await VllmCodeEngine._admission_tick(fake)  # type: ignore[arg-type]
        return time.monotonic()

    return asyncio.run(go())


def test_ticks_align_on_the_shared_clock_under_load() -> None:
    period_s = 0.05
    for _ in range(5):
        t = _tick(50.0, _TICK_MIN_RUNNING)
        phase = t % period_s
        assert min(phase, period_s - phase) < 0.012  # woke at (just after) a multiple of the period


def test_no_wait_when_off_or_light() -> None:
    t0 = time.monotonic()
    for _ in range(20):
        _tick(0.0, 10_000)
        _tick(200.0, _TICK_MIN_RUNNING - 1)
    assert time.monotonic() - t0 < 0.5

"""The gateway's load monitor: how late the event loop runs, and the engine's rates, over time.

One task per server. It sleeps ``PROBE_S`` at a time and measures how much later than asked it
woke up (the event loop's lag: what every session's reads, sends and timers wait on top of their
own work); each lag goes into ``voicegw_event_loop_lag_seconds``. Every
``gateway.load_log_interval_s`` it logs one INFO line ``load``::

    load sessions=256 engine_live=498 lag_ms_max=41.2 lag_ms_mean=3.1 requests_per_s=21.0
    first_outputs_per_s=20.0 ttft_ms_mean=812.4 steps_per_s=11890 outputs_per_s=4210
    decode_jobs_per_s=1190 decode_ms_mean=6.2 decoder_busy=0.41 decoder_mean_batch=37.5
    decoder_padding=0.21 mono=5123.456

(``mono``: ``time.monotonic()``, the clock the load generator's records use; ``decoder_*``: the
decoder process's share of the interval spent in forwards, its rows per forward and the share of
computed rows that only filled a batch bucket, the same in every gateway process it serves.)

The engine's part comes from ``EngineHealth.counters`` (monotonic totals; rates are their
differences over the interval). The arithmetic is ``LoadWindow``, pure; the task is the edge.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Callable, Mapping

from engine.api import SpeechEngine
from gateway.metrics import GatewayMetrics

log = logging.getLogger("voicegw.load")

PROBE_S = 0.02
"""How long the monitor sleeps between two lag probes."""


class LoadWindow:
    """Lag probes and counter totals of one interval -> the fields of one ``load`` line."""

    def __init__(self, counters: Mapping[str, float], t_s: float) -> None:
        self._reset(counters, t_s)

    def _reset(self, counters: Mapping[str, float], t_s: float) -> None:
        self._counters = dict(counters)
        self._t_s = t_s
        self._lag_max_s = 0.0
        self._lag_sum_s = 0.0
        self._probes = 0
        self._gc_max_s = 0.0
        self._gc_sum_s = 0.0
        self._gc_full = 0

    def gc_pause(self, generation: int, pause_s: float) -> None:
        self._gc_max_s = max(self._gc_max_s, pause_s)
        self._gc_sum_s += pause_s
        if generation >= 2:
            self._gc_full += 1

    def probe(self, lag_s: float) -> None:
        self._lag_max_s = max(self._lag_max_s, lag_s)
        self._lag_sum_s += lag_s
        self._probes += 1

    def close(self, counters: Mapping[str, float], t_s: float) -> dict[str, float]:
        """The interval's fields; the window restarts from ``counters`` at ``t_s``."""
        span_s = max(1e-9, t_s - self._t_s)
        d = {k: float(v) - self._counters.get(k, 0.0) for k, v in counters.items()}
        out: dict[str, float] = {
            "lag_ms_max": round(1000 * self._lag_max_s, 1),
            "lag_ms_mean": round(1000 * self._lag_sum_s / max(1, self._probes), 1),
            "gc_ms_max": round(1000 * self._gc_max_s, 1),
            "gc_ms_total": round(1000 * self._gc_sum_s, 1),
            "gc_full": float(self._gc_full),
        }
        for name in ("requests", "first_outputs", "steps", "outputs", "decode_jobs"):
            if name in d:
                out[f"{name}_per_s"] = round(d[name] / span_s, 1)
        if "ttft_s" in d and d.get("first_outputs"):
            out["ttft_ms_mean"] = round(1000 * d["ttft_s"] / d["first_outputs"], 1)
        if "decode_s" in d and d.get("decode_jobs"):
            out["decode_ms_mean"] = round(1000 * d["decode_s"] / d["decode_jobs"], 2)
        if "decoder_busy_s" in d:  # the decoder process's own totals (every client of it sees the same)
            out["decoder_busy"] = round(d["decoder_busy_s"] / span_s, 3)
        if d.get("decoder_forwards"):
            rows, padded = d.get("decoder_rows", 0.0), d.get("decoder_padded_rows", 0.0)
            out["decoder_mean_batch"] = round(rows / d["decoder_forwards"], 1)
            out["decoder_padding"] = round(padded / max(1.0, rows + padded), 3)
        self._reset(counters, t_s)
        return out


class LoadMonitor:
    """The task: lag probes into ``metrics``, a ``load`` line every ``interval_s`` (0: no lines)."""

    def __init__(self, engine: SpeechEngine, metrics: GatewayMetrics, interval_s: float,
                 sessions: Callable[[], int]) -> None:
        self.engine = engine
        self.metrics = metrics
        self.interval_s = interval_s
        self.sessions = sessions
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="voicegw-load-monitor")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _counters(self) -> tuple[int, Mapping[str, float]]:
        try:
            h = self.engine.health()
        except Exception:  # noqa: BLE001 - a monitor never takes the server down
            return -1, {}
        return h.running_requests, h.counters

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        _, counters = self._counters()
        now = loop.time()
        window = LoadWindow(counters, now)
        started: list[float] = []

        def on_gc(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                started[:] = [time.perf_counter()]
            elif started:
                window.gc_pause(int(info.get("generation", 0)), time.perf_counter() - started[0])

        gc.callbacks.append(on_gc)
        try:
            await self._probe_loop(loop, window)
        finally:
            with contextlib.suppress(ValueError):
                gc.callbacks.remove(on_gc)

    async def _probe_loop(self, loop: asyncio.AbstractEventLoop, window: LoadWindow) -> None:
        next_line = loop.time() + self.interval_s
        while True:
            t0 = loop.time()
            await asyncio.sleep(PROBE_S)
            t1 = loop.time()
            lag_s = max(0.0, t1 - t0 - PROBE_S)
            self.metrics.loop_lag.observe(lag_s)
            window.probe(lag_s)
            if self.interval_s > 0 and t1 >= next_line:
                live, counters = self._counters()
                fields = window.close(counters, t1)
                next_line = t1 + self.interval_s
                text = " ".join(f"{k}={v:g}" for k, v in fields.items())
                log.info("load sessions=%d engine_live=%d %s mono=%.3f", self.sessions(), live, text, time.monotonic())

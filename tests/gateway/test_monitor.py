"""gateway.monitor: the load line's arithmetic (pure) and the task over a real event loop."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest

from engine.api import EngineHealth
from gateway.metrics import GatewayMetrics
from gateway.monitor import LoadMonitor, LoadWindow


def test_load_window_rates_and_means() -> None:
    w = LoadWindow({"requests": 10, "first_outputs": 8, "ttft_s": 1.0, "steps": 100, "decode_jobs": 0, "decode_s": 0}, 5.0)
    for lag in (0.001, 0.003, 0.020):
        w.probe(lag)
    out = w.close({"requests": 14, "first_outputs": 12, "ttft_s": 1.4, "steps": 1100, "decode_jobs": 50, "decode_s": 0.25}, 7.0)
    assert out["lag_ms_max"] == 20.0
    assert out["lag_ms_mean"] == 8.0
    assert out["requests_per_s"] == 2.0
    assert out["first_outputs_per_s"] == 2.0
    assert out["ttft_ms_mean"] == 100.0  # 0.4 s over 4 first outputs
    assert out["steps_per_s"] == 500.0
    assert out["decode_ms_mean"] == 5.0
    # the next window starts from the totals just read, with no probes
    nxt = w.close({"requests": 14, "first_outputs": 12, "ttft_s": 1.4, "steps": 1100}, 8.0)
    assert nxt["requests_per_s"] == 0.0 and nxt["lag_ms_max"] == 0.0 and "ttft_ms_mean" not in nxt


def test_load_window_decoder_process_share() -> None:
    """The decoder process's totals: busy share of the interval, rows per forward, padding share."""
    zero = {"decoder_forwards": 0, "decoder_rows": 0, "decoder_padded_rows": 0, "decoder_busy_s": 0}
    w = LoadWindow(zero, 0.0)
    out = w.close({"decoder_forwards": 20, "decoder_rows": 600, "decoder_padded_rows": 200, "decoder_busy_s": 0.8},
                  2.0)
    assert out["decoder_busy"] == 0.4 and out["decoder_mean_batch"] == 30.0 and out["decoder_padding"] == 0.25
    idle = w.close({"decoder_forwards": 20, "decoder_rows": 600, "decoder_padded_rows": 200, "decoder_busy_s": 0.8},
                   3.0)
    assert idle["decoder_busy"] == 0.0 and "decoder_mean_batch" not in idle


class _Engine:
    name = "counting"

    def __init__(self) -> None:
        self.steps = 0.0

    def health(self) -> EngineHealth:
        self.steps += 50
        return EngineHealth(self.name, True, 3, counters={"steps": self.steps})


async def test_monitor_logs_lag_and_rates(caplog: pytest.LogCaptureFixture) -> None:
    metrics = GatewayMetrics()
    mon = LoadMonitor(_Engine(), metrics, 0.15, lambda: 7)  # type: ignore[arg-type]
    caplog.set_level(logging.INFO, logger="voicegw.load")
    mon.start()
    await asyncio.sleep(0.05)
    time.sleep(0.1)  # noqa: ASYNC251 - block the loop on purpose: one probe sees >= 80 ms of lag
    await asyncio.sleep(0.3)
    await mon.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == "voicegw.load"]
    assert lines and lines[0].startswith("load sessions=7 engine_live=3 ")
    fields: dict[str, Any] = dict(kv.split("=", 1) for kv in lines[0].split()[1:])
    assert float(fields["lag_ms_max"]) >= 80.0
    assert float(fields["steps_per_s"]) > 0
    text = metrics.render().decode()
    assert "voicegw_event_loop_lag_seconds_count" in text


def test_load_window_gc_pauses() -> None:
    w = LoadWindow({}, 0.0)
    w.gc_pause(0, 0.001)
    w.gc_pause(2, 0.300)
    out = w.close({}, 1.0)
    assert out["gc_ms_max"] == 300.0 and out["gc_ms_total"] == 301.0 and out["gc_full"] == 1.0
    assert w.close({}, 2.0)["gc_full"] == 0.0


def test_startup_heap_is_frozen() -> None:
    import gc

    from gateway.app import freeze_startup_heap

    freeze_startup_heap()  # the test session's engine fixture froze it already; again is harmless
    assert gc.get_freeze_count() > 0

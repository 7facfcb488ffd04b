from __future__ import annotations

import pytest

from gateway.flow import FlowConfig, FlowControl, WaterMarks

RATE = 1000  # 1 sample per ms keeps the arithmetic readable


def flow(window_ms: float = 500, stale_ms: float = 1000, now: float = 0.0) -> FlowControl:
    return FlowControl(FlowConfig(RATE, window_ms, stale_ms), now)


def test_window_bounds_what_is_sent_ahead():
    f = flow()
    assert f.can_send(0.0, 500) and f.can_send(0.0, 10_000)  # nothing ahead: always
    f.on_sent(0.0, 400)
    assert f.can_send(0.0, 100) and not f.can_send(0.0, 101)
    assert f.ahead(0.0) == 400


def test_virtual_playhead_plays_in_real_time_without_reports():
    f = flow()
    f.on_sent(0.0, 500)
    assert not f.can_send(0.0, 40)
    assert f.credit_deadline_s(0.0, 40) == pytest.approx(0.04)
    assert f.ahead(0.1) == 400
    assert f.can_send(0.1, 100)
    # it stops when it catches up (underrun) and restarts with the next audio
    assert f.ahead(2.0) == 0
    f.on_sent(5.0, 300)
    assert f.ahead(5.1) == 200


def test_reports_hold_the_playhead_until_stale():
    f = flow(stale_ms=1000)
    f.on_sent(0.0, 500)
    f.on_playback(0.0, 0)
    assert f.reporting
    assert f.ahead(0.5) == 500  # no extrapolation while the report is fresh
    assert not f.can_send(0.5, 1)
    # the next credit comes with a report, or when the report goes stale
    assert f.credit_deadline_s(0.5, 1) == pytest.approx(1.001)
    f.on_playback(0.6, 200)
    assert f.ahead(0.6) == 300 and f.can_send(0.6, 200)
    # stale: the virtual playhead continues from the last report in real time
    assert f.ahead(1.6) == 300
    assert f.ahead(1.7) == 200


def test_reports_are_clamped_and_monotonic():
    f = flow()
    f.on_sent(0.0, 100)
    f.on_playback(0.0, 10_000)  # cannot have played more than it got
    assert f.ahead(0.0) == 0
    f.on_sent(0.0, 100)
    f.on_playback(0.1, 50)  # counters never go back
    assert f.client_played(0.1) == 100


def test_cancel_discards_the_clients_buffer():
    f = flow()
    f.on_sent(0.0, 500)
    f.on_playback(0.0, 100)
    assert f.on_cancel(0.0, 150) == 150
    assert f.discarded == 350 and f.ahead(0.0) == 0
    f.on_sent(0.0, 200)
    f.on_playback(0.1, 150 + 120)  # the client's counter goes on from 150
    assert f.ahead(0.1) == 80
    assert f.client_played(0.1) == 270


def test_cancel_without_counter_uses_the_estimate():
    f = flow()
    f.on_sent(0.0, 500)
    assert f.on_cancel(0.2, None) == 200
    assert f.ahead(0.2) == 0


def test_watermarks():
    w = WaterMarks(100, 25)
    assert w.update(50) is None
    assert w.update(101) is True and w.paused
    assert w.update(60) is None and w.paused
    assert w.update(25) is False and not w.paused
    with pytest.raises(ValueError):
        WaterMarks(10, 20)

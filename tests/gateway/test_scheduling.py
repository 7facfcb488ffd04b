"""gateway/scheduling.py: priority from playback deadline, re-evaluation, step-time model, admission."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.scheduling import (
    OVERLOADED_CODE,
    REALTIME_STEP_MS,
    AdmissionController,
    EngineLoad,
    SchedulingPolicy,
    StepTimeEstimator,
    client_buffered_ms,
    fcfs_priority,
    make_priority_fn,
    priority_fn_for,
)
from voicegw.config import SchedulerConfig

CFG = SchedulerConfig(ttfa_target_ms=500.0, urgent_buffer_ms=300.0, priority_levels=8, bucket_ms=500.0)


# ----------------------------------------------------------------------------- buffer estimate


def test_buffered_from_sent_and_played() -> None:
    # 1 s sent, 0.25 s played at 24 kHz, report just arrived
    assert client_buffered_ms(24_000, 6_000, 24_000) == pytest.approx(750.0)


def test_buffered_drains_while_playing_since_report() -> None:
    assert client_buffered_ms(24_000, 6_000, 24_000, ms_since_report=250.0) == pytest.approx(500.0)
    # paused / prebuffering client: no drain
    assert client_buffered_ms(24_000, 6_000, 24_000, ms_since_report=250.0, playing=False) == pytest.approx(750.0)


def test_buffered_never_negative_and_counts_unsent() -> None:
    assert client_buffered_ms(1_000, 0, 24_000, ms_since_report=10_000.0) == 0.0
    assert client_buffered_ms(0, 500, 24_000) == 0.0  # report ahead of our count (racy): clamp
    assert client_buffered_ms(0, 0, 16_000, unsent_samples=1_600) == pytest.approx(100.0)


def test_buffered_rejects_bad_rate() -> None:
    with pytest.raises(ValueError):
        client_buffered_ms(1, 0, 0)


# ----------------------------------------------------------------------------- priorities


def test_invalid_policy_config() -> None:
    with pytest.raises(ValueError):
        SchedulingPolicy(SchedulerConfig(priority_levels=0))
    with pytest.raises(ValueError):
        SchedulingPolicy(SchedulerConfig(bucket_ms=0))


# ----------------------------------------------------------------------------- step time model


def test_estimator_prior_without_observations() -> None:
    e = StepTimeEstimator(prior_step_ms=40.0, overhead_fraction=0.5)
    assert e.predict(1) == pytest.approx(40.0)
    assert e.predict(3) == pytest.approx(20.0 + 3 * 20.0)


def test_estimator_learns_linear_model() -> None:
    e = StepTimeEstimator(prior_step_ms=1000.0)
    for _ in range(5):
        for b in (1, 2, 4, 8, 16):
            e.observe(b, 10.0 + 2.0 * b)
    a, c = e.coefficients()
    assert a == pytest.approx(10.0, rel=1e-6) and c == pytest.approx(2.0, rel=1e-6)
    assert e.predict(32) == pytest.approx(74.0, rel=1e-6)


def test_estimator_single_batch_size_splits_overhead() -> None:
    e = StepTimeEstimator(overhead_fraction=0.25)
    for _ in range(10):
        e.observe(4, 40.0)
    assert e.predict(4) == pytest.approx(40.0)
    assert e.predict(8) == pytest.approx(10.0 + 8 * 7.5)


def test_estimator_ignores_garbage_and_clamps() -> None:
    e = StepTimeEstimator(prior_step_ms=40.0)
    e.observe(0, 10.0)
    e.observe(2, float("nan"))
    e.observe(2, -1.0)
    assert e.observations == 0
    # decreasing with batch (noise): slope clamped to 0
    for b, y in ((1, 50.0), (2, 40.0), (4, 30.0)):
        e.observe(b, y)
    a, c = e.coefficients()
    assert c == 0.0 and a == pytest.approx(40.0, rel=0.01)
    assert all(e.predict(b) >= 0 for b in (1, 10, 100))


def test_estimator_forgets_old_observations() -> None:
    e = StepTimeEstimator(half_life=10.0)
    for _ in range(100):
        e.observe(1, 100.0)
    for _ in range(200):
        e.observe(1, 10.0)
    assert e.predict(1) == pytest.approx(10.0, rel=0.01)


@given(st.lists(st.tuples(st.integers(1, 256), st.floats(0.01, 10_000, allow_nan=False)), max_size=50))
def test_estimator_never_negative_and_monotone(obs: list[tuple[int, float]]) -> None:
    e = StepTimeEstimator()
    for b, y in obs:
        e.observe(b, y)
    a, c = e.coefficients()
    assert a >= 0 and c >= 0
    assert e.predict(1) <= e.predict(64) + 1e-9


# ----------------------------------------------------------------------------- admission


def _controller(step_ms: float = 20.0, **kw: Any) -> AdmissionController:
    est = StepTimeEstimator(prior_step_ms=step_ms, overhead_fraction=1.0)  # flat step time
    return AdmissionController(CFG, est, first_chunk_steps=6, decode_ms=10.0, mean_segment_steps=100.0, **kw)


def test_idle_engine_always_admits() -> None:
    ac = _controller(step_ms=1_000.0)  # far slower than the target even idle
    d = ac.decide(EngineLoad(running=0, waiting_ahead=0, max_num_seqs=8))
    assert d.admit and d.code is None
    assert d.estimated_ttfa_ms == pytest.approx(7 * 1000.0 + 10.0)


def test_free_slots_admit_without_queue_wait() -> None:
    ac = _controller()
    load = EngineLoad(running=5, waiting_ahead=2, max_num_seqs=8)
    assert ac.estimate_ttfa_ms(load) == pytest.approx(7 * 20.0 + 10.0)
    assert ac.decide(load).admit


def test_full_batch_queue_wait_and_refusal() -> None:
    ac = _controller()
    # 8 running, 8 new utterances ahead: needs 9 completions, one every 100/8 steps
    load = EngineLoad(running=8, waiting_ahead=8, max_num_seqs=8)
    expected = 9 * 100.0 / 8 * 20.0 + 7 * 20.0 + 10.0
    assert ac.estimate_ttfa_ms(load) == pytest.approx(expected)
    d = ac.decide(load)
    assert not d.admit and d.code == OVERLOADED_CODE == "engine_overloaded"
    assert d.retry_after_ms >= expected - 500.0
    assert "ms" in d.reason


def test_estimate_monotone_in_queue() -> None:
    ac = _controller()
    ests = [ac.estimate_ttfa_ms(EngineLoad(running=8, waiting_ahead=w, max_num_seqs=8)) for w in range(20)]
    assert ests == sorted(ests)
    assert ac.decide(EngineLoad(8, 0, 8)).admit  # one completion away: 12.5 steps
    assert not ac.decide(EngineLoad(8, 19, 8)).admit


def test_slow_machine_limit_scales_with_idle_estimate() -> None:
    ac = _controller(step_ms=100.0, idle_slack=1.5)  # idle estimate 710 ms > 500 ms target
    assert ac.decide(EngineLoad(running=3, waiting_ahead=0, max_num_seqs=8)).admit
    d = ac.decide(EngineLoad(running=8, waiting_ahead=1, max_num_seqs=8))
    assert not d.admit and d.limit_ms == pytest.approx(1.5 * 710.0)


def test_realtime_guard_optional() -> None:
    est = StepTimeEstimator(prior_step_ms=2.0, overhead_fraction=0.0)  # 2 ms per sequence
    ac = AdmissionController(CFG, est, max_step_ms=REALTIME_STEP_MS)
    assert ac.decide(EngineLoad(running=9, waiting_ahead=0, max_num_seqs=64)).admit  # 20 ms
    d = ac.decide(EngineLoad(running=12, waiting_ahead=0, max_num_seqs=64))  # 26 ms > 21.3
    assert not d.admit and d.code == OVERLOADED_CODE and "step time" in d.reason
    assert AdmissionController(CFG, est).decide(EngineLoad(12, 0, 64)).admit  # guard off by default


def test_admission_learns_from_observations() -> None:
    ac = AdmissionController(CFG, StepTimeEstimator(prior_step_ms=2.0), mean_segment_steps=100.0)
    load = EngineLoad(running=16, waiting_ahead=0, max_num_seqs=16)
    assert ac.decide(load).admit
    for _ in range(50):
        ac.observe_step(16, 60.0)
        ac.observe_segment_steps(300)
    assert ac.mean_segment_steps > 100.0
    assert not ac.decide(load).admit


def test_overloaded_code_matches_wire_protocol() -> None:
    protocol = pytest.importorskip("gateway.protocol")
    assert OVERLOADED_CODE == protocol.ErrorCode.ENGINE_OVERLOADED.value


# ----------------------------------------------------------------------------- deadline mode


def test_deadline_mode_is_default_and_uses_absolute_time() -> None:
    p = SchedulingPolicy(CFG, epoch_s=100.0)
    assert p.first_lead_ms == 0.0 and p.slack_ms == CFG.urgent_buffer_ms
    # continuing: deadline = now + buffer - slack, in 500 ms buckets since the epoch
    assert p.segment_priority(1, 1_300.0, now_s=110.0) == (10_000 + 1_000) // 500
    assert p.segment_priority(1, 100.0, now_s=110.0) == 10_000 // 500  # never before now
    # first segment: now
    assert p.segment_priority(0, 0.0, now_s=110.0) == 10_000 // 500
    # horizon caps deep buffers
    assert p.segment_priority(1, 1e9, now_s=110.0) == p.segment_priority(1, 4_300.0, now_s=110.0)


def test_deadline_priority_does_not_drift_while_the_client_plays() -> None:
    """The reason for deadline mode: a waiting request keeps its place with no re-evaluation."""
    p = SchedulingPolicy(CFG, slack_ms=0.0)
    sent = 24_000 * 3
    at_submit = p.segment_priority(1, client_buffered_ms(sent, 0, 24_000, 0.0), now_s=50.0)
    for dt in (0.25, 1.0, 2.0, 2.9):
        later = p.segment_priority(1, client_buffered_ms(sent, 0, 24_000, dt * 1000.0), now_s=50.0 + dt)
        assert abs(later - at_submit) <= 1  # quantisation only


def test_deadline_orders_old_shallow_before_new_deep() -> None:
    p = SchedulingPolicy(CFG, slack_ms=0.0)
    old = p.segment_priority(1, 3_000.0, now_s=10.0)  # needed at 13 s
    new_deep = p.segment_priority(1, 3_500.0, now_s=11.0)  # needed at 14.5 s
    new_shallow = p.segment_priority(1, 0.0, now_s=12.0)  # needed at 12 s
    assert new_shallow < old < new_deep


def test_first_segment_beats_everything_not_long_dry() -> None:
    p = SchedulingPolicy(CFG, first_lead_ms=4_000.0, slack_ms=0.0)  # "first segment always first"
    first = p.segment_priority(0, 0.0, now_s=20.0)
    assert first < p.segment_priority(1, 0.0, now_s=20.0)
    assert first < p.segment_priority(1, 0.0, now_s=17.0)  # dry for 3 s < horizon 4 s
    assert first > p.segment_priority(1, 0.0, now_s=15.0)  # dry for 5 s: it goes first
    q = SchedulingPolicy(CFG, first_lead_ms=0.0)
    assert q.segment_priority(0, 0.0, now_s=20.0) == q.segment_priority(1, 0.0, now_s=20.0)


@given(
    t=st.floats(min_value=0, max_value=1e5, allow_nan=False),
    a=st.floats(min_value=0, max_value=60_000, allow_nan=False),
    b=st.floats(min_value=0, max_value=60_000, allow_nan=False),
)
def test_deadline_priority_monotone(t: float, a: float, b: float) -> None:
    p = SchedulingPolicy(CFG)
    lo, hi = sorted((a, b))
    assert p.segment_priority(1, lo, t) <= p.segment_priority(1, hi, t)
    assert p.segment_priority(1, a, t) <= p.segment_priority(1, a, t + 1.0)
    assert p.segment_priority(0, 0.0, t) <= p.segment_priority(1, lo, t)


def test_priority_fn_uses_the_session_clock() -> None:
    fn = make_priority_fn(CFG)
    a = fn(False, 1_300.0, 1_000.0)
    assert a == 2  # epoch = the first call's now: (0 + 1300 - 300) // 500
    assert fn(False, 1_300.0, 1_010.0) == a + 20
    assert fn(True, 0.0, 1_010.0) == 10_000 // 500
    assert fcfs_priority(True, 0.0, 5.0) == fcfs_priority(False, 9e9, 9.0) == 0
    assert priority_fn_for(CFG, "fcfs") is fcfs_priority
    assert priority_fn_for(CFG, "priority")(True, 0.0, 3.0) == 0


def test_default_ordering_new_utterance_vs_playing_streams() -> None:
    p = SchedulingPolicy(CFG, epoch_s=0.0)
    first = p.segment_priority(0, 0.0, now_s=50.0)
    assert first < p.segment_priority(1, 1_500.0, now_s=50.0)  # stream with audio in hand waits
    assert first == p.segment_priority(1, 200.0, now_s=50.0)  # about to run dry: tie, FIFO
    assert p.segment_priority(1, 1_500.0, now_s=48.0) < first  # older request already due: first


def test_slack_makes_shallow_streams_as_urgent_as_new_utterances() -> None:
    p = SchedulingPolicy(CFG, first_lead_ms=0.0, slack_ms=2_000.0, epoch_s=0.0)
    first = p.segment_priority(0, 0.0, now_s=30.0)
    assert p.segment_priority(1, 1_500.0, now_s=30.0) == first  # within the slack: tie (FIFO in vLLM)
    assert p.segment_priority(1, 1_500.0, now_s=29.0) < first  # submitted earlier: goes first
    assert p.segment_priority(1, 3_000.0, now_s=30.0) == first + 2  # 1 s beyond the slack
    assert p.deadline_ms(1, 1e9, 30.0) == 30_000.0 + p.horizon_ms

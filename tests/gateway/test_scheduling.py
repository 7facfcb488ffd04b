"""gateway/scheduling.py: step-time model, admission."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.config import SchedulerConfig
from gateway.scheduling import (
    OVERLOADED_CODE,
    REALTIME_STEP_MS,
    AdmissionController,
    EngineLoad,
    StepTimeEstimator,
)

CFG = SchedulerConfig(ttfa_target_ms=500.0)


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


def test_retry_after_is_capped_at_the_documented_maximum() -> None:
    """A deep queue refuses with ``retry_after_ms`` of at most 5000 (docs/protocol.md), not the
    estimate's whole excess (5,775 was seen at 400 sessions)."""
    from gateway.scheduling import MAX_RETRY_AFTER_MS

    ac = _controller()
    d = ac.decide(EngineLoad(running=8, waiting_ahead=400, max_num_seqs=8))
    assert not d.admit and ac.estimate_ttfa_ms(EngineLoad(running=8, waiting_ahead=400, max_num_seqs=8)) > 10_000
    assert d.retry_after_ms == MAX_RETRY_AFTER_MS == 5_000


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
    ac = AdmissionController(CFG, est, max_step_ms=REALTIME_STEP_MS, require_queue=True)
    busy = EngineLoad(running=12, waiting_ahead=0, max_num_seqs=64)  # 26 ms > 21.3, slots free
    assert ac.decide(busy).admit  # a prior is no ground for refusing: nothing learned yet
    for _ in range(4):
        for b in range(1, 17):
            est.observe(b, 2.0 * b)  # learned: 2 ms per sequence
    assert ac.decide(EngineLoad(running=9, waiting_ahead=0, max_num_seqs=64)).admit  # 20 ms
    d = ac.decide(busy)  # refused although a batch slot is free
    assert not d.admit and d.code == OVERLOADED_CODE and "step time" in d.reason and d.retry_after_ms > 0
    assert AdmissionController(CFG, est, require_queue=True).decide(busy).admit  # guard off by default


def test_realtime_guard_on_a_machine_slower_than_real_time() -> None:
    est = StepTimeEstimator(prior_step_ms=40.0)
    for _ in range(4):
        for b in range(1, 17):
            est.observe(b, 40.0 + 5.0 * b)  # 45 ms at batch 1: never real time
    ac = AdmissionController(CFG, est, max_step_ms=REALTIME_STEP_MS, require_queue=True, idle_slack=1.5)
    assert ac.decide(EngineLoad(running=4, waiting_ahead=0, max_num_seqs=64)).admit  # 65 <= 1.5 x 45
    assert not ac.decide(EngineLoad(running=6, waiting_ahead=0, max_num_seqs=64)).admit  # 75 > 67.5


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

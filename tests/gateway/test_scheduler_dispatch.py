"""Pure parts of gateway-side scheduling: SegmentDispatcher (engine.scheduler), the load a new
utterance meets and the reserved-slot count (gateway.dispatch), queue-only admission."""

from __future__ import annotations

import pytest

from engine.scheduler import AdmissionController, EngineLoad, SegmentDispatcher, StepTimeEstimator
from gateway.dispatch import engine_load, reserved_slots
from voicegw.config import SchedulerConfig


def test_first_segments_are_never_held() -> None:
    d = SegmentDispatcher(capacity=2, reserved=1, lead_ms=500)
    assert d.submit("a-0", "a", True, 0.0, 0.0)
    assert d.submit("b-0", "b", True, 0.0, 0.0)
    assert d.submit("c-0", "c", True, 0.0, 0.0)  # over capacity: vLLM queues it, by priority
    assert d.in_engine == 3 and d.held == 0


def test_continuing_segment_waits_for_its_predecessor_then_for_a_slot() -> None:
    d = SegmentDispatcher(capacity=3, reserved=1, lead_ms=500)
    assert d.submit("a-0", "a", True, 0.0, 0.0)
    assert not d.submit("a-1", "a", False, 0.0, 2_000.0, after=["a-0"])
    assert d.poll(0.0) == []  # predecessor still generating: its audio is still coming
    d.release("a-0")
    assert d.poll(0.0) == ["a-1"]  # 0 in engine < 3 - 1
    assert d.in_engine == 1


def test_reserved_slots_stay_free_for_new_utterances() -> None:
    d = SegmentDispatcher(capacity=3, reserved=1, lead_ms=500)
    for s in ("a", "b"):
        assert d.submit(f"{s}-0", s, True, 0.0, 0.0)
    assert not d.submit("c-1", "c", False, 0.0, 3_000.0)
    assert d.poll(0.0) == []  # 2 in engine = capacity - reserved
    assert d.submit("n-0", "n", True, 0.0, 0.0)  # the new utterance gets the reserved slot
    assert d.next_wake_s(0.0) == pytest.approx(2.5)  # runway 3000 ms reaches lead 500 ms at 2.5 s
    assert d.poll(2.4) == []
    assert d.poll(2.5) == ["c-1"]  # urgent: dispatched regardless of slots
    assert d.dispatched_urgent == 1


def test_urgent_segment_ignores_predecessor() -> None:
    d = SegmentDispatcher(capacity=4, reserved=1, lead_ms=1_000)
    d.submit("a-0", "a", True, 0.0, 0.0)
    assert not d.submit("a-1", "a", False, 0.0, 1_500.0, after=["a-0"])
    assert d.poll(0.4) == []
    assert d.poll(0.5) == ["a-1"]  # the client drained to the lead: pipeline it


def test_credit_extends_runway() -> None:
    d = SegmentDispatcher(capacity=2, reserved=1, lead_ms=500)
    d.submit("x-0", "x", True, 0.0, 0.0)
    d.submit("a-1", "a", False, 0.0, 1_000.0)
    assert d.next_wake_s(0.0) == pytest.approx(0.5)
    d.credit("a", 2_000.0)
    d.credit("b", 9_000.0)  # another session: no effect
    assert d.runway_ms("a-1", 1.0) == pytest.approx(2_000.0)
    assert d.next_wake_s(1.0) == pytest.approx(2.5)


def test_earliest_deadline_first_among_held() -> None:
    d = SegmentDispatcher(capacity=3, reserved=1, lead_ms=100)
    d.submit("x-0", "x", True, 0.0, 0.0)
    d.submit("y-0", "y", True, 0.0, 0.0)
    d.submit("late-1", "a", False, 0.0, 4_000.0)
    d.submit("soon-1", "b", False, 0.5, 1_000.0)  # deadline 1.5 s < 4.0 s
    assert d.poll(0.5) == []
    d.release("x-0")
    assert d.poll(0.6) == ["soon-1"]
    d.release("y-0")
    assert d.poll(0.7) == ["late-1"]


def test_release_of_held_and_bounds() -> None:
    d = SegmentDispatcher(capacity=1, reserved=0, lead_ms=0, max_held=1)
    d.submit("x-0", "x", True, 0.0, 0.0)
    assert not d.submit("a-1", "a", False, 0.0, 5_000.0)
    assert d.submit("b-1", "b", False, 0.0, 5_000.0)  # over max_held: let through
    d.release("a-1")
    assert d.held == 0 and d.next_wake_s(0.0) is None
    with pytest.raises(ValueError):
        SegmentDispatcher(capacity=0)
    assert SegmentDispatcher(capacity=1, reserved=5).reserved == 0


def test_reserved_slots_count() -> None:
    assert reserved_slots(4, 0.25) == 1
    assert reserved_slots(64, 0.25) == 16
    assert reserved_slots(2, 0.1) == 1
    assert reserved_slots(1, 0.5) == 0
    assert reserved_slots(8, 0.0) == 0
    assert reserved_slots(4, 1.0) == 3


def test_engine_load_priority_vs_fcfs() -> None:
    assert engine_load(3, 4, 0, True) == EngineLoad(running=3, waiting_ahead=0, max_num_seqs=4)
    # 7 in the engine, 4 slots: 3 queued; under priority only queued first segments are ahead
    assert engine_load(7, 4, 1, True) == EngineLoad(4, 1, 4)
    assert engine_load(7, 4, 1, False) == EngineLoad(4, 3, 4)
    assert engine_load(-1, 0, 5, True) == EngineLoad(0, 0, 1)


def test_queue_only_admission() -> None:
    est = StepTimeEstimator(prior_step_ms=200.0, overhead_fraction=1.0)  # slow: 7 steps = 1.4 s
    strict = AdmissionController(SchedulerConfig(ttfa_target_ms=100.0), est, idle_slack=1.0)
    lenient = AdmissionController(SchedulerConfig(ttfa_target_ms=100.0), est, idle_slack=1.0, require_queue=True)
    load = EngineLoad(running=2, waiting_ahead=0, max_num_seqs=4)  # a slot is free
    assert lenient.decide(load).admit
    assert strict.decide(load).admit  # idle-estimate floor: no queue, same as idle
    full = EngineLoad(running=4, waiting_ahead=0, max_num_seqs=4)
    assert not lenient.decide(full).admit and not strict.decide(full).admit

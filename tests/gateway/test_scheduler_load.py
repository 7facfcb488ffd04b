"""Pure parts of gateway-side scheduling: the load a new utterance meets (``gateway.admission.engine_load``)
and queue-only admission."""

from __future__ import annotations

from gateway.admission import engine_load
from gateway.config import SchedulerConfig
from gateway.scheduling import AdmissionController, EngineLoad, StepTimeEstimator


def test_engine_load_fcfs() -> None:
    assert engine_load(3, 4) == EngineLoad(running=3, waiting_ahead=0, max_num_seqs=4)
    # 7 in the engine, 4 slots: 3 queued, all ahead of a new utterance (FCFS)
    assert engine_load(7, 4) == EngineLoad(4, 3, 4)
    assert engine_load(-1, 0) == EngineLoad(0, 0, 1)


def test_queue_only_admission() -> None:
    est = StepTimeEstimator(prior_step_ms=200.0, overhead_fraction=1.0)  # slow: 7 steps = 1.4 s
    strict = AdmissionController(SchedulerConfig(ttfa_target_ms=100.0), est, idle_slack=1.0)
    lenient = AdmissionController(SchedulerConfig(ttfa_target_ms=100.0), est, idle_slack=1.0, require_queue=True)
    load = EngineLoad(running=2, waiting_ahead=0, max_num_seqs=4)  # a slot is free
    assert lenient.decide(load).admit
    assert strict.decide(load).admit  # idle-estimate floor: no queue, same as idle
    full = EngineLoad(running=4, waiting_ahead=0, max_num_seqs=4)
    assert not lenient.decide(full).admit and not strict.decide(full).admit

"""Gateway preemption plumbing (``gateway.dispatch.EngineScheduler``): the server-wide registry
of running segments and ``preempt_for_first`` over a stub engine (no model)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from engine.api import EngineHealth
from gateway.dispatch import EngineScheduler
from voicegw.config import Config, EngineConfig, SchedulerConfig


class StubEngine:
    name = "stub"
    supports_preempt = True

    def __init__(self) -> None:
        self.running = 0
        self.calls: list[tuple[str, int]] = []
        self.counts: dict[str, int] = {}
        self.waiting: set[str] = set()

    def enable_preemption(self, on: bool = True) -> bool:
        return bool(on) and self.supports_preempt

    def health(self) -> EngineHealth:
        return EngineHealth(self.name, True, self.running, "")

    def preemptions(self, key: str) -> int | None:
        return self.counts.get(key)

    def can_preempt(self, key: str) -> bool:
        return key in self.counts and key not in self.waiting

    async def preempt(self, key: str, priority: int) -> bool:
        self.calls.append((key, priority))
        self.waiting.add(key)  # resumed, waiting for a slot
        self.counts[key] = self.counts.get(key, 0) + 1
        return True


def _sched(engine: Any, preempt: bool = True, seqs: int = 2) -> EngineScheduler:
    cfg = Config(engine=EngineConfig(max_num_seqs=seqs, scheduling_policy="priority"),
                 scheduler=replace(SchedulerConfig(), preempt=preempt, preempt_min_buffer_ms=1_000.0,
                                   admission=False))
    return EngineScheduler(cfg, engine)


def _run(s: EngineScheduler, eng: StubEngine, key: str, group: str, first: bool, buf: float) -> None:
    s.submit(key, group, first, buf, [])
    s.track(key, group, first, lambda: buf, lambda ms: 100 + int(ms // 1000))
    eng.running += 1
    eng.counts.setdefault(key, 0)


async def test_preempts_deepest_continuing_segment_when_full() -> None:
    eng = StubEngine()
    s = _sched(eng)
    _run(s, eng, "a-1-1", "a", False, 5_000.0)
    _run(s, eng, "b-1-1", "b", False, 3_000.0)
    s.first_output("a-1-1")
    s.first_output("b-1-1")
    _run(s, eng, "c-1-0", "c", True, 0.0)  # engine full: 3 in it, 2 slots
    assert s.preempt_for_first() == ["a-1-1"]
    _run(s, eng, "x-1-0", "x", True, 0.0)
    assert s.preempt_for_first() == ["b-1-1"], "a preemption in flight is not repeated"
    s.release("x-1-0")
    eng.running -= 1
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert eng.calls[:1] == [("a-1-1", 105)]
    assert s.preempted == 2
    eng.waiting.discard("b-1-1")
    eng.counts["b-1-1"] = 0
    # the same waiting first segment does not cause a second preemption
    assert s.preempt_for_first() == []
    # a second new utterance does: not the resumed one still waiting, the next deepest
    _run(s, eng, "d-1-0", "d", True, 0.0)
    assert s.preempt_for_first() == ["b-1-1"]
    # once resumed and generating again, a segment may be preempted again (at most twice)
    for key, want in (("e-1-0", ["a-1-1"]), ("f-1-0", ["b-1-1"])):
        await asyncio.sleep(0)
        eng.waiting.clear()
        _run(s, eng, key, key[0], True, 0.0)
        assert s.preempt_for_first() == want
    await asyncio.sleep(0)
    eng.waiting.clear()
    _run(s, eng, "g-1-0", "g", True, 0.0)
    assert s.preempt_for_first() == []  # both preempted twice
    for key in ("a-1-1", "b-1-1", "c-1-0", "d-1-0", "e-1-0", "f-1-0", "g-1-0"):
        s.release(key)
    assert s.preempt_for_first() == []


async def test_no_preemption_with_a_free_slot_or_when_off() -> None:
    eng = StubEngine()
    s = _sched(eng, seqs=3)
    _run(s, eng, "a-1-1", "a", False, 5_000.0)
    s.first_output("a-1-1")
    _run(s, eng, "c-1-0", "c", True, 0.0)
    assert s.preempt_for_first() == []  # 2 requests, 3 slots
    off = _sched(StubEngine(), preempt=False)
    assert not off.preempt_enabled and off.preempt_for_first() == []


async def test_engine_without_preempt_disables_it() -> None:
    eng = StubEngine()
    eng.supports_preempt = False  # type: ignore[misc]
    assert not _sched(eng).preempt_enabled


async def test_no_preemption_while_continuing_segments_queue_in_the_engine() -> None:
    """Without rescues (``preempt_rescue_ms`` 0) a victim would queue behind them and run dry."""
    eng = StubEngine()
    cfg = Config(engine=EngineConfig(max_num_seqs=2, scheduling_policy="priority"),
                 scheduler=replace(SchedulerConfig(), preempt=True, preempt_min_buffer_ms=1_000.0,
                                   admission=False, preempt_rescue_ms=0.0))
    s = EngineScheduler(cfg, eng)
    _run(s, eng, "a-1-1", "a", False, 5_000.0)
    _run(s, eng, "b-1-1", "b", False, 3_000.0)
    _run(s, eng, "b-1-2", "b", False, 3_000.0)  # b's next segment: beyond the 2 slots, queued
    s.first_output("a-1-1")
    s.first_output("b-1-1")
    _run(s, eng, "c-1-0", "c", True, 0.0)
    assert s.preempt_for_first() == [], "oversubscribed engine: preemption would only move the wait"
    s.release("b-1-2")
    eng.running -= 1
    _run(s, eng, "d-1-0", "d", True, 0.0)
    assert s.preempt_for_first() == ["a-1-1", "b-1-1"]


async def test_with_rescues_preemption_goes_on_while_continuing_segments_queue() -> None:
    eng = StubEngine()
    s = _sched(eng, seqs=2)
    assert s.rescue_ms > 0
    _run(s, eng, "a-1-1", "a", False, 5_000.0)
    _run(s, eng, "b-1-1", "b", False, 3_000.0)
    _run(s, eng, "b-1-2", "b", False, 3_000.0)  # queued
    s.first_output("a-1-1")
    s.first_output("b-1-1")
    _run(s, eng, "c-1-0", "c", True, 0.0)
    assert s.preempt_for_first() == ["a-1-1"], "a victim about to run dry would be rescued"
    for key in ("a-1-1", "b-1-1", "b-1-2", "c-1-0"):
        s.release(key)


def test_fcfs_never_preempts() -> None:
    on = replace(SchedulerConfig(), preempt=True)
    cfg = Config(engine=EngineConfig(max_num_seqs=2, scheduling_policy="fcfs"), scheduler=on)
    assert not EngineScheduler(cfg, StubEngine()).preempt_enabled
    cfg = Config(engine=EngineConfig(max_num_seqs=2, scheduling_policy="priority"), scheduler=on)
    assert EngineScheduler(cfg, StubEngine()).preempt_enabled


class RescueEngine(StubEngine):
    """A stub that also says which segments wait for a slot (``awaiting_slot``)."""

    def __init__(self) -> None:
        super().__init__()
        self.no_slot: set[str] = set()

    def awaiting_slot(self, key: str) -> bool:
        return key in self.no_slot or key in self.waiting


def _cont(s: EngineScheduler, eng: StubEngine, key: str, group: str, bufs: dict[str, float],
          preempted: int = 0) -> None:
    s.submit(key, group, False, bufs[group], [])
    s.track(key, group, False, lambda: bufs[group], lambda ms: 100 + int(ms // 1000))
    eng.counts[key] = preempted


async def test_rescue_gives_a_preempted_stream_about_to_run_dry_a_deep_ones_slot() -> None:
    eng = RescueEngine()
    s = _sched(eng)
    assert s.rescue_ms == 700.0
    bufs = {"a": 1_800.0, "b": 1_200.0, "c": 300.0}
    _cont(s, eng, "a-1-1", "a", bufs)
    _cont(s, eng, "b-1-1", "b", bufs)
    _cont(s, eng, "c-1-2", "c", bufs, preempted=1)
    for key in ("a-1-1", "b-1-1"):
        s.first_output(key)
    eng.no_slot.add("c-1-2")  # resumed, waits behind a and b; its client has 300 ms left
    await asyncio.sleep(0.1)
    assert s.rescues == 0, "waiting, but not long enough to tell it from a prefill"
    await asyncio.sleep(0.2)
    assert s.rescues == 1 and eng.calls == [("a-1-1", 101)], "deepest buffer first"
    await asyncio.sleep(0.2)
    assert s.rescues == 1, "the same waiting segment: not again at once"
    # the freed slot went elsewhere and a runs again: retried after RESCUE_RETRY_S
    eng.waiting.discard("a-1-1")
    await asyncio.sleep(0.45)
    assert s.rescues == 2
    # c got a slot: nothing more to do; the periodic check stops once nothing is tracked
    eng.no_slot.clear()
    eng.waiting.clear()
    s.first_output("c-1-2")
    assert s.rescue_urgent() == []
    for key in ("a-1-1", "b-1-1", "c-1-2"):
        s.release(key)
    await asyncio.sleep(0.1)
    assert s._check_timer is None


async def test_no_rescue_for_segments_queued_by_oversubscription_or_when_off() -> None:
    eng = RescueEngine()
    s = _sched(eng)
    bufs = {"a": 2_000.0, "c": 100.0}
    _cont(s, eng, "a-1-1", "a", bufs)
    s.first_output("a-1-1")
    _cont(s, eng, "c-1-1", "c", bufs)  # never preempted: queued because slots are short
    eng.no_slot.add("c-1-1")
    await asyncio.sleep(0.3)
    assert s.rescues == 0 and eng.calls == []
    s.release("a-1-1")
    s.release("c-1-1")
    cfg = Config(engine=EngineConfig(max_num_seqs=2, scheduling_policy="priority"),
                 scheduler=replace(SchedulerConfig(), preempt=True, preempt_rescue_ms=0.0))
    assert EngineScheduler(cfg, RescueEngine()).rescue_ms == 0.0


async def test_first_segment_preempts_only_after_waiting_for_a_slot() -> None:
    eng = RescueEngine()
    s = _sched(eng, seqs=2)
    assert s.first_wait_s == 0.15
    bufs = {"a": 5_000.0, "b": 3_000.0}
    _cont(s, eng, "a-1-1", "a", bufs)
    _cont(s, eng, "b-1-1", "b", bufs)
    eng.running = 2
    for key in ("a-1-1", "b-1-1"):
        s.first_output(key)
    # a slot turns over within the wait: no preemption
    _run(s, eng, "f-1-0", "f", True, 0.0)
    eng.no_slot.add("f-1-0")
    await asyncio.sleep(0.1)
    eng.no_slot.discard("f-1-0")
    s.first_output("f-1-0")
    await asyncio.sleep(0.2)
    assert eng.calls == []
    s.release("f-1-0")
    eng.running -= 1
    # no slot turns over: the deepest stream makes room
    _run(s, eng, "g-1-0", "g", True, 0.0)
    eng.no_slot.add("g-1-0")
    await asyncio.sleep(0.1)
    assert eng.calls == []
    await asyncio.sleep(0.2)
    assert [k for k, _ in eng.calls] == ["a-1-1"]
    for key in ("a-1-1", "b-1-1", "g-1-0"):
        s.release(key)


async def test_reprioritize_resubmits_through_the_engine_only_when_enabled() -> None:
    class RequeueStub(StubEngine):
        def __init__(self) -> None:
            super().__init__()
            self.requeued: list[tuple[str, int]] = []

        async def reprioritize(self, key: str, priority: int) -> bool:
            self.requeued.append((key, priority))
            return key != "gone-1-1"

    def make(requeue: bool, preempt: bool = False, policy: str = "priority") -> tuple[RequeueStub, EngineScheduler]:
        eng = RequeueStub()
        cfg = Config(engine=EngineConfig(max_num_seqs=2, scheduling_policy=policy),
                     scheduler=replace(SchedulerConfig(), requeue_waiting=requeue, preempt=preempt, admission=False))
        return eng, EngineScheduler(cfg, eng)

    eng, s = make(True)
    assert s.requeue_enabled and not s.preempt_enabled
    counted: list[int] = []
    s.on_requeue = counted.append
    s.reprioritize("a-1-1", 3)
    s.reprioritize("gone-1-1", 4)  # the engine says it is not waiting any more
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert eng.requeued == [("a-1-1", 3), ("gone-1-1", 4)]
    assert s.requeued == 1 and counted == [1]
    for requeue, policy in ((False, "priority"), (True, "fcfs")):
        eng, s = make(requeue, policy=policy)
        assert not s.requeue_enabled
        s.reprioritize("a-1-1", 3)
        await asyncio.sleep(0)
        assert eng.requeued == []

"""``engine.scheduler.choose_preemptions``: which running segments make room for new utterances."""

from __future__ import annotations

from engine.scheduler import RunningSegment, WaitingSegment, choose_preemptions, choose_rescues


def seg(key: str, buf: float, first: bool = False, n: int = 0, group: str = "") -> RunningSegment:
    return RunningSegment(key, buf, first, n, group or key)


def test_nothing_waiting_or_free_slots_cover_it() -> None:
    run = [seg("a", 5_000), seg("b", 4_000)]
    assert choose_preemptions(run, 0) == []
    assert choose_preemptions(run, 1, free_slots=1) == []
    assert choose_preemptions(run, 2, free_slots=1, min_buffer_ms=1_000) == ["a"]


def test_one_per_waiting_first_deepest_buffer_first() -> None:
    run = [seg("a", 2_500), seg("b", 6_000), seg("c", 4_000)]
    assert choose_preemptions(run, 1, min_buffer_ms=2_000) == ["b"]
    assert choose_preemptions(run, 2, min_buffer_ms=2_000) == ["b", "c"]
    assert choose_preemptions(run, 5, min_buffer_ms=2_000) == ["b", "c", "a"]


def test_only_continuing_segments_with_enough_buffer_and_budget() -> None:
    run = [seg("first", 9_000, first=True), seg("thin", 1_000), seg("worn", 8_000, n=2), seg("ok", 3_000, n=1)]
    assert choose_preemptions(run, 3, min_buffer_ms=2_000, max_preemptions=2) == ["ok"]
    assert choose_preemptions(run, 3, min_buffer_ms=2_000, max_preemptions=1) == []


def test_one_per_session_per_call() -> None:
    run = [seg("s1-a", 6_000, group="s1"), seg("s1-b", 5_000, group="s1"), seg("s2-a", 3_000, group="s2")]
    assert choose_preemptions(run, 2, min_buffer_ms=2_000) == ["s1-a", "s2-a"]


def test_no_preemption_while_continuing_segments_already_queue() -> None:
    run = [RunningSegment("deep", 1_800.0, False, group="g1"), RunningSegment("deep2", 1_700.0, False, group="g2")]
    assert choose_preemptions(run, 1, min_buffer_ms=1_000) == ["deep"]
    # the engine is oversubscribed: a preempted segment would wait behind those already queued
    assert choose_preemptions(run, 1, min_buffer_ms=1_000, queued_continuing=1) == []
    assert choose_preemptions(run, 2, min_buffer_ms=1_000, queued_continuing=0) == ["deep", "deep2"]


# ---- choose_rescues: a waiting stream about to run dry takes a deep stream's slot


def wait(key: str, buf: float, group: str = "", n: int = 1) -> WaitingSegment:
    return WaitingSegment(key, buf, group or key, n)


def test_rescue_swaps_urgent_waiting_for_deepest_running() -> None:
    run = [seg("a", 1_500), seg("b", 1_900), seg("f", 0, first=True)]
    assert choose_rescues([wait("w", 200)], run, urgent_ms=700) == [("w", "b")]
    # not urgent yet, or rescues off
    assert choose_rescues([wait("w", 800)], run, urgent_ms=700) == []
    assert choose_rescues([wait("w", 200)], run, urgent_ms=0) == []


def test_rescue_most_urgent_first_one_victim_each() -> None:
    run = [seg("a", 1_500), seg("b", 1_900)]
    got = choose_rescues([wait("x", 600), wait("y", 100), wait("z", 300)], run, urgent_ms=700)
    assert got == [("y", "b"), ("z", "a")]


def test_rescue_victims_need_buffer_budget_and_preemptible() -> None:
    run = [seg("a", 900), seg("b", 5_000, n=2), seg("c", 5_000, first=True), seg("d", 3_000)]
    assert choose_rescues([wait("w", 100)], run, urgent_ms=700, min_buffer_ms=1_000) == [("w", "d")]
    assert choose_rescues([wait("w", 100)], run, urgent_ms=700, preemptible=lambda k: k != "d") == []


def test_rescue_not_while_its_own_session_is_speaking_nor_from_it() -> None:
    # w's session still generates an earlier segment: its audio is coming, no swap
    run = [seg("s1", 0, group="s"), seg("b", 3_000)]
    assert choose_rescues([wait("s2", 100, group="s")], run, urgent_ms=700) == []
    # one victim per session per call
    run = [seg("b1", 3_000, group="b"), seg("b2", 3_000, group="b")]
    got = choose_rescues([wait("x", 100), wait("y", 200)], run, urgent_ms=700)
    assert got == [("x", "b1")]


def test_rescue_only_segments_that_were_preempted() -> None:
    # queued because the engine is oversubscribed, never preempted: no swap
    run = [seg("a", 1_900)]
    assert choose_rescues([wait("w", 100, n=0)], run, urgent_ms=700) == []
    assert choose_rescues([wait("w", 100, n=1)], run, urgent_ms=700) == [("w", "a")]
    assert choose_rescues([wait("w", 100, n=0)], run, urgent_ms=700, only_preempted=False) == [("w", "a")]

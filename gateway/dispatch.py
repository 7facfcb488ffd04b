"""Server-wide engine scheduling at the I/O edge: admission and preemption.

One ``EngineScheduler`` per ``GatewayServer`` (``for_server``), shared by its connections. It
is the thin asyncio shell around the pure policies of ``engine.scheduler``:

* ``admit``: ``AdmissionController`` asked before an utterance's first segment goes to the
  engine, from the engine's load (``SpeechEngine.health().running_requests``, the batch limit
  ``engine.max_num_seqs``, first segments still waiting for output) and the step time it
  learned from chunk arrivals (``observe_chunk``). ``scheduler.admission``.
* ``submit``/``release``: the segments the engine holds (first segments without audio yet
  count as the queue a new utterance meets).
* ``track``/``check_preemptions``: the server-wide registry of segments the engine is
  generating (every connection's) and, every ``CHECK_PERIOD_S`` (``scheduler.preempt``), two
  kinds of preemption: a first segment that waited ``scheduler.preempt_first_wait_ms`` for a slot
  makes room (``engine.scheduler.choose_preemptions`` names a continuing segment whose client has
  audio to spare), and a preempted segment whose client is about to run dry takes the slot of one
  with more (``choose_rescues``); ``SpeechEngine.preempt`` (``ChatTTSSpeech``) pauses and resumes
  them at their deadline priority.

No policy lives here: numbers in, decisions out.
"""

from __future__ import annotations

import asyncio
import logging
import math
import weakref
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from engine.api import SpeechEngine
from engine.scheduler import (
    AdmissionController,
    AdmissionDecision,
    EngineLoad,
    RunningSegment,
    WaitingSegment,
    choose_preemptions,
    choose_rescues,
)
from voicegw.config import Config

log = logging.getLogger("voicegw.gateway")

_REGISTRY: weakref.WeakKeyDictionary[Any, EngineScheduler] = weakref.WeakKeyDictionary()

CHECK_PERIOD_S = 0.05
"""Preemption: how often waiting segments are checked (while the engine has tracked segments)."""
RESCUE_MIN_WAIT_S = 0.15
"""Rescues: a segment counts as waiting for a slot once it produced nothing for this long (not a
prefill in progress)."""
RESCUE_RETRY_S = 0.5
"""Rescues: the same waiting segment causes another preemption at most this often (the freed
slot may have gone to a segment with an earlier deadline)."""


def engine_load(in_engine: int, max_num_seqs: int, first_waiting: int, priority_scheduling: bool) -> EngineLoad:
    """The load a new utterance's first segment meets. ``in_engine``: requests the engine holds
    (running or queued); ``first_waiting``: of those, first segments with no audio yet. Under
    ``priority`` a first segment overtakes queued continuing segments, so only queued first
    segments are ahead of it; under FCFS every queued request is."""
    seqs = max(1, max_num_seqs)
    total = max(0, in_engine)
    running = min(total, seqs)
    waiting = total - running
    ahead = min(waiting, max(0, first_waiting)) if priority_scheduling else waiting
    return EngineLoad(running=running, waiting_ahead=ahead, max_num_seqs=seqs)


@dataclass
class _Tracked:
    group: str
    first: bool
    buffered_ms: Callable[[], float]
    """The client's audio ahead of its playhead now (ms)."""
    resume_priority: Callable[[float], int]
    """Engine priority of the segment resumed with that much buffered."""


class EngineScheduler:
    def __init__(self, config: Config, engine: SpeechEngine) -> None:
        self.engine = engine
        self.max_num_seqs = max(1, config.engine.max_num_seqs)
        sc = config.scheduler
        self.priority_scheduling = config.engine.scheduling_policy == "priority"
        self.admission: AdmissionController | None = (
            AdmissionController(sc, first_chunk_steps=config.engine.first_audio_steps, require_queue=True)
            if sc.admission else None
        )
        self._first_waiting: set[str] = set()
        self.refused = 0
        # preemption hands the freed slot to a first segment through vLLM's priority queue: it
        # means nothing under FCFS (and an FCFS baseline must not preempt)
        # both need segments on the engine's restartable code iterator (``enable_preemption``)
        resumable = (self.priority_scheduling and bool(getattr(engine, "supports_preempt", False))
                     and (bool(sc.preempt) or bool(sc.requeue_waiting))
                     and bool(engine.enable_preemption(True)))  # type: ignore[attr-defined]
        self.preempt_enabled = resumable and bool(sc.preempt)
        self.requeue_enabled = resumable and bool(sc.requeue_waiting)
        """``scheduler.requeue_waiting`` in effect: ``reprioritize`` resubmits waiting segments."""
        self.requeued = 0
        self.on_requeue: Callable[[int], None] | None = None
        """Called with 1 for each waiting segment resubmitted at an earlier priority (metrics)."""
        self.preempt_min_buffer_ms = float(sc.preempt_min_buffer_ms)
        self.preempt_max_per_segment = int(sc.preempt_max_per_segment)
        self._tracked: dict[str, _Tracked] = {}
        self._has_output: set[str] = set()
        self._covered: set[str] = set()
        """First segments a preemption was made for."""
        self._engine_tasks: set[asyncio.Task[None]] = set()
        """Preemptions and requeues in flight (kept referenced until done)."""
        self._preempting: set[str] = set()
        """Segments whose preemption task has not finished yet."""
        self.preempted = 0
        self.rescue_ms = float(sc.preempt_rescue_ms) if self.preempt_enabled else 0.0
        self._waiting_since: dict[str, float] = {}
        self._rescued_at: dict[str, float] = {}
        self._check_timer: asyncio.TimerHandle | None = None
        self.first_wait_s = max(0.0, float(sc.preempt_first_wait_ms)) / 1000.0
        self.rescue_queued = bool(sc.preempt_rescue_queued)
        self.rescues = 0
        """Preemptions made by ``rescue_urgent`` (also counted in ``preempted`` once done)."""
        self.on_preempt: Callable[[int], None] | None = None
        """Called with the number of preemptions each time some are started (metrics)."""
        if sc.preempt and self.priority_scheduling and not self.preempt_enabled:
            log.info("engine %s cannot preempt: scheduler.preempt has no effect", getattr(engine, "name", "?"))

    @classmethod
    def for_server(cls, server: Any) -> EngineScheduler:
        """The scheduler of ``server`` (a ``GatewayServer``: ``config``, ``engine``), made once."""
        sched = _REGISTRY.get(server)
        if sched is None:
            sched = cls(server.config, server.engine)
            metrics = getattr(server, "metrics", None)
            if metrics is not None:
                sched.on_preempt = metrics.preemptions.inc
                sched.on_requeue = metrics.requeues.inc
            _REGISTRY[server] = sched
        return sched

    # ---- admission ------------------------------------------------------------------------

    def _in_engine(self) -> int:
        try:
            n = int(self.engine.health().running_requests)
        except Exception:
            n = -1
        return max(0, n)

    def admit(self) -> AdmissionDecision | None:
        """None (admitted, no controller) or the controller's decision for a new utterance."""
        if self.admission is None:
            return None
        load = engine_load(self._in_engine(), self.max_num_seqs, len(self._first_waiting), self.priority_scheduling)
        d = self.admission.decide(load)
        if not d.admit:
            self.refused += 1
        return d

    def observe_chunk(self, steps: int, interval_s: float | None) -> None:
        """A chunk of ``steps`` GPT steps arrived ``interval_s`` after the previous one of the same
        stream, the consumer not having paused in between (None: not a clean interval)."""
        if self.admission is None or steps <= 0 or interval_s is None or interval_s <= 0:
            return
        batch = min(self.max_num_seqs, max(1, self._in_engine()))
        self.admission.observe_step(batch, interval_s * 1000.0 / steps)

    def observe_segment(self, steps: int) -> None:
        if self.admission is not None:
            self.admission.observe_segment_steps(steps)

    # ---- the segments in the engine ---------------------------------------------------------

    def submit(self, key: str, first: bool) -> None:
        """The segment ``key`` goes to the engine now (``release`` when it is done with it)."""
        if first:
            self._first_waiting.add(key)

    def first_output(self, key: str) -> None:
        self._first_waiting.discard(key)
        self._covered.discard(key)
        if key in self._tracked:
            self._has_output.add(key)

    def release(self, key: str) -> None:
        """The segment is done with the engine (finished, failed, cancelled; held or not)."""
        self._first_waiting.discard(key)
        self._tracked.pop(key, None)
        self._has_output.discard(key)
        self._covered.discard(key)
        self._waiting_since.pop(key, None)
        self._rescued_at.pop(key, None)

    # ---- preemption ---------------------------------------------------------------------------

    def track(self, key: str, group: str, first: bool, buffered_ms: Callable[[], float],
              resume_priority: Callable[[float], int]) -> None:
        """The segment ``key`` went to the engine (``release`` forgets it). While segments are
        tracked, ``check_preemptions`` runs every ``CHECK_PERIOD_S``."""
        if self.preempt_enabled:
            self._tracked[key] = _Tracked(group, first, buffered_ms, resume_priority)
            if self._check_timer is None:
                self._check_timer = asyncio.get_running_loop().call_later(CHECK_PERIOD_S, self._on_check_timer)

    def check_preemptions(self) -> None:
        """The periodic check: first segments that waited ``scheduler.preempt_first_wait_ms`` for a
        batch slot (``preempt_for_first``), then preempted segments about to run dry
        (``rescue_urgent``)."""
        now = asyncio.get_running_loop().time()
        self._note_waiting(now)
        self.preempt_for_first(min_wait_s=self.first_wait_s, now_s=now)
        self.rescue_urgent(now_s=now)

    def _note_waiting(self, now: float) -> None:
        """Since when each tracked segment waits for a batch slot (the engine's ``awaiting_slot``)."""
        awaiting = getattr(self.engine, "awaiting_slot", None)
        if not callable(awaiting):
            return
        for key in self._tracked:
            if key not in self._preempting and awaiting(key):
                self._waiting_since.setdefault(key, now)
            else:
                self._waiting_since.pop(key, None)

    def preempt_for_first(self, min_wait_s: float = 0.0, now_s: float | None = None) -> list[str]:
        """Preempt running continuing segments for first segments waiting while the engine is
        full. ``min_wait_s`` > 0: only for first segments that have waited that long for a slot
        (``_note_waiting``: a slot that turns over soon costs no preemption). Returns the keys."""
        if not self.preempt_enabled:
            return []
        if min_wait_s > 0:
            now = asyncio.get_running_loop().time() if now_s is None else now_s
            uncovered = [k for k in self._first_waiting if k not in self._covered
                         and now - self._waiting_since.get(k, now) >= min_wait_s]
        else:
            uncovered = [k for k in self._first_waiting if k not in self._covered]
        if not uncovered:
            return []
        submitted = getattr(self.engine, "submitted", None)
        in_engine = self._in_engine()
        in_engine_first = sum(1 for k in uncovered if not callable(submitted) or submitted(k))
        others = in_engine - in_engine_first
        free = max(0, self.max_num_seqs - max(0, others))
        # first segments with no output yet sit at the head of vLLM's priority queue; whatever
        # else is beyond the batch limit is a continuing segment waiting for a slot
        firsts_waiting = sum(1 for k in self._first_waiting if not callable(submitted) or submitted(k))
        # the guard against preempting into an oversubscribed engine protects victims that nothing
        # would bring back in time; with rescues on, a victim about to run dry takes a deep
        # stream's slot back, so it is not needed
        queued_continuing = 0 if self.rescue_ms > 0 else max(0, in_engine - self.max_num_seqs - firsts_waiting)
        can_preempt = getattr(self.engine, "can_preempt", None)
        # finishing segments and resumed requests still waiting for a slot cannot be preempted
        running = [r for r in self._running_segments()
                   if not r.first and (not callable(can_preempt) or can_preempt(r.key))]
        keys = choose_preemptions(running, len(uncovered), free_slots=free,
                                  min_buffer_ms=self.preempt_min_buffer_ms,
                                  max_preemptions=self.preempt_max_per_segment,
                                  queued_continuing=queued_continuing)
        for first_key, key in zip(uncovered, keys, strict=False):
            self._covered.add(first_key)
            self._start_preempt(key)
        return keys

    def rescue_urgent(self, now_s: float | None = None) -> list[tuple[str, str]]:
        """Preempt running continuing segments with audio to spare for preempted segments that
        wait for a slot while their client is about to run dry (``choose_rescues``; part of
        ``check_preemptions``, which passes ``now_s`` after ``_note_waiting``). Returns (waiting,
        preempted) pairs."""
        if self.rescue_ms <= 0 or not callable(getattr(self.engine, "awaiting_slot", None)):
            return []
        now = now_s
        if now is None:
            now = asyncio.get_running_loop().time()
            self._note_waiting(now)
        preemptions = getattr(self.engine, "preemptions", None)
        can_preempt = getattr(self.engine, "can_preempt", None)
        waiting: list[WaitingSegment] = []
        for key, since in self._waiting_since.items():
            t = self._tracked.get(key)
            if (t is None or t.first or now - since < RESCUE_MIN_WAIT_S
                    or now - self._rescued_at.get(key, -math.inf) < RESCUE_RETRY_S):
                continue
            n = preemptions(key) if callable(preemptions) else 0
            waiting.append(WaitingSegment(key, float(t.buffered_ms()), t.group, int(n or 0)))
        pairs = choose_rescues(waiting, self._running_segments(), urgent_ms=self.rescue_ms,
                               min_buffer_ms=self.preempt_min_buffer_ms,
                               max_preemptions=self.preempt_max_per_segment,
                               preemptible=lambda k: not callable(can_preempt) or bool(can_preempt(k)),
                               only_preempted=not self.rescue_queued)
        for waiting_key, key in pairs:
            self._rescued_at[waiting_key] = now
            self._start_preempt(key)
        self.rescues += len(pairs)
        return pairs

    def _running_segments(self) -> list[RunningSegment]:
        """Tracked segments the engine generates now (first ones too): they produced output, are
        not waiting for a slot (``_note_waiting``) nor being preempted, and are still in the engine."""
        preemptions = getattr(self.engine, "preemptions", None)
        out: list[RunningSegment] = []
        for key in sorted(self._has_output):
            t = self._tracked.get(key)
            if t is None or key in self._preempting or key in self._waiting_since:
                continue
            n = preemptions(key) if callable(preemptions) else 0
            if n is None:
                continue  # no longer in the engine
            out.append(RunningSegment(key, float(t.buffered_ms()), t.first, int(n), t.group))
        return out

    def _on_check_timer(self) -> None:
        self._check_timer = None
        try:
            self.check_preemptions()
        except Exception:
            log.exception("preemption check failed")
        if self._tracked:
            self._check_timer = asyncio.get_running_loop().call_later(CHECK_PERIOD_S, self._on_check_timer)

    def _start_preempt(self, key: str) -> None:
        t = self._tracked[key]
        prio = int(t.resume_priority(float(t.buffered_ms())))
        self._preempting.add(key)
        self._spawn(self._preempt(key, prio), f"preempt {key}")
        if self.on_preempt is not None:
            self.on_preempt(1)

    async def _preempt(self, key: str, priority: int) -> None:
        try:
            if await self.engine.preempt(key, priority):  # type: ignore[attr-defined]
                self.preempted += 1
                log.debug("preempted %s (resumes at priority %d)", key, priority)
        except Exception:
            log.exception("preemption of %s failed", key)
        finally:
            self._preempting.discard(key)

    # ---- re-evaluation ---------------------------------------------------------------------

    def reprioritize(self, key: str, priority: int) -> None:
        """The session re-evaluated ``key``'s deadline (``Reprioritize``): resubmit it at
        ``priority`` if it still waits in the engine for a slot (the engine checks, atomically).
        """
        if not self.requeue_enabled:
            return
        self._spawn(self._requeue(key, priority), f"requeue {key}")

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._engine_tasks.add(task)
        task.add_done_callback(self._engine_tasks.discard)

    async def _requeue(self, key: str, priority: int) -> None:
        try:
            if await self.engine.reprioritize(key, priority):  # type: ignore[attr-defined]
                self.requeued += 1
                if self.on_requeue is not None:
                    self.on_requeue(1)
                log.debug("requeued %s at priority %d", key, priority)
        except Exception:
            log.exception("requeue of %s failed", key)

"""Server-wide engine scheduling at the I/O edge: admission and deadline dispatch.

One ``EngineScheduler`` per ``GatewayServer`` (``for_server``), shared by its connections. It
is the thin asyncio shell around the pure policies of ``engine.scheduler``:

* ``admit``: ``AdmissionController`` asked before an utterance's first segment goes to the
  engine, from the engine's load (``SpeechEngine.health().running_requests``, the batch limit
  ``engine.max_num_seqs``, first segments still waiting for output) and the step time it
  learned from chunk arrivals (``observe_chunk``). ``scheduler.admission``.
* ``submit``/``release``: ``SegmentDispatcher`` decides when a continuing segment may enter the
  engine (``scheduler.dispatch`` with ``engine.scheduling_policy = "priority"``); held segments
  wait on an ``asyncio.Event``; a timer wakes the dispatcher when a held segment's client runway
  reaches ``scheduler.dispatch_lead_ms``.

No policy lives here: numbers in, decisions out.
"""

from __future__ import annotations

import asyncio
import logging
import math
import weakref
from typing import Any

from engine.api import SpeechEngine
from engine.scheduler import AdmissionController, AdmissionDecision, EngineLoad, SegmentDispatcher
from voicegw.config import Config

log = logging.getLogger("voicegw.gateway")

_REGISTRY: weakref.WeakKeyDictionary[Any, EngineScheduler] = weakref.WeakKeyDictionary()


def reserved_slots(max_num_seqs: int, fraction: float) -> int:
    """Slots held back for first segments: ``round(max_num_seqs * fraction)``, at least 1 when
    ``fraction > 0``, at most ``max_num_seqs - 1``."""
    if fraction <= 0 or max_num_seqs <= 1:
        return 0
    return max(1, min(max_num_seqs - 1, round(max_num_seqs * fraction)))


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


class EngineScheduler:
    def __init__(self, config: Config, engine: SpeechEngine) -> None:
        self.engine = engine
        self.max_num_seqs = max(1, config.engine.max_num_seqs)
        sc = config.scheduler
        self.priority_scheduling = config.engine.scheduling_policy == "priority"
        self.admission: AdmissionController | None = (
            AdmissionController(sc, first_chunk_steps=config.engine.first_chunk_steps, require_queue=True)
            if sc.admission else None
        )
        self.dispatcher: SegmentDispatcher | None = None
        if sc.dispatch and self.priority_scheduling:
            self.dispatcher = SegmentDispatcher(
                self.max_num_seqs, reserved_slots(self.max_num_seqs, sc.reserved_slots_fraction),
                lead_ms=max(0.0, sc.dispatch_lead_ms))
        self._turns: dict[str, asyncio.Event] = {}
        self._first_waiting: set[str] = set()
        self._timer: asyncio.TimerHandle | None = None
        self.refused = 0

    @classmethod
    def for_server(cls, server: Any) -> EngineScheduler:
        """The scheduler of ``server`` (a ``GatewayServer``: ``config``, ``engine``), made once."""
        sched = _REGISTRY.get(server)
        if sched is None:
            sched = cls(server.config, server.engine)
            _REGISTRY[server] = sched
        return sched

    # ---- admission ------------------------------------------------------------------------

    def _in_engine(self) -> int:
        try:
            n = int(self.engine.health().running_requests)
        except Exception:
            n = -1
        if n < 0 and self.dispatcher is not None:
            n = self.dispatcher.in_engine
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

    # ---- dispatch ---------------------------------------------------------------------------

    def submit(self, key: str, group: str, first: bool, runway_ms: float, after: list[str]) -> asyncio.Event | None:
        """None: start now. Else an event set when the segment may start (it was held)."""
        if first:
            self._first_waiting.add(key)
        d = self.dispatcher
        if d is None:
            return None
        now = asyncio.get_running_loop().time()
        if d.submit(key, group, first, now, runway_ms, after):
            return None
        ev = asyncio.Event()
        self._turns[key] = ev
        self._pump()  # may start it at once (the event is then already set)
        return ev

    def runway_ms(self, key: str) -> float | None:
        d = self.dispatcher
        return None if d is None else d.runway_ms(key, asyncio.get_running_loop().time())

    def first_output(self, key: str) -> None:
        self._first_waiting.discard(key)

    def credit(self, group: str, audio_ms: float) -> None:
        if self.dispatcher is not None:
            self.dispatcher.credit(group, audio_ms)

    def release(self, key: str) -> None:
        """The segment is done with the engine (finished, failed, cancelled; held or not)."""
        self._first_waiting.discard(key)
        self._turns.pop(key, None)
        if self.dispatcher is not None:
            self.dispatcher.release(key)
            self._pump()

    def _pump(self) -> None:
        d = self.dispatcher
        if d is None:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        for key in d.poll(now):
            ev = self._turns.pop(key, None)
            if ev is not None:
                ev.set()
            else:  # its waiter is gone (cannot happen: release removes it first); free the slot
                d.release(key)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        at = d.next_wake_s(now)
        if at is not None and math.isfinite(at):
            self._timer = loop.call_at(max(at, now + 0.005), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._pump()

"""Server-wide admission at the I/O edge (no dispatching: the engine schedules FCFS).

One ``EngineScheduler`` per ``GatewayServer`` (``for_server``), shared by its connections. It
is the thin shell around the pure policy of ``gateway.scheduling``: ``admit`` asks the
``AdmissionController`` before an utterance's first segment goes to the engine, from the engine's
load (``SpeechEngine.health().running_requests``, the batch limit ``engine.max_num_seqs``) and
the step time it learned from chunk arrivals (``observe_chunk``). ``scheduler.admission``.

No policy lives here: numbers in, decisions out. (Gateway-side dispatch, preemption, rescues,
requeueing and deadline priorities were measured to lose and are gone: bench/RESULTS.md.)
"""

from __future__ import annotations

import weakref
from typing import Any

from engine.api import SpeechEngine
from gateway.config import GatewaySettings
from gateway.scheduling import REALTIME_STEP_MS, AdmissionController, AdmissionDecision, EngineLoad

_REGISTRY: weakref.WeakKeyDictionary[Any, EngineScheduler] = weakref.WeakKeyDictionary()


def engine_load(in_engine: int, max_num_seqs: int) -> EngineLoad:
    """The load a new utterance's first segment meets. ``in_engine``: requests the engine holds
    (running or queued). The engine is FCFS: every queued request is ahead of it."""
    seqs = max(1, max_num_seqs)
    total = max(0, in_engine)
    running = min(total, seqs)
    return EngineLoad(running=running, waiting_ahead=total - running, max_num_seqs=seqs)


class EngineScheduler:
    def __init__(self, config: GatewaySettings, engine: SpeechEngine) -> None:
        self.engine = engine
        self.max_num_seqs = max(1, config.engine.max_num_seqs)
        sc = config.scheduler
        self.admission: AdmissionController | None = (
            AdmissionController(sc, first_chunk_steps=config.engine.first_audio_steps, require_queue=True,
                                max_step_ms=REALTIME_STEP_MS if sc.realtime_guard else None)
            if sc.admission else None
        )
        self.refused = 0

    @classmethod
    def for_server(cls, server: Any) -> EngineScheduler:
        """The scheduler of ``server`` (a ``GatewayServer``: ``config``, ``engine``), made once."""
        sched = _REGISTRY.get(server)
        if sched is None:
            sched = _REGISTRY[server] = cls(server.config, server.engine)
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
        load = engine_load(self._in_engine(), self.max_num_seqs)
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

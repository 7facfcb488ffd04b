"""Admission: the gateway's one scheduling decision, whether a new utterance may start now.

Pure policy: no asyncio, no sockets, no torch. Its I/O-edge shell (``gateway/admission.py``)
feeds it numbers (engine load, step times, segment lengths) and acts on what it returns. The
engine itself schedules first come, first served (vLLM's default ``fcfs``): the gateway sets no
request priorities (deadline priorities, vLLM ``scheduling_policy="priority"``, lost to FCFS:
bench/RESULTS.md).

* ``AdmissionController``: before an utterance starts, estimate its time-to-first-audio from the
  engine load (running / waiting counts, ``max_num_seqs``; under FCFS every waiting request is
  ahead of a new one) and a step-time model fed with observations (``StepTimeEstimator``). If it
  cannot start within ``ttfa_target_ms``, refuse with error code ``engine_overloaded``
  (``OVERLOADED_CODE``) and a ``retry_after_ms`` hint. An idle engine always admits, and a
  refusal needs the estimate to exceed both the target and ``idle_slack`` x the idle estimate (a
  slow machine that cannot meet the target even idle degrades latency instead of refusing
  everyone). The gateway uses ``require_queue``: it refuses only when no batch slot is free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.config import SchedulerConfig

#: The longest ``retry_after_ms`` a refusal carries (docs/protocol.md; clients cap their wait there too).
MAX_RETRY_AFTER_MS = 5_000

#: Error code of an admission refusal: the gateway's ``error`` message ``code``
#: (``gateway.protocol.ErrorCode.ENGINE_OVERLOADED``; a test keeps them equal).
OVERLOADED_CODE = "engine_overloaded"

#: Real-time duration of one ChatTTS GPT step (512 samples at 24 kHz).
REALTIME_STEP_MS = 512 / 24_000 * 1000.0


# ---------------------------------------------------------------------------------------------
# Step-time model and admission


class StepTimeEstimator:
    """Engine step time as a function of batch size, learned from observations.

    Model: ``step_ms(b) = a + c * b`` (a: fixed per-step cost, c: per-sequence cost), fitted by
    least squares over exponentially decayed observations (``half_life`` observations), so it
    follows load and machine changes. With observations at one batch size only, the slope is
    not identifiable: the step is split into ``overhead_fraction`` fixed cost and the rest per
    sequence. With no observation, ``prior_step_ms`` at batch 1 is used the same way.

    Feed it with ``observe(batch_size, step_ms)``: e.g. per engine step from engine stats, or
    from a chunk of ``n`` steps that took ``t`` ms to arrive while ``b`` requests ran
    (``observe(b, t / n)``).
    """

    def __init__(
        self, prior_step_ms: float = 40.0, half_life: float = 200.0, overhead_fraction: float = 0.5
    ) -> None:
        if prior_step_ms <= 0 or half_life <= 0 or not 0 <= overhead_fraction <= 1:
            raise ValueError("invalid StepTimeEstimator parameters")
        self.prior_step_ms = prior_step_ms
        self.overhead_fraction = overhead_fraction
        self._decay = 0.5 ** (1.0 / half_life)
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.observations = 0

    def observe(self, batch_size: int, step_ms: float) -> None:
        if batch_size < 1 or not math.isfinite(step_ms) or step_ms <= 0:
            return
        d = self._decay
        x, y = float(batch_size), float(step_ms)
        self._w = self._w * d + 1.0
        self._x = self._x * d + x
        self._y = self._y * d + y
        self._xx = self._xx * d + x * x
        self._xy = self._xy * d + x * y
        self.observations += 1

    def coefficients(self) -> tuple[float, float]:
        """(a, c) of ``step_ms(b) = a + c * b``; both >= 0."""
        if self._w <= 0:
            return self._split(1.0, self.prior_step_ms)
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var <= 1e-6 * max(1.0, mx * mx):
            return self._split(mx, my)
        c = (self._xy / self._w - mx * my) / var
        a = my - c * mx
        if c < 0:  # noise: step time does not fall with batch size
            return max(0.0, my), 0.0
        if a < 0:  # force through a non-negative intercept
            return 0.0, my / mx
        return a, c

    def _split(self, batch: float, step_ms: float) -> tuple[float, float]:
        a = self.overhead_fraction * step_ms
        return a, (step_ms - a) / batch

    def predict(self, batch_size: int) -> float:
        a, c = self.coefficients()
        return a + c * max(1, batch_size)


@dataclass(frozen=True)
class EngineLoad:
    """Engine load as the gateway sees it when an utterance asks to start."""

    running: int
    """Requests the engine is stepping."""
    waiting_ahead: int
    """Requests waiting for a batch slot ahead of a new utterance's first segment (under FCFS:
    every waiting request)."""
    max_num_seqs: int
    """Engine batch limit (``EngineConfig.max_num_seqs``)."""


@dataclass(frozen=True)
class AdmissionDecision:
    admit: bool
    estimated_ttfa_ms: float
    """Predicted time from first segment submitted to first audio chunk out of the engine."""
    limit_ms: float
    """The bound the estimate was compared with."""
    code: str | None = None
    """``OVERLOADED_CODE`` when refused."""
    retry_after_ms: float = 0.0
    """Hint for the client when refused: how much sooner the engine should be able to start."""
    reason: str = ""


class AdmissionController:
    """Refuses a new utterance when its first audio cannot come within ``ttfa_target_ms``.

    Estimate (documented in docs/loadtest.md):

    * free slots ``f = max_num_seqs - running``. If ``waiting_ahead < f`` the first segment
      joins the batch at the next step: no queue wait.
    * otherwise it needs ``k = waiting_ahead - f + 1`` running requests to finish first. With
      segments of ``L`` steps on average (``observe_segment_steps``) and ``max_num_seqs``
      requests running with staggered starts, one finishes every ``L / max_num_seqs`` steps:
      queue wait ``= k * L / max_num_seqs`` steps at ``step_ms(max_num_seqs)``.
    * then ``1 + first_chunk_steps`` steps (prefill + steps before the first decoded chunk) at
      ``step_ms(batch)`` with ``batch = min(max_num_seqs, running + waiting_ahead + 1)``, plus
      ``decode_ms`` for the first chunk.

    Admit when the estimate <= ``max(ttfa_target_ms, idle_slack * idle estimate)``, or when the
    engine is idle, or (``require_queue``, what the gateway uses) when a batch slot is free: then
    the new utterance joins the batch at once and refusing it would not make anyone faster; the
    step-time model only decides how long a queue is too long.

    ``max_step_ms`` (optional, the real-time guard: ``REALTIME_STEP_MS``): before the free-slot
    rule, refuse when the learned step time at the batch the utterance would join exceeds
    ``max(max_step_ms, idle_slack x step(1))``: the answers already playing would fall behind real
    time (a machine slower than that at batch 1 refuses only past ``idle_slack`` x its batch-1
    step). The guard acts once the model has ``guard_min_observations`` observations: a prior is
    no ground for refusing anyone.
    """

    def __init__(
        self,
        config: SchedulerConfig | None = None,
        estimator: StepTimeEstimator | None = None,
        first_chunk_steps: int = 6,
        decode_ms: float = 10.0,
        mean_segment_steps: float = 150.0,
        idle_slack: float = 1.5,
        max_step_ms: float | None = None,
        require_queue: bool = False,
        guard_min_observations: int = 32,
    ) -> None:
        self.config = config or SchedulerConfig()
        self.require_queue = require_queue
        self.estimator = estimator or StepTimeEstimator()
        self.first_chunk_steps = first_chunk_steps
        self.decode_ms = decode_ms
        self.idle_slack = idle_slack
        self.max_step_ms = max_step_ms
        self.guard_min_observations = guard_min_observations
        self._segment_steps = mean_segment_steps
        self._segment_alpha = 0.05

    @property
    def mean_segment_steps(self) -> float:
        return self._segment_steps

    def observe_step(self, batch_size: int, step_ms: float) -> None:
        self.estimator.observe(batch_size, step_ms)

    def observe_segment_steps(self, steps: int) -> None:
        """A finished segment ran this many GPT steps (EWMA of segment length)."""
        if steps > 0:
            self._segment_steps += self._segment_alpha * (steps - self._segment_steps)

    def estimate_ttfa_ms(self, load: EngineLoad) -> float:
        max_seqs = max(1, load.max_num_seqs)
        running = max(0, load.running)
        ahead = max(0, load.waiting_ahead)
        free = max(0, max_seqs - running)
        est = self.estimator
        wait_ms = 0.0
        if ahead >= free:
            needed = ahead - free + 1
            wait_steps = needed * self._segment_steps / max_seqs
            wait_ms = wait_steps * est.predict(max_seqs)
        batch = min(max_seqs, running + ahead + 1)
        return wait_ms + (1 + self.first_chunk_steps) * est.predict(batch) + self.decode_ms

    def idle_estimate_ms(self) -> float:
        return self.estimate_ttfa_ms(EngineLoad(running=0, waiting_ahead=0, max_num_seqs=1))

    def decide(self, load: EngineLoad) -> AdmissionDecision:
        estimate = self.estimate_ttfa_ms(load)
        limit = max(self.config.ttfa_target_ms, self.idle_slack * self.idle_estimate_ms())
        if load.running <= 0 and load.waiting_ahead <= 0:
            return AdmissionDecision(True, estimate, limit, reason="idle engine")
        guard = self._realtime_guard(load, estimate, limit)
        if guard is not None:
            return guard
        if self.require_queue and load.waiting_ahead < max(0, load.max_num_seqs - load.running):
            return AdmissionDecision(True, estimate, limit, reason="a batch slot is free")
        if estimate > limit:
            return AdmissionDecision(
                False,
                estimate,
                limit,
                code=OVERLOADED_CODE,
                retry_after_ms=min(MAX_RETRY_AFTER_MS, math.ceil(estimate - limit)),
                reason=f"estimated time to first audio {estimate:.0f} ms > {limit:.0f} ms",
            )
        return AdmissionDecision(True, estimate, limit, reason="within target")

    def _realtime_guard(self, load: EngineLoad, estimate: float, limit: float) -> AdmissionDecision | None:
        """The refusal of the real-time guard (``max_step_ms``), or None."""
        if self.max_step_ms is None or self.estimator.observations < self.guard_min_observations:
            return None
        batch = min(max(1, load.max_num_seqs), load.running + load.waiting_ahead + 1)
        step = self.estimator.predict(batch)
        bound = max(self.max_step_ms, self.idle_slack * self.estimator.predict(1))
        if step <= bound:
            return None
        return AdmissionDecision(
            False,
            estimate,
            limit,
            code=OVERLOADED_CODE,
            retry_after_ms=min(MAX_RETRY_AFTER_MS, math.ceil((step - bound) * self._segment_steps)),
            reason=f"step time at batch {batch} {step:.1f} ms > {bound:.1f} ms",
        )

"""The gateway's scheduling policy, the one place it is decided: segment -> engine priority, and
admission.

Pure policy: no asyncio, no sockets, no torch. The session says what it knows (first segment of
an utterance or not, the audio its client has ahead, the time); the gateway's dispatch feeds the
admission side numbers (engine load, step times) and acts on what it returns.

Why: FCFS engines make a new speaker wait behind streams that already have seconds of audio
buffered at their client. What matters to a listener is the *playback deadline*: the moment
their client runs out of audio. A stream with 3 s buffered can wait 2 s without a glitch; a
new utterance with nothing buffered cannot wait at all. So:

* ``SchedulingPolicy.segment_priority`` maps a segment to a vLLM request priority (lower runs
  first, vLLM ``scheduling_policy="priority"``), earliest deadline first: priority = the moment the segment's audio is needed, in ``bucket_ms`` units since
  the policy's epoch:

  ==========================  ======================================================
  segment                     deadline
  ==========================  ======================================================
  first of an utterance       ``now - first_lead_ms`` (default 0)
  continuing                  ``now + client buffer - slack_ms`` (slack default
                              ``urgent_buffer_ms``), clamped to [now, now + horizon]
  ==========================  ======================================================

  Deadlines do not drift (the client plays its buffer exactly as fast as the clock runs), so a
  waiting request needs no re-evaluation.

  The client buffer is estimated by ``client_buffered_ms`` from what the gateway sent, the
  client's last ``playback`` report and the time since that report (the gateway's
  ``FlowControl.ahead_ms`` is the same quantity).

* What vLLM does with the priority (0.32, read from ``v1/core/sched/scheduler.py``): the
  WAITING queue is a heap ordered by ``(priority, arrival_time)``; when KV blocks run out the
  running request with the largest ``(priority, arrival_time)`` is preempted (recomputed
  later). Running requests are stepped together; a priority does not change a running
  request's step rate, and vLLM has no API to change the priority of a request already
  submitted.

* Admission (``AdmissionController``): before an utterance starts, estimate its
  time-to-first-audio from the engine load (running / waiting counts, ``max_num_seqs``) and a
  step-time model fed with observations (``StepTimeEstimator``). If it cannot start within
  ``ttfa_target_ms``, refuse with error code ``engine_overloaded`` (``OVERLOADED_CODE``) and a
  ``retry_after_ms`` hint. An idle engine always admits, and a refusal needs the estimate to
  exceed both the target and ``idle_slack`` x the idle estimate (a slow machine that cannot
  meet the target even idle degrades latency instead of refusing everyone). The gateway
  (``gateway/dispatch.py``) uses ``require_queue``: it refuses only when no batch slot is free.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

from voicegw.config import SchedulerConfig

#: ``(first_in_utterance, client_buffered_ms, now_s) -> priority`` (lower runs sooner, vLLM
#: ``scheduling_policy="priority"``). ``client_buffered_ms``: the audio the client still has to
#: play before this segment's audio (sent-not-played, held in the gateway, and the estimated
#: rest of segments still generating); ``now_s``: the session's clock.
PriorityFn: TypeAlias = Callable[[bool, float, float], int]

#: Error code of an admission refusal: the gateway's ``error`` message ``code``
#: (``gateway.protocol.ErrorCode.ENGINE_OVERLOADED``; a test keeps them equal).
OVERLOADED_CODE = "engine_overloaded"

#: Real-time duration of one ChatTTS GPT step (512 samples at 24 kHz).
REALTIME_STEP_MS = 512 / 24_000 * 1000.0


def client_buffered_ms(
    sent_samples: int,
    played_samples: int,
    sample_rate_hz: int,
    ms_since_report: float = 0.0,
    playing: bool = True,
    unsent_samples: int = 0,
) -> float:
    """Audio ahead of the client's playhead, in ms, as far as the gateway can tell now.

    ``sent_samples``: samples sent on the socket since the origin of ``played_samples`` (the
    same counter origin, e.g. the session or the utterance). ``played_samples``: from the
    client's last ``playback`` report. ``ms_since_report``: time since that report arrived;
    while the client is ``playing`` it consumed that much more. ``unsent_samples``: audio
    already synthesized but held by flow control; it is as good as buffered for the deadline.
    """
    if sample_rate_hz <= 0:
        raise ValueError("sample_rate_hz must be > 0")
    in_flight_ms = max(0, sent_samples - played_samples) * 1000.0 / sample_rate_hz
    if playing:
        in_flight_ms -= max(0.0, ms_since_report)
    return max(0.0, in_flight_ms) + max(0, unsent_samples) * 1000.0 / sample_rate_hz


class SchedulingPolicy:
    """Maps segments to vLLM priorities from the client's playback deadline (earliest deadline
    first).

    A continuing segment's deadline is ``now + buffered_ms - slack_ms`` (when its client runs dry,
    less ``slack_ms`` -- default ``urgent_buffer_ms`` -- for the time from getting a batch slot to
    first audio), clamped to ``[now, now + priority_levels * bucket_ms]`` (streams buffered deeper
    than the horizon are all "far"); a first segment's is ``now - first_lead_ms`` (default 0: as
    urgent as a stream about to run dry, more urgent than any stream with audio in hand, and after
    older requests already due). The priority is the deadline in ``bucket_ms`` units since
    ``epoch_s``. Deadlines do not move as time passes (a client plays its buffer at the rate the
    clock advances), so a request waiting in vLLM keeps the right place in the queue without any
    re-evaluation, and vLLM's KV-pressure preemption picks the latest deadline.
    ``first_lead_ms = priority_levels * bucket_ms`` is "first segment always first": measured on
    CPU it starved playing streams (bench/RESULTS.md), so it is not the default.
    """

    def __init__(
        self,
        config: SchedulerConfig | None = None,
        epoch_s: float = 0.0,
        first_lead_ms: float = 0.0,
        slack_ms: float | None = None,
    ) -> None:
        self.config = config or SchedulerConfig()
        if self.config.priority_levels < 1:
            raise ValueError("priority_levels must be >= 1")
        if self.config.bucket_ms <= 0:
            raise ValueError("bucket_ms must be > 0")
        self.epoch_s = epoch_s
        self.horizon_ms = self.config.priority_levels * self.config.bucket_ms
        self.first_lead_ms = max(0.0, first_lead_ms)
        self.slack_ms = self.config.urgent_buffer_ms if slack_ms is None else max(0.0, slack_ms)

    def deadline_ms(self, segment_index: int, buffered_ms: float, now_s: float) -> float:
        """When this segment's first audio is needed, ms since ``epoch_s``."""
        now_ms = (now_s - self.epoch_s) * 1000.0
        if segment_index <= 0:
            return now_ms - self.first_lead_ms
        return now_ms + min(max(0.0, buffered_ms - self.slack_ms), self.horizon_ms)

    def segment_priority(self, segment_index: int, buffered_ms: float, now_s: float = 0.0) -> int:
        """vLLM priority of a segment (lower runs first).

        ``segment_index``: 0 for the first segment of an utterance. ``buffered_ms``: audio the
        client has ahead of its playhead for this stream (``client_buffered_ms``). ``now_s``:
        monotonic time.
        """
        return math.floor(self.deadline_ms(segment_index, buffered_ms, now_s) / self.config.bucket_ms)

    def priority_fn(self) -> PriorityFn:
        """This policy as the session's ``PriorityFn``."""

        def fn(first_in_utterance: bool, client_buffered_ms: float, now_s: float) -> int:
            return self.segment_priority(0 if first_in_utterance else 1, client_buffered_ms, now_s)

        return fn


def make_priority_fn(
    config: SchedulerConfig | None = None,
    first_lead_ms: float = 0.0,
    slack_ms: float | None = None,
) -> PriorityFn:
    """The deadline policy as a ``PriorityFn``; its epoch is the first call's ``now_s`` (so
    priorities stay small numbers). One function serves every session of a server: their
    deadlines share the epoch."""
    policy: SchedulingPolicy | None = None

    def fn(first_in_utterance: bool, client_buffered_ms: float, now_s: float) -> int:
        nonlocal policy
        if policy is None:
            policy = SchedulingPolicy(config, epoch_s=now_s, first_lead_ms=first_lead_ms, slack_ms=slack_ms)
        return policy.segment_priority(0 if first_in_utterance else 1, client_buffered_ms, now_s)

    return fn


def fcfs_priority(first_in_utterance: bool, client_buffered_ms: float, now_s: float) -> int:
    """Every segment alike: the engine's arrival order (vLLM ``scheduling_policy="fcfs"``)."""
    return 0


def priority_fn_for(config: SchedulerConfig, scheduling_policy: str) -> PriorityFn:
    """What a server uses: the deadline policy when the engine schedules by priority, else FCFS."""
    return make_priority_fn(config) if scheduling_policy == "priority" else fcfs_priority


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
    """Requests waiting for the engine that a new utterance's first segment would not overtake
    (other new utterances' first segments)."""
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
    step-time model only decides how long a queue is too long. ``max_step_ms`` (optional): also refuse when the predicted step time at the
    new batch size exceeds it (e.g. ``REALTIME_STEP_MS``: every running stream would fall
    behind real time).
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
    ) -> None:
        self.config = config or SchedulerConfig()
        self.require_queue = require_queue
        self.estimator = estimator or StepTimeEstimator()
        self.first_chunk_steps = first_chunk_steps
        self.decode_ms = decode_ms
        self.idle_slack = idle_slack
        self.max_step_ms = max_step_ms
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
        if self.require_queue and load.waiting_ahead < max(0, load.max_num_seqs - load.running):
            return AdmissionDecision(True, estimate, limit, reason="a batch slot is free")
        if estimate > limit:
            return AdmissionDecision(
                False,
                estimate,
                limit,
                code=OVERLOADED_CODE,
                retry_after_ms=math.ceil(estimate - limit),
                reason=f"estimated time to first audio {estimate:.0f} ms > {limit:.0f} ms",
            )
        if self.max_step_ms is not None:
            batch = min(max(1, load.max_num_seqs), load.running + load.waiting_ahead + 1)
            step = self.estimator.predict(batch)
            if step > self.max_step_ms:
                return AdmissionDecision(
                    False,
                    estimate,
                    limit,
                    code=OVERLOADED_CODE,
                    retry_after_ms=math.ceil((step - self.max_step_ms) * self._segment_steps),
                    reason=f"step time at batch {batch} {step:.1f} ms > {self.max_step_ms:.1f} ms",
                )
        return AdmissionDecision(True, estimate, limit, reason="within target")

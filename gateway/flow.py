"""Flow-control accounting (pure): how far the server may run ahead of the client's playhead.

Everything is counted in samples of the session's stream, which is the concatenation of all the
audio the server sent in this session (utterances back to back).

* ``sent``: samples sent so far.
* ``consumed``: samples the client is done with: played, or discarded by a ``cancel``.
* ``ahead = sent - consumed``: audio buffered at the client or in flight. The server sends a
  frame only while ``ahead + frame <= window`` and pulls engine audio only while it could send it.

Where ``consumed`` comes from:

* Reporting clients (``playback`` messages, ``played_samples`` = cumulative samples actually
  played): ``consumed = played_samples + discarded``. A report below the previous one is ignored. Nothing is extrapolated while reports are
  fresh: the server never runs more than the window ahead of the reported playhead.
* Clients that never report, or whose last report is older than ``stale_report_ms``: a virtual
  playhead that plays in real time from the first audio (or from the last report's position, once
  that report is stale), stops when it catches up with ``sent`` (an underrun) and restarts with
  the next audio.
* ``cancel``: the client drops its buffer, so ``consumed`` jumps to ``sent``; the samples the
  client had not played are ``discarded`` (exact when ``cancel`` carries ``played_samples``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FlowConfig:
    sample_rate_hz: int
    window_ms: float
    """``LimitsConfig.flow_window_ms``."""
    stale_report_ms: float = 1_500.0
    """A report older than this no longer holds the playhead: the virtual playhead takes over."""

    @property
    def window_samples(self) -> int:
        return max(1, int(self.window_ms * self.sample_rate_hz / 1000.0))


class FlowControl:
    """Playhead estimate and send credit for one session's audio stream."""

    def __init__(self, config: FlowConfig, now_s: float) -> None:
        self.config = config
        self.rate = config.sample_rate_hz
        self.window = config.window_samples
        self.sent = 0
        self.discarded = 0
        self._virtual = 0.0
        self._virtual_t = now_s
        self._reported: int | None = None
        """Client's last ``played_samples``."""
        self._report_t = 0.0

    # ---- events -------------------------------------------------------------------------

    def on_sent(self, now_s: float, samples: int) -> None:
        self._advance(now_s)
        self.sent += samples

    def on_playback(self, now_s: float, played_samples: int) -> None:
        """A ``playback`` report: the client's cumulative played-sample counter."""
        self._advance(now_s)
        # counters only move forward: a report below the last one (a client that resets its counter
        # per utterance, or a stale/reordered one) is ignored, so it neither refreshes the report nor
        # resets the virtual playhead; once the last good report is stale the virtual playhead plays
        if self._reported is not None and played_samples < self._reported:
            return
        # a client can never have played more than it got
        self._reported = min(played_samples, self.sent - self.discarded)
        self._report_t = now_s
        # the virtual playhead restarts from the report, and only moves once the report is stale
        self._virtual = float(self._reported + self.discarded)
        self._virtual_t = now_s + self.config.stale_report_ms / 1000.0

    def on_cancel(self, now_s: float, client_played: int | None) -> int:
        """The client dropped its buffer. Returns the client played counter used (exact when it
        sent one, else the estimate)."""
        est = self.client_played(now_s) if client_played is None else client_played
        est = max(0, min(est, self.sent - self.discarded))
        self.discarded = self.sent - est
        if self._reported is not None:
            self._reported = est
        self._virtual = float(self.sent)
        self._virtual_t = now_s
        return est

    def discard_ahead(self, now_s: float, samples: int) -> None:
        """The client drops ``samples`` it has not played yet at the end of what it holds (one
        utterance stopped while an earlier one still plays): they count as consumed."""
        self._advance(now_s)
        n = max(0, min(samples, self.sent - self.consumed(now_s)))
        self.discarded += n
        self._virtual = min(float(self.sent), self._virtual + n)

    # ---- queries ------------------------------------------------------------------------

    @property
    def reporting(self) -> bool:
        return self._reported is not None

    def consumed(self, now_s: float) -> int:
        """Samples of the session stream the client is done with (played or discarded)."""
        self._advance(now_s)
        if self._reported is not None and now_s - self._report_t <= self.config.stale_report_ms / 1000.0:
            return min(self.sent, self._reported + self.discarded)
        return min(self.sent, int(self._virtual + 1e-6))

    def client_played(self, now_s: float) -> int:
        """Estimate of the client's own played counter (which does not count discarded audio)."""
        return max(0, self.consumed(now_s) - self.discarded)

    def ahead(self, now_s: float) -> int:
        return self.sent - self.consumed(now_s)

    def ahead_ms(self, now_s: float) -> float:
        return self.ahead(now_s) * 1000.0 / self.rate

    def left_estimate(self, now_s: float) -> int:
        """Samples the client has still to play, its best estimate: ``ahead``, less what a reporting
        client has played since its last fresh report (real time). Not used for send credit, which
        never extrapolates; it tells when the listener is about to run dry."""
        ahead = self.ahead(now_s)
        if self._reported is not None and now_s - self._report_t <= self.config.stale_report_ms / 1000.0:
            ahead -= int((now_s - self._report_t) * self.rate)
        return max(0, ahead)

    def can_send(self, now_s: float, samples: int) -> bool:
        ahead = self.ahead(now_s)
        return ahead == 0 or ahead + samples <= self.window

    def credit_deadline_s(self, now_s: float, samples: int) -> float | None:
        """When ``can_send(samples)`` will turn true if no report comes (None: it is true now)."""
        if self.can_send(now_s, samples):
            return None
        ahead = self.ahead(now_s)
        # samples the playhead must advance (sending is always allowed once nothing is ahead);
        # the virtual playhead moves from _virtual_t on (after a fresh report: once it is stale)
        need = min(ahead, ahead + samples - self.window)
        return max(now_s, self._virtual_t) + need / self.rate

    def _advance(self, now_s: float) -> None:
        dt = now_s - self._virtual_t
        if dt > 0:
            self._virtual = min(float(self.sent), self._virtual + dt * self.rate)
            self._virtual_t = now_s


class WaterMarks:
    """High/low water marks with hysteresis: ``paused`` turns on above ``high`` and off again at
    or below ``low`` (the websockets/uvicorn flow-control pattern)."""

    def __init__(self, high: int, low: int | None = None) -> None:
        if low is None:
            low = high // 4
        if not 0 <= low <= high:
            raise ValueError("need 0 <= low <= high")
        self.high = high
        self.low = low
        self.paused = False

    def update(self, level: int) -> bool | None:
        """Feed the current level; returns True when it just paused, False when it just
        resumed, None when nothing changed."""
        if not self.paused and level > self.high:
            self.paused = True
            return True
        if self.paused and level <= self.low:
            self.paused = False
            return False
        return None

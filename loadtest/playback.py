"""A simulated client jitter buffer that plays audio in (simulated) real time. Pure: no I/O.

It behaves like the browser client (AudioWorklet ring buffer, see the client notes):

* audio arrives in frames (``push``); playback starts once ``prebuffer_ms`` is queued (or the
  utterance's audio is complete, for clips shorter than the prebuffer);
* while playing, the playhead advances at the sample rate (``advance(now)``, computed
  analytically: no ticking);
* if the buffer runs dry while more audio of the utterance is still expected, that is an
  UNDERRUN: silence is played, counted and timed, and playback resumes once the (raised)
  target is queued again (target + ``underrun_step_ms``, capped at ``max_prebuffer_ms``);
* if it runs dry after the utterance's last audio (``end_of_audio``), playback just stops.
* ``cancel`` drops everything queued (a barge-in stops the speaker at once).

Times are seconds (any monotonic origin); sample counts are ints.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class UnderrunEvent:
    start_s: float
    end_s: float | None = None

    @property
    def duration_ms(self) -> float:
        return 0.0 if self.end_s is None else (self.end_s - self.start_s) * 1000.0


@dataclass
class JitterBuffer:
    sample_rate_hz: int
    prebuffer_ms: float = 80.0
    underrun_step_ms: float = 20.0
    max_prebuffer_ms: float = 300.0

    queued_samples: int = 0
    played_samples: int = 0
    """Cumulative real samples played since the session start (the ``playback`` report field)."""
    playing: bool = False
    expecting: bool = False
    """True while the current utterance may still deliver audio."""
    underruns: list[UnderrunEvent] = field(default_factory=list)
    _clock_s: float | None = None
    _frac: float = 0.0
    _target_ms: float = 0.0
    _in_underrun: bool = False

    def __post_init__(self) -> None:
        self._target_ms = self.prebuffer_ms

    # ----------------------------------------------------------------------------- queries

    @property
    def buffered_ms(self) -> float:
        return self.queued_samples * 1000.0 / self.sample_rate_hz

    @property
    def underrun_count(self) -> int:
        return len(self.underruns)

    @property
    def open_underrun(self) -> UnderrunEvent | None:
        """The underrun in progress, if any."""
        return self.underruns[-1] if self._in_underrun and self.underruns else None

    @property
    def target_ms(self) -> float:
        return self._target_ms

    def underrun_ms(self, now_s: float | None = None) -> float:
        """Total silence heard because of underruns (an open one counts up to ``now_s``)."""
        total = 0.0
        for ev in self.underruns:
            if ev.end_s is not None:
                total += ev.duration_ms
            elif now_s is not None:
                total += max(0.0, now_s - ev.start_s) * 1000.0
        return total

    # ----------------------------------------------------------------------------- events

    def begin_utterance(self, now_s: float) -> None:
        """More audio is coming (an utterance was started by the client)."""
        self.advance(now_s)
        self.expecting = True

    def end_of_audio(self, now_s: float) -> None:
        """The utterance will deliver no more audio (``utterance.done``)."""
        self.advance(now_s)
        self.expecting = False
        if self._in_underrun:
            self._close_underrun(now_s)
        if not self.playing and self.queued_samples > 0:
            self.playing = True  # short clip: play what there is

    def push(self, now_s: float, samples: int) -> None:
        self.advance(now_s)
        self.queued_samples += samples
        self._maybe_start(now_s)

    def cancel(self, now_s: float) -> int:
        """Barge-in: drop queued audio, stop. Returns the samples dropped."""
        self.advance(now_s)
        dropped = self.queued_samples
        self.queued_samples = 0
        self.playing = False
        self.expecting = False
        self._frac = 0.0
        if self._in_underrun:
            self._close_underrun(now_s)
        return dropped

    def advance(self, now_s: float) -> None:
        """Play from the last clock value up to ``now_s``."""
        if self._clock_s is None or now_s < self._clock_s:
            self._clock_s = now_s
            return
        dt = now_s - self._clock_s
        self._clock_s = now_s
        if not self.playing or dt <= 0:
            return
        exact = dt * self.sample_rate_hz + self._frac
        n = int(exact)
        if n < self.queued_samples:
            self.queued_samples -= n
            self.played_samples += n
            self._frac = exact - n
            return
        # ran dry inside this interval
        left = self.queued_samples
        dry_at = now_s - (exact - left) / self.sample_rate_hz
        self.played_samples += left
        self.queued_samples = 0
        self._frac = 0.0
        self.playing = False
        if self.expecting:
            self._in_underrun = True
            self.underruns.append(UnderrunEvent(start_s=max(dry_at, now_s - dt)))
            self._target_ms = min(self.max_prebuffer_ms, self._target_ms + self.underrun_step_ms)

    # ----------------------------------------------------------------------------- internals

    def _maybe_start(self, now_s: float) -> None:
        if self.playing:
            return
        if self.buffered_ms >= self._target_ms or (not self.expecting and self.queued_samples > 0):
            self.playing = True
            if self._in_underrun:
                self._close_underrun(now_s)

    def _close_underrun(self, now_s: float) -> None:
        self._in_underrun = False
        if self.underruns and self.underruns[-1].end_s is None:
            self.underruns[-1].end_s = now_s

    def drained_at(self) -> float | None:
        """When the queued audio will have played out (if playing), else None."""
        if self._clock_s is None:
            return None
        if not self.playing:
            return None if self.queued_samples else self._clock_s
        return self._clock_s + self.queued_samples / self.sample_rate_hz

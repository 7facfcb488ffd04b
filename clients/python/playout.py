"""Playback accounting, the same rules as the browser's AudioWorklet player (pure: no I/O, no time).

A ``Playout`` models a jitter buffer that an audio device drains at the stream rate:

* ``push(n)``: n samples arrived. ``end()``: the audio so far ends an utterance: when playback
  reaches this point with nothing after it, it goes idle (a clean *drain*, not an underrun).
* ``pull(n)``: the device wants n samples; returns how many real samples it gets (the rest is
  silence). Playback starts once ``target_ms`` is buffered (or the utterance is complete); when
  the buffer runs dry mid-utterance that is an *underrun*: counted, the target rises by
  ``step_ms`` (capped at ``max_target_ms``) and playback waits for the new target.
* ``cancel()``: the buffer is dropped at once.
* ``truncate(keep)``: samples buffered past position ``keep`` are dropped and what is left ends
  (a connection lost mid-segment: the client resumes from that segment; see ``Client``).

``played`` counts real samples handed to the device (never silence, never cancelled audio): it
is what ``playback.played_samples`` reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PlayoutReport:
    played_samples: int
    buffered_ms: float
    underruns: int
    target_ms: float
    state: str
    drained: bool = False


@dataclass
class Playout:
    rate_hz: int
    prebuffer_ms: float = 80.0
    step_ms: float = 20.0
    max_target_ms: float = 300.0
    written: int = 0
    """Samples ever pushed."""
    read: int = 0
    """Samples ever consumed (played or dropped by cancel)."""
    played: int = 0
    underruns: int = 0
    state: str = "idle"
    """idle | prebuffering | playing"""
    end_mark: int = -1
    target_ms: float = field(default=0.0)
    drains: int = 0
    """Clean drains so far (each ``end`` reached)."""

    def __post_init__(self) -> None:
        if not self.target_ms:
            self.target_ms = self.prebuffer_ms

    @property
    def buffered(self) -> int:
        return self.written - self.read

    @property
    def buffered_ms(self) -> float:
        return self.buffered * 1000.0 / self.rate_hz

    def push(self, n: int) -> None:
        if n <= 0:
            return
        self.written += n
        if self.state == "idle":
            self.state = "prebuffering"

    def end(self) -> None:
        self.end_mark = self.written
        if self.state == "idle" and self.buffered > 0:
            self.state = "prebuffering"

    def cancel(self) -> int:
        """Drop everything buffered; returns the played counter."""
        self.read = self.written
        self.end_mark = self.written
        self.state = "idle"
        return self.played

    def truncate(self, keep: int) -> int:
        """Drop buffered samples past stream position ``keep`` (clamped to what is buffered); the
        audio left ends there (a clean drain, not an underrun). Returns the samples dropped."""
        keep = max(self.read, min(self.written, keep))
        dropped = self.written - keep
        self.written = keep
        self.end_mark = keep
        if self.buffered == 0:
            self.state = "idle"
        elif self.state == "idle":
            self.state = "prebuffering"
        return dropped

    def pull(self, n: int) -> tuple[int, bool]:
        """The device consumes ``n`` samples of time. Returns (real samples played, drained now)."""
        if self.state == "prebuffering":
            complete = self.end_mark >= self.written
            if self.buffered > 0 and (self.buffered_ms >= self.target_ms or complete):
                self.state = "playing"
        if self.state != "playing":
            return 0, False
        k = min(n, self.buffered)
        self.read += k
        self.played += k
        drained = False
        if k < n:
            if self.read >= self.end_mark and self.written == self.end_mark:
                self.state = "idle"
                self.drains += 1
                drained = True
            else:
                self.underruns += 1
                self.target_ms = min(self.max_target_ms, self.target_ms + self.step_ms)
                self.state = "prebuffering"
        return k, drained

    def report(self, drained: bool = False) -> PlayoutReport:
        return PlayoutReport(
            played_samples=self.played,
            buffered_ms=round(self.buffered_ms, 1),
            underruns=self.underruns,
            target_ms=self.target_ms,
            state=self.state,
            drained=drained,
        )


@dataclass
class Underrun:
    """One underrun of a ``ClockedPlayout``: from when the buffer ran dry to when playback resumed
    (or the utterance's audio ended); times on the playout's clock, in s."""

    start_s: float
    end_s: float | None = None

    @property
    def duration_ms(self) -> float:
        return 0.0 if self.end_s is None else (self.end_s - self.start_s) * 1000.0


class ClockedPlayout:
    """A ``Playout`` drained in real time by a clock instead of an audio device: the load test's
    simulated listener (the same buffer rules as the Python client's player and the browser's
    worklet), with each underrun timed. ``advance(now_s)`` plays up to ``now_s``; every event
    first advances to its time. Pure (times are passed in)."""

    def __init__(self, rate_hz: int, prebuffer_ms: float = 80.0, step_ms: float = 20.0,
                 max_target_ms: float = 300.0) -> None:
        self.playout = Playout(rate_hz, prebuffer_ms=prebuffer_ms, step_ms=step_ms, max_target_ms=max_target_ms)
        self.rate_hz = rate_hz
        self.underruns: list[Underrun] = []
        self._clock_s: float | None = None
        self._frac = 0.0

    # ---- queries

    @property
    def played_samples(self) -> int:
        """Real samples played since the start (the ``playback`` report's ``played_samples``)."""
        return self.playout.played

    @property
    def queued_samples(self) -> int:
        return self.playout.buffered

    @property
    def buffered_ms(self) -> float:
        return self.playout.buffered_ms

    @property
    def playing(self) -> bool:
        return self.playout.state == "playing"

    @property
    def target_ms(self) -> float:
        return self.playout.target_ms

    @property
    def underrun_count(self) -> int:
        return len(self.underruns)

    @property
    def open_underrun(self) -> Underrun | None:
        """The underrun in progress, if any."""
        return self.underruns[-1] if self.underruns and self.underruns[-1].end_s is None else None

    def underrun_ms(self, now_s: float | None = None) -> float:
        """Silence heard because of underruns (an open one counts up to ``now_s``)."""
        return sum(u.duration_ms if u.end_s is not None
                   else (max(0.0, now_s - u.start_s) * 1000.0 if now_s is not None else 0.0)
                   for u in self.underruns)

    def drained_at(self) -> float | None:
        """When what is buffered will have played out (if playing); None while waiting to start."""
        if self._clock_s is None:
            return None
        if not self.playing:
            return None if self.playout.buffered else self._clock_s
        return self._clock_s + self.playout.buffered / self.rate_hz

    # ---- events

    def advance(self, now_s: float) -> None:
        """Play from the clock's last time up to ``now_s``."""
        if self._clock_s is None or now_s <= self._clock_s:
            if self._clock_s is None:
                self._clock_s = now_s
            return
        t1, self._clock_s = self._clock_s, now_s
        exact = (now_s - t1) * self.rate_hz + self._frac
        n = int(exact)
        self._frac = exact - n
        if n <= 0:
            return
        before = self.playout.underruns
        got, _ = self.playout.pull(n)
        if got and self.open_underrun is not None:
            self.open_underrun.end_s = t1  # playback resumed at the start of this interval
        if self.playout.underruns > before:
            self.underruns.append(Underrun(t1 + got / self.rate_hz))
        if not self.playing:
            self._frac = 0.0

    def begin_utterance(self, now_s: float) -> None:
        """An utterance starts: its audio is awaited (running dry inside it is an underrun)."""
        self.advance(now_s)

    def push(self, now_s: float, samples: int) -> None:
        self.advance(now_s)
        self.playout.push(samples)
        self._maybe_start(now_s)

    def _maybe_start(self, now_s: float) -> None:
        self.playout.pull(0)  # starts playback if the target is buffered (or the audio complete)
        if self.playing and self.open_underrun is not None:
            self.open_underrun.end_s = now_s

    def play_at_once(self, samples: int) -> None:
        """A listener as fast as the wire (throughput runs): the samples count as played at once."""
        self.playout.written += samples
        self.playout.read += samples
        self.playout.played += samples

    def end_of_audio(self, now_s: float) -> None:
        """The utterance delivers no more audio (``utterance.done``): what is buffered plays out,
        and running dry after it is a drain, not an underrun."""
        self.advance(now_s)
        self.playout.end()
        self._maybe_start(now_s)
        if self.open_underrun is not None:
            self.open_underrun.end_s = now_s

    def cancel(self, now_s: float) -> int:
        """Barge-in: drop what is buffered; returns the samples dropped."""
        self.advance(now_s)
        dropped = self.playout.buffered
        self.playout.cancel()
        self._frac = 0.0
        if self.open_underrun is not None:
            self.open_underrun.end_s = now_s
        return dropped

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

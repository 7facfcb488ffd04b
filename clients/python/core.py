"""The client's decisions, sans I/O: what to do after an overload refusal, a dropped connection or
a failed reconnect, where to resume an utterance, how playout is accounted.

Nothing here reads a clock, opens a socket, sleeps or imports asyncio / websockets / torch (also
at import time: tests/test_import_purity.py). Events go in as method calls with the time passed
in (``now_s``, seconds on any monotonic clock); decisions come out as plain action objects that
the I/O shell (``clients.python.client.Client``) carries out: send, schedule at ``at_s``,
reconnect, surface an error. The model is python-websockets' sans-I/O protocol and, on the server
side, ``gateway.session``.

The browser client makes the same decisions in ``clients/web/client-core.js``; both are run
against one table of scenarios (``clients/scenarios.json``: ``tests/test_client_core.py`` feeds
this module, ``tests/browser/test_client_scenarios.py`` the JS one).

Events and actions:

* ``overload_decision(policy, error_msg, ...)`` — an ``error`` about an utterance arrived:
  ``Retry(attempt, wait_ms, at_s)`` (send it again then) or ``Fail(code, reason)`` (surface it:
  ``final`` refusal, ``audio_received``, ``attempts_exhausted``, ``cancelled``).
* ``Reconnector.lost(close_code, now_s)`` — the connection dropped: ``Reconnect(attempt, wait_ms,
  at_s)``, or ``Fail("closed", "not_resumable")``; ``.failed(Failure, now_s)`` — an attempt
  failed: the next ``Reconnect`` or ``GiveUp`` (deadline passed, or a final refusal: 4xx
  handshake, a close code that says do not retry); ``.connected(now_s)`` — ``Reconnected``.
* ``connect_decision(policy, Failure, ...)`` — the first connection failed: try again (a
  capacity refusal, 503 / 1013) or give up.
* ``plan_resume(segments, ...)`` — where an unfinished utterance is sent again from
  (``ResumePoint``: its first segment not wholly received, that segment's first char and sample,
  and the playout position past which buffered audio is dropped).
* ``ClientCore.receive(msg, now_s)`` — a message from the server: the session's utterances
  (``Registry``, ``UtteranceState``) change; what the shell must do comes out (``SessionReady``,
  ``Finished``, ``CancelledUtterances``, ``RetryUtterance``, ``Refused``, ``FatalError``,
  ``Pong``).
* ``ClientCore.connection_lost(close_code, now_s)`` — ``Resumes`` (every unfinished utterance
  parked at its resume point, the playout position to cut at) and the first ``Reconnect``, or
  ``Fail``; its ``Reconnector`` takes the outage on.
* ``Playout`` — the jitter-buffer rules (push / end / pull / cancel / truncate), shared with the
  browser's AudioWorklet (``clients/web/playout-rules.js``).
"""

from __future__ import annotations

import base64
import binascii
import random
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from clients.python.playout import Playout, PlayoutReport
from gateway import protocol as P

__all__ = [
    "FINAL_CLOSES",
    "FINAL_HTTP",
    "NO_RETRY",
    "RESUMABLE_CLOSES",
    "RETRYABLE_ERRORS",
    "Fail",
    "Failure",
    "GiveUp",
    "Playout",
    "PlayoutReport",
    "Reconnect",
    "Reconnected",
    "Reconnector",
    "ResumePoint",
    "Resumes",
    "Retry",
    "RetryPolicy",
    "Segment",
    "SegmentLike",
    "SegmentPlay",
    "CancelledUtterances",
    "ClientCore",
    "FatalError",
    "Finished",
    "PlayLedger",
    "Pong",
    "Refused",
    "RetryUtterance",
    "SessionReady",
    "Registry",
    "UtteranceState",
    "UtteranceStats",
    "SegmentView",
    "connect_decision",
    "overload_decision",
    "plan_resume",
]

RESUMABLE_CLOSES = frozenset({1006, 1011, 1012, 1013})
"""Close codes after which a session is worth resuming (docs/protocol.md, close codes)."""
FINAL_CLOSES = frozenset({1002, 1007, 1008, 1009})
"""Close codes that say: do not retry (a client bug, or a policy the server enforces)."""
FINAL_HTTP = frozenset({400, 401, 403, 404, 405})
"""Handshake refusals that no retry can fix."""
RETRYABLE_ERRORS = frozenset({"engine_overloaded"})
"""Utterance errors worth sending the utterance again for; any other is a final refusal."""

Rand = Callable[[], float]
"""A source of uniform [0, 1) numbers (``random.Random().random``; a scenario's fixed list)."""


@dataclass(frozen=True)
class RetryPolicy:
    """How a ``Client`` rides out overload and dropped connections (docs/clients.md)."""

    overload_attempts: int = 3
    """Attempts in all for an utterance refused with ``engine_overloaded`` before any of its
    audio arrived (1: never retry)."""
    overload_max_wait_ms: float = 5000.0
    """Cap on one wait before an overload retry (the server's ``retry_after_ms``, jittered)."""
    reconnect: bool = True
    """Reconnect and resume after a dropped connection (1006, 1011, 1012, 1013)."""
    reconnect_initial_ms: float = 250.0
    """First backoff wait; it doubles per failed attempt."""
    reconnect_max_ms: float = 5000.0
    """Cap on one backoff wait (a server's ``Retry-After`` may ask for more: it wins)."""
    reconnect_timeout_s: float = 60.0
    """Give up (unfinished utterances fail with ``closed``) when not reconnected this long after
    the drop."""
    jitter: float = 0.2
    """Each wait is multiplied by a random factor in [1 - jitter, 1 + jitter]."""
    max_buffered_chars: int = 20_000
    """Text kept per utterance while it cannot be sent (outage, overload wait); over it the
    utterance fails with ``buffer_full``."""

    def __post_init__(self) -> None:
        if self.overload_attempts < 1:
            raise ValueError("overload_attempts must be >= 1")
        if not 0.0 <= self.jitter < 1.0:
            raise ValueError("jitter must be in [0, 1)")
        if min(self.overload_max_wait_ms, self.reconnect_initial_ms, self.reconnect_max_ms) < 0:
            raise ValueError("waits must be >= 0")
        if self.reconnect_timeout_s <= 0 or self.max_buffered_chars < 1:
            raise ValueError("reconnect_timeout_s and max_buffered_chars must be positive")

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RetryPolicy:
        """From a scenario's ``policy`` (this class's field names)."""
        return cls(**dict(d))

    def jittered_ms(self, ms: float, rnd: random.Random | Rand) -> float:
        r = rnd.random() if isinstance(rnd, random.Random) else rnd()
        return max(0.0, ms * (1.0 + self.jitter * (2.0 * r - 1.0)))

    def backoff_ms(self, attempt: int, rnd: random.Random | Rand) -> float:
        """Wait before reconnect attempt ``attempt`` (1-based)."""
        base = min(self.reconnect_max_ms, self.reconnect_initial_ms * 2.0 ** max(0, attempt - 1))
        return self.jittered_ms(base, rnd)


NO_RETRY = RetryPolicy(overload_attempts=1, reconnect=False)
"""A client that neither retries nor reconnects."""


# ------------------------------------------------------------------ actions


class _Action:
    def to_json(self) -> dict[str, Any]:
        """The action as the scenario table writes it (``action`` + fields; times in ms)."""
        out: dict[str, Any] = {"action": _ACTION_NAMES[type(self)]}
        for k, v in asdict(self).items():  # type: ignore[call-overload]
            if k == "at_s":
                out["at_ms"] = round(v * 1000.0, 3)
            else:
                out[k] = round(v, 3) if isinstance(v, float) else v
        return out


@dataclass(frozen=True)
class Retry(_Action):
    """Send the refused utterance again (attempt ``attempt``) at ``at_s``."""

    attempt: int
    wait_ms: float
    at_s: float


@dataclass(frozen=True)
class Fail(_Action):
    """Surface the error: no retry (``reason``: final | audio_received | attempts_exhausted |
    cancelled | not_resumable)."""

    code: str
    reason: str


@dataclass(frozen=True)
class Reconnect(_Action):
    """Open a new connection (attempt ``attempt``) at ``at_s``."""

    attempt: int
    wait_ms: float
    at_s: float


@dataclass(frozen=True)
class GiveUp(_Action):
    """Stop reconnecting: unfinished utterances fail with ``closed``."""

    attempts: int
    reason: str
    """deadline | final"""


@dataclass(frozen=True)
class Reconnected(_Action):
    attempts: int
    outage_ms: float


_ACTION_NAMES: dict[type, str] = {Retry: "retry", Fail: "fail", Reconnect: "reconnect", GiveUp: "give_up",
                                  Reconnected: "reconnected"}


# ------------------------------------------------------------------ overload


def overload_decision(policy: RetryPolicy, msg: Mapping[str, Any], *, attempts: int, received_samples: int,
                      now_s: float, rnd: random.Random | Rand, cancelled: bool = False) -> Retry | Fail:
    """An ``error`` about an utterance (``msg``) arrived: send it again, or let it fail.

    Retried only for a retryable code (``engine_overloaded``; any other is a final refusal),
    before any of its audio arrived (heard audio is never replayed), while attempts are left. The
    wait is the server's ``retry_after_ms`` (else ``reconnect_initial_ms``), jittered, capped at
    ``overload_max_wait_ms``."""
    code = str(msg.get("code"))
    if code not in RETRYABLE_ERRORS or msg.get("fatal"):
        return Fail(code, "final")
    if cancelled:
        return Fail(code, "cancelled")
    if received_samples > 0:
        return Fail(code, "audio_received")
    if attempts >= policy.overload_attempts:
        return Fail(code, "attempts_exhausted")
    hinted = msg.get("retry_after_ms")
    base = float(hinted) if isinstance(hinted, (int, float)) and not isinstance(hinted, bool) \
        else policy.reconnect_initial_ms
    wait_ms = min(policy.overload_max_wait_ms, policy.jittered_ms(base, rnd))
    return Retry(attempts + 1, wait_ms, now_s + wait_ms / 1000.0)


# ------------------------------------------------------------------ reconnect


@dataclass(frozen=True)
class Failure:
    """Why a connection attempt failed, as far as the shell could see (a browser sees no HTTP
    status: only the close code of a socket that opened)."""

    status: int | None = None
    """The handshake's HTTP status."""
    close_code: int | None = None
    """The close code of a socket that closed before ``session.started``."""
    retry_after_ms: float | None = None
    """The server asked to wait at least this long (``Retry-After``)."""
    error: str = ""

    @property
    def final(self) -> bool:
        return self.status in FINAL_HTTP or self.close_code in FINAL_CLOSES


CAPACITY_STATUS = 503
CAPACITY_CLOSE = 1013


def connect_decision(policy: RetryPolicy, failure: Failure, *, attempt: int, now_s: float, deadline_s: float,
                     rnd: random.Random | Rand) -> Reconnect | GiveUp:
    """The first connection (``Client.connect``) failed on attempt ``attempt``: only a server
    refusing for capacity (503 at the door, 1013 before ``session.started``) is tried again, after
    the backoff or its ``Retry-After`` (jittered), whichever is longer, while before the deadline."""
    if failure.status != CAPACITY_STATUS and failure.close_code != CAPACITY_CLOSE:
        return GiveUp(attempt, "final")
    wait_ms = policy.backoff_ms(attempt, rnd)
    if failure.retry_after_ms is not None:
        wait_ms = max(wait_ms, policy.jittered_ms(failure.retry_after_ms, rnd))
    if not policy.reconnect or now_s + wait_ms / 1000.0 > deadline_s:
        return GiveUp(attempt, "deadline")
    return Reconnect(attempt + 1, wait_ms, now_s + wait_ms / 1000.0)


class Reconnector:
    """The reconnect loop's decisions for one outage (exponential backoff with jitter, within
    ``reconnect_timeout_s`` of the drop; a final refusal stops it; a server's ``Retry-After`` is
    waited first)."""

    def __init__(self, policy: RetryPolicy, rnd: random.Random | Rand) -> None:
        self.policy = policy
        self.rnd = rnd
        self.attempt = 0
        self.t_drop_s: float | None = None
        self.deadline_s = 0.0
        self.last_error = ""

    def resumable(self, close_code: int | None, *, session_started: bool = True, closing: bool = False) -> bool:
        """Whether a drop with this close code (None: no close frame) is ridden out."""
        return (self.policy.reconnect and session_started and not closing
                and (close_code is None or close_code in RESUMABLE_CLOSES))

    def lost(self, close_code: int | None, now_s: float, *, session_started: bool = True,
             closing: bool = False) -> Reconnect | GiveUp | Fail:
        """The connection dropped: the first reconnect attempt, or fail (not resumable)."""
        if not self.resumable(close_code, session_started=session_started, closing=closing):
            return Fail("closed", "not_resumable")
        self.attempt = 0
        self.t_drop_s = now_s
        self.deadline_s = now_s + self.policy.reconnect_timeout_s
        self.last_error = ""
        return self._next(now_s, now_s)

    def failed(self, failure: Failure, now_s: float) -> Reconnect | GiveUp:
        """The attempt failed: the next one, or give up."""
        self.last_error = failure.error
        if failure.final:
            return GiveUp(self.attempt, "final")
        t = now_s
        if failure.retry_after_ms is not None:  # the server asked for at least this long
            t = now_s + max(0.0, min(failure.retry_after_ms / 1000.0, self.deadline_s - now_s))
        return self._next(t, t)

    def connected(self, now_s: float) -> Reconnected:
        t_drop = self.t_drop_s if self.t_drop_s is not None else now_s
        return Reconnected(self.attempt, round((now_s - t_drop) * 1000.0))

    def _next(self, now_s: float, base_s: float) -> Reconnect | GiveUp:
        self.attempt += 1
        wait_ms = self.policy.backoff_ms(self.attempt, self.rnd)
        if now_s + wait_ms / 1000.0 > self.deadline_s:
            return GiveUp(self.attempt, "deadline")
        return Reconnect(self.attempt, wait_ms, base_s + wait_ms / 1000.0)


# ------------------------------------------------------------------ resume planning


class SegmentLike(Protocol):
    """What resume planning reads of a segment (``SegmentView``, the client's own records)."""

    @property
    def start_char(self) -> int: ...
    @property
    def end_char(self) -> int: ...
    @property
    def sample_offset(self) -> int: ...
    @property
    def samples(self) -> int: ...
    @property
    def done(self) -> bool: ...
    @property
    def pos(self) -> int | None: ...
    @property
    def code_frames(self) -> int: ...


@dataclass
class SegmentView:
    """What the client knows of one segment of an utterance (utterance coordinates)."""

    start_char: int
    end_char: int
    sample_offset: int
    samples: int = 0
    """Samples received of it in the current take."""
    done: bool = False
    """``segment.done`` arrived: received whole."""
    pos: int | None = None
    """Playout position of its first sample (realtime/speakers), if any audio was buffered."""
    code_frames: int = 0
    """Its code frames received (``segment.codes``)."""


@dataclass(frozen=True)
class ResumePoint(_Action):
    """Send the utterance again from segment ``segment`` (its char ``char``, sample ``sample``);
    drop buffered audio past playout position ``keep`` (None: keep all). ``inside`` > 0: that
    many samples of the segment were received and are kept; the new sending goes on after them
    (``text.delta``'s ``resume``)."""

    segment: int
    char: int
    sample: int
    keep: int | None
    inside: int = 0


_ACTION_NAMES[ResumePoint] = "resume"


def can_resume_inside(seg: SegmentLike, mode: str, rate_hz: int) -> bool:
    """Whether the server (``session.started``'s ``resume``: ``mode``) can go on with ``seg`` at
    the next sample: ``samples`` always, ``codes`` when its codes cover every sample received."""
    if seg.samples <= 0:
        return False
    if mode == "samples":
        return True
    return mode == "codes" and seg.code_frames * P.SAMPLES_PER_STEP * rate_hz >= seg.samples * P.NATIVE_SAMPLE_RATE_HZ


def plan_resume(segs: Mapping[int, SegmentLike], *, seg_base: int, base_char: int, sample_base: int,
                mode: str = "segment", rate_hz: int = P.DEFAULT_SAMPLE_RATE_HZ) -> ResumePoint:
    """The first segment not wholly received, from the current sending's first (``seg_base``):
    at its next sample when the server can go on inside it (``can_resume_inside``), else at its
    start (its audio dropped); with none seen, the sending's start; past the last whole one, its end."""
    k = seg_base
    while k in segs and segs[k].done:
        k += 1
    seg = segs.get(k)
    if seg is not None and can_resume_inside(seg, mode, rate_hz):
        return ResumePoint(k, seg.start_char, seg.sample_offset + seg.samples, None, seg.samples)
    if seg is not None:
        return ResumePoint(k, seg.start_char, seg.sample_offset, seg.pos)
    prev = segs.get(k - 1)
    if prev is not None:
        return ResumePoint(k, prev.end_char, prev.sample_offset + prev.samples, None)
    return ResumePoint(k, base_char, sample_base, None)


# ------------------------------------------------------------------ utterance protocol state

MAX_PIECE_CHARS = 4000
"""Longest ``text.delta`` a resend uses (well under ``limits.max_message_bytes``)."""


@dataclass
class UtteranceStats:
    utterance_id: int | None = None
    status: str = "pending"
    """ok | error | cancelled | empty | pending"""
    error: str | None = None
    ttfa_ms: float | None = None
    """First text sent -> first audio frame received."""
    play_start_ms: float | None = None
    """First text sent -> playback started (realtime/speakers modes)."""
    samples: int = 0
    """Samples received."""
    server_samples: int | None = None
    """Samples the server says it sent (``utterance.done``)."""
    sample_rate_hz: int = 24_000
    underruns: int = 0
    cancelled: bool = False
    heard_text: str | None = None
    segments: list[str] = field(default_factory=list)
    wall_ms: float | None = None
    """First text sent -> all audio received."""
    chunks_dropped: int = 0
    attempts: int = 1
    """Times the utterance was sent (overload retries add one each)."""
    resumes: int = 0
    """Times it was sent again after a reconnect."""
    gap_ms: float = 0.0
    """Silence the listener heard inside it because of reconnects."""
    plays: list[SegmentPlay] = field(default_factory=list)
    """Per segment and take (one per sending): samples received and played (realtime/speakers:
    played out; instant: taken from ``speak()``; none: received)."""

    def heard_whole(self) -> list[int]:
        """Segment indexes in the order their audio was played through, each take once."""
        return [p.segment for p in self.plays if p.complete and p.played >= p.samples]

    @property
    def duration_ms(self) -> float:
        return self.samples * 1000.0 / self.sample_rate_hz

    def __str__(self) -> str:
        ttfa = f"{self.ttfa_ms:.0f} ms" if self.ttfa_ms is not None else "-"
        wall = f", received in {self.wall_ms:.0f} ms" if self.wall_ms is not None else ""
        extra = f", error {self.error}" if self.error else ""
        extra += ", cancelled" if self.cancelled else ""
        return (
            f"{self.status}: {self.duration_ms / 1000:.2f} s of audio ({self.samples} samples at "
            f"{self.sample_rate_hz} Hz), TTFA {ttfa}{wall}, {len(self.segments)} segments, "
            f"{self.underruns} underruns{extra}"
        )


@dataclass
class SegmentPlay:
    """One take of one segment: its audio as one sending delivered it."""

    segment: int
    take: int
    text: str = ""
    samples: int = 0
    """Samples received in this take."""
    played: int = 0
    complete: bool = False
    """The server said the segment's audio is all sent (``segment.done``) in this take."""


@dataclass
class Segment:
    """A segment of an utterance in utterance coordinates (chars and samples from its start)."""

    start_char: int
    end_char: int
    sample_offset: int
    play: SegmentPlay
    done: bool = False
    pos: int | None = None
    """Playout position of its first sample (realtime/speakers)."""
    codes: bytearray = field(default_factory=bytearray)
    """Its ``segment.codes``, decoded and in order (``P.CODE_FRAME_BYTES`` a frame)."""
    seed: int | None = None
    """Its sampling seed (``segment.codes``)."""

    @property
    def samples(self) -> int:
        """Samples received of it in the current take (``core.SegmentLike``)."""
        return self.play.samples

    @property
    def code_frames(self) -> int:
        return len(self.codes) // P.CODE_FRAME_BYTES



class UtteranceState:
    """One utterance's protocol state: its text and what of it the current sending carried, its
    segments in utterance coordinates (a resumed or retried sending keeps the numbering), and the
    transitions the client makes on it (what to send next, a segment's messages and audio, an
    overload retry, a resume). The shell's ``Utterance`` adds the audio queue and the waits."""

    def __init__(self, local_id: str, sample_rate_hz: int = P.DEFAULT_SAMPLE_RATE_HZ) -> None:
        self.local_id = local_id
        self.id: int | None = None
        """The server's id of the current sending."""
        self.stats = UtteranceStats(sample_rate_hz=sample_rate_hz)
        self.text = ""
        """All text the application gave it."""
        self.base_char = 0
        """Where in ``text`` the current sending starts (a resume starts past heard segments)."""
        self.sent = 0
        """Chars of ``text`` sent in the current sending (absolute)."""
        self.end_requested = False
        self.end_sent = False
        self.parked = False
        """Its text is kept, not sent (outage, overload wait) until it is sent again."""
        self.sent_any = False
        self.resume_note = False
        self.retrying = False
        """Refused for overload: the old sending's ``utterance.done`` is not the end."""
        self.seg_base = 0
        """Segment index / sample offset of the current sending's first segment."""
        self.sample_base = 0
        self.take = 0
        self.segs: dict[int, Segment] = {}
        self.cancelling = False
        self.finished = False
        """All its audio arrived, or it ended otherwise (the shell's ``done``)."""
        self.resume_with: dict[str, Any] | None = None
        """The next sending's ``resume`` (it goes on inside a segment), until its opening delta."""

    @property
    def chars(self) -> int:
        return len(self.text)

    def next_message(self, max_piece_chars: int = MAX_PIECE_CHARS) -> dict[str, Any] | None:
        """What the current sending lacks, next: a ``text.delta`` (the sending's first carries
        the utterance's ``id``), then ``text.end`` once asked; None when it has it all."""
        if self.sent < self.chars:
            opening = self.sent == self.base_char
            n = max(max_piece_chars, self.resume_with["chars"]) if opening and self.resume_with else max_piece_chars
            piece = self.text[self.sent:self.sent + n]
            msg: dict[str, Any] = {"type": P.ClientType.TEXT_DELTA.value, "text": piece}
            if opening:
                msg["id"] = self.local_id
                if self.resume_with is not None:
                    msg["resume"], self.resume_with = self.resume_with, None
            self.sent += len(piece)
            self.sent_any = True
            return msg
        if self.end_requested and not self.end_sent:
            self.end_sent = True
            return {"type": P.ClientType.TEXT_END.value}
        return None

    def new_segment(self, index: int, text: str, start_char: int, end_char: int, sample_offset: int) -> Segment:
        play = SegmentPlay(segment=index, take=self.take, text=text)
        self.stats.plays.append(play)
        seg = Segment(start_char, end_char, sample_offset, play)
        self.segs[index] = seg
        return seg

    def on_segment_started(self, msg: Mapping[str, Any]) -> None:
        """``segment.started`` of the current sending (its numbers are the sending's own)."""
        text = str(msg.get("text", ""))
        index = self.seg_base + int(msg.get("segment", 0))
        del self.stats.segments[index:]  # a resumed sending tells its segments again
        self.stats.segments.append(text)
        seg = self.segs.get(index)
        start = self.base_char + int(msg.get("start_char", 0))
        end = self.base_char + int(msg.get("end_char", 0))
        offset = self.sample_base + int(msg.get("sample_offset", 0))
        if seg is None:
            self.new_segment(index, text, start, end, offset)
        else:
            seg.start_char, seg.end_char, seg.play.text = start, end, text

    def on_segment_codes(self, msg: Mapping[str, Any]) -> None:
        """``segment.codes`` of the current sending: kept with the segment while they follow on."""
        seg = self.segs.get(self.seg_base + int(msg.get("segment", 0)))
        if seg is None:
            return
        try:
            data = base64.b64decode(str(msg.get("codes", "")), validate=True)
        except (ValueError, binascii.Error):
            return
        if int(msg.get("frame", -1)) == seg.code_frames and len(data) % P.CODE_FRAME_BYTES == 0:
            seg.codes += data
            if isinstance(msg.get("seed"), int):
                seg.seed = int(msg["seed"])

    def on_segment_done(self, msg: Mapping[str, Any]) -> None:
        seg = self.segs.get(self.seg_base + int(msg.get("segment", 0)))
        if seg is not None:
            seg.done = seg.play.complete = True

    def on_audio(self, segment: int, sample_offset: int, n: int) -> Segment:
        """``n`` samples of the current sending's segment ``segment`` arrived (at its
        ``sample_offset``): the segment (in utterance numbering) they are accounted to."""
        index = segment + self.seg_base
        seg = self.segs.get(index)
        if seg is None:  # no segment.started seen (a server that skips it): still accounted
            seg = self.new_segment(index, "", 0, 0, sample_offset + self.sample_base)
        seg.play.samples += n
        self.stats.samples += n
        return seg

    def restart_for_retry(self) -> None:
        """An overload retry's new sending: the whole text again, as a new take."""
        self.stats.attempts += 1
        self.stats.error = None
        self.retrying = False
        self.id = None
        self.base_char = self.sent = 0
        self.end_sent = False
        self.take += 1
        self.parked = False
        self.resume_with = None

    def resume(self, mode: str = "segment", rate_hz: int = P.DEFAULT_SAMPLE_RATE_HZ) -> ResumePoint:
        """The connection dropped: park it at its first segment not wholly received
        (``plan_resume``; ``mode``: the server's ``resume``), forget the segments from there on
        (inside one: the ones after it); the next sending starts there."""
        self.parked = True
        self.retrying = False
        plan = plan_resume(self.segs, seg_base=self.seg_base, base_char=self.base_char, sample_base=self.sample_base,
                           mode=mode, rate_hz=rate_hz)
        self.resume_with = None
        if plan.inside:
            seg = self.segs[plan.segment]
            self.resume_with = {"chars": seg.end_char - seg.start_char, "samples": plan.inside}
            if mode == "codes":
                self.resume_with["codes"] = base64.b64encode(bytes(seg.codes)).decode("ascii")
                if seg.seed is not None:
                    self.resume_with["seed"] = seg.seed
        for j in [j for j in self.segs if j >= plan.segment + (1 if plan.inside else 0)]:
            del self.segs[j]
        self.id = None
        self.base_char = self.sent = plan.char
        self.end_sent = False
        self.seg_base, self.sample_base = plan.segment, plan.sample
        self.stats.samples = plan.sample
        self.stats.error = None
        self.take += 1
        if self.sent_any:
            self.stats.resumes += 1
            self.resume_note = True
        return plan


U = TypeVar("U", bound=UtteranceState)


class Registry(Generic[U]):
    """The session's utterances, in order, and the server's ids of their current sendings. The
    server numbers the utterances a session opens from 1 and never says which opening delta an id
    answers: a new id goes to the first utterance whose sending has begun and has none."""

    def __init__(self) -> None:
        self.items: list[U] = []
        self.by_id: dict[int, U] = {}
        self.max_id = 0

    def add(self, u: U) -> U:
        self.items.append(u)
        return u

    def record(self, uid: int) -> U | None:
        """The utterance server id ``uid`` belongs to (assigned on first sight)."""
        u = self.by_id.get(uid)
        if u is None and uid > self.max_id:
            for cand in self.items:
                if cand.id is None and not cand.parked and cand.sent > cand.base_char and not cand.finished:
                    cand.id = uid
                    cand.stats.utterance_id = uid
                    self.max_id = uid
                    self.by_id[uid] = cand
                    return cand
        return u

    def opening(self, local_id: Any) -> U | None:
        """The utterance whose opening delta carried ``id`` = ``local_id`` and got no server id."""
        return next((x for x in self.items if x.local_id == local_id and x.id is None), None)

    def forget(self, u: U) -> None:
        if u in self.items:
            self.items.remove(u)
        if u.id is not None:
            self.by_id.pop(u.id, None)

    def new_session(self) -> None:
        """A new session numbers its utterances afresh."""
        self.by_id.clear()
        self.max_id = 0


class PlayLedger:
    """Which take of which segment the buffered audio belongs to, in playout order: samples
    played are credited to their ``SegmentPlay`` (``plays``: what of which segment was heard)."""

    def __init__(self) -> None:
        self.spans: deque[list[Any]] = deque()
        """[SegmentPlay, samples] in playout order."""

    def pushed(self, play: SegmentPlay, n: int) -> None:
        if self.spans and self.spans[-1][0] is play:
            self.spans[-1][1] += n
        else:
            self.spans.append([play, n])

    def credit(self, k: int) -> None:
        """``k`` samples were played."""
        while k > 0 and self.spans:
            span = self.spans[0]
            take = min(k, span[1])
            span[0].played += take
            span[1] -= take
            k -= take
            if span[1] == 0:
                self.spans.popleft()

    def drop_tail(self, dropped: int) -> None:
        """The last ``dropped`` buffered samples were dropped (a resume): they were not received
        in their take after all."""
        while dropped > 0 and self.spans:
            span = self.spans[-1]
            cut = min(dropped, span[1])
            span[1] -= cut
            span[0].samples -= cut
            dropped -= cut
            if span[1] == 0:
                self.spans.pop()

    def clear(self) -> None:
        self.spans.clear()


# ------------------------------------------------------------------ the session's messages in, actions out


@dataclass(frozen=True)
class SessionReady:
    """``session.started``: the session is up."""

    msg: Mapping[str, Any]


@dataclass(frozen=True)
class Finished(Generic[U]):
    """All of ``u``'s audio arrived (``utterance.done``); ``error``: it ended in error."""

    u: U
    error: str | None
    msg: Mapping[str, Any]


@dataclass(frozen=True)
class CancelledUtterances(Generic[U]):
    """``cancelled``: these utterances ended (stats set, forgotten); the oldest ``cancel()``
    awaiting a reply gets ``msg``."""

    utterances: list[U]
    msg: Mapping[str, Any]


@dataclass(frozen=True)
class RetryUtterance(Generic[U]):
    """``u`` was refused for overload before any audio: it is parked; end its refused sending
    and send it again as ``retry`` says."""

    u: U
    retry: Retry


@dataclass(frozen=True)
class Refused(Generic[U]):
    """The opening delta of ``u`` was refused: it never opened on the server (forgotten)."""

    u: U
    code: str
    message: str
    msg: Mapping[str, Any]


SESSION_START_ID = "session.start"
"""The ``id`` both clients give ``session.start``: an ``error`` that echoes it refused the session."""


@dataclass(frozen=True)
class FatalError:
    """A fatal ``error`` (the session closes after it), or the refusal of ``session.start`` (an
    ``error`` with ``SESSION_START_ID``: the session did not start)."""

    code: str
    message: str
    msg: Mapping[str, Any]


@dataclass(frozen=True)
class Pong:
    msg: Mapping[str, Any]


@dataclass(frozen=True)
class Resumes(Generic[U]):
    """After a drop: these utterances are parked at their resume points (send them again, in
    order, once reconnected; drop their queued audio from ``ResumePoint.segment``); buffered
    audio past playout position ``keep`` is dropped (None: keep all)."""

    plans: list[tuple[U, ResumePoint]]
    keep: int | None


Event = SessionReady | Finished[U] | CancelledUtterances[U] | RetryUtterance[U] | Refused[U] | FatalError | Pong


class ClientCore(Generic[U]):
    """The session protocol's state on the client side, sans I/O: the utterances
    (``registry``), what the server's messages do to them, and the decisions they call for.
    ``receive(msg, now_s)`` takes one decoded JSON message and returns what the shell must do."""

    def __init__(self, policy: RetryPolicy, rnd: random.Random | Rand) -> None:
        self.policy = policy
        self.rnd = rnd
        self.registry: Registry[U] = Registry()
        self.resume_mode = "segment"
        """How the server goes on with a partly received segment (``session.started``'s ``resume``)."""
        self.rate_hz = P.DEFAULT_SAMPLE_RATE_HZ

    def receive(self, msg: Mapping[str, Any], now_s: float, *, dropping_audio: bool = False,
                closing: bool = False) -> list[Event[U]]:
        """``dropping_audio``: a ``cancel`` awaits its reply (what it cancelled is not tracked);
        ``closing``: the application is closing the client (nothing is retried)."""
        t = msg.get("type")
        reg = self.registry
        if t == P.ServerType.SESSION_STARTED:
            self.resume_mode = str(msg.get("resume") or "segment")
            self.rate_hz = int(msg.get("sample_rate") or P.DEFAULT_SAMPLE_RATE_HZ)
            return [SessionReady(msg)]
        if t == P.ServerType.SEGMENT_CODES:
            u = reg.record(int(msg["utterance_id"]))
            if u is not None and not dropping_audio:
                u.on_segment_codes(msg)
            return []
        if t == P.ServerType.SEGMENT_STARTED:
            u = reg.record(int(msg["utterance_id"]))
            if u is not None and not dropping_audio:
                u.on_segment_started(msg)
            return []
        if t == P.ServerType.SEGMENT_DONE:
            u = reg.record(int(msg["utterance_id"]))
            if u is not None:
                u.on_segment_done(msg)
            return []
        if t == P.ServerType.UTTERANCE_DONE:
            uid = int(msg["utterance_id"])
            u = reg.record(uid)
            if u is not None and u.retrying:
                reg.by_id.pop(uid, None)  # the refused sending ended; the retry follows
            elif u is not None and not u.finished:
                u.stats.server_samples = u.sample_base + int(msg.get("samples", 0))
                error = None
                if msg.get("status") != P.UtteranceStatus.OK:
                    error = u.stats.error = str(msg.get("error") or u.stats.error or "error")
                return [Finished(u, error, msg)]
            return []
        if t == P.ServerType.CANCELLED:
            return [self.cancelled(msg)]
        if t == P.ServerType.ERROR:
            return self._error(msg, now_s, closing)
        if t == P.ServerType.PONG:
            return [Pong(msg)]
        return []

    def connection_lost(self, close_code: int | None, now_s: float, *, session_started: bool = True,
                        closing: bool = False) -> tuple[Reconnector, list[Resumes[U] | Reconnect | GiveUp | Fail]]:
        """The connection dropped (``close_code``; None: no close frame). Not resumable:
        ``[Fail]``. Else ``[Resumes, Reconnect | GiveUp]``, and the returned ``Reconnector``
        decides the rest of this outage (``failed``, ``connected``)."""
        rec = Reconnector(self.policy, self.rnd)
        first = rec.lost(close_code, now_s, session_started=session_started, closing=closing)
        if isinstance(first, Fail):
            return rec, [first]
        return rec, [self.plan_resumes(), first]

    def plan_resumes(self) -> Resumes[U]:
        """Park every unfinished utterance at its first segment not wholly received; the
        sendings' ids end with the session."""
        plans: list[tuple[U, ResumePoint]] = []
        keep: int | None = None
        for u in self.registry.items:
            if u.finished and not u.retrying:
                continue
            if u.id is not None:
                self.registry.by_id.pop(u.id, None)
            plan = u.resume(self.resume_mode, self.rate_hz)
            plans.append((u, plan))
            if keep is None:
                keep = plan.keep
        return Resumes(plans, keep)

    def cancelled(self, msg: Mapping[str, Any]) -> CancelledUtterances[U]:
        """``cancelled`` (the server's, or the shell's own while reconnecting): the utterances
        being cancelled and those it names end."""
        ids = set(msg.get("cancelled_utterances") or [])
        if msg.get("utterance_id") is not None:
            ids.add(msg["utterance_id"])
        gone = [u for u in self.registry.items if u.cancelling or (u.id is not None and u.id in ids)]
        for u in gone:
            u.stats.cancelled = True
            u.stats.status = "cancelled"
            if u.id is not None and u.id == msg.get("utterance_id"):
                u.stats.heard_text = msg.get("heard_text")
        return CancelledUtterances(gone, msg)

    def _error(self, msg: Mapping[str, Any], now_s: float, closing: bool) -> list[Event[U]]:
        out: list[Event[U]] = []
        reg = self.registry
        code = str(msg.get("code"))
        if msg.get("utterance_id") is not None:
            u = reg.record(int(msg["utterance_id"]))
            if u is not None:
                u.stats.error = code
                act = overload_decision(self.policy, msg, attempts=u.stats.attempts, received_samples=u.stats.samples,
                                        now_s=now_s, rnd=self.rnd, cancelled=u.cancelling or closing)
                if isinstance(act, Retry):
                    u.parked = True
                    u.retrying = True
                    out.append(RetryUtterance(u, act))
        elif msg.get("id") is not None:
            o = reg.opening(msg["id"])
            if o is not None and o.stats.samples == 0:
                # the opening delta was refused: this utterance never opened on the server
                o.text = ""
                o.sent = o.base_char = 0
                o.cancelling = True  # its sender stops
                o.stats.error = code
                reg.forget(o)
                out.append(Refused(o, code, str(msg.get("message", "")), msg))
        if msg.get("fatal") or msg.get("id") == SESSION_START_ID:
            out.append(FatalError(code, str(msg.get("message", "")), msg))
        return out

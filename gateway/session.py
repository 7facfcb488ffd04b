"""The session core: one client session as a pure state machine.

It takes events (a text/binary frame arrived, the engine produced audio or failed, the client
reported playback, a timer fired, the socket buffer filled/drained, the connection went away)
and returns actions (start/abort an engine stream, send a message or an audio frame, close).
No asyncio, no sockets: ``gateway/server.py`` carries the actions out and feeds events back.
Time comes in as ``now_s`` (monotonic seconds).

Audio path: text -> Segmenter (per utterance) -> at most ``max_in_flight`` segments in flight, in
text order, of which one at a time still generating (an utterance's first segment not counted)
-> each stream holds at most ``prefetch`` of pulled audio -> the head stream's audio is
cut into frames and sent while FlowControl gives credit. The server pulls a stream's engine
iterator only while ``may_pull`` is true, so a client that does not play stops the decoding.

Utterances are spoken one after the other: an utterance opens with the first non-empty
``text.delta`` and closes with ``text.end``; the next one may arrive while the previous one is
still being spoken, and plays after it. ``cancel`` stops everything.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import logging
import math
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from engine.api import (
    CODE_FRAME_BYTES,
    NATIVE_SAMPLE_RATE_HZ,
    SAMPLES_PER_STEP,
    AudioChunk,
    ResumeMode,
    SamplingParams,
    SpeechRequest,
)
from gateway import protocol as P
from gateway.audio import encode_samples
from gateway.config import GatewaySettings, LimitsConfig, SessionConfig
from gateway.flow import FlowConfig, FlowControl
from gateway.segmenter import Segmenter, is_cjk, is_speakable, text_units, word_timings

_log = logging.getLogger("voicegw.session")

#: Audio of one ChatTTS GPT step, ms.
STEP_MS = SAMPLES_PER_STEP * 1000.0 / NATIVE_SAMPLE_RATE_HZ


def _voice_for_log(voice: str | int | None) -> str:
    """A client's voice as a bounded log value: a seed as is, a string as its length and a short
    sha256 (an encoded embedding is up to ``MAX_VOICE_CHARS`` characters: no log amplification)."""
    if not isinstance(voice, str):
        return repr(voice)
    digest = hashlib.sha256(voice.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"str(len={len(voice)},sha256={digest})"


@dataclass(frozen=True)
class SessionSettings(SessionConfig):
    """Everything a session needs to know, read once from the settings: its ``[session]`` section
    (``gateway.config.SessionConfig``, the segmenter included) plus the limits and the engine's
    name."""

    limits: LimitsConfig = field(default_factory=LimitsConfig)
    engine_name: str = "unknown"
    resume_mode: ResumeMode = ResumeMode.SEGMENT
    """How the engine continues a segment a client received part of (``SpeechEngine.resume_mode``)."""
    check_voice: Callable[[str | int], str | None] | None = None
    """Why a ``session.start`` voice cannot be used, or None (``SpeechEngine.check_voice``); a
    refused voice is an ``invalid_field`` error on ``voice`` and the session does not start."""

    @classmethod
    def from_config(cls, config: GatewaySettings, engine_name: str,
                    resume_mode: ResumeMode = ResumeMode.SEGMENT,
                    check_voice: Callable[[str | int], str | None] | None = None,
                    **overrides: Any) -> SessionSettings:
        session = {f.name: getattr(config.session, f.name) for f in fields(SessionConfig)}
        return cls(**{**session, **overrides}, limits=config.limits, engine_name=engine_name,
                   resume_mode=resume_mode, check_voice=check_voice)


# ---- actions ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TtfaParts:
    """Time to first audio of one utterance, split where it is spent (seconds)."""

    first_text_s: float
    """Absolute time the utterance's first text arrived."""
    text_wait_s: float
    """First text -> the first segment was ready (boundary or timer)."""
    queue_s: float
    """Ready -> submitted to the engine (waiting for an earlier utterance or a slot)."""
    engine_s: float
    """Submitted -> first audio from the engine."""
    first_chunk_s: float
    """Absolute time of the first audio chunk; the server measures ``send`` from here."""


@dataclass(frozen=True)
class StartStream:
    request: SpeechRequest
    first: bool = False
    """The first segment of its utterance (admission asks about these only)."""


@dataclass(frozen=True)
class AbortStream:
    request_id: str
    engine_running: bool
    """False when the engine already finished the request (only the reader task remains)."""


@dataclass(frozen=True)
class SendMessage:
    message: P.ServerMessage
    """A typed server message; the server encodes it (``protocol.encode_server``)."""


@dataclass(frozen=True)
class SendAudio:
    data: bytes
    """Header + payload, a binary frame."""
    samples: int
    utterance_id: int
    ttfa: TtfaParts | None = None
    """Set on the first frame of an utterance."""


@dataclass(frozen=True)
class Close:
    code: P.CloseCode
    reason: P.CloseReason


Action = StartStream | AbortStream | SendMessage | SendAudio | Close


class EngineFailure(enum.Enum):
    OVERLOADED = "overloaded"
    RECOVERABLE = "recoverable"
    UNRECOVERABLE = "unrecoverable"


class SessionObserver:
    """Metrics hooks (no-ops here; gateway/metrics.py records them)."""

    def error(self, code: P.ErrorCode) -> None:
        pass

    def underruns(self, count: int) -> None:
        pass

    def audio_dropped(self, seconds: float, reason: str) -> None:
        pass

    def utterance_finished(self, outcome: str) -> None:
        pass

    def segment_submitted(self) -> None:
        pass


# ---- internal state -----------------------------------------------------------------------


@dataclass(eq=False)
class _Segment:
    index: int
    text: str
    units: int
    request_id: str
    generated: int = 0
    sent: int = 0
    session_start: int | None = None
    """Session-stream sample index of the segment's first frame."""
    finished: bool = False
    """The engine delivered all of its audio."""
    announced: bool = False
    start_char: int = 0
    """Offset (code points) of the segment's first character in the utterance's text."""
    utt_offset: int = 0
    """Sample offset of its first sample within its utterance."""
    end_char: int = 0
    """Offset just past the segment in the utterance's text (a client resumes from here)."""
    resumed_at: int = 0
    """A resumed segment: samples of it the client already had (not sent again)."""
    seed: int = 0
    """Its sampling seed: the session's ``options.seed``, else a random one (sent in
    ``segment.codes``: a resume samples the rest of the segment as it would have been)."""


@dataclass(frozen=True)
class _Resume:
    """An utterance opened to go on with a segment the client received part of."""

    text: str
    """The segment's text (the opening delta's first ``chars`` characters)."""
    samples: int
    """Samples of it the client has."""
    codes: Any = None
    """Its code frames so far (int64 ``[k, 4]``), for a ``ResumeMode.CODES`` engine."""
    seed: int | None = None
    """Its sampling seed (``segment.codes``)."""


@dataclass(eq=False)
class _Utterance:
    id: int
    segmenter: Segmenter
    resume: _Resume | None = None
    """Its first segment, given whole by the client (submitted before the segmenter's)."""
    char_base: int = 0
    """Where the segmenter's text starts in the utterance's text (after ``resume.text``)."""
    chars: int = 0
    ended: bool = False
    failed: P.ErrorCode | None = None
    segments: list[_Segment] = field(default_factory=list)
    seq: int = 0
    sent: int = 0
    generated: int = 0
    session_start: int | None = None
    t_first_text: float | None = None
    t_first_ready: float | None = None
    t_first_submit: float | None = None
    t_first_chunk: float | None = None
    ttfa_done: bool = False

    @property
    def input_done(self) -> bool:
        return self.ended and (self.failed is not None or (self.segmenter.done and self.resume is None))


@dataclass(eq=False)
class _Stream:
    utt: _Utterance
    seg: _Segment
    held: bytearray = field(default_factory=bytearray)
    held_samples: int = 0
    generating: bool = True
    skip: int = 0
    """Samples still to drop from the engine's audio (the client has them: a resumed segment)."""
    codes: bytearray = field(default_factory=bytearray)
    """Code frames not yet sent in ``segment.codes`` (sessions that asked ``resume``)."""
    codes_frame: int = 0
    """Index within the segment of the first frame in ``codes``."""

    @property
    def request_id(self) -> str:
        return self.seg.request_id


class SessionLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """Adds ``session`` to every record and merges per-call extras (``utterance``, ``request_id``)."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        kwargs["extra"] = {**(self.extra or {}), **kwargs.get("extra", {})}
        return msg, kwargs


class _TokenBucket:
    def __init__(self, rate: float, capacity: float, now_s: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self.tokens = capacity
        self.t = now_s

    def refill(self, now_s: float) -> None:
        self.tokens = min(self.capacity, self.tokens + max(0.0, now_s - self.t) * self.rate)
        self.t = now_s


class Session:
    """One client session. Call an ``on_*`` method per event; carry out the returned actions."""

    def __init__(
        self,
        session_id: str,
        settings: SessionSettings,
        now_s: float,
        *,
        observer: SessionObserver | None = None,
    ) -> None:
        self.id = session_id
        self.settings = settings
        self._obs = observer or SessionObserver()
        self.started = False
        self.closed = False
        self.draining = False
        self.rate_hz = P.DEFAULT_SAMPLE_RATE_HZ
        self.format = P.AudioFormat.PCM16
        self._voice: str | int | None = None
        self._params = SamplingParams()
        self._language: str | None = None
        self._resume_asked = False
        self._flow = FlowControl(FlowConfig(self.rate_hz, settings.limits.flow_window_ms), now_s)
        self._frame_samples = 1
        self._prefetch_samples = 1
        self._utterances: deque[_Utterance] = deque()
        self._history: deque[_Utterance] = deque(maxlen=max(1, settings.history_utterances))
        self._streams: deque[_Stream] = deque()
        self._by_id: dict[str, _Stream] = {}
        self._next_utt_id = 1
        self._send_blocked = False
        self._last_activity_s = now_s
        self._idle_timeout_s = settings.limits.idle_timeout_s
        """Idle close after this long: ``limits.idle_timeout_s``, or less if session.start asks."""
        lim = settings.limits
        self._messages = _TokenBucket(lim.max_messages_per_s, 2 * lim.max_messages_per_s, now_s)
        self._chars = _TokenBucket(lim.max_chars_per_s, lim.max_chars_per_s, now_s)
        self._strikes = 0.0
        """Refused deltas, decaying at one per second."""
        self._strikes_t = now_s
        self._underruns_seen = 0
        self._output_latency_ms = 0.0
        self.log = SessionLog(_log, {"session": session_id})

    # ================================================================ events

    def on_text_frame(self, now_s: float, data: str | bytes | dict[str, Any]) -> list[Action]:
        """A client text frame (or a dialect translator's native message object)."""
        out: list[Action] = []
        if self.closed:
            return out
        self._last_activity_s = now_s
        self._messages.refill(now_s)
        if self._messages.tokens < 1.0:
            self.log.warning("message flood: closing")
            self._close(out, P.CloseCode.POLICY_VIOLATION, P.CloseReason.MESSAGE_FLOOD)
            return out
        self._messages.tokens -= 1.0
        try:
            msg = P.parse_client_message(data)
        except P.ProtocolError as exc:
            self._error(out, exc.code, field=exc.field, msg_id=exc.msg_id)
            return out
        if not self.started and msg.type not in (P.ClientType.SESSION_START, P.ClientType.PING):
            self._error(out, P.ErrorCode.SESSION_NOT_STARTED, msg_id=msg.id)
            return out
        handler = {
            P.ClientType.SESSION_START: self._on_session_start,
            P.ClientType.TEXT_DELTA: self._on_text_delta,
            P.ClientType.TEXT_FLUSH: self._on_text_flush,
            P.ClientType.TEXT_END: self._on_text_end,
            P.ClientType.CANCEL: self._on_cancel,
            P.ClientType.PLAYBACK: self._on_playback,
            P.ClientType.PING: self._on_ping,
        }[msg.type]
        handler(now_s, msg, out)
        self._step(now_s, out)
        return out

    def on_binary_frame(self, now_s: float, data: bytes) -> list[Action]:
        out: list[Action] = []
        if self.closed:
            return out
        self._last_activity_s = now_s
        self._messages.refill(now_s)
        if self._messages.tokens < 1.0:
            self._close(out, P.CloseCode.POLICY_VIOLATION, P.CloseReason.MESSAGE_FLOOD)
            return out
        self._messages.tokens -= 1.0
        self._error(out, P.ErrorCode.BINARY_NOT_ALLOWED)
        return out

    def on_audio(self, now_s: float, request_id: str, chunk: AudioChunk) -> list[Action]:
        out: list[Action] = []
        s = self._by_id.get(request_id)
        if self.closed or s is None or not s.generating:
            return out
        if len(chunk.pcm) % 2 or (chunk.pcm and chunk.sample_rate_hz != self.rate_hz):
            self.log.error("engine returned bad audio for %s (rate %s, %d bytes)", request_id,
                           chunk.sample_rate_hz, len(chunk.pcm),
                           extra={"utterance": s.utt.id, "request_id": request_id})
            self._fail_utterance(s.utt, P.ErrorCode.ENGINE_ERROR, out)
            self._step(now_s, out)
            return out
        pcm = chunk.pcm
        if s.skip and pcm:
            drop = min(s.skip, len(pcm) // 2)
            s.skip -= drop
            pcm = pcm[2 * drop:]
        if chunk.codes and self._resume_asked:
            s.codes += chunk.codes
        n = len(pcm) // 2
        if n:
            s.held += pcm
            s.held_samples += n
            s.seg.generated += n
            s.utt.generated += n
            if s.utt.t_first_chunk is None:
                s.utt.t_first_chunk = now_s
        if chunk.finished:
            self._generated_all(now_s, s, out)
        self._step(now_s, out)
        return out

    def on_stream_end(self, now_s: float, request_id: str) -> list[Action]:
        """The engine iterator is exhausted."""
        out: list[Action] = []
        s = self._by_id.get(request_id)
        if self.closed or s is None or not s.generating:
            return out
        self._generated_all(now_s, s, out)
        self._step(now_s, out)
        return out

    def _generated_all(self, now_s: float, s: _Stream, out: list[Action]) -> None:
        """``s`` produced all its audio."""
        s.generating = False
        s.seg.finished = True

    def on_engine_error(self, now_s: float, request_id: str, failure: EngineFailure,
                        retry_after_ms: float | None = None) -> list[Action]:
        """An engine stream failed. ``retry_after_ms`` (overload only): when a retry is likely
        to be admitted; sent to the client with the ``engine_overloaded`` error."""
        out: list[Action] = []
        s = self._by_id.get(request_id)
        if self.closed or s is None:
            return out
        if failure is EngineFailure.UNRECOVERABLE:
            self.log.error("engine unavailable (request %s): closing", request_id,
                           extra={"utterance": s.utt.id, "request_id": request_id})
            self._error(out, P.ErrorCode.ENGINE_UNAVAILABLE, utterance_id=s.utt.id)
            self._close(out, P.CloseCode.INTERNAL_ERROR, P.CloseReason.ENGINE_UNAVAILABLE)
            return out
        overloaded = failure is EngineFailure.OVERLOADED
        code = P.ErrorCode.ENGINE_OVERLOADED if overloaded else P.ErrorCode.ENGINE_ERROR
        self._fail_utterance(s.utt, code, out, retry_after_ms=retry_after_ms if overloaded else None)
        self._step(now_s, out)
        return out

    def on_timer(self, now_s: float) -> list[Action]:
        """Idle close (no client message and nothing in flight for ``idle_timeout_s``), segmenter
        timers, flow credit."""
        out: list[Action] = []
        if self.closed:
            return out
        if not self._streams and now_s >= self._last_activity_s + self._idle_timeout_s:
            self.log.info("idle: closing")
            self._close(out, P.CloseCode.NORMAL, P.CloseReason.IDLE)
            return out
        self._step(now_s, out)
        return out

    def on_send_buffer(self, now_s: float, congested: bool) -> list[Action]:
        """The server's outbound buffer crossed its high (True) or low (False) water mark."""
        out: list[Action] = []
        self._send_blocked = congested
        if not congested and not self.closed:
            self._step(now_s, out)
        return out

    def on_slow_reader(self, now_s: float) -> list[Action]:
        """A send did not complete within send_timeout: the client stopped reading."""
        out: list[Action] = []
        if not self.closed:
            self.log.warning("slow reader: closing")
            self._drop_all(now_s, "slow_reader")
            self._close(out, P.CloseCode.POLICY_VIOLATION, P.CloseReason.SLOW_READER)
        return out

    def on_disconnect(self, now_s: float) -> list[Action]:
        """The connection is gone: abort everything it started."""
        out: list[Action] = []
        if self._streams or self._utterances:
            self.log.info("disconnected with work in progress: aborting")
        self._drop_all(now_s, "disconnect")
        self._abort_all(out)
        self.closed = True
        return out

    def on_shutdown(self, now_s: float) -> list[Action]:
        """Server draining: no new utterances; close 1012 once the current ones are sent."""
        out: list[Action] = []
        if self.closed:
            return out
        self.draining = True
        self._step(now_s, out)
        return out

    def on_shutdown_deadline(self, now_s: float) -> list[Action]:
        out: list[Action] = []
        if not self.closed:
            self._drop_all(now_s, "shutdown")
            self._close(out, P.CloseCode.SERVICE_RESTART, P.CloseReason.SHUTDOWN)
        return out

    def on_internal_error(self, now_s: float) -> list[Action]:
        out: list[Action] = []
        if not self.closed:
            self._error(out, P.ErrorCode.INTERNAL_ERROR)
            self._close(out, P.CloseCode.INTERNAL_ERROR, P.CloseReason.INTERNAL_ERROR)
        return out

    # ================================================================ queries

    @property
    def busy(self) -> bool:
        """Some utterance is not finished (text still coming, generating or sending)."""
        return bool(self._utterances)

    @property
    def running_requests(self) -> list[str]:
        return [s.request_id for s in self._streams if s.generating]

    def may_pull(self, now_s: float, request_id: str) -> bool:
        """May the server take the next chunk from this request's engine iterator now?"""
        s = self._by_id.get(request_id)
        if self.closed or s is None or not s.generating:
            return False
        if s.held_samples >= self._prefetch_samples:
            return False
        if self._streams and s is self._streams[0]:
            return self._flow.can_send(now_s, s.held_samples + 1)
        return True

    def next_deadline_s(self, now_s: float) -> float | None:
        """When ``on_timer`` has something to do (None: only events matter)."""
        if self.closed:
            return None
        deadlines: list[float] = []
        if not self._streams:
            deadlines.append(self._last_activity_s + self._idle_timeout_s)
        if self.started:
            if self._may_submit():
                utt = self._segmenting_utterance()
                if utt is not None and utt.failed is None:
                    d = utt.segmenter.deadline_s(now_s, idle=not self._streams)
                    if d is not None:
                        deadlines.append(d)
                    if utt.segmenter.segments_out > 0 and utt.segmenter.pending_text:
                        d = self._urgent_deadline_s(now_s)
                        if d is not None:
                            deadlines.append(d)
            if self._streams and not self._send_blocked:
                # credit for the head's next frame, or (nothing held) for pulling more audio
                head = self._streams[0]
                d = None
                if head.held_samples:
                    d = self._flow.credit_deadline_s(now_s, min(self._frame_samples, head.held_samples))
                elif head.generating:
                    d = self._flow.credit_deadline_s(now_s, 1)
                if d is not None:
                    deadlines.append(d + 0.001)
        return min(deadlines) if deadlines else None

    @property
    def flow(self) -> FlowControl:
        return self._flow

    # ================================================================ message handlers

    def _on_session_start(self, now_s: float, msg: P.ClientMessage, out: list[Action]) -> None:
        if self.started:
            self._error(out, P.ErrorCode.SESSION_ALREADY_STARTED, msg_id=msg.id)
            return
        f = msg.fields
        voice = f.get("voice")
        if voice not in (None, "") and self.settings.check_voice is not None:
            why = self.settings.check_voice(voice)
            if why is not None:
                self.log.info("session.start refused: voice %s: %s", _voice_for_log(voice), why)
                self._error(out, P.ErrorCode.INVALID_FIELD, field="voice", msg_id=msg.id)
                return
        self.rate_hz = int(f.get("sample_rate", P.DEFAULT_SAMPLE_RATE_HZ))
        self.format = P.AudioFormat(f.get("format", P.AudioFormat.PCM16.value))
        self._voice = voice if voice != "" else None
        self._language = f.get("language")
        self._idle_timeout_s = min(self.settings.limits.idle_timeout_s,
                                   float(f.get("idle_timeout_s", self.settings.limits.idle_timeout_s)))
        self._resume_asked = bool(f.get("resume", False))
        opts = f.get("options", {})
        self._params = replace(
            SamplingParams(),
            **{k: opts[k] for k in ("temperature", "top_p", "top_k", "seed") if k in opts},
        )
        st = self.settings
        self._flow = FlowControl(
            FlowConfig(self.rate_hz, st.limits.flow_window_ms, st.stale_report_ms), now_s
        )
        self._frame_samples = max(1, int(self.rate_hz * st.frame_ms / 1000.0))
        self._prefetch_samples = max(
            self._frame_samples, int(self.rate_hz * min(st.prefetch_ms, st.limits.flow_window_ms) / 1000.0)
        )
        self.started = True
        lim = st.limits
        out.append(SendMessage(P.SessionStarted(
            session_id=self.id,
            engine=st.engine_name,
            sample_rate=self.rate_hz,
            format=self.format,
            limits=P.SessionLimits(
                max_message_bytes=lim.max_message_bytes,
                max_utterance_chars=lim.max_utterance_chars,
                max_chars_per_s=lim.max_chars_per_s,
                max_messages_per_s=lim.max_messages_per_s,
                max_queued_utterances=lim.max_queued_utterances,
                idle_timeout_s=self._idle_timeout_s,
                flow_window_ms=lim.flow_window_ms,
            ),
            playback_report_interval_ms=st.playback_report_interval_ms,
            voice=self._voice,
            language=self._language,
            resume=st.resume_mode.value if self._resume_asked else None,
            id=msg.id,
        )))
        self.log.info("session started: %d Hz %s voice=%s", self.rate_hz, self.format.value, _voice_for_log(self._voice))

    def _open_utterance(self) -> _Utterance | None:
        if self._utterances and not self._utterances[-1].ended:
            return self._utterances[-1]
        return None

    def _on_text_delta(self, now_s: float, msg: P.ClientMessage, out: list[Action]) -> None:
        text: str = msg.fields["text"]
        if not text:
            return
        utt = self._open_utterance()
        if utt is not None and utt.failed is not None:
            return  # a failed utterance absorbs its remaining text until text.end
        lim = self.settings.limits
        if utt is None:
            if self.draining:
                self._error(out, P.ErrorCode.SHUTTING_DOWN, msg_id=msg.id)
                return
            if len(self._utterances) >= lim.max_queued_utterances:
                self._error(out, P.ErrorCode.QUEUE_FULL, msg_id=msg.id)
                return
        resume = self._resume_of(msg, utt is None, text, out)
        if resume is False:
            return
        if (utt.chars if utt else 0) + len(text) > lim.max_utterance_chars:
            self._error(out, P.ErrorCode.TEXT_TOO_LONG, msg_id=msg.id,
                        utterance_id=utt.id if utt else None)
            return
        self._chars.refill(now_s)
        if self._chars.tokens <= 0:
            self._error(out, P.ErrorCode.RATE_LIMITED, msg_id=msg.id, utterance_id=utt.id if utt else None)
            self._strikes = max(0.0, self._strikes - (now_s - self._strikes_t)) + 1.0
            self._strikes_t = now_s
            if self._strikes >= self.settings.rate_strikes_to_close:
                self.log.warning("text rate abuse: closing")
                self._close(out, P.CloseCode.POLICY_VIOLATION, P.CloseReason.RATE_LIMIT)
            return
        self._chars.tokens -= len(text)
        if utt is None:
            utt = _Utterance(id=self._next_utt_id, segmenter=Segmenter(self.settings.segmenter))
            self._next_utt_id += 1
            self._utterances.append(utt)
            if resume is not None:
                utt.resume, utt.char_base = resume, len(resume.text)
        utt.chars += len(text)
        utt.segmenter.feed(text[len(resume.text):] if resume is not None else text, now_s)
        if utt.t_first_text is None:
            utt.t_first_text = now_s

    def _resume_of(self, msg: P.ClientMessage, opening: bool, text: str,
                   out: list[Action]) -> _Resume | None | Literal[False]:
        """The delta's ``resume``, checked against this engine and the delta: None without one,
        False (an error sent) when it cannot be honoured."""
        r = msg.fields.get("resume")
        if r is None:
            return None
        mode = self.settings.resume_mode
        bad = None
        if not opening or mode is ResumeMode.SEGMENT:
            bad = "resume"  # only an utterance's first delta; an engine that only restarts segments
        elif r["chars"] > len(text) or not is_speakable(text[:r["chars"]]):
            bad = "resume.chars"
        elif mode is ResumeMode.CODES and r["samples"] and r.get("codes") is None:
            bad = "resume.codes"  # sampled again, the rest of the segment would not follow on
        if bad is not None:
            self._error(out, P.ErrorCode.INVALID_FIELD, field=bad, msg_id=msg.id)
            return False
        codes = r.get("codes") if mode is ResumeMode.CODES else None
        return _Resume(text[:r["chars"]], r["samples"], codes if codes is not None and len(codes) else None,
                       r.get("seed"))

    def _on_text_flush(self, now_s: float, msg: P.ClientMessage, out: list[Action]) -> None:
        utt = self._open_utterance()
        if utt is not None and utt.failed is None:
            utt.segmenter.flush()

    def _on_text_end(self, now_s: float, msg: P.ClientMessage, out: list[Action]) -> None:
        utt = self._open_utterance()
        if utt is None:
            return
        utt.ended = True
        if utt.failed is None:
            utt.segmenter.end()

    def _on_playback(self, now_s: float, msg: P.ClientMessage, out: list[Action]) -> None:
        f = msg.fields
        self._flow.on_playback(now_s, int(f["played_samples"]))
        if "underruns" in f:
            n = int(f["underruns"])
            if n > self._underruns_seen:
                self._obs.underruns(n - self._underruns_seen)
            self._underruns_seen = max(self._underruns_seen, n)
        if "output_latency_ms" in f:
            self._output_latency_ms = float(f["output_latency_ms"])

    def _on_ping(self, now_s: float, msg: P.ClientMessage, out: list[Action]) -> None:
        out.append(SendMessage(P.Pong(server_time_ms=round(now_s * 1000.0, 3), id=msg.id, t=msg.fields.get("t"))))

    def _on_cancel(self, now_s: float, msg: P.ClientMessage, out: list[Action]) -> None:
        if msg.fields.get("utterance_id") is not None:
            self._cancel_one(now_s, int(msg.fields["utterance_id"]), msg, out)
            return
        flow = self._flow
        given = msg.fields.get("played_samples")
        client_played = flow.client_played(now_s) if given is None else int(given)
        client_played = max(0, min(client_played, flow.sent - flow.discarded))
        pos = client_played + flow.discarded  # playhead in the session stream
        heard_pos = pos - int(self._output_latency_ms * self.rate_hz / 1000.0)
        target: _Utterance | None = None
        for u in [*self._history, *self._utterances]:
            if u.session_start is not None and u.session_start <= pos < u.session_start + u.sent:
                target = u
                break
        if target is None and self._utterances:
            target = self._utterances[0]
        stopped = tuple(u.id for u in self._utterances)
        if target is not None and target not in self._utterances and target.session_start is not None \
                and pos < target.session_start + target.sent:
            stopped = (target.id, *stopped)  # all sent (done) but still playing: its unplayed audio is cut too
        reply = P.Cancelled(utterance_id=None, cancelled_utterances=stopped, id=msg.id)
        if target is not None:
            played = 0
            if target.session_start is not None:
                played = max(0, min(pos - target.session_start, target.sent))
            reply = P.Cancelled(
                utterance_id=target.id,
                generated_ms=self._ms(target.generated),
                sent_ms=self._ms(target.sent),
                played_ms=self._ms(played),
                heard_text=self._heard_text(target, heard_pos),
                cancelled_utterances=stopped,
                id=msg.id,
            )
        dropped = (flow.sent - pos) + sum(s.held_samples for s in self._streams)
        if dropped > 0:
            self._obs.audio_dropped(dropped / self.rate_hz, "cancel")
        flow.on_cancel(now_s, client_played)
        self._abort_all(out)
        for _ in self._utterances:
            self._obs.utterance_finished("cancelled")
        if self._utterances:
            self.log.info("cancelled utterances %s", list(stopped))
        self._utterances.clear()
        out.append(SendMessage(reply))

    def _cancel_one(self, now_s: float, uid: int, msg: P.ClientMessage, out: list[Action]) -> None:
        """``cancel {utterance_id}``: stop that utterance only (its audio not yet played is
        dropped, its engine work aborted); the utterances after it go on."""
        flow = self._flow
        utt = next((u for u in self._utterances if u.id == uid), None)
        if utt is None:
            out.append(SendMessage(P.Cancelled(utterance_id=None, id=msg.id)))  # finished or unknown: nothing to stop
            return
        given = msg.fields.get("played_samples")
        client_played = flow.client_played(now_s) if given is None else int(given)
        client_played = max(0, min(client_played, flow.sent - flow.discarded))
        pos = client_played + flow.discarded
        played = 0
        if utt.session_start is not None:
            played = max(0, min(pos - utt.session_start, utt.sent))
            if pos >= utt.session_start:
                flow.on_cancel(now_s, client_played)  # the playhead is in it: all sent past it is its
            else:
                flow.discard_ahead(now_s, utt.sent)  # an earlier utterance still plays
        reply = P.Cancelled(utterance_id=utt.id, generated_ms=self._ms(utt.generated), sent_ms=self._ms(utt.sent),
                            played_ms=self._ms(played), cancelled_utterances=(utt.id,),
                            heard_text=self._heard_text(utt, pos - int(self._output_latency_ms * self.rate_hz / 1000.0)),
                            id=msg.id)
        dropped = max(0, utt.sent - played)
        for s in [s for s in self._streams if s.utt is utt]:
            dropped += s.held_samples
            out.append(AbortStream(s.request_id, s.generating))
            self._streams.remove(s)
            self._by_id.pop(s.request_id, None)
        if dropped > 0:
            self._obs.audio_dropped(dropped / self.rate_hz, "cancel")
        self._obs.utterance_finished("cancelled")
        self._utterances.remove(utt)
        self.log.info("cancelled utterance %d", uid, extra={"utterance": uid})
        out.append(SendMessage(reply))

    # ================================================================ the pipeline

    def _step(self, now_s: float, out: list[Action]) -> None:
        if self.closed or not self.started:
            return
        self._pump(now_s, out)
        self._finish_utterances(now_s, out)
        self._fill(now_s, out)
        self._pump(now_s, out)
        self._finish_utterances(now_s, out)
        self._mark_ready(now_s)
        if self.draining and not self._utterances and not self.closed:
            self._close(out, P.CloseCode.SERVICE_RESTART, P.CloseReason.SHUTDOWN)

    def _segmenting_utterance(self) -> _Utterance | None:
        """The oldest utterance whose text is not all handed to the engine (text order)."""
        for u in self._utterances:
            if u.failed is not None:
                if not u.ended:
                    return u  # absorbing its text: later utterances cannot exist yet
                continue
            if not u.segmenter.done or u.resume is not None:
                return u
        return None

    def _may_submit(self) -> bool:
        """Room for another segment: fewer than ``max_in_flight`` unsent and none still generating,
        an utterance's first segment not counted (it is short, for a fast first audio: its audio
        alone does not cover the next segment's time to first audio under load, so the second one
        generates beside it). One generating at a time keeps vLLM's batch near one request per
        speaking session (``SessionConfig.max_in_flight``)."""
        if len(self._streams) >= self.settings.max_in_flight:
            return False
        return not any(s.generating and s.seg.index > 0 for s in self._streams)

    def _fill(self, now_s: float, out: list[Action]) -> None:
        while self._may_submit():
            utt = self._segmenting_utterance()
            if utt is None or utt.failed is not None:
                return
            if utt.resume is not None:
                r, utt.resume = utt.resume, None
                self._submit(now_s, utt, r.text, out, (0, len(r.text)), r)
                continue
            seg = utt.segmenter.next_segment(now_s, idle=not self._streams, urgent=self._urgent(now_s))
            if seg is None:
                return
            if not is_speakable(seg.text):
                continue
            base = utt.char_base
            self._submit(now_s, utt, seg.text, out, (base + seg.start_char, base + seg.end_char))

    def _submit(self, now_s: float, utt: _Utterance, text: str, out: list[Action],
                chars: tuple[int, int] = (0, 0), resume: _Resume | None = None) -> None:
        index = len(utt.segments)
        first = index == 0
        request_id = f"{self.id}-{utt.id}-{index}"
        seed = self._params.seed if self._params.seed is not None else secrets.randbits(31)
        if resume is not None and resume.seed is not None:
            seed = resume.seed
        seg = _Segment(index=index, text=text, units=text_units(text), request_id=request_id,
                       start_char=chars[0], end_char=chars[1], resumed_at=resume.samples if resume else 0, seed=seed)
        utt.segments.append(seg)
        prefix = resume.codes if resume is not None else None
        stream = _Stream(utt=utt, seg=seg, skip=seg.resumed_at, codes_frame=0 if prefix is None else len(prefix))
        self._streams.append(stream)
        self._by_id[request_id] = stream
        if first:
            if utt.t_first_ready is None:
                utt.t_first_ready = now_s
            utt.t_first_submit = now_s
        self._obs.segment_submitted()
        self.log.debug("segment %s submitted (%d chars)", request_id, len(text),
                       extra={"utterance": utt.id, "request_id": request_id})
        params = replace(self._params, seed=seed)
        floor_ms = self.settings.min_audio_ms_per_unit
        if floor_ms > 0:
            steps = min(params.max_new_tokens - 1, math.ceil(seg.units * floor_ms / STEP_MS - 1e-9))
            if steps > params.min_new_tokens:
                params = replace(params, min_new_tokens=steps)
        queued_ms = self._listener_left_ms(now_s) if self.settings.tell_engine_queued_audio else 0.0
        out.append(StartStream(SpeechRequest(
            request_id=request_id,
            text=text,
            speaker=self._voice,
            params=params,
            sample_rate_hz=self.rate_hz,
            prefix_codes=prefix,
            queued_audio_ms=queued_ms,
        ), first=first and resume is None))  # a resumed answer is already playing: admission lets it on

    def _listener_left_ms(self, now_s: float) -> float:
        """Audio the listener has left: what the client still has to play
        (``FlowControl.left_estimate``) and what is held here unsent."""
        held = sum(s.held_samples for s in self._streams)
        return (self._flow.left_estimate(now_s) + held) * 1000.0 / self.rate_hz

    def _urgent_margin_ms(self, now_s: float) -> float | None:
        """``_listener_left_ms`` less ``SegmenterConfig.urgent_left_ms``; None while a segment is
        generating or the rule is off. Below 0: the next segment need not wait for a sentence end."""
        limit = self.settings.segmenter.urgent_left_ms
        if limit <= 0 or any(s.generating for s in self._streams):
            return None
        return self._listener_left_ms(now_s) - limit

    def _urgent(self, now_s: float) -> bool:
        margin = self._urgent_margin_ms(now_s)
        return margin is not None and margin < 0

    def _urgent_deadline_s(self, now_s: float) -> float | None:
        """When ``_urgent`` turns true as the listener plays on (None: true now, or never by time)."""
        margin = self._urgent_margin_ms(now_s)
        return now_s + margin / 1000.0 + 0.001 if margin is not None and margin >= 0 else None

    def _mark_ready(self, now_s: float) -> None:
        """Note when an utterance's first segment could go out but waits for the pipeline."""
        for u in list(self._utterances)[:4]:
            if u.t_first_ready is None and not u.segments and u.failed is None:
                if u.segmenter.next_segment(now_s, idle=False, peek=True) is not None:
                    u.t_first_ready = now_s

    def _pump(self, now_s: float, out: list[Action]) -> None:
        """Send the head stream's audio while credit lasts; retire finished segments."""
        while self._streams:
            head = self._streams[0]
            if head.held_samples == 0:
                if head.generating:
                    return
                self._retire(now_s, head, out)
                continue
            if self._send_blocked:
                return
            n = min(self._frame_samples, head.held_samples)
            if not self._flow.can_send(now_s, n):
                return
            self._emit_frame(now_s, head, n, out)

    def _emit_frame(self, now_s: float, s: _Stream, n: int, out: list[Action]) -> None:
        u, seg = s.utt, s.seg
        pcm = bytes(s.held[: 2 * n])
        del s.held[: 2 * n]
        s.held_samples -= n
        if not seg.announced:
            self._announce(s, out)
        if s.codes:
            self._send_codes(s, out)
        if u.session_start is None:
            u.session_start = self._flow.sent
        header = P.AudioFrameHeader(utterance_id=u.id, seq=u.seq, sample_offset=u.sent,
                                    segment=seg.index, format=self.format)
        ttfa = None
        if not u.ttfa_done:
            u.ttfa_done = True
            t0 = u.t_first_text if u.t_first_text is not None else now_s
            ready = u.t_first_ready if u.t_first_ready is not None else t0
            submit = u.t_first_submit if u.t_first_submit is not None else ready
            chunk = u.t_first_chunk if u.t_first_chunk is not None else submit
            ttfa = TtfaParts(first_text_s=t0, text_wait_s=ready - t0, queue_s=submit - ready,
                             engine_s=chunk - submit, first_chunk_s=chunk)
        out.append(SendAudio(P.pack_audio_frame(header, encode_samples(pcm, self.format)), n, u.id, ttfa))
        u.seq += 1
        u.sent += n
        seg.sent += n
        self._flow.on_sent(now_s, n)

    def _announce(self, s: _Stream, out: list[Action]) -> None:
        s.seg.announced = True
        s.seg.session_start = self._flow.sent
        s.seg.utt_offset = s.utt.sent
        out.append(SendMessage(P.SegmentStarted(
            utterance_id=s.utt.id,
            segment=s.seg.index,
            text=s.seg.text,
            sample_offset=s.utt.sent,
            start_char=s.seg.start_char,
            end_char=s.seg.end_char,
        )))

    def _send_codes(self, s: _Stream, out: list[Action]) -> None:
        """The stream's codes not sent yet, before the audio frame they cover."""
        out.append(SendMessage(P.SegmentCodes(
            utterance_id=s.utt.id, segment=s.seg.index, frame=s.codes_frame,
            codes=base64.b64encode(s.codes).decode("ascii"), seed=s.seg.seed)))
        s.codes_frame += len(s.codes) // CODE_FRAME_BYTES
        s.codes.clear()

    def _retire(self, now_s: float, s: _Stream, out: list[Action]) -> None:
        if not s.seg.announced:
            self._announce(s, out)
        # a resumed segment's words are timed over the whole segment, the part the client had first
        offset_ms = (s.seg.utt_offset - s.seg.resumed_at) * 1000.0 / self.rate_hz
        words = word_timings(s.seg.text, (s.seg.resumed_at + s.seg.sent) * 1000.0 / self.rate_hz)
        words = [(w, max(a, -offset_ms), b) for w, a, b in words if offset_ms + b > 0]
        out.append(SendMessage(P.SegmentDone(
            utterance_id=s.utt.id,
            segment=s.seg.index,
            samples=s.seg.sent,
            words=tuple(P.Word(word=w, start_ms=round(offset_ms + a, 1), end_ms=round(offset_ms + b, 1))
                        for w, a, b in words),
        )))
        self._streams.popleft()
        self._by_id.pop(s.request_id, None)
        self._last_activity_s = max(self._last_activity_s, now_s)

    def _finish_utterances(self, now_s: float, out: list[Action]) -> None:
        while self._utterances:
            u = self._utterances[0]
            if not u.input_done or any(s.utt is u for s in self._streams):
                return
            status = P.UtteranceStatus.OK if u.failed is None else P.UtteranceStatus.ERROR
            started = sum(1 for seg in u.segments if seg.announced)  # a refused segment never started
            msg = P.UtteranceDone(utterance_id=u.id, status=status, samples=u.sent, duration_ms=self._ms(u.sent),
                                  segments=started, error=u.failed)
            out.append(SendMessage(msg))
            self._obs.utterance_finished(status.value)
            self.log.info("utterance %d %s: %d segments, %.0f ms audio", u.id, status.value, started,
                          msg.duration_ms, extra={"utterance": u.id})
            self._utterances.popleft()
            self._history.append(u)
            self._last_activity_s = max(self._last_activity_s, now_s)

    def _fail_utterance(self, utt: _Utterance, code: P.ErrorCode, out: list[Action],
                        retry_after_ms: float | None = None) -> None:
        if utt.failed is not None:
            return
        if code is not P.ErrorCode.ENGINE_OVERLOADED:  # the server logs a refusal once, with its reason
            self.log.warning("utterance %d failed: %s", utt.id, code.value, extra={"utterance": utt.id})
        utt.failed = code
        dropped = 0
        for s in [s for s in self._streams if s.utt is utt]:
            dropped += s.held_samples
            out.append(AbortStream(s.request_id, s.generating))
            self._streams.remove(s)
            self._by_id.pop(s.request_id, None)
        if dropped:
            self._obs.audio_dropped(dropped / self.rate_hz, "error")
        self._error(out, code, utterance_id=utt.id,
                    retry_after_ms=None if retry_after_ms is None else math.ceil(retry_after_ms))

    # ================================================================ helpers

    def _abort_all(self, out: list[Action]) -> None:
        for s in self._streams:
            out.append(AbortStream(s.request_id, s.generating))
        self._streams.clear()
        self._by_id.clear()

    def _drop_all(self, now_s: float, reason: str) -> None:
        held = sum(s.held_samples for s in self._streams)
        if held:
            self._obs.audio_dropped(held / self.rate_hz, reason)
        for _ in self._utterances:
            self._obs.utterance_finished(reason)
        self._utterances.clear()

    def _close(self, out: list[Action], code: P.CloseCode, reason: P.CloseReason) -> None:
        self._abort_all(out)
        self.closed = True
        out.append(Close(code, reason))

    def _error(self, out: list[Action], code: P.ErrorCode, *, field: str | None = None,
               msg_id: P.MessageId | None = None, utterance_id: int | None = None,
               retry_after_ms: int | None = None) -> None:
        self._obs.error(code)
        out.append(SendMessage(P.ErrorMessage(code=code, field=field, id=msg_id, utterance_id=utterance_id,
                                              retry_after_ms=retry_after_ms)))

    def _ms(self, samples: int) -> float:
        return round(samples * 1000.0 / self.rate_hz, 1)

    def _heard_text(self, u: _Utterance, heard_pos: int) -> str:
        parts: list[str] = []
        for seg in u.segments:
            if seg.session_start is None:
                break
            played = heard_pos - seg.session_start
            if played <= 0:
                break
            est = int(seg.units * self.settings.est_ms_per_unit * self.rate_hz / 1000.0)
            total = seg.generated if seg.finished else max(seg.generated, est)
            if played >= total:
                parts.append(seg.text)
                continue
            k = int(len(seg.text) * played / max(total, 1))
            parts.append(_cut_words(seg.text, k))
            break
        return _join(parts)


def _cut_words(text: str, k: int) -> str:
    """``text[:k]`` without a trailing partial word (CJK characters stand alone)."""
    k = max(0, min(k, len(text)))
    if k == len(text) or k == 0:
        return text[:k]
    if is_cjk(text[k - 1]) or text[k].isspace() or is_cjk(text[k]):
        return text[:k].rstrip()
    j = text.rfind(" ", 0, k)
    return text[:j].rstrip() if j > 0 else ""


def _join(parts: list[str]) -> str:
    out = ""
    for p in parts:
        if not p:
            continue
        if out and not (is_cjk(out[-1]) or is_cjk(p[0])):
            out += " "
        out += p
    return out

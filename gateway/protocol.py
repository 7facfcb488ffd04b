"""voicegw wire protocol v1: message types, field schemas, error and close codes, audio header.

Pure: no sockets, no asyncio. ``docs/protocol.md`` documents everything here; a test keeps the
two in sync (every enum value appears in the document).

Text frames carry one JSON object each (``{"type": ..., ...}``); binary frames (server to client
only) carry audio: a 16-byte little-endian header (``AUDIO_HEADER``) followed by samples. Client
messages are parsed and validated here (``parse_client_message``); server messages are typed
(one frozen dataclass per ``ServerType``: ``ServerMessage``) and have one encoder
(``encode_server``).
"""

from __future__ import annotations

import base64
import binascii
import enum
import math
import struct
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Final, Literal, TypeAlias

import orjson

# the code frames' wire form and audio span, re-exported for the clients (segment.codes)
from engine.api import CODE_FRAME_BYTES as CODE_FRAME_BYTES
from engine.api import NATIVE_SAMPLE_RATE_HZ as NATIVE_SAMPLE_RATE_HZ
from engine.api import SAMPLES_PER_STEP as SAMPLES_PER_STEP
from engine.api import codes_from_bytes

PROTOCOL_VERSION: Final = 1
#: WebSocket subprotocol naming the protocol version; the server always selects it.
SUBPROTOCOL: Final = "voicegw.v1"
#: Subprotocol carrying a bearer token (browsers cannot set an Authorization header).
TOKEN_SUBPROTOCOL_PREFIX: Final = "voicegw.token."
#: HTTP path of the WebSocket endpoint.
WS_PATH: Final = "/ws"
#: Sample rates a client may ask for.
SUPPORTED_SAMPLE_RATES_HZ: Final = (8_000, 16_000, 24_000, 48_000)
DEFAULT_SAMPLE_RATE_HZ: Final = 24_000
#: Longest ``id`` a client may attach to a message (echoed in replies).
MAX_ID_CHARS: Final = 64
#: Longest ``voice`` string: an encoded speaker embedding (768 fp16 values: ~840 characters).
MAX_VOICE_CHARS: Final = 4096


class ClientType(enum.StrEnum):
    """Messages a client sends (JSON text frames)."""

    SESSION_START = "session.start"
    TEXT_DELTA = "text.delta"
    TEXT_FLUSH = "text.flush"
    TEXT_END = "text.end"
    CANCEL = "cancel"
    PLAYBACK = "playback"
    PING = "ping"


class ServerType(enum.StrEnum):
    """Messages the server sends (JSON text frames; audio goes in binary frames)."""

    SESSION_STARTED = "session.started"
    SEGMENT_STARTED = "segment.started"
    SEGMENT_DONE = "segment.done"
    SEGMENT_CODES = "segment.codes"
    UTTERANCE_DONE = "utterance.done"
    CANCELLED = "cancelled"
    ERROR = "error"
    PONG = "pong"


class AudioFormat(enum.StrEnum):
    PCM16 = "pcm16"
    """Signed 16-bit little-endian mono samples."""
    MULAW = "mulaw"
    """G.711 mu-law, one byte per sample."""

    @property
    def wire_code(self) -> int:
        return _FORMAT_CODES[self]

    @property
    def bytes_per_sample(self) -> int:
        return 2 if self is AudioFormat.PCM16 else 1


_FORMAT_CODES: dict[AudioFormat, int] = {AudioFormat.PCM16: 0, AudioFormat.MULAW: 1}


class UtteranceStatus(enum.StrEnum):
    """``status`` of ``utterance.done``."""

    OK = "ok"
    ERROR = "error"


class ErrorCode(enum.StrEnum):
    """``code`` of the ``error`` message. The message text is fixed per code (ERROR_MESSAGES)."""

    INVALID_JSON = "invalid_json"
    INVALID_MESSAGE = "invalid_message"
    UNKNOWN_TYPE = "unknown_type"
    INVALID_FIELD = "invalid_field"
    BINARY_NOT_ALLOWED = "binary_not_allowed"
    SESSION_NOT_STARTED = "session_not_started"
    SESSION_ALREADY_STARTED = "session_already_started"
    TEXT_TOO_LONG = "text_too_long"
    RATE_LIMITED = "rate_limited"
    QUEUE_FULL = "queue_full"
    SHUTTING_DOWN = "shutting_down"
    ENGINE_OVERLOADED = "engine_overloaded"
    ENGINE_ERROR = "engine_error"
    ENGINE_UNAVAILABLE = "engine_unavailable"
    INTERNAL_ERROR = "internal_error"


@dataclass(frozen=True)
class ErrorSpec:
    """What one error code means everywhere: the native ``error`` message and every dialect."""

    message: str
    """The one text a client ever sees for it (never exception text)."""
    http_status: int
    """What the HTTP dialects answer when it comes before any audio was sent."""
    fatal: bool = False
    """The session closes after it (1011 ``INTERNAL_ERROR``); otherwise it stays usable."""


#: THE error table: the native protocol, the WebSocket dialects and the HTTP dialects take their
#: texts, statuses and fatality from here (tests/gateway/test_protocol.py keeps it complete).
ERRORS: Final[dict[ErrorCode, ErrorSpec]] = {
    ErrorCode.INVALID_JSON: ErrorSpec("message is not valid JSON", 400),
    ErrorCode.INVALID_MESSAGE: ErrorSpec('message must be a JSON object with a string "type"', 400),
    ErrorCode.UNKNOWN_TYPE: ErrorSpec("unknown message type", 400),
    ErrorCode.INVALID_FIELD: ErrorSpec("a field is missing, unknown, of the wrong type or out of range", 400),
    ErrorCode.BINARY_NOT_ALLOWED: ErrorSpec("binary messages are not accepted from clients", 400),
    ErrorCode.SESSION_NOT_STARTED: ErrorSpec("send session.start first", 400),
    ErrorCode.SESSION_ALREADY_STARTED: ErrorSpec("session already started", 400),
    ErrorCode.TEXT_TOO_LONG: ErrorSpec("utterance text over the limit; the delta was dropped", 400),
    ErrorCode.RATE_LIMITED: ErrorSpec("text rate over the limit; the delta was dropped", 429),
    ErrorCode.QUEUE_FULL: ErrorSpec("too many utterances waiting to be spoken; the delta was dropped", 429),
    ErrorCode.SHUTTING_DOWN: ErrorSpec("server is shutting down; no new utterances", 503),
    ErrorCode.ENGINE_OVERLOADED: ErrorSpec("speech engine at capacity; the utterance was stopped", 503),
    ErrorCode.ENGINE_ERROR: ErrorSpec("speech engine failed on this utterance; the utterance was stopped", 500),
    ErrorCode.ENGINE_UNAVAILABLE: ErrorSpec("speech engine unavailable; the session is closed", 503, fatal=True),
    ErrorCode.INTERNAL_ERROR: ErrorSpec("internal error; the session is closed", 500, fatal=True),
}

#: The one text a client ever sees per error code (never exception text).
ERROR_MESSAGES: Final[dict[ErrorCode, str]] = {c: e.message for c, e in ERRORS.items()}

#: Errors after which the server closes the session (all others leave it usable).
FATAL_ERRORS: Final = frozenset(c for c, e in ERRORS.items() if e.fatal)


class CloseCode(enum.IntEnum):
    """WebSocket close codes the server uses (RFC 6455 numbers)."""

    NORMAL = 1000
    """Client closed, or the session was idle (reason ``idle``)."""
    PROTOCOL_ERROR = 1002
    """Invalid WebSocket framing (closed by the websockets library)."""
    INVALID_DATA = 1007
    """Text frame that is not UTF-8 (closed by the websockets library)."""
    POLICY_VIOLATION = 1008
    """Slow reader, message flood or text-rate abuse (see reason)."""
    MESSAGE_TOO_BIG = 1009
    """Message over ``limits.max_message_bytes`` (closed before the payload is read)."""
    INTERNAL_ERROR = 1011
    """Speech engine unavailable or internal error."""
    SERVICE_RESTART = 1012
    """Server shutting down (a restart or deploy): reconnect with backoff and resume."""
    TRY_AGAIN_LATER = 1013
    """Over ``limits.max_sessions`` (a race past the door's 503): reconnect with backoff."""


ABNORMAL_CLOSE: Final = 1006
"""Never sent (not a ``CloseCode``): the connection was lost without a close frame."""

#: Close codes -> (HTTP status, error code) for an HTTP dialect whose session closed before any
#: audio was sent.
CLOSE_HTTP: Final[dict[int, tuple[int, str]]] = {
    CloseCode.SERVICE_RESTART: (503, "shutting_down"),
    CloseCode.TRY_AGAIN_LATER: (503, "over_capacity"),
    CloseCode.INTERNAL_ERROR: (500, "internal_error"),
}


class CloseReason(enum.StrEnum):
    """``reason`` strings sent with a close code."""

    IDLE = "idle"
    SHUTDOWN = "server shutting down"
    SLOW_READER = "slow reader"
    MESSAGE_FLOOD = "message flood"
    RATE_LIMIT = "text rate abuse"
    ENGINE_UNAVAILABLE = "engine unavailable"
    INTERNAL_ERROR = "internal error"
    OVER_CAPACITY = "over capacity"
    PROTOCOL_ERROR = "protocol error"
    INVALID_DATA = "invalid data"
    MESSAGE_TOO_BIG = "message too big"


#: Fixed reasons for the closes the WebSocket library decides itself (a malformed frame, invalid
#: UTF-8, an oversize message): its own reason carries exception text, never sent to clients.
LIBRARY_CLOSE_REASONS: Final[dict[int, CloseReason]] = {
    1002: CloseReason.PROTOCOL_ERROR,
    1007: CloseReason.INVALID_DATA,
    1009: CloseReason.MESSAGE_TOO_BIG,
    1011: CloseReason.INTERNAL_ERROR,
}


# --------------------------------------------------------------------------------------------
# Binary audio frames (server -> client)

#: version u8, format u8 (0 pcm16, 1 mulaw), segment index u16, utterance id u32,
#: sequence number u32 (per utterance, from 0), sample offset u32 (first sample of this frame
#: within its utterance). Payload follows: samples in the session's format and rate.
AUDIO_HEADER: Final = struct.Struct("<BBHIII")
AUDIO_HEADER_BYTES: Final = AUDIO_HEADER.size  # 16
AUDIO_FRAME_VERSION: Final = 1


@dataclass(frozen=True)
class AudioFrameHeader:
    utterance_id: int
    seq: int
    sample_offset: int
    segment: int
    format: AudioFormat = AudioFormat.PCM16
    version: int = AUDIO_FRAME_VERSION


def pack_audio_frame(header: AudioFrameHeader, payload: bytes) -> bytes:
    return (
        AUDIO_HEADER.pack(
            header.version,
            header.format.wire_code,
            header.segment & 0xFFFF,
            header.utterance_id & 0xFFFFFFFF,
            header.seq & 0xFFFFFFFF,
            header.sample_offset & 0xFFFFFFFF,
        )
        + payload
    )


def unpack_audio_frame(data: bytes) -> tuple[AudioFrameHeader, bytes]:
    """Split a binary frame into header and payload. Raises ValueError when malformed."""
    if len(data) < AUDIO_HEADER_BYTES:
        raise ValueError("audio frame shorter than its header")
    version, fmt, segment, utt, seq, offset = AUDIO_HEADER.unpack_from(data)
    if version != AUDIO_FRAME_VERSION:
        raise ValueError(f"unknown audio frame version {version}")
    formats = {v: k for k, v in _FORMAT_CODES.items()}
    if fmt not in formats:
        raise ValueError(f"unknown audio format code {fmt}")
    header = AudioFrameHeader(
        utterance_id=utt, seq=seq, sample_offset=offset, segment=segment, format=formats[fmt]
    )
    return header, data[AUDIO_HEADER_BYTES:]


# --------------------------------------------------------------------------------------------
# Client messages: schema and parsing

MessageId: TypeAlias = str | int
"""A client's ``id`` (validated: a string of at most ``MAX_ID_CHARS``, or an integer), echoed."""


class ProtocolError(Exception):
    """A client message was refused. ``str()`` is never sent; clients get ERROR_MESSAGES[code]."""

    def __init__(self, code: ErrorCode, field: str | None = None, msg_id: MessageId | None = None):
        super().__init__(code.value if field is None else f"{code.value}: {field}")
        self.code = code
        self.field = field
        self.msg_id = msg_id


class Kind(enum.Enum):
    STR = "string"
    INT = "integer"
    NUMBER = "number"
    OBJECT = "object"
    STR_OR_INT = "string or integer"
    BOOL = "boolean"


@dataclass(frozen=True)
class FieldSpec:
    """One field of a client message."""

    name: str
    kind: Kind
    required: bool = False
    min: float | None = None
    max: float | None = None
    max_len: int | None = None
    choices: tuple[Any, ...] | None = None
    doc: str = ""

    def check(self, value: Any) -> bool:
        k = self.kind
        if k is Kind.BOOL or isinstance(value, bool):
            return k is Kind.BOOL and isinstance(value, bool)
        if k is Kind.STR or (k is Kind.STR_OR_INT and isinstance(value, str)):
            if not isinstance(value, str):
                return False
            if self.max_len is not None and len(value) > self.max_len:
                return False
        elif k is Kind.INT or k is Kind.STR_OR_INT:
            if not isinstance(value, int):
                return False
        elif k is Kind.NUMBER:
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                return False
        elif k is Kind.OBJECT:
            if not isinstance(value, dict):
                return False
        if isinstance(value, (int, float)):
            if self.min is not None and value < self.min:
                return False
            if self.max is not None and value > self.max:
                return False
        if self.choices is not None and value not in self.choices:
            return False
        return True


_ID = FieldSpec("id", Kind.STR_OR_INT, max_len=MAX_ID_CHARS, min=-(2**53), max=2**53,
                doc="optional; echoed in the error/pong it causes")
_U53 = float(2**53)

#: Fields of ``session.start``'s ``options`` object.
OPTION_FIELDS: Final[tuple[FieldSpec, ...]] = (
    FieldSpec("temperature", Kind.NUMBER, min=0.0, max=2.0, doc="sampling temperature (0 = greedy)"),
    FieldSpec("top_p", Kind.NUMBER, min=0.01, max=1.0, doc="nucleus mass"),
    FieldSpec("top_k", Kind.INT, min=1, max=1000, doc="top-k"),
    FieldSpec("seed", Kind.INT, min=0, max=2**31 - 1, doc="sampling seed (reproducible audio)"),
)

#: Longest ``resume.codes``: base64 of ``MAX_RESUME_FRAMES`` code frames.
MAX_RESUME_FRAMES: Final = 2048
MAX_RESUME_CODES_CHARS: Final = 4 * math.ceil(MAX_RESUME_FRAMES * CODE_FRAME_BYTES / 3)

#: Fields of an opening ``text.delta``'s ``resume`` object: go on with a segment the client
#: received part of (its text is the first ``chars`` characters of the delta's text).
RESUME_FIELDS: Final[tuple[FieldSpec, ...]] = (
    FieldSpec("chars", Kind.INT, required=True, min=1, max=2**31 - 1,
              doc="length of the segment, code points (its end_char - start_char)"),
    FieldSpec("samples", Kind.INT, required=True, min=0, max=2**31 - 1,
              doc="samples of it the client has (at the session rate): they are not sent again"),
    FieldSpec("codes", Kind.STR, max_len=MAX_RESUME_CODES_CHARS,
              doc="base64 of the segment's segment.codes so far, in order (session.started resume: codes)"),
    FieldSpec("seed", Kind.INT, min=0, max=2**31 - 1, doc="the segment's segment.codes seed"),
)

SCHEMAS: Final[dict[ClientType, tuple[FieldSpec, ...]]] = {
    ClientType.SESSION_START: (
        _ID,
        FieldSpec("voice", Kind.STR_OR_INT, max_len=MAX_VOICE_CHARS, min=0, max=2**31 - 1,
                  doc="speaker: int seed or encoded speaker embedding; default: server's voice"),
        FieldSpec("sample_rate", Kind.INT, choices=SUPPORTED_SAMPLE_RATES_HZ, doc="Hz; default 24000"),
        FieldSpec("format", Kind.STR, choices=tuple(AudioFormat), doc="pcm16 (default) or mulaw"),
        FieldSpec("language", Kind.STR, max_len=16, doc="BCP-47 tag, e.g. en, zh; echoed (informational)"),
        FieldSpec("options", Kind.OBJECT, doc="sampling options (see OPTION_FIELDS)"),
        FieldSpec("idle_timeout_s", Kind.NUMBER, min=1.0, max=86_400.0,
                  doc="idle close after this long (the smaller of it and limits.idle_timeout_s applies)"),
        FieldSpec("resume", Kind.BOOL, doc="send what resuming inside a segment needs (segment.codes)"),
    ),
    ClientType.TEXT_DELTA: (
        _ID,
        FieldSpec("text", Kind.STR, required=True, doc="next piece of the utterance's text, any size"),
        FieldSpec("resume", Kind.OBJECT, doc="opening delta only: go on with a partly received segment "
                  "(see RESUME_FIELDS)"),
    ),
    ClientType.TEXT_FLUSH: (_ID,),
    ClientType.TEXT_END: (_ID,),
    ClientType.CANCEL: (
        _ID,
        FieldSpec("played_samples", Kind.INT, min=0, max=_U53,
                  doc="client's played-sample counter at the moment it stopped playback"),
        FieldSpec("utterance_id", Kind.INT, min=1, max=_U53,
                  doc="stop only this utterance (queued, or the one playing); the others go on"),
    ),
    ClientType.PLAYBACK: (
        _ID,
        FieldSpec("played_samples", Kind.INT, required=True, min=0, max=_U53,
                  doc="samples played since session start (cumulative, real audio only)"),
        FieldSpec("buffered_ms", Kind.NUMBER, min=0, max=_U53, doc="audio queued at the client"),
        FieldSpec("underruns", Kind.INT, min=0, max=_U53, doc="cumulative underrun count"),
        FieldSpec("output_latency_ms", Kind.NUMBER, min=0, max=60_000, doc="device output latency"),
    ),
    ClientType.PING: (_ID, FieldSpec("t", Kind.NUMBER, doc="client timestamp, echoed in pong")),
}


@dataclass(frozen=True)
class ClientMessage:
    """A validated client message: its type and its fields (only schema fields, validated)."""

    type: ClientType
    fields: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> MessageId | None:
        v = self.fields.get("id")
        return v if isinstance(v, (str, int)) else None


def _validate_fields(specs: tuple[FieldSpec, ...], obj: dict[str, Any], prefix: str,
                     msg_id: MessageId | None) -> dict[str, Any]:
    by_name = {s.name: s for s in specs}
    out: dict[str, Any] = {}
    for key, value in obj.items():
        if key == "type" and not prefix:
            continue
        spec = by_name.get(key)
        if spec is None or not spec.check(value):
            raise ProtocolError(ErrorCode.INVALID_FIELD, prefix + key, msg_id)
        out[key] = value
    for spec in specs:
        if spec.required and spec.name not in obj:
            raise ProtocolError(ErrorCode.INVALID_FIELD, prefix + spec.name, msg_id)
    return out


def parse_client_message(data: str | bytes | dict[str, Any]) -> ClientMessage:
    """Parse and validate one client text frame, or the object a dialect's translator made (the
    same validation: a dialect is a client like any other). Raises ``ProtocolError``."""
    if isinstance(data, dict):
        obj: Any = data
    else:
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise ProtocolError(ErrorCode.INVALID_JSON) from None
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise ProtocolError(ErrorCode.INVALID_MESSAGE)
    raw_id = obj.get("id")
    msg_id: MessageId | None = raw_id if _ID.check(raw_id) else None
    try:
        mtype = ClientType(obj["type"])
    except ValueError:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, None, msg_id) from None
    fields = _validate_fields(SCHEMAS[mtype], obj, "", msg_id)
    if mtype is ClientType.SESSION_START and "options" in fields:
        fields["options"] = _validate_fields(OPTION_FIELDS, fields["options"], "options.", msg_id)
    if mtype is ClientType.TEXT_DELTA and "resume" in fields:
        r = fields["resume"] = _validate_fields(RESUME_FIELDS, fields["resume"], "resume.", msg_id)
        if "codes" in r:
            try:
                r["codes"] = codes_from_bytes(base64.b64decode(r["codes"], validate=True))
            except (ValueError, binascii.Error):
                raise ProtocolError(ErrorCode.INVALID_FIELD, "resume.codes", msg_id) from None
    return ClientMessage(mtype, fields)


# --------------------------------------------------------------------------------------------
# Server messages: one frozen dataclass per ``ServerType``, one encoder (``encode_server``).
#
# A message's fields are its wire keys, in wire order, after ``type`` (the class's ``TYPE``). A
# field made with ``_optional()`` is left off the wire when it is None; every other field is always
# sent (``null`` included). Nested values (``SessionLimits``, ``Word``, enums, tuples) are
# serialized by orjson as they are: dataclasses as objects in field order, enums as their values.

_OMIT_NONE: Final = "voicegw_omit_none"


def _optional() -> Any:
    """A field sent only when it is not None."""
    return field(default=None, metadata={_OMIT_NONE: True})


def _derived() -> Any:
    """A field the message sets itself (``__post_init__``), from the protocol's tables."""
    return field(init=False)


@dataclass(frozen=True, kw_only=True, slots=True)
class SessionLimits:
    """``session.started``'s ``limits``: the limits this session runs under."""

    max_message_bytes: int
    max_utterance_chars: int
    max_chars_per_s: float
    max_messages_per_s: float
    max_queued_utterances: int
    idle_timeout_s: float
    """The session's own: the smaller of ``limits.idle_timeout_s`` and what ``session.start`` asked."""
    flow_window_ms: float


@dataclass(frozen=True, kw_only=True, slots=True)
class SessionStarted:
    """Reply to ``session.start``: the session is ready."""

    TYPE: ClassVar[ServerType] = ServerType.SESSION_STARTED
    session_id: str
    protocol: str = SUBPROTOCOL
    engine: str
    sample_rate: int
    format: AudioFormat
    channels: int = 1
    frame_header_bytes: int = AUDIO_HEADER_BYTES
    limits: SessionLimits
    playback_report_interval_ms: float
    voice: str | int | None = _optional()
    language: str | None = _optional()
    resume: str | None = _optional()
    """When ``session.start`` asked (``resume: true``): how a partly received segment can be
    resumed here (``engine.api.ResumeMode``): ``codes`` (send its ``segment.codes`` back),
    ``samples`` (the engine makes the same audio again), ``segment`` (from its start only)."""
    id: MessageId | None = _optional()


@dataclass(frozen=True, kw_only=True, slots=True)
class SegmentCodes:
    """The code frames a segment's audio is made from, as the engine generates them (sessions
    that asked ``resume``, engines whose resume mode is ``codes``): sent after ``segment.started``
    and before the audio frames they cover. A client that kept them can resume the segment at
    any sample it has (``text.delta``'s ``resume``)."""

    TYPE: ClassVar[ServerType] = ServerType.SEGMENT_CODES
    utterance_id: int
    segment: int
    frame: int
    """Index of the first frame within the segment (a resumed segment's go on from its prefix)."""
    codes: str
    """Base64 of the frames: ``NUM_CODEBOOKS`` little-endian int16 codes each (``engine.api``)."""
    seed: int
    """The segment's sampling seed: given back with the codes, the rest of the segment is sampled
    as it would have been (its end included)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SegmentStarted:
    """Sent right before a segment's first audio frame (captions; where a client resumes)."""

    TYPE: ClassVar[ServerType] = ServerType.SEGMENT_STARTED
    utterance_id: int
    segment: int
    text: str
    sample_offset: int
    """First sample of the segment within its utterance."""
    start_char: int
    end_char: int
    """The segment's span in the utterance's text as received (code points)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Word:
    """One word of ``segment.done``'s ``words`` (ms from the utterance's first sample)."""

    word: str
    start_ms: float
    end_ms: float


@dataclass(frozen=True, kw_only=True, slots=True)
class SegmentDone:
    """A segment's last audio frame has been sent."""

    TYPE: ClassVar[ServerType] = ServerType.SEGMENT_DONE
    utterance_id: int
    segment: int
    samples: int
    words: tuple[Word, ...]
    word_timing: Literal["estimate"] = "estimate"


@dataclass(frozen=True, kw_only=True, slots=True)
class UtteranceDone:
    """All audio of an utterance has been sent (one per utterance, unless it is cancelled)."""

    TYPE: ClassVar[ServerType] = ServerType.UTTERANCE_DONE
    utterance_id: int
    status: UtteranceStatus
    samples: int
    duration_ms: float
    segments: int
    error: ErrorCode | None = _optional()
    """Why, when ``status`` is ``error``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Cancelled:
    """Reply to ``cancel``."""

    TYPE: ClassVar[ServerType] = ServerType.CANCELLED
    utterance_id: int | None
    """The utterance the playhead was in, else the oldest unfinished one, else None (sent: ``null``)."""
    generated_ms: float = 0.0
    sent_ms: float = 0.0
    played_ms: float = 0.0
    heard_text: str = ""
    cancelled_utterances: tuple[int, ...] = ()
    id: MessageId | None = _optional()


#: Longest client-chosen field name echoed in an error (a longer key is cut, with an ellipsis).
MAX_FIELD_ECHO_CHARS = 64


@dataclass(frozen=True, kw_only=True, slots=True)
class ErrorMessage:
    """``error``. ``message`` and ``fatal`` are not arguments: they come from ``ERRORS`` (a client
    never sees exception text); ``field`` is cut to ``MAX_FIELD_ECHO_CHARS``; ``retry_after_ms``
    is a whole number of ms, at least 0."""

    TYPE: ClassVar[ServerType] = ServerType.ERROR
    code: ErrorCode
    message: str = _derived()
    fatal: bool = _derived()
    field: str | None = _optional()
    """The offending field (``invalid_field``)."""
    id: MessageId | None = _optional()
    utterance_id: int | None = _optional()
    retry_after_ms: int | None = _optional()

    def __post_init__(self) -> None:
        spec = ERRORS[self.code]
        object.__setattr__(self, "message", spec.message)
        object.__setattr__(self, "fatal", spec.fatal)
        f = self.field
        if f is not None and len(f) > MAX_FIELD_ECHO_CHARS:
            object.__setattr__(self, "field", f[: MAX_FIELD_ECHO_CHARS - 1] + "…")
        if self.retry_after_ms is not None:
            object.__setattr__(self, "retry_after_ms", max(0, int(self.retry_after_ms)))


@dataclass(frozen=True, kw_only=True, slots=True)
class Pong:
    """Reply to ``ping``."""

    TYPE: ClassVar[ServerType] = ServerType.PONG
    server_time_ms: float
    id: MessageId | None = _optional()
    t: float | None = _optional()
    """The ping's ``t``, echoed."""


ServerMessage: TypeAlias = (
    SessionStarted | SegmentStarted | SegmentCodes | SegmentDone | UtteranceDone | Cancelled | ErrorMessage | Pong
)
"""A native server message (a JSON text frame once ``encode_server`` has made it bytes)."""

#: The message class of every server type (tests/gateway/test_protocol.py keeps it complete).
SERVER_MESSAGES: Final[dict[ServerType, type[ServerMessage]]] = {
    cls.TYPE: cls
    for cls in (SessionStarted, SegmentStarted, SegmentCodes, SegmentDone, UtteranceDone, Cancelled, ErrorMessage,
                Pong)
}

#: Per message class: its wire fields in order, and whether each is left off when None.
_WIRE_FIELDS: Final[dict[type, tuple[tuple[str, bool], ...]]] = {
    cls: tuple((f.name, bool(f.metadata.get(_OMIT_NONE))) for f in fields(cls))
    for cls in SERVER_MESSAGES.values()
}


def encode_server(message: ServerMessage) -> bytes:
    """THE encoder of server messages: ``{"type": ..., <fields in order>}`` as JSON (send it as a
    TEXT frame: ``send(data, text=True)``); optional fields that are None are left out."""
    obj: dict[str, Any] = {"type": message.TYPE.value}
    for name, omit_none in _WIRE_FIELDS[type(message)]:
        value = getattr(message, name)
        if value is None and omit_none:
            continue
        obj[name] = value
    return orjson.dumps(obj)


def wire_constants() -> dict[str, Any]:
    """Everything a client implementation needs to agree on (served at ``/protocol.json``)."""
    return {
        "version": PROTOCOL_VERSION,
        "subprotocol": SUBPROTOCOL,
        "token_subprotocol_prefix": TOKEN_SUBPROTOCOL_PREFIX,
        "ws_path": WS_PATH,
        "client_types": {m.name: m.value for m in ClientType},
        "server_types": {m.name: m.value for m in ServerType},
        "formats": {m.value: m.wire_code for m in AudioFormat},
        "sample_rates_hz": list(SUPPORTED_SAMPLE_RATES_HZ),
        "error_codes": {m.name: m.value for m in ErrorCode},
        "close_codes": {m.name: m.value for m in CloseCode},
        "audio_header": {
            "bytes": AUDIO_HEADER_BYTES,
            "version": AUDIO_FRAME_VERSION,
            "layout": "<BBHIII: version u8, format u8, segment u16, utterance_id u32, seq u32, "
            "sample_offset u32 (little-endian)",
        },
        "codes": {  # segment.codes: a frame's bytes; a frame's samples at the native rate
            "frame_bytes": CODE_FRAME_BYTES,
            "samples_per_frame": SAMPLES_PER_STEP,
            "native_rate_hz": NATIVE_SAMPLE_RATE_HZ,
        },
    }

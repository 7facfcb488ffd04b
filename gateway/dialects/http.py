"""The vendor-neutral half of the dialects' HTTP speech endpoints (pure): what a responder emits
(``Head``, ``Body``, ``End``, ``Abort``: ``front.HttpExchange`` writes them), the error base
class of the vendors whose errors are ``status``/``code``/``message`` (``VendorError``), and the
audio responder that ElevenLabs' and Deepgram's ``POST`` endpoints share (``AudioRequest``,
``AudioResponder``; the vendor's request parsing is ``elevenlabs.parse_http`` /
``deepgram.parse_http``). OpenAI's responder (SSE, usage) is ``openai.SpeechResponder``.

The response head waits for the first audio (so a refusal is still a proper HTTP error), then
the body is chunked as the engine produces; once audio has been sent, a failure can only cut the
stream short (``Abort``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from gateway import protocol as P
from gateway.dialects import voices
from gateway.dialects.audio import Encoder, OutputFormat, wav_stream_header
from gateway.dialects.base import session_start

# ---- what a responder emits -------------------------------------------------------------------


@dataclass(frozen=True)
class Head:
    status: int
    headers: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Body:
    data: bytes


@dataclass(frozen=True)
class End:
    """The response is complete."""


@dataclass(frozen=True)
class Abort:
    """Cut the response short (the client sees a truncated body)."""


HttpOut = Head | Body | End | Abort


# ---- vendor errors and the shared audio responder ----------------------------------------------

_CONTENT_TYPES: Final = {"pcm16": "audio/pcm", "mulaw": "audio/basic", "alaw": "audio/x-alaw-basic",
                         "mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac"}


class VendorError(Exception):
    """An error response in one vendor's shape: ``status``, ``code``, ``message``, ``headers``."""

    vendor: str = ""
    """``elevenlabs`` | ``deepgram`` (the subclasses: ``elevenlabs.ElevenLabsError``,
    ``deepgram.DeepgramError``, each with its ``body``)."""

    def __init__(self, status: int, code: str, message: str, headers: tuple[tuple[str, str], ...] = (),
                 request_id: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        retry = status in (429, 503) and not any(k.lower() == "retry-after" for k, _ in headers)
        self.headers = headers + ((("Retry-After", "1"),) if retry else ())
        self.request_id = request_id

    def body(self) -> bytes:
        raise NotImplementedError


@dataclass(frozen=True)
class AudioRequest:
    """What to speak and how to send it back."""

    text: str
    speaker: voices.Speaker
    fmt: OutputFormat
    error: type[VendorError]
    language: str | None = None
    seed: int | None = None
    wav: bool = False
    """A streaming WAV header first (sizes ``0xFFFFFFFF``)."""
    headers: tuple[tuple[str, str], ...] = ()
    request_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    timestamps: bool = False
    """ElevenLabs ``with-timestamps``: JSON with base64 audio and character alignment."""
    stream: bool = True
    """With ``timestamps``: one JSON line per segment (else one object at the end)."""


def body_json(raw: bytes, err: type[VendorError], max_chars: int) -> tuple[dict[str, Any], str]:
    """The JSON body ``{"text", ...}`` of an ElevenLabs or Deepgram request (object and text);
    raises ``err`` in that vendor's shape."""
    eleven = err.vendor == "elevenlabs"
    bad_status = 400 if err.vendor == "deepgram" else 422
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise err(400, "invalid_json" if eleven else "Bad Request", "the body is not valid JSON") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
        raise err(bad_status, "invalid_request" if eleven else "Bad Request",
                  'the body must be a JSON object with a string "text"')
    text = obj["text"]
    if not text.strip():
        raise err(bad_status, "invalid_request" if eleven else "Bad Request", '"text" is empty')
    if len(text) > max_chars:
        raise err(bad_status, "text_too_long" if eleven else "TEXT_TOO_LONG",
                  f'"text" is longer than {max_chars} characters')
    return obj, text


class AudioResponder:
    """One request over a native session: ``opening()`` messages, then audio as it comes (the
    encoded audio as the body; ElevenLabs' ``with-timestamps`` JSON is
    ``elevenlabs.TimestampsResponder``, which overrides the hooks ``_content_type``, ``_on_audio``,
    ``_segment`` and ``_complete``)."""

    def __init__(self, req: AudioRequest) -> None:
        self.req = req
        self.encoder = Encoder(req.fmt)
        self.head_sent = False
        self.finished = False
        self.samples = 0

    def opening(self) -> list[dict[str, Any]]:
        r = self.req
        return [session_start(r.fmt.session_rate_hz, r.speaker, r.language, r.seed), {"type": P.ClientType.TEXT_DELTA.value, "text": r.text}, {"type": P.ClientType.TEXT_END.value}]

    def _content_type(self) -> str:
        return "audio/wav" if self.req.wav else _CONTENT_TYPES[self.req.fmt.encoding]

    def _head(self) -> list[HttpOut]:
        if self.head_sent:
            return []
        self.head_sent = True
        out: list[HttpOut] = [Head(200, (("Content-Type", self._content_type()), *self.req.headers))]
        if self.req.wav:
            out.append(Body(wav_stream_header(self.req.fmt.rate_hz, encoding=self.req.fmt.encoding)))
        return out

    def on_server_audio(self, header: P.AudioFrameHeader, pcm16: bytes) -> list[HttpOut]:
        if self.finished or not pcm16:
            return []
        self.samples += len(pcm16) // 2
        return self._on_audio(pcm16)

    def _on_audio(self, pcm16: bytes) -> list[HttpOut]:
        """Audio of the utterance (not empty): what goes out for it now."""
        out = self._head()
        data = self.encoder.encode(pcm16)
        if data:
            out.append(Body(data))
        return out

    def _segment(self, msg: P.SegmentStarted | P.SegmentDone) -> list[HttpOut]:
        """A segment started or is done (its audio complete): nothing for plain audio."""
        return []

    def _complete(self, tail: bytes) -> list[HttpOut]:
        """The utterance is done (the head sent): the rest of the body (``tail``: the encoder's)."""
        return [Body(tail)] if tail else []

    def on_server_message(self, msg: P.ServerMessage) -> list[HttpOut]:
        if self.finished:
            return []
        if isinstance(msg, P.UtteranceDone):
            if msg.status is not P.UtteranceStatus.OK:
                return self._fail_code(msg.error or P.ErrorCode.ENGINE_ERROR)
            out = self._head()
            out += self._complete(self.encoder.flush())
            self.finished = True
            out.append(End())
            return out
        if isinstance(msg, P.SegmentStarted | P.SegmentDone):
            return self._segment(msg)
        if isinstance(msg, P.ErrorMessage) and (msg.fatal or msg.utterance_id is None):
            return self._fail_code(msg.code)
        return []

    def on_server_close(self, code: int, reason: str) -> list[HttpOut]:
        if self.finished:
            return []
        status, ecode = P.CLOSE_HTTP.get(code, (500, "internal_error"))
        return self._fail(self.req.error(status, ecode, reason or "the request was stopped",
                                         request_id=self.req.request_id))

    def _fail_code(self, code: P.ErrorCode) -> list[HttpOut]:
        spec = P.ERRORS[code]
        return self._fail(self.req.error(spec.http_status, code.value, spec.message, request_id=self.req.request_id))

    def _fail(self, err: VendorError) -> list[HttpOut]:
        self.finished = True
        if not self.head_sent:
            self.head_sent = True
            return [Head(err.status, (("Content-Type", "application/json"), *err.headers)), Body(err.body()), End()]
        return [Abort()]

"""OpenAI's speech endpoint (``POST /v1/audio/speech``) over a native session (pure). OpenAI has
no WebSocket TTS dialect here: this is all of it (its listings are ``listings.py``).

``parse_body`` validates the JSON body (OpenAI's fields; errors in OpenAI's shape, ``ApiError``).
``SpeechResponder`` runs one request: it opens the native session (``session.start``, the input as
one ``text.delta``, ``text.end``) and turns the session's audio into the HTTP response as it comes:
raw PCM, a WAV stream, or server-sent events (``stream_format: "sse"``). The response head waits
for the first audio (or the utterance's end), so a request the engine refuses still gets a proper
HTTP error; once audio has been sent, a failure can only cut the stream short (``Abort``).
"""

from __future__ import annotations

import base64
import math
import time
from dataclasses import dataclass
from typing import Any, Final

import orjson

from gateway import protocol as P
from gateway.dialects import voices
from gateway.dialects.audio import Encoder, OutputFormat, av_available, mp3_available, wav_stream_header
from gateway.dialects.base import session_start
from gateway.dialects.http import Abort, Body, End, Head, HttpOut

PATH: Final = "/v1/audio/speech"
RATE_HZ: Final = 24_000
"""OpenAI's pcm and wav are 24 kHz, 16-bit, mono."""
RESPONSE_FORMATS: Final = ("pcm", "wav", "mp3", "opus", "aac", "flac")
"""mp3 only when ``lameenc`` is installed (``audio.mp3_available``)."""
MP3_BITRATE_KBPS: Final = 64
"""mp3: 24 kHz mono, constant 64 kbit/s."""
COMPRESSED: Final[dict[str, OutputFormat]] = {
    "mp3": OutputFormat("mp3", RATE_HZ, MP3_BITRATE_KBPS),
    "opus": OutputFormat("opus", RATE_HZ, 32),
    "aac": OutputFormat("aac", RATE_HZ, 64),
    "flac": OutputFormat("flac", RATE_HZ),
}
"""mp3 needs ``lameenc``; opus (Ogg), aac (ADTS) and flac need ``av`` (PyAV)."""
_CONTENT_TYPES: Final = {"pcm": "audio/pcm", "wav": "audio/wav", "mp3": "audio/mpeg", "opus": "audio/opus",
                         "aac": "audio/aac", "flac": "audio/flac"}


def served_formats() -> tuple[str, ...]:
    """The ``response_format`` values this installation serves."""
    return tuple(f for f in RESPONSE_FORMATS
                 if f in ("pcm", "wav") or (f == "mp3" and mp3_available()) or (f != "mp3" and av_available()))
STREAM_FORMATS: Final = ("audio", "sse")
IGNORED_FIELDS: Final = ("instructions",)
SAMPLES_PER_TOKEN: Final = 512
"""``usage.output_tokens`` counts ChatTTS steps: 512 samples of 24 kHz audio each."""


class ApiError(Exception):
    """An OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> bytes:
        return orjson.dumps({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}})


@dataclass(frozen=True)
class SpeechBody:
    model: str
    input: str
    voice: str
    speaker: voices.Speaker
    response_format: str
    stream_format: str
    speed: float


def parse_body(raw: bytes, *, max_input_chars: int) -> SpeechBody:
    """Validate a request body; raises ApiError (400)."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise ApiError(400, "We could not parse the JSON body of your request.", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise ApiError(400, "The request body must be a JSON object.", code="invalid_json")
    for name in ("model", "input", "voice"):
        if name not in obj:
            raise ApiError(400, f"Missing required parameter: '{name}'.", param=name,
                           code="missing_required_parameter")
    model, text = obj["model"], obj["input"]
    if not isinstance(model, str) or not model or len(model) > 256:
        raise ApiError(400, "'model' must be a non-empty string.", param="model", code="invalid_type")
    if not isinstance(text, str):
        raise ApiError(400, "'input' must be a string.", param="input", code="invalid_type")
    if not text.strip():
        raise ApiError(400, "'input' is empty.", param="input", code="invalid_value")
    if len(text) > max_input_chars:
        raise ApiError(400, f"'input' is longer than {max_input_chars} characters.", param="input",
                       code="string_above_max_length")
    voice_obj = obj["voice"]
    if isinstance(voice_obj, dict) and isinstance(voice_obj.get("id"), str):
        voice = voice_obj["id"]
    elif isinstance(voice_obj, str):
        voice = voice_obj
    else:
        raise ApiError(400, "'voice' must be a string or an object with a string 'id'.", param="voice",
                       code="invalid_type")
    try:
        speaker = voices.openai_voice(voice)
    except voices.UnknownVoice:
        raise ApiError(400, f"Unknown voice {voice!r}. Supported: {', '.join(voices.OPENAI)}, a ChatTTS "
                       "seed ('2222'), or 'default'.", param="voice", code="invalid_value") from None
    fmt = obj.get("response_format", "mp3")
    served = served_formats()
    if fmt in RESPONSE_FORMATS and fmt not in served:
        raise ApiError(400, f"response_format '{fmt}' is not supported by this server; use one of "
                       f"{', '.join(served)}.", param="response_format", code="unsupported_value")
    if fmt not in served:
        raise ApiError(400, f"Invalid 'response_format': expected one of {', '.join(served)}.",
                       param="response_format", code="invalid_value")
    stream_format = obj.get("stream_format", "audio")
    if stream_format not in STREAM_FORMATS:
        raise ApiError(400, "Invalid 'stream_format': expected 'audio' or 'sse'.", param="stream_format",
                       code="invalid_value")
    speed = obj.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0.25 <= speed <= 4.0:
        raise ApiError(400, "'speed' must be a number from 0.25 to 4.0.", param="speed", code="invalid_value")
    if not math.isclose(float(speed), 1.0):
        raise ApiError(400, "'speed' other than 1.0 is not supported by this server.", param="speed",
                       code="unsupported_value")
    instructions = obj.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError(400, "'instructions' must be a string.", param="instructions", code="invalid_type")
    return SpeechBody(model, text, voice, speaker, fmt, stream_format, float(speed))


# ---- the response (its outputs: ``http.Head``, ``Body``, ``End``, ``Abort``) ------------------


def _openai_type(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status."""
    return "rate_limit_error" if status == 429 else "server_error" if status >= 500 else "invalid_request_error"


def error_for_code(code: P.ErrorCode) -> ApiError:
    spec = P.ERRORS[code]
    retry = (("Retry-After", "1"),) if spec.http_status in (429, 503) else ()
    return ApiError(spec.http_status, spec.message, _openai_type(spec.http_status), None, code.value, retry)


def error_outputs(err: ApiError) -> list[HttpOut]:
    return [Head(err.status, (("Content-Type", "application/json"), *err.headers)), Body(err.body()), End()]


class SpeechResponder:
    """One speech request over a native session (see the module docstring)."""

    def __init__(self, body: SpeechBody) -> None:
        self.body = body
        self.t0 = time.monotonic()
        """For ``openai-processing-ms``: the request parsed to the response's head."""
        self.sse = body.stream_format == "sse"
        self.head_sent = False
        self.finished = False
        self.samples = 0
        self.encoder = Encoder(COMPRESSED[body.response_format] if body.response_format in COMPRESSED
                               else OutputFormat("pcm16", RATE_HZ))

    def opening(self) -> list[dict[str, Any]]:
        return [session_start(RATE_HZ, self.body.speaker),
                {"type": P.ClientType.TEXT_DELTA.value, "text": self.body.input},
                {"type": P.ClientType.TEXT_END.value}]

    def _head(self) -> list[HttpOut]:
        if self.head_sent:
            return []
        self.head_sent = True
        ms = ("openai-processing-ms", str(round((time.monotonic() - self.t0) * 1000)))
        if self.sse:
            out: list[HttpOut] = [Head(200, (("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache"),
                                             ms))]
        else:
            out = [Head(200, (("Content-Type", _CONTENT_TYPES[self.body.response_format]), ms))]
        if self.body.response_format == "wav":
            header = wav_stream_header(RATE_HZ)
            out.append(Body(self._event_audio(header) if self.sse else header))
        return out

    def _event_audio(self, data: bytes) -> bytes:
        return _sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})

    def on_server_audio(self, header: P.AudioFrameHeader, pcm16: bytes) -> list[HttpOut]:
        if self.finished or not pcm16:
            return []
        self.samples += len(pcm16) // 2
        out = self._head()
        data = self.encoder.encode(pcm16)
        if data:
            out.append(Body(self._event_audio(data) if self.sse else data))
        return out

    def on_server_message(self, msg: P.ServerMessage) -> list[HttpOut]:
        if self.finished:
            return []
        if isinstance(msg, P.UtteranceDone):
            if msg.status is not P.UtteranceStatus.OK:
                return self._fail(error_for_code(msg.error or P.ErrorCode.ENGINE_ERROR))
            out = self._head()
            tail = self.encoder.flush()
            if tail:
                out.append(Body(self._event_audio(tail) if self.sse else tail))
            if self.sse:
                tokens_in = max(1, math.ceil(len(self.body.input) / 4))
                tokens_out = math.ceil(self.samples / SAMPLES_PER_TOKEN)
                out.append(Body(_sse({"type": "speech.audio.done", "usage": {
                    "input_tokens": tokens_in, "output_tokens": tokens_out,
                    "total_tokens": tokens_in + tokens_out}})))
            self.finished = True
            out.append(End())
            return out
        if isinstance(msg, P.ErrorMessage) and (msg.fatal or msg.utterance_id is None):
            return self._fail(error_for_code(msg.code))
        return []  # session.started, segment.*, non-fatal errors about the utterance (done follows)

    def on_server_close(self, code: int, reason: str) -> list[HttpOut]:
        if self.finished:
            return []
        status, ecode = P.CLOSE_HTTP.get(code, (500, "internal_error"))
        retry = (("Retry-After", "1"),) if status == 503 else ()
        return self._fail(ApiError(status, reason or "the request was stopped", "server_error", None, ecode, retry))

    def _fail(self, err: ApiError) -> list[HttpOut]:
        self.finished = True
        if not self.head_sent:
            self.head_sent = True
            return error_outputs(err)
        if self.sse:
            return [Body(_sse({"type": "error", "error": orjson.loads(err.body())["error"]})), End()]
        return [Abort()]


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"

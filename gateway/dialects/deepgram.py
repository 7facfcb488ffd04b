"""Deepgram's text-to-speech over a native session (pure): the ``/v1/speak`` WebSocket and the
REST endpoint ``POST /v1/speak`` (``parse_http`` at the end of this module; its audio responder is
``http.AudioResponder``, shared with ElevenLabs' HTTP endpoint).

WebSocket client: ``{"type": "Speak", "text"}``, ``{"type": "Flush"}``, ``{"type": "Clear"}``,
``{"type": "Close"}``. Server: ``Metadata`` at connect, binary audio, ``Flushed``/``Cleared``
(``sequence_id``), ``Warning``. Mapping (docs/dialects/deepgram.md):

* ``Speak`` -> ``text.delta``; the native segmenter starts audio at clause boundaries, so audio
  flows before ``Flush`` as it does at Deepgram.
* ``Flush`` -> ``text.end`` (+ barrier); ``Flushed`` once all its audio has been sent.
* ``Clear`` -> ``cancel``; audio still queued for the client is dropped; ``Cleared`` follows.
* ``Close`` -> the connection closes 1000 at once (as at Deepgram); unsent audio is dropped and the
  engine work stopped, as for any disconnect.

REST: JSON body ``{"text"}``, the WebSocket's query parameters (``model``, ``encoding``,
``sample_rate``) plus ``container`` (``none``, or ``wav`` for linear16: Deepgram's REST default),
default ``encoding=mp3`` as Deepgram's REST API, and opus/aac/flac with PyAV (``HTTP_AV``); errors
``{"err_code", "err_msg", "request_id"}`` (``DeepgramError``); ``dg-request-id``,
``dg-model-name``, ``dg-char-count`` headers.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import parse_qs, urlencode

import orjson

from gateway import protocol as P
from gateway.dialects import voices
from gateway.dialects.audio import Encoder, OutputFormat, av_available, mp3_available
from gateway.dialects.base import FieldError, Step, Turns, header_safe, parse_int, session_start
from gateway.dialects.http import AudioRequest, VendorError, body_json

PATH: Final = "/v1/speak"
#: encoding -> sample rates Deepgram accepts for it (default: linear16 at 24000 Hz).
RATES_HZ: Final[dict[str, tuple[int, ...]]] = {
    "linear16": (8_000, 16_000, 24_000, 32_000, 48_000),
    "mulaw": (8_000, 16_000),
    "alaw": (8_000, 16_000),
}
DEFAULT_RATE_HZ: Final[dict[str, int]] = {"linear16": 24_000, "mulaw": 8_000, "alaw": 8_000}
_ENCODINGS: Final = {"linear16": "pcm16", "mulaw": "mulaw", "alaw": "alaw"}
MODEL_VERSION: Final = "voicegw-chattts"
"""``Metadata.model_version`` when the serving engine is not known (see ``model_version``)."""


def model_version(engine_name: str) -> str:
    """``Metadata.model_version``: names the engine that serves (``voicegw-chattts-vllm``,
    ``voicegw-espeak`` ...)."""
    return f"voicegw-{engine_name}" if engine_name else MODEL_VERSION
#: Query parameters accepted and ignored.
IGNORED_PARAMS: Final = frozenset({"mip_opt_out", "tag", "callback", "callback_method", "bit_rate",
                                   "container"})


class QueryError(ValueError):
    """Refused at the handshake: HTTP 400 with ``{"err_code", "err_msg"}``."""

    def __init__(self, err_code: str, err_msg: str) -> None:
        super().__init__(err_msg)
        self.err_code = err_code
        self.err_msg = err_msg


@dataclass(frozen=True)
class Options:
    model: str
    speaker: voices.Speaker
    fmt: OutputFormat
    language: str | None


def parse_rate(raw: str | None, encoding: str, rates: tuple[int, ...], default: int) -> int:
    """``sample_rate`` (absent or empty: ``default``) through the one numeric parser
    (``base.parse_int``: ASCII digits, ``"24000.0"`` as the SDKs send); raises QueryError."""
    if not raw:
        return default
    try:
        rate = parse_int(raw, "sample_rate", min(rates), max(rates), float_zero=True)
    except FieldError:
        rate = -1
    if rate not in rates:
        raise QueryError("INVALID_QUERY_PARAMETER", f"sample_rate not supported for {encoding}; "
                         f"use one of {', '.join(map(str, rates))}")
    return rate


def parse_query(query: str) -> Options:
    """The handshake's query string -> options; raises QueryError."""
    try:
        q = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True, strict_parsing=False).items()}
    except ValueError:
        raise QueryError("INVALID_QUERY_PARAMETER", "malformed query string") from None
    model = q.get("model") or voices.DEEPGRAM_DEFAULT_MODEL
    try:
        speaker = voices.deepgram_voice(model)
    except voices.UnknownVoice:
        raise QueryError("INVALID_QUERY_PARAMETER", f"unknown model {model!r}: see docs/dialects/deepgram.md "
                         "for the voices this server has") from None
    encoding = q.get("encoding") or "linear16"
    if encoding not in RATES_HZ:
        raise QueryError("UNSUPPORTED_ENCODING", f"encoding {encoding!r} not supported; use linear16, mulaw "
                         "or alaw (no containers)")
    rate = parse_rate(q.get("sample_rate"), encoding, RATES_HZ[encoding], DEFAULT_RATE_HZ[encoding])
    speed = q.get("speed")
    if speed not in (None, "", "1", "1.0"):
        raise QueryError("INVALID_QUERY_PARAMETER", "speed other than 1.0 is not supported by this server")
    parts = model.lower().rsplit("-", 1)
    language = parts[1] if len(parts) == 2 and len(parts[1]) == 2 and parts[1].isalpha() else None
    return Options(model, speaker, OutputFormat(_ENCODINGS[encoding], rate), language)  # type: ignore[arg-type]


def _json(obj: dict[str, Any]) -> str:
    return orjson.dumps(obj).decode()


def _warning(code: str, description: str) -> str:
    return _json({"type": "Warning", "description": description, "code": code})


class DeepgramTranslator:
    """One ``/v1/speak`` connection (see the module docstring)."""

    def __init__(self, options: Options, request_id: str | None = None, model_version: str = MODEL_VERSION) -> None:
        self.options = options
        self.model_version = model_version
        self.request_id = request_id or str(uuid.uuid4())
        self.encoder = Encoder(options.fmt)
        self.turns = Turns()
        self.flushed_seq = 0
        self.cleared_seq = 0
        self.closing = False
        self.discarding = False
        """Between a Clear and its ``cancelled`` reply: audio still queued belongs to what was
        cleared and is dropped."""
        self.delivered_samples = 0

    def opening(self) -> Step:
        o = self.options
        start = session_start(o.fmt.session_rate_hz, o.speaker, o.language)
        meta = {"type": "Metadata", "request_id": self.request_id, "model_name": o.model,
                "model_version": self.model_version, "model_uuid": str(uuid.uuid5(uuid.NAMESPACE_URL, o.model))}
        return Step(to_session=[start], to_client=[_json(meta)])

    # ---- client -> session ------------------------------------------------------------------

    def on_client(self, data: str | bytes) -> Step:
        if isinstance(data, bytes):
            return Step(to_client=[_warning("BINARY_NOT_ALLOWED", "binary messages are not accepted")])
        try:
            msg = orjson.loads(data)
        except orjson.JSONDecodeError:
            return Step(to_client=[_warning("INVALID_JSON", "message is not valid JSON")])
        mtype = msg.get("type") if isinstance(msg, dict) else None
        if self.closing:
            return Step(to_client=[_warning("CLOSING", f"{mtype} after Close ignored")])
        if mtype == "Speak":
            text = msg.get("text")
            if not isinstance(text, str):
                return Step(to_client=[_warning("INVALID_MESSAGE", 'Speak needs a string "text"')])
            return Step(to_session=self.turns.delta(text))
        if mtype == "Flush":
            return Step(to_session=self.turns.boundary("flush"))
        if mtype == "Clear":
            self.turns.cancel_all()
            self.discarding = True
            return Step(to_session=[{"type": P.ClientType.CANCEL.value, "played_samples": self.delivered_samples}])
        if mtype == "Close":  # Deepgram closes at once: what is still generating is dropped
            self.closing = True
            return Step(close=(P.CloseCode.NORMAL, ""))
        return Step(to_client=[_warning("UNKNOWN_MESSAGE_TYPE", f"unknown message type {mtype!r}; expected "
                                        "Speak, Flush, Clear or Close")])

    # ---- session -> client ------------------------------------------------------------------

    def on_server_audio(self, header: P.AudioFrameHeader, pcm16: bytes) -> Step:
        if self.discarding:
            return Step()
        n = len(pcm16) // 2
        self.delivered_samples += n
        data = self.encoder.encode(pcm16)
        return Step(to_client=[data] if data else [], delivered_samples=n)

    def on_server_message(self, msg: P.ServerMessage) -> Step:
        step = Step()
        if isinstance(msg, P.Cancelled):
            self.discarding = False
            self.encoder.reset()
            self.turns.on_cancelled()
            step.to_client.append(_json({"type": "Cleared", "sequence_id": self.cleared_seq}))
            self.cleared_seq += 1
        elif isinstance(msg, P.ErrorMessage) and not _is_own_refusal(msg):
            step.to_client.append(_warning(msg.code.value.upper(), msg.message))
        elif isinstance(msg, P.ErrorMessage):
            step.to_client.append(_warning(msg.code.value.upper(), f"{msg.message} (Speak dropped)"))
        for tag, _status in self.turns.on_server_message(msg):
            tail = self.encoder.flush()
            if tail:
                step.to_client.append(tail)
            if tag == "flush":
                step.to_client.append(_json({"type": "Flushed", "sequence_id": self.flushed_seq}))
                self.flushed_seq += 1
        return step

    def on_server_close(self, code: int, reason: str) -> Step:
        return Step(close=(code, reason))


def _is_own_refusal(msg: P.ErrorMessage) -> bool:
    """A refused ``text.delta`` of ours (``Turns`` gives every delta a string id)."""
    return isinstance(msg.id, str)


# ---- HTTP: ``POST /v1/speak`` (Deepgram REST) ----------------------------------------------------

HTTP_MP3_KBPS: Final = 48
"""Deepgram REST's mp3: 22.05 kHz at 48 kbit/s (its documented default bit rate)."""
#: Deepgram REST encodings beyond the WebSocket's (PyAV): encoding -> (rates, default rate, kbps).
HTTP_AV: Final[dict[str, tuple[tuple[int, ...], int, int]]] = {
    "opus": ((48_000,), 48_000, 32),
    "aac": ((8_000, 16_000, 22_050, 24_000, 32_000, 44_100, 48_000), 22_050, 48),
    "flac": ((8_000, 16_000, 22_050, 32_000, 48_000), 48_000, 0),
}


class DeepgramError(VendorError):
    """Deepgram's error shape: ``{"err_code", "err_msg", "request_id"}``."""

    vendor = "deepgram"

    def body(self) -> bytes:
        return orjson.dumps({"err_code": self.code, "err_msg": self.message, "request_id": self.request_id})


def parse_http(query: str, raw: bytes, max_chars: int) -> AudioRequest:
    """``POST /v1/speak``; raises DeepgramError."""
    rid = str(uuid.uuid4())
    q = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
    if q.get("speed", "").endswith(".0"):  # SDKs send floats: "1.0" (sample_rate: parse_rate)
        q["speed"] = q["speed"][:-2]
    encoding = q.get("encoding") or "mp3"
    # Deepgram REST's default container: wav for linear16, mulaw and alaw; ogg for opus
    container = q.get("container") or {"linear16": "wav", "mulaw": "wav", "alaw": "wav", "opus": "ogg"}.get(
        encoding, "none")
    if encoding not in HTTP_AV and (container not in ("none", "wav") or container == "wav"
                                    and encoding not in ("linear16", "mulaw", "alaw")):
        raise DeepgramError(400, "UNSUPPORTED_CONTAINER", f"container {container!r} is not supported for "
                            f"{encoding}; use none (or wav with linear16, mulaw or alaw)", request_id=rid)
    if encoding in HTTP_AV:
        if not av_available():
            raise DeepgramError(400, "UNSUPPORTED_ENCODING", f"{encoding} needs the av package on this server; "
                                "use encoding=linear16, mulaw or alaw", request_id=rid)
        rates, default_rate, kbps = HTTP_AV[encoding]
        try:
            rate = parse_rate(q.get("sample_rate"), encoding, rates, default_rate)
        except QueryError as exc:
            raise DeepgramError(400, exc.err_code, exc.err_msg, request_id=rid) from None
        if container not in ("none", "ogg" if encoding == "opus" else "none"):
            raise DeepgramError(400, "UNSUPPORTED_CONTAINER", f"container {container!r} is not supported for "
                                f"{encoding}", request_id=rid)
        rest = urlencode({k: v for k, v in q.items() if k not in ("encoding", "sample_rate", "container")})
        try:
            opts = parse_query(rest)
        except QueryError as exc:
            raise DeepgramError(400, exc.err_code, exc.err_msg, request_id=rid) from None
        fmt = OutputFormat(encoding, rate, kbps)  # type: ignore[arg-type]
    elif encoding == "mp3":
        if not mp3_available():
            raise DeepgramError(400, "UNSUPPORTED_ENCODING", "mp3 needs the lameenc package on this server; "
                                "use encoding=linear16, mulaw or alaw", request_id=rid)
        rest = urlencode({k: v for k, v in q.items() if k not in ("encoding", "sample_rate", "container")})
        try:
            opts = parse_query(rest)
        except QueryError as exc:
            raise DeepgramError(400, exc.err_code, exc.err_msg, request_id=rid) from None
        fmt = OutputFormat("mp3", 22_050, HTTP_MP3_KBPS)
    else:
        rest = urlencode({k: v for k, v in q.items() if k != "container"})
        try:
            opts = parse_query(rest)
        except QueryError as exc:
            raise DeepgramError(400, exc.err_code, exc.err_msg, request_id=rid) from None
        fmt = opts.fmt
    _, text = body_json(raw, DeepgramError, max_chars)
    model = header_safe(opts.model)  # the client's spelling (a known model, "default" or a seed)
    headers = (("dg-request-id", rid), ("dg-model-name", model), ("dg-model-uuid", f"voicegw-{model}"),
               ("dg-char-count", str(len(text))))
    return AudioRequest(text, opts.speaker, fmt, DeepgramError, opts.language, wav=container == "wav",
                        headers=headers, request_id=rid)

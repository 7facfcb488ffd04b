"""Audio over plain HTTP for the ElevenLabs and Deepgram dialects (pure): request parsing and a
responder that turns one native session's audio into the response body as it comes.

* ElevenLabs ``POST /v1/text-to-speech/{voice_id}``, ``.../stream``, ``.../with-timestamps`` and
  ``.../stream/with-timestamps`` (JSON: ``audio_base64`` and character ``alignment``, one object,
  or one line per segment as each segment's audio is complete): JSON body ``{"text",
  "model_id"?, "voice_settings"?, "language_code"?, "seed"?, ...}``, query ``output_format``
  (the WebSocket dialect's formats, default ``mp3_44100_128``); errors ``{"detail": {"status",
  "message"}}``.
* Deepgram ``POST /v1/speak``: JSON body ``{"text"}``, the WebSocket dialect's query parameters
  (``model``, ``encoding``, ``sample_rate``) plus ``container`` (``none``, or ``wav`` for
  linear16: Deepgram's REST default), default ``encoding=mp3`` as Deepgram's REST API; errors
  ``{"err_code", "err_msg", "request_id"}``; ``dg-request-id``, ``dg-model-name``,
  ``dg-char-count`` headers.

Both endpoints stream: the head waits for the first audio (so a refusal is still a proper HTTP
error), then the body is chunked as the engine produces. OpenAI's ``/v1/audio/speech`` is
``openai.py`` (it has SSE and usage on top).
"""

from __future__ import annotations

import base64
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import parse_qs, unquote, urlencode

import orjson

from gateway import protocol as P
from gateway.dialects import deepgram, elevenlabs, voices
from gateway.dialects.audio import Encoder, OutputFormat, av_available, mp3_available, wav_stream_header
from gateway.dialects.base import Alignment, FieldError, header_safe, parse_int, session_start
from gateway.dialects.openai import Abort, Body, End, Head, HttpOut

ELEVENLABS_PATH_RE: Final = re.compile(r"^/v1/text-to-speech/([^/]+)(/stream)?(/with-timestamps)?$")
DEEPGRAM_MP3_KBPS: Final = 48
"""Deepgram REST's mp3: 22.05 kHz at 48 kbit/s (its documented default bit rate)."""
_CONTENT_TYPES: Final = {"pcm16": "audio/pcm", "mulaw": "audio/basic", "alaw": "audio/x-alaw-basic",
                         "mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac"}
#: Deepgram REST encodings beyond the WebSocket's (PyAV): encoding -> (rates, default rate, kbps).
DEEPGRAM_AV: Final[dict[str, tuple[tuple[int, ...], int, int]]] = {
    "opus": ((48_000,), 48_000, 32),
    "aac": ((8_000, 16_000, 22_050, 24_000, 32_000, 44_100, 48_000), 22_050, 48),
    "flac": ((8_000, 16_000, 22_050, 32_000, 48_000), 48_000, 0),
}



MAX_LINE_AUDIO_BYTES: Final = 65_536
"""``/stream/with-timestamps``: most audio bytes in one JSON line (~1.4 s of 24 kHz PCM)."""


class VendorError(Exception):
    """An error response in one vendor's shape: ``status``, ``code``, ``message``, ``headers``."""

    vendor = "elevenlabs"

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
        if self.vendor == "deepgram":
            return orjson.dumps({"err_code": self.code, "err_msg": self.message, "request_id": self.request_id})
        return orjson.dumps({"detail": {"status": self.code, "message": self.message}})


class ElevenLabsError(VendorError):
    vendor = "elevenlabs"


class DeepgramError(VendorError):
    vendor = "deepgram"


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


def _body_json(raw: bytes, err: type[VendorError], max_chars: int) -> tuple[dict[str, Any], str]:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise err(400, "invalid_json" if err is ElevenLabsError else "Bad Request", "the body is not valid JSON") \
            from None
    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
        raise err(400 if err is DeepgramError else 422, "invalid_request" if err is ElevenLabsError else "Bad Request",
                  'the body must be a JSON object with a string "text"')
    text = obj["text"]
    if not text.strip():
        raise err(400 if err is DeepgramError else 422, "invalid_request" if err is ElevenLabsError else "Bad Request",
                  '"text" is empty')
    if len(text) > max_chars:
        raise err(400 if err is DeepgramError else 422,
                  "text_too_long" if err is ElevenLabsError else "Bad Request",
                  f'"text" is longer than {max_chars} characters')
    return obj, text


def parse_elevenlabs(path: str, query: str, raw: bytes, max_chars: int) -> AudioRequest:
    """``POST /v1/text-to-speech/{voice_id}[/stream]``; raises ElevenLabsError."""
    m = ELEVENLABS_PATH_RE.match(path)
    if m is None:
        raise ElevenLabsError(404, "not_found", "not found")
    voice_id = unquote(m.group(1))
    try:
        if len(voice_id) > elevenlabs.MAX_VOICE_ID_CHARS:
            raise voices.UnknownVoice(voice_id)
        speaker = voices.elevenlabs_voice(voice_id)
    except voices.UnknownVoice:
        raise ElevenLabsError(404, "voice_not_found", f"A voice with the voice_id "
                              f"{elevenlabs.shown_voice_id(voice_id)} was not found.") from None
    q = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
    fmt_name = q.get("output_format") or "mp3_44100_128"
    served = elevenlabs.served_formats()
    fmt = served.get(fmt_name)
    if fmt is None:
        raise ElevenLabsError(400, "invalid_output_format", f"output_format {fmt_name} is not supported by this "
                              f"server; use one of {', '.join(served)}")
    obj, text = _body_json(raw, ElevenLabsError, max_chars)
    problem = elevenlabs.check_voice_settings(obj.get("voice_settings"))
    if problem:
        raise ElevenLabsError(422, "invalid_voice_settings", problem)
    seed = obj.get("seed")
    if seed is not None:
        try:
            seed = parse_int(seed, "seed", 0, elevenlabs.MAX_SEED)
        except FieldError as exc:
            raise ElevenLabsError(422, "invalid_seed", exc.message) from None
    language = obj.get("language_code")
    if language is not None and (not isinstance(language, str) or not re.fullmatch(r"[A-Za-z0-9-]{1,16}", language)):
        raise ElevenLabsError(422, "invalid_language_code", "language_code must be a language tag")
    return AudioRequest(text, speaker, fmt, ElevenLabsError, language, None if seed is None else seed % 2**31,
                        timestamps=m.group(3) is not None, stream=m.group(2) is not None)


def parse_deepgram(query: str, raw: bytes, max_chars: int) -> AudioRequest:
    """``POST /v1/speak``; raises DeepgramError."""
    rid = str(uuid.uuid4())
    q = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
    if q.get("speed", "").endswith(".0"):  # SDKs send floats: "1.0" (sample_rate: deepgram.parse_rate)
        q["speed"] = q["speed"][:-2]
    encoding = q.get("encoding") or "mp3"
    container = q.get("container") or {"linear16": "wav", "opus": "ogg"}.get(encoding, "none")
    if encoding not in DEEPGRAM_AV and (container not in ("none", "wav") or container == "wav"
                                        and encoding != "linear16"):
        raise DeepgramError(400, "UNSUPPORTED_CONTAINER", f"container {container!r} is not supported for "
                            f"{encoding}; use none (or wav with linear16)", request_id=rid)
    if encoding in DEEPGRAM_AV:
        if not av_available():
            raise DeepgramError(400, "UNSUPPORTED_ENCODING", f"{encoding} needs the av package on this server; "
                                "use encoding=linear16, mulaw or alaw", request_id=rid)
        rates, default_rate, kbps = DEEPGRAM_AV[encoding]
        try:
            rate = deepgram.parse_rate(q.get("sample_rate"), encoding, rates, default_rate)
        except deepgram.QueryError as exc:
            raise DeepgramError(400, exc.err_code, exc.err_msg, request_id=rid) from None
        if container not in ("none", "ogg" if encoding == "opus" else "none"):
            raise DeepgramError(400, "UNSUPPORTED_CONTAINER", f"container {container!r} is not supported for "
                                f"{encoding}", request_id=rid)
        rest = urlencode({k: v for k, v in q.items() if k not in ("encoding", "sample_rate", "container")})
        try:
            opts = deepgram.parse_query(rest)
        except deepgram.QueryError as exc:
            raise DeepgramError(400, exc.err_code, exc.err_msg, request_id=rid) from None
        fmt = OutputFormat(encoding, rate, kbps)  # type: ignore[arg-type]
    elif encoding == "mp3":
        if not mp3_available():
            raise DeepgramError(400, "UNSUPPORTED_ENCODING", "mp3 needs the lameenc package on this server; "
                                "use encoding=linear16, mulaw or alaw", request_id=rid)
        rest = urlencode({k: v for k, v in q.items() if k not in ("encoding", "sample_rate", "container")})
        try:
            opts = deepgram.parse_query(rest)
        except deepgram.QueryError as exc:
            raise DeepgramError(400, exc.err_code, exc.err_msg, request_id=rid) from None
        fmt = OutputFormat("mp3", 22_050, DEEPGRAM_MP3_KBPS)
    else:
        rest = urlencode({k: v for k, v in q.items() if k != "container"})
        try:
            opts = deepgram.parse_query(rest)
        except deepgram.QueryError as exc:
            raise DeepgramError(400, exc.err_code, exc.err_msg, request_id=rid) from None
        fmt = opts.fmt
    _, text = _body_json(raw, DeepgramError, max_chars)
    model = header_safe(opts.model)  # the client's spelling (a known model, "default" or a seed)
    headers = (("dg-request-id", rid), ("dg-model-name", model), ("dg-model-uuid", f"voicegw-{model}"),
               ("dg-char-count", str(len(text))))
    return AudioRequest(text, opts.speaker, fmt, DeepgramError, opts.language, wav=container == "wav",
                        headers=headers, request_id=rid)


class AudioResponder:
    """One request over a native session: ``opening()`` messages, then audio as it comes."""

    def __init__(self, req: AudioRequest) -> None:
        self.req = req
        self.encoder = Encoder(req.fmt)
        self.head_sent = False
        self.finished = False
        self.samples = 0
        self._alignment_of = Alignment()
        self._alignment_of.add_text(self.req.text)
        """Characters of the text before this are aligned (gaps: spaces, unspoken marks)."""
        self._seg_audio = bytearray()
        self._t_ms = 0.0
        self._chars: list[str] = []
        self._starts_s: list[float] = []
        self._ends_s: list[float] = []
        self._audio = bytearray()

    def opening(self) -> list[dict[str, Any]]:
        r = self.req
        return [session_start(r.fmt.session_rate_hz, r.speaker, r.language, r.seed), {"type": P.ClientType.TEXT_DELTA.value, "text": r.text}, {"type": P.ClientType.TEXT_END.value}]

    def _head(self) -> list[HttpOut]:
        if self.head_sent:
            return []
        self.head_sent = True
        ctype = "audio/wav" if self.req.wav else _CONTENT_TYPES[self.req.fmt.encoding]
        if self.req.timestamps:
            ctype = "application/json"
        out: list[HttpOut] = [Head(200, (("Content-Type", ctype), *self.req.headers))]
        if self.req.wav:
            out.append(Body(wav_stream_header(self.req.fmt.rate_hz)))
        return out

    def on_server_audio(self, header: P.AudioFrameHeader, pcm16: bytes) -> list[HttpOut]:
        if self.finished or not pcm16:
            return []
        self.samples += len(pcm16) // 2
        if self.req.timestamps:
            self._seg_audio += self.encoder.encode(pcm16)
            return []
        out = self._head()
        data = self.encoder.encode(pcm16)
        if data:
            out.append(Body(data))
        return out

    def _alignment(self, chars: list[str], starts: list[float], ends: list[float]) -> dict[str, Any]:
        a = {"characters": chars, "character_start_times_seconds": starts, "character_end_times_seconds": ends}
        return {"alignment": a, "normalized_alignment": a}

    def _segment_done(self, samples: int) -> list[HttpOut]:
        """A segment's audio is complete: its characters' times (an estimate within the segment,
        ``segmenter.char_timings``), as one JSON line when streaming."""
        dur_ms = samples * 1000.0 / self.req.fmt.session_rate_hz
        chars, starts, durs, _ = self._alignment_of.done_ms(samples, self.req.fmt.session_rate_hz) or ([], [], [], 0)
        t0 = round(self._t_ms / 1000.0, 3)
        s0 = [round((self._t_ms + a) / 1000.0, 3) for a in starts]
        e0 = [round((self._t_ms + a + d) / 1000.0, 3) for a, d in zip(starts, durs, strict=True)]
        self._t_ms += dur_ms
        audio, self._seg_audio = bytes(self._seg_audio), bytearray()
        if not self.req.stream:
            self._audio += audio
            self._chars += chars
            self._starts_s += s0
            self._ends_s += e0
            return []
        out = self._head()
        # lines of at most MAX_LINE_AUDIO_BYTES of audio (clients read a line into a bounded
        # buffer: aiohttp's default is 512 KiB, Pipecat's ElevenLabsHttpTTSService uses it); each
        # line carries the characters that start in its stretch of the segment's audio
        n_pieces = max(1, -(-len(audio) // MAX_LINE_AUDIO_BYTES))
        seg_start_s, seg_end_s = t0, round((self._t_ms) / 1000.0, 3)
        k = 0
        for i in range(n_pieces):
            piece = audio[i * MAX_LINE_AUDIO_BYTES:(i + 1) * MAX_LINE_AUDIO_BYTES]
            until_s = seg_start_s + (seg_end_s - seg_start_s) * (i + 1) / n_pieces
            j = len(chars) if i == n_pieces - 1 else k
            while i < n_pieces - 1 and j < len(chars) and s0[j] < until_s:
                j += 1
            line = {"audio_base64": base64.b64encode(piece).decode(), **self._alignment(chars[k:j], s0[k:j], e0[k:j])}
            out.append(Body(orjson.dumps(line) + b"\n"))
            k = j
        return out

    def on_server_message(self, msg: P.ServerMessage) -> list[HttpOut]:
        if self.finished:
            return []
        if isinstance(msg, P.UtteranceDone):
            if msg.status is not P.UtteranceStatus.OK:
                return self._fail_code(msg.error or P.ErrorCode.ENGINE_ERROR)
            out = self._head()
            tail = self.encoder.flush()
            if self.req.timestamps:
                audio = bytes(self._audio) + bytes(self._seg_audio) + tail
                rest = list(self._alignment_of.rest())  # trailing spaces or unspoken marks
                t_end = round(self._t_ms / 1000.0, 3)
                if self.req.stream:
                    if audio or rest:
                        out.append(Body(orjson.dumps({"audio_base64": base64.b64encode(audio).decode(),
                                                      **self._alignment(rest, [t_end] * len(rest),
                                                                        [t_end] * len(rest))}) + b"\n"))
                else:
                    self._chars += rest
                    self._starts_s += [t_end] * len(rest)
                    self._ends_s += [t_end] * len(rest)
                    out.append(Body(orjson.dumps({"audio_base64": base64.b64encode(audio).decode(),
                                                  **self._alignment(self._chars, self._starts_s, self._ends_s)})))
            elif tail:
                out.append(Body(tail))
            self.finished = True
            out.append(End())
            return out
        if self.req.timestamps and isinstance(msg, P.SegmentStarted):
            self._alignment_of.started(msg)
            return []
        if self.req.timestamps and isinstance(msg, P.SegmentDone):
            return self._segment_done(msg.samples)
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

"""ElevenLabs over a native session (pure): the input-streaming WebSockets
(``/v1/text-to-speech/{voice_id}/stream-input``, ``multi-stream-input``) and the HTTP endpoint
(``POST /v1/text-to-speech/{voice_id}[/stream][/with-timestamps]``, ``parse_http`` at the end of
this module; its responder is ``http.AudioResponder``, shared with Deepgram's REST, or for
``with-timestamps`` ``TimestampsResponder``).

WebSocket ``stream-input``:

Client: a first message ``{"text": " ", "voice_settings"?, "generation_config"?, "xi_api_key"?}``,
then ``{"text": "...", "flush"?: bool, "try_trigger_generation"?: bool}``, and ``{"text": ""}`` to
end. Server: ``{"audio": base64, "isFinal": false, "normalizedAlignment": null, "alignment": null}``
per chunk, ``{"audio": "", "alignment": {...}, ...}`` after each segment (``Alignment``),
``{"isFinal": true}`` once everything is spoken, then close 1000. Mapping
(docs/dialects/elevenlabs.md): text -> ``text.delta``; ``flush: true`` -> ``text.flush``;
``{"text": ""}`` -> ``text.end`` (+ barrier) -> ``isFinal`` -> close.

HTTP: JSON body ``{"text", "model_id"?, "voice_settings"?, "language_code"?, "seed"?, ...}``,
query ``output_format`` (the WebSocket's formats, default ``mp3_44100_128``); ``with-timestamps``
answers JSON (``audio_base64`` and character ``alignment``: one object, or with ``/stream`` one
line per segment as each segment's audio is complete); errors ``{"detail": {"status",
"message"}}`` (``ElevenLabsError``).
"""

from __future__ import annotations

import base64
import dataclasses
import math
import re
import secrets
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import parse_qs, unquote

import orjson

from gateway import protocol as P
from gateway.dialects import voices
from gateway.dialects.audio import Encoder, OutputFormat, av_available, mp3_available, wav_stream_header
from gateway.dialects.base import Alignment, FieldError, Step, Turns, parse_int, session_start
from gateway.dialects.http import AudioRequest, AudioResponder, Body, HttpOut, VendorError, body_json

PATH_PREFIX: Final = "/v1/text-to-speech/"
"""Every path under it is ElevenLabs' (its refusals in its shape)."""
PATH_RE: Final = re.compile(r"^/v1/text-to-speech/([^/]+)/(stream-input|multi-stream-input)$")
MAX_VOICE_ID_CHARS: Final = 128
"""A longer voice id is no voice (404 ``voice_not_found``); messages echo at most this much of it."""
MAX_CONTEXTS: Final = 5
"""Contexts open at once on one multi-context socket (a context is open until its ``isFinal``)."""
#: output_format values served (ElevenLabs names).
OUTPUT_FORMATS: Final[dict[str, OutputFormat]] = {
    "pcm_8000": OutputFormat("pcm16", 8_000),
    "pcm_16000": OutputFormat("pcm16", 16_000),
    "pcm_22050": OutputFormat("pcm16", 22_050),
    "pcm_24000": OutputFormat("pcm16", 24_000),
    "pcm_32000": OutputFormat("pcm16", 32_000),
    "pcm_44100": OutputFormat("pcm16", 44_100),
    "pcm_48000": OutputFormat("pcm16", 48_000),
    "ulaw_8000": OutputFormat("mulaw", 8_000),
    "alaw_8000": OutputFormat("alaw", 8_000),
}
#: MP3 output_format values, served when ``lameenc`` is installed (``audio.mp3_available``).
MP3_FORMATS: Final[dict[str, OutputFormat]] = {
    f"mp3_{rate}_{kbps}": OutputFormat("mp3", rate, kbps)
    for rate, kbps in ((22_050, 32), (24_000, 48), (44_100, 32), (44_100, 64), (44_100, 96), (44_100, 128), (44_100, 192))
}
#: Ogg/Opus output_format values, served when ``av`` (PyAV) is installed.
OPUS_FORMATS: Final[dict[str, OutputFormat]] = {
    f"opus_48000_{kbps}": OutputFormat("opus", 48_000, kbps) for kbps in (32, 64, 96, 128, 192)
}


#: WAV output_format values (PCM16 in a streaming WAV header): HTTP only; a WebSocket refuses them
#: (400 ``invalid_output_format``), its audio being base64 chunks with no container.
WAV_FORMATS: Final[dict[str, OutputFormat]] = {
    f"wav_{rate}": OutputFormat("pcm16", rate) for rate in (8_000, 16_000, 22_050, 24_000, 32_000, 44_100, 48_000)
}


def served_formats(http: bool = False) -> dict[str, OutputFormat]:
    """The output_format values this installation serves (``http``: with the WAV ones)."""
    return {**OUTPUT_FORMATS, **(MP3_FORMATS if mp3_available() else {}), **(OPUS_FORMATS if av_available() else {}),
            **(WAV_FORMATS if http else {})}


#: Query parameters accepted and ignored.
IGNORED_PARAMS: Final = frozenset({"model_id", "enable_logging", "enable_ssml_parsing", "optimize_streaming_latency",
                                   "sync_alignment", "auto_mode", "apply_text_normalization"})
DEFAULT_INACTIVITY_TIMEOUT_S: Final = 20
"""ElevenLabs' default ``inactivity_timeout``: the socket closes after this long without new text."""
MAX_INACTIVITY_TIMEOUT_S: Final = 180
MAX_SEED: Final = 4_294_967_295
"""ElevenLabs' ``seed`` range is 0..4294967295 (folded into the engine's 31-bit seeds)."""
"""The largest ``inactivity_timeout`` ElevenLabs documents."""


class HandshakeError(ValueError):
    """Refused at the handshake: HTTP ``status`` with ``{"detail": {"status", "message"}}``."""

    def __init__(self, http_status: int, status: str, message: str) -> None:
        super().__init__(message)
        self.http_status = http_status
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Options:
    voice_id: str
    speaker: voices.Speaker
    fmt: OutputFormat
    language: str | None
    seed: int | None
    multi: bool = False
    """``multi-stream-input``: several contexts on the socket (``ElevenLabsMultiTranslator``)."""
    inactivity_timeout_s: int = DEFAULT_INACTIVITY_TIMEOUT_S
    """Close after this long without client text or audio in flight (``inactivity_timeout``; the
    native session's ``idle_timeout_s``, so ``limits.idle_timeout_s`` caps it)."""


def shown_voice_id(voice_id: str) -> str:
    """A voice id as error messages echo it: at most ``MAX_VOICE_ID_CHARS`` characters."""
    return voice_id if len(voice_id) <= MAX_VOICE_ID_CHARS else voice_id[:MAX_VOICE_ID_CHARS] + "..."


def parse_request(path: str, query: str) -> Options:
    """Path and query of the handshake -> options; raises HandshakeError."""
    m = PATH_RE.match(path)
    if m is None:
        raise HandshakeError(404, "not_found", "not found")
    voice_id = unquote(m.group(1))
    try:
        if len(voice_id) > MAX_VOICE_ID_CHARS:
            raise voices.UnknownVoice(voice_id)
        speaker = voices.elevenlabs_voice(voice_id)
    except voices.UnknownVoice:
        raise HandshakeError(404, "voice_not_found", f"A voice with the voice_id {shown_voice_id(voice_id)} "
                             "was not found "
                             "(see docs/dialects/elevenlabs.md for the voices this server has).") from None
    try:
        q = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
    except ValueError:
        raise HandshakeError(400, "invalid_query", "malformed query string") from None
    fmt_name = q.get("output_format") or "mp3_44100_128"
    served = served_formats()
    fmt = served.get(fmt_name)
    if fmt is None:
        raise HandshakeError(400, "invalid_output_format", f"output_format {fmt_name} is not supported by this "
                             f"server; use one of {', '.join(served)}")
    try:
        seed = parse_int(q["seed"], "seed", 0, MAX_SEED) % 2**31 if q.get("seed") else None
    except FieldError as exc:
        raise HandshakeError(400, "invalid_seed", exc.message) from None
    language = q.get("language_code") or None
    if language is not None and (len(language) > 16 or not re.fullmatch(r"[A-Za-z0-9-]+", language)):
        raise HandshakeError(400, "invalid_language_code", "language_code must be a language tag")
    timeout_s = DEFAULT_INACTIVITY_TIMEOUT_S
    if q.get("inactivity_timeout"):
        try:
            timeout_s = parse_int(q["inactivity_timeout"], "inactivity_timeout", 1, MAX_INACTIVITY_TIMEOUT_S)
        except FieldError:
            raise HandshakeError(400, "invalid_inactivity_timeout",
                                 f"inactivity_timeout must be an integer in 1..{MAX_INACTIVITY_TIMEOUT_S} (seconds)") \
                from None
    return Options(voice_id, speaker, fmt, language, seed, m.group(2) == "multi-stream-input", timeout_s)


def _json(obj: dict[str, Any]) -> str:
    return orjson.dumps(obj).decode()


def _start(o: Options) -> dict[str, Any]:
    return {**session_start(o.fmt.session_rate_hz, o.speaker, o.language, o.seed),
            "idle_timeout_s": float(o.inactivity_timeout_s)}


def _idle_close(o: Options, cid_field: dict[str, Any]) -> Step:
    """The native session closed idle: ElevenLabs' ``input_timeout_exceeded``, close 1008."""
    msg = (f"Have not received a new text input within the timeout of {o.inactivity_timeout_s} seconds: "
           'streaming input terminated. Send text in time, a keep-alive, or the end of input ("").')
    return Step(to_client=[_json({"message": msg, "error": "input_timeout_exceeded", "code": int(P.CloseCode.POLICY_VIOLATION), **cid_field})],
                close=(P.CloseCode.POLICY_VIOLATION, "input_timeout_exceeded"))


def error_frame(error: str, message: str, code: int = P.CloseCode.POLICY_VIOLATION) -> str:
    """ElevenLabs' in-band error message."""
    return _json({"message": message, "error": error, "code": code})


class ElevenLabsTranslator:
    """One ``stream-input`` connection (see the module docstring).

    ``check_key``: when set, the first message must carry a valid ``xi_api_key`` (or
    ``authorization: Bearer``); the handshake had no valid key. Until it has, ``authenticated``
    is False, and the socket closes the connection (``on_auth_timeout``) unless a valid key comes
    within the gateway's opening deadline: a key-less connection must not hold a session seat."""

    def __init__(self, options: Options, check_key: Callable[[str], bool] | None = None) -> None:
        self.options = options
        self.check_key = check_key
        self.authenticated = check_key is None
        self.encoder = Encoder(options.fmt)
        self.turns = Turns()
        self.alignment = Alignment()
        self.initialized = False
        self.ended = False

    def opening(self) -> Step:
        o = self.options
        return Step(to_session=[_start(o)])

    # ---- client -> session ------------------------------------------------------------------

    def on_client(self, data: str | bytes) -> Step:
        if isinstance(data, bytes):
            return Step(to_client=[error_frame("invalid_message", "binary messages are not accepted")])
        try:
            msg = orjson.loads(data)
        except orjson.JSONDecodeError:
            return Step(to_client=[error_frame("invalid_message", "message is not valid JSON")])
        if not isinstance(msg, dict) or not isinstance(msg.get("text"), str):
            return Step(to_client=[error_frame("invalid_message", 'every message needs a string "text"')])
        if self.ended:
            return Step(to_client=[error_frame("invalid_message", "text after the end of input is ignored")])
        step = Step()
        if not self.initialized:
            self.initialized = True
            if self.check_key is not None and not self.check_key(_first_message_key(msg)):
                return Step(to_client=[error_frame("auth_error", "invalid or missing API key")],
                            close=(P.CloseCode.POLICY_VIOLATION, "invalid api key"))
            self.authenticated = True
            problem = check_voice_settings(msg.get("voice_settings"))
            if problem:
                return Step(to_client=[error_frame("invalid_voice_settings", problem)], close=(P.CloseCode.POLICY_VIOLATION, problem))
            if msg["text"] != "" and not msg["text"].strip():
                return step  # the initial " " ("" ends the input, even as the first message)
        text: str = msg["text"]
        if text == "":
            self.ended = True
            return Step(to_session=self.turns.boundary("final"))
        step.to_session += self.turns.delta(text)
        self.alignment.add_text(text)
        if msg.get("flush") is True:
            step.to_session.append({"type": P.ClientType.TEXT_FLUSH.value})
        return step

    def on_auth_timeout(self) -> Step:
        """No valid key arrived in time (the handshake had none)."""
        return Step(to_client=[error_frame("auth_error", "no API key received in time")],
                    close=(P.CloseCode.POLICY_VIOLATION, "no api key"))

    # ---- session -> client ------------------------------------------------------------------

    def on_server_audio(self, header: P.AudioFrameHeader, pcm16: bytes) -> Step:
        data = self.encoder.encode(pcm16)
        n = len(pcm16) // 2
        if not data:
            return Step(delivered_samples=n)
        return Step(to_client=[self._audio(data)], delivered_samples=n)

    def _audio(self, data: bytes) -> str:
        return _json({"audio": base64.b64encode(data).decode(), "isFinal": False,
                      "normalizedAlignment": None, "alignment": None})

    def on_server_message(self, msg: P.ServerMessage) -> Step:
        step = Step()
        if isinstance(msg, P.SegmentStarted):
            self.alignment.started(msg)
        elif isinstance(msg, P.SegmentDone):
            step.to_client += _alignment_message(self.alignment, self.encoder, msg, None)
        elif isinstance(msg, P.ErrorMessage):
            step.to_client.append(error_frame(msg.code.value, msg.message,
                                              P.CloseCode.INTERNAL_ERROR if msg.fatal else P.CloseCode.POLICY_VIOLATION))
        for tag, _status in self.turns.on_server_message(msg):
            tail = self.encoder.flush()
            if tail:
                step.to_client.append(self._audio(tail))
            if tag == "final":
                step.to_client.append(_json({"isFinal": True}))
                step.close = (P.CloseCode.NORMAL, "")
        return step

    def on_server_close(self, code: int, reason: str) -> Step:
        if reason == P.CloseReason.IDLE.value:
            return _idle_close(self.options, {})
        return Step(close=(code, reason))


def _alignment_message(al: Alignment, encoder: Encoder, msg: P.SegmentDone, cid: str | None) -> list[str]:
    """``segment.done`` -> one message with the segment's character alignment and no audio
    (``audio: ""``: the SDK's ``AudioOutput``/``AudioOutputMulti`` require a string):
    times in ms from the segment's start, ElevenLabs' "from the start of this message's audio",
    the segment being the span that the message times."""
    got = al.done(msg.samples, encoder.fmt.session_rate_hz)
    if got is None or not got[0]:
        return []
    a = {"chars": got[0], "charStartTimesMs": got[1], "charDurationsMs": got[2]}
    obj: dict[str, Any] = {"audio": "", "isFinal": False, "normalizedAlignment": a, "alignment": a}
    if cid is not None:
        obj["contextId"] = cid
    return [_json(obj)]


def _first_message_key(msg: dict[str, Any]) -> str:
    for k in ("xi_api_key", "xi-api-key"):
        v = msg.get(k)
        if isinstance(v, str) and v:
            return v
    auth = msg.get("authorization")
    if isinstance(auth, str) and auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return ""


def check_voice_settings(vs: Any) -> str | None:
    """voice_settings are accepted and ignored, except a speed other than 1.0 (not supported)."""
    if vs is None:
        return None
    if not isinstance(vs, dict):
        return "voice_settings must be an object"
    speed = vs.get("speed")
    if speed is not None and (not isinstance(speed, (int, float)) or not math.isclose(float(speed), 1.0)):
        return "voice_settings.speed other than 1.0 is not supported by this server"
    return None


# ---- multi-context (``multi-stream-input``) ----------------------------------------------------


@dataclass(eq=False)
class _Context:
    cid: str
    n: int
    """Its serial number on the socket (message ids: a ``context_id`` may be too long for one)."""
    encoder: Encoder
    uid: int | None = None
    """The native utterance carrying its text (utterance ids count utterances opened, from 1)."""
    alignment: Alignment = field(default_factory=Alignment)
    ended: bool = False
    """``text.end`` sent (its text is complete)."""
    done: bool = False
    """Its native utterance is over (all its audio sent), or it never had one."""
    flushed: bool = False
    closing: bool = False
    """The client closed it (``close_context``)."""
    barged: bool = False
    """Closed before its text was complete: its audio is dropped, its engine work stopped."""
    final: bool = False


class ElevenLabsMultiTranslator:
    """One ``multi-stream-input`` connection: every context is an utterance of the one native
    session (spoken one after another, in the order their text came).

    * ``{"text": " ", "context_id", "voice_settings"?}`` opens a context; text goes to its
      utterance (``text.delta``; text for another context first ends the open one);
      ``flush: true`` -> ``text.flush``; ``{"text": "", ...}`` is a keep-alive (see below).
    * ``close_context`` right after a flush with no text (the end of a turn, as Pipecat and LiveKit
      send it): ``text.end``, and ``{"isFinal": true, "contextId"}`` once its audio is all sent.
      Otherwise (an interruption: LiveKit's last message of an interrupted stream is text with a
      flush; a second ``close_context``): a barge-in of that context only (native ``cancel
      {utterance_id}``), its audio still queued dropped, ``isFinal`` right after.
    * ``close_socket``: the connection closes (1000); the session's work stops.
    * Audio: ``{"audio", "isFinal": false, "contextId", "alignment": null, "normalizedAlignment":
      null}``; after each segment its alignment (``audio: ""``); errors ``{"error", "message",
      "contextId"}``. ``{"text": ""}`` (a keep-alive) is a native ``ping``: it holds off the idle
      close (``inactivity_timeout``).
    """

    def __init__(self, options: Options, check_key: Callable[[str], bool] | None = None) -> None:
        self.options = options
        self.check_key = check_key
        self.authenticated = check_key is None
        self.contexts: dict[str, _Context] = {}
        self.by_uid: dict[int, _Context] = {}
        self.open: _Context | None = None
        """The context whose utterance takes text now."""
        self.uids = 0
        self.serial = 0
        self.by_n: dict[int, _Context] = {}
        self.initialized = False

    def opening(self) -> Step:
        o = self.options
        return Step(to_session=[_start(o)])

    def on_auth_timeout(self) -> Step:
        return Step(to_client=[error_frame("auth_error", "no API key received in time")], close=(P.CloseCode.POLICY_VIOLATION, "no api key"))

    def _error(self, error: str, message: str, cid: str | None) -> str:
        obj: dict[str, Any] = {"error": error, "message": message}
        if cid is not None:
            obj["contextId"] = cid
        return _json(obj)

    # ---- client -> session ------------------------------------------------------------------

    def on_client(self, data: str | bytes) -> Step:
        if isinstance(data, bytes):
            return Step(to_client=[self._error("invalid_message", "binary messages are not accepted", None)])
        try:
            msg = orjson.loads(data)
        except orjson.JSONDecodeError:
            return Step(to_client=[self._error("invalid_message", "message is not valid JSON", None)])
        if not isinstance(msg, dict):
            return Step(to_client=[self._error("invalid_message", "every message is a JSON object", None)])
        if not self.initialized:
            self.initialized = True
            if self.check_key is not None and not self.check_key(_first_message_key(msg)):
                return Step(to_client=[self._error("auth_error", "invalid or missing API key", None)],
                            close=(P.CloseCode.POLICY_VIOLATION, "invalid api key"))
            self.authenticated = True
        if msg.get("close_socket") is True:
            return Step(close=(P.CloseCode.NORMAL, ""))
        cid = msg.get("context_id", msg.get("contextId", "default"))
        if not isinstance(cid, str) or not cid or len(cid) > 256:
            return Step(to_client=[self._error("invalid_message", "context_id must be a non-empty string", None)])
        problem = check_voice_settings(msg.get("voice_settings"))
        if problem:
            return Step(to_client=[self._error("invalid_voice_settings", problem, cid)])
        ctx = self.contexts.get(cid)
        if msg.get("close_context") is True:
            return self._close(ctx) if ctx is not None else Step()
        text = msg.get("text")
        if text is not None and not isinstance(text, str):
            return Step(to_client=[self._error("invalid_message", '"text" must be a string', cid)])
        if ctx is None:
            if sum(1 for c in self.contexts.values() if not c.final) >= MAX_CONTEXTS:
                return Step(to_client=[self._error("max_active_conversations", f"at most {MAX_CONTEXTS} contexts "
                                                   "may be open on one connection; close one first", cid)])
            self.serial += 1
            ctx = self.contexts[cid] = self.by_n[self.serial] = _Context(cid, self.serial, Encoder(self.options.fmt))
        if ctx.closing:
            return Step(to_client=[self._error("context_closed", "this context was closed", cid)])
        step = Step()
        if text and text.strip():
            if ctx.ended:
                return Step(to_client=[self._error("context_closed", "text after this context's end", cid)])
            if self.open is not None and self.open is not ctx:
                step.extend(self._end(self.open))  # text for another context ends the open one
            if ctx.uid is None:
                self.uids += 1
                ctx.uid = self.uids
                self.by_uid[ctx.uid] = ctx
                step.to_session.append({"type": P.ClientType.TEXT_DELTA.value, "text": text, "id": f"open:{ctx.n}"})
            else:
                step.to_session.append({"type": P.ClientType.TEXT_DELTA.value, "text": text})
            ctx.alignment.add_text(text)
            self.open = ctx
            ctx.flushed = False
        if msg.get("flush") is True:
            # the end of a turn is a flush with no text (Pipecat: flush alone; LiveKit: {"text":
            # "", "flush": true}); a flush with text, then close_context, is LiveKit interrupting
            ctx.flushed = not (text and text.strip())
            if self.open is ctx:
                step.to_session.append({"type": P.ClientType.TEXT_FLUSH.value})
        if not step.to_session:  # a keep-alive (``{"text": ""}``) keeps the session from idling
            step.to_session.append({"type": P.ClientType.PING.value})
        return step

    def _end(self, ctx: _Context) -> Step:
        if self.open is ctx:
            self.open = None
        if ctx.ended:
            return Step()
        ctx.ended = True
        if ctx.uid is None:
            ctx.done = True
            return Step()
        return Step(to_session=[{"type": P.ClientType.TEXT_END.value}])

    def _close(self, ctx: _Context) -> Step:
        if ctx.final:
            return Step()
        if ctx.closing or not ctx.flushed:
            return self._barge(ctx)
        ctx.closing = True
        step = self._end(ctx)
        return step.extend(self._maybe_final(ctx))

    def _barge(self, ctx: _Context) -> Step:
        ctx.closing = ctx.barged = True
        if self.open is ctx:
            self.open = None
        ctx.ended = True
        if ctx.uid is None or ctx.done:
            ctx.done = True
            return self._maybe_final(ctx)
        return Step(to_session=[{"type": P.ClientType.CANCEL.value, "utterance_id": ctx.uid, "id": f"close:{ctx.n}"}])

    def _maybe_final(self, ctx: _Context) -> Step:
        if ctx.final or not (ctx.closing and ctx.done):
            return Step()
        ctx.final = True
        step = Step()
        tail = b"" if ctx.barged else ctx.encoder.flush()
        if tail:
            step.to_client.append(self._audio(ctx.cid, tail))
        step.to_client.append(_json({"isFinal": True, "contextId": ctx.cid}))
        self.contexts.pop(ctx.cid, None)
        self.by_n.pop(ctx.n, None)
        if ctx.uid is not None:
            self.by_uid.pop(ctx.uid, None)
        return step

    # ---- session -> client ------------------------------------------------------------------

    def _audio(self, cid: str, data: bytes) -> str:
        return _json({"audio": base64.b64encode(data).decode(), "isFinal": False, "contextId": cid,
                      "normalizedAlignment": None, "alignment": None})

    def on_server_audio(self, header: P.AudioFrameHeader, pcm16: bytes) -> Step:
        n = len(pcm16) // 2
        ctx = self.by_uid.get(header.utterance_id)
        if ctx is None or ctx.barged:
            return Step(delivered_samples=n)  # a context closed mid-way: dropped (flow credit all the same)
        data = ctx.encoder.encode(pcm16)
        return Step(to_client=[self._audio(ctx.cid, data)] if data else [], delivered_samples=n)

    def on_server_message(self, msg: P.ServerMessage) -> Step:
        step = Step()
        if isinstance(msg, P.SegmentStarted | P.SegmentDone):
            ctx = self.by_uid.get(msg.utterance_id)
            if ctx is not None and not ctx.barged:
                if isinstance(msg, P.SegmentStarted):
                    ctx.alignment.started(msg)
                else:
                    step.to_client += _alignment_message(ctx.alignment, ctx.encoder, msg, ctx.cid)
        elif isinstance(msg, P.UtteranceDone):
            ctx = self.by_uid.get(msg.utterance_id)
            if ctx is not None:
                ctx.done = True
                step.extend(self._maybe_final(ctx))
        elif isinstance(msg, P.Cancelled):
            mid = msg.id
            if isinstance(mid, str) and mid.startswith("close:") and mid[6:].isdigit():
                ctx = self.by_n.get(int(mid[6:]))
                if ctx is not None:
                    ctx.done = True
                    step.extend(self._maybe_final(ctx))
        elif isinstance(msg, P.ErrorMessage):
            mid = msg.id
            ctx = None
            if isinstance(mid, str) and mid.startswith("open:") and mid[5:].isdigit():
                ctx = self.by_n.get(int(mid[5:]))
                if ctx is not None and ctx.uid == self.uids:  # its utterance never opened
                    self.by_uid.pop(ctx.uid, None)
                    self.uids -= 1
                    ctx.uid = None
                    ctx.done = ctx.ended
            elif msg.utterance_id is not None:
                ctx = self.by_uid.get(msg.utterance_id)
            step.to_client.append(self._error(msg.code.value, msg.message, ctx.cid if ctx is not None else None))
            if msg.fatal:
                step.close = (P.CloseCode.INTERNAL_ERROR, "")
            if ctx is not None:
                step.extend(self._maybe_final(ctx))
        return step

    def on_server_close(self, code: int, reason: str) -> Step:
        if reason == P.CloseReason.IDLE.value:
            return _idle_close(self.options, {})
        return Step(close=(code, reason))


# ---- HTTP: ``POST /v1/text-to-speech/{voice_id}[/stream][/with-timestamps]`` ---------------------

HTTP_PATH_RE: Final = re.compile(r"^/v1/text-to-speech/([^/]+)(/stream)?(/with-timestamps)?$")


class ElevenLabsError(VendorError):
    """ElevenLabs' error shape: ``{"detail": {"status", "message"}}``."""

    vendor = "elevenlabs"

    def body(self) -> bytes:
        return orjson.dumps({"detail": {"status": self.code, "message": self.message}})


def parse_http(path: str, query: str, raw: bytes, max_chars: int, request_id: str = "") -> AudioRequest:
    """``POST /v1/text-to-speech/{voice_id}[/stream]``; raises ElevenLabsError. The response
    carries ElevenLabs' ``request-id`` (``request_id``: the gateway's ``x-request-id``),
    ``character-cost`` (characters billed: the text's length) and ``history-item-id``."""
    m = HTTP_PATH_RE.match(path)
    if m is None:
        raise ElevenLabsError(404, "not_found", "not found")
    voice_id = unquote(m.group(1))
    try:
        if len(voice_id) > MAX_VOICE_ID_CHARS:
            raise voices.UnknownVoice(voice_id)
        speaker = voices.elevenlabs_voice(voice_id)
    except voices.UnknownVoice:
        raise ElevenLabsError(404, "voice_not_found", f"A voice with the voice_id "
                              f"{shown_voice_id(voice_id)} was not found.") from None
    q = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
    fmt_name = q.get("output_format") or "mp3_44100_128"
    served = served_formats(http=True)
    fmt = served.get(fmt_name)
    if fmt is None:
        raise ElevenLabsError(400, "invalid_output_format", f"output_format {fmt_name} is not supported by this "
                              f"server; use one of {', '.join(served)}")
    obj, text = body_json(raw, ElevenLabsError, max_chars)
    problem = check_voice_settings(obj.get("voice_settings"))
    if problem:
        raise ElevenLabsError(422, "invalid_voice_settings", problem)
    seed = obj.get("seed")
    if seed is not None:
        try:
            seed = parse_int(seed, "seed", 0, MAX_SEED)
        except FieldError as exc:
            raise ElevenLabsError(422, "invalid_seed", exc.message) from None
    language = obj.get("language_code")
    if language is not None and (not isinstance(language, str) or not re.fullmatch(r"[A-Za-z0-9-]{1,16}", language)):
        raise ElevenLabsError(422, "invalid_language_code", "language_code must be a language tag")
    return AudioRequest(text, speaker, fmt, ElevenLabsError, language, None if seed is None else seed % 2**31,
                        timestamps=m.group(3) is not None, stream=m.group(2) is not None,
                        wav=fmt_name in WAV_FORMATS,
                        headers=(("request-id", request_id or uuid.uuid4().hex), ("character-cost", str(len(text))),
                                 ("history-item-id", secrets.token_hex(10))))


MAX_LINE_AUDIO_BYTES: Final = 65_536
"""``/stream/with-timestamps``: most audio bytes in one JSON line (~1.4 s of 24 kHz PCM)."""


HELD_BYTES: Final = 2
"""``/stream/with-timestamps``: the last bytes of the audio so far are held back (one 16-bit sample)
so that the line with a segment's alignment carries audio, as the vendor's lines do."""


class TimestampsResponder(AudioResponder):
    """``with-timestamps``: JSON with base64 audio and character ``alignment``, one object at the
    end; or (``/stream``) JSON lines as the audio arrives: audio lines (``alignment`` null) as each
    piece of audio comes from the engine, and when a segment's audio is complete a line with the
    segment's character times (times from the start of the answer, as the vendor's), carrying the
    audio not sent yet (at least ``HELD_BYTES``). The first audio leaves with the engine's first
    chunk, not after the whole first segment."""

    def __init__(self, req: AudioRequest) -> None:
        # the WAV header goes at the start of the (base64) audio, not before the JSON
        super().__init__(dataclasses.replace(req, wav=False))
        self._alignment_of = Alignment()
        self._alignment_of.add_text(self.req.text)
        """Characters of the text before this are aligned (gaps: spaces, unspoken marks)."""
        self._seg_audio = bytearray(wav_stream_header(req.fmt.rate_hz) if req.wav else b"")
        self._t_ms = 0.0
        self._chars: list[str] = []
        self._starts_s: list[float] = []
        self._ends_s: list[float] = []
        self._audio = bytearray()

    def _content_type(self) -> str:
        return "application/json"

    def _on_audio(self, pcm16: bytes) -> list[HttpOut]:
        self._seg_audio += self.encoder.encode(pcm16)
        if not self.req.stream or len(self._seg_audio) <= HELD_BYTES:
            return []
        audio = bytes(self._seg_audio[:-HELD_BYTES])
        del self._seg_audio[:-HELD_BYTES]
        return self._head() + self._lines(audio, None)

    def _lines(self, audio: bytes, alignment: tuple[list[str], list[float], list[float]] | None) -> list[HttpOut]:
        """JSON lines for ``audio`` (at most ``MAX_LINE_AUDIO_BYTES`` each: clients read a line into
        a bounded buffer; aiohttp's default is 512 KiB, Pipecat's ElevenLabsHttpTTSService uses it),
        the last one carrying ``alignment`` (an alignment-only line when there is no audio)."""
        pieces = [audio[i:i + MAX_LINE_AUDIO_BYTES] for i in range(0, len(audio), MAX_LINE_AUDIO_BYTES)]
        out: list[HttpOut] = []
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            al = self._alignment(*alignment) if last and alignment is not None else {"alignment": None,
                                                                                    "normalized_alignment": None}
            out.append(Body(orjson.dumps({"audio_base64": base64.b64encode(piece).decode(), **al}) + b"\n"))
        if not pieces and alignment is not None:
            out.append(Body(orjson.dumps(self._alignment(*alignment)) + b"\n"))
        return out

    def _segment(self, msg: P.SegmentStarted | P.SegmentDone) -> list[HttpOut]:
        if isinstance(msg, P.SegmentStarted):
            self._alignment_of.started(msg)
            return []
        return self._segment_done(msg.samples)

    def _alignment(self, chars: list[str], starts: list[float], ends: list[float]) -> dict[str, Any]:
        a = {"characters": chars, "character_start_times_seconds": starts, "character_end_times_seconds": ends}
        return {"alignment": a, "normalized_alignment": a}

    def _segment_done(self, samples: int) -> list[HttpOut]:
        """A segment's audio is complete: its characters' times (an estimate within the segment,
        ``segmenter.char_timings``), in a JSON line with the audio not sent yet when streaming."""
        dur_ms = samples * 1000.0 / self.req.fmt.session_rate_hz
        chars, starts, durs, _ = self._alignment_of.done_ms(samples, self.req.fmt.session_rate_hz) or ([], [], [], 0)
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
        if not chars and not audio:
            return []
        return self._head() + self._lines(audio, (chars, s0, e0))

    def _complete(self, tail: bytes) -> list[HttpOut]:
        out: list[HttpOut] = []
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
        return out


def http_responder(req: AudioRequest) -> AudioResponder:
    """The responder for a parsed request: ``with-timestamps`` JSON, or the audio itself."""
    return TimestampsResponder(req) if req.timestamps else AudioResponder(req)

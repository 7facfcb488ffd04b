"""Async Python client for the voicegw protocol v1 (see docs/protocol.md and docs/clients.md).

::

    async with Client("ws://127.0.0.1:8765/ws", voice=2222) as c:
        async for chunk in c.speak(llm_tokens):      # str, or a sync/async iterable of str
            sink.write(chunk.pcm)                    # PCM16 LE mono at c.sample_rate_hz
        await c.cancel()                             # barge-in

Text goes out as it arrives (one ``text.delta`` per piece); audio chunks come back while text is
still being sent. Playback accounting (``playback=``) decides what the server is told about
the playhead, which drives its flow control:

* ``"realtime"`` (default): a simulated device plays the audio in real time with the browser
  worklet's rules (prebuffer, underruns, adaptive target; ``clients/python/playout.py``) and
  ``playback`` reports go out every 250 ms and at drain, like the browser client.
* ``"speakers"``: the same, driven by a real sound card through ``sounddevice`` (optional
  dependency); falls back to ``"realtime"`` with a warning when it is not importable.
* ``"instant"``: a recorder. A chunk counts as played when your code takes it from ``speak()``,
  so the server sends as fast as the engine produces and as fast as you consume.
* ``"none"``: no reports (the server then assumes real-time playback from the first audio).

Every buffer is bounded: the server never runs more than its flow window (2 s by default) ahead
of the reported playhead; the per-utterance chunk queue keeps at most ``max_queued_chunk_s``
seconds (oldest chunks dropped and counted when nobody iterates).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import orjson
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from clients.python.playout import Playout
from gateway import protocol as P

log = logging.getLogger("voicegw.client")

PlaybackMode = Literal["realtime", "speakers", "instant", "none"]
TextSource = str | Iterable[str] | AsyncIterable[str]

_TICK_S = 0.01
_CANCEL_REPLY_TIMEOUT_S = 5.0


class VoicegwError(Exception):
    """A refusal or failure reported by the gateway (``code`` from the protocol's error codes,
    or ``handshake_failed`` / ``closed`` / ``timeout`` on the client side)."""

    def __init__(self, code: str, message: str = "", detail: dict[str, Any] | None = None) -> None:
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.message = message
        self.detail = detail or {}


class UtteranceFailed(VoicegwError):
    """The utterance ended with ``status: error`` (engine_error, engine_overloaded ...)."""


def ws_url(url: str) -> str:
    """Normalise a gateway address: http(s) -> ws(s); an empty path becomes the protocol's ``/ws``."""
    parts = urlsplit(url if "://" in url else f"ws://{url}")
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    path = parts.path if parts.path not in ("", "/") else P.WS_PATH
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))


def normalize_voice(voice: str | int | None) -> str | int | None:
    """CLI voices arrive as strings: an all-digit string is a seed (int)."""
    if isinstance(voice, str):
        v = voice.strip()
        if v == "":
            return None
        if v.isdigit():
            return int(v)
        return v
    return voice


@dataclass(frozen=True)
class AudioChunk:
    """One audio frame from the gateway, always PCM16 LE mono (mu-law is decoded)."""

    utterance_id: int
    segment: int
    seq: int
    sample_offset: int
    """First sample of this chunk within its utterance."""
    pcm: bytes
    sample_rate_hz: int

    @property
    def samples(self) -> int:
        return len(self.pcm) // 2


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


_END = object()


class Utterance:
    """One spoken utterance: async-iterate it for audio chunks; ``stats`` when done."""

    def __init__(self, client: Client, local_id: str) -> None:
        self._client = client
        self.local_id = local_id
        self.id: int | None = None
        self.stats = UtteranceStats(sample_rate_hz=client.sample_rate_hz)
        self.chars = 0
        self.cancelling = False
        self.t_first_text: float | None = None
        self.t_first_audio: float | None = None
        self.end_pos: int | None = None
        """Playout position (samples written) at ``utterance.done``."""
        self.underruns_at_start = 0
        self._queue: deque[AudioChunk | object] = deque()
        self._queued_samples = 0
        self._wake = asyncio.Event()
        self.done = asyncio.Event()
        """All audio received (or the utterance ended otherwise)."""
        self.played = asyncio.Event()
        """Playback finished (or there is no playback to wait for)."""
        self.failure: VoicegwError | None = None
        self.sender: asyncio.Task[None] | None = None

    # -- producer side (client internals)

    def _put(self, chunk: AudioChunk) -> None:
        limit = int(self._client.max_queued_chunk_s * chunk.sample_rate_hz)
        self._queue.append(chunk)
        self._queued_samples += chunk.samples
        while self._queued_samples > limit and len(self._queue) > 1:
            old = self._queue.popleft()
            if isinstance(old, AudioChunk):
                self._queued_samples -= old.samples
                self.stats.chunks_dropped += 1
        self._wake.set()

    def _drop_queued(self) -> None:
        kept = [x for x in self._queue if not isinstance(x, AudioChunk)]
        self._queue.clear()
        self._queue.extend(kept)
        self._queued_samples = 0

    def _finish(self, failure: VoicegwError | None = None) -> None:
        if self.done.is_set():
            return
        self.failure = failure
        if self.stats.status == "pending":
            self.stats.status = "error" if failure else "ok"
        self._queue.append(_END)
        self._wake.set()
        self.done.set()

    # -- consumer side

    def __aiter__(self) -> AsyncIterator[AudioChunk]:
        return self

    async def __anext__(self) -> AudioChunk:
        while not self._queue:
            self._wake.clear()
            await self._wake.wait()
        item = self._queue[0]
        if item is _END:
            if self.failure is not None:
                raise self.failure
            raise StopAsyncIteration
        self._queue.popleft()
        assert isinstance(item, AudioChunk)
        self._queued_samples -= item.samples
        self._client._on_consumed(item)
        return item

    async def collect(self) -> bytes:
        """All PCM of the utterance (waits until all audio is received)."""
        return b"".join([c.pcm async for c in self])

    async def wait_played(self) -> UtteranceStats:
        """Wait until the audio has been played out (realtime/speakers) or received (other modes).
        Wrap in ``asyncio.timeout`` to bound the wait."""
        await self.done.wait()
        await self.played.wait()
        if self.failure is not None:
            raise self.failure
        return self.stats


class Client:
    """One gateway session. Use as ``async with Client(url) as c``."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        voice: str | int | None = None,
        sample_rate_hz: int = P.DEFAULT_SAMPLE_RATE_HZ,
        *,
        format: str = "pcm16",
        language: str | None = None,
        options: dict[str, Any] | None = None,
        playback: PlaybackMode = "realtime",
        prebuffer_ms: float = 80.0,
        report_interval_ms: float = 250.0,
        max_queued_chunk_s: float = 60.0,
        open_timeout_s: float = 10.0,
    ) -> None:
        if sample_rate_hz not in P.SUPPORTED_SAMPLE_RATES_HZ:
            raise ValueError(f"sample_rate_hz must be one of {P.SUPPORTED_SAMPLE_RATES_HZ}")
        self.url = ws_url(url)
        self.token = token
        self.voice = normalize_voice(voice)
        self.sample_rate_hz = sample_rate_hz
        self.format = P.AudioFormat(format)
        self.language = language
        self.options = options
        self.playback_mode: PlaybackMode = playback
        self.report_interval_s = report_interval_ms / 1000.0
        self.max_queued_chunk_s = max_queued_chunk_s
        self.open_timeout_s = open_timeout_s
        self.playout = Playout(sample_rate_hz, prebuffer_ms=prebuffer_ms)
        self.session: dict[str, Any] | None = None
        self.ws: ClientConnection | None = None
        self.closed = False
        self.close_code: int | None = None
        self.errors: list[dict[str, Any]] = []
        """Every ``error`` message received."""
        self.received_samples = 0
        self.consumed_samples = 0
        """Samples taken from ``speak()`` iterators (the played counter in ``instant`` mode)."""
        self.dropped_frames = 0
        """Audio frames discarded because they belonged to a cancelled utterance."""
        self.reports_sent = 0
        self.output_latency_ms = 0.0
        self._utterances: list[Utterance] = []
        self._by_id: dict[int, Utterance] = {}
        self._max_id = 0
        self._local_seq = 0
        self._open: Utterance | None = None
        self._send_lock = asyncio.Lock()
        self._cancel_replies: deque[asyncio.Future[dict[str, Any]]] = deque()
        """cancel() calls awaiting the server's ``cancelled`` (FIFO); audio is dropped meanwhile."""
        self._session_waiter: asyncio.Future[dict[str, Any]] | None = None
        self._pong_waiters: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        self._lock = threading.Lock()  # playout + speaker FIFO (the sound card thread uses them)
        self._fifo = bytearray()  # speakers mode: PCM waiting for the sound card
        self._stream: Any = None
        self._last_report_s = 0.0
        self._last_instant_report = -1
        self._drain_pending = False

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Client:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> dict[str, Any]:
        """Open the socket and start the session; returns ``session.started``."""
        subprotocols = [P.SUBPROTOCOL]
        headers = {}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        try:
            self.ws = await connect(
                self.url,
                subprotocols=subprotocols,  # type: ignore[arg-type]
                additional_headers=headers,
                compression=None,
                open_timeout=self.open_timeout_s,
                close_timeout=2.0,
                max_queue=64,
            )
        except InvalidStatus as exc:
            status = exc.response.status_code
            body = exc.response.body.decode(errors="replace").strip() if exc.response.body else ""
            raise VoicegwError("handshake_failed", f"HTTP {status} {body}".strip(), {"status": status}) from None
        except (OSError, TimeoutError) as exc:
            raise VoicegwError("handshake_failed", f"cannot connect to {self.url}: {exc}") from None
        loop = asyncio.get_running_loop()
        self._session_waiter = loop.create_future()
        self._tasks.append(asyncio.create_task(self._reader(), name="voicegw-client-reader"))
        start: dict[str, Any] = {
            "type": P.ClientType.SESSION_START.value,
            "sample_rate": self.sample_rate_hz,
            "format": self.format.value,
        }
        if self.voice is not None:
            start["voice"] = self.voice
        if self.language:
            start["language"] = self.language
        if self.options:
            start["options"] = self.options
        await self._send(start)
        async with asyncio.timeout(self.open_timeout_s):
            self.session = await self._session_waiter
        self._start_playback()
        return self.session

    async def close(self) -> None:
        if self.closed and self.ws is None:
            return
        self.closed = True
        for t in self._tasks:
            if t is not asyncio.current_task():
                t.cancel()
        for u in list(self._utterances):
            if u.sender is not None:
                u.sender.cancel()
        if self.ws is not None:
            with contextlib.suppress(Exception):
                await self.ws.close()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        self._tasks.clear()
        self._stop_speakers()
        self._fail_all(VoicegwError("closed", "client closed"))
        self.ws = None

    # ------------------------------------------------------------------ text in

    def speak(self, source: TextSource) -> Utterance:
        """Stream ``source`` (a string or a sync/async iterable of text pieces) as one utterance.

        Returns at once; iterate the result for audio chunks (the text keeps streaming meanwhile).
        """
        self._check_open()
        u = self._new_utterance()
        u.sender = asyncio.create_task(self._send_utterance(u, source), name=f"voicegw-send {u.local_id}")
        return u

    async def send_text(self, text: str) -> Utterance:
        """Low level: send one ``text.delta`` (opens an utterance when none is open)."""
        self._check_open()
        async with self._send_lock:
            if self._open is None:
                self._open = self._new_utterance()
            u = self._open
            await self._send_delta(u, text)
            return u

    async def flush(self) -> None:
        async with self._send_lock:
            if self._open is not None:
                await self._send({"type": P.ClientType.TEXT_FLUSH.value})

    async def end(self) -> Utterance | None:
        """Low level: ``text.end`` for the utterance opened by ``send_text``."""
        async with self._send_lock:
            u, self._open = self._open, None
            if u is None:
                return None
            await self._send({"type": P.ClientType.TEXT_END.value})
            if u.chars == 0:
                self._settle_empty(u)
            return u

    async def cancel(self) -> dict[str, Any] | None:
        """Barge-in: silence now, drop audio in flight, stop every queued utterance.
        Returns the server's ``cancelled`` message."""
        if self.ws is None or self.closed:
            return None
        for u in self._utterances:
            u.cancelling = True
            if u.sender is not None and not u.sender.done():
                u.sender.cancel()
            u._drop_queued()  # audio not yet taken from speak() was cancelled too
        self._open = None
        reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._cancel_replies.append(reply)
        played: int | None
        if self.playback_mode in ("realtime", "speakers"):
            with self._lock:
                played = self.playout.cancel()
                self._fifo.clear()
        elif self.playback_mode == "instant":
            played = self.consumed_samples
        else:
            played = None
        msg: dict[str, Any] = {"type": P.ClientType.CANCEL.value}
        if played is not None:
            msg["played_samples"] = played
        await self._send(msg)
        try:
            async with asyncio.timeout(_CANCEL_REPLY_TIMEOUT_S):
                return await reply
        except TimeoutError:
            raise VoicegwError("timeout", "no reply to cancel") from None

    async def ping(self) -> float:
        """Application-level round trip, in ms."""
        pid = f"p{time.monotonic_ns()}"
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pong_waiters[pid] = fut
        t0 = time.perf_counter()
        await self._send({"type": P.ClientType.PING.value, "id": pid})
        async with asyncio.timeout(5):
            await fut
        return (time.perf_counter() - t0) * 1000.0

    # ------------------------------------------------------------------ internals: sending

    def _check_open(self) -> None:
        if self.ws is None or self.closed:
            raise VoicegwError("closed", "not connected")

    def _new_utterance(self) -> Utterance:
        self._local_seq += 1
        u = Utterance(self, f"u{self._local_seq}")
        self._utterances.append(u)
        return u

    async def _send(self, obj: dict[str, Any]) -> None:
        if self.ws is None:
            raise VoicegwError("closed", "not connected")
        try:
            await self.ws.send(orjson.dumps(obj).decode())
        except ConnectionClosed as exc:
            raise VoicegwError("closed", f"connection closed ({exc})") from None

    async def _send_delta(self, u: Utterance, text: str) -> None:
        if not text or u.cancelling:
            return
        msg: dict[str, Any] = {"type": P.ClientType.TEXT_DELTA.value, "text": text}
        if u.chars == 0:
            msg["id"] = u.local_id
        if u.t_first_text is None:
            u.t_first_text = time.perf_counter()
        u.chars += len(text)
        await self._send(msg)

    async def _send_utterance(self, u: Utterance, source: TextSource) -> None:
        try:
            async with self._send_lock:  # one utterance's text at a time, in order
                if self._open is not None:  # a send_text() utterance is open: it goes first
                    await self._send({"type": P.ClientType.TEXT_END.value})
                    if self._open.chars == 0:
                        self._settle_empty(self._open)
                    self._open = None
                async for piece in _aiter_text(source):
                    if u.cancelling or self.closed:
                        return
                    await self._send_delta(u, piece)
                if u.cancelling:
                    return
                await self._send({"type": P.ClientType.TEXT_END.value})
                if u.chars == 0:
                    self._settle_empty(u)
        except asyncio.CancelledError:
            raise
        except VoicegwError as exc:
            u._finish(exc)
        except Exception as exc:  # the token source failed: stop what was started
            log.warning("text source failed: %r; cancelling the utterance", exc)
            u._finish(VoicegwError("source_failed", repr(exc)))
            if u.chars > 0 and not self.closed:
                with contextlib.suppress(VoicegwError):
                    await self.cancel()

    def _settle_empty(self, u: Utterance) -> None:
        u.stats.status = "empty"
        u._finish()
        u.played.set()
        self._forget(u)

    # ------------------------------------------------------------------ internals: receiving

    def _record(self, uid: int) -> Utterance | None:
        u = self._by_id.get(uid)
        if u is None and uid > self._max_id:
            for cand in self._utterances:
                if cand.id is None and cand.chars > 0 and not cand.done.is_set():
                    cand.id = uid
                    cand.stats.utterance_id = uid
                    self._max_id = uid
                    self._by_id[uid] = cand
                    return cand
        return u

    async def _reader(self) -> None:
        assert self.ws is not None
        try:
            async for m in self.ws:
                if isinstance(m, bytes):
                    self._on_audio(m)
                else:
                    await self._on_message(orjson.loads(m))
        except ConnectionClosed:
            pass
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("client reader failed")
        finally:
            self.close_code = self.ws.close_code if self.ws is not None else None
            reason = self.ws.close_reason if self.ws is not None else ""
            self.closed = True
            err = VoicegwError("closed", f"connection closed {self.close_code} {reason or ''}".strip(),
                               {"code": self.close_code, "reason": reason})
            if self._session_waiter is not None and not self._session_waiter.done():
                self._session_waiter.set_exception(err)
            while self._cancel_replies:
                fut = self._cancel_replies.popleft()
                if not fut.done():
                    fut.set_exception(err)
            self._fail_all(err, keep_received=True)

    def _fail_all(self, err: VoicegwError, keep_received: bool = False) -> None:
        for u in list(self._utterances):
            if not (keep_received and u.done.is_set()):
                u._finish(err)  # fully received utterances keep their audio and status
            u.played.set()
            self._forget(u)

    def _on_audio(self, data: bytes) -> None:
        if self._cancel_replies:
            self.dropped_frames += 1
            return
        try:
            header, payload = P.unpack_audio_frame(data)
        except ValueError:
            log.warning("malformed audio frame (%d bytes)", len(data))
            return
        if header.format is P.AudioFormat.MULAW:
            from gateway.audio import mulaw_decode

            payload = mulaw_decode(payload).astype("<i2").tobytes()
        chunk = AudioChunk(
            utterance_id=header.utterance_id,
            segment=header.segment,
            seq=header.seq,
            sample_offset=header.sample_offset,
            pcm=payload,
            sample_rate_hz=self.sample_rate_hz,
        )
        n = chunk.samples
        self.received_samples += n
        u = self._record(header.utterance_id)
        if u is not None:
            if u.t_first_audio is None:
                u.t_first_audio = time.perf_counter()
                u.underruns_at_start = self.playout.underruns
                if u.t_first_text is not None:
                    u.stats.ttfa_ms = (u.t_first_audio - u.t_first_text) * 1000.0
            u.stats.samples += n
            u._put(chunk)
        if self.playback_mode in ("realtime", "speakers"):
            with self._lock:
                self.playout.push(n)
                if self.playback_mode == "speakers":
                    self._fifo += payload

    async def _on_message(self, msg: dict[str, Any]) -> None:
        t = msg.get("type")
        if t == P.ServerType.SESSION_STARTED:
            if self._session_waiter is not None and not self._session_waiter.done():
                self._session_waiter.set_result(msg)
        elif t == P.ServerType.SEGMENT_STARTED:
            u = self._record(int(msg["utterance_id"]))
            if u is not None and not self._cancel_replies:
                u.stats.segments.append(str(msg.get("text", "")))
        elif t == P.ServerType.UTTERANCE_DONE:
            u = self._record(int(msg["utterance_id"]))
            if u is not None and not u.done.is_set():
                u.stats.server_samples = int(msg.get("samples", 0))
                if u.t_first_text is not None:
                    u.stats.wall_ms = (time.perf_counter() - u.t_first_text) * 1000.0
                failure = None
                if msg.get("status") != P.UtteranceStatus.OK:
                    u.stats.error = str(msg.get("error") or u.stats.error or "error")
                    failure = UtteranceFailed(u.stats.error, "utterance failed", msg)
                with self._lock:
                    self.playout.end()
                    u.end_pos = self.playout.written
                u._finish(failure)
                self._check_played()
        elif t == P.ServerType.CANCELLED:
            ids = set(msg.get("cancelled_utterances") or [])
            if msg.get("utterance_id") is not None:
                ids.add(msg["utterance_id"])
            for u in list(self._utterances):
                if u.cancelling or (u.id is not None and u.id in ids):
                    u.stats.cancelled = True
                    u.stats.status = "cancelled"
                    if u.id is not None and u.id == msg.get("utterance_id"):
                        u.stats.heard_text = msg.get("heard_text")
                    u._finish()
                    u.played.set()
                    self._forget(u)
            if self._cancel_replies:
                waiter = self._cancel_replies.popleft()
                if not waiter.done():
                    waiter.set_result(msg)
        elif t == P.ServerType.ERROR:
            self.errors.append(msg)
            log.info("gateway error %s: %s", msg.get("code"), msg.get("message"))
            code = str(msg.get("code"))
            if msg.get("utterance_id") is not None:
                u = self._record(int(msg["utterance_id"]))
                if u is not None:
                    u.stats.error = code
            elif msg.get("id") is not None:
                u2 = next((x for x in self._utterances if x.local_id == msg["id"] and x.id is None), None)
                if u2 is not None and u2.stats.samples == 0:
                    # the opening delta was refused: this utterance never opened on the server
                    u2.chars = 0
                    u2.cancelling = True  # its sender stops
                    if self._open is u2:
                        self._open = None
                    u2.stats.error = code
                    u2._finish(VoicegwError(code, str(msg.get("message", "")), msg))
                    u2.played.set()
                    self._forget(u2)
            if msg.get("fatal") and self._session_waiter is not None and not self._session_waiter.done():
                self._session_waiter.set_exception(VoicegwError(code, str(msg.get("message", "")), msg))
        elif t == P.ServerType.PONG:
            fut = self._pong_waiters.pop(str(msg.get("id")), None)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def _forget(self, u: Utterance) -> None:
        with contextlib.suppress(ValueError):
            self._utterances.remove(u)
        if u.id is not None:
            self._by_id.pop(u.id, None)

    # ------------------------------------------------------------------ internals: playback

    def _on_consumed(self, chunk: AudioChunk) -> None:
        self.consumed_samples += chunk.samples
        if self.playback_mode == "instant" and not self.closed:
            task = asyncio.create_task(self._instant_report())
            self._tasks.append(task)
            task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    async def _instant_report(self) -> None:
        # coalesce: one report per event-loop turn at most
        await asyncio.sleep(0)
        if self.consumed_samples == self._last_instant_report or self.closed:
            return
        self._last_instant_report = self.consumed_samples
        with contextlib.suppress(VoicegwError):
            await self._send_report(self.consumed_samples, 0.0, 0, drained=False)

    def _start_playback(self) -> None:
        if self.playback_mode == "speakers" and not self._start_speakers():
            log.warning("sounddevice is not usable: simulating real-time playback instead")
            self.playback_mode = "realtime"
        if self.playback_mode in ("realtime", "speakers"):
            self._tasks.append(asyncio.create_task(self._playback_loop(), name="voicegw-client-playback"))

    def _start_speakers(self) -> bool:
        try:
            import sounddevice  # type: ignore[import-not-found]
        except Exception:  # not installed, or PortAudio missing
            return False
        loop = asyncio.get_running_loop()

        def callback(outdata: Any, frames: int, time_info: Any, status: Any) -> None:
            with self._lock:
                k, drained = self.playout.pull(frames)
                data = bytes(self._fifo[: 2 * k])
                del self._fifo[: 2 * k]
            outdata[: len(data)] = data
            outdata[len(data) :] = b"\0" * (len(outdata) - len(data))
            if drained:
                loop.call_soon_threadsafe(self._on_drained)

        try:
            self._stream = sounddevice.RawOutputStream(
                samplerate=self.sample_rate_hz, channels=1, dtype="int16", latency="low", callback=callback
            )
            self._stream.start()
            self.output_latency_ms = float(getattr(self._stream, "latency", 0.0) or 0.0) * 1000.0
        except Exception as exc:
            log.warning("cannot open the sound card: %s", exc)
            self._stream = None
            return False
        return True

    def _stop_speakers(self) -> None:
        if self._stream is not None:
            with contextlib.suppress(Exception):
                self._stream.stop()
                self._stream.close()
            self._stream = None

    def _on_drained(self) -> None:
        self._drain_pending = True
        self._check_played()

    async def _playback_loop(self) -> None:
        """Simulated device clock (realtime) and the report ticker (realtime and speakers)."""
        loop = asyncio.get_running_loop()
        t_last = loop.time()
        carry = 0.0
        played_before = 0
        self._last_report_s = t_last
        while not self.closed:
            await asyncio.sleep(_TICK_S)
            now = loop.time()
            drained = False
            if self.playback_mode == "realtime":
                carry += (now - t_last) * self.sample_rate_hz
                n = int(carry)
                carry -= n
                with self._lock:
                    _, drained = self.playout.pull(n)
            t_last = now
            if self._drain_pending:
                drained, self._drain_pending = True, False
            with self._lock:
                state = self.playout.state
                rep = self.playout.report(drained)
                played_now = self.playout.played
            if played_now > played_before:
                self._note_play_start()
            played_before = played_now
            if drained or (state != "idle" and now - self._last_report_s >= self.report_interval_s):
                self._last_report_s = now
                try:
                    await self._send_report(rep.played_samples, rep.buffered_ms, rep.underruns, drained)
                except VoicegwError:
                    return
            self._check_played()

    def _note_play_start(self) -> None:
        for u in self._utterances:
            if u.t_first_audio is not None and u.stats.play_start_ms is None:
                if u.t_first_text is not None:
                    u.stats.play_start_ms = (time.perf_counter() - u.t_first_text) * 1000.0
                return

    async def _send_report(self, played: int, buffered_ms: float, underruns: int, drained: bool) -> None:
        await self._send({
            "type": P.ClientType.PLAYBACK.value,
            "played_samples": played,
            "buffered_ms": round(max(0.0, buffered_ms), 1),
            "underruns": underruns,
            "output_latency_ms": round(min(60_000.0, self.output_latency_ms), 1),
        })
        self.reports_sent += 1

    def _check_played(self) -> None:
        """Mark utterances whose audio has been played out."""
        with self._lock:
            consumed = self.playout.read
            underruns = self.playout.underruns
        for u in list(self._utterances):
            if not u.done.is_set():
                continue
            if self.playback_mode not in ("realtime", "speakers") or (
                u.end_pos is not None and consumed >= u.end_pos
            ):
                if u.t_first_audio is not None:
                    u.stats.underruns = underruns - u.underruns_at_start
                u.played.set()
                self._forget(u)


async def _aiter_text(source: TextSource) -> AsyncIterator[str]:
    if isinstance(source, str):
        yield source
    elif isinstance(source, AsyncIterable):
        async for piece in source:
            yield str(piece)
    else:
        for piece in source:
            yield str(piece)
            await asyncio.sleep(0)

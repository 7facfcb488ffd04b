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

Riding out a bad minute (``retry=RetryPolicy(...)``, on by default):

* **Overload.** An utterance refused with ``engine_overloaded`` before any of its audio arrived is
  sent again after the server's ``retry_after_ms`` (jittered, capped), up to
  ``overload_attempts`` in all; ``stats.attempts`` says how many it took. An utterance that had
  audio fails (heard audio is never replayed).
* **Reconnect and resume.** When the connection drops (no close frame, 1011, 1012, 1013) the client
  reconnects with exponential backoff and jitter for up to ``reconnect_timeout_s``, starts a new
  session with the same settings and sends each unfinished utterance again from its first segment
  not wholly received, going on at that segment's next sample where the server can
  (``session.started``'s ``resume``: ``codes``, kept from ``segment.codes``, or ``samples``): all
  audio received plays on from the local buffer meanwhile and nothing is heard twice. Otherwise
  the rest of the interrupted segment is dropped and it restarts from its first word. Text the
  application streams during the outage is kept (``max_buffered_chars``) and
  sent after. Chunks of a resumed utterance keep its segment numbers and sample offsets.
  ``events`` (and ``on_event``) report ``disconnected``, ``reconnecting``, ``reconnected``,
  ``resumed``, ``retry`` and ``gave_up``; ``stats.plays`` says which audio of which segment played.

The decisions are ``clients.python.core``'s (sans I/O: the session's utterances and what the
server's messages do to them, overload retry, reconnect, resume planning, playout accounting);
this module is the asyncio shell that carries them out (sockets, tasks, timers, the sound card).

Seeing the wire (``recorder=``, ``ClientRecorder`` below): a ``ClientRecorder`` is told
every message and audio frame as it is received, with its ``time.monotonic()`` receipt time
(the load generator records its sessions this way). An application that plays the audio
itself uses ``playback="none"`` and reports its playhead with ``send_playback`` (and
``cancel(played_samples=...)``); ``max_queued_chunk_s=0`` keeps no audio for ``speak()``
iterators (the recorder has it; in ``instant`` mode it then counts as played on arrival).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import orjson
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from clients.python import core
from clients.python.core import NO_RETRY as NO_RETRY
from clients.python.core import RetryPolicy, Segment
from clients.python.core import SegmentPlay as SegmentPlay
from clients.python.core import UtteranceStats as UtteranceStats
from clients.python.playout import Playout
from gateway import protocol as P

log = logging.getLogger("voicegw.client")

class ClientRecorder:
    """The ``Client``'s recorder hook: an observer of what the gateway sends, with receipt times.

    ::

        class Times(ClientRecorder):
            def on_audio(self, utterance, header, payload, t):
                self.first_audio = getattr(self, "first_audio", None) or t

        async with Client(url, recorder=Times()) as c: ...

    Subclass ``ClientRecorder`` and override what you need (every method is a no-op here). The
    client calls it synchronously from its reader, in wire order, *before* acting on the message
    itself, with ``t = time.monotonic()`` taken once per WebSocket message as it is received
    (CLOCK_MONOTONIC: comparable across processes of one machine). ``msg`` is the decoded JSON
    message as received (do not modify it); ``header`` and ``payload`` are the audio frame as
    received (the payload still mu-law in a ``mulaw`` session). ``utterance`` is the client's
    ``Utterance`` the message belongs to, or None when the client has none for it (frames of a
    cancelled utterance arriving after its ``cancelled``, an utterance already played and
    forgotten): keep your own map from ``header.utterance_id`` / ``msg["utterance_id"]`` when
    late arrivals matter. Callbacks must be quick (they run on the receive path); an exception
    from one is logged and otherwise ignored.

    The load generator (``loadtest/client.py``) records its sessions through this hook; tests
    use it to see the wire (``tests/transcript.py``). A client without a recorder reads no clock
    and makes no calls for it.
    """

    def on_session_started(self, msg: dict[str, Any], t: float) -> None:
        """``session.started`` (again after each reconnect)."""

    def on_segment_started(self, utterance: Utterance | None, msg: dict[str, Any], t: float) -> None:
        """``segment.started``: ``segment``, ``text``, ``start_char``/``end_char`` ..."""

    def on_segment_done(self, utterance: Utterance | None, msg: dict[str, Any], t: float) -> None:
        """``segment.done``."""

    def on_utterance_done(self, utterance: Utterance | None, msg: dict[str, Any], t: float) -> None:
        """``utterance.done`` (``status``, ``samples``, the engine-side breakdown ...)."""

    def on_cancelled(self, utterance: Utterance | None, msg: dict[str, Any], t: float) -> None:
        """``cancelled`` (``utterance`` is the one named by ``msg["utterance_id"]``)."""

    def on_error(self, utterance: Utterance | None, msg: dict[str, Any], t: float) -> None:
        """``error`` (``utterance``: by ``utterance_id``, else by the ``id`` of an opening delta)."""

    def on_message(self, msg: dict[str, Any], t: float) -> None:
        """Any other JSON message (``pong``, types this client does not know)."""

    def on_audio(self, utterance: Utterance | None, header: P.AudioFrameHeader, payload: bytes, t: float) -> None:
        """A well-formed audio frame, also one the client drops (a ``cancel`` awaiting its reply).
        Samples: ``len(payload) // header.format.bytes_per_sample``."""

    def on_closed(self, code: int | None, reason: str, t: float) -> None:
        """The connection ended (``code``: the close code, 1006 without a close frame). Not
        called when the application closed the client itself."""


PlaybackMode = Literal["realtime", "speakers", "instant", "none"]
TextSource = str | Iterable[str] | AsyncIterable[str]

_TICK_S = 0.01
_CANCEL_REPLY_TIMEOUT_S = 5.0
_EVENTS_KEPT = 256
_MULAW = P.AudioFormat.MULAW




@dataclass(frozen=True)
class ClientEvent:
    """Something the connection went through (``Client.events``, ``on_event``)."""

    type: str
    """disconnected | reconnecting | reconnected | resumed | retry | gave_up"""
    t_s: float
    """``time.monotonic()`` when it happened."""
    detail: dict[str, Any] = field(default_factory=dict)


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


_END = object()


class Utterance(core.UtteranceState):
    """One spoken utterance: async-iterate it for audio chunks; ``stats`` when done. Its
    protocol state and transitions are ``core.UtteranceState``'s; this adds the audio queue,
    the waits and the times."""

    def __init__(self, client: Client, local_id: str) -> None:
        super().__init__(local_id, client.sample_rate_hz)
        self._client = client
        self.pump_lock = asyncio.Lock()
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

    def _drop_queued(self, from_segment: int = 0) -> None:
        kept = [x for x in self._queue if not isinstance(x, AudioChunk) or x.segment < from_segment]
        self._queue.clear()
        self._queue.extend(kept)
        self._queued_samples = sum(x.samples for x in kept if isinstance(x, AudioChunk))

    def _finish(self, failure: VoicegwError | None = None) -> None:
        if self.done.is_set():
            return
        self.failure = failure
        if self.stats.status == "pending":
            self.stats.status = "error" if failure else "ok"
        self._queue.append(_END)
        self._wake.set()
        self.done.set()
        self.finished = True

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
        self._client._on_consumed(item.samples, item.segment, self)
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
    """One gateway session (re-established after a dropped connection). Use as
    ``async with Client(url) as c``."""

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
        retry: RetryPolicy | None = None,
        on_event: Callable[[ClientEvent], None] | None = None,
        recorder: ClientRecorder | None = None,
        connect_options: dict[str, Any] | None = None,
        socket_factory: Callable[[], Awaitable[socket.socket]] | None = None,
    ) -> None:
        """``recorder``: an observer of everything received (``ClientRecorder``).
        ``connect_options``: keyword arguments for ``websockets.asyncio.client.connect`` over
        the client's own (e.g. ``ping_interval=None``, ``max_queue=16``). ``socket_factory``:
        returns a connected socket for each connection attempt (socket options such as a small
        ``SO_RCVBUF``); by default websockets opens the connection itself."""
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
        self.retry = retry if retry is not None else RetryPolicy()
        self.on_event = on_event
        self.recorder = recorder
        self.connect_options = dict(connect_options or {})
        self.socket_factory = socket_factory
        self.events: deque[ClientEvent] = deque(maxlen=_EVENTS_KEPT)
        """What the connection went through (most recent ``_EVENTS_KEPT``)."""
        self.reconnects = 0
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
        self.bad_frames = 0
        """Malformed audio frames received (discarded)."""
        self.bad_messages = 0
        """Text messages received that are not a JSON object (discarded)."""
        self.reports_sent = 0
        self.output_latency_ms = 0.0
        self._rnd = random.Random()
        self._core: core.ClientCore[Utterance] = core.ClientCore(self.retry, self._rnd)
        """The session's protocol state and decisions (sans I/O); this class carries them out."""
        self._reg = self._core.registry
        self._utterances = self._reg.items
        """Unfinished utterances, in order (``core.Registry``)."""
        self._by_id = self._reg.by_id
        self._local_seq = 0
        self._open: Utterance | None = None
        self._send_lock = asyncio.Lock()
        self._cancel_replies: deque[asyncio.Future[dict[str, Any]]] = deque()
        """cancel() calls awaiting the server's ``cancelled`` (FIFO); audio is dropped meanwhile."""
        self._session_waiter: asyncio.Future[dict[str, Any]] | None = None
        self._pong_waiters: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        self._lock = threading.Lock()  # playout + speaker FIFO + spans (the sound card thread uses them)
        self._fifo = bytearray()  # speakers mode: PCM waiting for the sound card
        self._ledger = core.PlayLedger()
        """Which segment the buffered audio belongs to."""
        self._stream: Any = None
        self._last_report_s = 0.0
        self._last_instant_report = -1
        self._drain_pending = False
        self._played_base = 0
        """Played samples before this session's audio (reports count from the session start)."""
        self._link_up = False
        self._link_gen = 0
        self._up_gen = -1
        """The link on which the current session started."""
        self._outage: dict[str, Any] | None = None
        """The last outage: drop -> reconnected -> first resumed audio played."""
        self._stop_reading = False

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Client:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> dict[str, Any]:
        """Open the socket and start the session; returns ``session.started``. A server that
        refuses for capacity (503 / 1013) is tried again with backoff within
        ``retry.reconnect_timeout_s``; other failures raise ``VoicegwError`` at once."""
        deadline = time.monotonic() + self.retry.reconnect_timeout_s
        attempt = 0
        while True:
            attempt += 1
            try:
                self.session = await self._open_session()
                break
            except VoicegwError as exc:
                act = core.connect_decision(self.retry, self._failure(exc), attempt=attempt, now_s=time.monotonic(),
                                            deadline_s=deadline, rnd=self._rnd)
                if not isinstance(act, core.Reconnect):
                    raise
                self._emit("reconnecting", attempt=attempt, wait_ms=round(act.wait_ms), error=str(exc))
                await asyncio.sleep(act.wait_ms / 1000.0)
        self._start_playback()
        return self.session

    async def _open_session(self) -> dict[str, Any]:
        """One socket + ``session.start``; the reader runs on it. Raises ``VoicegwError``."""
        headers = {}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        options: dict[str, Any] = {"subprotocols": [P.SUBPROTOCOL], "additional_headers": headers,
                                   "compression": None, "open_timeout": self.open_timeout_s,
                                   "close_timeout": 2.0, "max_queue": 64, **self.connect_options}
        try:
            if self.socket_factory is not None:
                options["sock"] = await self.socket_factory()
            ws = await connect(self.url, **options)
        except InvalidStatus as exc:
            status = exc.response.status_code
            body = exc.response.body.decode(errors="replace").strip() if exc.response.body else ""
            retry_after = exc.response.headers.get("Retry-After")
            detail: dict[str, Any] = {"status": status}
            with contextlib.suppress(TypeError, ValueError):
                detail["retry_after_ms"] = float(retry_after) * 1000.0  # type: ignore[arg-type]
            raise VoicegwError("handshake_failed", f"HTTP {status} {body}".strip(), detail) from None
        except (OSError, TimeoutError) as exc:
            raise VoicegwError("handshake_failed", f"cannot connect to {self.url}: {exc}") from None
        self.ws = ws
        self._link_gen += 1
        self._session_waiter = asyncio.get_running_loop().create_future()
        reader = asyncio.create_task(self._reader(ws, self._link_gen), name="voicegw-client-reader")
        self._tasks.append(reader)
        reader.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)
        start: dict[str, Any] = {
            "type": P.ClientType.SESSION_START.value,
            "sample_rate": self.sample_rate_hz,
            "format": self.format.value,
            "resume": True,
            "id": core.SESSION_START_ID,
        }
        if self.voice is not None:
            start["voice"] = self.voice
        if self.language:
            start["language"] = self.language
        if self.options:
            start["options"] = self.options
        try:
            await self._send(start)
            async with asyncio.timeout(self.open_timeout_s):
                session = await self._session_waiter
        except (VoicegwError, TimeoutError) as exc:
            self._link_gen += 1  # its reader's end is not a session's end
            if self.ws is ws:
                self.ws = None
            with contextlib.suppress(Exception):
                await ws.close()
            if isinstance(exc, VoicegwError):
                raise
            raise VoicegwError("timeout", "no session.started") from None
        self._up_gen = self._link_gen
        self._link_up = True
        return session

    async def close(self) -> None:
        if self.closed and self.ws is None:
            return
        self.closed = True
        self._link_up = False
        for t in list(self._tasks):
            if t is not asyncio.current_task():
                t.cancel()
        for u in list(self._utterances):
            if u.sender is not None:
                u.sender.cancel()
        if self.ws is not None:
            with contextlib.suppress(Exception):
                await self.ws.close()
        for t in list(self._tasks):
            if t is not asyncio.current_task():
                with contextlib.suppress(BaseException):
                    await t
        self._tasks.clear()
        self._stop_speakers()
        self._fail_all(VoicegwError("closed", "client closed"))
        self.ws = None

    @property
    def connected(self) -> bool:
        """A session is up (False while reconnecting)."""
        return self._link_up and not self.closed

    @property
    def last_outage(self) -> dict[str, Any] | None:
        """The last reconnect: ``outage_ms`` (drop -> new session), ``to_audio_ms`` (new session ->
        first resumed audio played: the outage's cost past the server's own restart), ``gap_ms``
        (the silence the listener heard: buffer dry -> resumed audio), ``attempts``."""
        return self._outage

    def _emit(self, type_: str, **detail: Any) -> None:
        ev = ClientEvent(type_, time.monotonic(), detail)
        self.events.append(ev)
        log.info("voicegw client: %s %s", type_, detail)
        if self.on_event is not None:
            try:
                self.on_event(ev)
            except Exception:  # noqa: BLE001 - an application callback must not break the client
                log.exception("on_event callback failed")

    @staticmethod
    def _failure(exc: VoicegwError) -> core.Failure:
        """What the core is told of a failed connection attempt."""
        code = exc.detail.get("code")
        hinted = exc.detail.get("retry_after_ms")
        return core.Failure(status=exc.detail.get("status"), close_code=code if isinstance(code, int) else None,
                            retry_after_ms=float(hinted) if isinstance(hinted, (int, float)) else None,
                            error=str(exc))

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
            if self._open is not None and self._link_up and not self._open.parked:
                with contextlib.suppress(VoicegwError):
                    await self._send({"type": P.ClientType.TEXT_FLUSH.value})

    async def end(self) -> Utterance | None:
        """Low level: ``text.end`` for the utterance opened by ``send_text``."""
        async with self._send_lock:
            u, self._open = self._open, None
            if u is None:
                return None
            await self._end_text(u)
            return u

    async def cancel(self, played_samples: int | None = None) -> dict[str, Any] | None:
        """Barge-in: silence now, drop audio in flight, stop every queued utterance.
        Returns the server's ``cancelled`` message (while reconnecting: a local one).
        ``played_samples``: the playhead to tell the server (an application that plays the audio
        itself, ``playback="none"``: see ``send_playback``); by default the client's own."""
        if self.closed:
            return None
        for u in self._utterances:
            u.cancelling = True
            if u.sender is not None and not u.sender.done():
                u.sender.cancel()
            u._drop_queued()  # audio not yet taken from speak() was cancelled too
        self._open = None
        played: int | None
        if self.playback_mode in ("realtime", "speakers"):
            with self._lock:
                played = self.playout.cancel()
                self._fifo.clear()
                self._ledger.clear()
        elif self.playback_mode == "instant":
            played = self.consumed_samples
        else:
            played = None
        if not self._link_up:  # nothing on the server to stop: the outage ended the session
            msg = {"type": P.ServerType.CANCELLED.value, "local": True,
                   "cancelled_utterances": [u.local_id for u in self._utterances]}
            self._on_cancelled(msg)
            return msg
        reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._cancel_replies.append(reply)
        out: dict[str, Any] = {"type": P.ClientType.CANCEL.value}
        if played_samples is not None:
            out["played_samples"] = played_samples
        elif played is not None:
            out["played_samples"] = max(0, played - self._played_base)
        try:
            await self._send(out)
            async with asyncio.timeout(_CANCEL_REPLY_TIMEOUT_S):
                return await reply
        except TimeoutError:
            raise VoicegwError("timeout", "no reply to cancel") from None

    async def send_playback(self, played_samples: int, buffered_ms: float = 0.0, underruns: int = 0,
                            output_latency_ms: float | None = None) -> None:
        """Report the playhead (a ``playback`` message; it paces the server's flow control). For an
        application that plays the audio itself (``playback="none"``): the other modes report by
        themselves. ``played_samples`` counts the session's samples played so far."""
        msg: dict[str, Any] = {
            "type": P.ClientType.PLAYBACK.value,
            "played_samples": played_samples,
            "buffered_ms": round(max(0.0, buffered_ms), 1),
            "underruns": underruns,
        }
        if output_latency_ms is not None:
            msg["output_latency_ms"] = round(min(60_000.0, output_latency_ms), 1)
        await self._send(msg)
        self.reports_sent += 1

    def stop_reading(self) -> None:
        """Take no more messages off this connection's socket (for load and robustness tests): its
        buffers fill and the gateway sees a consumer that stalled. The connection's end is
        still noticed (``ClientRecorder.on_closed``). Not undone, not carried over a reconnect."""
        self._stop_reading = True

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
        if self.closed or (self.ws is None and not self._reconnecting()):
            raise VoicegwError("closed", "not connected")

    def _reconnecting(self) -> bool:
        return not self._link_up and not self.closed and self.session is not None

    def _new_utterance(self) -> Utterance:
        self._local_seq += 1
        u = Utterance(self, f"u{self._local_seq}")
        u.parked = not self._link_up
        self._reg.add(u)
        return u

    async def _send(self, obj: dict[str, Any]) -> None:
        if self.ws is None:
            raise VoicegwError("closed", "not connected")
        try:
            await self.ws.send(orjson.dumps(obj).decode())
        except ConnectionClosed as exc:
            detail = {"code": exc.rcvd.code, "reason": exc.rcvd.reason} if exc.rcvd is not None else {}
            raise VoicegwError("closed", f"connection closed ({exc})", detail) from None

    async def _send_delta(self, u: Utterance, text: str) -> None:
        if not text or u.cancelling:
            return
        if u.chars + len(text) - u.sent > self.retry.max_buffered_chars:
            raise VoicegwError("buffer_full", "text kept while it cannot be sent is over retry.max_buffered_chars")
        if u.t_first_text is None:
            u.t_first_text = time.perf_counter()
        u.text += text
        await self._pump(u)

    async def _end_text(self, u: Utterance) -> None:
        u.end_requested = True
        if u.chars == 0:
            self._settle_empty(u)
            return
        await self._pump(u)

    async def _pump(self, u: Utterance) -> None:
        """Send what ``u`` holds that the current sending lacks (text, then ``text.end`` when
        asked). Parked, or with the link down, it keeps it; a link lost meanwhile is the
        reconnect's business (it sends the text again)."""
        async with u.pump_lock:
            try:
                while not u.parked and self._link_up and not u.cancelling:
                    msg = u.next_message()
                    if msg is None:
                        return
                    if "text" in msg:
                        await self._pace(len(msg["text"]))
                    await self._send(msg)
            except VoicegwError:
                if not self._reconnecting():
                    raise

    async def _pace(self, chars: int) -> None:
        """Resends come in big pieces: stay under the session's text rate (1 s burst)."""
        if chars < 256 or self.session is None:
            return
        rate = float((self.session.get("limits") or {}).get("max_chars_per_s") or 0.0)
        if rate > 0 and chars > 0.5 * rate:
            await asyncio.sleep(chars / rate)

    async def _send_utterance(self, u: Utterance, source: TextSource) -> None:
        try:
            async with self._send_lock:  # one utterance's text at a time, in order
                if self._open is not None:  # a send_text() utterance is open: it goes first
                    opened, self._open = self._open, None
                    await self._end_text(opened)
                async for piece in _aiter_text(source):
                    if u.cancelling or self.closed:
                        return
                    await self._send_delta(u, piece)
                if u.cancelling:
                    return
                await self._end_text(u)
        except asyncio.CancelledError:
            raise
        except VoicegwError as exc:
            u._finish(exc)
            u.played.set()
            self._forget(u)
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
        return self._reg.record(uid)

    async def _reader(self, ws: ClientConnection, gen: int) -> None:
        self._stop_reading = False
        timed = self.recorder is not None
        recv = ws.recv
        try:
            while True:
                m = await recv()  # not ``async for``: no async-generator step per message
                t = time.monotonic() if timed else 0.0
                if isinstance(m, bytes):
                    self._on_audio(m, t)
                else:
                    try:
                        msg = orjson.loads(m)
                    except orjson.JSONDecodeError:
                        msg = None
                    if isinstance(msg, dict):
                        await self._on_message(msg, t)
                    else:
                        self.bad_messages += 1
                        log.warning("malformed message from the gateway (%d characters)", len(m))
                if self._stop_reading:
                    await ws.wait_closed()
                    break
        except ConnectionClosed:
            pass
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("client reader failed")
        finally:
            if gen == self._link_gen:
                self._on_link_down(ws, gen)

    def _on_link_down(self, ws: ClientConnection, gen: int) -> None:
        code = ws.close_code
        reason = ws.close_reason or ""
        if self.recorder is not None and not self.closed:  # not the application's own close()
            self._notify(self.recorder.on_closed, code, reason, time.monotonic())
        self.close_code = code
        if self.ws is ws:
            self.ws = None
        err = VoicegwError("closed", f"connection closed {code} {reason}".strip(), {"code": code, "reason": reason})
        if self._session_waiter is not None and not self._session_waiter.done():
            self._session_waiter.set_exception(err)
        if gen != self._up_gen:
            return  # a session never started on it: the attempt that opened it reports the failure
        self._link_up = False
        for fut in self._pong_waiters.values():
            if not fut.done():
                fut.set_exception(err)
        self._pong_waiters.clear()
        reconnector, acts = self._core.connection_lost(code, time.monotonic(), session_started=self.session is not None,
                                                       closing=self.closed)
        first = acts[-1]
        if isinstance(first, core.Fail):
            self.closed = True
            while self._cancel_replies:
                fut = self._cancel_replies.popleft()
                if not fut.done():
                    fut.set_exception(err)
            self._fail_all(err, keep_received=True)
            return
        self._emit("disconnected", code=code, reason=reason)
        self._outage = {"outage_ms": None, "attempts": 0, "to_audio_ms": None, "gap_ms": None,
                        "t_drop": time.monotonic(), "t_up": None, "t_dry": None}
        while self._cancel_replies:  # the session that would answer is gone: cancelled it is
            fut = self._cancel_replies.popleft()
            if not fut.done():
                fut.set_result({"type": P.ServerType.CANCELLED.value, "local": True, "cancelled_utterances": []})
        assert isinstance(acts[0], core.Resumes) and isinstance(first, (core.Reconnect, core.GiveUp))
        self._carry_out_resumes(acts[0])
        task = asyncio.create_task(self._reconnect(reconnector, first), name="voicegw-client-reconnect")
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    def _carry_out_resumes(self, resumes: core.Resumes[Utterance]) -> None:
        """The core parked every unfinished utterance at its first segment not wholly received, or
        inside it (at its next sample): drop the audio after that point from the queues and the
        playout (what is left plays on meanwhile)."""
        for u, plan in resumes.plans:
            u._drop_queued(from_segment=plan.segment + (1 if plan.inside else 0))
        keep = resumes.keep
        if keep is not None and self.playback_mode in ("realtime", "speakers"):
            with self._lock:
                dropped = self.playout.truncate(keep)
                if self.playback_mode == "speakers":
                    del self._fifo[2 * self.playout.buffered:]
                self._ledger.drop_tail(dropped)

    async def _reconnect(self, rec: core.Reconnector, act: core.Reconnect | core.GiveUp) -> None:
        """Carry out the core's reconnect decisions (``core.Reconnector``): wait, open, repeat."""
        while not self.closed and isinstance(act, core.Reconnect):
            self._emit("reconnecting", attempt=act.attempt, wait_ms=round(act.wait_ms))
            await asyncio.sleep(max(0.0, act.at_s - time.monotonic()))
            try:
                session = await self._open_session()
            except VoicegwError as exc:
                act = rec.failed(self._failure(exc), time.monotonic())
                continue
            self.session = session
            self.reconnects += 1
            t_up = time.monotonic()
            up = rec.connected(t_up)
            o: dict[str, Any] = self._outage if self._outage is not None else {
                "to_audio_ms": None, "gap_ms": None, "t_dry": None}
            o.update(outage_ms=up.outage_ms, attempts=up.attempts, t_up=t_up)
            self._outage = o
            self._emit("reconnected", attempts=up.attempts, outage_ms=o["outage_ms"])
            await self._replay()
            return
        if self.closed:
            return
        self.closed = True
        last = rec.last_error
        self._emit("gave_up", attempts=rec.attempt, error=last)
        self._fail_all(VoicegwError("closed", f"could not reconnect within {self.retry.reconnect_timeout_s:g} s"
                                    + (f" ({last})" if last else "")), keep_received=True)

    async def _replay(self) -> None:
        """A new session is up: its ids and played counter start afresh; send the parked
        utterances again in order."""
        self._reg.new_session()
        with self._lock:
            if self.playback_mode in ("realtime", "speakers"):
                self._played_base = self.playout.played + self.playout.buffered
            elif self.playback_mode == "instant":
                self._played_base = self.consumed_samples + sum(u._queued_samples for u in self._utterances)
        self._last_instant_report = -1
        gen = self._link_gen
        for u in list(self._utterances):
            if not u.parked or u.cancelling:
                continue
            if gen != self._link_gen or not self._link_up:
                return  # dropped again: the next reconnect replays
            u.parked = False
            if u.resume_note:
                u.resume_note = False
                self._emit("resumed", utterance=u.local_id, from_segment=u.seg_base, from_char=u.base_char)
            try:
                await self._pump(u)
            except VoicegwError as exc:
                u._finish(exc)

    def _fail_all(self, err: VoicegwError, keep_received: bool = False) -> None:
        for u in list(self._utterances):
            if not (keep_received and u.done.is_set() and not u.retrying):
                u._finish(err)  # fully received utterances keep their audio and status
            u.played.set()
            self._forget(u)

    def _on_audio(self, data: bytes, t: float = 0.0) -> None:
        rec = self.recorder
        if self._cancel_replies:
            self.dropped_frames += 1
            if rec is not None:
                with contextlib.suppress(ValueError):
                    h, p = P.unpack_audio_frame(data)
                    self._notify(rec.on_audio, self._by_id.get(h.utterance_id), h, p, t)
            return
        try:
            header, payload = P.unpack_audio_frame(data)
        except ValueError:
            self.bad_frames += 1
            log.warning("malformed audio frame (%d bytes)", len(data))
            return
        u = self._by_id.get(header.utterance_id)
        if u is None:
            u = self._record(header.utterance_id)
        if rec is not None:
            try:
                rec.on_audio(u, header, payload, t)
            except Exception:  # noqa: BLE001 - an observer must not break the client
                log.exception("client recorder failed")
        mode = self.playback_mode
        queue = u is not None and self.max_queued_chunk_s > 0
        mulaw = header.format is _MULAW
        n = len(payload) if mulaw else len(payload) // 2
        if mulaw and (queue or mode == "speakers"):
            from gateway.audio import mulaw_decode

            payload = mulaw_decode(payload).astype("<i2").tobytes()
        self.received_samples += n
        seg: Segment | None = None
        if u is not None:
            segment = header.segment + u.seg_base
            if u.t_first_audio is None:
                u.t_first_audio = time.perf_counter()
                u.underruns_at_start = self.playout.underruns
                if u.t_first_text is not None:
                    u.stats.ttfa_ms = (u.t_first_audio - u.t_first_text) * 1000.0
            seg = u.on_audio(header.segment, header.sample_offset, n)
            if queue:
                u._put(AudioChunk(utterance_id=header.utterance_id, segment=segment, seq=header.seq,
                                  sample_offset=header.sample_offset + u.sample_base, pcm=payload,
                                  sample_rate_hz=self.sample_rate_hz))
            elif mode == "instant":
                self._on_consumed(n, segment, u)  # nobody takes it from speak(): played on arrival
            o = self._outage
            if (o is not None and o["to_audio_ms"] is None and o["t_up"] is not None
                    and mode not in ("realtime", "speakers")):
                o["to_audio_ms"] = round((time.monotonic() - o["t_up"]) * 1000.0)
                o["gap_ms"] = 0
        if mode == "none":
            if seg is not None:
                seg.play.played += n
        elif mode in ("realtime", "speakers"):
            with self._lock:
                if seg is not None:
                    if seg.pos is None:
                        seg.pos = self.playout.written
                    self._ledger.pushed(seg.play, n)
                self.playout.push(n)
                if mode == "speakers":
                    self._fifo += payload

    def _notify(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - an observer must not break the client
            log.exception("client recorder failed")

    def _record_message(self, mtype: Any, msg: dict[str, Any], t: float) -> None:
        """Tell the recorder about a JSON message (before the client acts on it)."""
        rec = self.recorder
        assert rec is not None
        if mtype == P.ServerType.SESSION_STARTED:
            self._notify(rec.on_session_started, msg, t)
            return
        fn: Callable[[Utterance | None, dict[str, Any], float], None]
        if mtype == P.ServerType.SEGMENT_STARTED:
            fn = rec.on_segment_started
        elif mtype == P.ServerType.SEGMENT_DONE:
            fn = rec.on_segment_done
        elif mtype == P.ServerType.UTTERANCE_DONE:
            fn = rec.on_utterance_done
        elif mtype == P.ServerType.CANCELLED:
            fn = rec.on_cancelled
        elif mtype == P.ServerType.ERROR:
            fn = rec.on_error
        else:
            self._notify(rec.on_message, msg, t)
            return
        uid = msg.get("utterance_id")
        u: Utterance | None = None
        if isinstance(uid, int):
            u = self._record(uid)
        elif msg.get("id") is not None and mtype == P.ServerType.ERROR:
            u = self._reg.opening(msg["id"])
        self._notify(fn, u, msg, t)

    async def _on_message(self, msg: dict[str, Any], t_rcvd: float = 0.0) -> None:
        t = msg.get("type")
        if self.recorder is not None:
            self._record_message(t, msg, t_rcvd)
        if t == P.ServerType.ERROR:
            self.errors.append(msg)
            log.info("gateway error %s: %s", msg.get("code"), msg.get("message"))
        for ev in self._core.receive(msg, time.monotonic(), dropping_audio=bool(self._cancel_replies),
                                     closing=self.closed):
            self._carry_out(ev)

    def _carry_out(self, ev: core.Event[Utterance]) -> None:
        """Do what the core decided on a message."""
        if isinstance(ev, core.SessionReady):
            if self._session_waiter is not None and not self._session_waiter.done():
                self._session_waiter.set_result(dict(ev.msg))
        elif isinstance(ev, core.Finished):
            u = ev.u
            if u.t_first_text is not None:
                u.stats.wall_ms = (time.perf_counter() - u.t_first_text) * 1000.0
            failure = UtteranceFailed(ev.error, "utterance failed", dict(ev.msg)) if ev.error is not None else None
            with self._lock:
                self.playout.end()
                u.end_pos = self.playout.written
            u._finish(failure)
            self._check_played()
        elif isinstance(ev, core.CancelledUtterances):
            for u in ev.utterances:
                u._finish()
                u.played.set()
                self._forget(u)
            if self._cancel_replies:
                waiter = self._cancel_replies.popleft()
                if not waiter.done():
                    waiter.set_result(dict(ev.msg))
        elif isinstance(ev, core.RetryUtterance):
            self._retry(ev.u, ev.retry)
        elif isinstance(ev, core.Refused):
            if self._open is ev.u:
                self._open = None
            ev.u._finish(VoicegwError(ev.code, ev.message, dict(ev.msg)))
            ev.u.played.set()
        elif isinstance(ev, core.FatalError):
            if self._session_waiter is not None and not self._session_waiter.done():
                self._session_waiter.set_exception(VoicegwError(ev.code, ev.message, dict(ev.msg)))
        elif isinstance(ev, core.Pong):
            fut = self._pong_waiters.pop(str(ev.msg.get("id")), None)
            if fut is not None and not fut.done():
                fut.set_result(dict(ev.msg))

    def _on_cancelled(self, msg: dict[str, Any]) -> None:
        """A ``cancelled`` (the server's, or a local one while reconnecting)."""
        for u in self._core.cancelled(msg).utterances:
            u._finish()
            u.played.set()
            self._forget(u)

    # ------------------------------------------------------------------ internals: overload retry

    def _retry(self, u: Utterance, act: core.Retry) -> None:
        """``engine_overloaded`` before any audio (``core.overload_decision``; the core parked
        ``u``): end the refused sending (the server absorbs its text until ``text.end``) and send
        it again after the hinted wait."""
        wait_ms = act.wait_ms
        self._emit("retry", utterance=u.local_id, attempt=act.attempt, wait_ms=round(wait_ms))
        task = asyncio.create_task(self._retry_later(u, wait_ms), name=f"voicegw-retry {u.local_id}")
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    async def _retry_later(self, u: Utterance, wait_ms: float) -> None:
        async with u.pump_lock:  # after any delta in flight: the refused sending absorbs it
            if not u.end_sent and self._link_up:
                u.end_sent = True
                with contextlib.suppress(VoicegwError):
                    await self._send({"type": P.ClientType.TEXT_END.value})  # ends the refused sending
        await asyncio.sleep(wait_ms / 1000.0)
        if u.cancelling or self.closed or not u.retrying or not self._link_up:
            return  # cancelled, or a reconnect took it over
        u.restart_for_retry()
        with contextlib.suppress(VoicegwError):
            await self._pump(u)

    def _forget(self, u: Utterance) -> None:
        self._reg.forget(u)

    # ------------------------------------------------------------------ internals: playback

    def _credit(self, k: int) -> None:
        """``k`` samples were played: credit them to their segments (caller holds ``_lock``)."""
        self._ledger.credit(k)

    def _on_consumed(self, n: int, segment: int, u: Utterance) -> None:
        self.consumed_samples += n
        if self.playback_mode == "instant":
            seg = u.segs.get(segment)
            if seg is not None:
                seg.play.played += n
            if self._link_up:
                task = asyncio.create_task(self._instant_report())
                self._tasks.append(task)
                task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    async def _instant_report(self) -> None:
        # coalesce: one report per event-loop turn at most
        await asyncio.sleep(0)
        played = max(0, self.consumed_samples - self._played_base)
        if played == self._last_instant_report or not self._link_up:
            return
        self._last_instant_report = played
        with contextlib.suppress(VoicegwError):
            await self._send_report(played, 0.0, 0, drained=False)

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
                self._credit(k)
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
                    k, drained = self.playout.pull(n)
                    self._credit(k)
            t_last = now
            if self._drain_pending:
                drained, self._drain_pending = True, False
            with self._lock:
                state = self.playout.state
                rep = self.playout.report(drained)
                played_now = self.playout.played
                buffered = self.playout.buffered
            if played_now > played_before:
                self._note_play_start()
            self._note_outage(buffered, played_now)
            played_before = played_now
            if not self._link_up:
                continue
            if drained or (state != "idle" and now - self._last_report_s >= self.report_interval_s):
                self._last_report_s = now
                try:
                    await self._send_report(max(0, rep.played_samples - self._played_base), rep.buffered_ms,
                                            rep.underruns, drained)
                except VoicegwError:
                    continue
            self._check_played()

    def _note_outage(self, buffered: int, played: int) -> None:
        """Times of the last outage: when the listener ran out of audio, when the resumed audio
        started playing (``last_outage``)."""
        o = self._outage
        if o is None or o["to_audio_ms"] is not None:
            return
        now = time.monotonic()
        if buffered == 0 and o["t_dry"] is None:
            o["t_dry"] = now
        if o["t_up"] is not None and played > self._played_base:
            o["to_audio_ms"] = round((now - o["t_up"]) * 1000.0)
            o["gap_ms"] = round((now - o["t_dry"]) * 1000.0) if o["t_dry"] is not None else 0
            self._emit("audio_resumed", to_audio_ms=o["to_audio_ms"], gap_ms=o["gap_ms"])
            for u in self._utterances:
                if u.stats.resumes:
                    u.stats.gap_ms += o["gap_ms"]
                    break

    def _note_play_start(self) -> None:
        for u in self._utterances:
            if u.t_first_audio is not None and u.stats.play_start_ms is None:
                if u.t_first_text is not None:
                    u.stats.play_start_ms = (time.perf_counter() - u.t_first_text) * 1000.0
                return

    async def _send_report(self, played: int, buffered_ms: float, underruns: int, drained: bool) -> None:
        await self.send_playback(played, buffered_ms, underruns, output_latency_ms=self.output_latency_ms)

    def _check_played(self) -> None:
        """Mark utterances whose audio has been played out."""
        with self._lock:
            consumed = self.playout.read
            underruns = self.playout.underruns
        for u in list(self._utterances):
            if not u.done.is_set() or u.retrying:
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

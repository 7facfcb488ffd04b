"""The I/O edge: the only module touching sockets, HTTP and asyncio tasks.

One port serves the WebSocket endpoint (``/ws``), the browser demo and static files (from
``clients/web/``), ``/healthz``, ``/metrics`` and ``/protocol.json``. All decisions live in the
pure cores (``session.Session``, ``flow``, ``segmenter``); this module feeds them events and carries
out their actions:

* per connection: a reader loop (frames -> session), a writer task (bounded outbound queue ->
  socket, each send bounded by ``send_timeout_ms``), one reader task per engine stream that pulls
  the engine's iterator only while the session allows it, and one timer.
* at the door (``process_request``): routes, Origin allow-list (403), bearer token (401), session
  cap (503), protocol version (400).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import logging
import mimetypes
import os
import secrets
import socket
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import orjson
from websockets.asyncio.server import Server, ServerConnection
from websockets.asyncio.server import serve as ws_serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from engine.api import EngineError, EngineErrorKind, EngineOverloaded, SpeechEngine, SpeechRequest
from gateway import dialects
from gateway import protocol as P
from gateway.admission import EngineScheduler
from gateway.config import GatewaySettings
from gateway.flow import WaterMarks
from gateway.forwarded import TrustedProxies, parse_networks
from gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gateway.metrics import GatewayMetrics
from gateway.responses import request_id, response, text_response
from gateway.scheduling import AdmissionDecision
from gateway.session import (
    AbortStream,
    Action,
    Close,
    EngineFailure,
    SendAudio,
    SendMessage,
    Session,
    SessionSettings,
    StartStream,
    TtfaParts,
)
from gateway.transport import Transport

log = logging.getLogger("voicegw.gateway")

_CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".json": "application/json",
    ".map": "application/json",
    ".svg": "image/svg+xml",
    ".wasm": "application/wasm",
    ".txt": "text/plain; charset=utf-8",
    ".wav": "audio/wav",
}
_MAX_STATIC_BYTES = 8 * 1024 * 1024
_CLOSE_WAIT_S = 1.0
"""How long a close handshake may take before the transport is aborted."""
_ABORT_WAIT_S = 2.0
"""How long a closing connection waits for the engine to confirm aborts."""


def default_static_dir() -> Path:
    """The web client's files (``clients/web``), found without importing the ``clients`` package:
    the gateway serves them as data."""
    import importlib.util

    spec = importlib.util.find_spec("clients")
    assert spec is not None and spec.submodule_search_locations, "the clients package is not installed"
    return Path(next(iter(spec.submodule_search_locations))).resolve() / "web"


def _with_request_id(conn: ServerConnection, request: Request, resp: Response) -> Response:
    """Every answer of the websockets side (upgrades, GETs, refusals) carries ``x-request-id``
    (the HTTP side, gateway/dialects/front.py, adds its own)."""
    if "x-request-id" not in resp.headers:
        resp.headers["x-request-id"] = request_id()
    return resp


@dataclass
class _Runner:
    task: asyncio.Task[None]
    gate: asyncio.Event


@dataclass
class _Out:
    data: bytes
    message: P.ServerMessage | None
    """The server message ``data`` encodes (``P.encode_server``; None: ``data`` is an audio frame)."""
    ttfa: TtfaParts | None = None
    utterance_id: int = 0


class GatewayServer:
    """The gateway on one port. ``await start()``, then ``await shutdown()``."""

    def __init__(
        self,
        config: GatewaySettings,
        engine: SpeechEngine,
        *,
        static_dir: Path | None = None,
        metrics: GatewayMetrics | None = None,
        settings: SessionSettings | None = None,
    ) -> None:
        self.config = config
        self.engine = engine
        self.static_dir = (static_dir or default_static_dir()).resolve()
        self.metrics = metrics or GatewayMetrics()
        self.settings = settings or SessionSettings.from_config(config, engine_name=engine.name,
                                                                   resume_mode=engine.resume_mode,
                                                                   check_voice=engine.check_voice)
        self.connections: set[_Connection] = set()
        self.draining = False
        self.proxies = TrustedProxies(parse_networks(config.gateway.trusted_proxies))
        self._client_of: weakref.WeakKeyDictionary[ServerConnection, str] = weakref.WeakKeyDictionary()
        """The client address of each accepted handshake, until its session starts."""
        self._per_client: collections.Counter[str] = collections.Counter()
        """Open sessions per client address."""
        self._ws: Server | None = None
        self._no_connections = asyncio.Event()
        self._shutdown_task: asyncio.Task[None] | None = None
        self.port = 0

    # ---- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        g = self.config.gateway
        self._ws = await ws_serve(
            self.handle,
            g.host,
            g.port,
            process_request=self._process_request,
            process_response=_with_request_id,
            select_subprotocol=self._select_subprotocol,
            compression=None,
            max_size=self.config.limits.max_message_bytes,
            max_queue=16,
            write_limit=g.write_limit_bytes,
            ping_interval=g.ping_interval_s,
            ping_timeout=g.ping_timeout_s,
            open_timeout=g.open_timeout_s,
            close_timeout=_CLOSE_WAIT_S,
            server_header="voicegw",
            create_connection=dialects.front_connection(self),  # POST /v1/audio/speech: gateway/dialects
            reuse_port=g.processes > 1,  # voicegw.group: the kernel spreads connections
        )
        sock = self._ws.sockets[0]
        self.port = sock.getsockname()[1]
        log.info("gateway listening on http://%s:%d (engine %s)", g.host, self.port, self.engine.name)

    @property
    def url(self) -> str:
        host = self.config.gateway.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    @property
    def ws_url(self) -> str:
        return "ws" + self.url[4:] + P.WS_PATH

    async def shutdown(self, grace_s: float | None = None, force: asyncio.Event | None = None) -> None:
        """Stop accepting; let utterances finish up to ``grace_s``; then close 1012.
        Idempotent: concurrent and later calls wait for the first one."""
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.create_task(self._shutdown(grace_s, force))
        await asyncio.shield(self._shutdown_task)

    async def _shutdown(self, grace_s: float | None, force: asyncio.Event | None) -> None:
        ws = self._ws
        if ws is None:
            return
        grace = self.config.gateway.shutdown_grace_s if grace_s is None else grace_s
        log.info("shutting down: %d sessions, grace %.1f s", len(self.connections), grace)
        self.draining = True
        ws.close(close_connections=False)  # stop accepting; handshakes in flight get 503
        for conn in list(self.connections):
            conn.dispatch(conn.session.on_shutdown)
        waiters: list[asyncio.Future[Any]] = [asyncio.ensure_future(self._all_closed())]
        if force is not None:
            waiters.append(asyncio.ensure_future(force.wait()))
        await asyncio.wait(waiters, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
        for w in waiters:
            w.cancel()
        for conn in list(self.connections):
            conn.dispatch(conn.session.on_shutdown_deadline)
        try:
            async with asyncio.timeout(_CLOSE_WAIT_S + _ABORT_WAIT_S + 1.0):
                await ws.wait_closed()
        except TimeoutError:
            for conn in list(self.connections):
                conn.ws.abort()
        log.info("gateway stopped")

    async def _all_closed(self) -> None:
        if self.connections:
            await self._no_connections.wait()

    # ---- the door -----------------------------------------------------------------------

    def _select_subprotocol(self, conn: ServerConnection, offered: Any) -> Subprotocol | None:
        if P.SUBPROTOCOL in offered:
            return Subprotocol(P.SUBPROTOCOL)
        return dialects.select_subprotocol(conn, offered)

    @property
    def engine_name(self) -> str:
        return self.settings.engine_name

    def _process_request(self, conn: ServerConnection, request: Request) -> Response | None:
        try:
            parts = urlsplit(request.path)
        except ValueError:  # e.g. "//[x/ws": an invalid IPv6 netloc
            return text_response(400, "bad request target")
        path = parts.path
        upgrade = "websocket" in request.headers.get("Upgrade", "").lower()
        if request.method != "GET":
            return text_response(405, "method not allowed", [("Allow", "GET")])
        if not upgrade:
            if path.startswith(("/v1/", "/v2/")):  # the dialects' listings, and their 404s, as JSON
                return dialects.get_listing(self, request, parts.path, parts.query)
            return self._http(path)
        peer = conn.remote_address[0] if conn.remote_address else ""
        client = self.proxies.client(str(peer), request.headers.get_all("X-Forwarded-For"))
        cap = self.config.limits.max_sessions_per_client
        if cap and self._per_client[client] >= cap:
            self.metrics.rejected.labels("client").inc()
            return text_response(429, "too many sessions from this client", [("Retry-After", "1")])
        self._client_of[conn] = client
        if path != P.WS_PATH:
            return dialects.process_request(self, request)  # OpenAI/ElevenLabs/Deepgram paths, else 404
        if self.draining:
            self.metrics.rejected.labels("shutdown").inc()
            return text_response(503, "server is shutting down", [("Retry-After", "5")])
        if not self.origin_ok(request.headers):
            self.metrics.rejected.labels("origin").inc()
            return text_response(403, "origin not allowed")
        offered = [p.strip() for h in request.headers.get_all("Sec-WebSocket-Protocol") for p in h.split(",")]
        if not self._auth_ok(request.headers, offered, parts.query):
            self.metrics.rejected.labels("auth").inc()
            return text_response(401, "missing or invalid token", [("WWW-Authenticate", 'Bearer realm="voicegw"')])
        versions = [p for p in offered if p.startswith("voicegw.v")]
        if versions and P.SUBPROTOCOL not in versions:
            self.metrics.rejected.labels("version").inc()
            return text_response(400, f"unsupported protocol version; this server speaks {P.SUBPROTOCOL}")
        if len(self.connections) >= self.config.limits.max_sessions:
            self.metrics.rejected.labels("capacity").inc()
            return text_response(503, "too many sessions", [("Retry-After", "1")])
        return None

    def origin_ok(self, headers: Headers) -> bool:
        origin = headers.get("Origin")
        if origin is None:
            return True  # not a browser: nothing to defend (auth still applies)
        allowed = self.config.gateway.allowed_origins
        if "*" in allowed:
            return True
        if allowed:
            return origin.rstrip("/") in {a.rstrip("/") for a in allowed}
        try:
            o = urlsplit(origin)
            port = o.port  # ValueError for a port out of range or not a number
        except ValueError:
            return False
        if o.scheme not in ("http", "https") or not o.hostname:
            return False
        host_header = headers.get("Host", "")
        if o.netloc.lower() == host_header.lower():
            return True
        local = {"localhost", "127.0.0.1", "::1", self.config.gateway.host.lower()}
        return o.hostname.lower() in local and (port or (443 if o.scheme == "https" else 80)) == self.port

    def _auth_ok(self, headers: Headers, offered: list[str], query: str) -> bool:
        tokens = self.config.gateway.auth_tokens
        if not tokens:
            return True
        candidates: list[str] = []
        auth = headers.get("Authorization", "")
        if auth[:7].lower() == "bearer ":
            candidates.append(auth[7:].strip())
        candidates += [p[len(P.TOKEN_SUBPROTOCOL_PREFIX):] for p in offered
                       if p.startswith(P.TOKEN_SUBPROTOCOL_PREFIX)]
        candidates += parse_qs(query).get("token", [])
        ok = False
        for c in candidates:
            for t in tokens:
                ok |= hmac.compare_digest(c.encode(), t.encode())
        return ok

    def _http(self, path: str) -> Response:
        if path == "/healthz":
            return self._healthz()
        if path == "/livez":  # the process serves: restart it only when this fails (docs/deploy.md)
            return response(200, orjson.dumps({"live": True, "pid": os.getpid()}), "application/json")
        if path == "/metrics":
            self.metrics.engine_running.set(self._engine_health_running())
            return response(200, self.metrics.render(), METRICS_CONTENT_TYPE)
        if path == "/protocol.json":
            return response(200, orjson.dumps(P.wire_constants()), "application/json")
        if path == P.WS_PATH:
            return text_response(426, "WebSocket upgrade required", [("Upgrade", "websocket")])
        return self._static(path)

    def _engine_health_running(self) -> int:
        try:
            return self.engine.health().running_requests
        except Exception:
            return -1

    def _healthz(self) -> Response:
        try:
            h = self.engine.health()
            body: dict[str, Any] = {
                "engine": h.name,
                "state": "draining" if self.draining else "ready" if h.healthy else "engine_down",
                "healthy": bool(h.healthy) and not self.draining,
                "engine_healthy": bool(h.healthy),
                "running_requests": h.running_requests,
                "sessions": len(self.connections),
                "draining": self.draining,
                "pid": os.getpid(),  # which gateway process answered (gateway.processes > 1)
            }
        except Exception:
            log.exception("engine health failed")
            body = {"engine": self.engine.name, "state": "draining" if self.draining else "engine_down",
                    "healthy": False, "engine_healthy": False, "sessions": len(self.connections),
                    "draining": self.draining}
        return response(200 if body["healthy"] else 503, orjson.dumps(body), "application/json")

    def _static(self, path: str) -> Response:
        rel = path.lstrip("/") or "index.html"
        if rel.endswith("/"):
            rel += "index.html"
        try:
            target = (self.static_dir / rel).resolve()
            if not target.is_relative_to(self.static_dir) or not target.is_file():  # is_file: ENAMETOOLONG
                return text_response(404, "not found")
            if target.stat().st_size > _MAX_STATIC_BYTES:
                return text_response(404, "not found")
            body = target.read_bytes()
        except (OSError, ValueError):
            return text_response(404, "not found")
        ctype = _CONTENT_TYPES.get(target.suffix.lower()) or mimetypes.guess_type(target.name)[0] \
            or "application/octet-stream"
        return response(200, body, ctype)

    # ---- connections --------------------------------------------------------------------

    async def handle(self, conn_in: ServerConnection | Transport) -> None:
        """Run one session over a WebSocket connection (native or a dialect's, by its path) or an
        HTTP speech request already adapted (``HttpExchange``)."""
        if isinstance(conn_in, ServerConnection):
            _fixed_library_close_reasons(conn_in)
        ws = dialects.adapt(self, conn_in)  # every connection as a Transport speaking protocol v1
        if len(self.connections) >= self.config.limits.max_sessions or self.draining:
            code = P.CloseCode.SERVICE_RESTART if self.draining else P.CloseCode.TRY_AGAIN_LATER
            reason = P.CloseReason.SHUTDOWN if self.draining else P.CloseReason.OVER_CAPACITY
            self.metrics.closes.labels(str(int(code))).inc()
            await ws.close(code, reason)
            return
        conn = _Connection(self, ws)
        if isinstance(conn_in, ServerConnection):
            conn.client = self._client_of.pop(conn_in, None)
        self.connections.add(conn)
        if conn.client is not None:
            self._per_client[conn.client] += 1
        self._no_connections.clear()
        self.metrics.sessions.set(len(self.connections))
        self.metrics.sessions_total.inc()
        try:
            await conn.run()
        finally:
            if conn.client is not None:
                self._per_client[conn.client] -= 1
                if self._per_client[conn.client] <= 0:
                    del self._per_client[conn.client]
            self.connections.discard(conn)
            if not self.connections:
                self._no_connections.set()
            self.metrics.sessions.set(len(self.connections))
            self.metrics.closes.labels(str(conn.close_code)).inc()


class _Connection:
    def __init__(self, server: GatewayServer, ws: Transport) -> None:
        self.server = server
        self.ws = ws
        self.engine = server.engine
        self.metrics = server.metrics
        self.loop = asyncio.get_running_loop()
        self.sched = EngineScheduler.for_server(server)
        self.session = Session(
            secrets.token_hex(6),
            server.settings,
            self.loop.time(),
            observer=server.metrics.observer(),
        )
        self.log = self.session.log
        g = server.config.gateway
        self.send_timeout_s = g.send_timeout_ms / 1000.0
        self.marks = WaterMarks(high=g.write_limit_bytes, low=g.write_limit_bytes // 4)
        # control messages bypass the water marks (bounded by the message rate limit); this cap
        # catches anything else
        self.hard_cap_bytes = 16 * g.write_limit_bytes + 1_048_576
        self.outbound: deque[_Out] = deque()
        self.out_bytes = 0
        self.out_ready = asyncio.Event()
        self.close_req: Close | None = None
        self.runners: dict[str, _Runner] = {}
        self.abort_tasks: set[asyncio.Task[None]] = set()
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at: float | None = None
        self.done = False
        self.client: str | None = None
        """The client's address (behind trusted proxies: the forwarded one); None for HTTP requests."""
        with contextlib.suppress(Exception):
            sock = ws.raw_socket()
            if sock is not None:
                # bound kernel memory per connection too (Linux doubles the value)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, g.write_limit_bytes)

    @property
    def close_code(self) -> int:
        """The code this server closed with, else the one the client sent (1006: none)."""
        if self.close_req is not None:
            return int(self.close_req.code)
        return self.ws.close_code or P.ABNORMAL_CLOSE

    # ---- main loops ---------------------------------------------------------------------

    async def run(self) -> None:
        peer = self.ws.remote_address
        if self.client is not None and (not peer or self.client != str(peer[0])):
            self.log.info("connected from %s (client %s)", peer, self.client)
        else:
            self.log.info("connected from %s", peer)
        writer = asyncio.create_task(self._writer())
        # the idle timer runs from the handshake, not from the first message
        self._rearm_timer(self.loop.time())
        try:
            async for message in self.ws:
                if isinstance(message, bytes | bytearray | memoryview):
                    self.dispatch(self.session.on_binary_frame, bytes(message))
                else:
                    self.dispatch(self.session.on_text_frame, message)
        except ConnectionClosed:
            pass
        finally:
            self.dispatch(self.session.on_disconnect)
            self.done = True
            self._cancel_timer()
            for runner in self.runners.values():
                runner.task.cancel()
            tasks = [r.task for r in self.runners.values()] + list(self.abort_tasks)
            if tasks:
                await asyncio.wait(tasks, timeout=_ABORT_WAIT_S)
            self.out_ready.set()
            if not writer.done():
                writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await writer
            self.log.info("closed (code %s)", self.ws.close_code)

    async def _writer(self) -> None:
        ws = self.ws
        while True:
            while not self.outbound:
                if self.close_req is not None or self.done:
                    if self.close_req is not None:
                        await self._close(self.close_req)
                    return
                self.out_ready.clear()
                await self.out_ready.wait()
            item = self.outbound.popleft()
            try:
                async with asyncio.timeout(self.send_timeout_s):
                    if item.message is not None:
                        await ws.send_message(item.message, item.data)
                    else:
                        await ws.send_audio(item.data)
            except TimeoutError:
                self.outbound.clear()
                self.out_bytes = 0
                self.dispatch(self.session.on_slow_reader)
                if self.close_req is not None:
                    await self._close(self.close_req, abort=True)
                return
            except ConnectionClosed:
                return
            self.out_bytes -= len(item.data)
            if item.ttfa is not None:
                now = self.loop.time()
                t = item.ttfa
                self.metrics.observe_ttfa(t, now)
                self.log.info(
                    "utterance %d first audio after %.0f ms (text wait %.0f, queue %.0f, engine %.0f, "
                    "send %.0f)", item.utterance_id, 1000 * (now - t.first_text_s), 1000 * t.text_wait_s,
                    1000 * t.queue_s, 1000 * t.engine_s, 1000 * (now - t.first_chunk_s),
                    extra={"utterance": item.utterance_id},
                )
            if self.marks.update(self.out_bytes) is False:
                self.dispatch(self.session.on_send_buffer, False)

    async def _close(self, close: Close, abort: bool = False) -> None:
        self.log.info("closing: %d %s", int(close.code), close.reason.value)
        try:
            async with asyncio.timeout(_CLOSE_WAIT_S):
                await self.ws.close(int(close.code), close.reason.value)
        except (TimeoutError, ConnectionClosed):
            pass
        except Exception:
            self.log.exception("close failed")
        if abort or not self.ws.closed:
            self.ws.abort()

    # ---- events into the session, actions out -------------------------------------------

    def dispatch(self, fn: Callable[..., list[Action]], *args: Any) -> None:
        """Run one session event and carry out its actions, all as of one reading of the clock:
        a gate closed as of one instant while the timer that reopens it is skipped as of a later
        one (credit free by then) would leave a stream waiting for good."""
        now = self.loop.time()
        try:
            actions = fn(now, *args)
        except Exception:
            self.log.exception("session core failed")
            actions = self.session.on_internal_error(now)
        self._apply(actions, now)

    def _apply(self, actions: list[Action], now: float) -> None:
        for a in actions:
            if isinstance(a, SendAudio):
                self._enqueue(_Out(a.data, None, a.ttfa, a.utterance_id), now)
                self.metrics.audio_sent.inc(a.samples / self.session.rate_hz)
                self.metrics.frames_sent.inc()
            elif isinstance(a, SendMessage):
                self._enqueue(_Out(P.encode_server(a.message), a.message), now)
            elif isinstance(a, StartStream):
                self._start_stream(a.request, a.first)
            elif isinstance(a, AbortStream):
                self._abort_stream(a)
            elif isinstance(a, Close):
                if self.close_req is None:
                    self.close_req = a
                self.out_ready.set()
        if not self.done:
            self._sync_gates(now)
            self._rearm_timer(now)

    def _enqueue(self, item: _Out, now: float) -> None:
        """Queue ``item`` for the writer, as of the event's instant ``now``."""
        if self.close_req is not None:
            return
        self.outbound.append(item)
        self.out_bytes += len(item.data)
        self.out_ready.set()
        if self.marks.update(self.out_bytes) is True:
            self.session.on_send_buffer(now, True)  # congested: no actions
        if self.out_bytes > self.hard_cap_bytes:
            self.log.warning("outbound over %d bytes: slow reader", self.hard_cap_bytes)
            self.outbound.clear()
            self.out_bytes = 0
            self._apply(self.session.on_slow_reader(now), now)

    def _sync_gates(self, now: float) -> None:
        for rid, runner in self.runners.items():
            if self.session.may_pull(now, rid):
                runner.gate.set()
            else:
                runner.gate.clear()

    def _rearm_timer(self, now: float) -> None:
        at = self.session.next_deadline_s(now)
        if at == self.timer_at and self.timer is not None:
            return
        self._cancel_timer()
        if at is not None:
            self.timer_at = at
            self.timer = self.loop.call_at(max(at, now + 0.001), self._on_timer)

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = None
        self.timer_at = None

    def _on_timer(self) -> None:
        self.timer = None
        self.timer_at = None
        if not self.done:
            self.dispatch(self.session.on_timer)

    # ---- engine streams -----------------------------------------------------------------

    def _start_stream(self, request: SpeechRequest, first: bool) -> None:
        rid = request.request_id
        refusal: AdmissionDecision | None = None
        if first:
            decision = self.sched.admit()
            if decision is not None and not decision.admit:
                refusal = decision
                self.metrics.admission_refused.inc()
        gate = asyncio.Event()
        task = asyncio.create_task(self._run_stream(request, gate, refusal),
                                   name=f"stream {rid}")
        self.runners[rid] = _Runner(task, gate)

    def _abort_stream(self, a: AbortStream) -> None:
        runner = self.runners.pop(a.request_id, None)
        if runner is not None:
            runner.task.cancel()
        if a.engine_running:
            t = asyncio.create_task(self._engine_abort(a.request_id))
            self.abort_tasks.add(t)
            t.add_done_callback(self.abort_tasks.discard)

    async def _engine_abort(self, request_id: str) -> None:
        try:
            await self.engine.abort(request_id)
        except Exception:
            self.log.exception("engine abort of %s failed", request_id)

    async def _run_stream(self, request: SpeechRequest, gate: asyncio.Event,
                          refusal: AdmissionDecision | None = None) -> None:
        rid = request.request_id
        sched = self.sched
        it = None
        steps = 0
        try:
            if refusal is not None:
                raise EngineOverloaded(f"admission: {refusal.reason}", retry_after_ms=refusal.retry_after_ms)
            it = self.engine.synthesize(request)
            t_prev: float | None = None
            while True:
                paused = not gate.is_set()
                await gate.wait()
                try:
                    chunk = await anext(it)
                except StopAsyncIteration:
                    sched.observe_segment(steps)
                    self.dispatch(self.session.on_stream_end, rid)
                    return
                now = self.loop.time()
                sched.observe_chunk(chunk.steps, None if paused or t_prev is None else now - t_prev)
                t_prev = now
                steps += chunk.steps
                self.dispatch(self.session.on_audio, rid, chunk)
                if chunk.finished:
                    sched.observe_segment(steps)
                    return
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # this stream's own cancel (abort, disconnect, shutdown)
            # a future cancelled under the engine, not this task: a failure the session must hear
            # of, or the stream would stay "generating" with no error and no end
            self.log.error("engine stream %s: cancelled inside the engine", rid)
            self.dispatch(self.session.on_engine_error, rid, EngineFailure.RECOVERABLE)
        except EngineOverloaded as exc:
            self.log.warning("engine overloaded on %s: %s", rid, exc)
            self.dispatch(self.session.on_engine_error, rid, EngineFailure.OVERLOADED, exc.retry_after_ms)
        except EngineError as exc:
            self.log.error("engine error on %s: %s", rid, exc)
            kind = EngineFailure.UNRECOVERABLE if exc.kind is EngineErrorKind.UNRECOVERABLE \
                else EngineFailure.RECOVERABLE
            self.dispatch(self.session.on_engine_error, rid, kind)
        except Exception:
            self.log.exception("engine stream %s failed", rid)
            self.dispatch(self.session.on_engine_error, rid, EngineFailure.RECOVERABLE)
        finally:
            cur = self.runners.get(rid)
            if cur is not None and cur.task is asyncio.current_task():
                del self.runners[rid]
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()


def _fixed_library_close_reasons(ws: ServerConnection) -> None:
    """Closes that the WebSocket library fails the connection with (a malformed frame, invalid
    UTF-8, an oversize message) carry a fixed reason (``P.LIBRARY_CLOSE_REASONS``), not the
    library's exception text. Per connection: the library itself is not patched."""
    protocol = getattr(ws, "protocol", None)
    fail = getattr(protocol, "fail", None)
    if fail is None:
        return

    def fixed_fail(code: Any, reason: str = "") -> None:
        fixed = P.LIBRARY_CLOSE_REASONS.get(int(code))
        fail(code, fixed.value if fixed is not None else "")

    protocol.fail = fixed_fail  # type: ignore[union-attr]

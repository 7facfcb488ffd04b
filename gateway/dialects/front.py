"""HTTP requests with a body on the gateway's port: ``POST /v1/audio/speech`` (OpenAI),
``POST /v1/text-to-speech/{voice_id}[/stream]`` (ElevenLabs), ``POST /v1/speak`` (Deepgram REST).

websockets' HTTP layer reads only GET requests without a body, and answers with one complete
response (``process_request``): it can neither read a JSON body nor stream audio back. So the
listening socket's connections are sniffed first (``front_connection``, the ``create_connection``
factory handed to ``websockets.serve``): a request line starting ``GET `` (WebSocket upgrades, the
demo page, /healthz, /metrics: everything as before) goes on to websockets untouched; any other
method is taken off websockets' hands (``transport.set_protocol``) and served here with h11, one
request per connection (``Connection: close``), the response streamed with chunked transfer
encoding.

A speech request runs as a session of the gateway (``Host.handle``), like a WebSocket client:
``HttpExchange`` is the duck-typed connection ``server._Connection`` drives, and
``openai.SpeechResponder`` / ``http.AudioResponder`` (ElevenLabs', Deepgram's) turn the session's audio into the
response body. Refusals come in the vendor's error shape (the path says which vendor).
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import http
import logging
import re
from collections.abc import AsyncIterator
from typing import Any, Final
from urllib.parse import parse_qs, urlsplit

import h11
from websockets.asyncio.server import ServerConnection

from gateway import protocol as P
from gateway.dialects import deepgram, elevenlabs, openai, refusals
from gateway.dialects.base import FieldError, Host, parse_int, token_matches
from gateway.dialects.http import Abort, AudioResponder, Body, End, Head, HttpOut, VendorError
from gateway.dialects.socket import Inbox
from gateway.responses import request_id
from gateway.transport import ClientItem

log = logging.getLogger("voicegw.dialects.front")

_MAX_HEAD_BYTES: Final = 16 * 1024
"""The request line and headers, counted on the raw bytes as they arrive (431 over it)."""
_HEAD_END: Final = re.compile(rb"\r?\n\r?\n")
_LINGER_S: Final = 2.0
_LINGER_MAX_BYTES: Final = 8 * 1024 * 1024
"""Lingering close: after a refusal the gateway shuts its side down and reads (and discards) what
the client still sends, for at most this long and this many bytes, before closing: a socket
closed with request bytes unread makes the kernel send RST, and the client may never see the
refusal (ECONNRESET while it is still sending a body the gateway refused)."""
_SNIFF_BYTES: Final = 8
"""The longest method we route ("OPTIONS " is 8 bytes)."""


def classify(head: bytes) -> str | None:
    """``"ws"`` (leave to websockets), ``"http"`` (serve here) or None (need more bytes)."""
    sp = head.find(b" ", 0, _SNIFF_BYTES + 1)
    if sp == -1:
        if len(head) > _SNIFF_BYTES or not head.isalpha():
            return "ws"  # not a method we serve: websockets answers it as before
        return None
    method = head[:sp]
    if method == b"GET" or not (method.isalpha() and method.isupper()):
        return "ws"
    return "http"


def front_connection(server: Host) -> type[ServerConnection]:
    """A ``ServerConnection`` subclass that hands non-GET requests to ``HttpExchangeProtocol``."""

    open_timeout_s = server.config.gateway.open_timeout_s
    # websockets answers pings (and a close) in data_received, bypassing the gateway's own send
    # accounting: a peer that sends pings and never reads would grow the write buffer without bound.
    # The same hard cap as the session's outbound queue (gateway/server.py) bounds it.
    max_write_buffer_bytes = 16 * server.config.gateway.write_limit_bytes + 1_048_576

    class FrontConnection(ServerConnection):
        _sniffing = True
        _diverted = False
        _sniffed = b""
        _raw: asyncio.Transport | None = None
        _timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            # websockets starts its handshake task in connection_made: wait until the request line
            # says the connection is for websockets
            self._raw = transport  # type: ignore[assignment]
            self._timer = self.loop.call_later(open_timeout_s, transport.abort)  # type: ignore[attr-defined]

        def data_received(self, data: bytes) -> None:
            if not self._sniffing:
                super().data_received(data)
                self._check_write_buffer()
                return
            self._sniffed += data
            kind = classify(self._sniffed)
            if kind is None:
                return
            self._sniffing = False
            if self._timer is not None:
                self._timer.cancel()
            buf, self._sniffed = self._sniffed, b""
            transport = self._raw
            assert transport is not None
            if kind == "ws":
                super().connection_made(transport)
                super().data_received(buf)
                self._check_write_buffer()
                return
            self._diverted = True
            proto = HttpExchangeProtocol(server)
            transport.set_protocol(proto)
            proto.connection_made(transport)
            proto.data_received(buf)

        def _check_write_buffer(self) -> None:
            transport = self._raw
            if transport is not None and not transport.is_closing() \
                    and transport.get_write_buffer_size() > max_write_buffer_bytes:
                log.warning("peer %s does not read (write buffer over %d bytes): aborting",
                            transport.get_extra_info("peername"), max_write_buffer_bytes)
                transport.abort()

        def eof_received(self) -> None:
            if self._sniffing:
                return None  # the transport closes itself
            super().eof_received()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._sniffing or self._diverted:
                if self._timer is not None:
                    self._timer.cancel()
                return
            super().connection_lost(exc)

    return FrontConnection


def _date() -> str:
    return email.utils.formatdate(usegmt=True)


class HttpExchangeProtocol(asyncio.Protocol):
    """One HTTP/1.1 request on a diverted connection."""

    def __init__(self, server: Host) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        lim = server.config.limits
        self.max_body_bytes = max(lim.max_message_bytes, 4 * lim.max_utterance_chars + 4096)
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD_BYTES)
        self.transport: asyncio.Transport | None = None
        self.request: h11.Request | None = None
        self.body = bytearray()
        self.lost = False
        self.closed = asyncio.Event()
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Task[None] | None = None
        self.exchange: HttpExchange | None = None
        self.request_id = request_id()
        self.vendor: refusals.Vendor | None = None
        self._head = b""
        """The raw head so far (until its end is seen, at most ``_MAX_HEAD_BYTES`` + 4 bytes)."""
        self._head_done = False
        self._lingering = False
        self._linger_left = _LINGER_MAX_BYTES
        self._linger_timer: asyncio.TimerHandle | None = None

    # ---- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        g = self.server.config.gateway
        self.transport.set_write_buffer_limits(high=g.write_limit_bytes)  # type: ignore[union-attr]
        self._timer = self.loop.call_later(g.open_timeout_s, self._request_timeout)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            self._discard(len(data))
            return
        if self.task is not None:
            return  # one request per connection: anything after the body is ignored
        if not self._head_done and self._head_too_large(data):
            self._respond_now(refusals.head_too_large(self._vendor_from_raw(), _MAX_HEAD_BYTES,
                                                      self.request_id))
            return
        try:
            self.h11.receive_data(data)
            self._next_events()
        except h11.RemoteProtocolError as exc:
            status = exc.error_status_hint if 400 <= exc.error_status_hint < 500 else 400
            vendor = self.vendor or self._vendor_from_raw()
            if vendor is None:
                self._respond_now(_text_error(status, "bad request"))
            else:
                self._respond_now(refusals.refusal(vendor, status, "bad_request", "malformed HTTP request",
                                                   request_id=self.request_id))

    def _head_too_large(self, data: bytes) -> bool:
        """The 16 KiB head limit on the raw bytes (h11's own limit applies only to a head that
        arrives in pieces): True when the head is over it."""
        room = _MAX_HEAD_BYTES + 4 - len(self._head)
        self._head += data[:max(room, 0)]
        start = len(self._head) - len(self._head.lstrip(b"\r\n"))  # blank lines before the request line
        m = _HEAD_END.search(self._head, start)
        if m is None:
            return len(self._head) > _MAX_HEAD_BYTES
        self._head_done = True
        return m.end() > _MAX_HEAD_BYTES

    def _vendor_from_raw(self) -> refusals.Vendor | None:
        """Whose path the raw request line names (for refusals before h11 has the request)."""
        line = self._head.lstrip(b"\r\n").split(b"\n", 1)[0]
        words = line.split(b" ")
        if len(words) < 2:
            return None
        try:
            return refusals.vendor_of(urlsplit(words[1].decode("ascii", "replace")).path)
        except ValueError:
            return None

    def eof_received(self) -> bool | None:
        if self._lingering:
            return None  # the client is done: close (our answer is already out)
        if self.task is not None:
            return True  # a client that half-closes after its request still gets the whole response
        # the client half-closed before its request was complete: a 400 it can still read (none
        # when it sent nothing at all), then close
        try:
            self.h11.receive_data(b"")
            self._next_events()
        except h11.RemoteProtocolError:
            vendor = self.vendor or self._vendor_from_raw()
            self._respond_now(_text_error(400, "incomplete request") if vendor is None else
                              refusals.refusal(vendor, 400, "bad_request", "incomplete request",
                                               request_id=self.request_id))
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.closed.set()
        self._can_write.set()
        if self._timer is not None:
            self._timer.cancel()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        if self.exchange is not None:
            self.exchange.on_lost()

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    # ---- request ------------------------------------------------------------------------------

    def _next_events(self) -> None:
        while self.task is None and not self.lost:
            event = self.h11.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.Request):
                self.request = event
                refusal = self._check_head(event)
                if refusal is not None:
                    self._respond_now(refusal)
                    return
                if self.h11.they_are_waiting_for_100_continue:
                    self._write(self.h11.send(h11.InformationalResponse(status_code=100, headers=[])))
            elif isinstance(event, h11.Data):
                self.body += event.data
                if len(self.body) > self.max_body_bytes:
                    self._respond_now(refusals.too_large(self.vendor, self.max_body_bytes, self.request_id))
                    return
            elif isinstance(event, h11.EndOfMessage):
                if self._timer is not None:
                    self._timer.cancel()
                self.task = self.loop.create_task(self._serve())
                return
            elif isinstance(event, h11.ConnectionClosed):
                return

    def _check_head(self, req: h11.Request) -> _Refusal | None:
        target = req.target.decode("ascii", "replace")
        parts = urlsplit(target)
        method = req.method.decode("ascii", "replace")
        self.vendor = refusals.vendor_of(parts.path)
        if self.vendor is None:
            if parts.path.startswith(("/v1/", "/v2/")):  # 404 in the shape of the client's vendor (by its key)
                if _header(req, b"xi-api-key") is not None:
                    return refusals.refusal("elevenlabs", 404, "not_found", f"{parts.path[:256]} not found")
                if (_header(req, b"authorization") or "").partition(" ")[0].lower() == "token":
                    return refusals.refusal("deepgram", 404, "NOT_FOUND", f"{parts.path[:256]} not found",
                                            request_id=self.request_id)
                return openai.ApiError(404, f"Invalid URL ({method} {parts.path[:256]})")
            return _Plain(405, "method not allowed", (("Allow", "GET"),))
        if method != "POST":
            return self._error(405, "method_not_allowed", f"Method {method[:16]} is not allowed here; use POST.",
                               (("Allow", "POST"),))
        length = _header(req, b"content-length")
        if length is not None:
            try:
                parse_int(length, "Content-Length", 0, self.max_body_bytes)
            except FieldError:  # h11 has checked it is a number: over the limit
                return refusals.too_large(self.vendor, self.max_body_bytes, self.request_id)
        if self.server.draining:
            self.server.metrics.rejected.labels("shutdown").inc()
            return refusals.shutting_down(self.vendor, self.request_id)
        tokens = self.server.config.gateway.auth_tokens
        if tokens:
            candidates = parse_qs(parts.query).get("token", [])
            auth = _header(req, b"authorization") or ""
            scheme, _, value = auth.partition(" ")
            if scheme.lower() in ("bearer", "token") and value.strip():
                candidates.append(value.strip())
            xi = _header(req, b"xi-api-key")
            if xi:
                candidates.append(xi)
            if not token_matches(candidates, tokens):
                self.server.metrics.rejected.labels("auth").inc()
                return refusals.unauthorized(self.vendor, self.request_id)
        return None

    def _error(self, status: int, code: str, message: str, headers: tuple[tuple[str, str], ...] = ()) -> _Refusal:
        """A refusal in the shape of the vendor whose path this is (``refusals``)."""
        return refusals.refusal(self.vendor, status, code, message, headers, self.request_id)

    def _request_timeout(self) -> None:
        self._timer = None
        if self.task is None and not self.lost:
            self._respond_now(self._error(408, "request_timeout", "request not received in time"))

    async def _serve(self) -> None:
        lim = self.server.config.limits
        assert self.request is not None
        parts = urlsplit(self.request.target.decode("ascii", "replace"))
        responder: Responder
        try:
            if self.vendor == "openai":
                body = openai.parse_body(bytes(self.body),
                                         max_input_chars=min(lim.max_utterance_chars, lim.openai_max_input_chars))
                responder = openai.SpeechResponder(body)
            elif self.vendor == "elevenlabs":
                responder = elevenlabs.http_responder(elevenlabs.parse_http(
                    parts.path, parts.query, bytes(self.body),
                    min(lim.max_utterance_chars, lim.elevenlabs_max_text_chars), self.request_id))
            else:
                responder = AudioResponder(deepgram.parse_http(
                    parts.query, bytes(self.body), min(lim.max_utterance_chars, lim.deepgram_max_text_chars)))
        except (openai.ApiError, VendorError) as err:
            if isinstance(err, deepgram.DeepgramError):
                err.request_id = self.request_id
            self._respond_now(err)
            return
        except Exception:  # a bug, not the client's doing: a 500 without the exception's text
            log.exception("speech request parsing failed")
            self._respond_now(refusals.internal_error(self.vendor, self.request_id))
            return
        exchange = self.exchange = HttpExchange(self, responder)
        try:
            await self.server.handle(exchange)
        except Exception:
            log.exception("speech request failed")
        finally:
            exchange.finish(abort=not exchange.done)

    # ---- response -----------------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        if data and self.transport is not None and not self.lost:
            self.transport.write(data)

    async def drain(self) -> None:
        await self._can_write.wait()

    def send_head(self, status: int, headers: tuple[tuple[str, str], ...], length: int | None = None) -> None:
        hdrs = [("Date", _date()), ("Server", "voicegw"), ("Connection", "close"),
                ("X-Content-Type-Options", "nosniff"), ("x-request-id", self.request_id), *headers]
        if length is not None:
            hdrs.append(("Content-Length", str(length)))
        reason = http.HTTPStatus(status).phrase.encode() if status in http.HTTPStatus._value2member_map_ else b""
        self._write(self.h11.send(h11.Response(status_code=status, headers=hdrs, reason=reason)))

    def send_body(self, data: bytes) -> None:
        self._write(self.h11.send(h11.Data(data=data)))

    def end(self) -> None:
        self._write(self.h11.send(h11.EndOfMessage()))
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def _respond_now(self, err: _Refusal) -> None:
        """A complete response outside a session (refusals), then a lingering close."""
        if self._timer is not None:
            self._timer.cancel()
        try:
            body = err.body()
            ctype = "text/plain; charset=utf-8" if isinstance(err, _Plain) else "application/json"
            self.send_head(err.status, (("Content-Type", ctype), *err.headers), len(body))
            self.send_body(body)
            self._write(self.h11.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:
            self.abort()
            return
        self._linger()

    def _linger(self) -> None:
        """Lingering close (``_LINGER_S``): shut our side down (the client sees the end of the
        answer), discard what the client still sends, close at its EOF or at the bounds."""
        t = self.transport
        if t is None or self.lost or self._lingering:
            return
        self._lingering = True
        if t.can_write_eof():
            t.write_eof()
        self._linger_timer = self.loop.call_later(_LINGER_S, t.close)

    def _discard(self, n: int) -> None:
        self._linger_left -= n
        if self._linger_left < 0 and self.transport is not None:
            self.transport.close()


class _Plain:
    def __init__(self, status: int, text: str, headers: tuple[tuple[str, str], ...] = ()) -> None:
        self.status = status
        self.text = text
        self.headers = headers

    def body(self) -> bytes:
        return (self.text + "\n").encode()


_Refusal = refusals.Refusal | _Plain
Responder = openai.SpeechResponder | AudioResponder


def _text_error(status: int, text: str) -> _Plain:
    return _Plain(status if 400 <= status < 600 else 400, text)


def _header(req: h11.Request, name: bytes) -> str | None:
    for k, v in req.headers:
        if k == name:
            return v.decode("latin-1")
    return None


class HttpExchange:
    """A ``Transport`` for ``server._Connection`` that answers one speech request."""

    def __init__(self, proto: HttpExchangeProtocol, responder: Responder,
                 report_interval_s: float = 0.1) -> None:
        self.proto = proto
        self.responder = responder
        self.report_interval_s = report_interval_s
        self.done = False
        self._inbox: Inbox | None = None
        self._lost_early = False
        self._close_code: int | None = None
        self._delivered = 0

    @property
    def remote_address(self) -> Any:
        t = self.proto.transport
        return t.get_extra_info("peername") if t is not None else None

    @property
    def close_code(self) -> int | None:
        return self._close_code

    @property
    def closed(self) -> bool:
        return self.done or self.proto.lost

    def abort(self) -> None:
        self.proto.abort()

    def raw_socket(self) -> Any:
        t = self.proto.transport
        return t.get_extra_info("socket") if t is not None else None

    def __aiter__(self) -> AsyncIterator[ClientItem]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[ClientItem]:
        inbox = self._inbox = Inbox(cap=8, report_interval_s=self.report_interval_s)
        for m in self.responder.opening():
            inbox.put_nowait(m)
        if self._lost_early or self.proto.lost:
            inbox.end()
        while (item := await inbox.get()) is not None:
            yield item

    def on_lost(self) -> None:
        if not self.done:
            self._close_code = self._close_code or P.ABNORMAL_CLOSE
        if self._inbox is not None:
            self._inbox.end()
        else:
            self._lost_early = True

    async def send_message(self, message: P.ServerMessage, encoded: bytes) -> None:
        await self._emit(self.responder.on_server_message(message))

    async def send_audio(self, frame: bytes) -> None:
        header, payload = P.unpack_audio_frame(frame)
        outs = self.responder.on_server_audio(header, payload)
        self._delivered += len(payload) // 2
        await self._emit(outs)
        if self._inbox is not None and not self.done:
            self._inbox.report(self._delivered)

    async def close(self, code: int = P.CloseCode.NORMAL, reason: str = "") -> None:
        if self._close_code is None:
            self._close_code = code
        await self._emit(self.responder.on_server_close(code, reason))
        self.finish(abort=not self.done)

    async def _emit(self, outs: list[HttpOut]) -> None:
        try:
            await self._emit_all(outs)
        except h11.LocalProtocolError:
            # a response h11 will not send (a bug: a header value it refuses): cut the connection
            # rather than leave the client waiting on a session nobody writes for
            log.exception("response not sendable: aborting the request")
            self.proto.abort()
            self._finished(P.CloseCode.INTERNAL_ERROR)

    async def _emit_all(self, outs: list[HttpOut]) -> None:
        p = self.proto
        for o in outs:
            if self.done:
                return
            if isinstance(o, Head):
                p.send_head(o.status, o.headers)
            elif isinstance(o, Body):
                p.send_body(o.data)
                await p.drain()
            elif isinstance(o, End):
                p.end()
                self._finished(P.CloseCode.NORMAL)
            elif isinstance(o, Abort):
                p.abort()
                self._finished(P.CloseCode.INTERNAL_ERROR)

    def _finished(self, code: int) -> None:
        self.done = True
        if self._close_code is None:
            self._close_code = code
        if self._inbox is not None:
            self._inbox.end()
        else:
            self._lost_early = True

    def finish(self, abort: bool) -> None:
        """The session is over: make sure the connection is too."""
        if not self.done:
            self._finished(P.CloseCode.INTERNAL_ERROR if abort else P.CloseCode.NORMAL)
            with contextlib.suppress(Exception):
                self.proto.abort() if abort else self.proto.end()

"""The ecosystem's TTS dialects on the gateway's port, as thin adapters onto protocol v1. One module
per vendor holds that vendor's WebSocket and HTTP handlers side by side:

* ``openai.py``: OpenAI ``POST /v1/audio/speech``;
* ``elevenlabs.py``: ElevenLabs ``/v1/text-to-speech/{voice_id}/stream-input`` and
  ``multi-stream-input`` WebSockets, and ``POST /v1/text-to-speech/{voice_id}[/stream]
  [/with-timestamps]``;
* ``deepgram.py``: Deepgram ``/v1/speak``, WebSocket and ``POST`` (REST).

Shared by the vendors: ``base.py`` (the translator step, turns, alignment, the one numeric
parser), ``http.py`` (the HTTP responders' outputs, the vendor error base, the audio responder
ElevenLabs' and Deepgram's ``POST`` share), ``refusals.py`` (one refusal builder per vendor
shape), ``audio.py`` (encoders), ``voices.py``, ``listings.py`` (``GET /v1/models``,
``/v1/voices``, ``/v1/audio/voices``); the I/O: ``front.py`` (requests that are not GET, with
h11), ``socket.py`` (a dialect WebSocket as a ``Transport``).

Every response carries ``x-request-id`` (clients log it; LiveKit warns without it).

Every dialect connection runs one native session (``gateway/session.py``) through the same
``server._Connection`` as a native client: same engine, scheduler, limits, flow control, metrics.
``gateway/server.py`` calls four hooks from here:

* ``front_connection(server)``: the ``create_connection`` of ``websockets.serve`` (diverts
  requests that are not GET to ``front.py``);
* ``process_request(server, request)``: handshakes on paths other than ``/ws``;
* ``select_subprotocol(conn, offered)``: Deepgram's ``token`` subprotocol (browser auth);
* ``adapt(server, ws)``: wraps a dialect WebSocket so the native connection code can drive it.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from gateway import protocol as P
from gateway.dialects import deepgram, elevenlabs, listings, refusals
from gateway.dialects.base import Host, token_matches
from gateway.dialects.front import front_connection
from gateway.dialects.socket import DialectSocket
from gateway.responses import json_response, request_id, response, text_response
from gateway.transport import NativeTransport, Transport

__all__ = ["adapt", "front_connection", "get_listing", "process_request", "request_id", "select_subprotocol"]

log = logging.getLogger("voicegw.dialects")

_DEEPGRAM_SUBPROTOCOLS = ("token", "bearer")


def get_listing(server: Host, request: Request, path: str, query: str) -> Response:
    """``GET /v1/...`` or ``/v2/...`` without an upgrade: a listing or a 404, in the asking client's shape."""
    tokens = server.config.gateway.auth_tokens
    if tokens and not token_matches(_credentials(request.headers, query), tokens):
        server.metrics.rejected.labels("auth").inc()
        who = listings.vendor(request.headers)
        return refusal_response(refusals.unauthorized(who, str(uuid.uuid4()) if who == "deepgram" else ""))
    rid = request_id()
    status, obj = listings.answer(path, request.headers, rid, query)
    return json_response(status, obj, [("x-request-id", rid)])


def _dialect_of(path: str) -> refusals.Vendor | None:
    """The WebSocket dialect a handshake path belongs to (``refusals.vendor_of``; OpenAI has no
    WebSocket dialect: its path is a 404 here, as any other)."""
    vendor = refusals.vendor_of(path)
    return None if vendor == "openai" else vendor


def _offered(headers: Headers) -> list[str]:
    return [p.strip() for h in headers.get_all("Sec-WebSocket-Protocol") for p in h.split(",")]


def _credentials(headers: Headers, query: str) -> list[str]:
    """Every place a dialect client may put its key: ``Authorization: Bearer|Token <key>``,
    ``xi-api-key``, subprotocols ``token, <key>`` / ``voicegw.token.<key>``, ``?token=``."""
    out: list[str] = []
    auth = headers.get("Authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() in ("bearer", "token") and value.strip():
        out.append(value.strip())
    if headers.get("xi-api-key"):
        out.append(headers["xi-api-key"])
    offered = _offered(headers)
    for i, p in enumerate(offered):
        if p in _DEEPGRAM_SUBPROTOCOLS and i + 1 < len(offered):
            out.append(offered[i + 1])
        if p.startswith(P.TOKEN_SUBPROTOCOL_PREFIX):
            out.append(p[len(P.TOKEN_SUBPROTOCOL_PREFIX):])
    out += parse_qs(query).get("token", [])
    return out


def refusal_response(err: refusals.Refusal, headers: tuple[tuple[str, str], ...] = ()) -> Response:
    """A dialect refusal (``refusals.refusal``: the same objects the HTTP side answers with) as a
    WebSocket handshake response."""
    extra = list(err.headers) + list(headers)
    rid = getattr(err, "request_id", "")
    if rid:
        extra.append(("x-request-id", rid))
    return response(err.status, err.body(), "application/json", extra)


def process_request(server: Host, request: Request) -> Response | None:
    """A WebSocket handshake on a path other than ``/ws``: 404 unless a dialect's; else the
    dialect's refusal in its shape (``refusals``: draining 503, origin 403, auth 401, parameters
    400/404, capacity 503), or None to accept. No client input reaches a 500: an unexpected
    exception is logged and answered 500 in the dialect's shape, with no exception text."""
    try:
        parts = urlsplit(request.path)
    except ValueError:
        return text_response(400, "bad request target")
    dialect = _dialect_of(parts.path)
    if dialect is None:
        if parts.path.startswith(("/v1/", "/v2/")):  # in the shape of the client's vendor, as a GET's
            rid = request_id()
            status, obj = listings.not_found(listings.vendor(request.headers), parts.path, rid)
            return json_response(status, obj, [("x-request-id", rid)])
        return text_response(404, "not found")
    rid = str(uuid.uuid4()) if dialect == "deepgram" else ""
    try:
        return _refuse_handshake(server, request, parts.path, parts.query, dialect, rid)
    except Exception:
        log.exception("dialect handshake check failed")
        return refusal_response(refusals.internal_error(dialect, rid))


def _refuse_handshake(server: Host, request: Request, path: str, query: str, dialect: refusals.Vendor,
                      rid: str) -> Response | None:
    if server.draining:
        server.metrics.rejected.labels("shutdown").inc()
        return refusal_response(refusals.shutting_down(dialect, rid))
    if not server.origin_ok(request.headers):
        server.metrics.rejected.labels("origin").inc()
        return refusal_response(refusals.origin_refused(dialect, rid))
    tokens = server.config.gateway.auth_tokens
    creds = _credentials(request.headers, query)
    if tokens and not token_matches(creds, tokens):
        # ElevenLabs clients may send the key in their first message instead
        if dialect != "elevenlabs" or creds:
            server.metrics.rejected.labels("auth").inc()
            return refusal_response(refusals.unauthorized(dialect, rid))
    try:
        if dialect == "deepgram":
            deepgram.parse_query(query)
        else:
            elevenlabs.parse_request(path, query)
    except deepgram.QueryError as exc:
        server.metrics.rejected.labels("params").inc()
        return refusal_response(refusals.refusal(dialect, 400, exc.err_code, exc.err_msg, request_id=rid),
                                (("dg-error", refusals.header_safe(exc.err_msg)),))
    except elevenlabs.HandshakeError as exc:
        server.metrics.rejected.labels("params").inc()
        return refusal_response(refusals.refusal(dialect, exc.http_status, exc.status, exc.message))
    if len(server.connections) >= server.config.limits.max_sessions:
        server.metrics.rejected.labels("capacity").inc()
        return refusal_response(refusals.over_capacity(dialect, rid))
    return None


def select_subprotocol(conn: ServerConnection, offered: Any) -> Subprotocol | None:
    """Deepgram browser clients authenticate with subprotocols ``token, <key>``: select ``token``."""
    req = conn.request
    if req is not None and urlsplit(req.path).path == deepgram.PATH:
        for p in _DEEPGRAM_SUBPROTOCOLS:
            if p in offered:
                return Subprotocol(p)
    return None


def adapt(server: Host, ws: ServerConnection | Transport) -> Transport:
    """The transport ``server._Connection`` drives: ``NativeTransport`` for the native protocol,
    a ``DialectSocket`` for a dialect's WebSocket (HTTP exchanges come already adapted)."""
    if not isinstance(ws, ServerConnection):
        return ws
    if ws.request is None:
        return NativeTransport(ws)
    parts = urlsplit(ws.request.path)
    dialect = _dialect_of(parts.path)
    if dialect == "deepgram":
        return DialectSocket(ws, deepgram.DeepgramTranslator(deepgram.parse_query(parts.query),
                                                             model_version=deepgram.model_version(server.engine_name)))
    if dialect == "elevenlabs":
        tokens = server.config.gateway.auth_tokens
        check = None
        if tokens and not token_matches(_credentials(ws.request.headers, parts.query), tokens):
            def check(key: str) -> bool:
                return token_matches([key], tokens)
        options = elevenlabs.parse_request(parts.path, parts.query)
        # without a key at the handshake, the key must come in a first message within the opening
        # deadline (else close 1008): a key-less connection must not hold a session seat
        auth_timeout_s = server.config.gateway.open_timeout_s if check is not None else None
        translator: Any = (elevenlabs.ElevenLabsMultiTranslator(options, check) if options.multi
                           else elevenlabs.ElevenLabsTranslator(options, check))
        return DialectSocket(ws, translator, auth_timeout_s=auth_timeout_s)
    return NativeTransport(ws)

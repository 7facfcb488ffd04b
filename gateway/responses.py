"""Complete HTTP responses of the websockets side of the port (``process_request`` answers: the
native door, /healthz, /metrics, static files, the dialects' handshake refusals and listings).

One builder for all of them (``response``), imported by ``gateway/server.py`` and
``gateway/dialects``; it imports nothing of the gateway, so neither side cycles through it. The
HTTP side (requests that are not GET, ``gateway/dialects/front.py``) streams its own responses
with h11.
"""

from __future__ import annotations

import email.utils
import http
import secrets
from typing import Any

import orjson
from websockets.datastructures import Headers
from websockets.http11 import Response

__all__ = ["json_response", "request_id", "response", "text_response"]


def response(status: int, body: bytes, content_type: str, headers: list[tuple[str, str]] | None = None,
             ) -> Response:
    """One response with exactly one of each framing header (``Headers[k] = v`` appends in
    websockets, so the headers are built once, never overwritten)."""
    st = http.HTTPStatus(status)
    hdrs = Headers([
        ("Date", email.utils.formatdate(usegmt=True)),
        ("Connection", "close"),
        ("Content-Length", str(len(body))),
        ("Content-Type", content_type),
        ("Cache-Control", "no-cache"),
        ("X-Content-Type-Options", "nosniff"),
    ])
    for k, v in headers or []:
        hdrs[k] = v
    return Response(st.value, st.phrase, hdrs, body)


def json_response(status: int, obj: Any, headers: list[tuple[str, str]] | None = None) -> Response:
    return response(status, orjson.dumps(obj), "application/json", headers)


def text_response(status: int, text: str, headers: list[tuple[str, str]] | None = None) -> Response:
    return response(status, (text + "\n").encode(), "text/plain; charset=utf-8", headers)


def request_id() -> str:
    """A fresh ``x-request-id`` value (every answer carries one; clients log it)."""
    return "req_" + secrets.token_hex(12)

"""ONE refusal builder per dialect shape (pure), used by the HTTP side (``front.py``: every
refusal of a ``POST``, the body parsers' errors), the WebSocket handshakes (``process_request``
in ``gateway/dialects/__init__.py``) and the listings' 401:

* OpenAI: ``{"error": {"message", "type", "param", "code"}}`` (``openai.ApiError``);
* ElevenLabs: ``{"detail": {"status", "message"}}`` (``elevenlabs.ElevenLabsError``);
* Deepgram: ``{"err_code", "err_msg", "request_id"}`` (``deepgram.DeepgramError``; an
  ``UPPER_CASE`` code; the generic refusals use the codes of ``DEEPGRAM_CODES``).

Messages are fixed text chosen by the gateway: never an exception's text.
"""

from __future__ import annotations

from typing import Final, Literal

from gateway.dialects import deepgram, elevenlabs, openai
from gateway.dialects.base import header_safe
from gateway.dialects.http import VendorError

__all__ = ["DEEPGRAM_CODES", "Refusal", "Vendor", "header_safe", "refusal", "vendor_of"]

Vendor = Literal["openai", "elevenlabs", "deepgram"]
Refusal = openai.ApiError | VendorError

#: Deepgram ``err_code`` of the generic refusals, by HTTP status.
DEEPGRAM_CODES: Final[dict[int, str]] = {
    400: "BAD_REQUEST", 401: "INVALID_AUTH", 403: "FORBIDDEN", 404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED",
    408: "REQUEST_TIMEOUT", 413: "PAYLOAD_TOO_LARGE", 431: "REQUEST_HEADER_FIELDS_TOO_LARGE",
    500: "INTERNAL_SERVER_ERROR", 503: "SERVICE_UNAVAILABLE",
}


def vendor_of(path: str) -> Vendor | None:
    """Whose path this is, so whose refusal shape it gets: every ``/v1/text-to-speech/...`` path is
    ElevenLabs' (one it does not serve, an over-long voice id: its 404 in its shape)."""
    if path == openai.PATH:
        return "openai"
    if path == deepgram.PATH:
        return "deepgram"
    if path.startswith(elevenlabs.PATH_PREFIX):
        return "elevenlabs"
    return None


def refusal(vendor: Vendor | None, status: int, code: str, message: str,
            headers: tuple[tuple[str, str], ...] = (), request_id: str = "") -> Refusal:
    """The refusal ``status`` in ``vendor``'s shape (None: OpenAI's, the gateway's default for
    ``/v1/`` paths). ``code`` is the snake_case code (OpenAI's ``code``, ElevenLabs' ``status``);
    for Deepgram an ``UPPER_CASE`` code is kept, else ``DEEPGRAM_CODES`` by status."""
    if vendor == "elevenlabs":
        return elevenlabs.ElevenLabsError(status, code, message, headers)
    if vendor == "deepgram":
        dg_code = code if code.isupper() else DEEPGRAM_CODES.get(status, code.upper())
        return deepgram.DeepgramError(status, dg_code, message, headers, request_id=request_id)
    type_ = "server_error" if status >= 500 else "invalid_request_error"
    return openai.ApiError(status, message, type_, None, code, headers)


def unauthorized(vendor: Vendor | None, request_id: str = "") -> Refusal:
    msg = {"elevenlabs": "Invalid API key", "deepgram": "Invalid credentials."}.get(vendor or "",
                                                                                   "Incorrect API key provided.")
    return refusal(vendor, 401, "invalid_api_key", msg, (("WWW-Authenticate", 'Bearer realm="voicegw"'),),
                   request_id)


def origin_refused(vendor: Vendor | None, request_id: str = "") -> Refusal:
    return refusal(vendor, 403, "origin_not_allowed", "origin not allowed", (), request_id)


def shutting_down(vendor: Vendor | None, request_id: str = "") -> Refusal:
    return refusal(vendor, 503, "shutting_down", "server is shutting down", (("Retry-After", "5"),), request_id)


def over_capacity(vendor: Vendor | None, request_id: str = "") -> Refusal:
    return refusal(vendor, 503, "over_capacity", "too many sessions", (("Retry-After", "1"),), request_id)


def too_large(vendor: Vendor | None, limit: int, request_id: str = "") -> Refusal:
    return refusal(vendor, 413, "request_too_large", f"request body over {limit} bytes", (), request_id)


def head_too_large(vendor: Vendor | None, limit: int, request_id: str = "") -> Refusal:
    return refusal(vendor, 431, "request_header_fields_too_large", f"request head over {limit} bytes", (),
                   request_id)


def internal_error(vendor: Vendor | None, request_id: str = "") -> Refusal:
    return refusal(vendor, 500, "internal_error", "internal server error", (), request_id)

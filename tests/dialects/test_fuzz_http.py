"""Fuzz of the dialects' HTTP and handshake surfaces against a real gateway on 127.0.0.1 (the fake
engine): query strings, headers, JSON bodies, chunked encoding and WebSocket handshake
parameters. For every request: the answer is a documented status, a refusal comes in the shape of
the dialect whose path it is, nothing is answered 500, nothing logs a traceback or an error, no
task exception goes unretrieved. After each surface: no socket of the server's port is left in
CLOSE-WAIT, and the gateway's open fds are back to their baseline.

Derandomized by default (200 fixed examples per surface, the same on every run: ``voicegw-fuzz``
profile); ``VOICEGW_FUZZ_EXPLORE=1`` explores (random examples, ``VOICEGW_FUZZ_EXAMPLES`` per
surface, default 500).
"""

from __future__ import annotations

import os
import socket
import string
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.dialects.hostile import (
    HTTP_STATUSES,
    WS_STATUSES,
    Answer,
    ThreadedGateway,
    open_fds,
    vendor_shape_ok,
    ws_handshake,
)

EXPLORE = os.environ.get("VOICEGW_FUZZ_EXPLORE") == "1"
settings.register_profile("voicegw-fuzz", derandomize=True, max_examples=200, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("voicegw-fuzz-explore", derandomize=False, deadline=None, database=None,
                          max_examples=int(os.environ.get("VOICEGW_FUZZ_EXAMPLES", "500")),
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FUZZ = settings.get_profile("voicegw-fuzz-explore" if EXPLORE else "voicegw-fuzz")

TOKEN = "fuzz-token"
RACHEL = "21m00Tcm4TlvDq8ikWAM"
COUNTS: dict[str, int] = {}
"""Hostile cases sent per surface (reported at the end of the module)."""

# ---- strategies ------------------------------------------------------------------------------------

NUMBERS = st.one_of(
    st.sampled_from(["²", "³", "٣", "é", "２４０００", "24000.0", "24000.5", "-1", "+1", "0x10", " 1", "1 ", "1e3", "NaN",
                     "inf", "1_000", "", "0", "00000000000000000000000024000", "9" * 40, "16000", "8000", "180",
                     "4294967295", "4294967296", "\x00", "1\x00"]),
    st.integers(-2**70, 2**70).map(str),
    st.text(max_size=12),
)
MODELS = ["pcm_16000", "mp3_44100_128", "default\t", " default", "aura-asteria-en ", "seed-\u212a", "\u017f2222",
          "aura-2-thalia-en", "2222"]
QUERY_KEYS = ["sample_rate", "encoding", "container", "model", "speed", "bit_rate", "seed", "inactivity_timeout",
              "output_format", "language_code", "token", "model_id", "sync_alignment", "auto_mode"]
ENCODINGS = ["linear16", "mulaw", "alaw", "mp3", "opus", "aac", "flac", "wav", "", "LINEAR16", "٣", "ｍｐ３"]


@st.composite
def queries(draw: Any) -> str:
    pairs = draw(st.lists(st.tuples(st.one_of(st.sampled_from(QUERY_KEYS), st.text(max_size=6)),
                                    st.one_of(NUMBERS, st.sampled_from(ENCODINGS + MODELS))),
                          max_size=5))
    q = "&".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in pairs)
    raw = draw(st.sampled_from(["", "", "", "&&==&", "%", "%zz", "a=%C2", "=", ";x=1", "%00=%00"]))
    return q + ("&" + raw if raw and q else raw)


VOICE_IDS = st.one_of(st.just(RACHEL), st.just("2222"), st.just("seed-²"), st.just("v" * 300),
                      st.text(alphabet=string.ascii_letters + string.digits + "-_.%~", min_size=1, max_size=40))
HTTP_PATHS = st.one_of(
    st.just("/v1/audio/speech"), st.just("/v1/speak"),
    st.builds(lambda v, tail: f"/v1/text-to-speech/{quote(v, safe='%')}{tail}", VOICE_IDS,
              st.sampled_from(["", "/stream", "/with-timestamps", "/stream/with-timestamps", "/bogus", "/stream-input"])),
)
JSON_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63 - 1), st.floats(allow_nan=True),
                        st.text(max_size=20), NUMBERS, st.lists(st.integers(-2**63, 2**63 - 1), max_size=2),
                        st.dictionaries(st.text(max_size=5), st.integers(-2**63, 2**63 - 1), max_size=2))
BODY_KEYS = ["text", "input", "model", "voice", "response_format", "stream_format", "speed", "seed", "voice_settings",
             "language_code", "model_id", "instructions"]


@st.composite
def bodies(draw: Any) -> bytes:
    kind = draw(st.sampled_from(["valid", "valid", "fields", "raw"]))
    if kind == "raw":
        return bytes(draw(st.binary(max_size=64)))
    obj: dict[str, Any] = {"text": "Hi there.", "input": "Hi there.", "model": "tts-1", "voice": "alloy",
                           "response_format": "pcm"}
    n = draw(st.integers(1, 4))
    for _ in range(n):
        obj[draw(st.sampled_from(BODY_KEYS))] = draw(JSON_VALUES)
    if kind == "valid":
        obj.pop(draw(st.sampled_from(BODY_KEYS)), None)
    return orjson.dumps(obj)


HEADER_NAMES = st.one_of(st.sampled_from(["Content-Length", "Transfer-Encoding", "Expect", "Authorization",
                                          "xi-api-key", "Content-Type", "Connection", "Host", "Origin", "Upgrade"]),
                         st.text(alphabet=string.ascii_letters + "-_!#$%&'*+.^`|~", min_size=1, max_size=12))
HEADER_VALUES = st.one_of(NUMBERS, st.sampled_from(["chunked", "gzip, chunked", "100-continue", f"Bearer {TOKEN}",
                                                    f"Token {TOKEN}", "Bearer ", "close", "keep-alive"]),
                          st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF,
                                                         blacklist_characters="\x7f"), max_size=30),
                          st.integers(0, 30_000).map(lambda n: "a" * n))
CREDENTIALS = st.sampled_from([[("Authorization", f"Bearer {TOKEN}")]] * 4
                              + [[("xi-api-key", TOKEN)], [("Authorization", f"Token {TOKEN}")],
                                 [("Authorization", "Bearer nope")], []])


def _vendor(path: str) -> str | None:
    p = path.split("?", 1)[0]
    if p == "/v1/audio/speech":
        return "openai"
    if p == "/v1/speak":
        return "deepgram"
    if p.startswith("/v1/text-to-speech/"):
        return "elevenlabs"
    return None


# ---- the gateway and the checks ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def gw() -> Iterator[ThreadedGateway]:
    with ThreadedGateway(gateway={"auth_tokens": (TOKEN,), "open_timeout_s": 1.0}) as g:
        yield g
    if COUNTS:
        print("\nhostile cases per surface:", COUNTS, "total", sum(COUNTS.values()))


def _send(port: int, data: bytes, *, half_close: bool = True, read_s: float = 5.0) -> Answer:
    """Send, half-close (the gateway answers an incomplete request 400 at once), read to EOF."""
    from tests.dialects.hostile import exchange

    if not half_close:
        return exchange(port, data, read_s=read_s)
    s = socket.create_connection(("127.0.0.1", port), timeout=read_s)
    buf = b""
    err = ""
    try:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        while d := s.recv(65536):
            buf += d
    except OSError as exc:
        err = type(exc).__name__
    finally:
        s.close()
    from tests.dialects.hostile import parse_answer

    return parse_answer(buf, err, dechunked=True)


def _check(gw: ThreadedGateway, surface: str, path: str, a: Answer, statuses: frozenset[int], req: bytes) -> None:
    COUNTS[surface] = COUNTS.get(surface, 0) + 1
    ctx = f"{surface}: {req[:300]!r} -> {a.status} {a.body[:300]!r} {a.error}"
    assert a.status is not None, ctx
    assert a.status in statuses, ctx
    assert b"Traceback" not in a.body and b"Error(" not in a.body, ctx
    vendor = _vendor(path)
    if a.status >= 400 and vendor is not None and a.headers.get("content-type", "").startswith("application/json"):
        assert vendor_shape_ok(vendor, a.body), ctx
    elif a.status >= 400 and vendor is not None and not (a.status == 400 and surface == "handshake"):
        # a dialect's path: its refusal is JSON in its shape (the WebSocket library's own 400 for
        # a malformed upgrade is text)
        raise AssertionError(f"not JSON: {ctx}")
    assert not gw.problems, (ctx, gw.problems)
    assert not gw.logged, (ctx, gw.logged)


def _surface(gw: ThreadedGateway, run: Callable[[], None]) -> None:
    base = open_fds()
    run()
    fds, cw = gw.settled(base)
    assert cw == 0, f"{cw} sockets in CLOSE-WAIT"
    assert fds <= base, f"open fds {base} -> {fds}"
    assert not gw.problems, gw.problems
    assert not gw.logged, gw.logged


def _post(path: str, body: bytes, headers: list[tuple[str, str]], *, length: bool = True) -> bytes:
    hdrs = [("Host", "127.0.0.1"), ("Content-Type", "application/json"), *headers]
    if length:
        hdrs.append(("Content-Length", str(len(body))))
    return (f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs) + "\r\n").encode() \
        + body


VALID = orjson.dumps({"text": "Hi.", "input": "Hi.", "model": "tts-1", "voice": "alloy", "response_format": "pcm"})


# ---- the surfaces ----------------------------------------------------------------------------------

@FUZZ
@given(value=st.one_of(NUMBERS, st.text(), st.integers(-2**70, 2**70), st.floats(), st.booleans(), st.none()),
       lo=st.integers(0, 100), span=st.integers(0, 2**40), float_zero=st.booleans())
def test_fuzz_parse_int(value: Any, lo: int, span: int, float_zero: bool) -> None:
    """The one numeric parser: an int in range, or FieldError; ASCII digits only."""
    from gateway.dialects.base import FieldError, parse_int

    COUNTS["parse_int"] = COUNTS.get("parse_int", 0) + 1
    try:
        n = parse_int(value, "x", lo, lo + span, float_zero=float_zero)
    except FieldError as exc:
        assert exc.message == f"x must be an integer in {lo}..{lo + span}"
        return
    assert lo <= n <= lo + span
    if isinstance(value, str):
        assert value.isascii() and value.split(".")[0].isdigit()


def test_fuzz_http_query_strings(gw: ThreadedGateway) -> None:
    @FUZZ
    @given(path=HTTP_PATHS, query=queries(), creds=CREDENTIALS)
    def run(path: str, query: str, creds: list[tuple[str, str]]) -> None:
        target = f"{path}?{query}" if query else path
        req = _post(target, VALID, creds)
        _check(gw, "http-query", target, _send(gw.port, req), HTTP_STATUSES, req)

    _surface(gw, run)


def test_fuzz_http_headers(gw: ThreadedGateway) -> None:
    @FUZZ
    @given(path=HTTP_PATHS, extra=st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=4), creds=CREDENTIALS,
           length=st.booleans())
    def run(path: str, extra: list[tuple[str, str]], creds: list[tuple[str, str]], length: bool) -> None:
        req = _post(path, VALID, creds + extra, length=length)
        _check(gw, "http-headers", path, _send(gw.port, req), HTTP_STATUSES, req)

    _surface(gw, run)


def test_fuzz_http_bodies(gw: ThreadedGateway) -> None:
    @FUZZ
    @given(path=HTTP_PATHS, body=bodies(), creds=CREDENTIALS)
    def run(path: str, body: bytes, creds: list[tuple[str, str]]) -> None:
        req = _post(path, body, creds)
        _check(gw, "http-body", path, _send(gw.port, req), HTTP_STATUSES, req)

    _surface(gw, run)


@st.composite
def chunked(draw: Any) -> bytes:
    out = b""
    payload = VALID
    pieces = draw(st.lists(st.integers(1, 40), max_size=6))
    for n in pieces:
        part, payload = payload[:n], payload[n:]
        size = draw(st.sampled_from([f"{len(part):x}", f"{len(part):X}", f"{len(part):x};ext=1", f"0{len(part):x}",
                                     f"{len(part) + 1:x}", "zz", "-1", "ffffffffffffffff", f" {len(part):x}", "²"]))
        out += size.encode() + b"\r\n" + part + draw(st.sampled_from([b"\r\n", b"\r\n", b"\n", b"", b"xx\r\n"]))
    out += payload and f"{len(payload):x}\r\n".encode() + payload + b"\r\n"
    out += draw(st.sampled_from([b"0\r\n\r\n", b"0\r\n\r\n", b"0\r\nX-Trailer: 1\r\n\r\n", b"", b"0\r\n",
                                 b"100000\r\n" + b"a" * 70_000 + b"\r\n0\r\n\r\n"]))
    return out


def test_fuzz_http_chunked(gw: ThreadedGateway) -> None:
    @FUZZ
    @given(path=HTTP_PATHS, body=chunked(), creds=CREDENTIALS,
           te=st.sampled_from(["chunked", "chunked", "Chunked", "gzip, chunked", "chunked, chunked"]))
    def run(path: str, body: bytes, creds: list[tuple[str, str]], te: str) -> None:
        req = _post(path, body, [*creds, ("Transfer-Encoding", te)], length=False)
        _check(gw, "http-chunked", path, _send(gw.port, req), HTTP_STATUSES, req)

    _surface(gw, run)


WS_PATHS = st.one_of(
    st.just("/v1/speak"),
    st.builds(lambda v, tail: f"/v1/text-to-speech/{quote(v, safe='%')}{tail}", VOICE_IDS,
              st.sampled_from(["/stream-input", "/multi-stream-input", "/stream-input", "/bogus", ""])),
)


def test_fuzz_websocket_handshakes(gw: ThreadedGateway) -> None:
    @FUZZ
    @given(path=WS_PATHS, query=queries(), creds=CREDENTIALS,
           origin=st.sampled_from([None, None, "http://127.0.0.1", "https://evil.example", "null", "http://[x",
                                   "http://127.0.0.1:99999"]),
           protocols=st.sampled_from([None, None, f"token, {TOKEN}", "token, nope", "token", "bearer, ²"]))
    def run(path: str, query: str, creds: list[tuple[str, str]], origin: str | None, protocols: str | None) -> None:
        target = f"{path}?{query}" if query else path
        headers = list(creds)
        if origin is not None:
            headers.append(("Origin", origin))
        if protocols is not None:
            headers.append(("Sec-WebSocket-Protocol", protocols))
        req = ws_handshake(target, headers)
        a = _send(gw.port, req, half_close=False)
        _check(gw, "handshake", target, a, WS_STATUSES, req)

    _surface(gw, run)

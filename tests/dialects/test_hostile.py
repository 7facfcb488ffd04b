"""Issue 34 (items 1-6): hostile input on the dialects' HTTP and handshake surfaces. Each test
failed before the fix: a Unicode digit crashed a parser (no answer, a socket left in CLOSE-WAIT, a
task exception never retrieved; a 500 with a traceback at a handshake), refusals came in the wrong
vendor's shape, refused bodies were answered with RST, and a head over 16 KiB in one write was
served."""

from __future__ import annotations

import http.client
import urllib.error
import urllib.request
from collections.abc import Iterator

import orjson
import pytest

from tests.dialects.hostile import (
    ThreadedGateway,
    exchange,
    open_fds,
    post,
    vendor_shape_ok,
    ws_handshake,
)

RACHEL = "21m00Tcm4TlvDq8ikWAM"
EL_WS = f"/v1/text-to-speech/{RACHEL}/stream-input"
TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def gw() -> Iterator[ThreadedGateway]:
    with ThreadedGateway() as g:
        yield g


@pytest.fixture(scope="module")
def gw_auth() -> Iterator[ThreadedGateway]:
    with ThreadedGateway(gateway={"auth_tokens": (TOKEN,), "allowed_origins": ("https://good.example",)}) as g:
        yield g


def _clean(g: ThreadedGateway) -> None:
    assert not g.problems, g.problems
    assert not g.logged, g.logged


# ---- 1. Deepgram REST: '²'.isdigit() but int('²') raises ------------------------------------------

def test_deepgram_rest_unicode_digit_is_400_and_leaks_nothing(gw: ThreadedGateway) -> None:
    req = post("/v1/speak?encoding=linear16&container=none&sample_rate=%C2%B2", b'{"text":"hi"}')
    base = open_fds()
    for _ in range(20):
        a = exchange(gw.port, req, read_s=3)
        assert a.status == 400, a
        assert vendor_shape_ok("deepgram", a.body), a.body
        assert orjson.loads(a.body)["err_code"] == "INVALID_QUERY_PARAMETER"
    fds, cw = gw.settled(base)
    assert fds <= base and cw == 0, (base, fds, cw)
    _clean(gw)


@pytest.mark.parametrize("query", ["sample_rate=%D9%A3", "sample_rate=24000.0", "sample_rate=+24000",
                                   "sample_rate=%EF%BC%92%EF%BC%94%EF%BC%90%EF%BC%90%EF%BC%90"])
def test_deepgram_rest_sample_rate_ascii_only(gw: ThreadedGateway, query: str) -> None:
    a = exchange(gw.port, post(f"/v1/speak?encoding=linear16&container=none&{query}", b'{"text":"hi"}'))
    assert a.status == (200 if query == "sample_rate=24000.0" else 400), a  # "24000.0": what SDKs send
    _clean(gw)


# ---- 2. handshakes: no client input reaches a 500 -------------------------------------------------

@pytest.mark.parametrize("path,vendor,code", [
    (EL_WS + "?seed=%C2%B2", "elevenlabs", "invalid_seed"),
    (EL_WS + "?inactivity_timeout=%C2%B3", "elevenlabs", "invalid_inactivity_timeout"),
    ("/v1/speak?sample_rate=%C2%B2", "deepgram", "INVALID_QUERY_PARAMETER"),
    (EL_WS + "?seed=%D9%A3", "elevenlabs", "invalid_seed"),
])
def test_handshake_unicode_digits_are_400(gw: ThreadedGateway, path: str, vendor: str, code: str) -> None:
    a = exchange(gw.port, ws_handshake(path))
    assert a.status == 400, a
    assert vendor_shape_ok(vendor, a.body), a.body
    body = orjson.loads(a.body)
    assert (body["detail"]["status"] if vendor == "elevenlabs" else body["err_code"]) == code
    _clean(gw)


def test_deepgram_handshake_error_header_is_ascii(gw: ThreadedGateway) -> None:
    """Found by the fuzz (explore mode): the ``dg-error`` header quoted a non-ASCII encoding and
    the response could not be built (500)."""
    a = exchange(gw.port, ws_handshake("/v1/speak?encoding=%D9%A3"))
    assert a.status == 400 and vendor_shape_ok("deepgram", a.body), a
    assert a.headers["dg-error"].isascii()
    _clean(gw)


@pytest.mark.parametrize("model", ["default%09", "%20default", "seed-%E2%84%AA", "%C5%BF2222"])
def test_deepgram_rest_model_header_is_ascii(gw: ThreadedGateway, model: str) -> None:
    """``dg-model-name`` echoes the client's model spelling: whitespace or a character that
    lower-cases to ASCII (``K`` KELVIN SIGN) must not break the response head."""
    a = exchange(gw.port, post(f"/v1/speak?encoding=linear16&container=none&model={model}", b'{"text":"hi"}'))
    assert a.status in (200, 400), a
    if a.status == 200:
        assert a.headers["dg-model-name"].isascii() and a.headers["dg-model-name"] == a.headers["dg-model-name"].strip()
    else:
        assert vendor_shape_ok("deepgram", a.body)
    _clean(gw)


# ---- 3. WebSocket refusals in the dialect's shape -------------------------------------------------

@pytest.mark.parametrize("path,vendor", [(EL_WS, "elevenlabs"), ("/v1/speak", "deepgram")])
@pytest.mark.parametrize("case", ["401", "403"])
def test_handshake_refusals_in_dialect_shape(gw_auth: ThreadedGateway, path: str, vendor: str, case: str) -> None:
    headers = [("Authorization", "Token wrong"), ("xi-api-key", "wrong")] if case == "401" else \
        [("Authorization", f"Token {TOKEN}"), ("Origin", "https://evil.example")]
    a = exchange(gw_auth.port, ws_handshake(path, headers))
    assert a.status == int(case), a
    assert vendor_shape_ok(vendor, a.body), a.body
    if vendor == "deepgram":
        assert orjson.loads(a.body)["err_code"] == ("INVALID_AUTH" if case == "401" else "FORBIDDEN")
        assert a.headers["x-request-id"] == orjson.loads(a.body)["request_id"]
    _clean(gw_auth)


@pytest.mark.parametrize("path,vendor", [(EL_WS, "elevenlabs"), ("/v1/speak", "deepgram")])
def test_handshake_capacity_refusal_in_dialect_shape(path: str, vendor: str) -> None:
    with ThreadedGateway(limits={"max_sessions": 1}) as g:
        held = __import__("socket").create_connection(("127.0.0.1", g.port))
        held.sendall(ws_handshake(path))
        assert held.recv(4096).startswith(b"HTTP/1.1 101 ")
        a = exchange(g.port, ws_handshake(path))
        held.close()
        assert a.status == 503 and a.headers.get("retry-after") == "1", a
        assert vendor_shape_ok(vendor, a.body), a.body
        _clean(g)


# ---- 4. the vendor's shape, not OpenAI's ---------------------------------------------------------

@pytest.mark.parametrize("path,vendor", [(f"/v1/text-to-speech/{RACHEL}", "elevenlabs"),
                                         ("/v1/speak", "deepgram"), ("/v1/audio/speech", "openai")])
def test_413_in_the_vendor_shape(gw: ThreadedGateway, path: str, vendor: str) -> None:
    req = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n".encode()
    a = exchange(gw.port, req)
    assert a.status == 413 and vendor_shape_ok(vendor, a.body), a
    _clean(gw)


def test_overlong_elevenlabs_voice_id_is_voice_not_found(gw: ThreadedGateway) -> None:
    vid = "v" * 300
    a = exchange(gw.port, post(f"/v1/text-to-speech/{vid}/stream", b'{"text":"hi"}'))
    assert a.status == 404 and vendor_shape_ok("elevenlabs", a.body), a
    assert orjson.loads(a.body)["detail"]["status"] == "voice_not_found"
    a = exchange(gw.port, ws_handshake(f"/v1/text-to-speech/{vid}/stream-input"))
    assert a.status == 404 and vendor_shape_ok("elevenlabs", a.body), a
    assert orjson.loads(a.body)["detail"]["status"] == "voice_not_found"
    _clean(gw)


# ---- 5. the 413 reaches the client (lingering close, not RST) ------------------------------------

@pytest.mark.parametrize("path", [f"/v1/text-to-speech/{RACHEL}", "/v1/speak", "/v1/audio/speech"])
def test_5mb_body_gets_413_not_reset(gw: ThreadedGateway, path: str) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{gw.port}{path}", data=b"x" * 5_000_000, method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=10)
    assert exc.value.code == 413
    _clean(gw)


def test_overlong_chunked_upload_gets_413_not_reset(gw: ThreadedGateway) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=10)
    conn.request("POST", "/v1/speak", body=iter([b"y" * 65536] * 64), encode_chunked=True,
                 headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
    resp = conn.getresponse()
    assert resp.status == 413 and vendor_shape_ok("deepgram", resp.read())
    conn.close()
    _clean(gw)


# ---- 6. the 16 KiB head limit on the raw bytes ---------------------------------------------------

@pytest.mark.parametrize("path,vendor", [("/v1/audio/speech", "openai"), ("/v1/speak", "deepgram")])
def test_head_over_16kib_in_one_write_is_431(gw: ThreadedGateway, path: str, vendor: str) -> None:
    body = b'{"model":"tts-1","input":"hi","voice":"alloy","response_format":"pcm","text":"hi"}'
    req = post(path, body, [(f"X-Pad-{i}", "a" * 7000) for i in range(3)])
    assert len(req) > 21_000
    a = exchange(gw.port, req)
    assert a.status == 431 and vendor_shape_ok(vendor, a.body), a
    _clean(gw)

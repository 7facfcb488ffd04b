"""The door: auth (401), Origin (403), session cap (503 / 1013), floods (1008), compression never
negotiated, the HTTP routes never answering 500, tokens never logged."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import string
import time

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed
from websockets.typing import Subprotocol

from clients.python import VoicegwError
from gateway import protocol as P
from gateway.app import configure_logging
from gateway.server import GatewayServer
from loadtest.fakes import FakeSpeechEngine
from tests.gateway.conftest import GatewayFactory, wait_until
from tests.reliability.helpers import assert_drained, assert_still_serving
from tests.reliability.rawws import (
    OP_BINARY,
    OP_PING,
    RawConn,
    build_frame,
    handshake_request,
    read_http_response,
)
from tests.transcript import Transcript, fast_client, quiet_client
from voicegw.config import GatewayConfig

TOKEN = "s3cret-Token_0123456789"
AUTH = {"auth_tokens": (TOKEN,)}
OK_HEADERS = {"Authorization": f"Bearer {TOKEN}"}
TOKEN_SUBPROTOCOLS = [Subprotocol(P.SUBPROTOCOL), Subprotocol(P.TOKEN_SUBPROTOCOL_PREFIX + TOKEN)]


async def _status(port: int, *, path: str = P.WS_PATH, headers: dict[str, str] | None = None,
                  subprotocols: tuple[str, ...] | None = (P.SUBPROTOCOL,)) -> tuple[int, dict[str, str], bytes]:
    conn = await RawConn.open("127.0.0.1", port, path=path, headers=headers, subprotocols=subprotocols,
                              expect_status=None)
    resp = conn.response
    if resp.status == 101:
        conn.abort()
    else:
        await conn.close()
    return resp.status, resp.headers, resp.body


# ---- auth ---------------------------------------------------------------------------------------

BAD_CREDENTIALS: list[tuple[str, dict[str, str], tuple[str, ...], str]] = [
    # (id, headers, subprotocols, query)
    ("none", {}, (P.SUBPROTOCOL,), ""),
    ("wrong-bearer", {"Authorization": "Bearer wrong"}, (P.SUBPROTOCOL,), ""),
    ("empty-bearer", {"Authorization": "Bearer "}, (P.SUBPROTOCOL,), ""),
    ("prefix-of-token", {"Authorization": f"Bearer {TOKEN[:-1]}"}, (P.SUBPROTOCOL,), ""),
    ("token-plus-suffix", {"Authorization": f"Bearer {TOKEN}x"}, (P.SUBPROTOCOL,), ""),
    ("token-other-case", {"Authorization": f"Bearer {TOKEN.upper()}"}, (P.SUBPROTOCOL,), ""),
    ("basic-scheme", {"Authorization": f"Basic {TOKEN}"}, (P.SUBPROTOCOL,), ""),
    ("bare-token-header", {"Authorization": TOKEN}, (P.SUBPROTOCOL,), ""),
    ("non-ascii-bearer", {"Authorization": "Bearer s3cr\u00e9t"}, (P.SUBPROTOCOL,), ""),
    ("wrong-subprotocol-token", {}, (P.SUBPROTOCOL, P.TOKEN_SUBPROTOCOL_PREFIX + "nope"), ""),
    ("token-as-plain-subprotocol", {}, (P.SUBPROTOCOL, TOKEN), ""),
    ("wrong-query", {}, (P.SUBPROTOCOL,), "?token=nope"),
    ("other-query-name", {}, (P.SUBPROTOCOL,), f"?access_token={TOKEN}"),
    ("query-bad-percent", {}, (P.SUBPROTOCOL,), "?token=%ff%fe"),
    ("empty-query-token", {}, (P.SUBPROTOCOL,), "?token="),
]


@pytest.mark.parametrize("headers,subprotocols,query", [pytest.param(h, s, q, id=i) for i, h, s, q in BAD_CREDENTIALS])
async def test_missing_or_invalid_token_is_401(headers: dict[str, str], subprotocols: tuple[str, ...], query: str,
                                               make_gateway: GatewayFactory):
    async with make_gateway(FakeSpeechEngine(), gateway=AUTH) as server:
        status, hdrs, body = await _status(server.port, path=P.WS_PATH + query, headers=headers,
                                           subprotocols=subprotocols)
        assert status == 401
        assert hdrs["www-authenticate"].startswith("Bearer")
        assert "upgrade" not in hdrs and "sec-websocket-accept" not in hdrs
        assert TOKEN.encode() not in body
        assert not server.connections


@pytest.mark.parametrize("how", ["header", "subprotocol", "query"])
async def test_valid_token_each_way(how: str, make_gateway: GatewayFactory):
    async with make_gateway(FakeSpeechEngine(), gateway=AUTH) as server:
        if how == "subprotocol":  # the Python client sends its token as a header: a raw socket here
            async with connect(server.ws_url, subprotocols=TOKEN_SUBPROTOCOLS, compression=None) as ws:
                assert ws.subprotocol == P.SUBPROTOCOL  # the token subprotocol is never echoed back
                await ws.send(orjson.dumps({"type": "session.start"}).decode())
                assert orjson.loads(await ws.recv())["type"] == "session.started"
            return
        url, token = (server.ws_url, TOKEN) if how == "header" else (server.ws_url + f"?token={TOKEN}", None)
        async with fast_client(url, token=token) as c:
            assert c.ws is not None and c.ws.subprotocol == P.SUBPROTOCOL
            assert (await c.speak("Authorized.").wait_played()).status == "ok"


async def test_http_routes_do_not_need_a_token_but_ws_does(make_gateway: GatewayFactory):
    """/healthz, /metrics and the demo stay public (they carry no session data); /ws does not."""
    async with make_gateway(FakeSpeechEngine(), gateway=AUTH) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        assert (await read_http_response(reader)).status == 200
        writer.close()
        assert (await _status(server.port))[0] == 401


# ---- origin -------------------------------------------------------------------------------------

FOREIGN_ORIGINS = [
    "http://evil.example",
    "https://evil.example",
    "null",
    "file://",
    "http://127.0.0.1.evil.example:{port}",
    "http://localhost.evil.example:{port}",
    "http://evil.example:{port}",
    "http://127.0.0.1:{other}",  # same host, another port: another site
    "ws://127.0.0.1:{port}",
    "http://user@evil.example",
    "",
]


@pytest.mark.parametrize("origin", FOREIGN_ORIGINS)
async def test_foreign_origin_is_403(origin: str, make_gateway: GatewayFactory):
    async with make_gateway(FakeSpeechEngine(), gateway=AUTH) as server:
        o = origin.format(port=server.port, other=server.port + 1)
        status, _, _ = await _status(server.port, headers={"Origin": o, **OK_HEADERS})
        assert status == 403, o
        assert not server.connections


async def test_allowed_origins(make_gateway: GatewayFactory):
    async with make_gateway(FakeSpeechEngine()) as server:
        for origin in (f"http://127.0.0.1:{server.port}", f"http://localhost:{server.port}"):
            assert (await _status(server.port, headers={"Origin": origin}))[0] == 101
        assert (await _status(server.port))[0] == 101  # no Origin: not a browser
    allowed = {"allowed_origins": ("https://app.example",)}
    async with make_gateway(FakeSpeechEngine(), gateway=allowed) as server:
        assert (await _status(server.port, headers={"Origin": "https://app.example"}))[0] == 101
        assert (await _status(server.port, headers={"Origin": "https://app.example/"}))[0] == 101
        for bad in ("http://app.example", "https://app.example:8443", "https://sub.app.example",
                    f"http://127.0.0.1:{server.port}"):
            assert (await _status(server.port, headers={"Origin": bad}))[0] == 403, bad


# found by the door fuzzing below (issue 8, fixed): an exception in process_request was an HTTP 500
# and an ERROR log with a traceback that any client could trigger at will
DOOR_500_CASES = [
    pytest.param(P.WS_PATH, {"Origin": "http://localhost:99999"}, 403, id="origin-port-out-of-range"),
    pytest.param(P.WS_PATH, {"Origin": "http://localhost:abc"}, 403, id="origin-port-not-a-number"),
    pytest.param("//[x/ws", {}, 400, id="path-invalid-ipv6-netloc"),
]


@pytest.mark.parametrize("path,headers,expected", DOOR_500_CASES)
async def test_door_never_answers_500(path: str, headers: dict[str, str], expected: int,
                                      make_gateway: GatewayFactory):
    async with make_gateway(FakeSpeechEngine()) as server:
        assert (await _status(server.port, path=path, headers=headers))[0] == expected


async def test_long_static_path_is_404(make_gateway: GatewayFactory):
    async with make_gateway(FakeSpeechEngine()) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /" + b"a" * 300 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        assert (await read_http_response(reader)).status == 404
        writer.close()


@pytest.mark.parametrize("path", ["/", "/nope", "/ws/"])
async def test_upgrade_on_unknown_path_has_one_content_length(path: str, make_gateway: GatewayFactory):
    """A response with two different Content-Length values is malformed (RFC 9112 6.3): proxies
    must reject it, and disagreeing parsers are what response smuggling is made of."""
    async with make_gateway(FakeSpeechEngine()) as server:
        conn = await RawConn.open("127.0.0.1", server.port, path=path, expect_status=None)
        resp = conn.response
        await conn.close()
        assert resp.status == 404
        assert len(resp.values("content-length")) == 1, resp.raw_headers
        assert len(resp.values("content-type")) == 1, resp.raw_headers


def test_every_door_response_of_the_server_has_single_framing_headers() -> None:
    """Every route of gateway/server.py builds its response once (no appended duplicates)."""
    from gateway.responses import text_response

    for r in (text_response(401, "x", [("WWW-Authenticate", "Bearer")]),
              text_response(503, "y", [("Retry-After", "1")])):
        names = [k.lower() for k, _ in r.headers.raw_items()]
        assert names.count("content-length") == 1 and names.count("content-type") == 1


_PATH_CHARS = string.ascii_letters + string.digits + "/.%?&=[]:@!$'()*+,;~-_"


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    path=st.one_of(st.just(P.WS_PATH), st.text(_PATH_CHARS, min_size=0, max_size=300).map(lambda s: "/" + s)),
    origin=st.one_of(st.none(), st.text(string.printable.strip() + " ", max_size=80),
                     st.builds(lambda h, p: f"http://{h}:{p}", st.sampled_from(["localhost", "127.0.0.1", "[::1]", "x"]),
                               st.one_of(st.integers(-5, 200_000).map(str), st.text("0123456789abc", max_size=8)))),
    upgrade=st.booleans(),
    auth=st.one_of(st.none(), st.text(string.printable.strip() + " ", max_size=60)),
)
def test_door_fuzz_gives_documented_status(door_server: int, path: str, origin: str | None, upgrade: bool,
                                           auth: str | None) -> None:
    """Random paths, Origins and Authorization values: every request gets a documented HTTP status
    (never a hang, never a 500, never two Content-Length headers)."""
    headers: dict[str, str] = {}
    if origin is not None:
        headers["Origin"] = origin
    if auth is not None:
        headers["Authorization"] = auth

    async def one() -> tuple[int | None, bool]:
        reader, writer = await asyncio.open_connection("127.0.0.1", door_server)
        if upgrade:
            req, _ = handshake_request("127.0.0.1", door_server, path=path, headers=headers)
        else:
            req = (f"GET {path} HTTP/1.1\r\nHost: x\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
                   + "\r\n").encode()
        writer.write(req)
        await writer.drain()
        try:
            resp = await read_http_response(reader, within_s=5)
        except (asyncio.IncompleteReadError, ConnectionError):
            return None, False  # dropped: an unparsable request
        finally:
            writer.transport.abort()
        return resp.status, resp.conflicting_length

    status, conflicting = asyncio.run(one())
    documented = {101, 200, 400, 401, 403, 404, 405, 426, 431, 503, None}
    assert status in documented, (status, path, headers)
    assert not conflicting, (status, path, headers)


@pytest.fixture(scope="module")
def door_server() -> object:
    """A gateway with auth on, in its own thread and event loop (hypothesis tests are sync)."""
    from tests.reliability.threaded import ThreadedGateway

    with ThreadedGateway(FakeSpeechEngine(), gateway=AUTH) as gw:
        yield gw.port
        assert gw.alive()


# ---- capacity -----------------------------------------------------------------------------------


async def test_session_cap_503_then_admits_again(make_gateway: GatewayFactory):
    async with make_gateway(FakeSpeechEngine(), limits={"max_sessions": 3}) as server:
        clients = [quiet_client(server.ws_url) for _ in range(3)]
        for c in clients:
            await c.connect()
        status, hdrs, _ = await _status(server.port)
        assert status == 503 and hdrs["retry-after"] == "1"
        with pytest.raises(VoicegwError) as ei:
            await quiet_client(server.ws_url).connect()
        assert ei.value.code == "handshake_failed" and ei.value.detail["status"] == 503
        await clients[0].close()
        assert await wait_until(lambda: len(server.connections) == 2)
        async with fast_client(server.ws_url) as c:
            assert (await c.speak("Admitted after a seat freed up.").wait_played()).status == "ok"
        for x in clients[1:]:
            await x.close()
        await assert_drained(server)


async def test_concurrent_handshakes_never_exceed_the_cap(make_gateway: GatewayFactory):
    """40 handshakes at once against a cap of 5: each gets a session, 503, or 1013 (the race between
    handshake and handler); never more than 5 live sessions."""
    cap = 5
    async with make_gateway(FakeSpeechEngine(), limits={"max_sessions": cap}) as server:
        peak = 0

        async def one() -> str:
            nonlocal peak
            c = quiet_client(server.ws_url)
            try:
                await c.connect()
            except VoicegwError as e:  # refused at the handshake (HTTP status), or closed at the start
                return str(e.detail.get("status") or e.detail.get("code"))
            try:
                peak = max(peak, len(server.connections))
                await asyncio.sleep(0.3)
            finally:
                await c.close()
            return "ok"

        outcomes = await asyncio.gather(*(one() for _ in range(40)))
        assert set(outcomes) <= {"ok", "503", "1013"}, outcomes
        assert 1 <= outcomes.count("ok") and peak <= cap
        await assert_drained(server)


# ---- floods -------------------------------------------------------------------------------------


async def test_message_flood_closes_1008_and_spares_others(make_gateway: GatewayFactory):
    limits = {"max_messages_per_s": 50.0}
    async with make_gateway(FakeSpeechEngine(), limits=limits) as server:
        bystander = fast_client(server.ws_url)
        await bystander.connect()
        conn = await RawConn.open("127.0.0.1", server.port)
        await conn.send_json({"type": "session.start"})
        await conn.read_json()
        await conn.send_json({"type": "text.delta", "text": "Flooding now. " * 5})
        for _ in range(400):  # burst is 2 x 50: the 101st message in a second closes
            await conn.send_json({"type": "ping"})
        code, reason = await conn.expect_close(within_s=5)
        assert (code, reason) == (1008, P.CloseReason.MESSAGE_FLOOD.value)
        await conn.close()
        assert await wait_until(lambda: len(server.connections) == 1)
        assert (await bystander.speak("The bystander is unaffected.").wait_played()).status == "ok"
        await bystander.close()
        await assert_drained(server)


async def test_binary_flood_closes_1008(make_gateway: GatewayFactory):
    async with make_gateway(FakeSpeechEngine(), limits={"max_messages_per_s": 20.0}) as server:
        t = Transcript()
        c = quiet_client(server.ws_url, t)
        await c.connect()
        ws = c.ws
        assert ws is not None
        with contextlib.suppress(ConnectionClosed):
            for _ in range(200):
                await ws.send(b"\x00" * 64)  # raw: the client itself never sends binary
        assert await t.wait_closed(5) == (1008, P.CloseReason.MESSAGE_FLOOD.value)
        await c.close()
        await assert_drained(server)


async def test_text_rate_abuse_closes_1008(make_gateway: GatewayFactory):
    limits = {"max_chars_per_s": 100.0, "max_messages_per_s": 1000.0}
    async with make_gateway(FakeSpeechEngine(), limits=limits) as server:
        t = Transcript()
        c = quiet_client(server.ws_url, t)
        await c.connect()
        with contextlib.suppress(VoicegwError):
            for _ in range(40):
                await c.send_text("x" * 90 + " ")
        assert await t.wait_closed(5) == (1008, P.CloseReason.RATE_LIMIT.value)
        codes = [m["code"] for m in t.errors()]
        assert "rate_limited" in codes and set(codes) <= {"rate_limited"}
        await c.close()
        await assert_drained(server)
        await assert_still_serving(server)


async def test_oversize_utterance_is_refused_not_buffered(make_gateway: GatewayFactory):
    """A client cannot make the server hold more than max_utterance_chars of text per utterance."""
    limits = {"max_utterance_chars": 1000, "max_chars_per_s": 1e6, "max_messages_per_s": 1e4}
    async with make_gateway(FakeSpeechEngine(), limits=limits) as server:
        t = Transcript()
        c = quiet_client(server.ws_url, t)
        await c.connect()
        for _ in range(20):
            await c.send_text("word " * 100)  # 500 chars each
        assert await wait_until(lambda: len(t.errors()) >= 18, within_s=5), t.types()
        assert {m["code"] for m in t.errors()} == {"text_too_long"}
        assert c.ws is not None
        c.ws.transport.abort()
        await c.close()
        await assert_drained(server)


# ---- compression --------------------------------------------------------------------------------


async def test_permessage_deflate_is_never_negotiated(make_gateway: GatewayFactory):
    async with make_gateway(FakeSpeechEngine()) as server:
        offers = [
            "permessage-deflate",
            "permessage-deflate; client_max_window_bits",
            "permessage-deflate; server_no_context_takeover; client_no_context_takeover",
            "x-webkit-deflate-frame",
        ]
        for offer in offers:
            conn = await RawConn.open("127.0.0.1", server.port, headers={"Sec-WebSocket-Extensions": offer})
            assert "sec-websocket-extensions" not in conn.response.headers, offer
            conn.abort()
        # the websockets client offers deflate by default: the server declines it
        async with connect(server.ws_url, subprotocols=[P.SUBPROTOCOL]) as ws:  # type: ignore[list-item]
            assert ws.protocol.extensions == []
            assert ws.response is not None and "Sec-WebSocket-Extensions" not in ws.response.headers


# ---- logs ---------------------------------------------------------------------------------------


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


async def test_tokens_and_text_are_not_logged(make_gateway: GatewayFactory):
    """With the production logging setup at DEBUG, neither tokens (in any of the three places) nor
    the text a client speaks reach the log."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, logging.getLogger("websockets").level)
    secret_text = "Confidential-utterance-4242"
    try:
        configure_logging(GatewayConfig(log_level="DEBUG", log_json=True))
        cap = _Capture()
        cap.setFormatter(root.handlers[0].formatter)
        root.addHandler(cap)
        async with make_gateway(FakeSpeechEngine(), gateway=AUTH) as server:
            async with fast_client(server.ws_url, token=TOKEN) as c:  # the token as a header
                await c.speak(f"Say this: {secret_text}.").wait_played()
            async with connect(server.ws_url, subprotocols=TOKEN_SUBPROTOCOLS, compression=None) as ws:
                for m in ({"type": "session.start"}, {"type": "text.delta", "text": f"Say this: {secret_text}."},
                          {"type": "text.end"}):
                    await ws.send(orjson.dumps(m).decode())
                async for m in ws:  # no playback reports: real-time pacing, a short sentence
                    if isinstance(m, str) and orjson.loads(m)["type"] == "utterance.done":
                        break
            async with quiet_client(server.ws_url + f"?token={TOKEN}"):
                pass
            with pytest.raises(VoicegwError):
                await quiet_client(server.ws_url, token=f"{TOKEN}-wrong").connect()
            await assert_drained(server)
        text = "\n".join(cap.lines)
        assert cap.lines, "nothing captured"
        assert TOKEN not in text
        assert secret_text not in text
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
        logging.getLogger("websockets").setLevel(saved[2])


# ---- control-frame flood ------------------------------------------------------------------------
#
# websockets answers every ping with a pong, in data_received, before the gateway sees anything,
# and control frames do not count against max_messages_per_s. A client that sends pings and never
# reads made the server buffer one pong per ping in user space, without bound (measured before the
# fix: +25 MB of server RSS for 26 MB of pings, linear, connection still open). Fixed (issue 8):
# gateway/dialects/front.py FrontConnection.data_received aborts a connection whose transport write
# buffer exceeds 16 x gateway.write_limit_bytes + 1 MiB (2 MiB by default).


async def _ping_flood(server: GatewayServer, total_bytes: int) -> tuple[int, bool]:
    """(largest server write buffer seen, whether the server dropped the flooder)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock)
    req, _ = handshake_request("127.0.0.1", server.port)
    writer.write(req)
    await writer.drain()
    assert (await read_http_response(reader)).status == 101
    batch = build_frame(OP_PING, b"p" * 125) * 1000  # 131 kB of pings, 127 kB of pongs owed
    peak = 0
    dropped = False
    for _ in range(total_bytes // len(batch)):
        try:
            writer.write(batch)
            async with asyncio.timeout(2):
                await writer.drain()
        except (ConnectionError, TimeoutError):
            dropped = True
            break
        await asyncio.sleep(0)
        for c in list(server.connections):
            peak = max(peak, c.ws.ws.transport.get_write_buffer_size())  # c.ws: a NativeTransport
        if not server.connections:
            dropped = True
            break
    dropped = dropped or await wait_until(lambda: not server.connections, within_s=2)
    writer.transport.abort()
    return peak, dropped


async def test_ping_flood_from_a_non_reader_is_bounded(make_gateway: GatewayFactory):
    """The flooder is dropped at the hard cap (2 MiB by default); others are still served."""
    async with make_gateway(FakeSpeechEngine()) as server:
        peak, dropped = await _ping_flood(server, 8 << 20)
        assert dropped and peak < (2 << 20) + (256 << 10), (peak, dropped)
        await assert_still_serving(server)


# ---- the HTTP (non-GET) door: POST /v1/audio/speech (gateway/dialects/front.py) -------------------

_AUTH_LINE = f"Authorization: Bearer {TOKEN}\r\n".encode()
_POST = b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\n"

HTTP_DOOR: list[tuple[str, bytes, int]] = [
    ("huge-content-length-no-body", _POST + _AUTH_LINE + b"Content-Length: 1000000000000\r\n\r\n", 413),
    ("chunked-over-the-cap", _POST + _AUTH_LINE + b"Transfer-Encoding: chunked\r\n\r\n"
     + (b"10000\r\n" + b"a" * 65536 + b"\r\n") * 4, 413),
    ("no-token", _POST + b"Content-Length: 2\r\n\r\n{}", 401),
    ("wrong-token", _POST + b"Authorization: Bearer nope\r\nContent-Length: 2\r\n\r\n{}", 401),
    ("not-json", _POST + _AUTH_LINE + b"Content-Length: 5\r\n\r\n{{{{{", 400),
    ("two-content-lengths", _POST + _AUTH_LINE + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\n{}", 400),
    ("put", b"PUT / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 405),
]


@pytest.mark.parametrize("request_bytes,expected", [pytest.param(b, c, id=i) for i, b, c in HTTP_DOOR])
async def test_http_door_refuses_hostile_requests(request_bytes: bytes, expected: int,
                                                  make_gateway: GatewayFactory):
    async with make_gateway(FakeSpeechEngine(), gateway={**AUTH, "open_timeout_s": 1.0}) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(request_bytes)
        await writer.drain()
        resp = await read_http_response(reader, within_s=3)
        writer.transport.abort()
        assert resp.status == expected
        assert not resp.conflicting_length
        assert not server.connections
        await assert_still_serving(server, token=TOKEN)


async def test_http_door_drops_a_stalled_body(make_gateway: GatewayFactory):
    """Half a body, then silence: 408 after open_timeout_s, nothing left behind."""
    async with make_gateway(FakeSpeechEngine(), gateway={**AUTH, "open_timeout_s": 1.0}) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(_POST + _AUTH_LINE + b'Content-Length: 100\r\n\r\n{"in')
        await writer.drain()
        t0 = time.monotonic()
        resp = await read_http_response(reader, within_s=4)
        writer.transport.abort()
        assert resp.status == 408 and time.monotonic() - t0 < 2.5
        assert not server.connections


# ---- dialect WebSockets: credentials at the handshake ---------------------------------------------
#
# ElevenLabs clients may send their key in the first message, so gateway/dialects/__init__.py
# accepts an ElevenLabs handshake that carries no credential at all. Before issue 8 such a
# connection held a session seat until limits.idle_timeout_s (300 s): a client without any token
# could fill max_sessions with silent connections. Now a valid key must come within
# gateway.open_timeout_s of the handshake (gateway/dialects/socket.py DialectSocket._authenticate),
# else close 1008.

ELEVENLABS_PATH = "/v1/text-to-speech/21m00Tcm4TlvDq8ikWAM/stream-input"


async def test_dialect_handshake_with_a_wrong_key_is_401(make_gateway: GatewayFactory):
    async with make_gateway(FakeSpeechEngine(), gateway=AUTH) as server:
        for path in (ELEVENLABS_PATH, "/v1/speak"):
            status, _, _ = await _status(server.port, path=path, headers={"xi-api-key": "wrong"},
                                         subprotocols=None)
            assert status == 401, path
        assert not server.connections


async def test_unauthenticated_dialect_socket_cannot_hold_seats(make_gateway: GatewayFactory):
    """Two key-less ElevenLabs sockets fill max_sessions (2): one silent, one sending messages
    without a key. Both are closed 1008 once gateway.open_timeout_s has passed, and the seats are
    free again."""
    gw = {**AUTH, "open_timeout_s": 1.0}
    async with make_gateway(FakeSpeechEngine(), gateway=gw, limits={"max_sessions": 2}) as server:
        squatters = []
        try:
            for _ in range(2):
                conn = await RawConn.open("127.0.0.1", server.port, path=ELEVENLABS_PATH, subprotocols=None,
                                          expect_status=None)
                squatters.append(conn)
            # accepted (the key may come in the first message) ...
            assert [c.response.status for c in squatters] == [101, 101]
            t0 = time.monotonic()
            chatty = squatters[1]

            async def chatter() -> None:
                with contextlib.suppress(Exception):
                    for _ in range(40):
                        await chatty.send_raw(build_frame(OP_BINARY, b"x"))
                        await chatty.send_json({"no": "text"})
                        await asyncio.sleep(0.05)

            task = asyncio.create_task(chatter())
            # ... but closed 1008 once the opening deadline has passed without a key
            closes = await asyncio.gather(*(c.expect_close(within_s=10) for c in squatters))
            took = time.monotonic() - t0
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            assert [code for code, _ in closes] == [1008, 1008], closes
            assert took < 5.0, took  # open_timeout_s (1 s) + scheduling slack; idle_timeout_s is 300 s
            assert await wait_until(lambda: not server.connections, within_s=2)
            await assert_still_serving(server, token=TOKEN)
        finally:
            for c in squatters:
                c.abort()


async def test_dialect_key_in_the_first_message_is_served(make_gateway: GatewayFactory):
    """The other side of the deadline: a key-less handshake whose first message carries the key
    (ElevenLabs' xi_api_key) gets its session, and keeps it past gateway.open_timeout_s."""
    gw = {**AUTH, "open_timeout_s": 1.0}
    async with make_gateway(FakeSpeechEngine(), gateway=gw) as server:
        conn = await RawConn.open("127.0.0.1", server.port, path=ELEVENLABS_PATH, subprotocols=None,
                                  expect_status=101)
        try:
            await conn.send_json({"text": " ", "xi_api_key": TOKEN})
            await asyncio.sleep(1.5)
            await conn.send_json({"text": "Hello there."})
            await conn.send_json({"text": ""})
            audio = 0
            while True:
                msg = await conn.read_json(within_s=10)
                if msg.get("audio"):
                    audio += 1
                if msg.get("isFinal") is True:
                    break
            assert audio > 0
        finally:
            conn.abort()

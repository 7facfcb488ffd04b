"""WebSocket framing attacks below the websockets client: hand-built frames over a raw socket.

Each case: a live session, then one hostile frame (or frame sequence); the server must answer
with the documented close code (docs/protocol.md "Close codes"; 1002/1007/1009 come from the
websockets library), drop the session and its engine work, and keep serving another client.
"""

from __future__ import annotations

import asyncio
import struct

import pytest

from gateway import protocol as P
from loadtest.fakes import FakeSpeechEngine
from tests.gateway.conftest import GatewayFactory, wait_until
from tests.reliability.helpers import assert_drained, assert_still_serving, fd_count
from tests.reliability.rawws import (
    ABNORMAL,
    OP_BINARY,
    OP_CLOSE,
    OP_CONT,
    OP_PING,
    OP_PONG,
    OP_TEXT,
    RawConn,
    build_frame,
    close_payload,
    handshake_request,
    read_http_response,
)

MAX_MESSAGE_BYTES = 4096
LIMITS = {"max_message_bytes": MAX_MESSAGE_BYTES}
GATEWAY = {"open_timeout_s": 0.5}
PING = b'{"type":"ping"}'

# (id, bytes sent after a session started, expected close code)
HOSTILE: list[tuple[str, bytes, int]] = [
    ("unmasked-text", build_frame(OP_TEXT, PING, mask=False), 1002),
    ("unmasked-close", build_frame(OP_CLOSE, close_payload(1000), mask=False), 1002),
    ("rsv1", build_frame(OP_TEXT, PING, rsv=0b100), 1002),
    ("rsv2", build_frame(OP_TEXT, PING, rsv=0b010), 1002),
    ("rsv3-on-ping", build_frame(OP_PING, b"x", rsv=0b001), 1002),
    ("opcode-3", build_frame(0x3, b"data"), 1002),
    ("opcode-7", build_frame(0x7, b"data"), 1002),
    ("opcode-0xB", build_frame(0xB, b""), 1002),
    ("opcode-0xF", build_frame(0xF, b"x"), 1002),
    ("ping-126-bytes", build_frame(OP_PING, b"p" * 126), 1002),
    ("pong-200-bytes", build_frame(OP_PONG, b"p" * 200), 1002),
    ("close-126-bytes", build_frame(OP_CLOSE, close_payload(1000, b"r" * 124)), 1002),
    ("fragmented-ping", build_frame(OP_PING, b"a", fin=False) + build_frame(OP_CONT, b"b"), 1002),
    ("fragmented-close", build_frame(OP_CLOSE, close_payload(1000), fin=False), 1002),
    ("continuation-first", build_frame(OP_CONT, PING), 1002),
    ("text-inside-fragmented", build_frame(OP_TEXT, b'{"type":', fin=False) + build_frame(OP_TEXT, PING), 1002),
    ("invalid-utf8", build_frame(OP_TEXT, b'{"type":"ping","t":"\xff\xfe"}'), 1007),
    ("utf8-surrogate", build_frame(OP_TEXT, b'{"type":"text.delta","text":"\xed\xa0\x80"}'), 1007),
    ("utf8-overlong", build_frame(OP_TEXT, b'{"type":"text.delta","text":"\xc0\xaf"}'), 1007),
    ("utf8-truncated-at-end", build_frame(OP_TEXT, b'{"type":"ping"}\xe2\x82'), 1007),
    ("invalid-utf8-across-fragments",
     build_frame(OP_TEXT, b'{"type":"ping","t":"\xe2', fin=False) + build_frame(OP_CONT, b'\x28"}'), 1007),
    ("close-code-999", build_frame(OP_CLOSE, close_payload(999)), 1002),
    ("close-code-1004", build_frame(OP_CLOSE, close_payload(1004)), 1002),
    ("close-code-1005", build_frame(OP_CLOSE, close_payload(1005)), 1002),
    ("close-code-1006", build_frame(OP_CLOSE, close_payload(1006)), 1002),
    ("close-code-1015", build_frame(OP_CLOSE, close_payload(1015)), 1002),
    ("close-code-2000", build_frame(OP_CLOSE, close_payload(2000)), 1002),
    ("close-code-5000", build_frame(OP_CLOSE, close_payload(5000)), 1002),
    ("close-code-65535", build_frame(OP_CLOSE, close_payload(65535)), 1002),
    ("close-1-byte", build_frame(OP_CLOSE, b"\x03"), 1002),
    ("close-reason-not-utf8", build_frame(OP_CLOSE, close_payload(1000, b"\xff\xfe")), 1007),
    ("oversize-text", build_frame(OP_TEXT, b"x" * (MAX_MESSAGE_BYTES + 1)), 1009),
    ("oversize-fragmented", b"".join(
        build_frame(OP_TEXT if i == 0 else OP_CONT, b" " * 1024, fin=i == 4) for i in range(5)), 1009),
    ("oversize-binary-header-only", build_frame(OP_BINARY, b"", length=MAX_MESSAGE_BYTES + 1), 1009),
]


@pytest.mark.parametrize("payload,expected", [pytest.param(b, c, id=i) for i, b, c in HOSTILE])
async def test_hostile_frame_gets_documented_close(payload: bytes, expected: int, make_gateway: GatewayFactory):
    engine = FakeSpeechEngine()
    async with make_gateway(engine, gateway=GATEWAY, limits=LIMITS) as server:
        conn = await RawConn.open("127.0.0.1", server.port)
        await conn.send_json({"type": "session.start"})
        assert (await conn.read_json())["type"] == "session.started"
        # some work in flight, so the close must also abort engine requests
        await conn.send_json({"type": "text.delta", "text": "Words that will be cut short by a bad frame. " * 4})
        await conn.send_raw(payload)
        code, reason = await conn.expect_close(within_s=3)
        assert code == expected
        # fixed texts only: the library's exception text ("invalid continuation byte at ...")
        # never reaches the client
        assert reason in {r.value for r in P.LIBRARY_CLOSE_REASONS.values()} | {""}, reason
        await conn.close()
        await assert_drained(server)
        await assert_still_serving(server)


async def test_oversize_header_closes_1009_before_payload(make_gateway: GatewayFactory):
    """Only a header announcing a huge payload is sent: the close must come without the payload."""
    async with make_gateway(FakeSpeechEngine(), gateway=GATEWAY, limits=LIMITS) as server:
        for length in (MAX_MESSAGE_BYTES + 1, 1 << 20, 1 << 40, (1 << 63) - 1):
            conn = await RawConn.open("127.0.0.1", server.port)
            await conn.send_json({"type": "session.start"})
            await conn.read_json()
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await conn.send_raw(build_frame(OP_TEXT, b"", length=length))  # header and mask key only
            code, _ = await conn.expect_close(within_s=2)
            assert code == 1009, length
            assert loop.time() - t0 < 1.0
            await conn.close()
        await assert_drained(server)
        await assert_still_serving(server)


@pytest.mark.parametrize("code", [1000, 1001, 3000, 4000, 4999])
async def test_valid_client_close_codes_are_echoed(code: int, make_gateway: GatewayFactory):
    async with make_gateway(FakeSpeechEngine(), gateway=GATEWAY) as server:
        conn = await RawConn.open("127.0.0.1", server.port)
        await conn.send_json({"type": "session.start"})
        await conn.read_json()
        await conn.send_json({"type": "text.delta", "text": "An utterance cut off by the client closing. " * 3})
        await conn.send_frame(OP_CLOSE, close_payload(code, "bye ✓".encode()))
        got, _ = await conn.expect_close(within_s=3)
        assert got == code  # RFC 6455 5.5.1: the endpoint echoes the status code
        await conn.close()
        await assert_drained(server)


async def test_binary_and_unsolicited_pong_do_not_close(make_gateway: GatewayFactory):
    async with make_gateway(FakeSpeechEngine(), gateway=GATEWAY) as server:
        conn = await RawConn.open("127.0.0.1", server.port)
        await conn.send_json({"type": "session.start"})
        await conn.read_json()
        await conn.send_frame(OP_BINARY, b"\x00" * 100)
        err = await conn.read_json()
        assert err["type"] == "error" and err["code"] == "binary_not_allowed"
        await conn.send_frame(OP_PONG, b"unsolicited")
        await conn.send_frame(OP_PING, b"hello")
        while True:
            f = await conn.read_frame()
            if f.opcode == OP_PONG:
                assert f.payload == b"hello"
                break
        # a fragmented text message is reassembled
        await conn.send_frame(OP_TEXT, b'{"type":"pi', fin=False)
        await conn.send_frame(OP_PING, b"between")  # control frames may interleave fragments
        await conn.send_frame(OP_CONT, b'ng","id":7}')
        msg = await conn.read_json()
        assert msg == {"type": "pong", "server_time_ms": msg["server_time_ms"], "id": 7}
        await conn.send_frame(OP_CLOSE, close_payload(1000))
        assert (await conn.expect_close())[0] == 1000
        await conn.close()
        await assert_drained(server)


# ---- handshakes -------------------------------------------------------------------------------


async def _dropped_within(reader: asyncio.StreamReader, within_s: float) -> bool:
    try:
        async with asyncio.timeout(within_s):
            while await reader.read(4096):
                pass
        return True
    except TimeoutError:
        return False
    except ConnectionError:
        return True


async def test_half_open_handshakes_are_dropped_by_open_timeout(make_gateway: GatewayFactory):
    """Silent connections and half-sent handshakes (slowloris) are dropped after
    ``gateway.open_timeout_s``; meanwhile other clients are served; nothing leaks."""
    async with make_gateway(FakeSpeechEngine(), gateway=GATEWAY) as server:
        await assert_still_serving(server)  # warm: lazily created objects exist before the baseline
        fds_before = fd_count()
        req, _ = handshake_request("127.0.0.1", server.port)
        conns = []
        for i in range(40):
            r, w = await asyncio.open_connection("127.0.0.1", server.port)
            if i % 2:  # half of them send part of the request, never its end
                w.write(req[: len(req) // 2])
                await w.drain()
            conns.append((r, w))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await assert_still_serving(server)  # served while 40 handshakes hang
        dropped = await asyncio.gather(*(_dropped_within(r, 3.0) for r, _ in conns))
        elapsed = loop.time() - t0
        assert all(dropped)
        assert elapsed < 0.5 + 1.5
        for _, w in conns:
            w.close()
        assert await wait_until(lambda: fd_count() <= fds_before, within_s=3), (fds_before, fd_count())
        await assert_still_serving(server)


@pytest.mark.parametrize("request_bytes,expected_status", [
    pytest.param(b"GARBAGE\r\n\r\n", None, id="garbage-request-line"),
    pytest.param(b"GET /ws HTTP/1.0\r\nHost: x\r\n\r\n", 426, id="http-1.0-no-upgrade"),
    pytest.param(b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Version: 13\r\n\r\n", 400, id="no-key"),
    pytest.param(b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Key: short\r\nSec-WebSocket-Version: 13\r\n\r\n", 400, id="bad-key"),
    pytest.param(b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 8\r\n\r\n", 400,
                 id="version-8"),
    pytest.param(b"GET /ws HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 9000 + b"\r\n\r\n", None, id="header-line-9KB"),
    pytest.param(b"GET /ws HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(200)) + b"\r\n",
                 None, id="200-headers"),
    pytest.param(b"POST /ws HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello", None, id="post"),
])
async def test_malformed_handshakes_are_refused(request_bytes: bytes, expected_status: int | None,
                                                make_gateway: GatewayFactory):
    """Refused with an HTTP error (or a dropped connection, ``None``: any 4xx or EOF); the server
    keeps serving."""
    async with make_gateway(FakeSpeechEngine(), gateway=GATEWAY) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(request_bytes)
        await writer.drain()
        try:
            resp = await read_http_response(reader, within_s=3)
            status: int | None = resp.status
        except (asyncio.IncompleteReadError, ConnectionError):
            status = None
        if expected_status is None:
            assert status is None or 400 <= status < 500, status
        else:
            assert status == expected_status
        assert await _dropped_within(reader, 3.0)
        writer.close()
        await assert_still_serving(server)


async def test_frames_before_handshake_completes_are_not_processed(make_gateway: GatewayFactory):
    """A client that sends frames glued to a refused handshake gets only the refusal."""
    async with make_gateway(FakeSpeechEngine(), gateway={**GATEWAY, "auth_tokens": ("tok",)}) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        req, _ = handshake_request("127.0.0.1", server.port)
        writer.write(req + build_frame(OP_TEXT, b'{"type":"session.start"}'))
        await writer.drain()
        resp = await read_http_response(reader)
        assert resp.status == 401
        assert await _dropped_within(reader, 3.0)
        writer.close()
        assert not server.connections


def test_close_code_table_matches_protocol() -> None:
    """The codes this file expects are the documented ones."""
    documented = {int(c) for c in P.CloseCode}
    for _, _, code in HOSTILE:
        assert code in documented
    assert ABNORMAL not in documented
    assert struct.calcsize("!H") == 2

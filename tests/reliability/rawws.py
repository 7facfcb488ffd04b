"""A raw WebSocket client below the websockets library: hand-built handshake and frames over
asyncio streams, so tests can send what no well-behaved client would (unmasked frames, reserved
bits, reserved opcodes, oversize or fragmented control frames, bad close codes, a length header
without its payload, half a handshake).

Server frames are parsed strictly enough to find the close frame and its code.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import os
import struct
from dataclasses import dataclass, field

import orjson

from gateway import protocol as P

WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

OP_CONT = 0x0
OP_TEXT = 0x1
OP_BINARY = 0x2
OP_CLOSE = 0x8
OP_PING = 0x9
OP_PONG = 0xA

#: What ``expect_close`` returns when the TCP connection ended without a close frame.
ABNORMAL = 1006


@dataclass
class HttpResponse:
    status: int
    reason: str
    headers: dict[str, str]
    """Header names lower-cased; repeated headers joined with ", "."""
    body: bytes = b""
    raw_headers: list[tuple[str, str]] = field(default_factory=list)

    def values(self, name: str) -> list[str]:
        return [v for k, v in self.raw_headers if k == name.lower()]

    @property
    def conflicting_length(self) -> bool:
        """More than one Content-Length value (a malformed response, RFC 9112 6.3)."""
        return len(set(self.values("content-length"))) > 1


@dataclass
class Frame:
    fin: bool
    opcode: int
    payload: bytes
    rsv: int = 0

    @property
    def close_code(self) -> int | None:
        if self.opcode != OP_CLOSE:
            return None
        if len(self.payload) < 2:
            return 1005
        return int(struct.unpack("!H", self.payload[:2])[0])

    @property
    def close_reason(self) -> str:
        return self.payload[2:].decode("utf-8", "replace") if self.opcode == OP_CLOSE else ""


def build_frame(
    opcode: int,
    payload: bytes = b"",
    *,
    fin: bool = True,
    rsv: int = 0,
    mask: bool = True,
    length: int | None = None,
) -> bytes:
    """One frame. ``rsv`` is the 3 reserved bits (0..7); ``length`` overrides the announced
    payload length (the payload bytes given are still appended as they are)."""
    n = len(payload) if length is None else length
    b0 = (0x80 if fin else 0) | ((rsv & 7) << 4) | (opcode & 0xF)
    mbit = 0x80 if mask else 0
    if n < 126:
        head = struct.pack("!BB", b0, mbit | n)
    elif n < 1 << 16:
        head = struct.pack("!BBH", b0, mbit | 126, n)
    else:
        head = struct.pack("!BBQ", b0, mbit | 127, n)
    if not mask:
        return head + payload
    key = os.urandom(4)
    return head + key + _xor(payload, key)


def _xor(data: bytes, key: bytes) -> bytes:
    if not data:
        return b""
    k = (key * (len(data) // 4 + 1))[: len(data)]
    return (int.from_bytes(data, "big") ^ int.from_bytes(k, "big")).to_bytes(len(data), "big")


def close_payload(code: int, reason: bytes = b"") -> bytes:
    return struct.pack("!H", code) + reason


def handshake_request(
    host: str,
    port: int,
    *,
    path: str = P.WS_PATH,
    key: str | None = None,
    subprotocols: tuple[str, ...] | None = (P.SUBPROTOCOL,),
    headers: dict[str, str] | None = None,
) -> tuple[bytes, str]:
    """(request bytes, Sec-WebSocket-Key)."""
    key = key or base64.b64encode(os.urandom(16)).decode()
    lines = [
        f"GET {path} HTTP/1.1",
        f"Host: {host}:{port}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Key: {key}",
        "Sec-WebSocket-Version: 13",
    ]
    if subprotocols:
        lines.append("Sec-WebSocket-Protocol: " + ", ".join(subprotocols))
    for k, v in (headers or {}).items():
        lines.append(f"{k}: {v}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode(), key


def accept_for(key: str) -> str:
    return base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()


async def read_http_response(reader: asyncio.StreamReader, within_s: float = 5.0) -> HttpResponse:
    async with asyncio.timeout(within_s):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        _, status, *reason = lines[0].split(" ", 2)
        headers: dict[str, str] = {}
        raw: list[tuple[str, str]] = []
        for line in lines[1:]:
            if not line:
                continue
            k, _, v = line.partition(":")
            k = k.strip().lower()
            raw.append((k, v.strip()))
            headers[k] = f"{headers[k]}, {v.strip()}" if k in headers else v.strip()
        resp = HttpResponse(int(status), reason[0] if reason else "", headers, b"", raw)
        lengths = resp.values("content-length")
        if int(status) != 101 and lengths and not resp.conflicting_length:
            resp.body = await reader.readexactly(int(lengths[0]))
        return resp


@dataclass
class RawConn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    response: HttpResponse
    frames: list[Frame] = field(default_factory=list)

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        *,
        path: str = P.WS_PATH,
        subprotocols: tuple[str, ...] | None = (P.SUBPROTOCOL,),
        headers: dict[str, str] | None = None,
        expect_status: int | None = 101,
    ) -> RawConn:
        reader, writer = await asyncio.open_connection(host, port)
        req, key = handshake_request(host, port, path=path, subprotocols=subprotocols, headers=headers)
        writer.write(req)
        await writer.drain()
        resp = await read_http_response(reader)
        if expect_status is not None and resp.status != expect_status:
            writer.close()
            raise AssertionError(f"handshake: HTTP {resp.status} {resp.reason}, expected {expect_status}")
        if resp.status == 101:
            assert resp.headers.get("sec-websocket-accept") == accept_for(key)
        return cls(reader, writer, resp)

    # ---- sending -----------------------------------------------------------------------

    async def send_raw(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def send_frame(self, opcode: int, payload: bytes = b"", **kw: object) -> None:
        await self.send_raw(build_frame(opcode, payload, **kw))  # type: ignore[arg-type]

    async def send_json(self, obj: object) -> None:
        await self.send_frame(OP_TEXT, orjson.dumps(obj))

    # ---- receiving ---------------------------------------------------------------------

    async def read_frame(self, within_s: float = 5.0) -> Frame:
        """The next server frame. Raises ``asyncio.IncompleteReadError`` at EOF, ``TimeoutError``."""
        async with asyncio.timeout(within_s):
            b0, b1 = await self.reader.readexactly(2)
            n = b1 & 0x7F
            if n == 126:
                (n,) = struct.unpack("!H", await self.reader.readexactly(2))
            elif n == 127:
                (n,) = struct.unpack("!Q", await self.reader.readexactly(8))
            key = await self.reader.readexactly(4) if b1 & 0x80 else None
            payload = await self.reader.readexactly(n)
            if key is not None:
                payload = _xor(payload, key)
            f = Frame(bool(b0 & 0x80), b0 & 0x0F, payload, (b0 >> 4) & 7)
            self.frames.append(f)
            return f

    async def read_json(self, within_s: float = 5.0) -> dict[str, object]:
        """The next text frame as JSON (binary frames skipped)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while True:
            f = await self.read_frame(max(0.01, deadline - loop.time()))
            if f.opcode == OP_TEXT:
                return orjson.loads(f.payload)  # type: ignore[no-any-return]
            if f.opcode == OP_CLOSE:
                raise ConnectionError(f"closed {f.close_code} {f.close_reason!r}")

    async def wait_json(self, mtype: str, within_s: float = 10.0, **match: object) -> dict[str, object]:
        """Read until a text message of this type (and these field values); others are skipped."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError(f"no {mtype} within {within_s} s")
            m = await self.read_json(left)
            if m.get("type") == mtype and all(m.get(k) == v for k, v in match.items()):
                return m

    async def expect_close(self, within_s: float = 5.0) -> tuple[int, str]:
        """Read until the server's close frame: (code, reason); (1006, "") when the TCP
        connection ends without one. Answers the close like a client should."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while True:
            try:
                f = await self.read_frame(max(0.01, deadline - loop.time()))
            except (asyncio.IncompleteReadError, ConnectionError):
                return ABNORMAL, ""
            if f.opcode == OP_CLOSE:
                code = f.close_code or 1005
                with contextlib.suppress(Exception):
                    await self.send_frame(OP_CLOSE, f.payload[:2])
                return code, f.close_reason

    async def wait_eof(self, within_s: float = 5.0) -> bool:
        """True when the server ends the TCP connection within the time (data is discarded)."""
        try:
            async with asyncio.timeout(within_s):
                while await self.reader.read(65536):
                    pass
            return True
        except TimeoutError:
            return False
        except ConnectionError:
            return True

    def abort(self) -> None:
        transport = self.writer.transport
        transport.abort()

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()
            await self.writer.wait_closed()

"""Hostile-client tooling for the dialects' HTTP and handshake surfaces (tests/dialects/test_hostile.py,
tests/dialects/test_fuzz_http.py).

``ThreadedGateway`` runs a real gateway (``GatewayServer`` on 127.0.0.1, the fake engine) on its
own event loop in a thread, so plain blocking sockets (and hypothesis, which drives synchronous
tests) can talk to it, and records what must never happen: an exception handed to the loop's
exception handler (a task's exception never retrieved, a callback's error), a log record with a
traceback, or one at ERROR or above. ``open_fds`` / ``close_wait`` read /proc: the gateway runs in
this process, and its listening port names its sockets in /proc/net/tcp.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from gateway.server import GatewayServer
from gateway.session import SessionSettings
from loadtest.fakes import FakeSpeechEngine
from tests.gateway.conftest import make_config

#: Statuses a dialect HTTP request may be answered with (docs/dialects/*.md, SECURITY.md).
HTTP_STATUSES = frozenset({200, 400, 401, 404, 405, 408, 413, 422, 431, 503})
#: Statuses a dialect WebSocket handshake may be answered with.
WS_STATUSES = frozenset({101, 400, 401, 403, 404, 503})


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def close_wait(port: int) -> int:
    """Sockets of ``port`` (the server side) in CLOSE-WAIT: the peer closed, the gateway did not."""
    n = 0
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "08":
                n += 1
    return n


class _Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.bad: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or record.levelno >= logging.ERROR:
            self.bad.append(f"{record.name}: {record.getMessage()}")


@dataclass
class ThreadedGateway:
    gateway: dict[str, Any] = field(default_factory=dict)
    limits: dict[str, Any] = field(default_factory=dict)
    port: int = 0
    problems: list[str] = field(default_factory=list)
    _loop: asyncio.AbstractEventLoop | None = None
    _server: GatewayServer | None = None
    _thread: threading.Thread | None = None
    _recorder: _Recorder = field(default_factory=_Recorder)

    def __enter__(self) -> ThreadedGateway:
        ready = threading.Event()
        logging.getLogger().addHandler(self._recorder)

        def run() -> None:
            loop = self._loop = asyncio.new_event_loop()
            loop.set_exception_handler(lambda _l, ctx: self.problems.append(str(ctx.get("message"))
                                                                             + " " + repr(ctx.get("exception"))))

            async def start() -> None:
                config = make_config({"port": 0, "open_timeout_s": 2.0, **self.gateway}, self.limits)
                engine = FakeSpeechEngine()
                self._server = GatewayServer(config, engine, static_dir=Path(__file__).parent,
                                             settings=SessionSettings.from_config(config, engine.name))
                await self._server.start()
                self.port = self._server.port
                ready.set()

            loop.run_until_complete(start())
            loop.run_forever()
            loop.run_until_complete(self._server.shutdown(grace_s=0.2))  # type: ignore[union-attr]
            loop.close()

        self._thread = threading.Thread(target=run, name="gateway", daemon=True)
        self._thread.start()
        assert ready.wait(10), "the gateway did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._thread is not None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        logging.getLogger().removeHandler(self._recorder)

    @property
    def logged(self) -> list[str]:
        return self._recorder.bad

    def settled(self, baseline_fds: int, within_s: float = 5.0) -> tuple[int, int]:
        """Wait until the open fds are back to ``baseline_fds`` and nothing is in CLOSE-WAIT;
        return the last (fds, close_wait) seen."""
        deadline = time.monotonic() + within_s
        while True:
            gc.collect()  # a task whose exception was never retrieved reports when collected
            fds, cw = open_fds(), close_wait(self.port)
            if (fds <= baseline_fds and cw == 0) or time.monotonic() > deadline:
                return fds, cw
            time.sleep(0.05)


@dataclass
class Answer:
    status: int | None
    """None: no answer (the connection was reset or timed out before a status line)."""
    headers: dict[str, str]
    body: bytes
    error: str = ""


def exchange(port: int, data: bytes, *, read_s: float = 5.0, chunks: list[bytes] | None = None) -> Answer:
    """Send ``data`` (then each of ``chunks``), read the answer until the server closes (a 101: the
    head only, then close)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=read_s)
    buf = b""
    err = ""
    try:
        try:
            s.sendall(data)
            for c in chunks or []:
                s.sendall(c)
        except OSError:
            pass  # the server may answer (and stop reading) before the whole request is sent
        while True:
            d = s.recv(65536)
            if not d:
                break
            buf += d
            if buf.startswith(b"HTTP/1.1 101 ") and b"\r\n\r\n" in buf:
                break
    except OSError as exc:
        err = type(exc).__name__
    finally:
        s.close()
    return parse_answer(buf, err)


def parse_answer(buf: bytes, err: str, *, dechunked: bool = False) -> Answer:
    """The status line, headers and body of the bytes an HTTP server answered (``dechunked``: a
    chunked body decoded)."""
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    try:
        status: int | None = int(lines[0].split(" ")[1])
    except (IndexError, ValueError):
        return Answer(None, {}, buf, err or "no status line")
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if dechunked and headers.get("transfer-encoding") == "chunked":
        body = dechunk(body)
    return Answer(status, headers, body, err)


def vendor_shape_ok(vendor: str, body: bytes) -> bool:
    """``body`` is an error in ``vendor``'s shape (docs/dialects/*.md)."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    if not isinstance(obj, dict):
        return False
    if vendor == "openai":
        e = obj.get("error")
        return isinstance(e, dict) and isinstance(e.get("message"), str) and isinstance(e.get("type"), str) \
            and set(e) == {"message", "type", "param", "code"}
    if vendor == "elevenlabs":
        d = obj.get("detail")
        return set(obj) == {"detail"} and isinstance(d, dict) and isinstance(d.get("status"), str) \
            and isinstance(d.get("message"), str)
    if vendor == "deepgram":
        return isinstance(obj.get("err_code"), str) and isinstance(obj.get("err_msg"), str) \
            and isinstance(obj.get("request_id"), str)
    raise ValueError(vendor)


def dechunk(body: bytes) -> bytes:
    """A chunked body's payload (best effort: what arrived)."""
    out = b""
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        try:
            n = int(size_line.split(b";")[0], 16)
        except ValueError:
            return out
        if n == 0:
            return out
        out += rest[:n]
        body = rest[n + 2:]
    return out


def ws_handshake(path: str, headers: list[tuple[str, str]] | None = None) -> bytes:
    hdrs = [("Host", "127.0.0.1"), ("Upgrade", "websocket"), ("Connection", "Upgrade"),
            ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="), ("Sec-WebSocket-Version", "13"), *(headers or [])]
    return (f"GET {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs) + "\r\n").encode()


def post(path: str, body: bytes, headers: list[tuple[str, str]] | None = None, *,
         content_length: bool = True) -> bytes:
    hdrs = [("Host", "127.0.0.1"), ("Content-Type", "application/json"), *(headers or [])]
    if content_length:
        hdrs.append(("Content-Length", str(len(body))))
    head = f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs) + "\r\n"
    return head.encode("latin-1") + body

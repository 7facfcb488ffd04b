"""I/O edge of the WebSocket dialects: a ``gateway.transport.Transport`` speaking a dialect on the
real connection.

``server._Connection`` runs the native session over it exactly as over a native client: it
iterates it for client messages and calls ``send_message``/``send_audio``/``close``. Here, client
frames go through the translator into native message objects (``__aiter__``; no JSON between
them), and the session's messages and audio through the translator into dialect frames. So the dialects share the native session core, engine,
scheduler, limits, flow control and metrics; nothing here decides anything.

Flow control: dialect clients do not report playback. The session is told the client "played"
what has been handed to the socket (a ``playback`` report after each send, at most every
``report_interval_s``): audio goes out as fast as the engine makes it and the client reads it, and
when the client stops reading, ``send`` blocks (websockets' write limit), reports stop, the flow
window fills and the engine is no longer pulled. A client that stops reading altogether is closed
by the native slow-reader rule.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.protocol import State

from gateway import protocol as P
from gateway.dialects.base import Step, Translator
from gateway.transport import ClientItem, NativeTransport

_CLOSE_WAIT_S = 2.0


class Inbox:
    """Native messages for the session: the client's (bounded, ``put`` waits for room), plus one
    coalesced ``playback`` report, sent at most every ``report_interval_s``."""

    def __init__(self, cap: int = 16, report_interval_s: float = 0.1) -> None:
        self.cap = cap
        self.report_interval_s = report_interval_s
        self._items: deque[dict[str, Any]] = deque()
        self._ready = asyncio.Event()
        self._space = asyncio.Event()
        self._report: int | None = None
        self._reported = -1
        self._last_report_s = -1e9
        self._ended = False
        self._loop = asyncio.get_running_loop()

    def put_nowait(self, item: dict[str, Any]) -> None:
        self._items.append(item)
        self._ready.set()

    async def put(self, item: dict[str, Any]) -> None:
        while len(self._items) >= self.cap and not self._ended:
            self._space.clear()
            await self._space.wait()
        if not self._ended:
            self.put_nowait(item)

    def report(self, played_samples: int) -> None:
        if played_samples != self._reported:
            self._report = played_samples
            self._ready.set()

    def end(self) -> None:
        self._ended = True
        self._ready.set()
        self._space.set()

    async def get(self) -> dict[str, Any] | None:
        """The next message; None once ended (pending client messages first)."""
        while True:
            if self._items:
                item = self._items.popleft()
                self._space.set()
                return item
            if self._ended:
                return None
            timeout: float | None = None
            if self._report is not None:
                wait = self._last_report_s + self.report_interval_s - self._loop.time()
                if wait <= 0:
                    played, self._report = self._report, None
                    self._reported = played
                    self._last_report_s = self._loop.time()
                    return {"type": P.ClientType.PLAYBACK.value, "played_samples": played}
                timeout = wait
            self._ready.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._ready.wait()


class DialectSocket(NativeTransport):
    """A ``Transport`` for ``server._Connection`` that speaks a dialect on ``ws``."""

    def __init__(self, ws: ServerConnection, translator: Translator, *, report_interval_s: float = 0.1,
                 inbox_cap: int = 16, auth_timeout_s: float | None = None) -> None:
        """``auth_timeout_s``: for a translator that authenticates in-band (``authenticated``
        attribute False at connect, ``on_auth_timeout()``): the connection is closed as the
        translator says unless it is authenticated within this many seconds of the handshake."""
        super().__init__(ws)
        self.translator = translator
        self.auth_timeout_s = auth_timeout_s
        self.report_interval_s = report_interval_s
        self.inbox_cap = inbox_cap
        self._inbox: Inbox | None = None
        self._delivered = 0
        self._close_task: asyncio.Task[None] | None = None

    # ---- the Transport (the connection's own state, close code and socket: NativeTransport's) ----

    def __aiter__(self) -> AsyncIterator[ClientItem]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[ClientItem]:
        inbox = self._inbox = Inbox(self.inbox_cap, self.report_interval_s)
        opening = self.translator.opening()
        for m in opening.to_session:
            inbox.put_nowait(m)
        reader = asyncio.create_task(self._read(inbox, opening))
        try:
            while (item := await inbox.get()) is not None:
                yield item
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader

    async def _read(self, inbox: Inbox, opening: Step) -> None:
        try:
            await self._carry(Step(to_client=opening.to_client, close=opening.close))
            if not await self._authenticate():
                return
            async for message in self.ws:
                await self._carry(self.translator.on_client(message))
        except ConnectionClosed:
            pass
        finally:
            inbox.end()

    def _authenticated(self) -> bool:
        return bool(getattr(self.translator, "authenticated", True))

    async def _authenticate(self) -> bool:
        """Read client messages until the translator is authenticated; False (and the connection
        closing) if that does not happen within ``auth_timeout_s``. Any message counts against the
        same deadline, so neither silence nor a trickle of unauthenticated messages keeps a seat."""
        if self.auth_timeout_s is None or self._authenticated():
            return True
        deadline = asyncio.get_running_loop().time() + self.auth_timeout_s
        try:
            while not self._authenticated():
                if self._close_task is not None:
                    return False  # the translator refused the key
                async with asyncio.timeout_at(deadline):
                    step = self.translator.on_client(await self.ws.recv())
                    if not self._authenticated():
                        await self._carry(step)  # error replies: a non-reader cannot stall the deadline
                        continue
                await self._carry(step)  # the authenticating message: carried out in full
        except TimeoutError:
            on_timeout = getattr(self.translator, "on_auth_timeout", None)
            try:
                async with asyncio.timeout(_CLOSE_WAIT_S):  # the error frame must not wait on a non-reader
                    await self._carry(on_timeout() if on_timeout is not None
                                      else Step(close=(P.CloseCode.POLICY_VIOLATION, "no credentials")))
            except TimeoutError:
                self.ws.transport.abort()
            return False
        return True

    async def send_message(self, message: P.ServerMessage, encoded: bytes) -> None:
        await self._carry(self.translator.on_server_message(message))

    async def send_audio(self, frame: bytes) -> None:
        header, payload = P.unpack_audio_frame(frame)
        await self._carry(self.translator.on_server_audio(header, payload))

    async def close(self, code: int = P.CloseCode.NORMAL, reason: str = "") -> None:
        step = self.translator.on_server_close(code, reason)
        if step.close is None:
            step.close = (code, reason)
        await self._carry(step)
        if self._close_task is not None:
            await asyncio.shield(self._close_task)

    # ---- carrying out a step ------------------------------------------------------------------

    async def _carry(self, step: Step) -> None:
        if self._close_task is not None:
            return
        inbox = self._inbox
        for m in step.to_session:
            if inbox is not None:
                await inbox.put(m)
        for frame in step.to_client:
            await self.ws.send(frame)
        if step.delivered_samples:
            self._delivered += step.delivered_samples
            if inbox is not None:
                inbox.report(self._delivered)
        if step.close is not None:
            # in its own task: the caller may be cancelled once the connection is gone
            self._close_task = asyncio.create_task(self._close(*step.close))

    async def _close(self, code: int, reason: str) -> None:
        try:
            async with asyncio.timeout(_CLOSE_WAIT_S):
                await self.ws.close(code, reason)
        except (TimeoutError, ConnectionClosed):
            pass
        if self.ws.state is not State.CLOSED:
            self.ws.transport.abort()

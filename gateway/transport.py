"""The one interface between a session's connection (``gateway/server.py`` ``_Connection``) and
what it runs over: a native WebSocket (``NativeTransport``), a dialect's WebSocket
(``gateway/dialects/socket.py`` ``DialectSocket``) or an HTTP speech request
(``gateway/dialects/front.py`` ``HttpExchange``).

Client messages come in as text or binary frames, or -- from a dialect's translator -- as the
native message objects themselves (no JSON round trip; the session validates them the same way).
Server messages go out as the typed message (``gateway.protocol.ServerMessage``) and its encoding
(``gateway.protocol.encode_server``, the one encoder), so a native transport sends the bytes and a
dialect translates the typed message (never parsing the JSON back).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from websockets.protocol import State

from gateway import protocol as P

if TYPE_CHECKING:
    from websockets.asyncio.server import ServerConnection

ClientItem = str | bytes | dict[str, Any]
"""A client message: a text frame, a binary frame, or a native message object (from a dialect)."""


class Transport(Protocol):
    @property
    def remote_address(self) -> Any: ...

    @property
    def close_code(self) -> int | None:
        """The close code once closed (None before)."""
        ...

    @property
    def closed(self) -> bool: ...

    def __aiter__(self) -> AsyncIterator[ClientItem]: ...

    async def send_message(self, message: P.ServerMessage, encoded: bytes) -> None:
        """A native server message (``encoded`` is ``protocol.encode_server(message)``)."""
        ...

    async def send_audio(self, frame: bytes) -> None:
        """A native audio frame (``protocol.pack_audio_frame``)."""
        ...

    async def close(self, code: int, reason: str) -> None: ...

    def abort(self) -> None:
        """Drop the connection at once (no closing handshake)."""
        ...

    def raw_socket(self) -> Any:
        """The OS socket under it (to bound its kernel send buffer), or None."""
        ...


class NativeTransport:
    """The native protocol (v1) on a websockets ``ServerConnection``."""

    def __init__(self, ws: ServerConnection) -> None:
        self.ws = ws

    @property
    def remote_address(self) -> Any:
        return self.ws.remote_address

    @property
    def close_code(self) -> int | None:
        return self.ws.close_code

    @property
    def closed(self) -> bool:
        return self.ws.state is State.CLOSED

    def __aiter__(self) -> AsyncIterator[ClientItem]:
        return self.ws.__aiter__()

    async def send_message(self, message: P.ServerMessage, encoded: bytes) -> None:
        await self.ws.send(encoded, text=True)

    async def send_audio(self, frame: bytes) -> None:
        await self.ws.send(frame)

    async def close(self, code: int, reason: str) -> None:
        await self.ws.close(code, reason)

    def abort(self) -> None:
        self.ws.transport.abort()

    def raw_socket(self) -> Any:
        return self.ws.transport.get_extra_info("socket")

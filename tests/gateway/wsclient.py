"""A small protocol-v1 test client over websockets (collects messages and audio)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

import orjson
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed
from websockets.typing import Subprotocol

from gateway import protocol as P


@dataclass
class Frame:
    header: P.AudioFrameHeader
    payload: bytes

    @property
    def samples(self) -> int:
        return len(self.payload) // self.header.format.bytes_per_sample


@dataclass
class Client:
    ws: ClientConnection
    fast_playback: bool = False
    """Report every received sample as played at once (a client that plays instantly), so the
    server is paced by the engine, not by real time."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    frames: list[Frame] = field(default_factory=list)
    received_samples: int = 0
    started: dict[str, Any] | None = None

    @classmethod
    async def open(cls, url: str, *, fast_playback: bool = False, subprotocols: list[str] | None = None,
                   **kwargs: Any) -> Client:
        offered = [Subprotocol(p) for p in subprotocols or [P.SUBPROTOCOL]]
        ws = await connect(url, subprotocols=offered, compression=None,
                           open_timeout=5, close_timeout=2, **kwargs)
        return cls(ws, fast_playback)

    async def send(self, obj: dict[str, Any] | str | bytes) -> None:
        if isinstance(obj, dict):
            await self.ws.send(orjson.dumps(obj).decode())
        else:
            await self.ws.send(obj)

    async def start(self, **fields: Any) -> dict[str, Any]:
        await self.send({"type": "session.start", **fields})
        self.started = await self.wait_for("session.started")
        return self.started

    async def recv_one(self, within_s: float = 5.0) -> dict[str, Any] | Frame:
        m = await asyncio.wait_for(self.ws.recv(), within_s)
        if isinstance(m, bytes):
            header, payload = P.unpack_audio_frame(m)
            f = Frame(header, payload)
            self.frames.append(f)
            self.received_samples += f.samples
            if self.fast_playback:
                with contextlib.suppress(ConnectionClosed):  # the server may be closing
                    await self.send({"type": "playback", "played_samples": self.received_samples,
                                     "buffered_ms": 0})
            return f
        obj = orjson.loads(m)
        self.messages.append(obj)
        return obj  # type: ignore[no-any-return]

    async def wait_for(self, mtype: str, within_s: float = 10.0, **match: Any) -> dict[str, Any]:
        """Receive until a message of this type (and these field values) arrives."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError(f"no {mtype} within {within_s} s; got {self.types()[-10:]}")
            m = await self.recv_one(left)
            if isinstance(m, dict) and m.get("type") == mtype and all(m.get(k) == v for k, v in match.items()):
                return m

    async def speak(self, text: str, piece_chars: int = 0, end: bool = True) -> None:
        pieces = [text] if piece_chars <= 0 else [text[i:i + piece_chars] for i in range(0, len(text), piece_chars)]
        for p in pieces:
            await self.send({"type": "text.delta", "text": p})
        if end:
            await self.send({"type": "text.end"})

    def types(self) -> list[str]:
        return [m["type"] for m in self.messages]

    def errors(self) -> list[dict[str, Any]]:
        return [m for m in self.messages if m["type"] == "error"]

    def utterance_frames(self, utterance_id: int) -> list[Frame]:
        return [f for f in self.frames if f.header.utterance_id == utterance_id]

    async def close(self) -> None:
        await self.ws.close()

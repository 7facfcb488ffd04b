"""What a ``clients.python.Client`` received, for tests: a ``ClientRecorder`` that keeps every
message and audio frame in order and lets a test wait for the next one it expects.

::

    t = Transcript()
    async with Client(url, playback="instant", max_queued_chunk_s=0, retry=NO_RETRY, recorder=t) as c:
        await c.speak("Hello.").wait_played()
        done = await t.wait_for("utterance.done")

``playback="instant", max_queued_chunk_s=0``: the audio counts as played the moment it arrives
(the server is paced by the engine, not by real time); ``playback="none"``: no reports at all
(the server paces to real time). Raw protocol control (malformed input, odd frames) is
``tests/reliability/rawws.py``'s business.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from clients.python import NO_RETRY, Client, ClientRecorder, Utterance
from gateway import protocol as P


@dataclass
class Frame:
    header: P.AudioFrameHeader
    payload: bytes
    """As received (still mu-law in a ``mulaw`` session)."""
    t: float

    @property
    def samples(self) -> int:
        return len(self.payload) // self.header.format.bytes_per_sample


class Transcript(ClientRecorder):
    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.frames: list[Frame] = []
        self.close: tuple[int | None, str] | None = None
        """(code, reason) once the server ended the connection."""
        self._next = 0
        self._changed = asyncio.Event()

    # ---- the recorder hook

    def _add(self, msg: dict[str, Any]) -> None:
        self.messages.append(msg)
        self._changed.set()

    def on_session_started(self, msg: dict[str, Any], t: float) -> None:
        self._add(msg)

    def on_segment_started(self, utterance: Utterance | None, msg: dict[str, Any], t: float) -> None:
        self._add(msg)

    def on_segment_done(self, utterance: Utterance | None, msg: dict[str, Any], t: float) -> None:
        self._add(msg)

    def on_utterance_done(self, utterance: Utterance | None, msg: dict[str, Any], t: float) -> None:
        self._add(msg)

    def on_cancelled(self, utterance: Utterance | None, msg: dict[str, Any], t: float) -> None:
        self._add(msg)

    def on_error(self, utterance: Utterance | None, msg: dict[str, Any], t: float) -> None:
        self._add(msg)

    def on_message(self, msg: dict[str, Any], t: float) -> None:
        self._add(msg)

    def on_audio(self, utterance: Utterance | None, header: P.AudioFrameHeader, payload: bytes, t: float) -> None:
        self.frames.append(Frame(header, payload, t))
        self._changed.set()

    def on_closed(self, code: int | None, reason: str, t: float) -> None:
        self.close = (code, reason)
        self._changed.set()

    # ---- for tests

    async def _changes(self, deadline: float) -> None:
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise TimeoutError
        self._changed.clear()
        await asyncio.wait_for(self._changed.wait(), left)

    async def wait_for(self, mtype: str, within_s: float = 10.0, **match: Any) -> dict[str, Any]:
        """The next message of this type (and these field values) after the last one a
        ``wait_for`` returned (messages before it are passed over, like a reader would)."""
        deadline = asyncio.get_running_loop().time() + within_s
        while True:
            while self._next < len(self.messages):
                m = self.messages[self._next]
                self._next += 1
                if m.get("type") == mtype and all(m.get(k) == v for k, v in match.items()):
                    return m
            if self.close is not None:
                raise ConnectionError(f"no {mtype}: closed {self.close}; got {self.types()[-10:]}")
            try:
                await self._changes(deadline)
            except TimeoutError:
                raise TimeoutError(f"no {mtype} within {within_s} s; got {self.types()[-10:]}") from None

    async def wait_audio(self, within_s: float = 10.0) -> Frame:
        """The first audio frame (at once if one arrived already)."""
        deadline = asyncio.get_running_loop().time() + within_s
        while not self.frames:
            await self._changes(deadline)
        return self.frames[0]

    async def until_quiet(self, quiet_s: float, within_s: float = 30.0) -> None:
        """Wait until nothing has arrived for ``quiet_s``."""
        deadline = asyncio.get_running_loop().time() + within_s
        while True:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), quiet_s)
            except TimeoutError:
                return
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"still receiving after {within_s} s")

    async def next_arrival(self, within_s: float = 10.0) -> None:
        """Wait until something new arrives (a message, a frame or the close)."""
        self._changed.clear()
        await asyncio.wait_for(self._changed.wait(), within_s)

    async def wait_closed(self, within_s: float = 10.0) -> tuple[int | None, str]:
        """(code, reason) of the server's close."""
        deadline = asyncio.get_running_loop().time() + within_s
        while self.close is None:
            await self._changes(deadline)
        return self.close

    def types(self) -> list[str]:
        return [str(m.get("type")) for m in self.messages]

    def of_type(self, mtype: str) -> list[dict[str, Any]]:
        return [m for m in self.messages if m.get("type") == mtype]

    def errors(self) -> list[dict[str, Any]]:
        return self.of_type("error")

    def utterance_frames(self, utterance_id: int) -> list[Frame]:
        return [f for f in self.frames if f.header.utterance_id == utterance_id]

    @property
    def samples(self) -> int:
        return sum(f.samples for f in self.frames)


def fast_client(url: str, transcript: Transcript | None = None, **kw: Any) -> Client:
    """A client whose audio counts as played on arrival (no queue, ``instant`` reports), that
    neither retries nor reconnects: the server is paced by the engine alone."""
    kw.setdefault("playback", "instant")
    kw.setdefault("retry", NO_RETRY)
    return Client(url, max_queued_chunk_s=0, recorder=transcript, **kw)


def quiet_client(url: str, transcript: Transcript | None = None, **kw: Any) -> Client:
    """A client that never reports playback (the server paces it to real time from its first
    audio), keeps no audio, and neither retries nor reconnects."""
    kw.setdefault("retry", NO_RETRY)
    return Client(url, playback="none", max_queued_chunk_s=0, recorder=transcript, **kw)

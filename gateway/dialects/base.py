"""What the WebSocket dialects share (pure): the translator interface and turn bookkeeping.

A dialect translator sits between a dialect's client and one native session (protocol v1,
``gateway/session.py``). It never touches sockets: it turns client frames into native client
messages, and the session's typed messages (``protocol.ServerMessage``: no JSON in between) and
audio into the dialect's frames (``Step``).
``gateway/dialects/socket.py`` carries the steps out.

``Turns`` answers the question every dialect asks: "the client marked the end of its text here:
when has all of that text's audio been sent?" (ElevenLabs' ``isFinal``, Deepgram's ``Flushed``).
It sends ``text.end`` followed by a ``ping`` (a barrier: its ``pong`` comes after every reply to
the text before it), and watches ``error`` replies (a refused ``text.delta`` echoes its id) and
``utterance.done`` (one per utterance, in order). A boundary whose text opened an utterance is
complete at that utterance's ``utterance.done``; one whose text opened none (no text, or every
delta refused) at its ``pong``. Completions come out in boundary order.
"""

from __future__ import annotations

import hmac
import re
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from gateway import protocol as P
from gateway.segmenter import char_timings

if TYPE_CHECKING:
    from collections.abc import Sized

    from websockets.datastructures import Headers

    from gateway.config import GatewaySettings
    from gateway.metrics import GatewayMetrics


class Host(Protocol):
    """What the dialects use of the gateway (``gateway.server.GatewayServer`` is one): its
    configuration, metrics and state, its Origin rule, and ``handle`` to run a native session over
    a connection (a dialect socket, an HTTP exchange). The dialects import nothing of the server."""

    @property
    def config(self) -> GatewaySettings: ...

    @property
    def metrics(self) -> GatewayMetrics: ...

    @property
    def draining(self) -> bool: ...

    @property
    def connections(self) -> Sized: ...

    @property
    def engine_name(self) -> str:
        """The serving engine's name (``engine.api`` ``name``: ``chattts-vllm``, ``espeak`` ...)."""
        ...

    def origin_ok(self, headers: Headers) -> bool: ...

    async def handle(self, ws: Any) -> None: ...


@dataclass
class Step:
    """What a translator wants done."""

    to_session: list[dict[str, Any]] = field(default_factory=list)
    """Native client messages for the session, in order."""
    to_client: list[str | bytes] = field(default_factory=list)
    """Dialect frames for the client, in order (str: text frame, bytes: binary frame)."""
    close: tuple[int, str] | None = None
    """Close the client connection (code, reason) after ``to_client``."""
    delivered_samples: int = 0
    """Session samples handed to the client by this step (flow-control credit)."""

    def extend(self, other: Step) -> Step:
        self.to_session += other.to_session
        self.to_client += other.to_client
        self.close = self.close or other.close
        self.delivered_samples += other.delivered_samples
        return self


class Translator(Protocol):
    """One dialect connection's translation (pure; see Step)."""

    def opening(self) -> Step:
        """At connect: the native ``session.start`` (and any greeting for the client)."""
        ...

    def on_client(self, data: str | bytes) -> Step: ...

    def on_server_message(self, msg: P.ServerMessage) -> Step: ...

    def on_server_audio(self, header: P.AudioFrameHeader, pcm16: bytes) -> Step: ...

    def on_server_close(self, code: int, reason: str) -> Step:
        """The session closes the connection: frames to send first, and the close to use."""
        ...


@dataclass(eq=False)
class _Boundary:
    tag: Any
    delta_ids: set[str]
    refused: set[str]
    ponged: bool = False
    done: bool = False
    status: str = "ok"
    cancelled: bool = False

    @property
    def opened(self) -> bool:
        return bool(self.delta_ids - self.refused)

    @property
    def complete(self) -> bool:
        return self.ponged and (self.done or not self.opened)


class Turns:
    """Boundary bookkeeping over the native protocol (see the module docstring)."""

    def __init__(self, prefix: str = "") -> None:
        self._prefix = prefix
        self._n = 0
        self._current: set[str] = set()
        self._refused: set[str] = set()
        self._pending: deque[_Boundary] = deque()
        self._barriers: dict[str, _Boundary] = {}

    def _id(self, kind: str) -> str:
        self._n += 1
        return f"{self._prefix}{kind}{self._n}"

    @property
    def has_text(self) -> bool:
        """Text was sent since the last boundary."""
        return bool(self._current)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def delta(self, text: str) -> list[dict[str, Any]]:
        """``text.delta`` for a piece of text (nothing for an empty one)."""
        if not text:
            return []
        mid = self._id("d")
        self._current.add(mid)
        return [{"type": P.ClientType.TEXT_DELTA.value, "text": text, "id": mid}]

    def boundary(self, tag: Any) -> list[dict[str, Any]]:
        """End the current text: ``text.end`` plus the barrier ``ping``; ``tag`` comes back from
        ``completed`` once all of the text's audio has been sent."""
        b = _Boundary(tag, self._current, self._refused)
        self._current, self._refused = set(), set()
        bid = self._id("b")
        self._pending.append(b)
        self._barriers[bid] = b
        return [{"type": P.ClientType.TEXT_END.value}, {"type": P.ClientType.PING.value, "id": bid}]

    def cancel_all(self) -> None:
        """A native ``cancel`` was sent: every boundary so far (and the open text) is dropped once
        the ``cancelled`` reply comes (``on_cancelled``)."""
        for b in self._pending:
            b.cancelled = True
        self._current, self._refused = set(), set()

    def on_cancelled(self) -> None:
        self._pending = deque(b for b in self._pending if not b.cancelled)
        self._barriers = {k: b for k, b in self._barriers.items() if not b.cancelled}

    def on_server_message(self, msg: P.ServerMessage) -> list[tuple[Any, str]]:
        """Feed every session message; returns ``(tag, status)`` of boundaries now complete, in
        order (status ``ok``, ``error`` or ``empty``)."""
        if isinstance(msg, P.ErrorMessage) and isinstance(msg.id, str):
            mid = msg.id
            if mid in self._current:
                self._refused.add(mid)
            else:
                for b in self._pending:
                    if mid in b.delta_ids:
                        b.refused.add(mid)
                        break
        elif isinstance(msg, P.Pong) and isinstance(msg.id, str) and msg.id in self._barriers:
            self._barriers.pop(msg.id).ponged = True
        elif isinstance(msg, P.UtteranceDone):
            for b in self._pending:
                if not b.cancelled and not b.done and (not b.ponged or b.opened):
                    b.done = True
                    b.status = msg.status.value
                    break
        out: list[tuple[Any, str]] = []
        while self._pending and self._pending[0].complete and not self._pending[0].cancelled:
            b = self._pending.popleft()
            out.append((b.tag, b.status if b.opened else "empty"))
        return out


class FieldError(ValueError):
    """A numeric field that ``parse_int`` refuses: ``name`` says which; ``message`` is fixed text
    (never the client's value, never an exception's text)."""

    def __init__(self, name: str, lo: int, hi: int) -> None:
        self.name = name
        self.lo = lo
        self.hi = hi
        self.message = f"{name} must be an integer in {lo}..{hi}"
        super().__init__(self.message)


_ASCII_UINT = re.compile(r"[0-9]{1,20}(?:\.0+)?")
_ASCII_UINT_STRICT = re.compile(r"[0-9]{1,20}")


def parse_int(value: object, name: str, lo: int, hi: int, *, float_zero: bool = False) -> int:
    """THE parser of every numeric query, header and body field of the dialects: a string of ASCII
    digits only (no sign, no spaces, no Unicode digits such as ``"²"`` or ``"٣"``, at most 20 of
    them; with ``float_zero`` also ``"24000.0"``, as some SDKs send) or, from a JSON body, an
    integer (not a bool; with ``float_zero`` also an integral float), in ``lo..hi``. Anything else
    raises ``FieldError`` -- one exception type that each dialect turns into its refusal."""
    if isinstance(value, str):
        m = (_ASCII_UINT if float_zero else _ASCII_UINT_STRICT).fullmatch(value)
        if m is None:
            raise FieldError(name, lo, hi)
        n = int(value.split(".", 1)[0])
    elif isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif float_zero and isinstance(value, float) and value.is_integer():
        n = int(value)
    else:
        raise FieldError(name, lo, hi)
    if not lo <= n <= hi:
        raise FieldError(name, lo, hi)
    return n


def header_safe(text: str, limit: int = 256) -> str:
    """``text`` as an HTTP header value: printable ASCII only, no leading or trailing space (a
    value may quote the client's input: anything else becomes ``?``), at most ``limit`` characters."""
    return "".join(c if " " <= c <= "~" else "?" for c in text[:limit]).strip()


def session_start(rate_hz: int, speaker: Any = None, language: str | None = None,
                  seed: int | None = None) -> dict[str, Any]:
    """The native ``session.start`` every dialect opens its session with (PCM16 at ``rate_hz``)."""
    start: dict[str, Any] = {"type": P.ClientType.SESSION_START.value, "sample_rate": rate_hz,
                             "format": P.AudioFormat.PCM16.value}
    if speaker is not None:
        start["voice"] = speaker
    if language:
        start["language"] = language
    if seed is not None:
        start["options"] = {"seed": seed}
    return start


def token_matches(candidates: Iterable[str], tokens: Iterable[str]) -> bool:
    """Constant-time comparison of every candidate against every accepted token."""
    ok = False
    toks = list(tokens)
    for c in candidates:
        for t in toks:
            ok |= hmac.compare_digest(c.encode(), t.encode())
    return ok


class Alignment:
    """Character timing of one utterance's text, a segment at a time, for the dialects that carry
    alignment (ElevenLabs): ``add_text`` with every piece of the utterance's text as it is sent,
    ``started`` with the native ``segment.started`` (its ``start_char``/``end_char``), ``done``
    with ``segment.done``'s ``samples``. ``done`` gives the characters since the previous segment
    (the text between segments -- spaces, marks not spoken -- at the segment's start, lasting 0)
    and the segment's own, with start and duration in ms from the segment's start: the segment's
    measured duration shared out in proportion to speaking time (``segmenter.char_timings``; an
    estimate inside the segment, exact at its two ends), so the spans add up to the audio sent."""

    def __init__(self) -> None:
        self.text = ""
        self._prev_end = 0
        self._span: tuple[int, int] | None = None

    def add_text(self, text: str) -> None:
        self.text += text

    def started(self, msg: P.SegmentStarted) -> None:
        self._span = (msg.start_char, msg.end_char)

    def done_ms(self, samples: int, rate_hz: int) -> tuple[list[str], list[float], list[float], int] | None:
        """(chars, start_ms, duration_ms, how many leading chars are the gap) of the segment just
        done, in ms from its start; None when no segment started."""
        if self._span is None:
            return None
        start, end = self._span
        self._span = None
        gap = self.text[self._prev_end:start] if start >= self._prev_end else ""
        seg = self.text[start:end]
        self._prev_end = max(self._prev_end, end)
        starts, durs = char_timings(seg, samples * 1000.0 / rate_hz)
        return list(gap) + list(seg), [0.0] * len(gap) + starts, [0.0] * len(gap) + durs, len(gap)

    def rest(self) -> str:
        """The text after the last segment done (trailing spaces, marks not spoken)."""
        return self.text[self._prev_end:]

    def done(self, samples: int, rate_hz: int) -> tuple[list[str], list[int], list[int]] | None:
        """``done_ms`` in whole ms (the starts are the rounded running sum, so the last start +
        duration is the segment's rounded duration)."""
        got = self.done_ms(samples, rate_hz)
        if got is None:
            return None
        chars, starts, _, gap = got
        edges = [round(a) for a in starts[gap:]] + [round(samples * 1000.0 / rate_hz)]
        return chars, [0] * gap + edges[:-1], [0] * gap + [b - a for a, b in zip(edges, edges[1:], strict=False)]

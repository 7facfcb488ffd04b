"""The ``Client``'s recorder hook: an observer of what the gateway sends, with receipt times.

::

    class Times(ClientRecorder):
        def on_audio(self, utterance, header, payload, t):
            self.first_audio = getattr(self, "first_audio", None) or t

    async with Client(url, recorder=Times()) as c: ...

Subclass ``ClientRecorder`` and override what you need (every method is a no-op here). The
client calls it synchronously from its reader, in wire order, *before* acting on the message
itself, with ``t = time.monotonic()`` taken once per WebSocket message as it is received
(CLOCK_MONOTONIC: comparable across processes of one machine). ``msg`` is the decoded JSON
message as received (do not modify it); ``header`` and ``payload`` are the audio frame as
received (the payload still mu-law in a ``mulaw`` session). ``utterance`` is the client's
``Utterance`` the message belongs to, or None when the client has none for it (frames of a
cancelled utterance arriving after its ``cancelled``, an utterance already played and
forgotten): keep your own map from ``header.utterance_id`` / ``msg["utterance_id"]`` when
late arrivals matter. Callbacks must be quick (they run on the receive path); an exception
from one is logged and otherwise ignored.

The load generator (``loadtest/client.py``) records its sessions through this hook; tests
use it to see the wire (``tests/transcript.py``). A client without a recorder reads no clock
and makes no calls for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clients.python.client import Utterance
    from gateway.protocol import AudioFrameHeader


class ClientRecorder:
    """No-op base of a ``Client(recorder=...)`` observer (see the module doc)."""

    def on_session_started(self, msg: dict[str, Any], t: float) -> None:
        """``session.started`` (again after each reconnect)."""

    def on_segment_started(self, utterance: Utterance | None, msg: dict[str, Any], t: float) -> None:
        """``segment.started``: ``segment``, ``text``, ``start_char``/``end_char`` ..."""

    def on_segment_done(self, utterance: Utterance | None, msg: dict[str, Any], t: float) -> None:
        """``segment.done``."""

    def on_utterance_done(self, utterance: Utterance | None, msg: dict[str, Any], t: float) -> None:
        """``utterance.done`` (``status``, ``samples``, the engine-side breakdown ...)."""

    def on_cancelled(self, utterance: Utterance | None, msg: dict[str, Any], t: float) -> None:
        """``cancelled`` (``utterance`` is the one named by ``msg["utterance_id"]``)."""

    def on_error(self, utterance: Utterance | None, msg: dict[str, Any], t: float) -> None:
        """``error`` (``utterance``: by ``utterance_id``, else by the ``id`` of an opening delta)."""

    def on_message(self, msg: dict[str, Any], t: float) -> None:
        """Any other JSON message (``pong``, types this client does not know)."""

    def on_audio(self, utterance: Utterance | None, header: AudioFrameHeader, payload: bytes, t: float) -> None:
        """A well-formed audio frame, also one the client drops (a ``cancel`` awaiting its reply).
        Samples: ``len(payload) // header.format.bytes_per_sample``."""

    def on_closed(self, code: int | None, reason: str, t: float) -> None:
        """The connection ended (``code``: the close code, 1006 without a close frame). Not
        called when the application closed the client itself."""

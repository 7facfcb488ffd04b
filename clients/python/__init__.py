"""Python client for the voicegw gateway (protocol v1).

``Client`` (async, streaming), ``say`` / ``chat`` (what ``voicegw say`` / ``voicegw chat`` run),
``WavWriter`` / ``write_wav`` / ``read_wav``, ``Playout`` (the playback accounting model),
``ClientRecorder`` (the observer hook: what was received, when). ``clients.python.core`` holds the
client's decisions, sans I/O.

The names load on first use (PEP 562), so that importing the pure parts (``clients.python.core``,
``clients.python.playout``) does not import asyncio and websockets with the client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clients.python.client import (
        AudioChunk,
        Client,
        ClientEvent,
        ClientRecorder,
        PlaybackMode,
        SegmentPlay,
        Utterance,
        UtteranceFailed,
        UtteranceStats,
        VoicegwError,
        ws_url,
    )
    from clients.python.commands import chat, say
    from clients.python.core import NO_RETRY, RetryPolicy
    from clients.python.playout import Playout
    from clients.python.wav import WavWriter, read_wav, write_wav

_WHERE = {
    "NO_RETRY": "core",
    "RetryPolicy": "core",
    "AudioChunk": "client",
    "Client": "client",
    "ClientEvent": "client",
    "ClientRecorder": "client",
    "PlaybackMode": "client",
    "SegmentPlay": "client",
    "Utterance": "client",
    "UtteranceFailed": "client",
    "UtteranceStats": "client",
    "VoicegwError": "client",
    "ws_url": "client",
    "chat": "commands",
    "say": "commands",
    "Playout": "playout",
    "WavWriter": "wav",
    "read_wav": "wav",
    "write_wav": "wav",
}

__all__ = [
    "NO_RETRY",
    "AudioChunk",
    "Client",
    "ClientEvent",
    "ClientRecorder",
    "PlaybackMode",
    "RetryPolicy",
    "SegmentPlay",
    "Playout",
    "Utterance",
    "UtteranceFailed",
    "UtteranceStats",
    "VoicegwError",
    "WavWriter",
    "chat",
    "read_wav",
    "say",
    "write_wav",
    "ws_url",
]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{where}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])

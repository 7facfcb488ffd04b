"""Python client for the voicegw gateway (protocol v1).

``Client`` (async, streaming), ``say`` / ``chat`` (what ``voicegw say`` / ``voicegw chat`` run),
``WavWriter`` / ``write_wav`` / ``read_wav``, ``Playout`` (the playback accounting model),
``ClientRecorder`` (the observer hook: what was received, when).
"""

from clients.python.client import (
    NO_RETRY,
    AudioChunk,
    Client,
    ClientEvent,
    ClientRecorder,
    PlaybackMode,
    RetryPolicy,
    SegmentPlay,
    Utterance,
    UtteranceFailed,
    UtteranceStats,
    VoicegwError,
    ws_url,
)
from clients.python.commands import chat, say
from clients.python.playout import Playout
from clients.python.wav import WavWriter, read_wav, write_wav

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

"""Streaming ChatTTS decoder: codes (or GPT hidden states) -> 24 kHz PCM, each step decoded once.

* ``engine.decoder.window``: the pure windowing core (no torch): reaches, per-stage windows,
  ISTFT overlap-add bookkeeping, chunk policy.
* ``engine.decoder.nets``: the vocoder in plain torch, loaded from the checkpoint.
* ``engine.decoder.streaming``: the synchronous batched streaming core (``StreamingVocoder``).
* ``engine.decoder.batching``: ``BatchingDecoder``, the asyncio edge (one task, one worker thread).

See docs/decoder.md. Torch is imported only when a torch-side name is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.decoder.window import (
    ChunkPolicy,
    ConvStep,
    ConvWindow,
    DecoderGeometry,
    OlaStep,
    OlaWindow,
    Reach,
    StackWindow,
    conv_reach,
)

if TYPE_CHECKING:
    from engine.decoder.batching import BatchingDecoder, DecoderStream
    from engine.decoder.nets import Vocoder, load_vocoder
    from engine.decoder.streaming import DecodeJob, StreamingVocoder, StreamState

_LAZY = {
    "Vocoder": "engine.decoder.nets",
    "load_vocoder": "engine.decoder.nets",
    "StreamingVocoder": "engine.decoder.streaming",
    "StreamState": "engine.decoder.streaming",
    "DecodeJob": "engine.decoder.streaming",
    "BatchingDecoder": "engine.decoder.batching",
    "DecoderStream": "engine.decoder.batching",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)


__all__ = [
    "BatchingDecoder",
    "ChunkPolicy",
    "ConvStep",
    "ConvWindow",
    "DecodeJob",
    "DecoderGeometry",
    "DecoderStream",
    "OlaStep",
    "OlaWindow",
    "Reach",
    "StackWindow",
    "StreamState",
    "StreamingVocoder",
    "Vocoder",
    "conv_reach",
    "load_vocoder",
]

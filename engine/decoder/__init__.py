"""Streaming ChatTTS decoder: codes (or GPT hidden states) -> 24 kHz PCM, in its own process.

* ``engine.decoder.window``: the pure windowing core (no torch): reaches, the static window
  shape, rows, chunk policy.
* ``engine.decoder.nets``: the vocoder in plain torch, loaded from the checkpoint.
* ``engine.decoder.windowed``: ``WindowDecoder``, the static-shape batched forward (one CUDA
  graph per batch bucket on a GPU, TF32; eager on CPU).
* ``engine.decoder.worker``: the decoder process (streams, rows, batching, crossfade) and its
  wire format.
* ``engine.decoder.client``: ``DecoderClient``, the asyncio edge in the gateway process.

See docs/decoder.md. Importing this package imports no torch.
"""

from __future__ import annotations

from engine.decoder.window import ChunkPolicy, DecoderGeometry, Reach, Row, StreamLead, WindowSpec, conv_reach

__all__ = ["ChunkPolicy", "DecoderGeometry", "Reach", "Row", "StreamLead", "WindowSpec", "conv_reach"]

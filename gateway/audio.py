"""PCM helpers for the wire formats (pure numpy)."""

from __future__ import annotations

import numpy as np

from gateway.protocol import AudioFormat

_MULAW_BIAS = 0x84
_SEG_END = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF], dtype=np.int32)


def _build_mulaw_table() -> np.ndarray:
    """G.711 mu-law encoding of every int16 value (index: value + 32768), the classic
    14-bit Sun g711 algorithm (bit-exact with CPython's former ``audioop.lin2ulaw``)."""
    x = np.arange(-32_768, 32_768, dtype=np.int32) >> 2
    mask = np.where(x < 0, 0x7F, 0xFF)
    mag = np.minimum(np.abs(x), 8159) + 0x21
    seg = np.searchsorted(_SEG_END, mag, side="left").astype(np.int32)
    uval = np.where(seg >= 8, 0x7F, (seg << 4) | ((mag >> (np.minimum(seg, 7) + 1)) & 0x0F))
    return ((uval ^ mask) & 0xFF).astype(np.uint8)


_MULAW_TABLE = _build_mulaw_table()


def mulaw_encode(pcm16: bytes) -> bytes:
    """int16 little-endian samples -> mu-law bytes (one per sample)."""
    samples = np.frombuffer(pcm16, dtype="<i2").astype(np.int32) + 32_768
    return bytes(_MULAW_TABLE[samples].tobytes())


def mulaw_decode(data: bytes) -> np.ndarray:
    """mu-law bytes -> int16 samples (for tests and clients)."""
    u = ~np.frombuffer(data, dtype=np.uint8).astype(np.int32) & 0xFF
    sign = u & 0x80
    exponent = (u >> 4) & 0x07
    mantissa = u & 0x0F
    mag = ((mantissa << 3) + _MULAW_BIAS) << exponent
    out = np.where(sign != 0, _MULAW_BIAS - mag, mag - _MULAW_BIAS)
    return out.astype(np.int16)


def encode_samples(pcm16: bytes, fmt: AudioFormat) -> bytes:
    """Engine PCM16 -> the session's wire format."""
    if fmt is AudioFormat.PCM16:
        return pcm16
    return mulaw_encode(pcm16)

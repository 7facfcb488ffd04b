"""Audio output formats: float -> PCM16, streaming resampling (soxr), G.711 mu-law.

* ChatTTS (Vocos) produces 24 kHz float audio; that is the native rate (no resampling).
* 16 kHz and 48 kHz (and 8 kHz for telephony) go through ``soxr.ResampleStream``: a proper
  band-limited resampler that keeps its filter state across chunks, so chunked resampling
  equals resampling the whole signal, and ``last=True`` flushes the filter tail.
* G.711 mu-law (8-bit, normally at 8 kHz) via lookup tables built once from the G.711
  segment/mantissa definition (``audioop`` is gone in Python 3.13).

Pure numpy + soxr; no torch, no asyncio.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

NATIVE_RATE_HZ = 24_000
SUPPORTED_RATES_HZ: tuple[int, ...] = (8_000, 16_000, 24_000, 48_000)
Encoding = Literal["pcm16", "mulaw"]

_MULAW_BIAS = 0x84


def float_to_pcm16(x: np.ndarray) -> np.ndarray:
    """Float audio in [-1, 1] -> int16 (clipped, rounded)."""
    y = np.clip(np.asarray(x, dtype=np.float32), -1.0, 1.0) * 32767.0
    return np.rint(y).astype("<i2")


def pcm16_bytes(x: np.ndarray) -> bytes:
    """Float audio -> little-endian PCM16 bytes."""
    return float_to_pcm16(x).tobytes()


def pcm16_to_float(data: bytes | np.ndarray) -> np.ndarray:
    arr = np.frombuffer(data, dtype="<i2") if isinstance(data, (bytes, bytearray, memoryview)) else data
    return np.asarray(arr, dtype=np.float32) / 32768.0


def _mulaw_encode_exact(s: np.ndarray) -> np.ndarray:
    """G.711 mu-law of int16 samples (vectorised reference definition; builds the table).

    The 14-bit formulation of the Sun/CCITT reference code (also CPython's old ``audioop``):
    ``v = sample >> 2``; magnitude ``|v|`` clipped to 8159, plus bias 33; segment = number of
    the upper bounds ``0x3F, 0x7F, ..., 0x1FFF`` it exceeds (8: saturate); 4 mantissa bits; all
    bits inverted (sign bit set for non-negative samples).
    """
    v = s.astype(np.int32) >> 2
    mask = np.where(v < 0, 0x7F, 0xFF)
    mag = np.minimum(np.abs(v), 8159) + 33
    seg = np.zeros_like(mag)
    for bound in (0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF):
        seg += (mag > bound).astype(np.int32)
    uval = np.where(seg >= 8, 0x7F, (seg << 4) | ((mag >> (seg + 1)) & 0x0F))
    return ((uval ^ mask) & 0xFF).astype(np.uint8)


_ENCODE_TABLE: np.ndarray = _mulaw_encode_exact(np.arange(-32768, 32768))
"""mu-law byte for every int16 value, indexed by ``sample + 32768``."""


def _mulaw_decode_table() -> np.ndarray:
    u = ~np.arange(256, dtype=np.int32) & 0xFF
    sign = u & 0x80
    exponent = (u >> 4) & 0x07
    mantissa = u & 0x0F
    mag = (((mantissa << 3) + _MULAW_BIAS) << exponent) - _MULAW_BIAS
    return np.where(sign != 0, -mag, mag).astype(np.int16)


_DECODE_TABLE: np.ndarray = _mulaw_decode_table()


def mulaw_encode(pcm16: np.ndarray | bytes) -> bytes:
    """int16 samples (array or little-endian bytes) -> G.711 mu-law bytes (one per sample)."""
    arr = np.frombuffer(pcm16, dtype="<i2") if isinstance(pcm16, (bytes, bytearray, memoryview)) else pcm16
    idx = np.asarray(arr, dtype=np.int32) + 32768
    return bytes(_ENCODE_TABLE[idx].tobytes())


def mulaw_decode(data: bytes) -> np.ndarray:
    """G.711 mu-law bytes -> int16 samples."""
    return np.asarray(_DECODE_TABLE[np.frombuffer(data, dtype=np.uint8)])


class StreamResampler:
    """Streaming resampler (``soxr.ResampleStream``, float32 mono); identity when rates match."""

    def __init__(self, in_rate_hz: int, out_rate_hz: int, quality: str = "HQ") -> None:
        if in_rate_hz <= 0 or out_rate_hz <= 0:
            raise ValueError("sample rates must be positive")
        self.in_rate_hz = in_rate_hz
        self.out_rate_hz = out_rate_hz
        self._rs = None
        if in_rate_hz != out_rate_hz:
            import soxr

            self._rs = soxr.ResampleStream(in_rate_hz, out_rate_hz, 1, dtype="float32", quality=quality)
        self.closed = False

    def process(self, x: np.ndarray, last: bool = False) -> np.ndarray:
        """Resample the next chunk; ``last=True`` also flushes the filter (then no more calls)."""
        if self.closed:
            raise RuntimeError("resampler already flushed")
        self.closed = last
        x = np.ascontiguousarray(x, dtype=np.float32)
        if self._rs is None:
            return x
        return np.asarray(self._rs.resample_chunk(x, last=last), dtype=np.float32)


class AudioEncoder:
    """24 kHz float chunks -> bytes at ``rate_hz`` in ``encoding`` (PCM16 LE or mu-law), streaming."""

    def __init__(self, rate_hz: int = NATIVE_RATE_HZ, encoding: Encoding = "pcm16", in_rate_hz: int = NATIVE_RATE_HZ) -> None:
        if rate_hz not in SUPPORTED_RATES_HZ:
            raise ValueError(f"sample rate {rate_hz} not supported; use one of {SUPPORTED_RATES_HZ}")
        if encoding not in ("pcm16", "mulaw"):
            raise ValueError(f"encoding {encoding!r} not supported; use pcm16 or mulaw")
        self.rate_hz = rate_hz
        self.encoding: Encoding = encoding
        self._resampler = StreamResampler(in_rate_hz, rate_hz)

    @property
    def bytes_per_sample(self) -> int:
        return 2 if self.encoding == "pcm16" else 1

    def encode(self, audio: np.ndarray, last: bool = False) -> bytes:
        pcm = float_to_pcm16(self._resampler.process(audio, last=last))
        return pcm.tobytes() if self.encoding == "pcm16" else mulaw_encode(pcm)

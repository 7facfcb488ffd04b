"""Audio output of the dialects (numpy + soxr; MP3 through ``lameenc``, Ogg/Opus, AAC and FLAC
through PyAV's bundled FFmpeg, each when installed): encodings, extra rates, WAV streaming header.

The session always produces PCM16 at one of the native protocol's rates; a dialect may want a rate
the native protocol does not offer (22050, 32000, 44100 Hz) or an encoding it does not (A-law,
MP3). ``Encoder`` turns the session's PCM16 into the dialect's bytes: a streaming band-limited
resampler (``engine.audio_format.StreamResampler``) when the rates differ, then PCM16 / mu-law /
A-law / MP3 (LAME, constant bit rate, mono) / Ogg Opus, AAC (ADTS), FLAC (libopus, FFmpeg's
aac and flac encoders: ``av``), streamed: bytes come out as the container's pages fill.
"""

from __future__ import annotations

import importlib.util
import io
import struct
from dataclasses import dataclass
from typing import Any, Final, Literal

import numpy as np

from engine.audio_format import StreamResampler, float_to_pcm16, pcm16_to_float
from gateway import protocol as P
from gateway.audio import mulaw_encode

Encoding = Literal["pcm16", "mulaw", "alaw", "mp3", "opus", "aac", "flac"]

_BYTES_PER_SAMPLE: Final[dict[str, int]] = {"pcm16": 2, "mulaw": 1, "alaw": 1, "mp3": 0, "opus": 0, "aac": 0,
                                            "flac": 0}
#: PyAV encodings: (container format, FFmpeg encoder).
_AV_CODECS: Final[dict[str, tuple[str, str]]] = {"opus": ("ogg", "libopus"), "aac": ("adts", "aac"),
                                                 "flac": ("flac", "flac")}
OPUS_RATES_HZ: Final = (8_000, 12_000, 16_000, 24_000, 48_000)
#: Rate the session runs at when the wanted rate is not a native one (then resampled here).
_FALLBACK_SESSION_RATE_HZ: Final = 24_000


@dataclass(frozen=True)
class OutputFormat:
    encoding: Encoding
    rate_hz: int
    bitrate_kbps: int = 0
    """MP3 only."""

    @property
    def session_rate_hz(self) -> int:
        """The native session's rate for this output (resampled from it when different)."""
        return self.rate_hz if self.rate_hz in P.SUPPORTED_SAMPLE_RATES_HZ else _FALLBACK_SESSION_RATE_HZ

    @property
    def bytes_per_sample(self) -> int:
        """0 for MP3 (compressed)."""
        return _BYTES_PER_SAMPLE[self.encoding]


def mp3_available() -> bool:
    """MP3 output needs the optional ``lameenc`` package (LAME)."""
    return importlib.util.find_spec("lameenc") is not None


def av_available() -> bool:
    """Opus, AAC and FLAC output need the optional ``av`` package (PyAV, FFmpeg bundled)."""
    return importlib.util.find_spec("av") is not None


class _Sink(io.RawIOBase):
    """Where the muxer writes: bytes are taken out as they come (not seekable: streamed)."""

    def __init__(self) -> None:
        super().__init__()
        self._parts: list[bytes] = []

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def write(self, b: bytes) -> int:  # type: ignore[override]
        self._parts.append(bytes(b))
        return len(b)

    def take(self) -> bytes:
        out = b"".join(self._parts)
        self._parts.clear()
        return out


class _AvStream:
    """One Ogg/Opus, ADTS/AAC or FLAC stream through PyAV (frame sizes are buffered by PyAV)."""

    def __init__(self, encoding: str, rate_hz: int, bitrate_kbps: int) -> None:
        import av

        fmt, codec = _AV_CODECS[encoding]
        self.rate_hz = rate_hz
        self._sink = _Sink()
        self._container = av.open(self._sink, mode="w", format=fmt)
        add_stream: Any = self._container.add_stream
        self._stream: Any = add_stream(codec, rate=rate_hz, layout="mono")
        if bitrate_kbps:
            self._stream.bit_rate = bitrate_kbps * 1000
        self.used = False

    def encode(self, pcm16: bytes) -> bytes:
        import av

        self.used = True
        arr = np.frombuffer(pcm16, dtype="<i2").reshape(1, -1)
        frame = av.AudioFrame.from_ndarray(arr, format="s16", layout="mono")
        frame.sample_rate = self.rate_hz
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
        return self._sink.take()

    def flush(self) -> bytes:
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        return self._sink.take()


class _Mp3:
    """A LAME encoder for one stream (LAME cannot continue after its final flush)."""

    def __init__(self, rate_hz: int, bitrate_kbps: int) -> None:
        import lameenc  # type: ignore[import-not-found]

        self._enc = lameenc.Encoder()
        self._enc.set_bit_rate(bitrate_kbps)
        self._enc.set_in_sample_rate(rate_hz)
        self._enc.set_out_sample_rate(rate_hz)
        self._enc.set_channels(1)
        self._enc.set_quality(2)
        self._enc.silence()
        self.used = False

    def encode(self, pcm16: bytes) -> bytes:
        self.used = True
        return bytes(self._enc.encode(pcm16))

    def flush(self) -> bytes:
        return bytes(self._enc.flush()) if self.used else b""


# ---- G.711 A-law -------------------------------------------------------------------------

_ALAW_SEG_END: Final = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF], dtype=np.int32)


def _build_alaw_table() -> np.ndarray:
    """A-law byte of every int16 value (index: value + 32768): G.711 on the 13-bit magnitude,
    segment = first upper bound the magnitude does not exceed, 4 mantissa bits, even bits
    inverted (XOR 0x55), sign bit set for non-negative samples."""
    v = np.arange(-32_768, 32_768, dtype=np.int32) >> 3
    neg = v < 0
    mask = np.where(neg, 0x55, 0xD5)
    mag = np.where(neg, -v - 1, v)
    seg = np.searchsorted(_ALAW_SEG_END, mag, side="left").astype(np.int32)
    shift = np.where(seg < 2, 1, seg)
    aval = (np.minimum(seg, 7) << 4) | ((mag >> np.minimum(shift, 15)) & 0x0F)
    aval = np.where(seg >= 8, 0x7F, aval)
    return ((aval ^ mask) & 0xFF).astype(np.uint8)


_ALAW_TABLE: Final = _build_alaw_table()


def alaw_encode(pcm16: bytes) -> bytes:
    """int16 little-endian samples -> A-law bytes (one per sample)."""
    idx = np.frombuffer(pcm16, dtype="<i2").astype(np.int32) + 32_768
    return bytes(_ALAW_TABLE[idx].tobytes())


def alaw_decode(data: bytes) -> np.ndarray:
    """A-law bytes -> int16 samples (tests, clients)."""
    a = np.frombuffer(data, dtype=np.uint8).astype(np.int32) ^ 0x55
    t = (a & 0x0F) << 4
    seg = (a & 0x70) >> 4
    t = np.where(seg == 0, t + 8, t + 0x108)
    t = np.where(seg > 1, t << np.maximum(seg - 1, 0), t)
    return np.where(a & 0x80, t, -t).astype(np.int16)


# ---- streaming encoder ---------------------------------------------------------------------


class Encoder:
    """Session PCM16 (at ``fmt.session_rate_hz``) -> the dialect's bytes, streaming.

    With resampling, the filter holds a few ms back: ``flush()`` at the end of an utterance emits
    them (and starts a fresh filter for the next one); ``reset()`` drops them (cancel)."""

    def __init__(self, fmt: OutputFormat) -> None:
        self.fmt = fmt
        self._rs: StreamResampler | None = None
        self._mp3: _Mp3 | None = None
        self._av: _AvStream | None = None
        self._dirty = False
        self.reset()

    def reset(self) -> None:
        if self.fmt.session_rate_hz != self.fmt.rate_hz:
            self._rs = StreamResampler(self.fmt.session_rate_hz, self.fmt.rate_hz)
        if self.fmt.encoding == "mp3":
            self._mp3 = _Mp3(self.fmt.rate_hz, self.fmt.bitrate_kbps)
        if self.fmt.encoding in _AV_CODECS:
            self._av = _AvStream(self.fmt.encoding, self.fmt.rate_hz, self.fmt.bitrate_kbps)
        self._dirty = False

    def encode(self, pcm16: bytes) -> bytes:
        if not pcm16:
            return b""
        if self._rs is not None:
            self._dirty = True
            pcm16 = float_to_pcm16(self._rs.process(pcm16_to_float(pcm16))).tobytes()
        return self._finish(pcm16)

    def flush(self) -> bytes:
        """What the resampler and the MP3 encoder still hold (empty when nothing is pending); the
        next audio starts a fresh stream."""
        out = b""
        if self._rs is not None and self._dirty:
            tail = float_to_pcm16(self._rs.process(np.zeros(0, dtype=np.float32), last=True)).tobytes()
            out = self._finish(tail)
        if self._mp3 is not None and self._mp3.used:
            out += self._mp3.flush()
        elif self._av is not None and self._av.used:
            out += self._av.flush()
        elif not out:
            return b""
        self.reset()
        return out

    def _finish(self, pcm16: bytes) -> bytes:
        if self.fmt.encoding == "pcm16" or not pcm16:
            return pcm16
        if self.fmt.encoding == "mulaw":
            return mulaw_encode(pcm16)
        if self.fmt.encoding == "mp3":
            assert self._mp3 is not None
            return self._mp3.encode(pcm16)
        if self._av is not None:
            return self._av.encode(pcm16)
        return alaw_encode(pcm16)


#: WAV format tags and bits per sample of the encodings a WAV header may carry.
_WAV_TAGS: Final[dict[str, tuple[int, int]]] = {"pcm16": (1, 16), "mulaw": (7, 8), "alaw": (6, 8)}


def wav_stream_header(rate_hz: int, channels: int = 1, bits: int = 16, encoding: str = "pcm16") -> bytes:
    """A 44-byte WAV header (PCM16, or G.711 mu-law / A-law: format tag 7 / 6, 8 bits, for
    ``encoding`` ``mulaw`` / ``alaw``) for a stream of unknown length (RIFF and data sizes
    0xFFFFFFFF: readers take the data as running to the end of the file)."""
    tag, enc_bits = _WAV_TAGS[encoding]
    bits = bits if encoding == "pcm16" else enc_bits
    block = channels * bits // 8
    return (
        b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVE"
        + b"fmt " + struct.pack("<IHHIIHH", 16, tag, channels, rate_hz, rate_hz * block, block, bits)
        + b"data" + struct.pack("<I", 0xFFFFFFFF)
    )

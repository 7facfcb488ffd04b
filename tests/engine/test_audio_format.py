"""engine.audio_format: PCM16 conversion, soxr streaming resampling, G.711 mu-law."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from engine.audio_format import (
    SUPPORTED_RATES_HZ,
    AudioEncoder,
    StreamResampler,
    float_to_pcm16,
    mulaw_decode,
    mulaw_encode,
    pcm16_to_float,
)


def test_float_to_pcm16() -> None:
    x = np.array([0.0, 1.0, -1.0, 2.0, -2.0, 0.5, 1e-6], dtype=np.float32)
    y = float_to_pcm16(x)
    assert y.dtype == np.dtype("<i2")
    assert y.tolist() == [0, 32767, -32767, 32767, -32767, 16384, 0]
    assert np.abs(pcm16_to_float(y.tobytes()) - np.clip(x, -1, 1)).max() < 1e-4


def test_mulaw_known_values() -> None:
    # G.711: silence encodes to 0xFF (positive zero), full scale to 0x80 / 0x00
    assert mulaw_encode(np.array([0], np.int16)) == b"\xff"
    assert mulaw_encode(np.array([32767], np.int16)) == b"\x80"
    assert mulaw_encode(np.array([-32768], np.int16)) == b"\x00"
    assert mulaw_decode(b"\xff").tolist() == [0]
    assert mulaw_decode(b"\x80").tolist() == [32124]
    assert mulaw_decode(b"\x00").tolist() == [-32124]


def test_mulaw_matches_audioop_when_available() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        audioop = pytest.importorskip("audioop")  # gone in Python 3.13: the tables must stand alone
    x = np.arange(-32768, 32768, dtype="<i2")
    assert mulaw_encode(x) == audioop.lin2ulaw(x.tobytes(), 2)
    u = bytes(range(256))
    assert mulaw_decode(u).tobytes() == audioop.ulaw2lin(u, 2)


def test_mulaw_round_trip_error_is_logarithmic() -> None:
    x = np.arange(-32768, 32768, 7, dtype=np.int16)
    y = mulaw_decode(mulaw_encode(x)).astype(np.int32)
    xi = x.astype(np.int32)
    err = np.abs(y - xi)
    # quantisation step doubles per segment (16 steps each): relative error stays below ~5 %
    big = np.abs(xi) > 256
    assert (err[big] / np.abs(xi[big])).max() < 0.05
    assert err[~big].max() <= 16
    assert mulaw_encode(x.tobytes()) == mulaw_encode(x)  # bytes in == array in


@pytest.mark.parametrize("rate", [8000, 16000, 48000])
def test_resampler_chunked_equals_whole_and_keeps_frequency(rate: int) -> None:
    sr = 24000
    t = np.arange(sr) / sr
    x = (0.5 * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32)
    whole = StreamResampler(sr, rate).process(x, last=True)
    rs = StreamResampler(sr, rate)
    rng = np.random.default_rng(rate)
    parts = []
    pos = 0
    while pos < len(x):
        k = int(rng.integers(1, 3000))
        parts.append(rs.process(x[pos : pos + k]))
        pos += k
    parts.append(rs.process(np.zeros(0, np.float32), last=True))
    chunked = np.concatenate(parts)
    assert abs(len(chunked) - rate) <= 1 and abs(len(whole) - rate) <= 1
    n = min(len(chunked), len(whole))
    assert np.abs(chunked[:n] - whole[:n]).max() < 1e-4
    spec = np.abs(np.fft.rfft(chunked[rate // 10 : rate // 10 + rate // 2]))
    peak_hz = np.argmax(spec) * rate / (rate // 2)
    assert abs(peak_hz - 440.0) <= 4.0
    assert 0.45 < np.abs(chunked[rate // 10 : -rate // 10]).max() < 0.55
    with pytest.raises(RuntimeError):
        rs.process(x[:10])


def test_resampler_identity_at_native_rate() -> None:
    x = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    assert np.array_equal(StreamResampler(24000, 24000).process(x), x)


@pytest.mark.parametrize(("rate", "encoding"), [(24000, "pcm16"), (16000, "pcm16"), (48000, "pcm16"), (8000, "mulaw")])
def test_audio_encoder_lengths(rate: int, encoding: str) -> None:
    enc = AudioEncoder(rate, encoding)  # type: ignore[arg-type]
    x = (0.3 * np.sin(np.arange(24000) / 10.0)).astype(np.float32)
    out = b"".join([enc.encode(x[:10000]), enc.encode(x[10000:20000]), enc.encode(x[20000:], last=True)])
    assert abs(len(out) // enc.bytes_per_sample - rate) <= 1
    assert enc.bytes_per_sample == (1 if encoding == "mulaw" else 2)


def test_audio_encoder_rejects_unsupported() -> None:
    assert SUPPORTED_RATES_HZ == (8000, 16000, 24000, 48000)
    with pytest.raises(ValueError):
        AudioEncoder(44100)
    with pytest.raises(ValueError):
        AudioEncoder(8000, "alaw")  # type: ignore[arg-type]

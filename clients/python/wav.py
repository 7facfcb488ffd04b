"""WAV output (PCM16 mono) with the standard library's ``wave`` module."""

from __future__ import annotations

import wave
from pathlib import Path
from types import TracebackType


class WavWriter:
    """Streaming WAV writer: ``write(pcm)`` as chunks arrive; the header is fixed at ``close``."""

    def __init__(self, path: str | Path, sample_rate_hz: int) -> None:
        self.path = Path(path)
        self.sample_rate_hz = sample_rate_hz
        self.samples = 0
        self._w = wave.open(str(self.path), "wb")  # noqa: SIM115 - closed in close()
        self._w.setnchannels(1)
        self._w.setsampwidth(2)
        self._w.setframerate(sample_rate_hz)

    def write(self, pcm: bytes) -> None:
        self._w.writeframesraw(pcm)
        self.samples += len(pcm) // 2

    def close(self) -> None:
        self._w.close()

    def __enter__(self) -> WavWriter:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def write_wav(path: str | Path, pcm: bytes, sample_rate_hz: int) -> Path:
    """Write PCM16 LE mono samples to a WAV file."""
    with WavWriter(path, sample_rate_hz) as w:
        w.write(pcm)
    return Path(path)


def read_wav(path: str | Path) -> tuple[bytes, int]:
    """(PCM16 samples, rate) of a mono 16-bit WAV file."""
    with wave.open(str(path), "rb") as r:
        if r.getnchannels() != 1 or r.getsampwidth() != 2:
            raise ValueError(f"{path}: expected mono 16-bit PCM")
        return r.readframes(r.getnframes()), r.getframerate()

"""Count the audio in an MP3 stream by walking its frame headers (no decoder needed)."""

from __future__ import annotations

_BITRATES_KBPS = {  # (MPEG-1 layer III, MPEG-2/2.5 layer III)
    1: (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    2: (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
}
_RATES_HZ = {3: (44_100, 48_000, 32_000), 2: (22_050, 24_000, 16_000), 0: (11_025, 12_000, 8_000)}


def mp3_duration(data: bytes) -> tuple[int, int, int]:
    """(frames, samples, sample rate) of a layer III stream; raises ValueError on junk."""
    i = frames = samples = 0
    rate = 0
    while i + 4 <= len(data):
        h = int.from_bytes(data[i:i + 4], "big")
        if h >> 21 != 0x7FF:
            raise ValueError(f"no frame sync at byte {i}")
        version = (h >> 19) & 3  # 3: MPEG-1, 2: MPEG-2, 0: MPEG-2.5
        layer = (h >> 17) & 3
        if layer != 1 or version == 1:
            raise ValueError("not MPEG layer III")
        kbps = _BITRATES_KBPS[1 if version == 3 else 2][(h >> 12) & 0xF]
        rate = _RATES_HZ[version][(h >> 10) & 3]
        padding = (h >> 9) & 1
        spf = 1152 if version == 3 else 576
        size = (spf // 8) * kbps * 1000 // rate + padding
        if size <= 4:
            raise ValueError("free-format or bad frame")
        i += size
        frames += 1
        samples += spf
    if i != len(data):
        raise ValueError("truncated last frame")
    return frames, samples, rate

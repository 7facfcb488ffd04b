"""EspeakSpeech: real eSpeak NG speech from the espeakng-loader wheel."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest

from engine.api import AudioChunk, SpeechEngine, SpeechRequest
from engine.espeak import VOICES, EspeakSpeech, clean_text, split_pieces, voice_for

TEXT = "Hello there, this is a test of the offline fallback voice. It should sound robotic but clear."
LONG_TEXT = "This is a rather long sentence that keeps going for a while, so that there is plenty to say. " * 30


@pytest.fixture
async def espeak() -> AsyncIterator[EspeakSpeech]:
    eng = EspeakSpeech()
    await eng.start()
    yield eng
    await eng.close()


async def collect(eng: EspeakSpeech, req: SpeechRequest) -> list[AudioChunk]:
    return [c async for c in eng.synthesize(req)]


def pcm_of(chunks: list[AudioChunk]) -> np.ndarray:
    return np.frombuffer(b"".join(c.pcm for c in chunks), dtype="<i2")


# ------------------------------------------------------------------ pure parts


def test_voice_mapping() -> None:
    assert voice_for(None, "hi", default=0) == VOICES[0]
    assert voice_for(None, "hi", default="2222") == VOICES[2222 % len(VOICES)]
    assert voice_for(3) == VOICES[3]
    assert voice_for("3") == VOICES[3]
    assert voice_for("espeak:de+f2") == "de+f2"
    assert voice_for("espeak:bad;name") == VOICES[0]
    emb = "蘁淰敕欀" * 20  # an upstream-encoded embedding string
    assert voice_for(emb) == voice_for(emb) and voice_for(emb) in VOICES
    assert voice_for(1, "你好，世界。") == "cmn+" + VOICES[1].split("+")[1]
    assert voice_for(0, "你好") == "cmn"


def test_split_and_clean() -> None:
    assert clean_text("a [uv_break] b [laugh] c[oral_2]") == "a b c"
    pieces = split_pieces(LONG_TEXT, 120)
    assert all(0 < len(p) <= 120 for p in pieces)
    assert " ".join(pieces).split() == LONG_TEXT.split()
    cjk = "你" * 300
    assert "".join(split_pieces(cjk, 120)) == cjk
    assert split_pieces("   ", 120) == []


# ------------------------------------------------------------------ real speech


async def test_is_speech_engine(espeak: EspeakSpeech) -> None:
    assert isinstance(espeak, SpeechEngine)
    h = espeak.health()
    assert h.name == "espeak" and h.healthy and h.running_requests == 0


async def test_audio_length_plausible(espeak: EspeakSpeech) -> None:
    chunks = await collect(espeak, SpeechRequest("r1", TEXT, sample_rate_hz=24_000))
    assert chunks[-1].finished and all(not c.finished for c in chunks[:-1])
    assert all(c.sample_rate_hz == 24_000 and len(c.pcm) % 2 == 0 for c in chunks)
    assert len(chunks) > 5, "audio must stream in several chunks"
    pcm = pcm_of(chunks)
    dur_s = len(pcm) / 24_000
    # ~16 words at 175 wpm plus pauses: 4-9 s.
    assert 4.0 < dur_s < 9.0, dur_s
    rms = float(np.sqrt(np.mean(pcm.astype(np.float64) ** 2)))
    assert rms > 500, f"too quiet: rms {rms}"
    assert espeak.health().running_requests == 0


@pytest.mark.parametrize("rate", [8_000, 16_000, 22_050, 48_000])
async def test_sample_rates_same_duration(espeak: EspeakSpeech, rate: int) -> None:
    ref = len(pcm_of(await collect(espeak, SpeechRequest("ref", TEXT, sample_rate_hz=24_000)))) / 24_000
    got = len(pcm_of(await collect(espeak, SpeechRequest("x", TEXT, sample_rate_hz=rate)))) / rate
    assert abs(got - ref) < 0.02, (got, ref)


async def test_chinese_and_control_tokens(espeak: EspeakSpeech) -> None:
    pcm = pcm_of(await collect(espeak, SpeechRequest("zh", "你好[uv_break]，这是一个测试。", sample_rate_hz=16_000)))
    assert 0.8 < len(pcm) / 16_000 < 6.0


async def test_empty_text(espeak: EspeakSpeech) -> None:
    chunks = await collect(espeak, SpeechRequest("e", "  [laugh] ", sample_rate_hz=24_000))
    assert len(chunks) == 1 and chunks[0].finished and chunks[0].pcm == b""


async def test_first_chunk_fast(espeak: EspeakSpeech) -> None:
    t0 = time.perf_counter()
    agen = espeak.synthesize(SpeechRequest("ttfa", LONG_TEXT, sample_rate_hz=24_000))
    first = await agen.__anext__()
    ttfa = time.perf_counter() - t0
    await agen.aclose()
    assert first.pcm and ttfa < 0.2, ttfa
    await asyncio.sleep(0.05)
    assert espeak.health().running_requests == 0


async def test_abort_is_prompt(espeak: EspeakSpeech) -> None:
    got: list[AudioChunk] = []
    first = asyncio.Event()

    async def consume() -> None:
        async for c in espeak.synthesize(SpeechRequest("ab", LONG_TEXT, sample_rate_hz=24_000)):
            got.append(c)
            first.set()
            await asyncio.sleep(0.005)  # a slowish reader

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), 5)
    t0 = time.perf_counter()
    await espeak.abort("ab")
    await asyncio.wait_for(task, 1)
    assert time.perf_counter() - t0 < 0.1
    assert got[-1].finished
    assert len(pcm_of(got)) / 24_000 < 10  # far less than the ~60 s of the whole text
    await asyncio.sleep(0.05)
    assert espeak.health().running_requests == 0
    await espeak.abort("ab")  # unknown / finished id: no error
    # the engine still serves requests after an abort
    assert len(pcm_of(await collect(espeak, SpeechRequest("after", "Still here.", sample_rate_hz=24_000)))) > 0


async def test_concurrent_requests(espeak: EspeakSpeech) -> None:
    solo = pcm_of(await collect(espeak, SpeechRequest("solo", TEXT, speaker=5, sample_rate_hz=24_000)))
    results = await asyncio.gather(
        *(
            collect(espeak, SpeechRequest(f"c{i}", TEXT, speaker=5, sample_rate_hz=24_000))
            for i in range(6)
        )
    )
    for chunks in results:
        assert chunks[-1].finished
        # eSpeak NG is not bit-exact run to run (pause jitter of a few samples): compare durations
        assert abs(len(pcm_of(chunks)) - len(solo)) < 0.02 * 24_000, "concurrent output must match solo"
    assert espeak.health().running_requests == 0


async def test_short_request_not_stuck_behind_long(espeak: EspeakSpeech) -> None:
    long_gen = espeak.synthesize(SpeechRequest("long", LONG_TEXT, sample_rate_hz=24_000))
    await long_gen.__anext__()
    t0 = time.perf_counter()
    short = await collect(espeak, SpeechRequest("short", "Quick one.", sample_rate_hz=24_000))
    assert time.perf_counter() - t0 < 0.5 and short[-1].finished
    await long_gen.aclose()


async def test_queue_bounded_when_reader_stalls(espeak: EspeakSpeech) -> None:
    agen = espeak.synthesize(SpeechRequest("stall", LONG_TEXT, sample_rate_hz=24_000))
    await agen.__anext__()
    await asyncio.sleep(0.5)  # the reader stalls; the worker must stop producing
    job = espeak._jobs["stall"]
    queued_s = job.queued_samples / 24_000
    assert queued_s < espeak.max_buffered_ms / 1000 + 10, queued_s  # max_buffered + one piece
    assert job.pieces, "the worker must not have run through the whole text"
    await agen.aclose()
    await asyncio.sleep(0.05)
    assert espeak.health().running_requests == 0

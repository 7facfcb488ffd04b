"""ElevenLabs HTTP (``POST /v1/text-to-speech/{voice_id}`` and ``/stream``) and Deepgram REST
(``POST /v1/speak``), driven by the official ``elevenlabs`` and ``deepgram-sdk`` packages with only
the base URL and key changed; errors in each vendor's shape."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import httpx
import orjson
import pytest
from deepgram import AsyncDeepgramClient, DeepgramClientEnvironment

from gateway.dialects.audio import mp3_available
from gateway.dialects.voices import DEEPGRAM, ELEVENLABS
from loadtest.fakes import CountingEngine, FakeSpeechEngine
from tests.dialects.mp3 import mp3_duration
from tests.gateway.conftest import GatewayFactory, wait_until

RACHEL = "21m00Tcm4TlvDq8ikWAM"
TEXT = "Hello there, this is the gateway speaking over plain HTTP. It streams as it is made."


def _dg(server: Any, key: str = "dg-test") -> AsyncDeepgramClient:
    env = DeepgramClientEnvironment(base=server.url, production="ws" + server.url[4:],
                                    agent="ws" + server.url[4:], agent_rest=server.url)
    return AsyncDeepgramClient(api_key=key, environment=env)


@pytest.mark.parametrize("method", ["convert", "stream"])
async def test_elevenlabs_sdk_convert_and_stream(counting_engine: CountingEngine, make_gateway: GatewayFactory,
                                                 method: str) -> None:
    from elevenlabs.client import ElevenLabs

    async with make_gateway(counting_engine) as server:
        client = ElevenLabs(api_key="xi-test", base_url=server.url)

        def run() -> bytes:
            fn = getattr(client.text_to_speech, method)
            return b"".join(fn(voice_id=RACHEL, text=TEXT, model_id="eleven_flash_v2_5", output_format="pcm_16000"))

        audio = await asyncio.wait_for(asyncio.to_thread(run), 60)
        assert len(audio) == 2 * counting_engine.total_samples > 0
        assert counting_engine.rates == {16_000}
        assert {r.speaker for r in counting_engine.requests} == {ELEVENLABS[RACHEL][1]}
        if isinstance(counting_engine.inner, FakeSpeechEngine):
            assert counting_engine.total_samples == sum(
                counting_engine.inner.expected_samples(r.text, 16_000) for r in counting_engine.requests)
        assert await wait_until(lambda: counting_engine.health().running_requests == 0)


async def test_elevenlabs_http_default_mp3_and_errors(fake_engine: FakeSpeechEngine,
                                                      make_gateway: GatewayFactory) -> None:
    from elevenlabs.client import ElevenLabs
    from elevenlabs.core.api_error import ApiError

    async with make_gateway(fake_engine, gateway={"auth_tokens": ("xi-s3cret",)}) as server:
        client = ElevenLabs(api_key="xi-s3cret", base_url=server.url)
        if mp3_available():
            mp3 = await asyncio.to_thread(lambda: b"".join(client.text_to_speech.convert(voice_id=RACHEL, text=TEXT)))
            frames, samples, rate = mp3_duration(mp3)
            assert frames > 0 and rate == 44_100
        reached = len(fake_engine.requests)
        cases = [({"voice_id": "nobody", "text": TEXT}, 404, "voice_not_found"),
                 ({"voice_id": RACHEL, "text": TEXT, "output_format": "opus_16000_64"}, 400, "invalid_output_format"),
                 ({"voice_id": RACHEL, "text": TEXT, "voice_settings": {"speed": 1.5}}, 422, "invalid_voice_settings")]
        for kwargs, status, code in cases:
            with pytest.raises(ApiError) as exc:
                await asyncio.to_thread(lambda kw=kwargs: b"".join(client.text_to_speech.convert(**kw)))  # type: ignore[misc]
            assert exc.value.status_code == status and exc.value.body["detail"]["status"] == code, exc.value.body
        wrong = ElevenLabs(api_key="nope", base_url=server.url)
        with pytest.raises(ApiError) as exc:
            await asyncio.to_thread(lambda: b"".join(wrong.text_to_speech.convert(voice_id=RACHEL, text=TEXT)))
        assert exc.value.status_code == 401 and exc.value.body["detail"]["status"] == "invalid_api_key"
        assert len(fake_engine.requests) == reached  # refusals never reach the engine


@pytest.mark.parametrize("kwargs,rate,wav", [({"encoding": "linear16", "sample_rate": 24000}, 24_000, True),
                                             ({"encoding": "linear16", "sample_rate": 16000, "container": "none"},
                                              16_000, False),
                                             ({"encoding": "mulaw", "sample_rate": 8000}, 8_000, True),
                                             ({"encoding": "alaw", "sample_rate": 8000}, 8_000, True),
                                             ({"encoding": "mulaw", "sample_rate": 8000, "container": "none"},
                                              8_000, False)])
async def test_deepgram_sdk_rest_generate(counting_engine: CountingEngine, make_gateway: GatewayFactory,
                                          kwargs: dict[str, Any], rate: int, wav: bool) -> None:
    async with make_gateway(counting_engine) as server:
        chunks = [c async for c in _dg(server).speak.v1.audio.generate(text=TEXT, model="aura-2-thalia-en", **kwargs)]
        audio = b"".join(chunks)
        header = 44 if wav else 0
        per_sample = 1 if kwargs["encoding"] in ("mulaw", "alaw") else 2
        if wav:  # Deepgram REST's default container for linear16, mulaw and alaw
            assert audio[:4] == b"RIFF" and audio[8:12] == b"WAVE"
            tag, channels, got_rate, _, _, bits = struct.unpack("<HHIIHH", audio[20:36])
            want_tag = {"linear16": 1, "mulaw": 7, "alaw": 6}[kwargs["encoding"]]
            assert (tag, channels, got_rate, bits) == (want_tag, 1, rate, 8 * per_sample)
        else:
            assert audio[:4] != b"RIFF"
        assert len(audio) - header == per_sample * counting_engine.total_samples > 0
        assert {r.speaker for r in counting_engine.requests} == {DEEPGRAM["aura-2-thalia-en"]}
        assert counting_engine.rates == {rate if rate != 8_000 else 8_000}


async def test_deepgram_rest_default_mp3_headers_and_errors(fake_engine: FakeSpeechEngine,
                                                            make_gateway: GatewayFactory) -> None:
    from deepgram.core.api_error import ApiError

    async with make_gateway(fake_engine, gateway={"auth_tokens": ("dg-s3cret",)}) as server:
        client = _dg(server, "dg-s3cret")
        if mp3_available():
            raw = client.speak.v1.audio.with_raw_response.generate(text=TEXT)
            async with raw as resp:
                assert resp.headers["dg-model-name"] == "aura-asteria-en" and resp.headers["dg-request-id"]
                assert resp.headers["dg-char-count"] == str(len(TEXT))
                mp3 = b"".join([c async for c in resp.data])
            frames, _, rate = mp3_duration(mp3)
            assert frames > 0 and rate == 22_050
        with pytest.raises(ApiError) as exc:
            _ = [c async for c in client.speak.v1.audio.generate(text=TEXT, model="aura-nobody-en",
                                                                 encoding="linear16")]
        assert exc.value.status_code == 400 and exc.value.body["err_code"] == "INVALID_QUERY_PARAMETER"
        assert exc.value.body["request_id"]
        with pytest.raises(ApiError) as exc:
            _ = [c async for c in _dg(server, "wrong").speak.v1.audio.generate(text=TEXT, encoding="linear16")]
        assert exc.value.status_code == 401 and exc.value.body["err_code"] == "INVALID_AUTH"


async def test_elevenlabs_with_timestamps(counting_engine: CountingEngine, make_gateway: GatewayFactory) -> None:
    """``convert_with_timestamps`` / ``stream_with_timestamps``: the audio, and every character of
    the spoken segments with start/end times in order, ending where the audio ends."""
    import base64

    from elevenlabs.client import ElevenLabs

    async with make_gateway(counting_engine) as server:
        client = ElevenLabs(api_key="xi-test", base_url=server.url)
        res = await asyncio.to_thread(lambda: client.text_to_speech.convert_with_timestamps(
            voice_id=RACHEL, text=TEXT, output_format="pcm_16000"))
        audio = base64.b64decode(res.audio_base_64)
        assert len(audio) == 2 * counting_engine.total_samples > 0
        al = res.alignment
        assert al is not None and "".join(al.characters) == TEXT  # every character, spaces included
        starts, ends = al.character_start_times_seconds, al.character_end_times_seconds
        assert starts == sorted(starts) and all(a <= b for a, b in zip(starts, ends, strict=True))
        assert abs(ends[-1] - len(audio) / 2 / 16_000) < 0.01  # the last character ends with the audio

        before = counting_engine.total_samples
        chunks = await asyncio.to_thread(lambda: list(client.text_to_speech.stream_with_timestamps(
            voice_id=RACHEL, text=TEXT, output_format="pcm_16000")))
        audio2 = b"".join(base64.b64decode(c.audio_base_64) for c in chunks if c.audio_base_64)
        assert len(audio2) == 2 * (counting_engine.total_samples - before) > 0
        chars = [ch for c in chunks if c.alignment is not None for ch in c.alignment.characters]
        assert "".join(chars) == TEXT


async def test_stream_with_timestamps_lines_stay_small(make_gateway: GatewayFactory) -> None:
    """A long segment's audio goes out in several lines (clients read a line into a bounded
    buffer: aiohttp's 512 KiB, which Pipecat's ElevenLabsHttpTTSService uses); the characters are
    shared out over them, all of them, in order."""
    import base64

    from gateway.dialects.elevenlabs import MAX_LINE_AUDIO_BYTES

    text = "This one sentence runs on for a good while without any comma to cut it at all " * 2
    async with make_gateway(FakeSpeechEngine(ms_per_char=40.0)) as server:
        async with httpx.AsyncClient(timeout=30) as http:
            r = await http.post(f"{server.url}/v1/text-to-speech/{RACHEL}/stream/with-timestamps",
                                params={"output_format": "pcm_24000"}, json={"text": text.strip()},
                                headers={"xi-api-key": "xi-test"})
    lines = [orjson.loads(x) for x in r.content.splitlines() if x.strip()]
    sizes = [len(base64.b64decode(x["audio_base64"])) for x in lines]
    assert len(lines) > 2 and max(sizes) <= MAX_LINE_AUDIO_BYTES and min(sizes) > 0
    aligned = [x["alignment"] for x in lines if x["alignment"] is not None]
    chars = "".join(c for a in aligned for c in a["characters"])
    assert chars == text.strip()
    starts = [t for a in aligned for t in a["character_start_times_seconds"]]
    assert starts == sorted(starts)


async def test_stream_with_timestamps_first_audio_leaves_before_the_segment_ends(make_gateway: GatewayFactory) -> None:
    """``/stream/with-timestamps`` sends audio as the engine makes it (alignment null), not once a
    segment is complete: a segment of ~3 s of audio made at 2x real time gives its first audio line
    in well under its 1.5 s of generation, then its alignment in the line that ends it."""
    import time

    text = "This single sentence is long enough to take a few seconds of audio to speak"
    engine = FakeSpeechEngine(ms_per_char=40.0, speed=2.0, chunk_ms=100.0)
    async with make_gateway(engine) as server, httpx.AsyncClient(timeout=30) as http:
        t0 = time.monotonic()
        async with http.stream("POST", f"{server.url}/v1/text-to-speech/{RACHEL}/stream/with-timestamps",
                               params={"output_format": "pcm_24000"}, json={"text": text},
                               headers={"xi-api-key": "xi-test"}) as r:
            first_s = None
            lines = []
            async for raw in r.aiter_lines():
                if raw.strip():
                    lines.append(orjson.loads(raw))
                    first_s = first_s if first_s is not None else time.monotonic() - t0
            total_s = time.monotonic() - t0
    assert lines[0]["alignment"] is None and lines[-1]["alignment"] is not None
    assert first_s is not None and first_s < 0.5 < total_s, (first_s, total_s)


def _sdk_output_formats() -> tuple[str, ...]:
    import typing

    from elevenlabs.text_to_speech.types.text_to_speech_convert_request_output_format import (
        TextToSpeechConvertRequestOutputFormat,
    )
    literal = typing.get_args(TextToSpeechConvertRequestOutputFormat)[0]
    return typing.get_args(literal)


async def test_elevenlabs_every_sdk_output_format_is_served(fake_engine: FakeSpeechEngine,
                                                            make_gateway: GatewayFactory) -> None:
    """Every value of the SDK's own output_format enum: the right container and rate."""
    import base64

    from elevenlabs.client import ElevenLabs

    from gateway.dialects.elevenlabs import served_formats

    formats = _sdk_output_formats()
    assert {"wav_16000", "wav_24000", "pcm_32000", "mp3_24000_48"} <= set(formats)
    async with make_gateway(fake_engine) as server:
        client = ElevenLabs(api_key="xi-test", base_url=server.url)
        for fmt in formats:
            kind, rate = fmt.split("_")[0], int(fmt.split("_")[1])
            if (kind == "mp3" and not mp3_available()) or (kind == "opus" and fmt not in served_formats()):
                continue
            data = await asyncio.to_thread(lambda f=fmt: b"".join(client.text_to_speech.convert(  # type: ignore[misc]
                voice_id=RACHEL, text="Hello there.", output_format=f)))
            assert data, fmt
            if kind == "wav":
                assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt ", fmt
                tag, channels, got_rate, _, _, bits = struct.unpack("<HHIIHH", data[20:36])
                assert (tag, channels, got_rate, bits) == (1, 1, rate, 16), fmt
                assert len(data) > 44 and (len(data) - 44) % 2 == 0, fmt
            elif kind == "pcm":
                assert len(data) % 2 == 0 and data[:4] != b"RIFF", fmt
            elif kind == "mp3":
                frames, _, got_rate = mp3_duration(data)
                assert frames > 0 and got_rate == rate, fmt
                assert ((int.from_bytes(data[:4], "big") >> 12) & 0xF) > 0, fmt
            elif kind == "opus":
                assert data[:4] == b"OggS", fmt
            else:
                assert kind in ("ulaw", "alaw") and data[:4] != b"RIFF", fmt
        # with-timestamps: the WAV header starts the (base64) audio
        async with httpx.AsyncClient(timeout=30) as http:
            r = await http.post(f"{server.url}/v1/text-to-speech/{RACHEL}/with-timestamps?output_format=wav_16000",
                                json={"text": "Hello there."}, headers={"xi-api-key": "k"})
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        assert base64.b64decode(r.json()["audio_base64"])[:4] == b"RIFF"


@pytest.mark.parametrize("suffix", ["", "/stream", "/with-timestamps"])
async def test_elevenlabs_http_response_headers(fake_engine: FakeSpeechEngine, make_gateway: GatewayFactory,
                                                suffix: str) -> None:
    """ElevenLabs' ``request-id``, ``character-cost`` (the characters billed) and ``history-item-id``."""
    async with make_gateway(fake_engine) as server, httpx.AsyncClient(timeout=30) as http:
        r = await http.post(f"{server.url}/v1/text-to-speech/{RACHEL}{suffix}?output_format=pcm_16000",
                            json={"text": TEXT}, headers={"xi-api-key": "k"})
        assert r.status_code == 200
        assert r.headers["request-id"] == r.headers["x-request-id"]
        assert r.headers["character-cost"] == str(len(TEXT))
        assert len(r.headers["history-item-id"]) == 20


async def test_vendor_text_limits(fake_engine: FakeSpeechEngine, make_gateway: GatewayFactory) -> None:
    """ElevenLabs refuses text over 10,000 characters, Deepgram REST over 2,000, each in its shape;
    the limits are configurable."""
    async with make_gateway(fake_engine) as server, httpx.AsyncClient(timeout=30) as http:
        reached = len(fake_engine.requests)
        r = await http.post(f"{server.url}/v1/text-to-speech/{RACHEL}?output_format=pcm_16000",
                            json={"text": "x" * 10_001}, headers={"xi-api-key": "k"})
        assert r.status_code == 422 and r.json()["detail"]["status"] == "text_too_long", r.text
        assert "10000" in r.json()["detail"]["message"]
        r = await http.post(f"{server.url}/v1/speak?encoding=linear16", json={"text": "x" * 2_001},
                            headers={"Authorization": "Token k"})
        assert r.status_code == 400 and r.json()["err_code"] == "TEXT_TOO_LONG", r.text
        assert r.json()["request_id"] and "2000" in r.json()["err_msg"]
        assert len(fake_engine.requests) == reached  # refused before the engine
        r = await http.post(f"{server.url}/v1/speak?encoding=linear16", json={"text": "Hi. " * 500},
                            headers={"Authorization": "Token k"})
        assert r.status_code == 200
    async with make_gateway(fake_engine, limits={"deepgram_max_text_chars": 5, "elevenlabs_max_text_chars": 5}) \
            as server, httpx.AsyncClient(timeout=30) as http:
        r = await http.post(f"{server.url}/v1/speak", json={"text": "Hello there."},
                            headers={"Authorization": "Token k"})
        assert r.status_code == 400 and r.json()["err_code"] == "TEXT_TOO_LONG"
        r = await http.post(f"{server.url}/v1/text-to-speech/{RACHEL}", json={"text": "Hello there."},
                            headers={"xi-api-key": "k"})
        assert r.status_code == 422

"""Ogg/Opus, AAC and FLAC through every dialect that defines them (PyAV's FFmpeg encoders), decoded
back with PyAV: OpenAI ``response_format`` opus/aac/flac (official SDK), ElevenLabs
``opus_48000_*`` over HTTP and its WebSocket, Deepgram REST ``encoding=opus|flac|aac``."""

from __future__ import annotations

import asyncio
import base64
import io
from typing import Any

import orjson
import pytest
from openai import AsyncOpenAI
from websockets.asyncio.client import connect

from gateway.dialects.audio import av_available
from loadtest.fakes import FakeSpeechEngine
from tests.dialects.test_http_audio import _dg
from tests.gateway.conftest import GatewayFactory

pytestmark = pytest.mark.skipif(not av_available(), reason="PyAV (av) is not installed")
TEXT = "Hello there, this is the gateway speaking in a compressed format, sentence by sentence."
RACHEL = "21m00Tcm4TlvDq8ikWAM"


def _decode(data: bytes) -> tuple[str, int, float]:
    """(codec, rate, seconds) of an encoded stream."""
    import av

    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.audio[0]
        samples = sum(f.samples for f in c.decode(audio=0))
        return stream.codec_context.name, stream.rate, samples / stream.rate


@pytest.mark.parametrize("fmt,codec", [("opus", "opus"), ("aac", "aac"), ("flac", "flac")])
async def test_openai_formats(fake_engine: FakeSpeechEngine, make_gateway: GatewayFactory, fmt: str, codec: str) -> None:
    async with make_gateway(fake_engine) as server:
        oa = AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0, timeout=30)
        resp = await oa.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, response_format=fmt)  # type: ignore[arg-type]
        name, rate, seconds = await asyncio.to_thread(_decode, resp.content)
        expected = fake_engine.expected_samples(TEXT, 24_000) / 24_000
        assert name == codec and abs(seconds - expected) < 0.1, (name, rate, seconds, expected)


async def test_elevenlabs_opus_over_http_and_websocket(fake_engine: FakeSpeechEngine,
                                                       make_gateway: GatewayFactory) -> None:
    from elevenlabs.client import ElevenLabs

    async with make_gateway(fake_engine) as server:
        client = ElevenLabs(api_key="xi-test", base_url=server.url)
        data = await asyncio.to_thread(lambda: b"".join(client.text_to_speech.convert(
            voice_id=RACHEL, text=TEXT, output_format="opus_48000_64")))
        name, rate, seconds = await asyncio.to_thread(_decode, data)
        expected = fake_engine.expected_samples(TEXT, 48_000) / 48_000
        assert name == "opus" and rate == 48_000 and abs(seconds - expected) < 0.1
        url = f"ws://127.0.0.1:{server.port}/v1/text-to-speech/{RACHEL}/stream-input?output_format=opus_48000_32"
        chunks = bytearray()
        async with connect(url) as ws:
            await ws.send(orjson.dumps({"text": " "}).decode())
            await ws.send(orjson.dumps({"text": TEXT}).decode())
            await ws.send(orjson.dumps({"text": ""}).decode())
            async with asyncio.timeout(30):
                while True:
                    msg: dict[str, Any] = orjson.loads(await ws.recv())
                    if msg.get("audio"):
                        chunks += base64.b64decode(msg["audio"])
                    if msg.get("isFinal"):
                        break
        name, rate, seconds = await asyncio.to_thread(_decode, bytes(chunks))
        assert name == "opus" and abs(seconds - expected) < 0.1


@pytest.mark.parametrize("encoding,codec,rate", [("opus", "opus", 48_000), ("flac", "flac", 48_000),
                                                 ("aac", "aac", 22_050)])
async def test_deepgram_rest_codecs(fake_engine: FakeSpeechEngine, make_gateway: GatewayFactory,
                                    encoding: str, codec: str, rate: int) -> None:
    async with make_gateway(fake_engine) as server:
        data = b"".join([c async for c in _dg(server).speak.v1.audio.generate(text=TEXT, encoding=encoding)])  # type: ignore[arg-type]
        name, got_rate, seconds = await asyncio.to_thread(_decode, data)
        expected = fake_engine.expected_samples(TEXT, 24_000) / 24_000
        assert name == codec and got_rate == rate and abs(seconds - expected) < 0.1, (name, got_rate, seconds)

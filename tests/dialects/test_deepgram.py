"""Deepgram ``/v1/speak`` WebSocket, driven by the official ``deepgram-sdk`` (unmodified: its
environment's ``production`` URL and the key changed)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from deepgram import AsyncDeepgramClient, DeepgramClientEnvironment
from deepgram.core.api_error import ApiError
from deepgram.speak.v1.types import SpeakV1Text
from websockets.exceptions import ConnectionClosed

from gateway.dialects.voices import DEEPGRAM
from loadtest.fakes import CountingEngine, FakeSpeechEngine
from tests.gateway.conftest import GatewayFactory, wait_until

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK's websockets.legacy client


def _client(server: Any, key: str = "dg-test") -> AsyncDeepgramClient:
    env = DeepgramClientEnvironment(base=server.url, production="ws" + server.url[4:],
                                    agent="ws" + server.url[4:], agent_rest=server.url)
    return AsyncDeepgramClient(api_key=key, environment=env)


async def _until(sock: Any, kind: str, within_s: float = 10.0) -> tuple[bytes, list[Any]]:
    """Receive until a message of ``kind``: (audio before it, messages)."""
    audio, msgs = b"", []
    async with asyncio.timeout(within_s):
        while True:
            m = await sock.recv()
            if isinstance(m, bytes):
                audio += m
                continue
            msgs.append(m)
            if getattr(m, "type", None) == kind:
                return audio, msgs


async def test_speak_flush_close(counting_engine: CountingEngine, make_gateway: GatewayFactory):
    async with make_gateway(counting_engine) as server:
        async with _client(server).speak.v1.connect(model="aura-2-thalia-en", encoding="linear16",
                                                    sample_rate=16000) as sock:
            meta = await sock.recv()
            assert meta.type == "Metadata" and meta.model_name == "aura-2-thalia-en"
            assert meta.model_version == f"voicegw-{counting_engine.name}"  # the engine that serves
            for piece in ["Hello", " there,", " this is the gateway", " speaking Deepgram."]:
                await sock.send_text(SpeakV1Text(text=piece))
            await sock.send_flush()
            audio, msgs = await _until(sock, "Flushed")
            assert msgs[-1].sequence_id == 0
            assert len(audio) == 2 * counting_engine.total_samples > 0
            first, n_first = counting_engine.total_samples, len(counting_engine.requests)

            await sock.send_flush()  # nothing new: Flushed at once
            audio2, msgs = await _until(sock, "Flushed")
            assert audio2 == b"" and msgs[-1].sequence_id == 1

            await sock.send_text(SpeakV1Text(text="And one more sentence, never flushed."))
            await sock.send_close()  # closes at once, like Deepgram
            with pytest.raises(ConnectionClosed):
                while True:
                    await asyncio.wait_for(sock.recv(), 5)
        assert await wait_until(lambda: counting_engine.health().running_requests == 0)
        assert counting_engine.total_samples >= first
        assert counting_engine.rates == {16_000}
        assert {r.speaker for r in counting_engine.requests} == {DEEPGRAM["aura-2-thalia-en"]}
        if isinstance(counting_engine.inner, FakeSpeechEngine):
            assert first == sum(counting_engine.inner.expected_samples(r.text, 16_000)
                                for r in counting_engine.requests[:n_first])


@pytest.mark.parametrize("encoding,rate,bytes_per_sample", [
    ("mulaw", 8000, 1), ("alaw", 16000, 1), ("linear16", 32000, 2), ("linear16", 48000, 2),
])
async def test_encodings(counting_engine: CountingEngine, make_gateway: GatewayFactory,
                         encoding: str, rate: int, bytes_per_sample: int):
    async with make_gateway(counting_engine) as server:
        async with _client(server).speak.v1.connect(encoding=encoding, sample_rate=rate) as sock:
            await sock.send_text(SpeakV1Text(text="Encodings, rates."))
            await sock.send_flush()
            audio, _ = await _until(sock, "Flushed")
        session_rate = next(iter(counting_engine.rates))
        expected = counting_engine.total_samples * rate / session_rate
        assert abs(len(audio) / bytes_per_sample - expected) <= 2 and expected > 0
        assert {r.speaker for r in counting_engine.requests} == {DEEPGRAM["aura-asteria-en"]}


async def test_clear_stops_audio_and_engine(make_gateway: GatewayFactory):
    slow = FakeSpeechEngine(speed=2.0)
    async with make_gateway(slow) as server:
        async with _client(server).speak.v1.connect(model="aura-luna-en") as sock:
            await sock.send_text(SpeakV1Text(text="This is a long answer that the user will interrupt. " * 6))
            await sock.send_flush()
            while not isinstance(await asyncio.wait_for(sock.recv(), 5), bytes):
                pass
            await sock.send_clear()
            _audio, msgs = await _until(sock, "Cleared")
            assert msgs[-1].sequence_id == 0
            assert not [m for m in msgs if getattr(m, "type", None) == "Flushed"]
            assert await wait_until(lambda: slow.health().running_requests == 0, within_s=3)
            # nothing of the cleared text follows; new text is spoken normally
            await sock.send_text(SpeakV1Text(text="Okay."))
            await sock.send_flush()
            audio, msgs = await _until(sock, "Flushed")
            assert len(audio) == 2 * slow.expected_samples("Okay.", 24_000)
            assert msgs[-1].sequence_id == 0


async def test_handshake_errors_and_auth(fake_engine: FakeSpeechEngine, make_gateway: GatewayFactory):
    async with make_gateway(fake_engine, gateway={"auth_tokens": ("dg-s3cret",)}) as server:
        with pytest.raises(ApiError) as exc:
            async with _client(server, "wrong").speak.v1.connect():
                pass
        assert exc.value.status_code == 401
        for kwargs in ({"model": "aura-2-nobody-en"}, {"encoding": "mp3"}, {"encoding": "mulaw", "sample_rate": 24000},
                       {"speed": 1.3}):
            with pytest.raises(ApiError) as exc:
                async with _client(server, "dg-s3cret").speak.v1.connect(**kwargs):
                    pass
            assert exc.value.status_code == 400, kwargs
        async with _client(server, "dg-s3cret").speak.v1.connect() as sock:
            await sock.recv()  # Metadata
            await sock._send("not json")  # noqa: SLF001 - the SDK only sends valid messages
            warning = await asyncio.wait_for(sock.recv(), 5)
            assert warning.type == "Warning" and warning.code == "INVALID_JSON"


async def test_browser_token_subprotocol(fake_engine: FakeSpeechEngine, make_gateway: GatewayFactory):
    from websockets.asyncio.client import connect
    from websockets.typing import Subprotocol

    async with make_gateway(fake_engine, gateway={"auth_tokens": ("dg-s3cret",)}) as server:
        url = "ws" + server.url[4:] + "/v1/speak?encoding=linear16&sample_rate=24000"
        offered = [Subprotocol("token"), Subprotocol("dg-s3cret")]
        async with connect(url, subprotocols=offered) as ws:
            assert ws.subprotocol == "token"
            assert '"Metadata"' in str(await asyncio.wait_for(ws.recv(), 5))

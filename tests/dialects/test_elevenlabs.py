"""ElevenLabs ``stream-input`` WebSocket, driven by the official ``elevenlabs`` SDK (unmodified:
only base_url and key changed) and, for what the SDK does not expose, by a plain WebSocket client
speaking the published message schema."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
import orjson
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from gateway.dialects.audio import alaw_decode, mp3_available
from gateway.dialects.voices import ELEVENLABS
from loadtest.fakes import CountingEngine, FakeSpeechEngine
from tests.dialects.mp3 import mp3_duration
from tests.dialects.tls import tls_front
from tests.gateway.conftest import GatewayFactory, wait_until

RACHEL = "21m00Tcm4TlvDq8ikWAM"
CHUNKS = ["Hello ", "there, ", "this is ", "the gateway ", "speaking ", "through the ElevenLabs ",
          "dialect. ", "It streams ", "as text ", "arrives."]


@pytest.mark.parametrize("output_format,rate", [("pcm_24000", 24_000), ("pcm_16000", 16_000)])
async def test_official_sdk_convert_realtime(counting_engine: CountingEngine, make_gateway: GatewayFactory,
                                             tls_cert: Any, trust_cert: Any, output_format: str, rate: int):
    from elevenlabs.client import ElevenLabs

    async with make_gateway(counting_engine) as server, tls_front(server.port, *tls_cert) as tls_port:
        # the SDK always speaks wss:// (it rewrites the base URL's scheme): TLS in front, as in production
        client = ElevenLabs(api_key="xi-test", base_url=f"https://127.0.0.1:{tls_port}")

        def run() -> bytes:
            return b"".join(client.text_to_speech.convert_realtime(
                voice_id=RACHEL, text=iter(CHUNKS), model_id="eleven_flash_v2_5", output_format=output_format))

        audio = await asyncio.wait_for(asyncio.to_thread(run), 30)
        assert len(audio) == 2 * counting_engine.total_samples > 0
        assert counting_engine.rates == {rate}
        assert {r.speaker for r in counting_engine.requests} == {ELEVENLABS[RACHEL][1]}
        if isinstance(counting_engine.inner, FakeSpeechEngine):
            assert counting_engine.total_samples == sum(
                counting_engine.inner.expected_samples(r.text, rate) for r in counting_engine.requests)
        assert await wait_until(lambda: counting_engine.health().running_requests == 0)


async def _session(url: str, messages: list[dict[str, Any]], **kw: Any) -> tuple[list[dict[str, Any]], bytes, int]:
    """Send ``messages``, read until the server closes: (messages received, audio, close code)."""
    got: list[dict[str, Any]] = []
    audio = b""
    async with connect(url, compression=None, open_timeout=5, **kw) as ws:
        for m in messages:
            await ws.send(orjson.dumps(m).decode())
        try:
            while True:
                msg = orjson.loads(await asyncio.wait_for(ws.recv(), 20))
                got.append(msg)
                if msg.get("audio"):
                    audio += base64.b64decode(msg["audio"])
        except ConnectionClosed:
            pass
    assert ws.close_code is not None
    return got, audio, ws.close_code


def _url(server: Any, voice: str = RACHEL, **query: str) -> str:
    q = "&".join(f"{k}={v}" for k, v in query.items())
    return f"{server.ws_url[:-3]}/v1/text-to-speech/{voice}/stream-input?{q}"


@pytest.mark.parametrize("fmt,rate,bytes_per_sample", [
    ("pcm_22050", 22_050, 2), ("pcm_44100", 44_100, 2), ("ulaw_8000", 8_000, 1), ("alaw_8000", 8_000, 1),
])
async def test_output_formats(counting_engine: CountingEngine, make_gateway: GatewayFactory,
                              fmt: str, rate: int, bytes_per_sample: int):
    async with make_gateway(counting_engine) as server:
        msgs: list[dict[str, Any]] = [{"text": " ", "voice_settings": {"stability": 0.5, "similarity_boost": 0.8, "speed": 1.0}},
                {"text": "Formats and rates, "}, {"text": "all of them."}, {"text": ""}]
        got, audio, code = await _session(_url(server, output_format=fmt), msgs)
        assert code == 1000 and got[-1] == {"isFinal": True}
        session_rate = next(iter(counting_engine.rates))
        expected = counting_engine.total_samples * rate / session_rate
        assert abs(len(audio) / bytes_per_sample - expected) <= 2
        if fmt == "alaw_8000" and isinstance(counting_engine.inner, FakeSpeechEngine):
            pcm = alaw_decode(audio).astype(np.float64)
            assert np.sqrt(np.mean(pcm**2)) > 1000  # the sine came through, not silence


async def test_flush_speaks_before_the_end_and_final_closes(fake_engine: FakeSpeechEngine,
                                                            make_gateway: GatewayFactory):
    async with make_gateway(fake_engine) as server:
        async with connect(_url(server, voice="seed-4242", output_format="pcm_24000")) as ws:
            await ws.send(orjson.dumps({"text": " "}).decode())
            await ws.send(orjson.dumps({"text": "no boundary here", "flush": True}).decode())
            first = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
            assert first["audio"] and first["isFinal"] is False
            await ws.send(orjson.dumps({"text": ""}).decode())
            rest = []
            with pytest.raises(ConnectionClosed):
                while True:
                    rest.append(orjson.loads(await asyncio.wait_for(ws.recv(), 5)))
            assert rest[-1] == {"isFinal": True} and ws.close_code == 1000
        assert fake_engine.requests[0].speaker == 4242 and fake_engine.requests[0].text == "no boundary here"

        # the end without any text: isFinal at once
        got, audio, code = await _session(_url(server, output_format="pcm_16000"), [{"text": " "}, {"text": ""}])
        assert got == [{"isFinal": True}] and audio == b"" and code == 1000
        got, audio, code = await _session(_url(server, output_format="pcm_16000"), [{"text": ""}])
        assert got == [{"isFinal": True}] and audio == b"" and code == 1000


async def test_handshake_errors_and_key_in_first_message(fake_engine: FakeSpeechEngine,
                                                         make_gateway: GatewayFactory):
    async with make_gateway(fake_engine, gateway={"auth_tokens": ("xi-s3cret",)}) as server:
        with pytest.raises(InvalidStatus) as exc:
            await connect(_url(server, voice="NoSuchVoice", output_format="pcm_24000"))
        assert exc.value.response.status_code == 404
        assert orjson.loads(exc.value.response.body)["detail"]["status"] == "voice_not_found"
        with pytest.raises(InvalidStatus) as exc:
            await connect(_url(server, output_format="opus_16000_64"))
        assert exc.value.response.status_code == 400
        with pytest.raises(InvalidStatus) as exc:
            await connect(_url(server, output_format="pcm_24000"), additional_headers={"xi-api-key": "wrong"})
        assert exc.value.response.status_code == 401

        # no key at the handshake: the first message must carry it
        got, audio, code = await _session(_url(server, output_format="pcm_24000"),
                                          [{"text": " ", "xi_api_key": "wrong"}, {"text": "Hello."}])
        assert code == 1008 and got[0]["error"] == "auth_error" and audio == b""
        got, audio, code = await _session(_url(server, output_format="pcm_24000"),
                                          [{"text": " ", "xi_api_key": "xi-s3cret"}, {"text": "Hello."},
                                           {"text": ""}])
        assert code == 1000 and got[-1] == {"isFinal": True}
        assert len(audio) == 2 * fake_engine.expected_samples("Hello.", 24_000)
        got, audio, code = await _session(_url(server, output_format="pcm_24000"),
                                          [{"text": " ", "voice_settings": {"speed": 1.2}}],
                                          additional_headers={"xi-api-key": "xi-s3cret"})
        assert code == 1008 and got[0]["error"] == "invalid_voice_settings"


async def test_disconnect_aborts_engine(make_gateway: GatewayFactory):
    slow = FakeSpeechEngine(speed=2.0)
    async with make_gateway(slow) as server:
        async with connect(_url(server, output_format="pcm_24000")) as ws:
            await ws.send(orjson.dumps({"text": " "}).decode())
            await ws.send(orjson.dumps({"text": "A long story begins. " * 10, "flush": True}).decode())
            assert orjson.loads(await asyncio.wait_for(ws.recv(), 5))["audio"]
        assert await wait_until(lambda: slow.health().running_requests == 0, within_s=3)


@pytest.mark.skipif(not mp3_available(), reason="lameenc not installed")
async def test_official_sdk_default_mp3(counting_engine: CountingEngine, make_gateway: GatewayFactory,
                                        tls_cert: Any, trust_cert: Any):
    from elevenlabs.client import ElevenLabs

    async with make_gateway(counting_engine) as server, tls_front(server.port, *tls_cert) as tls_port:
        client = ElevenLabs(api_key="xi-test", base_url=f"https://127.0.0.1:{tls_port}")

        def run() -> bytes:  # the SDK's default output_format: mp3_44100_128
            return b"".join(client.text_to_speech.convert_realtime(voice_id="Adam", text=iter(CHUNKS)))

        audio = await asyncio.wait_for(asyncio.to_thread(run), 30)
        frames, samples, rate = mp3_duration(audio)
        assert rate == 44_100
        expected = counting_engine.total_samples * 44_100 / next(iter(counting_engine.rates))
        assert -2 <= samples - expected <= 3 * 1152 + 1105


async def test_alignment_per_segment_and_inactivity_timeout(fake_engine: FakeSpeechEngine,
                                                             make_gateway: GatewayFactory):
    async with make_gateway(fake_engine) as server:
        text = ["Hello there. ", "This is the gateway, ", "speaking in segments!"]
        got, audio, code = await _session(_url(server, output_format="pcm_24000"),
                                          [{"text": " "}, *({"text": t} for t in text), {"text": ""}])
        assert code == 1000 and got[-1] == {"isFinal": True}
        timed = [m for m in got if m.get("alignment")]
        assert len(timed) >= 2  # one per segment, after its audio
        from elevenlabs.types.audio_output import AudioOutput
        from elevenlabs.types.final_output import FinalOutput

        for m in got:  # every message is one of the SDK's own types
            (FinalOutput if m.get("isFinal") else AudioOutput).model_validate(m)
        for m in timed:
            a = m["alignment"]
            assert m["audio"] == "" and m["normalizedAlignment"] == a and m["isFinal"] is False
            assert len(a["chars"]) == len(a["charStartTimesMs"]) == len(a["charDurationsMs"])
            assert a["charStartTimesMs"][0] == 0 and all(isinstance(t, int) for t in a["charStartTimesMs"])
            assert all(t1 == t0 + d for t0, t1, d in zip(a["charStartTimesMs"], a["charStartTimesMs"][1:],
                                                           a["charDurationsMs"], strict=False))
        # the characters are the text; each message's span is its segment's audio (times restart at 0)
        assert "".join(c for m in timed for c in m["alignment"]["chars"]) == "".join(text)
        span_ms = sum(m["alignment"]["charStartTimesMs"][-1] + m["alignment"]["charDurationsMs"][-1] for m in timed)
        assert abs(span_ms - len(audio) / 2 / 24) <= len(timed)  # whole ms per segment

        # inactivity_timeout: no new text for that long -> input_timeout_exceeded, close 1008
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        got, audio, code = await _session(_url(server, output_format="pcm_24000", inactivity_timeout="1"),
                                          [{"text": " "}, {"text": "Hi there."}])
        assert audio and code == 1008 and got[-1]["error"] == "input_timeout_exceeded"
        assert 1.0 <= loop.time() - t0 < 6.0
        with pytest.raises(InvalidStatus) as exc:
            await connect(_url(server, output_format="pcm_24000", inactivity_timeout="0"))
        assert exc.value.response.status_code == 400
        assert orjson.loads(exc.value.response.body)["detail"]["status"] == "invalid_inactivity_timeout"


async def test_wav_output_format_is_refused_on_the_websocket(fake_engine: FakeSpeechEngine,
                                                             make_gateway: GatewayFactory) -> None:
    async with make_gateway(fake_engine) as server:
        with pytest.raises(InvalidStatus) as exc:
            await connect(_url(server, output_format="wav_16000"))
        assert exc.value.response.status_code == 400
        assert orjson.loads(exc.value.response.body)["detail"]["status"] == "invalid_output_format"
        async with connect(_url(server, output_format="pcm_32000")):
            pass

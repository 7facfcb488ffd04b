"""POST /v1/audio/speech driven by the official ``openai`` SDK (unmodified, base_url pointed at
the gateway)."""

from __future__ import annotations

import asyncio
import base64
import io
import time
import wave

import httpx
import openai
import orjson
import pytest
from openai import AsyncOpenAI
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from gateway import protocol as P
from gateway.dialects.audio import mp3_available
from loadtest.fakes import CountingEngine, FakeSpeechEngine
from tests.dialects.mp3 import mp3_duration
from tests.gateway.conftest import GatewayFactory, wait_until

TEXT = "Hello there. This is the gateway speaking through the OpenAI dialect, sentence by sentence."


def _client(server, api_key: str = "sk-test") -> AsyncOpenAI:  # type: ignore[no-untyped-def]
    return AsyncOpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=30)


async def test_pcm_streams_as_synthesised(counting_engine: CountingEngine, make_gateway: GatewayFactory):
    async with make_gateway(counting_engine) as server:
        client = _client(server)
        chunks: list[tuple[float, int]] = []
        async with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input=TEXT, response_format="pcm"
        ) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"] == "audio/pcm"
            assert resp.headers["transfer-encoding"] == "chunked"
            data = b""
            async for chunk in resp.iter_bytes():
                chunks.append((time.monotonic(), len(chunk)))
                data += chunk
        assert len(data) == 2 * counting_engine.total_samples > 0
        assert counting_engine.rates == {24_000}
        assert {r.speaker for r in counting_engine.requests} == {2222}
        assert len(counting_engine.requests) >= 2  # segmented like a native utterance
        # streamed: the first audio arrived before the engine made the last of it
        assert chunks[0][0] < counting_engine.last_chunk_s
        if isinstance(counting_engine.inner, FakeSpeechEngine):
            assert counting_engine.total_samples == sum(
                counting_engine.inner.expected_samples(r.text, 24_000) for r in counting_engine.requests)
        assert await wait_until(lambda: counting_engine.health().running_requests == 0)


async def test_wav_and_sse(counting_engine: CountingEngine, make_gateway: GatewayFactory):
    async with make_gateway(counting_engine) as server:
        client = _client(server)
        async with client.audio.speech.with_streaming_response.create(
            model="gpt-4o-mini-tts", voice={"id": "nova"}, input="A short wave file.", response_format="wav",
            instructions="cheerful",
        ) as resp:
            assert resp.headers["content-type"] == "audio/wav"
            wav_bytes = await resp.read()
        with wave.open(io.BytesIO(wav_bytes)) as w:
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24_000, 1, 2)
            frames = w.readframes(10**9)
        assert len(frames) == 2 * counting_engine.total_samples > 0

        before = counting_engine.total_samples
        async with client.audio.speech.with_streaming_response.create(
            model="gpt-4o-mini-tts", voice="7869", input="Events, please.", response_format="pcm",
            stream_format="sse",
        ) as resp:
            assert resp.headers["content-type"].startswith("text/event-stream")
            events = [orjson.loads(line[6:]) async for line in resp.iter_lines() if line.startswith("data: ")]
        assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
        audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
        assert len(audio) == 2 * (counting_engine.total_samples - before) > 0
        done = events[-1]
        assert done["type"] == "speech.audio.done"
        assert done["usage"]["total_tokens"] == done["usage"]["input_tokens"] + done["usage"]["output_tokens"]
        assert counting_engine.requests[-1].speaker == 7869


@pytest.mark.parametrize(
    ("kwargs", "param", "code"),
    [
        ({"voice": "nobody"}, "voice", "invalid_value"),
        ({"response_format": "ogg"}, "response_format", "invalid_value"),
        ({"speed": 1.5}, "speed", "unsupported_value"),
        ({"speed": 9.0}, "speed", "invalid_value"),
        ({"input": "   "}, "input", "invalid_value"),
        ({"stream_format": "chunks"}, "stream_format", "invalid_value"),
    ],
)
async def test_request_errors_in_openai_shape(fake_engine: FakeSpeechEngine, make_gateway: GatewayFactory,
                                              kwargs: dict, param: str, code: str):
    async with make_gateway(fake_engine) as server:
        args = {"model": "tts-1", "voice": "alloy", "input": "Hi.", "response_format": "pcm", **kwargs}
        with pytest.raises(openai.BadRequestError) as exc:
            await _client(server).audio.speech.create(**args)
        err = exc.value.body
        assert isinstance(err, dict)
        assert err["param"] == param and err["code"] == code and err["type"] == "invalid_request_error"
        assert isinstance(err["message"], str) and err["message"]
        assert fake_engine.requests == []


async def test_auth_overload_and_limits(fake_engine: FakeSpeechEngine, make_gateway: GatewayFactory):
    async with make_gateway(fake_engine, gateway={"auth_tokens": ("s3cret",)},
                            limits={"max_utterance_chars": 50}) as server:
        with pytest.raises(openai.AuthenticationError) as exc:
            await _client(server, "wrong").audio.speech.create(model="tts-1", voice="alloy", input="Hi.",
                                                               response_format="pcm")
        assert exc.value.body["code"] == "invalid_api_key"  # type: ignore[index]
        ok = await _client(server, "s3cret").audio.speech.create(model="tts-1", voice="alloy", input="Hi there.",
                                                                 response_format="pcm")
        assert len(ok.content) == 2 * fake_engine.expected_samples("Hi there.", 24_000)
        with pytest.raises(openai.InternalServerError) as exc5:
            await _client(server, "s3cret").audio.speech.create(model="tts-1", voice="alloy",
                                                                input="Too busy #OVERLOAD# now.",
                                                                response_format="pcm")
        assert exc5.value.status_code == 503 and exc5.value.body["code"] == "engine_overloaded"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as exc4:
            await _client(server, "s3cret").audio.speech.create(model="tts-1", voice="alloy", input="x" * 51,
                                                                response_format="pcm")
        assert exc4.value.body["code"] == "string_above_max_length"  # type: ignore[index]
        assert await wait_until(lambda: fake_engine.health().running_requests == 0)


async def test_disconnect_mid_stream_aborts_engine(make_gateway: GatewayFactory):
    slow = FakeSpeechEngine(speed=2.0)
    async with make_gateway(slow) as server:
        async with _client(server).audio.speech.with_streaming_response.create(
            model="tts-1", voice="echo", input="This is a long answer. " * 20, response_format="pcm"
        ) as resp:
            async for _chunk in resp.iter_bytes():
                break
        assert await wait_until(lambda: slow.health().running_requests == 0, within_s=3)
        assert slow.aborted


async def test_same_port_still_serves_websocket_and_get(fake_engine: FakeSpeechEngine,
                                                        make_gateway: GatewayFactory):
    async with make_gateway(fake_engine) as server:
        async with httpx.AsyncClient() as http:
            assert (await http.get(server.url + "/healthz")).status_code == 200
            r = await http.post(server.url + "/v1/chat/completions", json={})
            assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
            r = await http.post(server.url + "/healthz", content=b"x")
            assert r.status_code == 405
            r = await http.get(server.url + "/v1/audio/speech")
            assert r.status_code == 404
            r = await http.post(server.url + "/v1/audio/speech", content=b"{not json")
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
            r = await http.post(server.url + "/v1/audio/speech", content=b"x" * 200_000)
            assert r.status_code == 413
        async with connect(server.ws_url, subprotocols=[P.SUBPROTOCOL], compression=None) as ws:  # type: ignore[list-item]
            await ws.send(orjson.dumps({"type": "session.start"}).decode())
            started = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
            assert started["type"] == "session.started"


async def test_graceful_shutdown_finishes_the_request(make_gateway: GatewayFactory):
    engine = FakeSpeechEngine(speed=5.0)
    async with make_gateway(engine) as server:
        text = "One sentence first. And a second one after it."
        async with _client(server).audio.speech.with_streaming_response.create(
            model="tts-1", voice="onyx", input=text, response_format="pcm"
        ) as resp:
            it = resp.iter_bytes()
            data = await anext(it)
            stopping = asyncio.create_task(server.shutdown(grace_s=5.0))
            async for chunk in it:
                data += chunk
            await stopping
        assert len(data) == 2 * sum(engine.expected_samples(r.text, 24_000) for r in engine.requests)
        # while draining, new requests are refused with OpenAI's shape
        with pytest.raises((openai.InternalServerError, openai.APIConnectionError)):
            await _client(server).audio.speech.create(model="tts-1", voice="onyx", input="Hi.",
                                                      response_format="pcm")


async def test_dialects_share_the_session_cap(fake_engine: FakeSpeechEngine, make_gateway: GatewayFactory):
    async with make_gateway(fake_engine, limits={"max_sessions": 1}) as server:
        url = "ws" + server.url[4:] + "/v1/speak"
        async with connect(url) as ws:  # a Deepgram session holds the only slot
            await asyncio.wait_for(ws.recv(), 5)
            assert await wait_until(lambda: len(server.connections) == 1)
            with pytest.raises(openai.InternalServerError) as exc:
                await _client(server).audio.speech.create(model="tts-1", voice="alloy", input="Hi.",
                                                          response_format="pcm")
            assert exc.value.status_code == 503 and exc.value.body["code"] == "over_capacity"  # type: ignore[index]
            with pytest.raises(InvalidStatus) as exc_ws:
                await connect(server.ws_url[:-3] + "/v1/text-to-speech/Rachel/stream-input?output_format=pcm_24000")
            assert exc_ws.value.response.status_code == 503
        assert await wait_until(lambda: not server.connections)
        ok = await _client(server).audio.speech.create(model="tts-1", voice="alloy", input="Hi.",
                                                       response_format="pcm")
        assert len(ok.content) == 2 * fake_engine.expected_samples("Hi.", 24_000)


@pytest.mark.skipif(not mp3_available(), reason="lameenc not installed")
async def test_mp3_default_format(counting_engine: CountingEngine, make_gateway: GatewayFactory):
    async with make_gateway(counting_engine) as server:
        # no response_format: OpenAI's default, mp3
        async with _client(server).audio.speech.with_streaming_response.create(
            model="tts-1", voice="shimmer", input="The default format is mp3, streamed."
        ) as resp:
            assert resp.headers["content-type"] == "audio/mpeg"
            data = await resp.read()
        frames, samples, rate = mp3_duration(data)
        assert rate == 24_000
        # LAME adds its encoder delay and pads the last frame
        assert 0 <= samples - counting_engine.total_samples <= 3 * 576 + 1105


async def test_raw_http_expect_continue_and_http10(fake_engine: FakeSpeechEngine, make_gateway: GatewayFactory):
    async with make_gateway(fake_engine) as server:
        body = orjson.dumps({"model": "tts-1", "voice": "alloy", "input": "Raw socket.", "response_format": "pcm"})
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
        await writer.drain()
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 100 ")
        writer.write(body)
        raw = await asyncio.wait_for(reader.read(), 10)  # the server closes after the response
        writer.close()
        head, _, chunked = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK") and b"transfer-encoding: chunked" in head.lower()
        pcm, rest = b"", chunked
        while True:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            pcm, rest = pcm + rest[:size], rest[size + 2:]
        assert len(pcm) == 2 * fake_engine.expected_samples("Raw socket.", 24_000)

        # HTTP/1.0: no chunked encoding, the body runs to the close
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /v1/audio/speech HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        raw = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        head, _, pcm = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"chunked" not in head.lower()
        assert len(pcm) == 2 * fake_engine.expected_samples("Raw socket.", 24_000)

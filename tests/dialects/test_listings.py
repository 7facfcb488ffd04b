"""``GET /v1/models`` / ``/v1/voices`` / ``/v1/audio/voices``, JSON 404s in each vendor's shape,
``x-request-id`` on every response, and OpenAI's input-length limit; driven by the official
``openai`` and ``elevenlabs`` SDKs (base URL pointed at the gateway) and plain HTTP."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from typing import Any

import openai
import orjson
import pytest
from openai import AsyncOpenAI
from websockets.asyncio.client import connect

from gateway.dialects import voices
from loadtest.fakes import FakeSpeechEngine
from tests.gateway.conftest import GatewayFactory


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    req = urllib.request.Request(url, headers=headers or {})  # noqa: S310 - local test server
    try:
        with urllib.request.urlopen(req, timeout=10) as r:  # noqa: S310
            return r.status, {k.lower(): v for k, v in r.headers.items()}, orjson.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, orjson.loads(e.read())


async def test_sdks_list_models_and_voices(fake_engine: FakeSpeechEngine, make_gateway: GatewayFactory) -> None:
    from elevenlabs.client import ElevenLabs

    async with make_gateway(fake_engine) as server:
        oa = AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0, timeout=10)
        models = [m.id async for m in oa.models.list()]
        assert "tts-1" in models and "gpt-4o-mini-tts" in models
        raw = await oa.models.with_raw_response.list()
        assert raw.headers.get("x-request-id", "").startswith("req_")

        el = ElevenLabs(api_key="xi-test", base_url=server.url)
        got = await asyncio.to_thread(el.voices.get_all)
        assert {v.voice_id for v in got.voices} == set(voices.ELEVENLABS)
        rachel = await asyncio.to_thread(el.voices.get, "21m00Tcm4TlvDq8ikWAM")
        assert rachel.name == "Rachel"
        el_models = await asyncio.to_thread(el.models.list)
        assert "eleven_flash_v2_5" in {m.model_id for m in el_models}

        status, headers, body = await asyncio.to_thread(_get, server.url + "/v1/models", {"Authorization": "Token k"})
        assert status == 200 and {m["name"] for m in body["tts"]} == set(voices.DEEPGRAM)
        status, headers, body = await asyncio.to_thread(_get, server.url + "/v1/audio/voices")
        assert status == 200 and body["voices"] == list(voices.OPENAI)
        assert headers["content-type"] == "application/json" and headers["x-request-id"].startswith("req_")


@pytest.mark.parametrize("headers,shape", [
    ({}, lambda b: b["error"]["code"] == "unknown_url" and b["error"]["type"] == "invalid_request_error"),
    ({"xi-api-key": "k"}, lambda b: b["detail"]["status"] == "not_found"),
    ({"Authorization": "Token k"}, lambda b: b["err_code"] == "NOT_FOUND" and b["request_id"].startswith("req_")),
])
async def test_unknown_paths_answer_json_in_the_vendor_shape(fake_engine: FakeSpeechEngine, make_gateway: GatewayFactory,
                                                             headers: dict[str, str], shape: Any) -> None:
    async with make_gateway(fake_engine) as server:
        status, got_headers, body = await asyncio.to_thread(_get, server.url + "/v1/nope", headers)
        assert status == 404 and got_headers["content-type"] == "application/json" and shape(body), body
        assert got_headers["x-request-id"].startswith("req_")
        status, _, body = await asyncio.to_thread(_get, server.url + "/v1/voices/nobody", {"xi-api-key": "k"})
        assert status == 404 and body["detail"]["status"] == "voice_not_found"


async def test_listings_need_the_key_when_auth_is_on(fake_engine: FakeSpeechEngine, make_gateway: GatewayFactory) -> None:
    async with make_gateway(fake_engine, gateway={"auth_tokens": ("s3cret",)}) as server:
        oa = AsyncOpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0, timeout=10)
        with pytest.raises(openai.AuthenticationError) as exc:
            await oa.models.list()
        assert exc.value.body["code"] == "invalid_api_key"  # type: ignore[index]
        ok = AsyncOpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0, timeout=10)
        assert [m.id async for m in ok.models.list()]


async def test_every_response_has_a_request_id(fake_engine: FakeSpeechEngine, make_gateway: GatewayFactory) -> None:
    async with make_gateway(fake_engine) as server:
        oa = AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0, timeout=30)
        raw = await oa.audio.speech.with_raw_response.create(model="tts-1", voice="alloy", input="Hi there.",
                                                             response_format="pcm")
        assert raw.headers["x-request-id"].startswith("req_")
        assert int(raw.headers["openai-processing-ms"]) >= 0
        for path in ("/healthz", "/protocol.json"):
            status, headers, _ = await asyncio.to_thread(_get, server.url + path)
            assert status == 200 and headers["x-request-id"].startswith("req_")
        ws_paths = ["/ws", "/v1/speak?encoding=linear16&sample_rate=24000",
                    "/v1/text-to-speech/21m00Tcm4TlvDq8ikWAM/stream-input"]
        for path in ws_paths:
            async with connect(f"ws://127.0.0.1:{server.port}{path}", open_timeout=5) as ws:
                assert ws.response is not None and ws.response.headers["x-request-id"].startswith("req_")


async def test_openai_input_limit_is_openais_and_configurable(fake_engine: FakeSpeechEngine,
                                                              make_gateway: GatewayFactory) -> None:
    async with make_gateway(fake_engine) as server:
        oa = AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0, timeout=30)
        with pytest.raises(openai.BadRequestError) as exc:
            await oa.audio.speech.create(model="tts-1", voice="alloy", input="x" * 4097, response_format="pcm")
        assert exc.value.body["code"] == "string_above_max_length" and "4096" in exc.value.body["message"]  # type: ignore[index]
    async with make_gateway(fake_engine, limits={"openai_max_input_chars": 10}) as server:
        oa = AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0, timeout=30)
        with pytest.raises(openai.BadRequestError):
            await oa.audio.speech.create(model="tts-1", voice="alloy", input="Hello there.", response_format="pcm")


async def test_elevenlabs_voices_search_is_served_in_the_v2_shape(fake_engine: FakeSpeechEngine,
                                                                   make_gateway: GatewayFactory) -> None:
    from elevenlabs.client import ElevenLabs

    async with make_gateway(fake_engine) as server:
        el = ElevenLabs(api_key="xi-test", base_url=server.url)
        got = await asyncio.to_thread(el.voices.search)
        assert {v.voice_id for v in got.voices} == set(voices.ELEVENLABS)
        assert got.has_more is False and got.total_count == len(voices.ELEVENLABS) and got.next_page_token is None
        rachel = await asyncio.to_thread(el.voices.search, search="rach")
        assert [v.name for v in rachel.voices] == ["Rachel"] and rachel.total_count == 1


@pytest.mark.parametrize("method", ["GET", "POST"])
@pytest.mark.parametrize("path", ["/v2/nope", "/v1/nope/deeper"])
async def test_unknown_v1_v2_paths_answer_json_in_the_elevenlabs_shape(fake_engine: FakeSpeechEngine,
                                                                      make_gateway: GatewayFactory,
                                                                      method: str, path: str) -> None:
    async with make_gateway(fake_engine) as server:
        def call() -> tuple[int, dict[str, str], Any]:
            req = urllib.request.Request(server.url + path, headers={"xi-api-key": "k"}, method=method,  # noqa: S310
                                         data=b"{}" if method == "POST" else None)
            try:
                with urllib.request.urlopen(req, timeout=10) as r:  # noqa: S310
                    return r.status, dict(r.headers.items()), orjson.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, {k.lower(): v for k, v in e.headers.items()}, orjson.loads(e.read())

        status, headers, body = await asyncio.to_thread(call)
        assert status == 404 and headers["content-type"] == "application/json", (status, headers)
        assert body["detail"]["status"] == "not_found", body


async def test_openai_models_retrieve(fake_engine: FakeSpeechEngine, make_gateway: GatewayFactory) -> None:
    async with make_gateway(fake_engine) as server:
        oa = AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0, timeout=10)
        model = await oa.models.retrieve("tts-1")
        assert model.id == "tts-1" and model.object == "model" and model.owned_by == "voicegw"
        with pytest.raises(openai.NotFoundError) as exc:
            await oa.models.retrieve("whisper-9")
        assert exc.value.body["code"] == "model_not_found"  # type: ignore[index]


async def test_websocket_handshake_on_an_unknown_v2_path_is_a_json_404(fake_engine: FakeSpeechEngine,
                                                                       make_gateway: GatewayFactory) -> None:
    from websockets.exceptions import InvalidStatus

    async with make_gateway(fake_engine) as server:
        with pytest.raises(InvalidStatus) as exc:
            async with connect(f"ws://127.0.0.1:{server.port}/v2/nope", open_timeout=5,
                               additional_headers={"xi-api-key": "k"}):
                pass
        assert exc.value.response.status_code == 404
        assert orjson.loads(exc.value.response.body)["detail"]["status"] == "not_found"

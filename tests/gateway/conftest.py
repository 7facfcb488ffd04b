"""Gateway test fixtures.

``speech_engine`` is THE engine of the integration tests. It is the sine-tone test double unless
``VOICEGW_TEST_ENGINE`` names a backend: ``vllm`` or ``reference`` (ChatTTSSpeech on the tiny random
checkpoint, built like ``voicegw.runtime.build_speech_engine`` does), or ``espeak``/``auto``
(through ``build_speech_engine``). Run the ChatTTS ones under ``flock /tmp/voicegw-heavy.lock``
with ``VLLM_CPU_KVCACHE_SPACE=1``.
Tests that need the double's knobs (failure injection, exact lengths) use ``fake_engine``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from engine.api import SpeechEngine
from gateway.server import GatewayServer
from gateway.session import SessionSettings
from tests.gateway.fakes import FakeSpeechEngine
from voicegw.config import Config, GatewayConfig, LimitsConfig

ENGINE_KIND = os.environ.get("VOICEGW_TEST_ENGINE", "fake")


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def speech_engine(request: pytest.FixtureRequest) -> AsyncIterator[SpeechEngine]:
    if ENGINE_KIND == "fake":
        engine: SpeechEngine = FakeSpeechEngine()
    elif ENGINE_KIND in ("vllm", "reference"):
        # ChatTTS on the tiny random checkpoint: what voicegw.runtime.build_speech_engine builds
        from engine.factory import create_code_engine
        from engine.speech import ChatTTSSpeech, build_decoder
        from voicegw.config import EngineConfig

        model_dir = str(request.getfixturevalue("tiny_model_dir"))
        ecfg = EngineConfig(backend=ENGINE_KIND, model_dir=model_dir, device="cpu", kv_cache_gib=1.0,
                            max_model_len=1024)
        engine = ChatTTSSpeech(create_code_engine(ecfg, model_dir), build_decoder(ecfg, model_dir), ecfg)
    else:
        from voicegw.config import Config, EngineConfig
        from voicegw.runtime import build_speech_engine

        engine = build_speech_engine(Config(engine=EngineConfig(backend=ENGINE_KIND, device="cpu")))
    await engine.start()
    yield engine
    await engine.close()


@pytest.fixture
def fake_engine() -> FakeSpeechEngine:
    return FakeSpeechEngine()


def make_config(gateway: dict[str, Any] | None = None, limits: dict[str, Any] | None = None) -> Config:
    g = dataclasses.replace(GatewayConfig(port=0, shutdown_grace_s=2.0), **(gateway or {}))
    lim = dataclasses.replace(LimitsConfig(), **(limits or {}))
    return Config(gateway=g, limits=lim)


GatewayFactory = Callable[..., contextlib.AbstractAsyncContextManager[GatewayServer]]


@pytest.fixture
def make_gateway(tmp_path: Path) -> GatewayFactory:
    """``async with make_gateway(engine, gateway={...}, limits={...}) as server: ...``"""

    @contextlib.asynccontextmanager
    async def factory(
        engine: SpeechEngine,
        *,
        gateway: dict[str, Any] | None = None,
        limits: dict[str, Any] | None = None,
        static_dir: Path | None = None,
        settings: dict[str, Any] | None = None,
    ) -> AsyncIterator[GatewayServer]:
        config = make_config(gateway, limits)
        st = SessionSettings.from_config(config, engine.name, **(settings or {}))
        server = GatewayServer(config, engine, static_dir=static_dir or tmp_path, settings=st)
        await server.start()
        try:
            yield server
        finally:
            await server.shutdown(grace_s=0.5)

    return factory


async def wait_until(pred: Callable[[], bool], within_s: float = 3.0, interval: float = 0.01) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while loop.time() < deadline:
        if pred():
            return True
        await asyncio.sleep(interval)
    return pred()

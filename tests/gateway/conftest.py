"""Gateway test fixtures.

``speech_engine`` (tests/conftest.py) is THE engine of the integration tests: by default the real
ChatTTS-on-vLLM engine on the tiny random checkpoint; ``VOICEGW_TEST_ENGINE=fake|espeak|reference``
switches it. Tests that need the double's knobs (failure injection, exact lengths) use ``fake_engine``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from engine.api import SpeechEngine
from gateway.server import GatewayServer
from gateway.session import SessionSettings
from voicegw.config import Config, GatewayConfig, LimitsConfig

# ``speech_engine`` (THE engine of the integration tests, VOICEGW_TEST_ENGINE) and ``fake_engine``
# live in tests/conftest.py, shared by every test directory (one engine per test session).


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
        st = SessionSettings.from_config(config, engine.name, engine.resume_mode, engine.check_voice,
                                        **(settings or {}))
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

"""Browser fixtures: a real gateway on 127.0.0.1 (random port) and Debian chromium via Playwright.

The speech engine comes from ONE fixture, ``speech_engine``; pick it with the environment variable
``VOICEGW_BROWSER_ENGINE``:

* ``espeak`` (default): ``engine.espeak.EspeakSpeech``, real speech, offline.
* ``fake``: ``tests.gateway.fakes.FakeSpeechEngine`` (sine tone paced like an engine).
* ``vllm`` / ``reference``: the real ChatTTS engine on the tiny random checkpoint (session fixture
  ``tiny_model_dir``) through ``engine.factory.create_speech_engine``, like tests/gateway (run it
  under ``flock /tmp/voicegw-heavy.lock``).

``VOICEGW_TEST_ENGINE`` (the gateway tests' switch) is used when ``VOICEGW_BROWSER_ENGINE`` is unset.

Chromium: ``/usr/lib/chromium/chromium`` (Debian package ``chromium``), never ``playwright install``.
Tests skip when it is not installed.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM_CANDIDATES = ("/usr/lib/chromium/chromium", "/usr/bin/chromium", "/usr/bin/chromium-browser")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--autoplay-policy=no-user-gesture-required",
]


def chromium_path() -> str | None:
    env = os.environ.get("VOICEGW_CHROMIUM")
    if env:
        return env if Path(env).exists() else None
    for c in CHROMIUM_CANDIDATES:
        if Path(c).exists():
            return c
    return shutil.which("chromium")


def engine_kind() -> str:
    return os.environ.get("VOICEGW_BROWSER_ENGINE") or os.environ.get("VOICEGW_TEST_ENGINE") or "espeak"


def build_chattts_speech(backend: str, model_dir: str) -> Any:
    """ChatTTSSpeech (code engine + streaming decoder) for ``backend`` on ``model_dir``: through
    ``engine.factory.create_speech_engine`` when it exists, else assembled here."""
    from voicegw.config import EngineConfig

    cfg = EngineConfig(backend=backend, model_dir=model_dir, device="cpu", kv_cache_gib=1.0)
    try:
        from engine.factory import create_speech_engine  # type: ignore[attr-defined,unused-ignore]
    except ImportError:
        from engine.factory import create_code_engine
        from engine.speech import ChatTTSSpeech, build_decoder

        return ChatTTSSpeech(create_code_engine(cfg, model_dir), build_decoder(cfg, model_dir), cfg)
    return create_speech_engine(cfg)


@pytest.fixture(scope="module")
async def speech_engine(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """The SpeechEngine behind the gateway (switch with VOICEGW_BROWSER_ENGINE / VOICEGW_TEST_ENGINE)."""
    kind = engine_kind()
    eng: Any
    if kind == "espeak":
        from engine.espeak import EspeakSpeech

        eng = EspeakSpeech()
    elif kind == "fake":
        from tests.gateway.fakes import FakeSpeechEngine

        eng = FakeSpeechEngine()
    else:  # a ChatTTS backend (vllm, reference) on the tiny random checkpoint
        eng = build_chattts_speech(kind, str(request.getfixturevalue("tiny_model_dir")))
    await eng.start()
    yield eng
    await eng.close()


@pytest.fixture(scope="module")
async def gateway(speech_engine: Any) -> AsyncIterator[Any]:
    """The real gateway (gateway.server.GatewayServer) in this event loop, on a random port."""
    from gateway.server import GatewayServer
    from voicegw.config import Config, GatewayConfig

    server = GatewayServer(Config(gateway=GatewayConfig(host="127.0.0.1", port=0)), speech_engine)
    await server.start()
    yield server
    await server.shutdown(grace_s=1.0)


@pytest.fixture(scope="module")
async def browser(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Any]:
    """A Playwright persistent context on Debian chromium with a fresh user-data dir."""
    exe = chromium_path()
    if exe is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium); CI installs it")
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        pytest.skip("python playwright is not installed")
    pw = await async_playwright().start()
    ctx = await pw.chromium.launch_persistent_context(
        str(tmp_path_factory.mktemp("chromium-profile")),
        executable_path=exe,
        headless=True,
        args=CHROMIUM_FLAGS,
    )
    yield ctx
    await ctx.close()
    await pw.stop()


@pytest.fixture
async def page(browser: Any, gateway: Any) -> AsyncIterator[Any]:
    """A fresh tab; console errors and page errors fail the test."""
    pg = await browser.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))
    pg.on("console", lambda m: errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
    pg.errors = errors  # type: ignore[attr-defined]
    yield pg
    await pg.close()
    assert not errors, errors

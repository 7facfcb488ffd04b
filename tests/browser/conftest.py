"""Browser fixtures: a real gateway on 127.0.0.1 (random port) and Debian chromium via Playwright.

The speech engine is the session's ``speech_engine`` (tests/conftest.py): ChatTTS-on-vLLM on the
tiny checkpoint by default; ``VOICEGW_TEST_ENGINE`` = ``reference`` | ``espeak`` | ``fake``
switches it. Runs with the real engine are heavy: ``flock /tmp/voicegw-heavy.lock pytest ...``.

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
    """The session's engine (``speech_engine`` in tests/conftest.py; VOICEGW_TEST_ENGINE)."""
    from tests.conftest import ENGINE_KIND

    return ENGINE_KIND


@pytest.fixture(scope="module")
async def gateway(speech_engine: Any) -> AsyncIterator[Any]:
    """The real gateway (gateway.server.GatewayServer) in this event loop, on a random port."""
    from gateway.server import GatewayServer
    from voicegw.config import Config, GatewayConfig, SessionConfig

    # The tiny random checkpoint stops at random (a sentence can end after 0.1 s of audio): the
    # floor on audio per text unit gives the tests' texts the length their assertions need.
    cfg = Config(gateway=GatewayConfig(host="127.0.0.1", port=0), session=SessionConfig(min_audio_ms_per_unit=32.0))
    server = GatewayServer(cfg, speech_engine)
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

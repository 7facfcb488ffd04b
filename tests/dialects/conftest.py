"""Dialect test fixtures: the gateway fixtures of tests/gateway, plus an engine wrapper that
records how much audio the engine produced for each request (``loadtest.fakes.CountingEngine``:
tests check the audio a third-party client received against what the engine made, whichever engine
``speech_engine`` is).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.api import SpeechEngine
from loadtest.fakes import CountingEngine
from tests.dialects.tls import make_cert
from tests.gateway.conftest import make_gateway  # noqa: F401 (fixture)


@pytest.fixture
def counting_engine(speech_engine: SpeechEngine) -> CountingEngine:  # noqa: F811
    return CountingEngine(speech_engine)


@pytest.fixture(scope="session")
def tls_cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_cert(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def trust_cert(tls_cert: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> Path:
    """Make the test certificate trusted by default SSL contexts created during the test."""
    monkeypatch.setenv("SSL_CERT_FILE", str(tls_cert[0]))
    return tls_cert[0]

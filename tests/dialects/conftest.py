"""Dialect test fixtures: the gateway fixtures of tests/gateway, plus an engine wrapper that
records how much audio the engine produced for each request (so tests check the audio a
third-party client received against what the engine made, whichever engine ``speech_engine`` is).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine.api import AudioChunk, EngineHealth, SpeechEngine, SpeechRequest
from tests.dialects.tls import make_cert
from tests.gateway.conftest import make_gateway  # noqa: F401 (fixture)


@dataclass
class CountingEngine:
    """Delegates to ``inner``; counts the samples of each request and when the last chunk came."""

    inner: SpeechEngine
    samples: dict[str, int] = field(default_factory=dict)
    requests: list[SpeechRequest] = field(default_factory=list)
    last_chunk_s: float = 0.0

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def native_sample_rate_hz(self) -> int:
        return self.inner.native_sample_rate_hz

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def health(self) -> EngineHealth:
        return self.inner.health()

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    def synthesize(self, request: SpeechRequest) -> AsyncIterator[AudioChunk]:
        return self._gen(request)

    async def _gen(self, request: SpeechRequest) -> AsyncIterator[AudioChunk]:
        import time

        self.requests.append(request)
        self.samples[request.request_id] = 0
        it = self.inner.synthesize(request)
        try:
            async for chunk in it:
                self.samples[request.request_id] += len(chunk.pcm) // 2
                self.last_chunk_s = time.monotonic()
                yield chunk
        finally:
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                await aclose()

    @property
    def total_samples(self) -> int:
        return sum(self.samples.values())

    @property
    def rates(self) -> set[int]:
        return {r.sample_rate_hz for r in self.requests}


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

"""The tests' gateway in a process of its own: ``loadtest.serve.ServerProcess`` (the one launcher
of the load test, the benchmarks and these tests), plus the RSS and file descriptors of the
gateway process alone (vLLM's engine core and the decoder are its children and are not counted).

``with GatewayProcess("fake", settings={"limits.max_sessions": 8}) as gw: gw.ws_url, gw.rss(), ...``
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loadtest.serve import ServerProcess
from tests.reliability.helpers import fd_count, rss_bytes

ROOT = Path(__file__).resolve().parents[2]


class GatewayProcess(ServerProcess):
    def __init__(self, engine: str = "fake", *, settings: dict[str, Any] | None = None,
                 model_dir: str | Path | None = None, start_timeout_s: float = 60.0,
                 log_path: Path | None = None) -> None:
        super().__init__(engine, model_dir=str(model_dir or ""),
                         overrides={k: str(v) for k, v in (settings or {}).items()},
                         start_timeout_s=start_timeout_s, log_path=log_path)

    def __enter__(self) -> GatewayProcess:
        self.start()
        return self

    def rss(self) -> int:
        return rss_bytes(self.pid)

    def fds(self) -> int:
        return fd_count(self.pid)

"""A gateway on its own event loop in a background thread, for synchronous tests (hypothesis)
that drive it with ``asyncio.run`` per example."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from engine.api import SpeechEngine
from gateway.server import GatewayServer
from gateway.session import SessionSettings
from tests.gateway.conftest import make_config

T = TypeVar("T")


class ThreadedGateway:
    def __init__(self, engine: SpeechEngine, *, gateway: dict[str, Any] | None = None,
                 limits: dict[str, Any] | None = None) -> None:
        self.engine = engine
        self.config = make_config(gateway, limits)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="gateway-loop", daemon=True)
        self.server: GatewayServer | None = None
        self.errors: list[BaseException] = []
        self._ready = threading.Event()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.set_exception_handler(self._on_loop_error)
        self.loop.run_forever()

    def _on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        self.errors.append(exc if isinstance(exc, BaseException) else RuntimeError(str(context.get("message"))))

    def call(self, fn: Callable[[], Awaitable[T]], timeout_s: float = 30.0) -> T:
        fut: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(fn(), self.loop)  # type: ignore[arg-type]
        return fut.result(timeout_s)

    def __enter__(self) -> ThreadedGateway:
        self.thread.start()

        async def start() -> None:
            await self.engine.start()
            st = SessionSettings.from_config(self.config, self.engine.name, self.engine.resume_mode,
                                            self.engine.check_voice)
            self.server = GatewayServer(self.config, self.engine, settings=st)
            await self.server.start()

        self.call(start)
        return self

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.port

    @property
    def ws_url(self) -> str:
        assert self.server is not None
        return self.server.ws_url

    def alive(self) -> bool:
        return self.thread.is_alive() and self.loop.is_running()

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            if self.server is not None:
                await self.server.shutdown(grace_s=0.5)
            await self.engine.close()

        try:
            self.call(stop)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()

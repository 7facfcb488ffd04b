"""Entry points: ``serve`` (async, engine given) and ``run_gateway`` (what ``voicegw serve`` calls)."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from engine.api import SpeechEngine
from gateway.config import GatewayConfig, GatewaySettings
from gateway.metrics import GatewayMetrics
from gateway.monitor import LoadMonitor
from gateway.server import GatewayServer
from gateway.session import SessionSettings

log = logging.getLogger("voicegw.gateway")


async def serve(
    config: GatewaySettings,
    engine: SpeechEngine,
    *,
    stop: asyncio.Event | None = None,
    force_stop: asyncio.Event | None = None,
    static_dir: Path | None = None,
    metrics: GatewayMetrics | None = None,
    settings: SessionSettings | None = None,
    on_ready: Callable[[GatewayServer], None] | None = None,
) -> None:
    """Serve until ``stop`` is set (or the task is cancelled), then shut down gracefully:
    stop accepting, let utterances finish up to ``gateway.shutdown_grace_s`` (or until
    ``force_stop``), close 1012. The engine must be started; it is not closed here."""
    server = GatewayServer(config, engine, static_dir=static_dir, metrics=metrics, settings=settings)
    await server.start()
    monitor = LoadMonitor(engine, server.metrics, config.gateway.load_log_interval_s, lambda: len(server.connections))
    monitor.start()
    if on_ready is not None:
        on_ready(server)
    try:
        if stop is None:
            await asyncio.Future()  # until cancelled
        else:
            await stop.wait()
    finally:
        await monitor.stop()
        await server.shutdown(force=force_stop)


def run_gateway(config: GatewaySettings, engine: SpeechEngine) -> int:
    """Run the gateway in this process until SIGINT/SIGTERM (a second signal skips the grace
    period). Starts ``engine`` (built by the caller: ``engine.build.build_speech_engine``) and
    closes it at the end. Returns the process exit code (2: the engine could not be started).
    Configures logging (idempotent: the root logger gets one handler)."""
    configure_logging(config.gateway)
    try:
        import uvloop

        runner: Callable[[Any], Any] = uvloop.run
    except ImportError:  # pragma: no cover - non-Linux
        runner = asyncio.run
    try:
        runner(_main(config, engine))
    except KeyboardInterrupt:
        pass
    except _StartupError as exc:
        log.error("%s", exc)
        return 2
    return 0


class _StartupError(Exception):
    pass


async def _main(config: GatewaySettings, engine: SpeechEngine) -> None:
    log.info("event loop %s; engine %s", type(asyncio.get_running_loop()).__module__, engine.name)
    try:
        await engine.start()
    except Exception as exc:
        raise _StartupError(f"cannot start the engine {engine.name}: {exc}") from None
    freeze_startup_heap()
    stop = asyncio.Event()
    force = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():
            force.set()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal)
        except (NotImplementedError, RuntimeError):  # pragma: no cover
            pass
    try:
        await serve(config, engine, stop=stop, force_stop=force)
    finally:
        await engine.close()


def freeze_startup_heap() -> None:
    """Move every object alive after start-up (torch, vLLM, the engine: millions of them) out of
    the garbage collector's reach (``gc.freeze``), so a full collection under load scans only
    what the sessions allocated since: no pause of the event loop that grows with the imports."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info("gc: %d start-up objects frozen in %.0f ms", gc.get_freeze_count(), 1000 * (time.perf_counter() - t0))


class JsonFormatter(logging.Formatter):
    """One JSON object per line; ``session``/``utterance`` extras become fields."""

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in ("session", "utterance", "request_id"):
            v = getattr(record, key, None)
            if v is not None:
                obj[key] = v
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(obj).decode()


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        s = super().format(record)
        sid = getattr(record, "session", None)
        return f"{s} [session={sid}]" if sid is not None else s


def configure_logging(cfg: GatewayConfig) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if cfg.log_json:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(_TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(cfg.log_level.upper())
    # websockets logs every HTTP request/handshake at INFO
    logging.getLogger("websockets").setLevel(max(logging.WARNING, root.level))

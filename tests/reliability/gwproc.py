"""The gateway in a child process, so its memory and file descriptors can be measured alone.

Child side (``python -m tests.reliability.gwproc --engine fake|espeak|vllm [--model-dir D]
[--set section.field=value ...]``): builds the engine, serves on an ephemeral port under uvloop
(like ``voicegw serve``), prints one JSON line ``{"port": ..., "pid": ...}`` on stdout when ready,
stops gracefully on SIGTERM/SIGINT.

Parent side: ``GatewayProcess`` starts it, reads the port, samples RSS/fds of the child (engine-core
processes of vLLM are its children and are not counted), reads /healthz, stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import orjson

from tests.reliability.helpers import fd_count, rss_bytes

ROOT = Path(__file__).resolve().parents[2]


# ---- child ------------------------------------------------------------------------------------


def _build_engine(kind: str, model_dir: str | None, cfg: Any) -> Any:
    if kind == "fake":
        from tests.gateway.fakes import FakeSpeechEngine

        return FakeSpeechEngine()
    if kind == "espeak":
        from engine.espeak import EspeakSpeech

        return EspeakSpeech()
    if kind == "vllm":
        import dataclasses

        from engine._compat import ensure_torch_companions


        ensure_torch_companions()  # before anything imports transformers, vocos or chattts
        from voicegw.runtime import build_speech_engine

        ecfg = dataclasses.replace(cfg.engine, backend="vllm", model_dir=model_dir or "", device="cpu")
        return build_speech_engine(dataclasses.replace(cfg, engine=ecfg))
    raise SystemExit(f"unknown engine {kind}")


async def _child(args: argparse.Namespace) -> None:
    from gateway.app import serve
    from voicegw.config import load_config

    overrides: dict[str, Any] = {"gateway.port": 0, "gateway.host": "127.0.0.1"}
    for item in args.set or []:
        k, _, v = item.partition("=")
        overrides[k] = v
    cfg = load_config(env={}, overrides=overrides)
    speech = _build_engine(args.engine, args.model_dir, cfg)
    await speech.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def ready(server: Any) -> None:
        sys.stdout.write(orjson.dumps({"port": server.port, "pid": os.getpid()}).decode() + "\n")
        sys.stdout.flush()

    try:
        await serve(cfg, speech, stop=stop, on_ready=ready)
    finally:
        await speech.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", default="fake", choices=["fake", "espeak", "vllm"])
    p.add_argument("--model-dir")
    p.add_argument("--set", action="append", help="section.field=value (config override)")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    import logging

    logging.basicConfig(level=args.log_level, format="gw %(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("websockets").setLevel(logging.WARNING)
    import uvloop

    uvloop.run(_child(args))


# ---- parent -----------------------------------------------------------------------------------


class GatewayProcess:
    """``with GatewayProcess(engine="fake", settings={...}) as gw: gw.ws_url, gw.rss(), ...``"""

    def __init__(self, engine: str = "fake", *, settings: dict[str, Any] | None = None,
                 model_dir: str | Path | None = None, start_timeout_s: float = 60.0,
                 log_path: Path | None = None) -> None:
        self.engine = engine
        self.settings = settings or {}
        self.model_dir = model_dir
        self.start_timeout_s = start_timeout_s
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.pid = 0
        self._log: Any = None

    def __enter__(self) -> GatewayProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        cmd = [sys.executable, "-m", "tests.reliability.gwproc", "--engine", self.engine]
        if self.model_dir:
            cmd += ["--model-dir", str(self.model_dir)]
        for k, v in self.settings.items():
            cmd += ["--set", f"{k}={v}"]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
        self._log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        # its own process group: kill() takes the engine-core and decoder processes with it
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=self._log,
                                     start_new_session=True)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + self.start_timeout_s
        line = b""
        os.set_blocking(self.proc.stdout.fileno(), False)
        while time.monotonic() < deadline:
            chunk = self.proc.stdout.readline()
            if chunk:
                line += chunk
                if line.endswith(b"\n"):
                    if line.startswith(b'{"port"'):
                        break
                    line = b""  # a library printing on stdout (vLLM does)
            elif self.proc.poll() is not None:
                raise RuntimeError(f"gateway process exited with {self.proc.returncode}")
            else:
                time.sleep(0.05)
        else:
            self.stop()
            raise TimeoutError("gateway process did not start")
        info = orjson.loads(line)
        self.port, self.pid = int(info["port"]), int(info["pid"])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    def rss(self) -> int:
        return rss_bytes(self.pid)

    def fds(self) -> int:
        return fd_count(self.pid)

    def healthz(self) -> tuple[int, dict[str, Any]]:
        try:
            with urllib.request.urlopen(self.url + "/healthz", timeout=5) as r:
                return int(r.status), orjson.loads(r.read())
        except urllib.error.HTTPError as e:
            return int(e.code), orjson.loads(e.read())

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the gateway and every process it started (a crashed host, from outside)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.stop()

    def stop(self, timeout_s: float = 20.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        rc = self.proc.returncode
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self._log not in (None, subprocess.DEVNULL):
            with contextlib.suppress(Exception):
                self._log.close()
        self.proc = None
        return rc


if __name__ == "__main__":
    main()

"""The gateway in a subprocess, with the engine asked for: the one launcher of the load test,
the benchmarks and the tests that need a gateway process of its own.

``ServerProcess(engine, ...)`` starts ``python -m loadtest.serve ...`` (127.0.0.1, a
free port), waits for its ``READY <ws-url>`` line, samples the RSS of its process tree (the
vLLM engine core is a child process) and stops it on exit (SIGTERM to its process group, then
SIGKILL). ``start``/``stop`` outside ``with``; ``kill`` is a crash from outside (SIGKILL to the
group); ``healthz``, ``alive``, ``port`` and ``pid`` for tests.

Engines: the backends of ``voicegw serve`` (``engine.config.BACKENDS``: ``vllm``, ``reference``,
``espeak``), built by ``engine.build.build_speech_engine`` as ``voicegw serve`` builds them; the
test doubles ``fake`` (``loadtest.fakes.FakeSpeechEngine``, a sine tone) and ``sim``
(``loadtest.fakes.SimBatchEngine``: vLLM-like batch scheduling without a model); ``native``
(``loadtest.baseline.NativePipelineSpeech``: upstream ChatTTS streaming, one at a time).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from engine.config import BACKENDS
from loadtest.procmem import RssSampler

READY_PREFIX = "READY "
#: The load test's own engines (test doubles, the upstream baseline); the rest are the product's.
TEST_ENGINES = ("fake", "sim", "native")
ENGINES = (*TEST_ENGINES, *BACKENDS)
#: Longest wait for a server to come up (a vLLM engine start on CPU takes 15-75 s).
START_TIMEOUT_S = 240.0


class ServerProcess:
    def __init__(self, engine: str, *, model_dir: str = "",
                 overrides: dict[str, str] | None = None, start_timeout_s: float = START_TIMEOUT_S,
                 log_path: str | Path | None = None) -> None:
        self.engine = engine
        self.model_dir = model_dir
        self.overrides = dict(overrides or {})
        self.start_timeout_s = start_timeout_s
        self.url = ""
        self.proc: subprocess.Popen[str] | None = None
        self.sampler: RssSampler | None = None
        self._log_file: Any = None
        self.log_path = Path(log_path) if log_path else Path(tempfile.gettempdir()) / f"voicegw-loadtest-{engine}-{os.getpid()}.log"
        self.start_s = 0.0

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def start(self) -> None:
        cmd = [sys.executable, "-m", "loadtest.serve", "--engine", self.engine]
        if self.model_dir:
            cmd += ["--model-dir", self.model_dir]
        for k, v in self.overrides.items():
            cmd += ["--set", f"{k}={v}"]
        self._log_file = open(self.log_path, "a")  # noqa: SIM115 - closed in stop()
        env = dict(os.environ)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        t = time.monotonic()
        # its own process group (killpg on exit) but the caller's session: a new session would put
        # the server in its own Linux autogroup, and on a 2-core machine with the GPT worker pinned
        # to one core the load generator's group was then starved for seconds at a time (25-40%
        # of a scheduling-bench run; bench/RESULTS-archive.md, "client stalls")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log_file, text=True, env=env,
                                     cwd=root, process_group=0)
        try:
            self.url = self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.start_s = time.monotonic() - t
        self.sampler = RssSampler(self.proc.pid).start()
        self.sampler.sample()
        self.rss_idle_bytes = self.sampler.last_bytes

    @property
    def ws_url(self) -> str:
        return self.url

    @property
    def http_url(self) -> str:
        return "http" + self.url[2:].rsplit("/", 1)[0]

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1].split("/", 1)[0])

    @property
    def pid(self) -> int:
        """The gateway's process (vLLM's engine core and the decoder are its children)."""
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthz(self) -> tuple[int, dict[str, Any]]:
        import json

        try:
            with urllib.request.urlopen(self.http_url + "/healthz", timeout=5) as r:
                return int(r.status), json.loads(r.read())
        except urllib.error.HTTPError as e:
            return int(e.code), json.loads(e.read())

    def kill(self) -> None:
        """SIGKILL the gateway and every process it started (a crashed host, from outside)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        self.stop()

    def _wait_ready(self) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before ready; log: {self.log_path}\n"
                                   + _tail(self.log_path))
            r, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if r:
                line = self.proc.stdout.readline()
                if line.startswith(READY_PREFIX):
                    return line[len(READY_PREFIX):].strip()
        raise TimeoutError(f"server not ready after {self.start_timeout_s:.0f} s; log: {self.log_path}\n"
                           + _tail(self.log_path))

    def info(self) -> dict[str, Any]:
        s = self.sampler
        return {
            "engine": self.engine,
            "url": self.url,
            "pid": self.proc.pid if self.proc else None,
            "start_s": round(self.start_s, 2),
            "rss_idle_mib": round(self.rss_idle_bytes / 2**20, 1) if s else None,
            "rss_peak_mib": round(s.peak_bytes / 2**20, 1) if s else None,
            "rss_last_mib": round(s.last_bytes / 2**20, 1) if s else None,
            "log": str(self.log_path),
        }

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> int | None:
        """SIGTERM (graceful shutdown), SIGKILL after 15 s; returns the exit code."""
        rc: int | None = None
        if self.sampler is not None:
            self.sampler.sample()
            self.sampler.stop()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(5)
        if proc is not None:
            rc = proc.returncode
            if proc.stdout is not None:
                proc.stdout.close()
        self.proc = None
        self.sampler = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return rc


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# ------------------------------------------------------------------------------ the child


def _build_config(args: argparse.Namespace) -> Any:
    from voicegw.config import load_config

    overrides: dict[str, Any] = {"gateway.host": "127.0.0.1", "gateway.port": 0, "gateway.shutdown_grace_s": 1.0}
    if args.engine in BACKENDS:
        overrides["engine.backend"] = args.engine
    if args.engine == "vllm":
        overrides["engine.kv_cache_gib"] = 1.0  # shared 2-core dev machine; --set overrides
        overrides["engine.device"] = "cpu" if os.environ.get("CUDA_VISIBLE_DEVICES", "") == "" else "auto"
    if args.model_dir:
        overrides["engine.model_dir"] = args.model_dir
    for item in args.set:
        k, _, v = item.partition("=")
        overrides[k] = v
    return load_config(env={}, overrides=overrides)


def _make_engine(kind: str, cfg: Any) -> Any:
    if kind == "fake":
        from loadtest.fakes import FakeSpeechEngine

        return FakeSpeechEngine()
    if kind == "sim":
        from loadtest.fakes import SimBatchEngine

        return SimBatchEngine(max_num_seqs=cfg.engine.max_num_seqs)
    if kind == "native":
        from loadtest.baseline import NativePipelineSpeech

        return NativePipelineSpeech(cfg.engine.model_dir, default_speaker=cfg.engine.default_speaker)
    from engine.build import build_speech_engine

    return build_speech_engine(cfg.engine)


def generated_model_dir(size: Literal["tiny", "small"] = "tiny") -> str:
    """A random ChatTTS checkpoint of ``size`` (seed 0, rewritten each call: deterministic) under
    ``$VOICEGW_LOADTEST_CKPT`` (default: the temp dir's ``voicegw-loadtest-ckpt``)."""
    from engine.checkpoint import make_checkpoint

    root = Path(os.environ.get("VOICEGW_LOADTEST_CKPT", Path(tempfile.gettempdir()) / "voicegw-loadtest-ckpt"))
    return str(make_checkpoint(root / size, size, seed=0))


async def _child(args: argparse.Namespace) -> None:
    if args.engine not in ("fake", "sim"):
        from engine._compat import ensure_torch_companions

        ensure_torch_companions()  # before anything imports transformers, vocos or chattts
    from gateway.app import serve

    if args.engine in ("vllm", "reference", "native") and not args.model_dir:
        args.model_dir = generated_model_dir()
    cfg = _build_config(args)
    if any(item.split("=", 1)[0] == "gateway.log_level" for item in args.set):  # its INFO load lines too
        import logging

        logging.getLogger().setLevel(cfg.gateway.log_level.upper())
    eng = _make_engine(args.engine, cfg)
    await eng.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def ready(server: Any) -> None:
        print(READY_PREFIX + server.ws_url, flush=True)

    try:
        await serve(cfg, eng, stop=stop, on_ready=ready)
    finally:
        await eng.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.serve")
    p.add_argument("--engine", choices=ENGINES, required=True)
    p.add_argument("--model-dir", default="")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    args = p.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop

        uvloop.run(_child(args))
    except ImportError:  # pragma: no cover
        asyncio.run(_child(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Gateway replicas behind the real load balancers, each run with the shipped configuration file
itself (``deploy/haproxy/haproxy.cfg``; ``deploy/nginx/voicegw.conf`` included from a minimal
main file that only says where nginx keeps its pid, logs and temp files).

Three replicas of ``voicegw serve`` (the product's entry point) on 127.0.0.1:8801-8803, the
ports the shipped files name, each with its own vLLM engine on the tiny checkpoint (a session
moved to another replica goes on inside its segment from the codes the client kept).
Debian's ``haproxy`` and ``nginx`` are needed (``.ci/run`` installs them); without them the tests
fail, they are not skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.browser.conftest import browser  # noqa: F401 - the browser-through-the-proxy test's chromium

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
REPLICA_PORTS = (8801, 8802, 8803)
LB_PORTS = {"haproxy": 8090, "nginx": 8091}
#: The replicas' settings: the proxies connect from 127.0.0.1 (trusted); a short drain, so that an
#: answer is cut by a SIGTERM and resumed elsewhere.
REPLICA_SETTINGS = {
    "engine.backend": "vllm", "engine.kv_cache_gib": "0.25", "engine.max_num_seqs": "8",
    "engine.max_model_len": "512", "engine.default_speaker": "2222",
    "gateway.trusted_proxies": "127.0.0.1", "gateway.shutdown_grace_s": "1.5",
    "limits.max_sessions_per_client": "6",
    # speech-length segments (random weights stop at random): answers still arriving when a
    # replica is lost, with something to resume
    "session.min_audio_ms_per_unit": "32",
}


def _http(url: str, timeout_s: float = 2.0) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return int(r.status), json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return int(e.code), json.loads(e.read() or b"{}")


def _wait_port(port: int, timeout_s: float, proc: subprocess.Popen[bytes] | None = None, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"exited {proc.returncode}: {log.read_text()[-3000:] if log else ''}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port} after {timeout_s} s: {log.read_text()[-3000:] if log else ''}")


class Replica:
    """One ``voicegw serve`` on a fixed port."""

    def __init__(self, port: int, logdir: Path, model_dir: Path) -> None:
        self.port = port
        self.log = logdir / f"replica-{port}.log"
        self.model_dir = model_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.up = False
        """``/healthz`` answered 200 since the last launch."""

    def start(self) -> None:
        self.launch()
        self.wait_up()

    def launch(self) -> None:
        cmd = [sys.executable, "-m", "voicegw.cli", "serve", "--gateway.port", str(self.port),
               "--engine.model_dir", str(self.model_dir)]
        for k, v in REPLICA_SETTINGS.items():
            cmd += [f"--{k}", v]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.up = False

    def wait_up(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + 240
        while True:
            with contextlib.suppress(OSError):
                if _http(f"http://127.0.0.1:{self.port}/healthz")[0] == 200:
                    self.up = True
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"replica {self.port} did not come up: {self.log.read_text()[-3000:]}")
            time.sleep(0.1)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def sessions(self) -> int:
        # a generous timeout: on a 2-core host three replicas, their sessions and a restarting
        # engine share the CPU, and an event loop can lag a second or two
        return int(_http(f"http://127.0.0.1:{self.port}/healthz", timeout_s=15.0)[1].get("sessions", 0))

    def signal(self, sig: int) -> None:
        """SIGTERM: to ``voicegw serve`` alone, as Kubernetes and ``kill PID`` send it (it stops its
        engine itself once drained; a signal to every process at once would kill the engine core
        under the draining sessions: systemd needs ``KillMode=mixed``, docs/deploy.md). Other
        signals (a crash): to every process of the replica."""
        assert self.proc is not None
        if sig == signal.SIGTERM:
            os.kill(self.proc.pid, sig)
        else:
            os.killpg(self.proc.pid, sig)

    def wait(self, timeout_s: float = 30) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def stop(self) -> None:
        if self.alive():
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def ensure_up(self) -> None:
        if not self.alive():
            self.start()


class Balancer:
    """HAProxy or nginx with the shipped configuration."""

    def __init__(self, kind: str, workdir: Path) -> None:
        self.kind = kind
        self.port = LB_PORTS[kind]
        self.dir = workdir / kind
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log = self.dir / "out.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    def start(self) -> None:
        binary = shutil.which(self.kind) or f"/usr/sbin/{self.kind}"
        if self.kind == "haproxy":
            cmd = [binary, "-db", "-f", str(DEPLOY / "haproxy" / "haproxy.cfg")]
        else:
            main = self.dir / "nginx.conf"
            main.write_text(
                "daemon off;\nworker_processes 1;\n"
                f"pid {self.dir}/nginx.pid;\nerror_log {self.dir}/error.log info;\n"
                "events { worker_connections 1024; }\n"
                "http {\n"
                f"  access_log {self.dir}/access.log;\n"
                + "".join(f"  {t}_temp_path {self.dir}/{t};\n" for t in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
                + f"  include {DEPLOY / 'nginx' / 'voicegw.conf'};\n"
                "}\n")
            cmd = [binary, "-p", str(self.dir), "-c", str(main)]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _wait_port(self.port, 15, self.proc, self.log)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


@pytest.fixture(scope="package")
def replicas(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    logdir = tmp_path_factory.mktemp("replicas")
    reps = [Replica(p, logdir, tiny_model_dir) for p in REPLICA_PORTS]
    try:
        for r in reps:
            r.launch()  # their engines start side by side
        for r in reps:
            r.wait_up()
        yield reps
    finally:
        for r in reps:
            r.stop()


@pytest.fixture(scope="package", params=["haproxy", "nginx"])
def balancer(request: pytest.FixtureRequest, replicas: list[Replica],
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Balancer]:
    lb = Balancer(request.param, tmp_path_factory.mktemp("lb"))
    lb.start()
    try:
        yield lb
    finally:
        lb.stop()


def _back_in_rotation(balancer: Balancer) -> None:
    """HAProxy: two passing health checks (rise 2, inter 500 ms). nginx (passive checks only):
    a reload (SIGHUP) starts workers with no failure marks, rather than waiting out fail_timeout
    (10 s); the old workers finish the connections they hold."""
    if balancer.kind == "haproxy":
        time.sleep(1.5)
        return
    assert balancer.proc is not None
    os.kill(balancer.proc.pid, signal.SIGHUP)
    time.sleep(0.5)


@pytest.fixture
def live(replicas: list[Replica], balancer: Balancer) -> list[Replica]:
    """Every replica up and, for the balancer, in rotation again (after a test lost one)."""
    waited = False
    for r in replicas:
        if not r.alive() or not r.up:
            if not r.alive():
                r.launch()
            r.wait_up()
            waited = True
    if waited:
        _back_in_rotation(balancer)
    return replicas


@pytest.fixture
def running(replicas: list[Replica], balancer: Balancer) -> list[Replica]:
    """The replicas, some perhaps still starting again after a test lost them (the balancer keeps
    new sessions off them until they answer): for tests that need one replica or two."""
    up = [r for r in replicas if r.alive() and r.up]
    assert len(up) >= 2, "two replicas in rotation"
    return replicas

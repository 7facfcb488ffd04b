"""Issue 33: no process outlives its gateway. ``kill -9`` of a real ``voicegw serve`` (vLLM on CPU,
the tiny checkpoint) once healthy: every process it started (engine core, its worker, the decoder,
multiprocessing's resource tracker; the gateway processes of a group) is gone within 2 s
(``engine.lifeline``), and a new ``voicegw serve`` on the same port comes up healthy and removes
the dead run's shared-memory files (``engine.shm.remove_stale``).

One vLLM engine at a time on the 2-core CI host: ``flock /tmp/voicegw-heavy.lock pytest
tests/reliability/test_kill9.py``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import psutil
import pytest

from engine.shm import shm_dir
from tests.groupdiag import log_tail, spy_group

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(os.environ.get("VOICEGW_TEST_ENGINE", "vllm") != "vllm", reason="vLLM engine tests"),
]

#: The promise: every descendant gone this long after the SIGKILL.
GONE_WITHIN_S = 2.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _health(port: int) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
            return dict(orjson.loads(r.read()))
    except Exception:
        return None


def _start(model_dir: Path, port: int, processes: int, log: Path, timeout_s: float = 300.0) -> subprocess.Popen[bytes]:
    """``voicegw serve`` in a session of its own (the test's fallback cleanup kills that process
    group), returned once ``/healthz`` is healthy from every gateway process."""
    args = [
        sys.executable, "-m", "voicegw.cli", "serve", "--gateway.port", str(port),
        "--gateway.processes", str(processes), "--gateway.shutdown_grace_s", "2",
        "--engine.backend", "vllm", "--engine.device", "cpu", "--engine.model_dir", str(model_dir),
        "--engine.max_num_seqs", "16", "--engine.max_model_len", "512", "--engine.enforce_eager", "true",
        "--engine.kv_cache_gib", "0.05", "--engine.default_speaker", "2222",
    ]
    out = log.open("ab")
    proc = subprocess.Popen(args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=out, stderr=out, start_new_session=True)
    pids: set[int] = set()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"serve exited {proc.returncode}:\n{log_tail(log)}")
            h = _health(port)
            if h is not None and h.get("healthy"):
                pids.add(int(h["pid"]))
                if len(pids) >= processes:
                    return proc
            time.sleep(0.2)
        raise AssertionError(f"not healthy in {timeout_s:.0f} s:\n{log_tail(log)}\n{spy_group(proc.pid)}")
    except BaseException:
        _cleanup(proc)
        raise


def _cleanup(proc: subprocess.Popen[bytes]) -> None:
    """Whatever is left of the test's own process group (a failed assertion must not leave an
    engine running for the tests after it)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _describe(p: psutil.Process) -> str:
    try:
        return f"{p.pid} {' '.join(p.cmdline())[:70] or p.name()}"
    except psutil.Error:
        return f"{p.pid} (gone)"


def _our_shm_files(pid: int) -> set[str]:
    return {f.name for f in shm_dir().iterdir() if f.name.startswith("voicegw-") and f"-{pid}-" in f.name}


def _kill9_and_restart(model_dir: Path, tmp_path: Path, processes: int, expect: int) -> None:
    port = _free_port()
    log = tmp_path / "serve.log"
    proc = _start(model_dir, port, processes, log)
    second: subprocess.Popen[bytes] | None = None
    try:
        root = psutil.Process(proc.pid)
        before = root.children(recursive=True)
        names = [_describe(p) for p in before]
        print(f"[kill9] serve {proc.pid}, {len(before)} descendants before: {names}", flush=True)
        assert len(before) >= expect, names
        files = _our_shm_files(proc.pid)
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        died: dict[int, float] = {}
        while time.monotonic() - t0 < GONE_WITHIN_S:
            for p in before:
                if p.pid not in died and not _alive(p):
                    died[p.pid] = time.monotonic() - t0
            if len(died) == len(before):
                break
            time.sleep(0.02)
        left = [_describe(p) for p in before if _alive(p)]
        print(f"[kill9] {len(before) - len(left)} of {len(before)} gone, the last after "
              f"{max(died.values(), default=0):.2f} s; alive {GONE_WITHIN_S:.0f} s after the kill: {left}", flush=True)
        assert not left, f"alive {GONE_WITHIN_S} s after kill -9 of serve: {left}"

        # the same port at once: healthy; the dead run's shared-memory files removed
        t1 = time.monotonic()
        second = _start(model_dir, port, processes, tmp_path / "serve2.log")
        print(f"[kill9] restarted on port {port}, healthy in {time.monotonic() - t1:.1f} s", flush=True)
        assert files, "the dead run had no shared-memory file"
        assert not _our_shm_files(proc.pid), f"left behind: {_our_shm_files(proc.pid)}"
        logs = "".join(f.read_text() for f in tmp_path.glob("serve2*.log"))  # a retried start's too
        assert "left by a run that died" in logs
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) == 0
    finally:
        _cleanup(proc)
        if second is not None:
            _cleanup(second)


def test_kill9_of_serve_leaves_no_process_and_a_restart_on_the_port_is_healthy(tiny_model_dir: Path, tmp_path: Path) -> None:
    """One gateway process: the engine core, its worker, the decoder, the resource tracker."""
    _kill9_and_restart(tiny_model_dir, tmp_path, processes=1, expect=4)


def test_kill9_of_a_group_launcher_leaves_no_process_and_a_restart_is_healthy(tiny_model_dir: Path, tmp_path: Path) -> None:
    """``gateway.processes`` 2: the gateway processes (which would keep the port), the engine core,
    its worker, the decoder, the resource tracker."""
    _kill9_and_restart(tiny_model_dir, tmp_path, processes=2, expect=6)

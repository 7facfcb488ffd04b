"""``kill -9`` of a real ``voicegw serve`` and a restart on its port (issue 33), for
``tests/reliability/test_kill9.py`` (one gateway process) and ``tests/engine/test_group.py`` (a
group's launcher): every process it started is gone within ``GONE_WITHIN_S``
(``engine.lifeline``), and a new ``voicegw serve`` on the same port comes up healthy and removes
the dead run's shared-memory files (``engine.shm.remove_stale``)."""

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

from engine.shm import shm_dir
from tests.groupdiag import log_tail, spy_group

ROOT = Path(__file__).resolve().parents[2]

#: The promise: every descendant gone this long after the SIGKILL.
GONE_WITHIN_S = 2.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def health(port: int) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
            return dict(orjson.loads(r.read()))
    except Exception:
        return None


def start_serve(model_dir: Path, port: int, processes: int, log: Path, timeout_s: float = 300.0,
                extra: tuple[str, ...] = (), env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``voicegw serve`` in a session of its own (the test's fallback cleanup kills that process
    group), returned once ``/healthz`` is healthy from every gateway process; ``extra``: more
    arguments, ``env``: more environment."""
    args = [
        sys.executable, "-m", "voicegw.cli", "serve", "--gateway.port", str(port),
        "--gateway.processes", str(processes), "--gateway.shutdown_grace_s", "2",
        "--engine.backend", "vllm", "--engine.device", "cpu", "--engine.model_dir", str(model_dir),
        "--engine.max_num_seqs", "16", "--engine.max_model_len", "512", "--engine.enforce_eager", "true",
        "--engine.kv_cache_gib", "0.05", "--engine.default_speaker", "2222", *extra,
    ]
    out = log.open("ab")
    proc = subprocess.Popen(args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                            stdout=out, stderr=out, start_new_session=True)
    pids: set[int] = set()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"serve exited {proc.returncode}:\n{log_tail(log)}")
            h = health(port)
            if h is not None and h.get("healthy"):
                pids.add(int(h["pid"]))
                if len(pids) >= processes:
                    return proc
            time.sleep(0.2)
        raise AssertionError(f"not healthy in {timeout_s:.0f} s:\n{log_tail(log)}\n{spy_group(proc.pid)}")
    except BaseException:
        cleanup(proc)
        raise


def cleanup(proc: subprocess.Popen[bytes]) -> None:
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


def kill9_and_check(pid: int, expect: int) -> set[str]:
    """SIGKILL ``voicegw serve`` ``pid`` (the launcher alone) and assert that every process it had
    started (at least ``expect``) is gone within ``GONE_WITHIN_S``; returns the dead run's
    shared-memory files (for ``restart_after_kill9``)."""
    root = psutil.Process(pid)
    before = root.children(recursive=True)
    names = [_describe(p) for p in before]
    print(f"[kill9] serve {pid}, {len(before)} descendants before: {names}", flush=True)
    assert len(before) >= expect, names
    files = _our_shm_files(pid)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
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
    return files


def restart_after_kill9(model_dir: Path, port: int, processes: int, tmp_path: Path, dead_pid: int,
                        files: set[str], extra: tuple[str, ...] = (),
                        env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """A new ``voicegw serve`` on the dead one's port (``extra`` arguments, ``env``), healthy; it
    removed the dead run's shared-memory files. The caller stops it."""
    t1 = time.monotonic()
    second = start_serve(model_dir, port, processes, tmp_path / "serve2.log", extra=extra, env=env)
    print(f"[kill9] restarted on port {port}, healthy in {time.monotonic() - t1:.1f} s", flush=True)
    assert files, "the dead run had no shared-memory file"
    assert not _our_shm_files(dead_pid), f"left behind: {_our_shm_files(dead_pid)}"
    logs = "".join(f.read_text() for f in tmp_path.glob("serve2*.log"))
    assert "left by a run that died" in logs
    return second



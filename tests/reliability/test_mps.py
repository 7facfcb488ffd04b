"""``voicegw.mps``: the MPS daemon ``voicegw serve`` starts for its GPU processes, driven through a
stand-in for ``nvidia-cuda-mps-control`` (``fake_mps/``; no GPU on the test hosts): it starts and
the environment points at it, it quits with its server, it dies with a ``kill -9``'d owner and
leaves no process, a dead one is started again, and without the program it is skipped or refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability.mps_stub import logged_pids, mps_env
from voicegw import mps

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """The stand-in on PATH, no MPS set up, a temporary directory of this test's own."""
    for k, v in mps_env(tmp_path).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr("tempfile.tempdir", None)
    keys = (mps.PIPE_ENV, mps.LOG_ENV, "PYTHONPATH", "VOICEGW_VLLM_BOOT")
    saved = {k: os.environ.pop(k) for k in keys if k in os.environ and k != "PYTHONPATH"}
    saved_path = os.environ.get("PYTHONPATH")
    yield
    for k in keys:
        os.environ.pop(k, None)
    os.environ.update(saved)
    if saved_path is not None:
        os.environ["PYTHONPATH"] = saved_path


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _pids(log_dir: Path, timeout_s: float = 5.0) -> tuple[int, int]:
    """(daemon, server) of the stand-in's newest start."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = logged_pids(log_dir)
        if pids:
            return pids[-1]
        time.sleep(0.02)
    raise AssertionError(f"the daemon logged no pids in {log_dir}")


def _gone(pids: list[int], within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.02)
    return [p for p in pids if _alive(p)]


def test_start_points_the_environment_at_the_daemon_and_stop_quits_it_with_its_server(fake_path: None) -> None:
    m = mps.start(required=True)
    assert m is not None and m.keeper is not None
    try:
        assert (m.pipe_dir / "control").exists()
        assert os.environ[mps.PIPE_ENV] == str(m.pipe_dir) and os.environ[mps.LOG_ENV] == str(m.log_dir)
        daemon, server = _pids(m.log_dir)
        assert m.poll() is None and _alive(daemon) and _alive(server)
    finally:
        m.stop()
    assert m.keeper.returncode == 0
    assert not _gone([m.keeper.pid, daemon, server], 2.0)
    assert not m.root.exists()


def test_terminal_signals_leave_the_daemon_to_outlive_the_gateways_drain(fake_path: None) -> None:
    """A Ctrl-C reaches the whole process group: the daemon must serve the GPU processes until
    ``voicegw serve`` stops it, after their drain."""
    m = mps.start(required=True)
    assert m is not None and m.keeper is not None
    try:
        daemon, server = _pids(m.log_dir)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            os.kill(m.keeper.pid, sig)
            os.kill(daemon, sig)
        time.sleep(0.5)
        assert m.poll() is None and _alive(daemon) and _alive(server)
    finally:
        m.stop()
    assert m.keeper.returncode == 0
    assert not _gone([daemon, server], 2.0)


def test_a_dead_daemon_is_started_again_on_the_same_directories(fake_path: None) -> None:
    m = mps.start(required=True)
    assert m is not None
    try:
        daemon, server = _pids(m.log_dir)
        os.kill(daemon, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while m.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert m.poll() == 1, "the keeper did not report the daemon's death"
        assert not _gone([server], 2.0), "the dead daemon's server was left behind"
        # by now the group has prepared vLLM: its boot must not reach the keeper (it would import
        # torch and vLLM before starting the daemon, seconds on a loaded host)
        from engine.vllm._env import BOOT_FLAG, child_env

        os.environ.update(child_env())
        assert os.environ[BOOT_FLAG] == "1"
        m.restart()
        assert m.keeper is not None
        with open(f"/proc/{m.keeper.pid}/environ", "rb") as f:
            assert BOOT_FLAG.encode() not in f.read()
        daemon2, server2 = _pids(m.log_dir)
        assert daemon2 != daemon and _alive(daemon2) and (m.pipe_dir / "control").exists()
    finally:
        m.stop()
    assert not _gone([daemon2, server2], 2.0)


_OWNER = """
import sys, time
from engine.lifeline import mark_root
from tests.reliability.mps_stub import logged_pids, mps_env
from voicegw import mps
mark_root()
m = mps.start(required=True)
print(m.keeper.pid, m.root, flush=True)
time.sleep(60)
"""


def test_kill9_of_its_owner_leaves_no_daemon_and_the_next_start_removes_its_directories(fake_path: None) -> None:
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                             stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        keeper_s, root_s = owner.stdout.readline().split()
        root = Path(root_s)
        daemon, server = _pids(root / "log")
        owner.kill()
        owner.wait()
        left = _gone([int(keeper_s), daemon, server], 2.0)
        assert not left, f"alive 2 s after kill -9 of their owner: {left}"
        assert root.exists()
        assert mps.remove_stale() == [str(root)]
        assert not root.exists()
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def test_without_the_program_it_is_skipped_unless_required_and_mps_set_up_already_is_used(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(mps.PIPE_ENV, raising=False)
    assert mps.start(required=False) is None
    with pytest.raises(mps.MpsError, match="nvidia-cuda-mps-control on PATH"):
        mps.start(required=True)
    monkeypatch.setenv(mps.PIPE_ENV, str(tmp_path))
    assert mps.start(required=True) is None

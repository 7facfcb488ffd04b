"""``engine.lifeline`` and ``engine.shm.remove_stale`` without an engine (fast): a chain of armed
processes dies with its root, whichever thread started it; a dead run's shared-memory files go,
a live one's and other files stay. The real ``voicegw serve`` under ``kill -9``: test_kill9.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from engine.shm import remove_stale

ROOT = Path(__file__).resolve().parents[2]

# The root starts a child from a worker thread that then ends (where PR_SET_PDEATHSIG alone would
# kill the child at once), the child starts a grandchild; both arm. Prints the two pids.
_ROOT_SCRIPT = textwrap.dedent("""
    import os, subprocess, sys, threading, time
    from engine.lifeline import mark_root
    mark_root()
    CHILD = '''
    import os, subprocess, sys, time
    from engine.lifeline import arm, child_env
    arm()
    g = subprocess.Popen([sys.executable, "-c", "from engine.lifeline import arm; arm(); import time; time.sleep(60)"],
                         env={**os.environ, **child_env()})
    print(os.getpid(), g.pid, flush=True)
    time.sleep(60)
    '''
    out = []
    def start():
        out.append(subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True))
    t = threading.Thread(target=start); t.start(); t.join()  # the spawning thread is gone now
    print(out[0].stdout.readline().strip(), flush=True)
    time.sleep(60)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_armed_processes_die_with_their_root_even_when_started_from_a_thread() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    root = subprocess.Popen([sys.executable, "-c", _ROOT_SCRIPT], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert root.stdout is not None
        child, grandchild = (int(x) for x in root.stdout.readline().split())
        time.sleep(0.5)  # longer than the poll: the thread that started the child has long ended
        assert _alive(child) and _alive(grandchild)
        root.send_signal(signal.SIGKILL)
        root.wait()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and (_alive(child) or _alive(grandchild)):
            time.sleep(0.05)
        assert not _alive(child) and not _alive(grandchild)
    finally:
        root.kill()
        root.wait()


def test_a_child_whose_parent_died_before_it_armed_exits_at_once() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer exists: "the parent that started me" died before arm()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VOICEGW_LIFELINE": str(dead.pid)}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", "from engine.lifeline import arm; arm(); import time; time.sleep(30)"],
                       env=env, timeout=20)
    assert r.returncode == -signal.SIGKILL and time.monotonic() - t0 < 10


def test_only_dead_owners_shared_memory_files_are_removed(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    names = {
        "dead": f"voicegw-frames-{gone.pid}-0123456789ab",
        "dead_audio": f"voicegw-audio-{gone.pid}-ba9876543210",
        "live": f"voicegw-frames-{os.getppid()}-0123456789ab",
        "mine": f"voicegw-audio-{os.getpid()}-0123456789ab",
        "other": f"psm_{gone.pid}",
        "odd": f"voicegw-frames-{gone.pid}-notahexsuffix",
    }
    for n in names.values():
        (tmp_path / n).write_bytes(b"x")
    removed = sorted(Path(p).name for p in remove_stale(tmp_path))
    assert removed == sorted([names["dead"], names["dead_audio"]])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(v for k, v in names.items() if not k.startswith("dead"))


def test_a_child_forked_by_the_root_arms_and_dies_with_it() -> None:
    """vLLM's ``fork`` start method (its default on CUDA): no ``sitecustomize`` in the child."""
    script = textwrap.dedent("""
        import os, time
        from engine.lifeline import mark_root
        mark_root()
        pid = os.fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        print(pid, flush=True)
        time.sleep(60)
    """)
    root = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert root.stdout is not None
        child = int(root.stdout.readline())
        root.send_signal(signal.SIGKILL)
        root.wait()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        root.kill()
        root.wait()

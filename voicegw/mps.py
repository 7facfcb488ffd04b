"""CUDA MPS for the GPU processes of one ``voicegw serve`` (``gateway.cuda_mps``).

Without MPS the GPU runs one CUDA context at a time: the engine cores and the decoder processes
take turns (time-slicing), and each turn costs the others. Under one MPS server their kernels run
on the GPU at the same time. ``voicegw serve`` starts an MPS control daemon of its own, with pipe
and log directories of its own, before it starts any other process; every process it starts
inherits ``CUDA_MPS_PIPE_DIRECTORY`` and connects to it when it first uses CUDA (bench/RESULTS.md
has the same-call measurements; docs/gpu.md says when to turn it off).

```
 voicegw serve
   └── MPS keeper (python -m voicegw.mps; armed by engine.lifeline; a child subreaper)
         └── nvidia-cuda-mps-control -f      (this run's pipe and log directories)
               └── nvidia-cuda-mps-server    (started by the daemon for the first CUDA client)
```

* **Start** (:func:`start`): a keeper process starts the daemon in the foreground; :func:`start`
  returns once the daemon's control socket exists, and has set the two directories in this
  process's environment, for every process started after it.
* **MPS set up already** (``CUDA_MPS_PIPE_DIRECTORY`` in the environment, a system-wide daemon,
  say): used as it is, nothing started.
* **Stop** (:meth:`Mps.stop`, after the GPU processes have stopped): the keeper's stdin is closed;
  it sends ``quit`` to the daemon (the daemon stops its server) and exits; the directories are
  removed. The keeper and the daemon ignore SIGINT, SIGTERM and SIGHUP: a Ctrl-C in a terminal
  reaches the whole process group, and the daemon must outlive the gateways' drain.
* **``kill -9`` of serve**: the keeper's lifeline SIGKILLs its descendants (the daemon and its
  server, kept below the keeper as a child subreaper) and itself; the next start removes the
  directories of runs whose owner is dead (:func:`remove_stale`).
* **Death of the daemon mid-run**: ``voicegw.group``'s supervisor starts a new one on the same
  directories (:meth:`Mps.restart`), within its restart budget. A CUDA process that finds no
  daemon runs without MPS (the driver's own fallback).

Linux only, like MPS.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger("voicegw")

#: The daemon's program (the NVIDIA driver's compute utilities).
BINARY = "nvidia-cuda-mps-control"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
#: How long :func:`start` waits for the daemon's control socket.
START_TIMEOUT_S = 10.0
#: How long the keeper waits for the daemon to quit before it SIGKILLs it and its server.
QUIT_TIMEOUT_S = 10.0

_NAME = re.compile(r"voicegw-mps-(?P<pid>\d+)-([0-9a-f]{12})")
_PR_SET_CHILD_SUBREAPER = 36


class MpsError(RuntimeError):
    """The MPS daemon could not be started."""


class Mps:
    """This run's MPS daemon (:func:`start`): its directories and its keeper process."""

    def __init__(self, root: Path, binary: str) -> None:
        self.root = root
        self.binary = binary
        self.pipe_dir = root / "pipe"
        self.log_dir = root / "log"
        self.keeper: subprocess.Popen[bytes] | None = None

    def env(self) -> dict[str, str]:
        """The variables that point a CUDA process at this daemon."""
        return {PIPE_ENV: str(self.pipe_dir), LOG_ENV: str(self.log_dir)}

    def _spawn(self) -> None:
        from engine.lifeline import ENV
        from engine.vllm._env import BOOT_FLAG

        # the keeper's lifeline without PR_SET_PDEATHSIG: its watchdog, not the kernel, must kill it,
        # so that it SIGKILLs the daemon's server first (the kernel would orphan the server); and
        # without vLLM's boot (set once the engine is prepared: a restart would import torch and
        # vLLM first, seconds on a loaded host, before the daemon starts)
        env = {k: v for k, v in os.environ.items() if k != BOOT_FLAG}
        self.keeper = subprocess.Popen(
            [sys.executable, "-m", "voicegw.mps", self.binary, str(self.pipe_dir), str(self.log_dir)],
            env={**env, ENV: str(os.getpid())}, stdin=subprocess.PIPE)
        deadline = time.monotonic() + START_TIMEOUT_S
        socket = self.pipe_dir / "control"
        while not socket.exists():
            if self.keeper.poll() is not None:
                raise MpsError(f"{self.binary} exited with {self.keeper.returncode} at its start "
                               f"(its log: {self.log_dir})")
            if time.monotonic() > deadline:
                self._kill()
                raise MpsError(f"{self.binary} did not open {socket} in {START_TIMEOUT_S:.0f} s")
            time.sleep(0.02)

    def poll(self) -> int | None:
        """None while the daemon's keeper runs, else its exit code."""
        return None if self.keeper is None else self.keeper.poll()

    def restart(self) -> None:
        """A new daemon on the same directories, after the last one died."""
        self._kill()
        with contextlib.suppress(FileNotFoundError):
            (self.pipe_dir / "control").unlink()
        self._spawn()

    def stop(self) -> None:
        """Quit the daemon (and its server), remove the directories."""
        if self.keeper is not None and self.keeper.poll() is None:
            assert self.keeper.stdin is not None
            self.keeper.stdin.close()  # the keeper's signal to quit
            try:
                self.keeper.wait(QUIT_TIMEOUT_S + 5)
            except subprocess.TimeoutExpired:
                self._kill()
        shutil.rmtree(self.root, ignore_errors=True)

    def _kill(self) -> None:
        """SIGKILL what runs below the keeper (the daemon, its server), then the keeper."""
        from engine.lifeline import kill_descendants

        if self.keeper is not None and self.keeper.poll() is None:
            kill_descendants(self.keeper.pid)
            self.keeper.kill()
            self.keeper.wait()
        if self.keeper is not None and self.keeper.stdin is not None:
            self.keeper.stdin.close()


def start(*, required: bool) -> Mps | None:
    """Start this run's MPS daemon and point this process's environment at it (see the module
    docstring). None when MPS is set up already, or when ``nvidia-cuda-mps-control`` is not on PATH
    and not ``required`` (a warning says so). Raises :class:`MpsError` when it cannot start."""
    if os.environ.get(PIPE_ENV):
        log.info("CUDA MPS: using the daemon at %s=%s", PIPE_ENV, os.environ[PIPE_ENV])
        return None
    binary = shutil.which(BINARY)
    if binary is None:
        if required:
            raise MpsError(f"gateway.cuda_mps needs {BINARY} on PATH (the NVIDIA driver's compute utilities)")
        log.warning("CUDA MPS: %s is not on PATH; the GPU processes take turns on the GPU "
                    "(gateway.cuda_mps false silences this; docs/gpu.md)", BINARY)
        return None
    for path in remove_stale():
        log.info("removed %s, left by a run that died", path)
    root = Path(tempfile.gettempdir()) / f"voicegw-mps-{os.getpid()}-{secrets.token_hex(6)}"
    mps = Mps(root, binary)
    mps.pipe_dir.mkdir(parents=True, mode=0o700)
    mps.log_dir.mkdir(mode=0o700)
    try:
        mps._spawn()
    except BaseException:
        mps.stop()
        raise
    os.environ.update(mps.env())
    log.info("CUDA MPS: daemon started (keeper pid %d, %s=%s)", mps.keeper.pid if mps.keeper else -1,
             PIPE_ENV, mps.pipe_dir)
    return mps


def remove_stale(directory: Path | None = None) -> list[str]:
    """Remove the directories :func:`start` made for runs whose owner pid no longer exists (a run
    killed by SIGKILL leaves them behind); returns the paths removed."""
    from engine.lifeline import left_by_dead

    removed: list[str] = []
    for entry in left_by_dead(directory or Path(tempfile.gettempdir()), _NAME):
        if not entry.is_dir(follow_symlinks=False):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


def _keep(binary: str, pipe_dir: str, log_dir: str) -> int:
    """The keeper process: runs the daemon in the foreground until its stdin ends (then ``quit``)
    or the daemon exits; 0 after a quit, else the daemon's exit code (1 for a signal)."""
    from engine.lifeline import arm, kill_descendants, prctl, set_pdeathsig

    arm()  # serve dies -> this process SIGKILLs its descendants (the daemon, its server), then itself
    prctl(_PR_SET_CHILD_SUBREAPER, 1)  # a server that the daemon double-forks stays below this process
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # ignored by the daemon too (exec keeps it)
        signal.signal(s, signal.SIG_IGN)
    stop = threading.Event()

    def until_eof() -> None:  # os.read: no buffered reader's lock left held at the interpreter's exit
        while os.read(0, 4096):
            pass
        stop.set()

    threading.Thread(target=until_eof, daemon=True).start()
    env = {**os.environ, PIPE_ENV: pipe_dir, LOG_ENV: log_dir}
    with open(Path(log_dir) / "keeper.log", "ab") as out:
        daemon = subprocess.Popen([binary, "-f"], env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                  preexec_fn=set_pdeathsig)
        while daemon.poll() is None and not stop.wait(0.1):
            pass
        if stop.is_set() and daemon.poll() is None:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                subprocess.run([binary], input=b"quit\n", env=env, stdout=out, stderr=out, timeout=QUIT_TIMEOUT_S)
            with contextlib.suppress(subprocess.TimeoutExpired):
                daemon.wait(QUIT_TIMEOUT_S)
    kill_descendants(os.getpid())  # what did not quit: the daemon, its server
    daemon.wait()
    with contextlib.suppress(ChildProcessError):  # a subreaper's adopted children
        while os.waitpid(-1, 0)[0]:
            pass
    if stop.is_set():
        return 0
    return daemon.returncode if daemon.returncode > 0 else 1


if __name__ == "__main__":
    sys.exit(_keep(*sys.argv[1:4]))

"""No process outlives the ``voicegw serve`` that started it, however that process died (SIGKILL
included): every process of ours and of vLLM's calls :func:`arm` at its start.

The mechanism, per child process:

* **A watchdog thread polling ``os.getppid()``** (every :data:`POLL_S`): when the parent process
  is gone the child is re-parented (to PID 1 or a sub-reaper), ``getppid()`` changes, and the
  child SIGKILLs its descendants, then itself (the descendants are armed too and would follow
  one poll later per level, but under load every level adds a scheduling delay).
  This is the mechanism that always runs because it is immune to where the child was started
  from: ``prctl(PR_SET_PDEATHSIG)`` fires when the parent *thread* that forked the child exits,
  not the parent process, and vLLM's engine core is started from a worker thread
  (``VllmCodeEngine.start`` constructs ``AsyncLLM`` in ``asyncio.to_thread``; a restart does it
  again from another thread): PDEATHSIG there would kill a healthy engine core the day that
  thread ends. ``getppid()`` names the parent process, whichever of its threads forked.
* **``PR_SET_PDEATHSIG`` = SIGKILL in addition, where the parent says it is safe**: a parent that
  starts the child from its main thread (the thread that lives as long as the process) marks the
  environment it hands over (:func:`child_env` with the ``:main`` suffix, computed at the spawn).
  The kernel then kills the child at once, even while its Python is stuck in C code holding the
  GIL (where the watchdog thread cannot run).
* **The start-up race**: the parent may die between the fork and :func:`arm`. The parent's pid
  travels in ``VOICEGW_LIFELINE``; when the child's ``getppid()`` differs and that pid no longer
  exists, the parent died already and the child exits at once. (A pid that exists but is not
  the parent: an intermediate process started the child, which then watches its actual parent.)
  :func:`arm` rewrites the variable with the child's own pid, for the grandchildren.

``voicegw serve`` itself is not armed (its parent is a shell or a service manager); it sets
``VOICEGW_LIFELINE`` to its pid (:func:`mark_root`) so that the processes it starts, directly
or through vLLM, can check the race above. Children forked (``os.fork``, no exec: vLLM's
``fork`` start method, its default on CUDA while CUDA is not initialised) of the root or of an
armed process arm through ``os.register_at_fork`` (no ``sitecustomize`` runs, no thread survives
a fork). ``subprocess`` and multiprocessing's ``spawn`` run no fork hooks: their children arm
at their start (``sitecustomize``, the decoder's entry).

multiprocessing's resource tracker is not armed: it exits by itself once every process holding
its pipe is gone, *after* removing what they leaked (named semaphores, shared memory).

Linux only (``prctl``, re-parenting); elsewhere the watchdog thread still runs. Standard library
only: this runs in ``sitecustomize`` of every process vLLM spawns.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time

#: Environment variable: ``<pid of the parent>`` or ``<pid>:main`` (started from its main thread).
ENV = "VOICEGW_LIFELINE"
#: Watchdog poll period (seconds); a chain of three processes follows within ~3 periods.
POLL_S = 0.1
_PR_SET_PDEATHSIG = 1

_armed_pid: int | None = None
_root_pid: int | None = None


def mark_root() -> None:
    """In ``voicegw serve``: the processes started from here on find this pid in ``ENV``, and
    the ones it forks (vLLM's engine core on CUDA: ``fork`` unless CUDA is initialised) arm."""
    global _root_pid
    _root_pid = os.getpid()
    os.environ[ENV] = str(os.getpid())


def child_env() -> dict[str, str]:
    """``ENV`` for a child started now by this thread (``:main``: PDEATHSIG is safe for it)."""
    main = threading.current_thread() is threading.main_thread()
    return {ENV: f"{os.getpid()}{':main' if main else ''}"}


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (someone else's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def left_by_dead(directory: str | os.PathLike[str], name: re.Pattern[str]) -> list[os.DirEntry[str]]:
    """The entries of ``directory`` whose whole name matches ``name``, an owner pid in its group
    ``pid``, for owners that are neither this process nor alive: what a run killed by SIGKILL left
    behind (``engine.shm.remove_stale``, ``voicegw.mps.remove_stale``). [] where the directory
    cannot be read."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    out = []
    for entry in entries:
        m = name.fullmatch(entry.name)
        if m is not None and int(m.group("pid")) != os.getpid() and not pid_alive(int(m.group("pid"))):
            out.append(entry)
    return out


def sigkill_pending(pid: int) -> bool:
    """Whether process ``pid`` has a SIGKILL pending (``/proc/<pid>/status``: ``ShdPnd`` or
    ``SigPnd``): it never runs another instruction of its own, but the kernel closes its files
    only late in its exit, after its memory is torn down, and a process in uninterruptible sleep
    (D state: I/O, reclaim) takes the signal only when that sleep ends, which on a loaded host
    takes seconds. False when it cannot tell (no such process, no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    bit = 1 << (int(signal.SIGKILL) - 1)
    for line in lines:
        key, _, value = line.partition(":")
        if key in ("ShdPnd", "SigPnd"):
            try:
                if int(value.strip(), 16) & bit:
                    return True
            except ValueError:
                continue
    return False


def descendants(pid: int) -> list[int]:
    """``pid``'s descendants, children first (``/proc/<pid>/task/*/children``; [] without it)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except (OSError, ValueError):
                continue
            out.extend(kids)
            todo.extend(kids)
    return out


def kill_descendants(pid: int) -> None:
    """SIGKILL ``pid``'s descendants (not ``pid``)."""
    for kid in descendants(pid):
        try:
            os.kill(kid, signal.SIGKILL)
        except OSError:
            pass


def _die() -> None:
    """SIGKILL this process's descendants (they would follow one watchdog poll per level; under
    load each level costs a scheduling delay), then this process."""
    kill_descendants(os.getpid())
    os.kill(os.getpid(), signal.SIGKILL)
    os._exit(137)  # not reached


def prctl(option: int, value: int) -> bool:
    """``prctl(option, value)`` for this process (Linux); whether it succeeded."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(option, value, 0, 0, 0) == 0)
    except Exception:  # noqa: BLE001 - callers go on without it
        return False


def set_pdeathsig() -> bool:
    """SIGKILL this process when the thread that started it ends (``PR_SET_PDEATHSIG``)."""
    return prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))


def _watch(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            _die()
        time.sleep(POLL_S)


def arm(*, pdeathsig: bool | None = None) -> None:
    """Die with the parent process (see the module docstring). Idempotent per process.

    ``pdeathsig``: set ``PR_SET_PDEATHSIG``; None: when ``ENV`` says the parent started this
    process from its main thread."""
    global _armed_pid
    if _armed_pid == os.getpid():
        return
    parent = os.getppid()
    value = os.environ.get(ENV, "")
    expected_s, _, how = value.partition(":")
    expected = int(expected_s) if expected_s.isdigit() else None
    if pdeathsig is None:
        pdeathsig = how == "main" and expected == parent
    if pdeathsig:
        set_pdeathsig()
        parent_now = os.getppid()  # PDEATHSIG set after the parent died never fires
        if parent_now != parent:
            _die()
    if expected is not None and parent != expected and not pid_alive(expected):
        _die()  # the parent that started this process died before this line
    _armed_pid = os.getpid()
    os.environ[ENV] = str(os.getpid())
    threading.Thread(target=_watch, args=(parent,), name="voicegw-lifeline", daemon=True).start()


def _after_fork() -> None:
    """A forked child of an armed process or of the root runs no ``sitecustomize`` (no exec)
    and inherits no thread: it arms here (a child that then execs loses the thread harmlessly)."""
    if os.getpid() not in (_armed_pid, _root_pid) and (_armed_pid is not None or _root_pid is not None):
        arm(pdeathsig=False)


os.register_at_fork(after_in_child=_after_fork)

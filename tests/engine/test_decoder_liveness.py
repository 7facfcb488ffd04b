"""``DecoderClient`` against a stand-in decoder process that speaks the wire protocol but never
answers a job: a worker that stops answering, one that dies while another process holds a copy of
its socket end (no EOF ever comes), one the kernel has not finished killing. Each time the pending
push fails ``UNRECOVERABLE`` promptly and ``healthy`` turns false: a session never hangs on its
decoder. No torch, no vLLM: a second or two in all."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest

from engine.api import EngineError, EngineErrorKind
from engine.decoder.client import DecoderClient, DecoderSettings, shared_plan
from engine.lifeline import sigkill_pending

#: The stand-in worker: the ready message (a geometry of 512 samples per step, its pid), then it
#: reads every message and answers none.
SILENT_WORKER = """
import json, os, socket, sys
sk = socket.socket(fileno=int(sys.argv[1]))
ready = {"step_dim": 4, "code_limit": 626, "frames_per_step": 2, "hop": 256, "n_fft": 1024,
         "stage_reaches": [[0, 0]], "lookahead_steps": 0, "pid": os.getpid()}
sk.send(bytes([1]) + json.dumps(ready).encode())
while sk.recv(1 << 20):
    pass
"""


@asynccontextmanager
async def _silent(deadline_s: float, holder: bool = False
                  ) -> AsyncIterator[tuple[DecoderClient, subprocess.Popen[bytes]]]:
    """A client attached (as a gateway process of a group is) to a stand-in worker that never
    answers; ``holder``: a second process keeps a copy of the worker's socket end open."""
    settings = DecoderSettings(model_dir="unused", slots=2, job_deadline_s=deadline_s, start_timeout_s=30)
    shares, theirs, path = shared_plan(settings, 1)
    c = DecoderClient(settings, attach=shares[0])
    try:
        procs = _stand_ins(theirs[0].fileno(), holder)
        theirs[0].close()
        try:
            await c.start()
            yield c, procs[0]
        finally:
            await c.close()
            for p in procs:
                p.kill()
                p.wait()
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _stand_ins(fd: int, holder: bool) -> list[subprocess.Popen[bytes]]:
    """The silent worker on socket ``fd``, and (``holder``) a process that only keeps a copy of it."""
    procs = [subprocess.Popen([sys.executable, "-c", SILENT_WORKER, str(fd)], pass_fds=[fd])]
    if holder:
        procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=[fd]))
    return procs


async def _fails_within(push: asyncio.Task[Any], within_s: float) -> float:
    """Seconds until ``push`` failed ``UNRECOVERABLE`` (a push still waiting after ``within_s``
    is the hang these tests are about)."""
    t0 = time.monotonic()
    with pytest.raises(EngineError) as err:
        await asyncio.wait_for(push, within_s)
    assert err.value.kind is EngineErrorKind.UNRECOVERABLE
    return time.monotonic() - t0


def _push(c: DecoderClient) -> asyncio.Task[Any]:
    return asyncio.create_task(c.open_stream().push(np.zeros((2, 4), np.int64), final=True))


async def test_a_worker_that_stops_answering_is_killed_and_fails_its_streams() -> None:
    async with _silent(deadline_s=0.5) as (c, worker):
        assert c.healthy and c.worker_pid == worker.pid
        took_s = await _fails_within(_push(c), 10)
        assert 0.4 < took_s < 5, took_s
        assert not c.healthy and c.failed is not None and "did not answer" in c.failed
        assert await asyncio.to_thread(worker.wait, 5) == -signal.SIGKILL  # the watchdog replaces it
        with pytest.raises(EngineError):
            c.open_stream()


async def test_a_dead_worker_fails_its_streams_while_its_socket_end_lives_elsewhere() -> None:
    """Another process holds a copy of the worker's socket end, so its death brings no EOF: the
    pidfd of the worker's pid tells (the job deadline, 60 s here, is not what ends the push)."""
    async with _silent(deadline_s=60, holder=True) as (c, worker):
        push = _push(c)
        await asyncio.sleep(0.2)
        worker.kill()
        assert await _fails_within(push, 10) < 5
        assert not c.healthy and c.failed == "decoder process exited"


async def test_a_worker_with_a_sigkill_pending_counts_as_dead(monkeypatch: pytest.MonkeyPatch) -> None:
    """A killed worker in uninterruptible sleep keeps its files open until that sleep ends: the
    pending SIGKILL (``/proc/<pid>/status``, read by ``healthy``) fails its streams at once."""
    import engine.decoder.client as client

    pending: set[int] = set()
    check: Callable[[int], bool] = lambda pid: pid in pending  # noqa: E731 - the kernel's view, staged
    monkeypatch.setattr(client, "sigkill_pending", check)
    async with _silent(deadline_s=60) as (c, worker):
        push = _push(c)
        await asyncio.sleep(0.2)
        assert c.healthy
        pending.add(worker.pid)
        t0 = time.monotonic()
        while c.healthy:  # read at most every KILL_CHECK_S
            assert time.monotonic() - t0 < 1
            await asyncio.sleep(0.01)
        assert await _fails_within(push, 1) < 0.1
        assert c.failed == "decoder process killed"


def test_sigkill_pending_reads_the_kernel() -> None:
    assert not sigkill_pending(os.getpid())
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert not sigkill_pending(p.pid)  # gone: nothing to tell

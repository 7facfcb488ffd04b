"""asyncio edge of the decoder process: ``DecoderClient`` (one per gateway) and ``DecoderStream``.

``start`` creates the shared-memory file of output samples and a ``SOCK_SEQPACKET`` socket pair,
starts ``python -m engine.decoder.worker`` with one end, and waits for its ready message (the
vocoder's geometry, measured there: the gateway process never imports torch for decoding). Each
``DecoderStream`` owns a slot; ``push`` sends the new steps and the emission target and awaits the
reply, then copies the slot's samples out. Replies are read by one reader callback on the event
loop; sends are serialized by a lock.

Bounded: ``slots`` streams at once (``open_stream`` raises a recoverable ``EngineError`` when
none is free), one job in flight per stream, ``out_cap_steps`` steps of samples per job (a larger
emission is cut into several jobs). A stream closed with a job in flight keeps its slot until the
reply arrives, so the worker never writes into a slot its next owner reads.

A dead worker: every pending push fails ``UNRECOVERABLE`` and ``healthy`` turns false, as soon as
the client sees any of three signs. EOF on the socket (the kernel closed the worker's files); the
worker's exit on a pidfd of its pid (the ready message names it; the exit shows even where a copy
of the worker's socket end outlives it in another process); a SIGKILL pending for it (read by
``healthy``: a process in uninterruptible sleep takes the signal, and closes its files, only when
that sleep ends, seconds later on a loaded host). A worker that does not answer a job within
``DecoderSettings.job_deadline_s`` (stuck, or dead with its socket end held open elsewhere) is
killed and fails the same way; the speech engine's watchdog then replaces it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import mmap
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.api import SAMPLES_PER_STEP, EngineError, EngineErrorKind
from engine.decoder.window import DecoderGeometry, Reach
from engine.decoder.worker import (
    FLAG_FINAL,
    FLAG_RESET,
    KIND_JOB,
    KIND_PUSH,
    KIND_READY,
    KIND_STATS,
    KIND_STATS_REPLY,
    MAX_MESSAGE_BYTES,
    REP,
    REQ,
    SOCKET_BUFFER_BYTES,
    STATUS_OK,
)
from engine.lifeline import sigkill_pending
from engine.shm import create_file, map_file, new_path

_log = logging.getLogger(__name__)

_ROOT = str(Path(__file__).resolve().parents[2])
"""The checkout (``engine`` is importable from here in the worker)."""
_PAYLOAD_BYTES = 256 << 10
"""Most input bytes in one message (hidden states are 3 KB per step)."""
_EXIT_WAIT_S = 10.0
"""``close``: how long the worker may take to exit once its socket closed, then to be reaped
once killed (beyond that ``close`` logs it and returns)."""
COUNTERS_REFRESH_S = 0.5
"""``refresh_worker_counters``: shortest time between two requests for the worker's counters."""
KILL_CHECK_S = 0.1
"""``healthy``: shortest time between two reads of the worker's pending signals (``/proc``: tens
of microseconds, and admission control asks for health per request)."""


@dataclass
class DecoderStats:
    jobs: int = 0
    samples: int = 0
    """24 kHz samples received."""


@dataclass
class _Slot:
    index: int
    busy: bool = False
    orphan: bool = False
    """Its stream was closed while a job was in flight: free it when the reply comes."""


@dataclass
class DecoderSettings:
    """What the worker is started with (from ``EngineConfig``; see ``build_decoder``)."""

    model_dir: str
    use_hidden: bool = False
    device: str = "cpu"
    chunk_steps: int = 16
    lookahead_steps: int = -1
    left_steps: int = -1
    """``EngineConfig.decoder_left_steps``."""
    max_batch: int = 64
    slots: int = 128
    max_steps: int = 2048
    torch_threads: int = 1
    dtype: str = "float32"
    """``EngineConfig.decoder_dtype``."""
    compile: bool = False
    """``EngineConfig.decoder_compile``."""
    out_cap_steps: int = 0
    """Steps of samples one job may return (0: 2 x chunk_steps; ``job_cap_steps`` resolves it)."""
    start_timeout_s: float = 600.0
    job_deadline_s: float = 30.0
    """Longest wait for the worker's reply to one job (its send included); past it the worker
    counts as stuck: it is killed and every pending push fails ``UNRECOVERABLE``. A forward takes
    milliseconds to a few hundred (a full batch on a CPU) and a job waits behind a few of them: a
    stream that got no audio for this long is broken for its listener anyway, and a bound this far
    above a loaded host's scheduling stalls never fires during normal work."""
    env: dict[str, str] = field(default_factory=dict)

    @property
    def job_cap_steps(self) -> int:
        """``out_cap_steps``, 0 resolved."""
        return self.out_cap_steps or 2 * self.chunk_steps


class DecoderStream:
    """One utterance's stream. Push steps in order; the last push is ``final``."""

    def __init__(self, client: DecoderClient, slot: _Slot) -> None:
        self._client = client
        self._slot = slot
        self._fresh = True
        self.steps_in = 0
        self.emitted_steps = 0
        self.emitted_samples = 0
        self.closed = False
        self.finished = False
        self._busy = False

    async def push(self, x: np.ndarray, final: bool = False, emit_steps: int | None = None) -> np.ndarray:
        """Send ``x`` (``[n, step_dim]``); return the float32 24 kHz samples of the steps up to
        ``emit_steps`` (all of them when ``final``; ``None``: what the lookahead allows)."""
        if self.closed or self.finished:
            raise EngineError("decoder stream is closed")
        if self._busy:
            raise RuntimeError("DecoderStream.push is not reentrant: await the previous push")
        c = self._client
        c.check_input(x)
        self._busy = True
        try:
            received = self.steps_in + int(x.shape[0])
            if final:
                target = received
            elif emit_steps is None:
                target = received - c.lookahead_steps
            else:
                target = emit_steps
            target = max(self.emitted_steps, min(target, received))
            pieces: list[np.ndarray] = []
            # the inputs first, in messages of bounded size (no emission until the last)
            per_msg = max(1, _PAYLOAD_BYTES // max(1, c.step_dim * c.wire_itemsize))
            sent = 0
            n = int(x.shape[0])
            while True:
                k = min(per_msg, n - sent)
                last_input = sent + k == n
                tgt = min(target, self.emitted_steps + c.out_cap_steps) if last_input else self.emitted_steps
                pieces.append(await self._job(x[sent : sent + k], tgt, final and last_input and tgt == received))
                self.emitted_steps = tgt
                sent += k
                if last_input:
                    break
            self.steps_in = received
            while self.emitted_steps < target or (final and not self.finished):
                tgt = min(target, self.emitted_steps + c.out_cap_steps)
                pieces.append(await self._job(x[:0], tgt, final and tgt == received))
                self.emitted_steps = tgt
            if final:
                self.finished = True
                self.close()
            audio = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
            self.emitted_samples += int(audio.shape[0])
            return audio
        finally:
            self._busy = False

    async def _job(self, x: np.ndarray, target: int, final: bool) -> np.ndarray:
        flags = (FLAG_FINAL if final else 0) | (FLAG_RESET if self._fresh else 0)
        self._fresh = False
        audio = await self._client._submit(self._slot, x, target, flags)
        if final:
            self.finished = True
        return audio

    def close(self) -> None:
        """Forget the stream (no more pushes). Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._client._release(self._slot)


class DecoderClient:
    """See the module docstring. ``start()`` before use, ``close()`` at the end."""

    def __init__(self, settings: DecoderSettings, attach: SharedDecoder | None = None) -> None:
        self.settings = settings
        self.attach = attach
        """Set: use this share of a decoder process another process started (``shared_plan``)."""
        self.geometry: DecoderGeometry | None = None
        self.info: dict[str, Any] = {}
        self.stats = DecoderStats()
        self.failed: str | None = None
        self.out_cap_steps = settings.job_cap_steps
        self._proc: subprocess.Popen[bytes] | None = None
        self.worker_pid: int | None = None
        """The worker's pid (its ready message), once started."""
        self._pidfd: int | None = None
        """A pidfd of the worker (Linux 5.3+): readable once it exited."""
        self._kill_checked_s = -1e9
        self._sock: socket.socket | None = None
        self._mm: mmap.mmap | None = None
        self._out: np.ndarray | None = None
        self._slots = [_Slot(i) for i in range(attach.slots if attach is not None else settings.slots)]
        self._free: deque[_Slot] = deque(self._slots)
        self._pending: dict[int, tuple[_Slot, asyncio.Future[tuple[int, int]]]] = {}
        self._stats_waiters: deque[asyncio.Future[dict[str, Any]]] = deque()
        self.worker_counters: dict[str, float] = {}
        """The worker's counters (``WorkerStats``) as of the last ``refresh_worker_counters`` reply;
        the worker's own totals, the same in every client of a shared decoder process."""
        self._refresh: asyncio.Task[dict[str, Any]] | None = None
        self._refreshed_s = -1e9
        self._ready: asyncio.Future[dict[str, Any]] | None = None
        self._next_job = 1
        self._send_lock = asyncio.Lock()
        self.uses_codes = not settings.use_hidden
        self.step_dim = 0
        self.lookahead_steps = 0
        self.code_limit: int | None = None
        self.wire_itemsize = 2 if self.uses_codes else 4

    # ------------------------------------------------------------------ lifecycle

    @property
    def healthy(self) -> bool:
        """Whether the worker serves. A worker with a SIGKILL pending fails the client here (its
        pending pushes fail at once) rather than when the kernel ends its exit."""
        if self.failed is not None or self._sock is None:
            return False
        if self._proc is not None and self._proc.poll() is not None:
            return False
        now = time.monotonic()
        if self.worker_pid is not None and now - self._kill_checked_s >= KILL_CHECK_S:
            self._kill_checked_s = now
            if sigkill_pending(self.worker_pid):
                self._fail("decoder process killed")
                return False
        return True

    @property
    def _out_cap_samples(self) -> int:
        return self.out_cap_steps * SAMPLES_PER_STEP

    async def start(self) -> None:
        if self._proc is not None or self._sock is not None:
            return
        loop = asyncio.get_running_loop()
        path: str | None = None
        if self.attach is not None:  # a decoder process shared by several gateway processes
            a = self.attach
            mm, flat = map_file(a.shm_path, a.total_slots * a.out_cap_samples * 4, create=False, dtype=np.float32)
            self._mm = mm
            self._out = flat.reshape(a.total_slots, a.out_cap_samples)[a.slot_lo : a.slot_lo + a.slots]
            ours = a.sock
        else:
            path = new_path("audio")
            self._mm, flat = map_file(path, self.settings.slots * self._out_cap_samples * 4, create=True, dtype=np.float32)
            self._out = flat.reshape(self.settings.slots, self._out_cap_samples)
            ours, theirs = _pair()
            try:
                self._proc = spawn_worker(self.settings, [theirs], path, self.settings.slots)
            finally:
                theirs.close()
        ours.setblocking(False)
        self._sock = ours
        self._ready = loop.create_future()
        loop.add_reader(ours.fileno(), self._on_readable)
        try:
            info = await asyncio.wait_for(asyncio.shield(self._ready), self.settings.start_timeout_s)
        except BaseException:
            if path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            await self.close()
            raise
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # both sides have it mapped: nothing is left behind if either dies
        self.info = info
        self._watch_worker(self._proc.pid if self._proc is not None else int(info["pid"]))
        self.step_dim = int(info["step_dim"])
        self.lookahead_steps = int(info["lookahead_steps"])
        self.code_limit = info.get("code_limit")
        self.geometry = DecoderGeometry(
            frames_per_step=int(info["frames_per_step"]),
            stage_reaches=tuple(Reach(int(a), int(b)) for a, b in info["stage_reaches"]),
            n_fft=int(info["n_fft"]), hop=int(info["hop"]),
        )
        if self.geometry.samples_per_step != SAMPLES_PER_STEP:
            await self.close()
            raise EngineError(f"decoder geometry {self.geometry.samples_per_step} samples per step is not supported")

    async def close(self) -> None:
        if self.failed is None:
            self.failed = "decoder closed"  # from here on an EOF is ours, not a crash
        if self._refresh is not None:
            self._refresh.cancel()
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(sock.fileno())
            sock.close()
        self._unwatch_worker()
        self._fail("decoder closed")
        proc, self._proc = self._proc, None
        if proc is not None:
            loop = asyncio.get_running_loop()
            try:
                await asyncio.wait_for(loop.run_in_executor(None, proc.wait), _EXIT_WAIT_S)
            except TimeoutError:
                proc.kill()
                try:  # a killed process in uninterruptible sleep is reaped whenever it leaves it
                    await asyncio.wait_for(loop.run_in_executor(None, proc.wait), _EXIT_WAIT_S)
                except TimeoutError:
                    _log.error("decoder process %d not reaped %g s after SIGKILL", proc.pid, _EXIT_WAIT_S)
        self._out = None
        if self._mm is not None:
            with contextlib.suppress(BufferError):
                self._mm.close()
            self._mm = None

    # ------------------------------------------------------------------ streams

    def open_stream(self) -> DecoderStream:
        if not self.healthy:
            raise EngineError("decoder not running", EngineErrorKind.UNRECOVERABLE)
        if not self._free:
            raise EngineError("decoder: every stream slot is in use")
        return DecoderStream(self, self._free.popleft())

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def check_input(self, x: np.ndarray) -> None:
        """Reject a malformed push before it reaches the worker."""
        sd = self.step_dim
        if not isinstance(x, np.ndarray) or x.ndim != 2 or x.shape[1] != sd:
            raise EngineError(f"decoder input must be an array [n, {sd}], got {getattr(x, 'shape', type(x))}")
        if self.uses_codes:
            if not np.issubdtype(x.dtype, np.integer):
                raise EngineError(f"codes must be integers, got {x.dtype}")
            limit = self.code_limit or 0
            if x.size and (int(x.min()) < 0 or int(x.max()) >= limit):
                raise EngineError(f"code out of range 0..{limit - 1}")
        elif x.size and not np.isfinite(x).all():
            raise EngineError("hidden states contain non-finite values")

    async def worker_stats(self) -> dict[str, Any]:
        """The worker's counters (forwards, rows, busy time, largest batch)."""
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(fut)
        try:
            async with asyncio.timeout(self.settings.job_deadline_s):
                await self._send(REQ.pack(KIND_STATS, 0, 0, 0, 0, 0))
                return await fut
        except TimeoutError:
            raise self._unanswered() from None

    def refresh_worker_counters(self, min_interval_s: float = COUNTERS_REFRESH_S) -> None:
        """Ask the worker for its counters without waiting: the reply updates ``worker_counters``.
        One request at a time, at most one per ``min_interval_s`` (callers such as admission ask
        per request); nothing while the decoder is down or outside an event loop."""
        if not self.healthy or (self._refresh is not None and not self._refresh.done()):
            return
        now = time.monotonic()
        if now - self._refreshed_s < min_interval_s:
            return
        self._refreshed_s = now
        try:
            self._refresh = asyncio.get_running_loop().create_task(self.worker_stats(), name="decoder counters")
        except RuntimeError:
            return
        self._refresh.add_done_callback(self._got_counters)

    def _got_counters(self, task: asyncio.Task[dict[str, Any]]) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        self.worker_counters = {k: float(v) for k, v in task.result().items() if isinstance(v, int | float)}

    # ------------------------------------------------------------------ internals

    def _release(self, slot: _Slot) -> None:
        if slot.busy:
            slot.orphan = True
        else:
            self._free.append(slot)

    async def _send(self, msg: bytes) -> None:
        sock = self._sock
        if sock is None or self.failed is not None:
            raise EngineError("decoder not running", EngineErrorKind.UNRECOVERABLE)
        async with self._send_lock:
            await asyncio.get_running_loop().sock_sendall(sock, msg)

    async def _submit(self, slot: _Slot, x: np.ndarray, target: int, flags: int) -> np.ndarray:
        if self.failed is not None or self._sock is None:
            raise EngineError("decoder not running", EngineErrorKind.UNRECOVERABLE)
        job = self._next_job
        self._next_job = (job + 1) & 0xFFFFFFFF or 1
        wire = np.ascontiguousarray(x, dtype=np.int16 if self.uses_codes else np.float32)
        msg = REQ.pack(KIND_PUSH, flags, job, slot.index, int(x.shape[0]), int(target)) + wire.tobytes()
        fut: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()
        self._pending[job] = (slot, fut)
        slot.busy = True
        try:
            async with asyncio.timeout(self.settings.job_deadline_s):
                try:
                    await self._send(msg)
                except BaseException:
                    self._pending.pop(job, None)
                    slot.busy = False
                    raise
                status, samples = await fut
        except TimeoutError:
            raise self._unanswered() from None
        if status != STATUS_OK:
            raise EngineError("decoder rejected the input" if status == 1 else "decoder forward failed")
        assert self._out is not None
        audio = self._out[slot.index, :samples].copy()
        self.stats.jobs += 1
        self.stats.samples += samples
        return audio

    def _on_readable(self) -> None:
        sock = self._sock
        if sock is None:
            return
        while True:
            try:
                msg = sock.recv(MAX_MESSAGE_BYTES)
            except BlockingIOError:
                return
            except OSError:
                msg = b""
            if not msg:
                self._fail("decoder process exited")
                with contextlib.suppress(Exception):
                    asyncio.get_running_loop().remove_reader(sock.fileno())
                return
            kind = msg[0]
            if kind == KIND_JOB:
                _, status, job, samples = REP.unpack_from(msg)
                entry = self._pending.pop(job, None)
                if entry is None:
                    continue
                slot, fut = entry
                slot.busy = False
                if slot.orphan:
                    slot.orphan = False
                    self._free.append(slot)
                if not fut.done():
                    fut.set_result((status, samples))
            elif kind == KIND_READY:
                if self._ready is not None and not self._ready.done():
                    self._ready.set_result(json.loads(msg[1:]))
            elif kind == KIND_STATS_REPLY:
                if self._stats_waiters:
                    w = self._stats_waiters.popleft()
                    if not w.done():
                        w.set_result(json.loads(msg[1:]))

    def _unanswered(self) -> EngineError:
        """A job (or counters request) the worker did not answer within ``job_deadline_s``: kill
        the worker (for a share: the launcher replaces it), fail the client; the error to raise."""
        why = f"decoder process did not answer within {self.settings.job_deadline_s:g} s: killed"
        self._fail(why)
        with contextlib.suppress(OSError):
            if self._proc is not None:
                self._proc.kill()
            elif self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        return EngineError(why, EngineErrorKind.UNRECOVERABLE)

    def _watch_worker(self, pid: int) -> None:
        """Fail the client when process ``pid`` (the worker) exits, whoever else holds a copy of its
        socket end (a pidfd on the event loop; without pidfds the socket's EOF alone tells)."""
        self.worker_pid = pid
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # exited and reaped already (a share's worker: by the launcher)
            self._fail("decoder process exited")
            return
        except OSError:  # no pidfd on this kernel: the socket's EOF alone tells
            return
        asyncio.get_running_loop().add_reader(self._pidfd, self._on_worker_exit)

    def _on_worker_exit(self) -> None:
        self._unwatch_worker()
        self._fail("decoder process exited")

    def _unwatch_worker(self) -> None:
        fd, self._pidfd = self._pidfd, None
        if fd is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)

    def _fail(self, why: str) -> None:
        if self.failed is None:
            self.failed = why
            if why != "decoder closed":
                _log.error("%s", why)
        err = EngineError(why, EngineErrorKind.UNRECOVERABLE)
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(err)
        for slot, fut in self._pending.values():
            slot.busy = False
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()
        while self._stats_waiters:
            w = self._stats_waiters.popleft()
            if not w.done():
                w.set_exception(err)


@dataclass(frozen=True)
class SharedDecoder:
    """One gateway process's share of a decoder process several gateway processes use
    (``engine.vllm.launch``): its socket, the samples file, its slot rows there."""

    sock: socket.socket
    shm_path: str
    total_slots: int
    out_cap_samples: int
    slot_lo: int
    """This client's first row of the samples file (the worker adds it to the client's slots)."""
    slots: int
    """Streams this client may hold at once (its rows ``slot_lo .. slot_lo + slots``)."""


def _pair() -> tuple[socket.socket, socket.socket]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for sk in (ours, theirs):
        sk.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        sk.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    return ours, theirs


def spawn_worker(s: DecoderSettings, theirs: list[socket.socket], shm_path: str,
                 slots_per_client: int) -> subprocess.Popen[bytes]:
    """Start ``python -m engine.decoder.worker`` serving one client per socket in ``theirs``; client
    ``i``'s slots are rows ``i * slots_per_client ..`` of the samples file ``shm_path``."""
    args = {
        "fds": [t.fileno() for t in theirs], "model_dir": s.model_dir, "use_hidden": s.use_hidden,
        "device": s.device, "chunk_steps": s.chunk_steps, "lookahead_steps": s.lookahead_steps,
        "left_steps": s.left_steps, "max_batch": s.max_batch, "slots": slots_per_client * len(theirs),
        "slots_per_client": slots_per_client,
        "max_steps": s.max_steps, "torch_threads": s.torch_threads, "dtype": s.dtype, "compile": s.compile,
        "out_cap_steps": s.job_cap_steps,
        "shm_path": shm_path,
    }
    from engine.lifeline import child_env

    env = {**os.environ, **s.env, **child_env()}  # the worker dies with this process (engine.lifeline)
    env.pop("VOICEGW_VLLM_BOOT", None)  # vLLM's child boot (set while an engine core starts) is not ours
    py_path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and not p.endswith("_boot")]
    env["PYTHONPATH"] = os.pathsep.join([_ROOT, *py_path])
    # Popen returns once the child is forked; the worker is watched through its socket(s)
    return subprocess.Popen(
        [sys.executable, "-m", "engine.decoder.worker", json.dumps(args)],
        pass_fds=[t.fileno() for t in theirs], env=env,
    )


def shared_plan(s: DecoderSettings, clients: int) -> tuple[list[SharedDecoder], list[socket.socket], str]:
    """What one decoder process for ``clients`` gateway processes needs (``engine.vllm.launch``): a
    ``SharedDecoder`` per client, the worker's ends of the sockets (for ``spawn_worker``, then
    close them) and the samples file (unlink it once every client has mapped it)."""
    out_cap = s.job_cap_steps * SAMPLES_PER_STEP
    total = s.slots * clients
    path = new_path("audio")
    create_file(path, total * out_cap * 4)
    pairs = [_pair() for _ in range(clients)]
    shares = [SharedDecoder(ours, path, total, out_cap, i * s.slots, s.slots) for i, (ours, _) in enumerate(pairs)]
    return shares, [t for _, t in pairs], path

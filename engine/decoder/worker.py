"""The decoder process: streams of codes in, 24 kHz samples out, one batched forward at a time.

The gateway (``engine.decoder.client``) starts it with ``python -m engine.decoder.worker`` and
talks to it over an ``AF_UNIX``/``SOCK_SEQPACKET`` socket, one per gateway process when several
share it (``engine.vllm.launch``; one message per request or reply, fixed ``struct`` headers, no
pickling), and one shared-memory file of output samples
(``float32[slots, out_cap]``): a job's samples are written into its stream's slot, the reply
carries their count, and the gateway copies them out before that stream's next job (a stream has
at most one job in flight). Nothing here runs in the gateway's process, thread or GIL.

``WorkerCore`` is the synchronous core: per stream the inputs received so far, the steps
emitted, the crossfade continuation; a push becomes rows (``WindowSpec.rows``); ``step`` runs
one forward over up to ``max_batch`` queued rows (rows of streams that have emitted nothing yet
first: time to first audio), never waiting for a batch to fill, and reports the jobs it
completed. The process loop (``serve``) blocks on the socket only while no row is queued.
"""

from __future__ import annotations

import json
import os
import select
import socket
import struct
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.decoder.window import Row, WindowSpec
from engine.shm import map_file

#: request header: kind, flags, job id, slot, new steps in the payload, emit target (steps)
REQ = struct.Struct("<BBxxIIII")
#: reply header: kind, status, job id, samples written to the slot
REP = struct.Struct("<BBxxII")

KIND_PUSH = 0
KIND_STATS = 1
KIND_JOB = 0
KIND_READY = 1
KIND_STATS_REPLY = 2

FLAG_FINAL = 1
FLAG_RESET = 2
"""First push of a stream on this slot: forget what the slot held."""

STATUS_OK = 0
STATUS_BAD_INPUT = 1
STATUS_FORWARD_FAILED = 2

MAX_MESSAGE_BYTES = 1 << 20
SOCKET_BUFFER_BYTES = 4 << 20


@dataclass
class _Stream:
    step_dim: int
    dtype: Any
    hist: np.ndarray = field(init=False)
    received: int = 0
    emitted: int = 0
    """Steps whose samples were handed out."""
    samples: int = 0
    tail: np.ndarray | None = None
    final: bool = False

    def __post_init__(self) -> None:
        self.hist = np.zeros((64, self.step_dim), self.dtype)

    def append(self, x: np.ndarray, max_steps: int) -> None:
        need = self.received + x.shape[0]
        if need > max_steps:
            raise ValueError(f"stream longer than {max_steps} steps")
        if need > self.hist.shape[0]:
            grown = np.zeros((min(max_steps, max(need, 2 * self.hist.shape[0])), self.step_dim), self.dtype)
            grown[: self.received] = self.hist[: self.received]
            self.hist = grown
        self.hist[self.received : need] = x
        self.received = need


@dataclass
class _Job:
    job_id: int
    slot: int
    rows_left: int
    samples: int = 0


@dataclass
class _Queued:
    job: _Job
    stream: _Stream
    row: Row
    offset: int
    """Where the row's samples go in the job's output."""
    last: bool
    """Last row of a final job: no continuation to keep."""


@dataclass
class WorkerStats:
    forwards: int = 0
    rows: int = 0
    padded_rows: int = 0
    """Empty rows the forwards computed to fill their batch bucket."""
    busy_s: float = 0.0
    """Time inside forwards (on a GPU: until the samples are on the host)."""
    max_batch_seen: int = 0
    jobs: int = 0

    def as_dict(self) -> dict[str, float]:
        return {"forwards": self.forwards, "rows": self.rows, "padded_rows": self.padded_rows,
                "busy_s": round(self.busy_s, 4), "max_batch_seen": self.max_batch_seen, "jobs": self.jobs,
                "mean_batch": round(self.rows / self.forwards, 2) if self.forwards else 0.0}


class WorkerCore:
    """See the module docstring. ``run(x, start, end)`` is ``WindowDecoder.run``."""

    def __init__(self, spec: WindowSpec, run: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray],
                 out: np.ndarray, step_dim: int, dtype: Any, max_batch: int, max_steps: int,
                 code_limit: int | None, bucket_of: Callable[[int], int] | None = None) -> None:
        self.spec = spec
        self._run = run
        self._bucket_of = bucket_of
        """Rows a forward of ``n`` rows computes (``WindowDecoder.bucket``; None: ``n``)."""
        self.out = out
        """``[slots, out_cap]`` float32 (the shared memory)."""
        self.step_dim, self.dtype = step_dim, np.dtype(dtype)
        self.max_batch, self.max_steps = max_batch, max_steps
        self.code_limit = code_limit
        self._streams: dict[int, _Stream] = {}
        self._first: deque[_Queued] = deque()
        self._rest: deque[_Queued] = deque()
        self.stats = WorkerStats()
        sps = spec.geometry.samples_per_step
        self.out_cap_steps = out.shape[1] // sps

    @property
    def queued_rows(self) -> int:
        return len(self._first) + len(self._rest)

    def submit(self, job_id: int, slot: int, x: np.ndarray, target: int, flags: int) -> tuple[int, int] | None:
        """Take one push. Returns ``(status, samples)`` when it completes at once (no rows, or a
        bad request), else ``None`` (``step`` reports it)."""
        if not 0 <= slot < self.out.shape[0]:
            return STATUS_BAD_INPUT, 0
        st = self._streams.get(slot)
        if st is None or flags & FLAG_RESET:
            st = self._streams[slot] = _Stream(self.step_dim, self.dtype)
        if st.final:
            return STATUS_BAD_INPUT, 0
        if x.shape[0] and self.code_limit is not None and (int(x.min()) < 0 or int(x.max()) >= self.code_limit):
            return STATUS_BAD_INPUT, 0
        try:
            st.append(x, self.max_steps)
        except ValueError:
            return STATUS_BAD_INPUT, 0
        final = bool(flags & FLAG_FINAL)
        if final:
            target = st.received
        target = max(st.emitted, min(target, st.received))
        if target - st.emitted > self.out_cap_steps:
            return STATUS_BAD_INPUT, 0
        rows = self.spec.rows(st.emitted, target, st.received, final)
        st.emitted = target
        st.final = final
        job = _Job(job_id, slot, len(rows))
        if not rows:
            self._done_stream(st, slot)
            return STATUS_OK, 0
        queue = self._first if st.samples == 0 else self._rest
        off = 0
        for i, r in enumerate(rows):
            queue.append(_Queued(job, st, r, off, final and i == len(rows) - 1))
            off += r.samples
        st.samples += off
        return None

    def _done_stream(self, st: _Stream, slot: int) -> None:
        if st.final and self._streams.get(slot) is st:
            del self._streams[slot]

    def step(self) -> list[tuple[int, int, int]]:
        """One forward over up to ``max_batch`` queued rows; returns ``(job_id, status, samples)``
        of the jobs it completed."""
        batch: list[_Queued] = []
        while len(batch) < self.max_batch and (self._first or self._rest):
            batch.append((self._first or self._rest).popleft())
        if not batch:
            return []
        spec = self.spec
        w, left = spec.window_steps, spec.left_steps
        xs = np.zeros((len(batch), w, self.step_dim), self.dtype)
        start = np.empty(len(batch), np.int64)
        end = np.empty(len(batch), np.int64)
        for i, q in enumerate(batch):
            ws = q.row.start - left
            lo, hi = max(0, ws), min(q.row.end, ws + w)
            xs[i, lo - ws : hi - ws] = q.stream.hist[lo:hi]
            start[i], end[i] = ws, q.row.end
        t0 = time.perf_counter()
        try:
            y = self._run(xs, start, end)
        except Exception:  # noqa: BLE001 - a failed forward fails its jobs, the process lives on
            done: dict[int, tuple[int, int, int]] = {}
            for q in batch:
                done[q.job.job_id] = (q.job.job_id, STATUS_FORWARD_FAILED, 0)
                q.job.rows_left = -1
            self.drop_jobs({q.job.job_id for q in batch})
            return list(done.values())
        st = self.stats
        st.forwards += 1
        st.rows += len(batch)
        if self._bucket_of is not None:
            st.padded_rows += self._bucket_of(len(batch)) - len(batch)
        st.busy_s += time.perf_counter() - t0
        st.max_batch_seen = max(st.max_batch_seen, len(batch))
        xf = spec.xfade
        out: list[tuple[int, int, int]] = []
        for i, q in enumerate(batch):
            n = q.row.samples
            audio = y[i, :n]
            tail = q.stream.tail
            if tail is not None and n:
                k = min(tail.shape[0], n)
                ramp = np.arange(1, k + 1, dtype=np.float32) / np.float32(k + 1)
                audio = audio.copy()
                audio[:k] = ramp * audio[:k] + (1.0 - ramp) * tail[:k]
            q.stream.tail = None if (q.last or not xf) else y[i, n : n + xf].copy()
            self.out[q.job.slot, q.offset : q.offset + n] = audio
            q.job.samples += n
            q.job.rows_left -= 1
            if q.job.rows_left == 0:
                st.jobs += 1
                out.append((q.job.job_id, STATUS_OK, q.job.samples))
                self._done_stream(q.stream, q.job.slot)
        return out

    def drop_jobs(self, ids: set[int]) -> None:
        """Forget the queued rows of jobs ``ids`` (a failed forward, a client gone)."""
        for dq in (self._first, self._rest):
            keep = [q for q in dq if q.job.job_id not in ids]
            dq.clear()
            dq.extend(keep)


# --------------------------------------------------------------------------- the process


def _send(sock: socket.socket, kind: int, status: int, job: int, samples: int) -> None:
    sock.send(REP.pack(kind, status, job, samples))


def serve(args: dict[str, Any], socks: list[socket.socket]) -> None:
    """Load the vocoder, warm up (CUDA graphs), report ready, then decode until every socket
    closes. One socket per client: several gateway processes may share this process
    (``engine.vllm.launch``); client ``c``'s slot ``s`` is row ``c * slots_per_client + s`` of the
    samples file, and job ids are translated so that clients' ids never meet."""
    import torch

    from engine.decoder.nets import load_vocoder
    from engine.decoder.windowed import WindowDecoder

    if int(args.get("torch_threads", 0)) > 0:
        torch.set_num_threads(int(args["torch_threads"]))
    device = str(args.get("device") or "cpu")
    voc = load_vocoder(args["model_dir"], use_hidden=bool(args.get("use_hidden")), device=device)
    geo = voc.geometry
    la = int(args.get("lookahead_steps", -1))
    if la < 0 or la > geo.exact_lookahead_steps:
        la = geo.exact_lookahead_steps
    spec = WindowSpec(geo, int(args["chunk_steps"]), la, left_context_steps=int(args.get("left_steps", -1)))
    max_batch = int(args["max_batch"])
    dec = WindowDecoder(voc, spec, max_batch, compute_dtype=str(args.get("dtype") or "float32"),
                        compile_forward=bool(args.get("compile")))
    t_warm = time.perf_counter()
    dec.warm_up()
    warm_up_s = time.perf_counter() - t_warm
    graphs = 0
    if dec.compile_forward:
        from torch._dynamo.utils import counters

        graphs = int(counters["stats"]["unique_graphs"])
    print(f"decoder process {os.getpid()}: warmed up in {warm_up_s:.1f} s ({device}, {dec.compute_dtype}, "
          f"{graphs} compiled graphs, buckets {dec.buckets})", file=sys.stderr, flush=True)
    slots, out_cap = int(args["slots"]), int(args["out_cap_steps"]) * geo.samples_per_step
    per = int(args.get("slots_per_client") or slots)
    mm, flat = map_file(args["shm_path"], slots * out_cap * 4, create=False, dtype=np.float32)
    out = flat.reshape(slots, out_cap)
    limit = voc.front.vq_layer.quantizer.codebook_size if voc.uses_codes else None  # type: ignore[union-attr]
    dtype = np.int64 if voc.uses_codes else np.float32
    core = WorkerCore(spec, dec.run, out, dec.step_dim, dtype, max_batch, int(args["max_steps"]), limit,
                      bucket_of=dec.bucket)
    wire_dtype = np.int16 if voc.uses_codes else np.float32
    ready = {
        "step_dim": dec.step_dim, "uses_codes": voc.uses_codes, "code_limit": limit,
        "frames_per_step": geo.frames_per_step, "n_fft": geo.n_fft, "hop": geo.hop,
        "stage_reaches": [[r.left, r.right] for r in geo.stage_reaches],
        "lookahead_steps": la, "exact": spec.exact, "window_steps": spec.window_steps, "left_steps": spec.left_steps,
        "buckets": dec.buckets, "device": device, "dtype": str(dec.compute_dtype).removeprefix("torch."),
        "compiled": dec.compile_forward, "compiled_graphs": graphs, "warm_up_s": round(warm_up_s, 2),
        "pid": os.getpid(), "clients": len(socks),
    }
    live: dict[int, socket.socket] = dict(enumerate(socks))
    jobs: dict[int, tuple[int, int]] = {}  # worker job id -> (client, the client's job id)
    next_job = 0

    def reply(c: int, job: int, status: int, samples: int) -> None:
        sk = live.get(c)
        if sk is None:
            return  # that client went away (its gateway stopped): drop the reply
        try:
            _send(sk, KIND_JOB, status, job, samples)
        except OSError:
            drop(c)

    def drop(c: int) -> None:
        live.pop(c, None)
        gone = {j for j, (cc, _) in jobs.items() if cc == c}
        core.drop_jobs(gone)
        for j in gone:
            jobs.pop(j, None)

    def handle(c: int, msg: bytes) -> None:
        nonlocal next_job
        kind, flags, job, slot, n_new, target = REQ.unpack_from(msg)
        sk = live[c]
        if kind == KIND_STATS:
            sk.send(bytes([KIND_STATS_REPLY]) + json.dumps(core.stats.as_dict()).encode())
            return
        payload = np.frombuffer(msg, dtype=wire_dtype, offset=REQ.size)
        if payload.size != n_new * dec.step_dim or not 0 <= slot < per:
            reply(c, job, STATUS_BAD_INPUT, 0)
            return
        next_job = (next_job + 1) & 0xFFFFFFFF
        jobs[next_job] = (c, job)
        res = core.submit(next_job, c * per + slot, payload.reshape(n_new, dec.step_dim).astype(dtype), target, flags)
        if res is not None:
            jobs.pop(next_job, None)
            reply(c, job, res[0], res[1])

    def drain(c: int) -> None:
        """Every message waiting on client ``c``'s socket (they all join the next forward)."""
        while c in live:
            try:
                msg = live[c].recv(MAX_MESSAGE_BYTES, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                msg = b""
            if not msg:
                drop(c)  # that gateway closed its socket (or died)
                return
            handle(c, msg)

    for sk in socks:
        sk.send(bytes([KIND_READY]) + json.dumps(ready).encode())
    while live:
        readable, _, _ = select.select(list(live.values()), [], [], 0 if core.queued_rows else None)
        by_fd = {sk.fileno(): c for c, sk in live.items()}
        for sk in readable:
            drain(by_fd[sk.fileno()])
        for job, status, samples in core.step():
            owner = jobs.pop(job, None)
            if owner is not None:
                reply(owner[0], owner[1], status, samples)


def main() -> None:
    import signal

    from engine.lifeline import arm

    arm()  # dies with its parent (the gateway process or the group's launcher), SIGKILL included
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the gateway shuts it down by closing the socket
    args = json.loads(sys.argv[1])
    socks = [socket.socket(fileno=int(fd)) for fd in args["fds"]]
    for sk in socks:
        sk.setblocking(True)
    try:
        serve(args, socks)
    except (BrokenPipeError, ConnectionResetError):
        pass  # a gateway went away mid-reply
    finally:
        for sk in socks:
            sk.close()


if __name__ == "__main__":
    main()

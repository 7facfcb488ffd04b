"""asyncio edge of the streaming decoder: chunks from many streams, one batched forward.

``BatchingDecoder`` owns one task that drains a bounded queue of decode jobs. It takes the
first waiting job, gathers more for up to ``batch_wait_ms`` (or until ``max_batch`` are
queued), and runs ``StreamingVocoder.decode`` for the batch in a single worker thread, so
the event loop never blocks on torch. While a forward runs, new jobs queue up and form the
next batch. A stream has at most one job in flight (``DecoderStream.push`` is awaited), and
a batch never holds two jobs of one stream.

Where a job waits, and what bounds it: in the queue (``max_queue`` jobs; ``push`` waits for
room: back-pressure on the producers), then for at most one running forward plus its own.
Cancellation: a cancelled ``push`` whose job has not run yet is dropped, and its stream is
closed (its state would no longer match what was pushed); a job already running completes
and its result is discarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from engine.api import EngineError, EngineErrorKind
from engine.decoder.streaming import DecodeJob, StreamingVocoder, StreamState

_log = logging.getLogger(__name__)


@dataclass
class DecoderStats:
    batches: int = 0
    jobs: int = 0
    busy_s: float = 0.0
    """Wall time spent in forwards (worker thread)."""
    max_batch_seen: int = 0
    samples: int = 0
    """24 kHz samples produced."""

    @property
    def mean_batch(self) -> float:
        return self.jobs / self.batches if self.batches else 0.0


@dataclass
class _Job:
    stream: DecoderStream
    x: np.ndarray
    final: bool
    emit_steps: int | None
    future: asyncio.Future[np.ndarray] = field(repr=False)


class DecoderStream:
    """One utterance on a ``BatchingDecoder``. Push steps in order; the last push is ``final``."""

    def __init__(self, decoder: BatchingDecoder, state: StreamState) -> None:
        self._decoder = decoder
        self.state = state
        self.closed = False
        self._busy = False

    @property
    def steps_in(self) -> int:
        return self.state.steps_in

    @property
    def emitted_samples(self) -> int:
        return self.state.emitted_samples

    async def push(self, x: np.ndarray, final: bool = False, emit_steps: int | None = None) -> np.ndarray:
        """Decode ``x`` (``[n, step_dim]``); return the new float32 24 kHz audio (maybe empty)."""
        if self.closed or self.state.finished:
            raise EngineError("decoder stream is closed")
        if self._busy:
            raise RuntimeError("DecoderStream.push is not reentrant: await the previous push")
        self._decoder.check_input(x)
        self._busy = True
        try:
            return await self._decoder._submit(self, x, final, emit_steps)
        finally:
            self._busy = False

    def close(self) -> None:
        """Forget the stream (no more pushes). Idempotent."""
        self.closed = True


class BatchingDecoder:
    """See the module docstring. ``start()`` before use, ``close()`` at the end."""

    def __init__(
        self,
        core: StreamingVocoder,
        max_batch: int = 64,
        batch_wait_ms: float = 2.0,
        max_queue: int = 1024,
    ) -> None:
        if max_batch < 1 or batch_wait_ms < 0 or max_queue < 1:
            raise ValueError("max_batch >= 1, batch_wait_ms >= 0, max_queue >= 1")
        self.core = core
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_ms / 1000.0
        self._queue: asyncio.Queue[_Job] = asyncio.Queue(maxsize=max_queue)
        self._full = asyncio.Event()
        self._executor: ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None
        self._deferred: list[_Job] = []
        self.stats = DecoderStats()
        self.failed: BaseException | None = None

    @property
    def geometry(self):  # type: ignore[no-untyped-def]
        return self.core.geometry

    @property
    def healthy(self) -> bool:
        return self.failed is None and (self._task is None or not self._task.done())

    async def start(self) -> None:
        if self._task is not None:
            return
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="voicegw-decoder")
        self._task = asyncio.get_running_loop().create_task(self._run(), name="voicegw-decoder")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for job in self._drain_all():
            if not job.future.done():
                job.future.set_exception(EngineError("decoder closed"))
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def open_stream(self) -> DecoderStream:
        return DecoderStream(self, self.core.open())

    def check_input(self, x: np.ndarray) -> None:
        """Reject a malformed push before it can fail a whole batch."""
        sd = self.core.step_dim
        if not isinstance(x, np.ndarray) or x.ndim != 2 or x.shape[1] != sd:
            raise EngineError(f"decoder input must be an array [n, {sd}], got {getattr(x, 'shape', type(x))}")
        if self.core.vocoder.uses_codes:
            if not np.issubdtype(x.dtype, np.integer):
                raise EngineError(f"codes must be integers, got {x.dtype}")
            limit = self.core.vocoder.front.vq_layer.quantizer.codebook_size  # type: ignore[union-attr]
            if x.size and (int(x.min()) < 0 or int(x.max()) >= limit):
                raise EngineError(f"code out of range 0..{limit - 1}")
        elif x.size and not np.isfinite(x).all():
            raise EngineError("hidden states contain non-finite values")

    async def decode_now(self, jobs: list[DecodeJob]) -> list[np.ndarray]:
        """Run one forward for ``jobs`` in the worker thread, bypassing the queue (benchmarks)."""
        if self._executor is None:
            raise RuntimeError("BatchingDecoder not started")
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.core.decode, jobs)

    # ------------------------------------------------------------------ internals

    async def _submit(self, stream: DecoderStream, x: np.ndarray, final: bool, emit_steps: int | None) -> np.ndarray:
        if self._task is None or self.failed is not None:
            raise EngineError("decoder not running", EngineErrorKind.UNRECOVERABLE)
        fut: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        job = _Job(stream, x, final, emit_steps, fut)
        await self._queue.put(job)
        if self._queue.qsize() >= self.max_batch:
            self._full.set()
        try:
            return await fut
        except asyncio.CancelledError:
            stream.close()  # its state may or may not include this push: unusable
            raise

    def _drain_all(self) -> list[_Job]:
        jobs, self._deferred = self._deferred, []
        while True:
            try:
                jobs.append(self._queue.get_nowait())
            except asyncio.QueueEmpty:
                return jobs

    async def _gather(self) -> list[_Job]:
        batch: list[_Job] = []
        seen: set[int] = set()

        def take(job: _Job) -> None:
            if job.future.done() or job.stream.closed:
                if not job.future.done():
                    job.future.set_exception(EngineError("decoder stream is closed"))
                return
            if id(job.stream) in seen:  # second job of a stream: next batch
                self._deferred.append(job)
                return
            seen.add(id(job.stream))
            batch.append(job)

        deferred, self._deferred = self._deferred, []
        for job in deferred:
            take(job)
        if not batch:
            take(await self._queue.get())
            if self.batch_wait_s > 0 and self._queue.qsize() + len(batch) < self.max_batch:
                self._full.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._full.wait(), self.batch_wait_s)
        while len(batch) < self.max_batch:
            try:
                take(self._queue.get_nowait())
            except asyncio.QueueEmpty:
                break
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                batch = await self._gather()
                if not batch:
                    continue
                jobs = [DecodeJob(j.stream.state, j.x, j.final, j.emit_steps) for j in batch]
                t0 = time.perf_counter()
                try:
                    assert self._executor is not None
                    results = await loop.run_in_executor(self._executor, self.core.decode, jobs)
                except asyncio.CancelledError:
                    for j in batch:
                        if not j.future.done():
                            j.future.set_exception(EngineError("decoder closed"))
                    raise
                except Exception as exc:  # noqa: BLE001 - a failed forward fails its batch only
                    _log.exception("decoder forward failed (batch of %d)", len(batch))
                    for j in batch:
                        j.stream.close()
                        if not j.future.done():
                            j.future.set_exception(EngineError(f"decoder forward failed: {exc}"))
                    continue
                dt = time.perf_counter() - t0
                st = self.stats
                st.batches += 1
                st.jobs += len(batch)
                st.busy_s += dt
                st.max_batch_seen = max(st.max_batch_seen, len(batch))
                for j, audio in zip(batch, results, strict=True):
                    st.samples += audio.shape[0]
                    if not j.future.done():
                        j.future.set_result(audio)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # pragma: no cover - loop bug: fail loudly, mark unhealthy
            self.failed = exc
            _log.exception("decoder loop died")
            for job in self._drain_all():
                if not job.future.done():
                    job.future.set_exception(EngineError("decoder loop died", EngineErrorKind.UNRECOVERABLE))
            raise

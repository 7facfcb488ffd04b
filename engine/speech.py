"""``ChatTTSSpeech``: a ``CodeEngine`` (text -> code frames) + the streaming decoder -> PCM chunks.

Flow control: ``synthesize`` is an async generator pulled lazily. It reads code frames from
the code engine and runs a decoder forward only while the consumer is waiting for the next
chunk; when the consumer stops pulling, nothing more is read or decoded for that request
(the code engine's own stream buffers what the GPT keeps producing; the gateway's scheduler
lowers the priority of streams that are far ahead). Per request at most one chunk of audio
is decoded and not yet taken: the one being handed to the consumer. The decoder's job queue
(``DecoderClient``, bounded) is shared by all requests.

Chunking (``ChunkPolicy``): first audio once ``first_chunk_steps`` steps are audible, then
chunks that follow the stream's lead over real-time playback (``StreamLead``), up to
``chunk_steps``, one forward at most ``2 * chunk_steps``; audio is ``lookahead_steps`` behind the newest step
(exact mode: the derived receptive field; the output then equals a whole-utterance decode).
The last chunk (``finished=True``) carries the flushed tail.

Restart on crash (``EngineConfig.restart_on_crash``): a watchdog task polls the code engine's
health; when a code engine that was up reports itself dead (e.g. the vLLM engine-core process
died), it calls the code engine's ``restart()`` (a new engine core, warm-up included), retrying
with a doubling backoff (``restart_backoff_s``, at most 60 s) while restarts fail. Meanwhile
``health()`` is unhealthy (``/healthz`` 503) and requests fail as "engine unavailable", as during
the crash itself. Restarts of one process are serialized (two speech engines over one code engine
restart it once).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from engine.api import (
    NATIVE_SAMPLE_RATE_HZ,
    SAMPLES_PER_STEP,
    AudioChunk,
    CodeEngine,
    CodeFrames,
    EngineError,
    EngineHealth,
    SpeechRequest,
)
from engine.audio_format import SUPPORTED_RATES_HZ, StreamResampler, float_to_pcm16
from engine.decoder.window import ChunkPolicy, StreamLead

if TYPE_CHECKING:
    from engine.decoder.client import DecoderClient
    from voicegw.config import EngineConfig

_log = logging.getLogger(__name__)

_RESTART_POLL_S = 0.5
"""Watchdog: how often the code engine's health is read (a cheap attribute check)."""
_RESTART_BACKOFF_MAX_S = 60.0
_restart_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = weakref.WeakKeyDictionary()


def _restart_lock() -> asyncio.Lock:
    loop = asyncio.get_running_loop()
    lock = _restart_locks.get(loop)
    if lock is None:
        lock = _restart_locks[loop] = asyncio.Lock()
    return lock


async def restart_code_engine(code: CodeEngine) -> bool:
    """Restart ``code`` if it is unhealthy (serialized with every watchdog of this process: a code
    engine is never restarted twice at once). True when it is healthy afterwards; a failed restart
    raises."""
    async with _restart_lock():
        if code.health().healthy:
            return True
        await code.restart()  # type: ignore[attr-defined]
        return bool(code.health().healthy)


def chunk_policy(cfg: EngineConfig, exact_lookahead_steps: int) -> ChunkPolicy:
    """The policy from the config; ``decoder_lookahead_steps`` < 0 (or absent) means exact."""
    la = int(getattr(cfg, "decoder_lookahead_steps", -1))
    if la < 0 or la > exact_lookahead_steps:
        la = exact_lookahead_steps
    return ChunkPolicy(cfg.first_chunk_steps, cfg.chunk_steps, la)


def build_decoder(cfg: EngineConfig, model_dir: str, device: str = "cpu") -> DecoderClient:
    """A (not yet started) client of a decoder process for ``model_dir``'s vocoder on ``device``."""
    from engine.decoder.client import DecoderClient, DecoderSettings

    return DecoderClient(DecoderSettings(
        model_dir=str(model_dir), use_hidden=bool(cfg.use_hidden_decoder), device=str(device),
        chunk_steps=cfg.chunk_steps, lookahead_steps=cfg.decoder_lookahead_steps, max_batch=cfg.decoder_max_batch,
        slots=2 * cfg.max_num_seqs + 32, max_steps=cfg.max_model_len, torch_threads=cfg.decoder_torch_threads,
    ))


class ChatTTSSpeech:
    """``SpeechEngine`` over a ``CodeEngine`` and a ``DecoderClient`` (see module docstring)."""

    native_sample_rate_hz = NATIVE_SAMPLE_RATE_HZ

    def __init__(self, code_engine: CodeEngine, decoder: DecoderClient, cfg: EngineConfig) -> None:
        self._code = code_engine
        self._decoder = decoder
        self.name = code_engine.name
        self.use_hidden = bool(cfg.use_hidden_decoder)
        if self.use_hidden == decoder.uses_codes:
            raise ValueError("decoder path does not match engine.use_hidden_decoder")
        self._cfg = cfg
        self.policy = chunk_policy(cfg, 10**6)
        """Replaced at ``start`` once the decoder reports its geometry (the exact lookahead)."""
        self.exact = self.policy.lookahead_steps >= 10**6
        self._active: dict[str, asyncio.Event] = {}
        self._codes: dict[str, ResumableCodes] = {}
        """Code streams of the running segments (``preempt``)."""
        self.supports_preempt = bool(getattr(code_engine, "supports_resume", False)) and not self.use_hidden
        """``preempt`` needs a code engine that resumes requests (vLLM) and the codes decoder path."""
        self.preempt_enabled = False
        """Segments started while this is set use the restartable code iterator (``enable_preemption``)."""
        self.restart_on_crash = bool(getattr(cfg, "restart_on_crash", True))
        self.restart_backoff_s = max(0.0, float(getattr(cfg, "restart_backoff_s", 5.0)))
        self.restarting = False
        self.restarts_s: list[float] = []
        """Seconds each completed restart took (watchdog)."""
        self._watchdog: asyncio.Task[None] | None = None
        self._restart_task: asyncio.Task[bool] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self._decoder.start()
        geo = self._decoder.geometry
        assert geo is not None
        self.policy = chunk_policy(self._cfg, geo.exact_lookahead_steps)
        self.exact = self.policy.lookahead_steps >= geo.exact_lookahead_steps
        await self._code.start()
        if self.restart_on_crash and callable(getattr(self._code, "restart", None)) and self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watch(), name="code engine watchdog")

    async def close(self) -> None:
        try:
            await self._stop_watchdog()
            await self._code.close()
        finally:
            await self._decoder.close()

    def health(self) -> EngineHealth:
        h = self._code.health()
        if self.restarting:
            h = replace(h, healthy=False, detail="restarting after a crash" + (f" ({h.detail})" if h.detail else ""))
        if not self._decoder.healthy:
            return replace(h, healthy=False, detail=(h.detail + "; " if h.detail else "") + "decoder down")
        return h

    # ------------------------------------------------------------------ restart on crash

    async def _watch(self) -> None:
        """Poll the code engine; restart it when, having been up, it reports itself dead."""
        seen_up = False
        failures = 0
        while True:
            await asyncio.sleep(_RESTART_POLL_S)
            h = self._code.health()
            if h.healthy:
                seen_up, failures = True, 0
                continue
            if not seen_up:
                continue  # never started (or still starting): not a crash
            self._restart_task = asyncio.create_task(self._restart(h.detail), name="code engine restart")
            # shielded: close() lets a restart finish (a cancelled restart could leak an engine core)
            ok = await asyncio.shield(self._restart_task)
            self._restart_task = None
            if not ok:
                failures += 1
                await asyncio.sleep(min(_RESTART_BACKOFF_MAX_S, self.restart_backoff_s * 2 ** (failures - 1)))

    async def _restart(self, detail: str) -> bool:
        async with _restart_lock():
            if self._code.health().healthy:
                return True  # another watchdog of this process restarted it
            self.restarting = True
            t0 = time.monotonic()
            _log.warning("code engine %s unhealthy (%s): restarting", self.name, detail)
            try:
                await self._code.restart()  # type: ignore[attr-defined]
            except Exception:
                _log.exception("code engine restart failed; retrying after a backoff")
                return False
            finally:
                self.restarting = False
            took = time.monotonic() - t0
            if not self._code.health().healthy:
                _log.error("code engine restarted in %.1f s but is not healthy: %s", took, self._code.health().detail)
                return False
            self.restarts_s.append(took)
            _log.warning("code engine %s restarted in %.1f s", self.name, took)
            return True

    async def _stop_watchdog(self) -> None:
        task, self._watchdog = self._watchdog, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        restart, self._restart_task = self._restart_task, None
        if restart is not None:
            with contextlib.suppress(Exception):
                await restart

    async def abort(self, request_id: str) -> None:
        ev = self._active.get(request_id)
        if ev is not None:
            ev.set()
        codes = self._codes.get(request_id)
        if codes is not None and codes.engine_rid != request_id:
            await codes.aclose()  # a resumed code request: its own id
        await self._code.abort(request_id)

    def enable_preemption(self, on: bool = True) -> bool:
        """Opt in to ``preempt`` (``scheduler.preempt``): later segments run on the restartable code
        iterator; off (the default), segments read the code engine's stream directly. Returns
        whether preemption is now on (False when the code engine cannot resume requests)."""
        self.preempt_enabled = bool(on) and self.supports_preempt
        return self.preempt_enabled

    def preemptions(self, request_id: str) -> int | None:
        """How often the running segment ``request_id`` was preempted (None: not running)."""
        codes = self._codes.get(request_id)
        return None if codes is None else codes.preemptions

    def submitted(self, request_id: str) -> bool:
        """The segment's code request went to the code engine (it counts in ``health()``)."""
        codes = self._codes.get(request_id)
        return codes is not None and codes.submitted

    def awaiting_slot(self, request_id: str) -> bool:
        """The segment's code request is in the code engine but has produced nothing yet (a
        resumed one: nothing new since it was resubmitted): it waits for a batch slot."""
        codes = self._codes.get(request_id)
        return codes is not None and codes.awaiting_frames()

    def can_preempt(self, request_id: str) -> bool:
        """``request_id`` is running and generating now (a resumed one: once it produced again)."""
        codes = self._codes.get(request_id)
        return self.supports_preempt and codes is not None and codes.preemptible()

    async def preempt(self, request_id: str, priority: int) -> bool:
        """Preempt the running segment ``request_id``: abort its code request and resubmit it at
        once as a resumed request (every frame received so far as the prefix) at ``priority``.
        The segment's audio stream continues seamlessly. False when it cannot (unknown or
        finishing segment, engine without resume, no step left)."""
        codes = self._codes.get(request_id)
        if codes is None or not self.supports_preempt:
            return False
        return await codes.preempt(priority)

    async def reprioritize(self, request_id: str, priority: int) -> bool:
        """Give the segment ``request_id`` a new engine priority while it still waits for a batch
        slot (its code request produced nothing yet): abort and submit it again at ``priority``
        (it holds no KV worth keeping). False when it cannot: not waiting any more, unknown, or
        segments read the code engine directly (``enable_preemption`` off)."""
        codes = self._codes.get(request_id)
        if codes is None or not self.supports_preempt:
            return False
        return await codes.requeue(priority)

    # ------------------------------------------------------------------ synthesis

    def synthesize(self, request: SpeechRequest) -> AsyncIterator[AudioChunk]:
        if request.sample_rate_hz not in SUPPORTED_RATES_HZ:
            raise EngineError(f"sample rate {request.sample_rate_hz} not supported ({SUPPORTED_RATES_HZ})")
        return self._synthesize(request)

    async def _synthesize(self, request: SpeechRequest) -> AsyncIterator[AudioChunk]:
        rid = request.request_id
        rate = request.sample_rate_hz
        aborted = asyncio.Event()
        self._active[rid] = aborted
        stream = self._decoder.open_stream()
        resampler = StreamResampler(NATIVE_SAMPLE_RATE_HZ, rate)
        policy = self.policy
        pending: list[np.ndarray] = []
        received = decoded = reported = 0
        loop = asyncio.get_running_loop()
        lead = StreamLead(SAMPLES_PER_STEP / NATIVE_SAMPLE_RATE_HZ)
        frames_iter: AsyncIterator[CodeFrames]
        if self.supports_preempt and self.preempt_enabled:
            frames_iter = self._codes[rid] = ResumableCodes(self._code, request)
        else:
            frames_iter = self._code.generate(request)
        finished = False
        try:
            async for frames in frames_iter:
                if aborted.is_set() or frames.finish_reason == "abort":
                    aborted.set()
                    break
                x = self._step_input(frames)
                if x is not None and x.shape[0]:
                    pending.append(x)
                    received += x.shape[0]
                final = frames.finished
                while True:
                    n = policy.push_steps(received, decoded, final, lead.lead_steps(loop.time()))
                    last = final and decoded + n == received
                    if not n and not last:
                        break
                    take, pending = _split_steps(pending, n)
                    audio = await self._push(stream, take, last, decoded + n)
                    decoded += n
                    lead.emitted(audio.shape[0] / SAMPLES_PER_STEP, loop.time())
                    pcm = self._encode(resampler, audio, last=last)
                    if last:
                        finished = True
                        yield AudioChunk(rid, pcm, rate, finished=True, steps=received - reported)
                        return
                    if pcm:
                        yield AudioChunk(rid, pcm, rate, steps=decoded - reported)
                        reported = decoded
            if aborted.is_set():
                yield AudioChunk(rid, b"", rate, finished=True, steps=0)
                finished = True
                return
            # the code stream ended without a final frame (or was aborted upstream): flush
            if not finished:
                if any(p.shape[0] for p in pending) or stream.steps_in:
                    audio = await self._push(stream, pending, True, received)
                    pcm = self._encode(resampler, audio, last=True)
                else:
                    pcm = b""
                finished = True
                yield AudioChunk(rid, pcm, rate, finished=True, steps=received - reported)
        finally:
            stream.close()
            self._active.pop(rid, None)
            engine_rid = rid
            if isinstance(frames_iter, ResumableCodes):
                engine_rid = frames_iter.engine_rid
                if self._codes.get(rid) is frames_iter:
                    del self._codes[rid]
            aclose = getattr(frames_iter, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
            if not finished:
                with contextlib.suppress(Exception):
                    await self._code.abort(engine_rid)

    def _step_input(self, frames) -> np.ndarray | None:  # type: ignore[no-untyped-def]
        n = int(frames.codes.shape[0]) if frames.codes is not None else 0
        if not self.use_hidden:
            return np.asarray(frames.codes, dtype=np.int64).reshape(n, -1) if n else None
        if n and frames.hidden is None:
            raise EngineError("engine.use_hidden_decoder is set but the code engine gives no hidden states")
        return np.asarray(frames.hidden, dtype=np.float32) if n else None

    async def _push(self, stream, pending: list[np.ndarray], final: bool, received: int) -> np.ndarray:  # type: ignore[no-untyped-def]
        sd = self._decoder.step_dim
        dtype = np.float32 if self.use_hidden else np.int64
        x = np.concatenate(pending) if pending else np.zeros((0, sd), dtype)
        emit = received if final else self.policy.emit_steps(received)
        return await stream.push(x, final=final, emit_steps=emit)  # type: ignore[no-any-return]

    @staticmethod
    def _encode(resampler: StreamResampler, audio: np.ndarray, last: bool) -> bytes:
        return bytes(float_to_pcm16(resampler.process(audio, last=last)).tobytes())


_END = object()


class ResumableCodes:
    """A segment's code frames across preemptions: the restartable code iterator of
    ``ChatTTSSpeech._synthesize``.

    Until the first ``preempt`` it reads the code engine's stream directly (lazily, as the
    consumer pulls). ``preempt(priority)`` aborts the running code request and, in a background
    task, drains what that request still delivers, then resubmits the segment as a resumed
    request (``SpeechRequest.prefix_codes`` = every frame received so far, new engine request id
    ``<id>.p<n>``, the given priority) and forwards its frames. From then on the consumer reads
    the task's queue (bounded by the segment's ``max_new_tokens`` frames: every item carries at
    least one frame, bar the last). The frames the consumer sees continue without gap or
    duplicate; the preemption's own abort never reaches it.
    """

    def __init__(self, code: CodeEngine, request: SpeechRequest) -> None:
        self._code = code
        self.request = request
        self.rid = request.request_id
        self.engine_rid = request.request_id
        """Request id of the code request now running (``<id>.p<n>`` after ``n`` preemptions and requeues)."""
        self.preemptions = 0
        self.requeues = 0
        """Times the request was resubmitted while waiting for a slot (``requeue``)."""
        self.frames_received = 0
        self._parts: list[np.ndarray] = []
        self._it: AsyncIterator[CodeFrames] | None = code.generate(request)
        self._it_done = False
        self._lock = asyncio.Lock()
        self._queue: asyncio.Queue[object] | None = None
        self._pump: asyncio.Task[None] | None = None
        self._pending_priority: int | None = None
        self._pending_requeue = False
        self.submitted = False
        """The first code request was started (its ``generate`` entered)."""
        self._resumed_waiting = False
        self._finished = False
        self._closed = False

    # ---- consumer side

    def __aiter__(self) -> ResumableCodes:
        return self

    async def __anext__(self) -> CodeFrames:
        while True:
            if self._queue is not None:
                item = await self._queue.get()
                if item is _END:
                    raise StopAsyncIteration
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, CodeFrames)
                return item
            async with self._lock:
                if self._queue is not None:
                    continue  # preempted while we waited
                if self._it is None or self._it_done:
                    raise StopAsyncIteration
                self.submitted = True
                try:
                    fr = await anext(self._it)
                except StopAsyncIteration:
                    self._it_done = True
                    raise
                out = self._take(fr)
                if out is None:
                    continue
                return out

    # ---- preemption

    def preemptible(self, max_preemptions: int | None = None) -> bool:
        """True when ``preempt`` would pause a code request that is generating now (not finished,
        not being preempted, not a resumed request still waiting for its first new frame)."""
        if self._closed or self._finished or self._pending_priority is not None or self._resumed_waiting:
            return False
        if max_preemptions is not None and self.preemptions >= max_preemptions:
            return False
        # a resumed request needs at least one step left
        return self.frames_received + 1 < int(self.request.params.max_new_tokens)

    def awaiting_frames(self) -> bool:
        """Submitted and no frame yet, or resumed and no new frame yet (not finished, not closing,
        not between a preemption's abort and its resubmission)."""
        if self._closed or self._finished or self._pending_priority is not None:
            return False
        return self._resumed_waiting or (self.submitted and self.frames_received == 0)

    async def preempt(self, priority: int) -> bool:
        """Abort the running code request and resume it at ``priority``. False when the segment
        is finished, closing, already being preempted, or has no step left."""
        if not self.preemptible():
            return False
        await self._restart(priority, requeue=False)
        return True

    async def requeue(self, priority: int) -> bool:
        """Resubmit the code request at ``priority`` while it waits for a batch slot (submitted,
        nothing received yet): a new place in the engine's queue, not a preemption. Frames that
        raced in before the abort become the prefix, as for ``preempt``. False when it is not
        waiting."""
        if not self.awaiting_frames():
            return False
        await self._restart(priority, requeue=True)
        return True

    async def _restart(self, priority: int, requeue: bool) -> None:
        self._pending_priority = int(priority)
        self._pending_requeue = requeue
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._pump = asyncio.create_task(self._run_pump(), name=f"resume {self.rid}")
        await self._code.abort(self.engine_rid)

    def _take(self, fr: CodeFrames) -> CodeFrames | None:
        """Record ``fr``'s frames; the preemption's own abort becomes a non-final frame (None if
        it carries no frames) and marks the current code request done."""
        n = int(fr.codes.shape[0]) if fr.codes is not None else 0
        if n:
            self._resumed_waiting = False
            self._parts.append(np.asarray(fr.codes, dtype=np.int64))
            self.frames_received += n
        if fr.finished:
            self._it_done = True
            if fr.finish_reason == "abort" and self._pending_priority is not None and not self._closed:
                return dataclasses.replace(fr, request_id=self.rid, finished=False, finish_reason=None) if n else None
            self._finished = True
        return dataclasses.replace(fr, request_id=self.rid) if fr.request_id != self.rid else fr

    async def _run_pump(self) -> None:
        q = self._queue
        assert q is not None
        try:
            async with self._lock:
                while True:
                    it = self._it
                    while it is not None and not self._it_done:
                        try:
                            fr = await anext(it)
                        except StopAsyncIteration:
                            self._it_done = True
                            break
                        out = self._take(fr)
                        if out is not None:
                            q.put_nowait(out)
                    await _aclose(it)
                    prio, self._pending_priority = self._pending_priority, None
                    if prio is None or self._finished or self._closed:
                        break
                    if self._pending_requeue:
                        self.requeues += 1
                    else:
                        self.preemptions += 1
                    prefix = np.concatenate(self._parts) if self._parts else None
                    if prefix is not None and len(prefix) >= int(self.request.params.max_new_tokens):
                        # every step arrived before the abort took effect: finished, not resumed
                        self._finished = True
                        q.put_nowait(CodeFrames(request_id=self.rid, codes=prefix[:0], finished=True,
                                                finish_reason="length"))
                        break
                    self.engine_rid = f"{self.rid}.p{self.preemptions + self.requeues}"
                    req = dataclasses.replace(
                        self.request, request_id=self.engine_rid, priority=prio, prefix_codes=prefix
                    )
                    self._it = self._code.generate(req)
                    self._it_done = False
                    self._resumed_waiting = True
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            q.put_nowait(exc)
        finally:
            q.put_nowait(_END)

    async def aclose(self) -> None:
        self._closed = True
        pump, self._pump = self._pump, None
        if pump is not None and not pump.done():
            pump.cancel()
            with contextlib.suppress(BaseException):
                await pump
        await _aclose(self._it)


async def _aclose(it: object) -> None:
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()


def _split_steps(pending: list[np.ndarray], n: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The first ``n`` steps of ``pending`` and the rest (arrays split where needed)."""
    take: list[np.ndarray] = []
    rest = list(pending)
    need = n
    while need > 0 and rest:
        head = rest.pop(0)
        if head.shape[0] <= need:
            take.append(head)
            need -= head.shape[0]
        else:
            take.append(head[:need])
            rest.insert(0, head[need:])
            need = 0
    return take, rest

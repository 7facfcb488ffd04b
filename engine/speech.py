"""``ChatTTSSpeech``: a ``CodeEngine`` (text -> code frames) + the streaming decoder -> PCM chunks.

Flow control: ``synthesize`` is an async generator pulled lazily. It reads code frames from
the code engine and runs a decoder forward only while the consumer is waiting for the next
chunk; when the consumer stops pulling, nothing more is read or decoded for that request
(the code engine's own stream buffers what the GPT keeps producing). Per request at most one
chunk of audio is decoded and not yet taken: the one being handed to the consumer. The
decoder's job queue (``DecoderClient``, bounded) is shared by all requests.

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
the crash itself. The code engine serializes its restarts (two speech engines over one code engine,
or a watchdog beside an operator, restart it once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
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
    ResumeMode,
    SpeechRequest,
    codes_to_bytes,
)
from engine.audio_format import SUPPORTED_RATES_HZ, StreamResampler, float_to_pcm16
from engine.decoder.window import ChunkPolicy, StreamLead

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.decoder.client import DecoderClient, SharedDecoder

_log = logging.getLogger(__name__)

_RESTART_POLL_S = 0.5
"""Watchdog: how often the code engine's health is read (a cheap attribute check)."""
_RESTART_BACKOFF_MAX_S = 60.0
def chunk_policy(cfg: EngineConfig, exact_lookahead_steps: int) -> ChunkPolicy:
    """The policy from the config; ``decoder_lookahead_steps`` < 0 (or absent) means exact."""
    la = int(getattr(cfg, "decoder_lookahead_steps", -1))
    if la < 0 or la > exact_lookahead_steps:
        la = exact_lookahead_steps
    return ChunkPolicy(cfg.first_chunk_steps, cfg.chunk_steps, la, full_chunks_below_x=cfg.full_chunks_below_x)


def build_decoder(cfg: EngineConfig, model_dir: str, device: str = "cpu", attach: SharedDecoder | None = None) -> DecoderClient:
    """A (not yet started) client of a decoder process for ``model_dir``'s vocoder on ``device``
    (``attach``: a ``SharedDecoder``, its share of a decoder process another process started)."""
    from engine.decoder.client import DecoderClient, DecoderSettings

    return DecoderClient(DecoderSettings(
        model_dir=str(model_dir), use_hidden=bool(cfg.use_hidden_decoder), device=str(device),
        chunk_steps=cfg.chunk_steps, lookahead_steps=cfg.decoder_lookahead_steps,
        left_steps=cfg.decoder_left_steps, max_batch=cfg.decoder_max_batch,
        slots=2 * cfg.max_num_seqs + 32, max_steps=cfg.max_model_len, torch_threads=cfg.decoder_torch_threads,
        dtype=cfg.decoder_dtype, compile=cfg.decoder_compile,
    ), attach)


class ChatTTSSpeech:
    """``SpeechEngine`` over a ``CodeEngine`` and a ``DecoderClient`` (see module docstring)."""

    native_sample_rate_hz = NATIVE_SAMPLE_RATE_HZ

    def __init__(self, code_engine: CodeEngine, decoder: DecoderClient, cfg: EngineConfig) -> None:
        self._code = code_engine
        self._decoder = decoder
        self._decode_counters: dict[str, float] = {"decode_jobs": 0.0, "decode_s": 0.0}
        self.name = code_engine.name
        self.use_hidden = bool(cfg.use_hidden_decoder)
        if self.use_hidden == decoder.uses_codes:
            raise ValueError("decoder path does not match engine.use_hidden_decoder")
        self._cfg = cfg
        self.policy = chunk_policy(cfg, 10**6)
        """Replaced at ``start`` once the decoder reports its geometry (the exact lookahead)."""
        self.exact = self.policy.lookahead_steps >= 10**6
        self._active: dict[str, asyncio.Event] = {}
        self.restart_on_crash = bool(getattr(cfg, "restart_on_crash", True))
        self.restart_backoff_s = max(0.0, float(getattr(cfg, "restart_backoff_s", 5.0)))
        self.restarting = False
        self.restarts_s: list[float] = []
        """Seconds each completed restart took (watchdog)."""
        self.resume_mode = (ResumeMode.CODES if getattr(code_engine, "supports_resume", False) and not self.use_hidden
                            else ResumeMode.SEGMENT)
        """CODES where the code engine continues from ``prefix_codes`` and the decoder vocodes codes
        (the hidden-state decoder would need the prefix's hidden states, which nobody keeps)."""
        self._watchdog: asyncio.Task[None] | None = None
        self._restart_task: asyncio.Task[bool] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        # A client of an engine core launched by another process (engine.vllm.launch) connects
        # first: that returns once the engine core is up, KV cache sized, so the decoder's GPU
        # memory is not taken while vLLM measures what it may use.
        shared = getattr(self._code, "shared", None) is not None
        if shared:
            await self._code.start()
        await self._decoder.start()
        geo = self._decoder.geometry
        assert geo is not None
        self.policy = chunk_policy(self._cfg, geo.exact_lookahead_steps)
        self.exact = self.policy.lookahead_steps >= geo.exact_lookahead_steps
        if not shared:
            await self._code.start()
        if self.restart_on_crash and self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watch(), name="engine watchdog")

    async def close(self) -> None:
        try:
            await self._stop_watchdog()
            await self._code.close()
        finally:
            await self._decoder.close()

    def health(self) -> EngineHealth:
        h = self._code.health()
        self._decoder.refresh_worker_counters()
        worker = {f"decoder_{k}": v for k, v in self._decoder.worker_counters.items()
                  if k in ("forwards", "rows", "padded_rows", "busy_s")}
        h = replace(h, counters={**h.counters, **self._decode_counters, **worker})
        if self.restarting:
            h = replace(h, healthy=False, detail="restarting after a crash" + (f" ({h.detail})" if h.detail else ""))
        if not self._decoder.healthy:
            return replace(h, healthy=False, detail=(h.detail + "; " if h.detail else "") + "decoder down")
        return h

    # ------------------------------------------------------------------ restart on crash

    async def _watch(self) -> None:
        """Poll the decoder and the code engine; replace the decoder process when it died, restart
        the code engine when, having been up, it reports itself dead (where it can restart)."""
        seen_up = False
        failures = 0
        can_restart = callable(getattr(self._code, "restart", None))
        while True:
            await asyncio.sleep(_RESTART_POLL_S)
            if not self._decoder.healthy:
                self._restart_task = asyncio.create_task(self._restart_decoder(), name="decoder restart")
                ok = await asyncio.shield(self._restart_task)
                self._restart_task = None
                if not ok:
                    failures += 1
                    await asyncio.sleep(min(_RESTART_BACKOFF_MAX_S, self.restart_backoff_s * 2 ** (failures - 1)))
                continue
            if not can_restart:
                continue
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
        if self._code.health().healthy:
            return True
        self.restarting = True
        t0 = time.monotonic()
        _log.warning("code engine %s unhealthy (%s): restarting", self.name, detail)
        try:
            # serialized by the code engine: one restarting already (another watchdog, an
            # operator) is waited for, not repeated
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
        _log.warning("code engine %s healthy again after %.1f s", self.name, took)
        return True

    async def _restart_decoder(self) -> bool:
        """A new decoder process for a dead one: this process starts its own again, or, for a share
        of a decoder process another process started (``DecoderClient.attach``), takes the share of
        its replacement from the code engine (``replacement_decoder``: the launcher's message).
        Streams of the dead one have failed already (``EngineErrorKind.UNRECOVERABLE``)."""
        from engine.decoder.client import DecoderClient

        old = self._decoder
        t0 = time.monotonic()
        _log.warning("decoder down (%s): starting a new decoder process", old.failed)
        try:
            attach = None
            if old.attach is not None:
                wait = getattr(self._code, "replacement_decoder", None)
                if wait is None:
                    raise EngineError("a shared decoder process died and nothing replaces it")
                attach = await wait()
            new = DecoderClient(old.settings, attach)
            await new.start()
        except Exception:
            _log.exception("decoder restart failed; retrying after a backoff")
            return False
        self._decoder = new
        await old.close()
        _log.warning("decoder healthy again after %.1f s", time.monotonic() - t0)
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
        await self._code.abort(request_id)

    # ------------------------------------------------------------------ synthesis

    def check_voice(self, voice: str | int) -> str | None:
        check = getattr(self._code, "check_speaker", None)
        return check(voice) if check is not None else None

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
        queued_s = max(0.0, request.queued_audio_ms) / 1000.0
        lead = StreamLead(SAMPLES_PER_STEP / NATIVE_SAMPLE_RATE_HZ,
                          queued_until_s=loop.time() + queued_s if queued_s else None)
        prefix = request.prefix_codes
        if prefix is not None and len(prefix):
            if self.resume_mode is not ResumeMode.CODES:
                raise EngineError(f"{self.name}: a segment cannot be resumed from its codes here")
            # the frames a client already has audio of: decoded again (the decoder's context), the
            # code engine continues after them and yields only the new ones
            pending.append(np.asarray(prefix, dtype=np.int64))
            received = len(prefix)
        heard_steps = float(received)
        codes: list[bytes] = []
        frames_iter: AsyncIterator[CodeFrames] = self._code.generate(request)
        finished = False
        t_arrival0: float | None = None
        arrival0 = 0
        try:
            async for frames in frames_iter:
                if aborted.is_set() or frames.finish_reason == "abort":
                    aborted.set()
                    break
                x = self._step_input(frames)
                if x is not None and x.shape[0]:
                    pending.append(x)
                    received += x.shape[0]
                    if self.resume_mode is ResumeMode.CODES:
                        codes.append(codes_to_bytes(x))
                    if t_arrival0 is None:
                        t_arrival0, arrival0 = loop.time(), received
                final = frames.finished
                now = loop.time()
                span = now - t_arrival0 if t_arrival0 is not None else 0.0
                # steps per second since this stream's first frames (its share of the engine)
                arrival = (received - arrival0) / span if span > 0.02 and received > arrival0 else None
                rate_x = arrival * lead.step_s if arrival else None
                while True:
                    n = policy.push_steps(received, decoded, final, lead.lead_steps(loop.time()), rate_x)
                    last = final and decoded + n == received
                    if not n and not last:
                        break
                    take, pending = _split_steps(pending, n)
                    audio = await self._push(stream, take, last, decoded + n)
                    decoded += n
                    steps_out = audio.shape[0] / SAMPLES_PER_STEP
                    unheard = min(steps_out, heard_steps)  # a resumed segment's prefix: the client has it
                    heard_steps -= unheard
                    lead.emitted(steps_out - unheard, loop.time())
                    pcm = self._encode(resampler, audio, last=last)
                    if last:
                        finished = True
                        yield AudioChunk(rid, pcm, rate, finished=True, steps=received - reported,
                                         codes=b"".join(codes))
                        return
                    if pcm:
                        yield AudioChunk(rid, pcm, rate, steps=decoded - reported, codes=b"".join(codes))
                        codes.clear()
                        reported = decoded
                if not final and t_arrival0 is not None:
                    # Nothing is due until the next chunk's steps are in: read the code stream once
                    # for them rather than once per GPT step (ChunkPolicy.idle_s). Barge-in wakes it.
                    now = loop.time()
                    wait_s = policy.idle_s(received, decoded, lead.lead_steps(now), lead.step_s, arrival)
                    if wait_s:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(aborted.wait(), wait_s)
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
                yield AudioChunk(rid, pcm, rate, finished=True, steps=received - reported, codes=b"".join(codes))
        finally:
            stream.close()
            self._active.pop(rid, None)
            aclose = getattr(frames_iter, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
            if not finished:
                with contextlib.suppress(Exception):
                    await self._code.abort(rid)

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
        t0 = time.monotonic()
        audio = await stream.push(x, final=final, emit_steps=emit)
        c = self._decode_counters
        c["decode_jobs"] += 1
        c["decode_s"] += time.monotonic() - t0
        return audio  # type: ignore[no-any-return]

    @staticmethod
    def _encode(resampler: StreamResampler, audio: np.ndarray, last: bool) -> bytes:
        return bytes(float_to_pcm16(resampler.process(audio, last=last)).tobytes())


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

"""``ChatTTSSpeech``: a ``CodeEngine`` (text -> code frames) + the streaming decoder -> PCM chunks.

Flow control: ``synthesize`` is an async generator pulled lazily. It reads code frames from
the code engine and runs a decoder forward only while the consumer is waiting for the next
chunk; when the consumer stops pulling, nothing more is read or decoded for that request
(the code engine's own stream buffers what the GPT keeps producing; the gateway's scheduler
lowers the priority of streams that are far ahead). Per request at most one chunk of audio
is decoded and not yet taken: the one being handed to the consumer. The decoder's job queue
(``BatchingDecoder``, bounded) is shared by all requests.

Chunking (``ChunkPolicy``): first audio once ``first_chunk_steps`` steps are audible, then
chunks growing to ``chunk_steps``; audio is ``lookahead_steps`` behind the newest step
(exact mode: the derived receptive field; the output then equals a whole-utterance decode).
The last chunk (``finished=True``) carries the flushed tail.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from engine.api import (
    NATIVE_SAMPLE_RATE_HZ,
    AudioChunk,
    CodeEngine,
    EngineError,
    EngineHealth,
    SpeechRequest,
)
from engine.audio_format import SUPPORTED_RATES_HZ, StreamResampler, float_to_pcm16
from engine.decoder.window import ChunkPolicy

if TYPE_CHECKING:
    from engine.decoder.batching import BatchingDecoder
    from voicegw.config import EngineConfig

_log = logging.getLogger(__name__)


def chunk_policy(cfg: EngineConfig, exact_lookahead_steps: int) -> ChunkPolicy:
    """The policy from the config; ``decoder_lookahead_steps`` < 0 (or absent) means exact."""
    la = int(getattr(cfg, "decoder_lookahead_steps", -1))
    if la < 0 or la > exact_lookahead_steps:
        la = exact_lookahead_steps
    return ChunkPolicy(cfg.first_chunk_steps, cfg.chunk_steps, la)


def build_decoder(cfg: EngineConfig, model_dir: str, device: str = "cpu") -> BatchingDecoder:
    """Load the vocoder of ``model_dir`` and wrap it in a (not yet started) ``BatchingDecoder``."""
    from engine.decoder.batching import BatchingDecoder
    from engine.decoder.nets import load_vocoder
    from engine.decoder.streaming import StreamingVocoder

    voc = load_vocoder(model_dir, use_hidden=cfg.use_hidden_decoder, device=device)
    return BatchingDecoder(
        StreamingVocoder(voc), max_batch=cfg.decoder_max_batch, batch_wait_ms=cfg.decoder_batch_wait_ms
    )


class ChatTTSSpeech:
    """``SpeechEngine`` over a ``CodeEngine`` and a ``BatchingDecoder`` (see module docstring)."""

    native_sample_rate_hz = NATIVE_SAMPLE_RATE_HZ

    def __init__(self, code_engine: CodeEngine, decoder: BatchingDecoder, cfg: EngineConfig) -> None:
        self._code = code_engine
        self._decoder = decoder
        self.name = code_engine.name
        self.use_hidden = bool(cfg.use_hidden_decoder)
        if self.use_hidden == decoder.core.vocoder.uses_codes:
            raise ValueError("decoder path does not match engine.use_hidden_decoder")
        self.policy = chunk_policy(cfg, decoder.geometry.exact_lookahead_steps)
        self.exact = self.policy.lookahead_steps >= decoder.geometry.exact_lookahead_steps
        self._active: dict[str, asyncio.Event] = {}

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self._decoder.start()
        await self._code.start()

    async def close(self) -> None:
        try:
            await self._code.close()
        finally:
            await self._decoder.close()

    def health(self) -> EngineHealth:
        h = self._code.health()
        if not self._decoder.healthy:
            return replace(h, healthy=False, detail=(h.detail + "; " if h.detail else "") + "decoder down")
        return h

    async def abort(self, request_id: str) -> None:
        ev = self._active.get(request_id)
        if ev is not None:
            ev.set()
        await self._code.abort(request_id)

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
                if not policy.ready(received, decoded, final):
                    continue
                audio = await self._push(stream, pending, final, received)
                pending, decoded = [], received
                pcm = self._encode(resampler, audio, last=final)
                if final:
                    finished = True
                    yield AudioChunk(rid, pcm, rate, finished=True, steps=received - reported)
                    return
                if pcm:
                    yield AudioChunk(rid, pcm, rate, steps=received - reported)
                    reported = received
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
        sd = self._decoder.core.step_dim
        dtype = np.float32 if self.use_hidden else np.int64
        x = np.concatenate(pending) if pending else np.zeros((0, sd), dtype)
        emit = None if (self.exact or final) else self.policy.emit_steps(received)
        return await stream.push(x, final=final, emit_steps=emit)  # type: ignore[no-any-return]

    @staticmethod
    def _encode(resampler: StreamResampler, audio: np.ndarray, last: bool) -> bytes:
        return bytes(float_to_pcm16(resampler.process(audio, last=last)).tobytes())

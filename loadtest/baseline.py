"""The "native pipeline" baseline as a SpeechEngine: upstream ChatTTS as its users run it.

``NativePipelineSpeech`` serves each request with upstream ``Chat.infer(text, stream=True)``:
one request at a time (FIFO; priorities ignored), upstream's own streaming (every
``stream_batch`` = 24 GPT steps it RE-DECODES the whole sequence so far and yields the new tail;
the first ``pass_first_n_batches`` = 2 yields are skipped, so first audio comes after 72 steps),
upstream defaults otherwise. It is what the gateway would give with no engine of its own: the
comparison ``python -m loadtest compare`` runs the same gateway, protocol and clients against it.

Documented choices (each favours the baseline): ``skip_refine_text=True`` (refinement is not
streamable and adds its whole duration), text normalisation and homophone replacement off (they
drop digits/symbols and cost seconds on first use), ``split_text=False`` (the gateway already
segments). Speaker and sampling parameters map as in ``engine.reference``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np

from engine.api import (
    NATIVE_SAMPLE_RATE_HZ,
    AudioChunk,
    EngineError,
    EngineErrorKind,
    EngineHealth,
    ResumeMode,
    SpeechRequest,
)

_log = logging.getLogger(__name__)

#: Audio pieces buffered between the worker thread and the caller.
_QUEUE_ITEMS = 16
#: Requests allowed to wait for the single worker (beyond: EngineOverloaded).
MAX_WAITING = 256


class NativePipelineSpeech:
    """Upstream ``Chat.infer(stream=True)``, one request at a time, off the event loop."""

    name = "chattts-native"
    native_sample_rate_hz = NATIVE_SAMPLE_RATE_HZ
    resume_mode = ResumeMode.SEGMENT

    def __init__(self, model_dir: str | Path, default_speaker: str | int | None = "2222", device: str = "cpu",
                 chat: Any = None) -> None:
        self.model_dir = Path(model_dir)
        self.default_speaker = default_speaker
        self.device = device
        self._chat = chat
        self._hidden = 0
        self._lock = asyncio.Lock()
        self._running: dict[str, threading.Event] = {}
        self._waiting = 0
        self._error: str | None = None

    def check_voice(self, voice: str | int) -> str | None:
        return None

    async def start(self) -> None:
        from engine.prompt import read_model_info
        from engine.reference import load_chat

        self._hidden = read_model_info(self.model_dir).hidden_size
        if self._chat is None:
            try:
                self._chat = await asyncio.to_thread(load_chat, self.model_dir, self.device)
            except Exception as exc:
                self._error = f"native pipeline load failed: {exc!r}"
                raise EngineError(self._error, EngineErrorKind.UNRECOVERABLE) from exc

    async def close(self) -> None:
        for ev in self._running.values():
            ev.set()
        self._chat = None

    def health(self) -> EngineHealth:
        ok = self._chat is not None and self._error is None
        return EngineHealth(self.name, ok, len(self._running), self._error or ("" if ok else "not started"))

    async def abort(self, request_id: str) -> None:
        ev = self._running.get(request_id)
        if ev is not None:
            ev.set()

    def _params(self, request: SpeechRequest) -> Any:
        from engine.speaker import SpeakerError, resolve_speaker

        p = request.params
        try:
            spk = resolve_speaker(request.speaker if request.speaker is not None else self.default_speaker,
                                  self._hidden)
        except SpeakerError as exc:
            raise EngineError(f"bad speaker: {exc}", EngineErrorKind.RECOVERABLE) from None
        return self._chat.InferCodeParams(
            spk_emb=None if spk is None else spk.encoded(),
            temperature=max(1e-6, float(p.temperature)),
            top_P=float(p.top_p),
            top_K=int(p.top_k),
            repetition_penalty=float(p.repetition_penalty),
            max_new_token=int(p.max_new_tokens),
            min_new_token=max(1, int(min(p.min_new_tokens, p.max_new_tokens))),
            show_tqdm=False,
            manual_seed=p.seed,
        )

    def _run(self, text: str, params: Any, stop: threading.Event, put: Any) -> None:
        import torch

        chat = self._chat
        with torch.no_grad():
            gen = chat.infer([text], stream=True, skip_refine_text=True, split_text=False,
                             do_text_normalization=False, do_homophone_replacement=False,
                             params_infer_code=params)
            for wavs in gen:
                if stop.is_set():
                    chat.interrupt()
                    break
                wav = np.asarray(wavs[0] if np.ndim(wavs) > 1 else wavs, dtype=np.float32).reshape(-1)
                if wav.size:
                    put(wav, False)
        put(np.zeros(0, dtype=np.float32), True)

    def synthesize(self, request: SpeechRequest) -> AsyncIterator[AudioChunk]:
        return self._gen(request)

    async def _gen(self, request: SpeechRequest) -> AsyncIterator[AudioChunk]:
        from engine.api import EngineOverloaded
        from engine.audio_format import StreamResampler, pcm16_bytes

        if self._chat is None:
            raise EngineError(self._error or "engine not started", EngineErrorKind.UNRECOVERABLE)
        text = request.text.strip()
        if not text:
            raise EngineError("empty text", EngineErrorKind.RECOVERABLE)
        rid = request.request_id
        if rid in self._running:
            raise EngineError(f"duplicate request id {rid}", EngineErrorKind.RECOVERABLE)
        if self._waiting >= MAX_WAITING:
            raise EngineOverloaded("native pipeline queue full")
        params = self._params(request)
        rate = request.sample_rate_hz
        stop = threading.Event()
        self._running[rid] = stop
        self._waiting += 1
        acquired = False
        try:
            async with self._lock:
                acquired = True
                self._waiting -= 1
                if stop.is_set():
                    yield AudioChunk(rid, b"", rate, finished=True)
                    return
                loop = asyncio.get_running_loop()
                queue: asyncio.Queue[tuple[np.ndarray, bool]] = asyncio.Queue(_QUEUE_ITEMS)

                def put(wav: np.ndarray, done: bool) -> None:
                    if stop.is_set() and not done:
                        return
                    asyncio.run_coroutine_threadsafe(queue.put((wav, done)), loop).result()

                resampler = StreamResampler(NATIVE_SAMPLE_RATE_HZ, rate)
                task = loop.run_in_executor(None, self._run, text, params, stop, put)
                try:
                    while True:
                        get = asyncio.ensure_future(queue.get())
                        waitables: set[asyncio.Future[Any]] = {get, task}
                        done_set, _ = await asyncio.wait(waitables, return_when=asyncio.FIRST_COMPLETED)
                        if get not in done_set:
                            get.cancel()
                            exc = task.exception()
                            if exc is not None:
                                raise EngineError(f"native pipeline failed: {exc!r}",
                                                  EngineErrorKind.RECOVERABLE) from exc
                            if queue.empty():
                                yield AudioChunk(rid, pcm16_bytes(resampler.process(np.zeros(0, np.float32), True)),
                                                 rate, finished=True)
                                return
                            continue
                        wav, done = get.result()
                        out = resampler.process(wav, last=done)
                        yield AudioChunk(rid, pcm16_bytes(out), rate, finished=done)
                        if done:
                            return
                finally:
                    stop.set()
                    while not task.done():  # the thread stops within one stream batch
                        while not queue.empty():
                            queue.get_nowait()
                        await asyncio.sleep(0.005)
        finally:
            if not acquired:
                self._waiting -= 1
            if self._running.get(rid) is stop:
                del self._running[rid]

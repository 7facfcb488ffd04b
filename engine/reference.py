"""``ReferenceCodeEngine``: upstream ``chattts`` in-process (the oracle and the baseline).

Runs ``Chat._infer_code`` (the code stage of ``Chat.infer`` with ``skip_refine_text=True``,
no text normalization, ``use_decoder=False``-style code output) one request at a time in a
worker thread, streaming every step (``stream_batch=1``). Frames carry the GPT's last hidden
state too (upstream returns them).

Differences from calling ``Chat.infer`` directly, all documented choices:

* temperature 0 (greedy) is run as temperature ``GREEDY_TEMPERATURE`` (upstream divides by
  the temperature; a tiny one makes its multinomial pick the argmax);
* EOS is blocked at step 0 (``min_new_token >= 1``): upstream regenerates the whole request
  when EOS comes first, which loops forever when decoding is greedy;
* ``ignore_eos`` blocks EOS for the whole request (``min_new_token = max_new_token``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np

from engine.api import CodeFrames, EngineError, EngineErrorKind, EngineHealth, SpeechRequest
from engine.config import EngineConfig
from engine.prompt import read_model_info
from engine.speaker import BAD_SPEAKER, SpeakerError, resolve_speaker

_log = logging.getLogger(__name__)

#: Temperature used for greedy requests (see module docstring).
GREEDY_TEMPERATURE = 1e-6
#: Frames buffered between the worker thread and the caller before the thread waits.
_QUEUE_FRAMES = 64


def load_chat(model_dir: str | Path, device: str = "cpu") -> Any:
    """Upstream ``Chat`` on any checkpoint in upstream layout, released or random.

    The released checkpoint passes upstream's own sha256 check; a random one (other hashes,
    possibly other sizes) gets its own hash map and a config resized from its files.
    """
    import ChatTTS
    import torch

    from engine._compat import ensure_torch_companions


    ensure_torch_companions()  # before anything imports transformers, vocos or chattts
    from engine.checkpoint import FULL, load_spec, sha256_map, speaker_stat, upstream_configs

    spec = load_spec(model_dir)
    chat = ChatTTS.Chat(logging.getLogger("chattts.reference"))
    own = sha256_map(model_dir)
    if own != {k: chat.sha256_map.get(k) for k in own}:
        chat.sha256_map = own
    if spec != FULL:
        cfgs = upstream_configs(spec)
        c = chat.config
        for k, v in cfgs["dvae_decoder"].items():
            setattr(c.dvae.decoder, k, v)
        for k, v in cfgs["dvae_encoder"].items():
            setattr(c.dvae.encoder, k, v)
        for k, v in cfgs["decoder"].items():
            setattr(c.decoder, k, v)
        for k, v in cfgs["vocos_backbone"].items():
            setattr(c.vocos.backbone.init_args, k, v)
        c.vocos.head.init_args.dim = spec.vocos_dim
        c.gpt.hidden_size = spec.gpt_hidden
        c.gpt.intermediate_size = spec.gpt_intermediate
        c.gpt.num_attention_heads = spec.gpt_heads
        c.gpt.num_hidden_layers = spec.gpt_layers
        c.embed.hidden_size = spec.gpt_hidden
        c.spk_stat = speaker_stat(spec.gpt_hidden)
    ok = chat.load(source="custom", custom_path=str(model_dir), device=torch.device(device), compile=False)
    if not ok:
        raise EngineError(f"upstream chattts failed to load {model_dir}", EngineErrorKind.UNRECOVERABLE)
    return chat


class _Abort(Exception):
    pass


class ReferenceCodeEngine:
    """Upstream chattts, one request at a time, off the event loop."""

    name = "chattts-reference"

    def __init__(self, model_dir: str | Path, cfg: EngineConfig, *, chat: Any = None) -> None:
        self.model_dir = Path(model_dir)
        self.cfg = cfg
        self.info = read_model_info(self.model_dir)
        self._chat = chat
        self._lock = asyncio.Lock()  # one request at a time
        self._running: dict[str, threading.Event] = {}
        self._waiting = 0
        self._error: str | None = None

    async def start(self) -> None:
        if self._chat is None:
            device = "cpu" if self.cfg.device in ("auto", "cpu") else self.cfg.device
            try:
                self._chat = await asyncio.to_thread(load_chat, self.model_dir, device)
            except EngineError:
                raise
            except Exception as exc:
                self._error = f"reference load failed: {exc!r}"
                raise EngineError(self._error, EngineErrorKind.UNRECOVERABLE) from exc
        self._error = None

    async def close(self) -> None:
        for ev in self._running.values():
            ev.set()
        self._chat = None

    def health(self) -> EngineHealth:
        ok = self._chat is not None and self._error is None
        return EngineHealth(
            self.name, ok, len(self._running) + self._waiting, self._error or ("" if ok else "not started")
        )

    async def abort(self, request_id: str) -> None:
        ev = self._running.get(request_id)
        if ev is not None:
            ev.set()

    def check_speaker(self, value: str | int) -> str | None:
        """Why ``value`` is not a speaker this model can use (a fixed phrase), or None."""
        try:
            resolve_speaker(value, self.info.hidden_size)
        except SpeakerError:
            return BAD_SPEAKER
        return None

    def _params(self, request: SpeechRequest) -> Any:
        chat = self._chat
        p = request.params
        try:
            spk = resolve_speaker(request.speaker if request.speaker is not None else self.cfg.default_speaker,
                                  self.info.hidden_size)
        except SpeakerError as exc:
            raise EngineError(f"bad speaker: {exc}", EngineErrorKind.RECOVERABLE) from None
        min_new = p.max_new_tokens if p.ignore_eos else max(1, p.min_new_tokens)
        return chat.InferCodeParams(
            prompt="[speed_5]",
            spk_emb=None if spk is None else spk.encoded(),
            temperature=GREEDY_TEMPERATURE if p.temperature <= 0 else float(p.temperature),
            top_P=float(p.top_p),
            top_K=int(p.top_k) if p.top_k > 0 else self.info.num_audio_tokens,
            repetition_penalty=float(p.repetition_penalty),
            max_new_token=int(p.max_new_tokens),
            min_new_token=int(min(min_new, p.max_new_tokens)),
            show_tqdm=False,
            ensure_non_empty=True,
            manual_seed=p.seed,
            stream_batch=1,
        )

    def _run(self, request: SpeechRequest, params: Any, stop: threading.Event, put: Any) -> None:
        """Worker thread: upstream generation, one ``put(codes, hidden, done, reason)`` per step."""
        import torch

        chat = self._chat
        chat.context.set(False)
        emitted = 0
        n = 0
        text = request.text.strip()
        with torch.no_grad():
            gen = chat._infer_code([text], True, chat.device, True, params)
            for result in gen:
                ids = result.ids[0]
                hid = result.hiddens[0] if result.hiddens else None
                n = int(ids.shape[0])
                if n > emitted:
                    codes = ids[emitted:n].to(torch.int64).cpu().numpy()
                    hidden = None if hid is None else hid[emitted:n].to(torch.float32).cpu().numpy()
                    put(codes, hidden, False, None)
                    emitted = n
                if stop.is_set():
                    chat.context.set(True)
        reason = "abort" if stop.is_set() else ("length" if n >= params.max_new_token else "eos")
        put(np.zeros((0, self.info.num_vq), dtype=np.int64), None, True, reason)

    async def generate(self, request: SpeechRequest) -> AsyncIterator[CodeFrames]:
        if self._chat is None:
            raise EngineError(self._error or "engine not started", EngineErrorKind.UNRECOVERABLE)
        if not request.text.strip():
            raise EngineError("empty text", EngineErrorKind.RECOVERABLE)
        if request.request_id in self._running:
            raise EngineError(f"duplicate request id {request.request_id}", EngineErrorKind.RECOVERABLE)
        params = self._params(request)
        stop = threading.Event()
        rid = request.request_id
        self._running[rid] = stop
        self._waiting += 1
        acquired = False
        try:
            async with self._lock:
                acquired = True
                self._waiting -= 1
                if stop.is_set():
                    yield CodeFrames(rid, np.zeros((0, self.info.num_vq), dtype=np.int64), None, True, "abort")
                    return
                loop = asyncio.get_running_loop()
                queue: asyncio.Queue[tuple[Any, Any, bool, str | None]] = asyncio.Queue(_QUEUE_FRAMES)

                def put(codes: Any, hidden: Any, done: bool, reason: str | None) -> None:
                    fut = asyncio.run_coroutine_threadsafe(queue.put((codes, hidden, done, reason)), loop)
                    fut.result()

                task = loop.run_in_executor(None, self._run, request, params, stop, put)
                try:
                    while True:
                        get = asyncio.ensure_future(queue.get())
                        waits: set[asyncio.Future[Any]] = {get, task}
                        done_set, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                        if get in done_set:
                            codes, hidden, done, reason = get.result()
                            yield CodeFrames(rid, codes, hidden, done, reason)
                            if done:
                                break
                        else:
                            get.cancel()
                            exc = task.exception()
                            if exc is not None:
                                raise EngineError(f"reference generation failed: {exc!r}",
                                                  EngineErrorKind.RECOVERABLE) from exc
                            # Thread finished: drain what it left.
                            while not queue.empty():
                                codes, hidden, done, reason = queue.get_nowait()
                                yield CodeFrames(rid, codes, hidden, done, reason)
                                if done:
                                    return
                            return
                finally:
                    stop.set()
                    # Let the thread finish (it stops within one step) so the lock is honest.
                    while not task.done():
                        while not queue.empty():
                            queue.get_nowait()
                        await asyncio.sleep(0.005)
        finally:
            if not acquired:
                self._waiting -= 1
            if self._running.get(rid) is stop:
                del self._running[rid]

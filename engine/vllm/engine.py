"""``VllmCodeEngine``: ChatTTS codes from stock vLLM's ``AsyncLLM`` (v1 engine).

Per request: our own prompt ids (``skip_tokenizer_init``), the speaker vector and ChatTTS
sampling parameters in ``SamplingParams.extra_args`` (read in the worker by
:class:`engine.vllm.logits.ChatTTSLogitsProcessor`), ``cache_salt`` per speaker.

Codebooks 1..3 reach this process through the frame table of :mod:`engine.vllm.channel`:
every request holds a slot of it for its life; vLLM's token ``k`` (codebook 0) tells which
entry to read, and the entry names its generation and codebook 0, so a stale entry is never
taken for the request's own. vLLM samples greedily from a one-hot row (the model samples all
four codebooks itself) and computes no logprobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import hashlib
import importlib.util
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np

from engine.api import (
    CodeFrames,
    EngineError,
    EngineErrorKind,
    EngineHealth,
    SamplingParams,
    SpeechRequest,
)
from engine.config import EngineConfig
from engine.prompt import CodeModelInfo, PromptBuilder
from engine.speaker import BAD_SPEAKER, ResolvedSpeaker, SpeakerError, resolve_speaker
from engine.vllm._env import child_env, prepare
from engine.vllm.channel import ENV_KEY, FrameTable, TableSpec
from engine.vllm.state import EXTRA_KEY, RequestParams, encode_vector

_log = logging.getLogger(__name__)

#: Most per-request stats kept for inspection (``request_stats``).
_STATS_KEPT = 1024
#: How long a token's frame-table entry may stay unreadable before the request fails (it is
#: written before vLLM copies the token out, so a miss means a broken channel, not a race).
_FRAME_WAIT_S = 2.0


@dataclasses.dataclass
class _Live:
    aborted: bool = False


@dataclasses.dataclass(frozen=True)
class SharedClient:
    """This front end's share of an engine core launched by another process
    (:mod:`engine.vllm.launch`): vLLM's multi-client front end, one client per gateway process."""

    client_config: dict[str, Any]
    """What vLLM's ``AsyncLLM`` takes as ``client_addresses`` (its ZMQ endpoints, index, count)."""
    index: int
    """This client's index, ``0 .. count-1``."""
    count: int
    """Front ends sharing the engine core."""
    table_env: str
    """The frame table (``TableSpec.to_env``), created by the launching process."""
    slot_lo: int
    """First frame-table slot this front end hands out."""
    slot_hi: int
    """One past its last slot (slot ranges of the clients do not overlap)."""
    loads: Any
    """``multiprocessing.RawArray('q', count)``: requests each front end holds (summed for
    ``health().running_requests``, which admission control reads as the engine's load)."""
    decoder: Any = None
    """``engine.decoder.client.SharedDecoder``: this process's share of the group's one decoder
    process (None: the gateway process starts its own)."""
    control: Any = None
    """``multiprocessing`` Connection (receiving end) from the launcher: ``{"event": "dead"}`` when
    the engine core died (vLLM's client of an engine core it did not start cannot see that), then
    ``{"event": "core", "client_config": ...}`` for the engine core started in its place
    (``VllmCodeEngine.restart``); ``{"event": "decoder", "share": SharedDecoder}`` for a decoder
    process started in place of a dead one (``VllmCodeEngine.replacement_decoder``). None: a dead
    engine core or decoder process is unrecoverable."""


def _detect_device(cfg: EngineConfig) -> str:
    if cfg.device != "auto":
        return cfg.device
    try:
        from vllm.platforms import current_platform

        return "cpu" if current_platform.is_cpu() else "cuda"
    except Exception:  # noqa: BLE001
        return "cpu"


def effective_min_new(p: SamplingParams) -> int:
    """EOS is never allowed at step 0 (upstream silently regenerates then), and ``ignore_eos``
    blocks it for the whole request."""
    if p.ignore_eos:
        return p.max_new_tokens
    return max(1, p.min_new_tokens)


_ENV_LOCK = threading.Lock()
"""Serializes the environment patch of engine construction (``VllmCodeEngine._construct``)."""
#: A shared engine core's first reply to a client (``_first_contact``): deadline.
_FIRST_CONTACT_S = 120.0
#: A client of a shared engine core that died: how long ``restart`` waits for the launcher's
#: replacement (its engine core's start included).
_NEW_CORE_WAIT_S = 600.0


class _PrefixComplete(EngineError):
    """``prefix_codes`` as long as the request may run: the segment had reached its length."""


class VllmCodeEngine:
    """ChatTTS GPT inside vLLM. See the module docstring."""

    name = "chattts-vllm"
    #: ``SpeechRequest.prefix_codes`` (resume an aborted segment) is honoured.
    supports_resume = True

    def __init__(
        self,
        model_dir: str | Path,
        cfg: EngineConfig,
        *,
        kv_cache_bytes: int | None = None,
        engine_args: dict[str, Any] | None = None,
        warmup: bool = True,
        shared: SharedClient | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.shared = shared
        #: vLLM request ids must be unique over every front end of a shared engine core.
        self._rid_prefix = f"c{shared.index}-" if shared is not None else ""
        self.cfg = cfg
        self._kv_cache_bytes = kv_cache_bytes
        self._extra_args = dict(engine_args or {})
        self._warmup = warmup
        self._prompts = PromptBuilder(self.model_dir)
        self.info: CodeModelInfo = self._prompts.info
        self._llm: Any = None
        self._live: dict[str, _Live] = {}
        self._counters: dict[str, float] = dict.fromkeys(("requests", "first_outputs", "ttft_s", "steps", "outputs"), 0.0)
        self._stats: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._dead: str | None = None
        self._restart_lock = asyncio.Lock()
        self._control_task: asyncio.Task[None] | None = None
        self._replacement: dict[str, Any] | None = None
        self._replaced = asyncio.Event()
        self._decoder_share: Any = None
        """The newest decoder share the launcher sent (``SharedDecoder``), not yet taken."""
        self._decoder_sent = asyncio.Event()
        self._speakers: OrderedDict[str, ResolvedSpeaker | None] = OrderedDict()
        self.device = _detect_device(cfg)
        self.start_seconds: float | None = None
        self.start_breakdown: dict[str, float] = {}
        self._table: FrameTable | None = None

    # ------------------------------------------------------------------ lifecycle

    def engine_args(self) -> Any:
        prepare()
        from vllm.engine.arg_utils import AsyncEngineArgs

        from engine.vllm.logits import logits_processor_fqcn
        from engine.vllm.plugin import ARCHITECTURE

        info = self.info
        dtype = self.cfg.dtype
        if dtype == "auto":
            dtype = "float32" if self.device == "cpu" else "bfloat16"
        max_len = min(self.cfg.max_model_len, info.max_positions)
        args: dict[str, Any] = dict(
            model=str(self.model_dir / "asset" / "gpt"),
            skip_tokenizer_init=True,
            dtype=dtype,
            max_model_len=max_len,
            max_num_seqs=self.cfg.max_num_seqs,
            max_num_batched_tokens=max(self.cfg.max_num_batched_tokens, 16),
            enable_chunked_prefill=self.cfg.enable_chunked_prefill,
            enable_prefix_caching=self.cfg.enable_prefix_caching,
            enforce_eager=self.cfg.enforce_eager,
            logits_processors=[logits_processor_fqcn()],
            worker_extension_cls="engine.vllm.worker_ext.ChatTTSWorkerExtension",
            generation_config="vllm",
            disable_log_stats=True,
            seed=0,
            hf_overrides={
                "architectures": [ARCHITECTURE],
                "vocab_size": info.unified_vocab_size,
                "chattts_num_text_tokens": info.num_text_tokens,
                "chattts_num_audio_tokens": info.num_audio_tokens,
                "chattts_num_vq": info.num_vq,
                "chattts_spk_emb_id": info.spk_emb_id,
                "chattts_embed_path": str((self.model_dir / "asset" / "Embed.safetensors").resolve()),
            },
        )
        if self.device == "cpu":
            kv = self._kv_cache_bytes or int(self.cfg.kv_cache_gib * 2**30)
            args["kv_cache_memory_bytes"] = kv
        else:
            args["gpu_memory_utilization"] = self.cfg.gpu_memory_utilization
            if self._kv_cache_bytes:
                args["kv_cache_memory_bytes"] = self._kv_cache_bytes
            args["async_scheduling"] = self.cfg.async_scheduling
            # The step keeps all state on the device (no host reads): vLLM's default CUDA-graph
            # mode (FULL for decode batches, PIECEWISE for mixed ones) applies.
        if self.cfg.data_parallel_size > 1:
            # vLLM's internal load balancing: one engine-core process per rank, requests routed
            # to the least loaded one (dense model: ranks step independently, no collective).
            args["data_parallel_size"] = self.cfg.data_parallel_size
        args.update(self._extra_args)
        known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        dropped = sorted(k for k in args if k not in known)
        if dropped:
            _log.warning("vLLM %s lacks engine args %s; ignored", _vllm_version(), dropped)
        return AsyncEngineArgs(**{k: v for k, v in args.items() if k in known})

    async def start(self) -> None:
        if self._llm is not None:
            return
        t0 = time.monotonic()
        if self._table is None and self.shared is not None:
            sh = self.shared
            self._table = FrameTable.attach_range(TableSpec.from_env(sh.table_env), sh.slot_lo, sh.slot_hi)
        if self._table is None:
            # Outlives engine restarts: the new engine-core processes map it again.
            self._table = FrameTable(self.frame_table_slots(), min(self.cfg.max_model_len, self.info.max_positions))
        env: dict[str, str | None] = {**self.launch_env(), ENV_KEY: self._table.spec.to_env(), **child_env()}
        self._llm = await asyncio.to_thread(self._construct, env)
        self._dead = None
        if self.shared is not None:
            if self.shared.control is not None and self._control_task is None:
                self._control_task = asyncio.create_task(self._listen_to_launcher(), name="launcher messages")
            try:
                await self._first_contact(self._llm)
            except BaseException:
                # not left in place looking healthy: a request would wait for good on a core
                # that never answered this client
                await self._shutdown()
                self._dead = "the shared engine core did not answer this client"
                raise
        t1 = time.monotonic()
        if self._warmup:
            await self._warm()
        t2 = time.monotonic()
        self.start_seconds = t2 - t0
        self.start_breakdown = {"construct_s": t1 - t0, "warmup_s": t2 - t1}
        _log.info(
            "vLLM code engine ready in %.1f s (engine %.1f s, warm-up %.1f s; %s, vLLM %s)",
            self.start_seconds, t1 - t0, t2 - t1, self.device, _vllm_version(),
        )

    def launch_env(self) -> dict[str, str | None]:
        """Environment the engine-core processes start with (None: removed), besides the frame
        table's ``ENV_KEY`` and ``child_env()``."""
        env: dict[str, str | None] = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
        if self.device != "cpu" and importlib.util.find_spec("flashinfer") is None:
            env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        if self.device == "cpu" and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ:
            # Cores kept out of the worker's spinning OpenMP pool (EngineConfig.cpu_reserved_cores:
            # the decoder and the gateway run there). The user's env setting wins.
            reserved = max(0, self.cfg.cpu_reserved_cores)
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(min(reserved, max(0, (os.cpu_count() or 1) - 1)))
        if self.device == "cpu":
            # The legacy VLLM_CPU_KVCACHE_SPACE overrides kv_cache_memory_bytes inside vLLM; our
            # size (EngineConfig.kv_cache_gib or the constructor's kv_cache_bytes) must win.
            env["VLLM_CPU_KVCACHE_SPACE"] = None  # removed while vLLM starts
        return env

    def _construct(self, env: dict[str, str | None]) -> Any:
        prepare()
        from vllm.v1.engine.async_llm import AsyncLLM

        from engine.vllm.plugin import register

        register()  # this process; spawned ones register via the entry point or _boot/

        # The environment is the process's: two engines constructing at once (a restart beside a
        # start) would each save the other's patch as "original" and one would leave it behind.
        with _ENV_LOCK:
            saved = {k: os.environ.get(k) for k in env}
            for k, val in env.items():
                if val is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = val
            try:
                if self.shared is None:
                    return AsyncLLM.from_engine_args(self.engine_args())
                return self._connect(AsyncLLM)
            finally:
                for k, v in saved.items():
                    if k == "VLLM_USE_V2_MODEL_RUNNER":
                        continue  # vLLM may read it lazily in this process too; keep it
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v

    def _connect(self, async_llm: Any) -> Any:
        """A client of the engine core another process launched (``SharedClient``)."""
        from vllm.usage.usage_lib import UsageContext

        sh = self.shared
        assert sh is not None
        args = self.engine_args()
        args._api_process_count = sh.count
        args._api_process_rank = sh.index
        vllm_config = args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        return async_llm.from_vllm_config(
            vllm_config,
            disable_log_stats=True,
            client_addresses=sh.client_config,
            client_count=sh.count,
            client_index=sh.index,
        )

    def _set_live(self, rid: str, live: _Live | None) -> None:
        if live is None:
            self._live.pop(rid, None)
        else:
            self._live[rid] = live
        if self.shared is not None:
            self.shared.loads[self.shared.index] = len(self._live)

    def running_requests(self) -> int:
        """Requests the engine core holds: this front end's, plus the other front ends' when shared."""
        if self.shared is None:
            return len(self._live)
        return int(sum(self.shared.loads))

    async def _first_contact(self, llm: Any) -> None:
        """A client of a shared engine core: the engine core's first reply (vLLM asks it for its
        supported tasks before a client's first request, then caches the answer) within
        ``_FIRST_CONTACT_S``, else an unrecoverable error: the gateway process exits and the
        launcher stops the group (exit 1) instead of a group silently short of a process."""
        ask = getattr(llm, "get_supported_tasks", None)
        if ask is None:
            return
        try:
            await asyncio.wait_for(ask(), _FIRST_CONTACT_S)
        except TimeoutError:
            raise EngineError(f"the shared engine core did not answer this client in {_FIRST_CONTACT_S:.0f} s",
                              EngineErrorKind.UNRECOVERABLE) from None

    async def _warm(self) -> None:
        """Short requests that run first-use paths before real traffic: greedy and sampled, with
        and without a seed, alone and then three in one batch. vLLM's logprob-rank kernel is a
        ``torch.compile`` function (inductor on CPU): compiled for batch size 1 at its first call
        and compiled again, shape-generic, at its first call with a larger batch. On CPU each
        compile runs g++ for seconds; left to live traffic it stalls every stream in the batch
        (a freeze long enough to underrun a listener when a second stream joins)."""

        async def one(i: int, temp: float, seed: int | None) -> None:
            req = SpeechRequest(
                request_id=f"__warmup-{i}-{time.monotonic_ns()}",
                text="warm up",
                speaker=0,
                params=SamplingParams(temperature=temp, max_new_tokens=3, min_new_tokens=3, seed=seed),
            )
            async for _ in self.generate(req):
                pass

        await one(0, 0.0, 1)
        await one(1, 0.3, 1)
        await asyncio.gather(one(2, 0.0, 1), one(3, 0.3, None), one(4, 0.3, 2))

    def frame_table_slots(self) -> int:
        """Requests this engine holds at once (running and queued in vLLM); more wait here."""
        return 4 * self.cfg.max_num_seqs + 64

    async def restart(self) -> None:
        """A new engine core (warm-up included) for a dead one. Callers are serialized: one that
        waited while another restarted finds the engine healthy and returns (two restarts at once
        would shut down the engine the other just built, minutes later, under live traffic).
        A client of a shared engine core does not start one: it waits for the launcher's
        replacement (``SharedClient.control``: the new core's client config) and connects to it."""
        async with self._restart_lock:
            if self._llm is not None and self.health().healthy:
                return
            if self.shared is not None and self.shared.control is None:
                raise EngineError("the shared engine core died and none replaces it", EngineErrorKind.UNRECOVERABLE)
            await self._shutdown()
            if self.shared is not None:
                try:
                    await asyncio.wait_for(self._replaced.wait(), _NEW_CORE_WAIT_S)
                except TimeoutError:
                    raise EngineError(f"no new engine core from the launcher in {_NEW_CORE_WAIT_S:.0f} s",
                                      EngineErrorKind.UNRECOVERABLE) from None
                config, self._replacement = self._replacement, None
                self._replaced.clear()
                assert config is not None
                self.shared = dataclasses.replace(self.shared, client_config=config)
            await self.start()

    async def replacement_decoder(self) -> Any:
        """This process's share (``SharedDecoder``) of the decoder process the launcher started in
        place of a dead one (``SharedClient.control``), once it has been sent."""
        if self.shared is None or self.shared.control is None:
            raise EngineError("the shared decoder process died and none replaces it", EngineErrorKind.UNRECOVERABLE)
        try:
            await asyncio.wait_for(self._decoder_sent.wait(), _NEW_CORE_WAIT_S)
        except TimeoutError:
            raise EngineError(f"no new decoder process from the launcher in {_NEW_CORE_WAIT_S:.0f} s",
                              EngineErrorKind.UNRECOVERABLE) from None
        share, self._decoder_share = self._decoder_share, None
        self._decoder_sent.clear()
        return share

    async def _listen_to_launcher(self) -> None:
        """Messages of the launcher (``SharedClient.control``), until the pipe closes."""
        assert self.shared is not None
        control = self.shared.control
        loop = asyncio.get_running_loop()
        readable = asyncio.Event()
        loop.add_reader(control.fileno(), readable.set)
        try:
            while True:
                await readable.wait()
                readable.clear()
                while control.poll(0):
                    try:
                        msg = control.recv()
                    except (EOFError, OSError):
                        return  # the launcher is gone (the group stops)
                    if msg.get("event") == "dead":
                        self._engine_core_died()
                    elif msg.get("event") == "core":
                        self._replacement = msg["client_config"]
                        self._replaced.set()
                    elif msg.get("event") == "decoder":
                        old, self._decoder_share = self._decoder_share, msg["share"]
                        if old is not None:  # superseded: its decoder process died before we took it
                            old.sock.close()
                        self._decoder_sent.set()
        finally:
            loop.remove_reader(control.fileno())

    def _engine_core_died(self) -> None:
        """The launcher saw this client's engine core die: vLLM's own path for a dead engine core
        (its output queue gets ``EngineDeadError``: every request stream raises it, new requests
        are refused), which vLLM's client of an external engine core does not take by itself."""
        from vllm.v1.engine.exceptions import EngineDeadError

        self._dead = "the shared engine core died"
        _log.warning("engine core: the launcher reports it dead; waiting for its replacement")
        core = getattr(self._llm, "engine_core", None)
        resources = getattr(core, "resources", None)
        if resources is not None:
            resources.engine_dead = True
        queue = getattr(core, "outputs_queue", None)
        if queue is not None:
            queue.put_nowait(EngineDeadError())
        _fail_waiting_streams(self._llm)

    async def close(self) -> None:
        task, self._control_task = self._control_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._shutdown()
        if self._table is not None:
            self._table.close(unlink=self.shared is None)
            self._table = None

    async def _shutdown(self) -> None:
        llm, self._llm = self._llm, None
        if llm is None:
            return
        for live in self._live.values():
            live.aborted = True
        # vLLM's output handler hands an engine failure to every waiting request stream when it
        # reads it; cancelled before that (a restart racing the failure), it never would
        _fail_waiting_streams(llm)
        handler = getattr(llm, "output_handler", None)
        if handler is not None:
            handler.cancel()  # before the engine core goes away: no "engine dead" noise
        try:
            await asyncio.to_thread(llm.shutdown)
        except Exception:  # noqa: BLE001 - already dead engines may raise on shutdown
            _log.debug("vLLM shutdown raised", exc_info=True)
        # Shut down once: AsyncLLM.__del__ would call shutdown() again at interpreter exit,
        # when module globals are gone (noisy TypeError).
        llm.shutdown = lambda *a, **k: None
        del llm
        gc.collect()

    # ------------------------------------------------------------------ requests

    def check_speaker(self, value: str | int) -> str | None:
        """Why ``value`` is not a speaker this model can use (a fixed phrase), or None; a good one
        is resolved into the cache the requests read."""
        try:
            self._speaker(value)
        except SpeakerError:
            return BAD_SPEAKER
        return None

    def _speaker(self, value: str | int | None) -> ResolvedSpeaker | None:
        if value is None:
            value = self.cfg.default_speaker
        key = f"{type(value).__name__}:{value}"
        if key in self._speakers:
            self._speakers.move_to_end(key)
            return self._speakers[key]
        spk = resolve_speaker(value, self.info.hidden_size)
        self._speakers[key] = spk
        if len(self._speakers) > 256:
            self._speakers.popitem(last=False)
        return spk

    def build(
        self, request: SpeechRequest, slot: int = 0, gen: int = 1, *, side_codes: bool = True, cache_salt: bool = True
    ) -> tuple[Any, Any]:
        """(TokensPrompt, SamplingParams) for ``request`` in frame-table ``slot``/``gen``.
        Raises ``EngineError``.

        ``side_codes=False`` and ``cache_salt=False`` are debug switches for negative controls
        (codebooks 1..3 left out of the input; no per-speaker prefix-cache salt)."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        text = request.text.strip()
        if not text:
            raise EngineError("empty text", EngineErrorKind.RECOVERABLE)
        try:
            spk = self._speaker(request.speaker)
        except SpeakerError as exc:
            raise EngineError(f"bad speaker: {exc}", EngineErrorKind.RECOVERABLE) from None
        p = request.params
        ids = self._prompts.code_prompt_ids(text, spk is not None)
        max_new = int(p.max_new_tokens)
        room = min(self.cfg.max_model_len, self.info.max_positions) - len(ids)
        if room < 1:
            raise EngineError(f"prompt of {len(ids)} tokens leaves no room for audio", EngineErrorKind.RECOVERABLE)
        max_new = max(1, min(max_new, room))
        greedy = p.temperature <= 0.0
        prefix: list[list[int]] | None = None
        if request.prefix_codes is not None and len(request.prefix_codes):
            pre = np.asarray(request.prefix_codes, dtype=np.int64)
            a = self.info.num_audio_tokens
            if pre.ndim != 2 or pre.shape[1] != self.info.num_vq or pre.min() < 0 or pre.max() >= a:
                raise EngineError(f"bad prefix_codes of shape {pre.shape}", EngineErrorKind.RECOVERABLE)
            if len(pre) >= max_new:
                raise _PrefixComplete(f"prefix of {len(pre)} frames leaves no steps (max {max_new})")
            prefix = pre.tolist()
        k = 0 if prefix is None else len(prefix)
        seed = p.seed if p.seed is not None else secrets.randbits(63)
        rp = RequestParams(
            key=request.request_id,
            slot=slot,
            gen=gen,
            temperature=float(p.temperature) if not greedy else 1.0,
            top_p=float(p.top_p),
            top_k=int(p.top_k),
            penalty=float(p.repetition_penalty),
            window=int(p.repetition_window),
            min_new=min(effective_min_new(p), max_new),
            max_new=max_new,
            greedy=greedy,
            # seeded rows: a stream of their own, distinct from the seed's other uses
            seed=(int(seed) * 1_000_003 + 0x5EED) % (2**63) if p.seed is not None else int(seed),
            speaker=None if spk is None else encode_vector(spk.normalized),
            side_codes=side_codes,
            prefix=prefix,
        )
        eos_id = self.info.num_text_tokens + self.info.eos_code
        sp = VSamplingParams(
            n=1,
            temperature=0.0,  # the model samples; vLLM takes the one-hot row's argmax
            max_tokens=max_new - k,
            stop_token_ids=[eos_id],
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            extra_args={EXTRA_KEY: rp.to_extra()},
        )
        salt = spk.salt if spk is not None else None
        if prefix is not None:
            # vLLM hashes token ids only: equal codebook-0 tokens with other side codes embed
            # differently, so a resumed prompt must never share blocks with another request's.
            ids = [*ids, *(self.info.num_text_tokens + int(row[0]) for row in prefix)]
            digest = hashlib.sha256(np.ascontiguousarray(request.prefix_codes, dtype=np.int64).tobytes()).hexdigest()
            salt = f"{salt or ''}|resume:{digest[:32]}"
        prompt: dict[str, Any] = {"prompt_token_ids": ids}
        if salt is not None and self.cfg.enable_prefix_caching and cache_salt:
            prompt["cache_salt"] = salt
        return TokensPrompt(**prompt), sp  # type: ignore[typeddict-item]

    def _frames(self, slot: int, gen: int, k0: int, token_ids: Any) -> tuple[np.ndarray | None, bool]:
        """Delta tokens (frames ``k0..``) -> (codes ``[n, num_vq]`` without EOS or None while an
        entry is not readable yet, saw_eos). Synchronous: this runs
        once per request and step, so the common case creates no coroutine."""
        info = self.info
        t, eos = info.num_text_tokens, info.eos_code
        codes0 = [tok - t for tok in token_ids]
        if any(not 0 <= c < info.num_audio_tokens for c in codes0):
            raise EngineError("vLLM sampled an id outside codebook 0", EngineErrorKind.RECOVERABLE)
        saw_eos = eos in codes0
        if saw_eos:
            codes0 = codes0[: codes0.index(eos)]
        if not codes0:
            return np.zeros((0, info.num_vq), dtype=np.int64), saw_eos
        table = self._table
        assert table is not None
        codes = table.read(slot, gen, k0, codes0)
        if codes is not None and eos in codes:  # a side codebook drew EOS (codebook 0 follows it)
            first = int(np.nonzero((codes == eos).any(axis=1))[0][0])
            codes, saw_eos = codes[:first], True
        return codes, saw_eos

    async def _wait_frames(self, slot: int, gen: int, k0: int, token_ids: Any, stats: dict[str, Any]) -> tuple[np.ndarray, bool]:
        """The entries are written before vLLM copies the token out: only a broken channel waits
        past the bound (then the request fails rather than deliver wrong codes)."""
        stats["frame_waits"] = stats.get("frame_waits", 0) + 1
        deadline = time.monotonic() + _FRAME_WAIT_S
        while True:
            await asyncio.sleep(0.0005)
            codes, saw_eos = self._frames(slot, gen, k0, token_ids)
            if codes is not None:
                return codes, saw_eos
            if time.monotonic() > deadline:
                raise EngineError("side codes missing from the frame table", EngineErrorKind.RECOVERABLE)

    async def generate(
        self, request: SpeechRequest, *, side_codes: bool = True, cache_salt: bool = True
    ) -> AsyncIterator[CodeFrames]:
        """Stream code frames. The keyword switches are for negative controls (see ``build``)."""
        llm = self._llm
        if llm is None or self._dead:
            raise EngineError(self._dead or "engine not started", EngineErrorKind.UNRECOVERABLE)
        if request.request_id in self._live:
            raise EngineError(f"duplicate request id {request.request_id}", EngineErrorKind.RECOVERABLE)
        table = self._table
        assert table is not None
        from vllm.v1.engine.exceptions import EngineDeadError

        live = _Live()
        rid = request.request_id
        self._set_live(rid, live)
        try:
            slot, gen = await table.acquire()
        except BaseException:
            self._set_live(rid, None)
            raise
        try:
            prompt, sp = self.build(request, slot, gen, side_codes=side_codes, cache_salt=cache_salt)
        except _PrefixComplete:
            # a resumed segment that had run to its length: nothing is left to generate
            self._set_live(rid, None)
            table.release(slot)
            yield CodeFrames(request_id=rid, codes=np.zeros((0, self.info.num_vq), dtype=np.int64),
                             finished=True, finish_reason="length")
            return
        except BaseException:
            self._set_live(rid, None)
            table.release(slot)
            raise
        k = 0 if request.prefix_codes is None else len(request.prefix_codes)
        t_submit = time.monotonic()
        if live.aborted:  # aborted while it waited for a frame-table slot: never reaches vLLM
            self._set_live(rid, None)
            table.release(slot)
            yield CodeFrames(request_id=rid, codes=np.zeros((0, self.info.num_vq), dtype=np.int64),
                             finished=True, finish_reason="abort")
            return
        counters = self._counters
        counters["requests"] += 1
        stats: dict[str, Any] = {"prompt_tokens": len(prompt["prompt_token_ids"]), "steps": 0, "slot": slot}
        stream = llm.generate(prompt, sp, self._rid_prefix + rid)
        finished = False
        try:
            async for out in stream:
                comp = out.outputs[0]
                tokens = comp.token_ids
                got, saw_eos = self._frames(slot, gen, k, tokens)
                if got is None:
                    got, saw_eos = await self._wait_frames(slot, gen, k, tokens, stats)
                codes = got
                k += len(tokens)
                stats["steps"] += len(tokens)
                counters["steps"] += len(tokens)
                counters["outputs"] += 1
                if "ttft_s" not in stats and len(tokens):
                    stats["ttft_s"] = ttft = time.monotonic() - t_submit
                    counters["first_outputs"] += 1
                    counters["ttft_s"] += ttft
                    stats["num_cached_tokens"] = getattr(out, "num_cached_tokens", None)
                done = bool(out.finished) or saw_eos
                reason = None
                if done:
                    fr = comp.finish_reason
                    if live.aborted or fr == "abort":
                        reason = "abort"
                    elif saw_eos or fr == "stop":
                        reason = "eos"
                    else:
                        reason = "length"
                if len(codes) or done:
                    yield CodeFrames(request_id=rid, codes=codes, finished=done, finish_reason=reason)
                if done:
                    finished = True
                    break
            if not finished:
                finished = True
                yield CodeFrames(
                    request_id=rid,
                    codes=np.zeros((0, self.info.num_vq), dtype=np.int64),
                    finished=True,
                    finish_reason="abort",
                )
        except EngineDeadError as exc:
            self._dead = f"vLLM engine died: {exc!r}"
            raise EngineError(self._dead, EngineErrorKind.UNRECOVERABLE) from None
        except EngineError:
            raise
        except Exception as exc:
            if llm.errored:
                self._dead = f"vLLM engine died: {exc!r}"
                raise EngineError(self._dead, EngineErrorKind.UNRECOVERABLE) from None
            raise EngineError(f"vLLM request failed: {exc!r}", EngineErrorKind.RECOVERABLE) from None
        finally:
            self._set_live(rid, None)
            stats["wall_s"] = time.monotonic() - t_submit
            self._stats[rid] = stats
            while len(self._stats) > _STATS_KEPT:
                self._stats.popitem(last=False)
            try:
                await stream.aclose()  # aborts in vLLM when we stopped early
            finally:
                table.release(slot)

    async def abort(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is not None:
            live.aborted = True
        if self._llm is not None and not self._dead:
            try:
                await self._llm.abort(self._rid_prefix + request_id)
            except Exception:  # noqa: BLE001 - abort of a finished/dead request
                _log.debug("abort %s raised", request_id, exc_info=True)

    def request_stats(self, request_id: str) -> dict[str, Any] | None:
        """TTFT, steps, prompt tokens, prefix-cache hits of a recent request (observability)."""
        return self._stats.get(request_id)

    def health(self) -> EngineHealth:
        llm = self._llm
        if llm is None:
            return EngineHealth(self.name, False, self.running_requests(), self._dead or "not started")
        if self._dead or llm.errored:
            self._dead = self._dead or "vLLM engine core died"
            return EngineHealth(self.name, False, self.running_requests(), self._dead)
        return EngineHealth(self.name, True, self.running_requests(), f"vLLM {_vllm_version()} on {self.device}",
                            counters=dict(self._counters))

    async def worker_stats(self) -> dict[str, int]:
        """Counters from the worker process (e.g. requests resumed after preemption)."""
        res = await self._llm.collective_rpc("voicegw_stats")
        return dict(res[0]) if res else {}

    async def slot_frames(self, slot: int, n: int) -> np.ndarray:
        """The first ``n`` frames the worker holds for ``slot`` (its device history; tests)."""
        res = await self._llm.collective_rpc("voicegw_slot_frames", args=(slot, n))
        return np.asarray(res[0], dtype=np.int64).reshape(-1, self.info.num_vq)


def _fail_waiting_streams(llm: Any) -> None:
    """Every request stream of ``llm`` still open raises ``EngineDeadError`` at its next read
    (``generate`` turns it into an unrecoverable ``EngineError``), at once rather than whenever
    vLLM's output handler reads the failure: a stream left waiting on a dead or shut-down engine
    core would never end."""
    from vllm.v1.engine.exceptions import EngineDeadError

    processor = getattr(llm, "output_processor", None)
    if processor is not None:
        processor.propagate_error(EngineDeadError())


def _vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:  # noqa: BLE001
        return "?"

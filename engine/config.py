"""The speech engine's settings (``[engine]``), and the validation base every section uses.

Frozen dataclasses, one attribute docstring per field (``voicegw config-doc`` turns them into
docs/configuration.md), validated in the dataclass: a section built in code is held to the same
rules as one read from TOML, environment or CLI (``voicegw.config.load_config``). Nothing here
imports above ``engine``: the gateway's sections (``gateway.config``) and the root ``Config``
(``voicegw.config``) build on it.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the key and what is allowed."""


class Checked:
    """Validation inside a frozen dataclass (``__post_init__``): every field that is not itself a
    section goes through ``_check_field`` (the class's ``_choices`` and ``_positive`` tables, then
    its own rules), then the class's cross-field ``_cross_check``. Messages name the key
    ``<_section>.<field>``."""

    _section: ClassVar[str] = ""
    _choices: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    """Field -> allowed values (compared case-insensitively)."""
    _positive: ClassVar[frozenset[str]] = frozenset()
    """Fields that must be > 0."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if not dataclasses.is_dataclass(value):
                self._check_field(f.name, value)
        self._cross_check()

    def _check_field(self, name: str, value: Any) -> None:
        choices = self._choices.get(name)
        if choices is not None and str(value).upper() not in [c.upper() for c in choices]:
            self._fail(name, f"{value!r} is not one of {', '.join(choices)}")
        if name in self._positive and not value > 0:
            self._fail(name, f"must be > 0, got {value!r}")

    def _cross_check(self) -> None:
        pass

    def _fail(self, name: str, message: str) -> typing.NoReturn:
        raise ConfigError(f"{self._section}.{name}: {message}" if self._section else f"{name}: {message}")


BACKENDS: tuple[str, ...] = ("vllm", "reference", "espeak")
"""The engine backends ``voicegw serve`` can build (``engine.build``; ``auto`` picks one of them)."""

CHATTTS_EXACT_LOOKAHEAD_STEPS = 52
"""Steps after a step that its exact audio depends on (the released DVAE + Vocos; the decoder derives
it from the checkpoint: ``DecoderGeometry.exact_lookahead_steps``)."""


@dataclass(frozen=True)
class EngineConfig(Checked):
    """The speech engine."""

    _section: ClassVar[str] = "engine"
    _choices: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "backend": ("auto", *BACKENDS),
        "device": ("auto", "cpu", "cuda"),
        "dtype": ("auto", "float32", "bfloat16", "float16"),
        "decoder_dtype": ("float32", "float16"),
    }
    _positive: ClassVar[frozenset[str]] = frozenset({
        "max_num_seqs", "max_num_batched_tokens", "kv_cache_gib", "max_model_len", "restart_backoff_s",
        "first_chunk_steps", "chunk_steps", "decoder_max_batch",
    })

    backend: str = "auto"
    """``vllm`` (ChatTTS GPT in vLLM), ``reference`` (upstream chattts in-process), ``espeak``
    (eSpeak NG, no weights needed) or ``auto``: vllm when ChatTTS weights are found, else espeak.
    A backend named here starts or fails with an error; it is never replaced by another."""
    model_dir: str = ""
    """ChatTTS model directory in upstream layout (``asset/...``). Empty: ``~/.cache/voicegw/chattts``;
    downloaded from the hub when ``download`` is true and it is missing."""
    download: bool = False
    """Download ChatTTS weights from the hub (upstream's source) when missing."""
    device: str = "auto"
    """``cpu``, ``cuda`` or ``auto``."""
    dtype: str = "auto"
    """GPT dtype in vLLM: ``auto`` (bf16 on GPU, fp32 on CPU), ``float32``, ``bfloat16``, ``float16``."""
    default_speaker: str = "2222"
    """Voice when the client names none: an int seed or an upstream-encoded embedding string."""
    max_num_seqs: int = 64
    """vLLM: concurrent sequences in one batch."""
    max_num_batched_tokens: int = 2048
    """vLLM: tokens per engine step (chunked prefill budget)."""
    enable_chunked_prefill: bool = True
    """vLLM: split long prefills across steps so running streams keep stepping."""
    enable_prefix_caching: bool = True
    """vLLM: reuse KV of shared prompt prefixes (salted per speaker)."""
    kv_cache_gib: float = 2.0
    """vLLM KV cache size on CPU, GiB (passed as ``kv_cache_memory_bytes``; a
    ``VLLM_CPU_KVCACHE_SPACE`` in the environment is removed while vLLM starts, so this wins)."""
    gpu_memory_utilization: float = 0.85
    """vLLM GPU memory fraction."""
    enforce_eager: bool = True
    """vLLM: no torch.compile / CUDA graphs (fast start on CPU; false on a CUDA GPU by default)."""
    async_scheduling: bool = True
    """vLLM async scheduling (GPU only; ignored on CPU): step N+1 is scheduled while step N runs
    (the step never reads the device from the host, so they overlap)."""
    data_parallel_size: int = 1
    """vLLM data parallelism: this many independent engine replicas (one GPU each, each with its own
    KV cache and scheduler) behind the one gateway; vLLM's client spreads requests over them by load.
    The decoder still runs in the gateway process on the first GPU. 1: off."""
    max_model_len: int = 2048
    """vLLM max sequence length (prompt + steps)."""
    restart_on_crash: bool = True
    """Restart the code engine (a new vLLM engine core, warm-up included) or the decoder process
    when it dies, without restarting the gateway; /healthz is 503 and requests fail
    ``engine_unavailable`` meanwhile."""
    restart_backoff_s: float = 5.0
    """Wait after a failed restart before the next attempt; doubles per failure, at most 60 s."""
    first_chunk_steps: int = 2
    """Decoder: GPT steps of audio in the first chunk (2 steps = 43 ms); first audio comes after
    first_chunk_steps + decoder_lookahead_steps GPT steps (exact mode: + 52 for ChatTTS). A short
    first chunk brings the first audio earlier, at every load (bench/RESULTS.md)."""
    chunk_steps: int = 16
    """Decoder: GPT steps per later chunk."""
    full_chunks_below_x: float = 1.0
    """Decoder: a stream whose GPT steps arrive slower than this multiple of real time gets whole
    chunks (``chunk_steps``) instead of ones sized by its lead (``ChunkPolicy``): each forward costs
    the decoder one window whatever the chunk's size, and a stream that slow builds no lead with
    small chunks. 0: chunks follow the lead at every rate."""
    decoder_max_batch: int = 64
    """Decoder: most rows (chunks of at most ``chunk_steps`` steps) in one batched forward; the batch
    buckets (one CUDA graph each on a GPU) are the powers of two up to it."""
    decoder_lookahead_steps: int = 8
    """Decoder: steps the audio trails the newest GPT step. -1: exact (the derived receptive field,
    52 steps for ChatTTS: output identical to whole-utterance decoding). Below, a chunk's newest
    samples are decoded as if the utterance ended at the newest step, and seams are crossfaded.
    8 is the smallest lookahead that stays close to the exact decode (bench/decoder_bench.py,
    docs/decoder.md)."""
    decoder_left_steps: int = 24
    """Decoder: steps of left context each window decodes in lookahead mode (-1: the exact left
    reach, 52 steps for ChatTTS); exact mode always takes the exact reach. Every forward costs
    ``left + chunk_steps + lookahead`` steps of decoding: 24 makes the default window 48 steps
    instead of 76, with samples equal to the exact-left decode's to float32 noise on the bench's
    full-size checkpoint (docs/decoder.md, "The left context: measured")."""
    cpu_reserved_cores: int = 1
    """vLLM on CPU: cores kept out of the GPT worker's OpenMP pool (``VLLM_CPU_NUM_OF_RESERVED_CPU``;
    that environment variable, when set, wins). The worker's OpenMP threads spin, so a worker on
    every core starves the decoder, the gateway and anything else on the host (a browser) while it
    generates; 0 gives the GPT worker every core (GPT-only benchmarks; bench/RESULTS.md)."""
    decoder_dtype: str = "float32"
    """Decoder: dtype its convolutions and matmuls compute in (autocast; the spectrum, the
    overlap-add and the returned samples stay float32): ``float32`` (TF32 on a CUDA GPU) or
    ``float16``. On a GPU the default is ``float16`` together with ``decoder_compile``: the pair wins
    over float32 where either alone does not (``GPU_DEFAULTS``; bench/RESULTS.md)."""
    decoder_compile: bool = False
    """Decoder: compile its forward with torch.compile (inductor, dynamic batch) at start-up, before
    the CUDA graphs are captured, so that the norms, activations and masks run fused. Start-up takes
    longer (a cold compile per process); on by default on a GPU."""
    decoder_torch_threads: int = 1
    """Torch intra-op threads of the decoder process (and of the in-process ``reference`` GPT); 0 keeps
    torch's default. 1 is fastest for the small per-chunk forwards on CPU."""
    decoder_device: str = ""
    """Device of the streaming decoder (DVAE + Vocos): empty = the GPT's device; else ``cpu``,
    ``cuda`` or ``cuda:N``. On a host with a spare GPU, e.g. ``cuda:1``, the decoder's kernels stop
    time-sharing the GPU that runs the GPT (vLLM's first rank takes the first visible GPU)."""
    use_hidden_decoder: bool = False
    """Vocode GPT hidden states with ``Decoder`` (upstream default) instead of codes with DVAE."""

    @property
    def first_audio_steps(self) -> int:
        """GPT steps before a segment's first audio: the first chunk and the decoder's lookahead
        (exact mode: ChatTTS's receptive field, 52 steps)."""
        la = self.decoder_lookahead_steps
        return self.first_chunk_steps + (CHATTTS_EXACT_LOOKAHEAD_STEPS if la < 0 else max(1, la))

    def _check_field(self, name: str, value: Any) -> None:
        if name == "backend" and value == "synthetic":
            self._fail(name, "'synthetic' was removed (a pacing scaffold); use vllm, reference or espeak")
        super()._check_field(name, value)
        if name == "gpu_memory_utilization" and not 0 < value <= 1:
            self._fail(name, f"must be in (0, 1], got {value!r}")
        if name == "decoder_lookahead_steps" and value < -1:
            self._fail(name, f"must be >= -1 (-1 = exact), got {value!r}")
        if name == "decoder_left_steps" and value != -1 and value < 4:
            self._fail(name, f"must be -1 (the exact reach) or >= 4, got {value!r}")
        if name == "full_chunks_below_x" and value < 0:
            self._fail(name, f"must be >= 0 (0 = off), got {value!r}")
        if name == "decoder_torch_threads" and value < 0:
            self._fail(name, f"must be >= 0, got {value!r}")
        if name == "decoder_device" and not re.fullmatch(r"|cpu|cuda(:\d+)?", value):
            self._fail(name, f"expected '', 'cpu', 'cuda' or 'cuda:N', got {value!r}")
        if name == "data_parallel_size" and value < 1:
            self._fail(name, f"must be >= 1, got {value!r}")

    def _cross_check(self) -> None:
        if self.first_chunk_steps > self.chunk_steps:
            raise ConfigError(f"engine.first_chunk_steps: must be <= engine.chunk_steps ({self.chunk_steps})")

"""The one configuration: frozen dataclasses, read once from TOML, environment and CLI.

Precedence (later wins): defaults < TOML file (``--config`` / ``VOICEGW_CONFIG``)
< environment (``VOICEGW_<SECTION>_<FIELD>``, e.g. ``VOICEGW_GATEWAY_PORT=9000``)
< CLI flags (``--gateway.port 9000`` or the short aliases the CLI declares).

Every field has a docstring (the attribute docstring right below it); ``describe()`` turns
them into the configuration reference (``docs/configuration.md``).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import re
import textwrap
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the key and what is allowed."""


class _Checked:
    """Validation inside the dataclass (``__post_init__``): per-field rules from the tables below
    (``_CHOICES``, ``_POSITIVE``, ``_validate``), then the class's cross-field ``_cross_check``.
    A section built in code is held to the same rules as one read from TOML, env or the CLI."""

    _section: typing.ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if not dataclasses.is_dataclass(value):
                _validate(self._section, f.name, value)
        self._cross_check()

    def _cross_check(self) -> None:
        pass

    def _fail(self, name: str, message: str) -> typing.NoReturn:
        raise ConfigError(f"{self._section}.{name}: {message}")


@dataclass(frozen=True)
class GatewayConfig(_Checked):
    """The WebSocket/HTTP server."""

    _section: typing.ClassVar[str] = "gateway"

    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = 8765
    """TCP port for WebSocket, demo page, /healthz and /metrics."""
    processes: int = 0
    """Gateway processes (sessions, flow control, WebSocket I/O) sharing the port
    (``SO_REUSEPORT``), one vLLM engine core through vLLM's multi-client front end, and one decoder
    process (``engine.vllm.group``). 0: 4 when the engine is vLLM on a CUDA GPU (measured on an H200:
    docs/gpu.md), else 1. Above 1 needs the ``vllm`` backend and a fixed ``port``;
    ``limits.max_sessions`` then applies per process."""
    auth_tokens: tuple[str, ...] = ()
    """Bearer tokens accepted (header ``Authorization: Bearer``, subprotocol ``voicegw.token.<t>``
    or query ``?token=``). Empty: no auth (development only)."""
    allowed_origins: tuple[str, ...] = ()
    """Origin allow-list for browser connections. Empty: same-host origins only
    (http(s)://host:port of this server, localhost and 127.0.0.1); ``*`` allows any."""
    write_limit_bytes: int = 65_536
    """websockets write buffer high-water mark; ``send`` waits above it."""
    send_timeout_ms: int = 10_000
    """A client whose socket buffer stays full this long is closed (1008 slow reader)."""
    ping_interval_s: float = 20.0
    """Keepalive ping interval."""
    ping_timeout_s: float = 20.0
    """Close the connection if a pong does not arrive within this time."""
    open_timeout_s: float = 10.0
    """Drop connections that do not finish the opening handshake in this time."""
    shutdown_grace_s: float = 10.0
    """On SIGTERM: stop accepting, let utterances finish up to this long, then close 1012."""
    log_level: str = "INFO"
    """Python logging level."""
    log_json: bool = False
    """Structured JSON logs (one object per line) instead of text."""
    load_log_interval_s: float = 10.0
    """Every this many seconds one INFO line ``load``: open sessions, engine requests, the event
    loop's lag (max and mean of 20 ms probes) and the engine's rates (requests, first outputs and
    their mean time, GPT steps, decoder jobs and their mean time) over the interval
    (``gateway.monitor``). 0: off (the lag histogram of ``/metrics`` stays)."""

    def _cross_check(self) -> None:
        if self.processes < 0:
            self._fail("processes", "must be >= 0 (0: automatic)")
        if self.processes > 1 and self.port == 0:
            self._fail("processes", "more than one process needs a fixed port (gateway.port 0 picks one per process)")


CHATTTS_EXACT_LOOKAHEAD_STEPS = 52
"""Steps after a step that its exact audio depends on (the released DVAE + Vocos; the decoder derives
it from the checkpoint: ``DecoderGeometry.exact_lookahead_steps``)."""


@dataclass(frozen=True)
class EngineConfig(_Checked):
    """The speech engine."""

    _section: typing.ClassVar[str] = "engine"

    backend: str = "auto"
    """``vllm`` (ChatTTS GPT in vLLM), ``reference`` (upstream chattts in-process), ``espeak``
    (offline fallback), ``synthetic`` (random codes at a set pace + the real decoder of the model
    directory: pacing tests without a GPU) or ``auto``: vllm when ChatTTS weights are found, else espeak."""
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
    cudagraph_mode: str = "auto"
    """vLLM CUDA graphs (GPU, ``enforce_eager`` false): ``FULL`` replays mixed prefill+decode
    batches as whole-step graphs too (attention backends that allow it, e.g. FlashAttention 3);
    ``FULL_AND_PIECEWISE`` full graphs for decode-only batches, piecewise for mixed ones;
    ``auto``: vLLM's default."""
    max_cudagraph_capture_size: int = 0
    """vLLM: the largest step (in tokens) replayed from a CUDA graph; larger steps run eagerly.
    0: vLLM's default."""
    admit_interval_ms: float = 0.0
    """vLLM: under load (32 or more requests in the engine), new requests wait for the next tick of
    this period on a clock shared by the gateway processes, so that arrivals are prefilled together
    in fewer mixed steps and the steps between run decode-only batches. 0: submit at once."""
    restart_on_crash: bool = True
    """Restart the code engine (a new vLLM engine core, warm-up included) when it dies, without
    restarting the gateway; /healthz is 503 and requests fail ``engine_unavailable`` meanwhile."""
    restart_backoff_s: float = 5.0
    """Wait after a failed restart before the next attempt; doubles per failure, at most 60 s."""
    first_chunk_steps: int = 2
    """Decoder: GPT steps of audio in the first chunk (2 steps = 43 ms); first audio comes after
    first_chunk_steps + decoder_lookahead_steps GPT steps (exact mode: + 52 for ChatTTS). 2, not 4:
    on an H200 (2026-12-02, same call) seg-TTFA p50 at 1 session 29 vs 42 ms, at 64 sessions
    p50/p99 47/142 vs 87/203 ms, with no underruns at either (bench/RESULTS.md)."""
    chunk_steps: int = 16
    """Decoder: GPT steps per later chunk."""
    decoder_max_batch: int = 64
    """Decoder: most rows (chunks of at most ``chunk_steps`` steps) in one batched forward; the batch
    buckets (one CUDA graph each on a GPU) are the powers of two up to it."""
    decoder_lookahead_steps: int = 8
    """Decoder: steps the audio trails the newest GPT step. -1: exact (the derived receptive field,
    52 steps for ChatTTS: output identical to whole-utterance decoding). Below, a chunk's newest
    samples are decoded as if the utterance ended at the newest step, and seams are crossfaded.
    8 is the smallest lookahead within 40 dB SNR (2.3% of peak) of the exact decode on the random
    full checkpoint with strong layer scales (bench/decoder_bench.py, docs/decoder.md); 4 gives
    25 dB, 16 gives 90 dB."""
    cpu_reserved_cores: int = 1
    """vLLM on CPU: cores kept out of the GPT worker's OpenMP pool (``VLLM_CPU_NUM_OF_RESERVED_CPU``;
    that environment variable, when set, wins). The worker's OpenMP threads spin, so a worker on
    every core starves the decoder, the gateway and anything else on the host (a browser) while it
    generates: on a 2-core host 0 gave 4 underruns in 5 browser runs, 1 gave none in 3; 0 is +40%
    GPT steps/s for one full-size stream alone (bench/RESULTS.md). 0 for GPT-only benchmarks."""
    decoder_torch_threads: int = 1
    """Torch intra-op threads of the decoder process (and of the in-process ``reference`` GPT); 0 keeps
    torch's default. 1 is fastest for the small per-chunk forwards on CPU."""
    decoder_device: str = ""
    """Device of the streaming decoder (DVAE + Vocos): empty = the GPT's device; else ``cpu``,
    ``cuda`` or ``cuda:N``. On a host with a spare GPU, e.g. ``cuda:1``, the decoder's kernels stop
    time-sharing the GPU that runs the GPT (vLLM's first rank takes the first visible GPU)."""
    use_hidden_decoder: bool = False
    """Vocode GPT hidden states with ``Decoder`` (upstream default) instead of codes with DVAE."""
    synthetic_ttft_ms: float = 40.0
    """``backend = "synthetic"`` (no GPT: random valid codes, the real decoder and gateway, for
    pacing tests on CPU): time from submit to a stream's first step."""
    synthetic_steps_per_s: float = 86.0
    """``backend = "synthetic"``: steps per second per stream (46.9 is real time; 86 is the vLLM
    engine on one H200 at 10 streams)."""
    synthetic_ms_per_char: float = 70.0
    """``backend = "synthetic"``: speech per non-space text character (sets each segment's steps)."""


    @property
    def first_audio_steps(self) -> int:
        """GPT steps before a segment's first audio: the first chunk and the decoder's lookahead
        (exact mode: ChatTTS's receptive field, 52 steps)."""
        la = self.decoder_lookahead_steps
        return self.first_chunk_steps + (CHATTTS_EXACT_LOOKAHEAD_STEPS if la < 0 else max(1, la))


@dataclass(frozen=True)
class SchedulerConfig(_Checked):
    """Admission control (the engine schedules first come, first served: vLLM's default)."""

    _section: typing.ClassVar[str] = "scheduler"

    ttfa_target_ms: float = 500.0
    """Admission: refuse a new utterance early when it cannot start within this time."""
    admission: bool = True
    """Admission control for the first segment of an utterance: when the engine has no free batch
    slot (``engine.max_num_seqs``) and the estimated time to first audio (queue length, learned
    step time and segment length) exceeds ``ttfa_target_ms``, the utterance fails at once with
    error ``engine_overloaded`` (the session stays open; the client may retry)."""


@dataclass(frozen=True)
class LimitsConfig(_Checked):
    """Per-connection and global limits (see SECURITY.md)."""

    _section: typing.ClassVar[str] = "limits"

    max_sessions: int = 256
    """Concurrent sessions; over it: HTTP 503 at the handshake."""
    max_message_bytes: int = 65_536
    """Largest client message; over it: close 1009 before the payload is read."""
    max_utterance_chars: int = 20_000
    """Text per utterance; over it: error ``text_too_long``."""
    max_chars_per_s: float = 2_000.0
    """Text rate per session (token bucket); over it: error ``rate_limited``, then close 1008."""
    max_messages_per_s: float = 200.0
    """Messages per session per second (token bucket, burst 2x); flood: close 1008."""
    idle_timeout_s: float = 300.0
    """Close 1000 ("idle") after this long without a client message while no audio is in flight
    (an open utterance waiting for text does not count), from the handshake on."""
    flow_window_ms: float = 2_000.0
    """Never run further ahead of the client's reported playhead than this (ms of audio)."""
    openai_max_input_chars: int = 4096
    """OpenAI dialect: longest ``input`` of ``POST /v1/audio/speech`` (OpenAI documents 4096
    characters); longer: 400 ``string_above_max_length``. ``max_utterance_chars`` still caps it."""
    max_queued_utterances: int = 16
    """Unfinished utterances a session may hold (queued behind the one speaking included); a new
    utterance beyond it is refused with ``queue_full`` (the wire's ``max_queued_utterances``)."""


@dataclass(frozen=True)
class SegmenterConfig(_Checked):
    """Where text is cut into segments (``gateway/segmenter.py``); a unit is a letter or digit, a
    CJK character counts 3."""

    _section: typing.ClassVar[str] = "session.segmenter"

    first_min_units: int = 10
    """First segment: shortest text cut at a clause boundary."""
    first_max_units: int = 80
    """First segment: without any boundary, cut at a space once this long."""
    first_wait_ms: float = 350.0
    """First segment: after this long since the first character, send complete words."""
    min_units: int = 24
    """Later segments: shortest text cut at a sentence boundary (unless idle or forced)."""
    max_units: int = 200
    """Any segment: longest text."""
    idle_wait_ms: float = 400.0
    """Later segments: when nothing is in flight, text that waited this long goes out."""

    def _cross_check(self) -> None:
        if self.first_min_units > self.first_max_units:
            self._fail("first_min_units", f"must be <= first_max_units ({self.first_max_units})")
        if self.min_units > self.max_units:
            self._fail("min_units", f"must be <= max_units ({self.max_units})")


@dataclass(frozen=True)
class SessionConfig(_Checked):
    """One session's pacing and bookkeeping (``gateway/session.py``), and its segmenter."""

    _section: typing.ClassVar[str] = "session"

    segmenter: SegmenterConfig = field(default_factory=SegmenterConfig)
    """``[session.segmenter]``: where text is cut into segments."""
    max_in_flight: int = 2
    """Segments in flight per session (submitted to the engine and not yet fully sent): the next
    segment is submitted while the current one is still being sent, so sentences follow without
    gaps, and a client that does not play cannot make the engine run further ahead. Of those, one
    at a time is still generating, an utterance's short first segment not counted: from the second
    segment on, the next one is submitted once the current one has all its audio (which is then
    still being sent, up to ``limits.flow_window_ms`` + ``prefetch_ms`` ahead of playback); the
    first has the second generating beside it (its audio alone does not cover the next segment's
    time to first audio under load). This keeps vLLM's running batch near one request per speaking
    session: two generating at once lost on an H200 (2026-12-03, same call: 671 underruns at 256
    sessions against 0; bench/RESULTS.md)."""
    frame_ms: float = 40.0
    """Longest audio frame sent."""
    prefetch_ms: float = 1_000.0
    """Audio a stream may hold pulled-but-unsent (capped at ``limits.flow_window_ms``)."""
    stale_report_ms: float = 1_500.0
    """A client's playback report older than this no longer counts: the playhead is assumed to
    advance in real time from it (flow control's virtual playhead)."""
    playback_report_interval_ms: float = 250.0
    """Advertised to clients (``session.started``): how often to send ``playback``."""
    rate_strikes_to_close: float = 10.0
    """Refused (rate-limited) deltas, decaying one per second, after which the session closes 1008."""
    history_utterances: int = 4
    """Finished utterances kept for ``cancelled`` accounting (audio may still be playing)."""
    est_ms_per_unit: float = 70.0
    """Speaking time per text unit, to place the playhead inside a segment still generating."""
    min_audio_ms_per_unit: float = 0.0
    """Floor on a segment's audio per text unit (``gateway.segmenter.text_units``): the GPT may not
    stop (EOS is masked through ``min_new_tokens``) before ``units x this`` ms of audio. Guards
    against a GPT that stops before the end of its text; typical speech is ``est_ms_per_unit``.
    0: off, the model alone decides. The GPU benchmarks set 32 (half of typical speech) so that
    random-weight checkpoints, which stop at random, give segments of speech-like length."""


@dataclass(frozen=True)
class Config(_Checked):
    """Everything, read once at start."""

    _section: typing.ClassVar[str] = ""

    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    session: SessionConfig = field(default_factory=SessionConfig)
    explicit: frozenset[str] = frozenset()
    """``section.field`` keys given in TOML, environment or CLI (``load_config`` fills it): the
    ``GPU_DEFAULTS`` never replace those (``on_cuda``)."""

    def _cross_check(self) -> None:
        if self.session.frame_ms > self.limits.flow_window_ms:
            raise ConfigError(f"session.frame_ms: must be <= limits.flow_window_ms ({self.limits.flow_window_ms})")
        if self.engine.first_chunk_steps > self.engine.chunk_steps:
            raise ConfigError(f"engine.first_chunk_steps: must be <= engine.chunk_steps ({self.engine.chunk_steps})")


_SECTIONS: dict[str, type] = {
    "gateway": GatewayConfig,
    "engine": EngineConfig,
    "scheduler": SchedulerConfig,
    "limits": LimitsConfig,
    "session": SessionConfig,
    "session.segmenter": SegmenterConfig,
}
"""Every section; a dotted one is a table inside its parent (``[session.segmenter]``)."""

GPU_DEFAULTS: dict[str, Any] = {
    "engine.enforce_eager": False,
    "engine.max_num_seqs": 512,
    "engine.max_num_batched_tokens": 8192,
    "engine.decoder_max_batch": 256,
    "engine.admit_interval_ms": 50.0,
}
"""The defaults that differ when ``voicegw serve`` runs ChatTTS on vLLM on a CUDA GPU (the field
defaults are the CPU ones): compiled with CUDA graphs, hundreds of sequences per batch, the decoder's
largest bucket 256 rows, arrivals under load admitted on a 50 ms tick. The H200 figures of bench/RESULTS.md are measured with these."""


def on_cuda(cfg: Config) -> Config:
    """``cfg`` with ``GPU_DEFAULTS`` for every key not given explicitly (``Config.explicit``)."""
    changed: dict[str, dict[str, Any]] = {}
    for key, value in GPU_DEFAULTS.items():
        if key not in cfg.explicit:
            section, _, name = key.rpartition(".")
            changed.setdefault(section, {})[name] = value
    return dataclasses.replace(cfg, **{sec: dataclasses.replace(getattr(cfg, sec), **kw) for sec, kw in changed.items()})

_CHOICES: dict[tuple[str, str], tuple[str, ...]] = {
    ("engine", "backend"): ("auto", "vllm", "reference", "espeak", "synthetic"),
    ("engine", "device"): ("auto", "cpu", "cuda"),
    ("engine", "dtype"): ("auto", "float32", "bfloat16", "float16"),
    ("engine", "cudagraph_mode"): ("auto", "FULL", "FULL_AND_PIECEWISE", "PIECEWISE"),
    ("gateway", "log_level"): ("DEBUG", "INFO", "WARNING", "ERROR"),
}

_POSITIVE: set[tuple[str, str]] = {
    ("gateway", "write_limit_bytes"),
    ("gateway", "send_timeout_ms"),
    ("engine", "max_num_seqs"),
    ("engine", "max_num_batched_tokens"),
    ("engine", "kv_cache_gib"),
    ("engine", "max_model_len"),
    ("engine", "restart_backoff_s"),
    ("engine", "first_chunk_steps"),
    ("engine", "chunk_steps"),
    ("engine", "decoder_max_batch"),
    ("engine", "synthetic_steps_per_s"),
    ("engine", "synthetic_ms_per_char"),
    ("scheduler", "ttfa_target_ms"),
    ("limits", "max_sessions"),
    ("limits", "max_message_bytes"),
    ("limits", "max_utterance_chars"),
    ("limits", "max_chars_per_s"),
    ("limits", "max_messages_per_s"),
    ("limits", "idle_timeout_s"),
    ("limits", "flow_window_ms"),
    ("limits", "max_queued_utterances"),
    ("limits", "openai_max_input_chars"),
    ("session", "max_in_flight"),
    ("session", "frame_ms"),
    ("session", "prefetch_ms"),
    ("session", "stale_report_ms"),
    ("session", "playback_report_interval_ms"),
    ("session", "rate_strikes_to_close"),
    ("session", "history_utterances"),
    ("session", "est_ms_per_unit"),
    ("session.segmenter", "first_min_units"),
    ("session.segmenter", "first_max_units"),
    ("session.segmenter", "first_wait_ms"),
    ("session.segmenter", "min_units"),
    ("session.segmenter", "max_units"),
    ("session.segmenter", "idle_wait_ms"),
}


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass (the string literal right after each field)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _coerce(section: str, name: str, tp: Any, value: Any) -> Any:
    key = f"{section}.{name}"
    origin = typing.get_origin(tp)
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if tp is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if tp is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if tp is str:
            if not isinstance(value, (str, int)):
                raise ValueError
            return str(value)
        if origin is tuple:
            if isinstance(value, str):
                items = [v.strip() for v in value.split(",") if v.strip()]
            elif isinstance(value, (list, tuple)):
                items = [str(v) for v in value]
            else:
                raise ValueError
            return tuple(items)
    except (TypeError, ValueError):
        pass
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is tuple:
        return "a list of strings (comma-separated in env/CLI)"
    return {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}.get(
        tp, str(tp)
    )


def _validate(section: str, name: str, value: Any) -> None:
    key = (section, name)
    if key in _CHOICES:
        choices = _CHOICES[key]
        if str(value).upper() not in [c.upper() for c in choices]:
            raise ConfigError(f"{section}.{name}: {value!r} is not one of {', '.join(choices)}")
    if key in _POSITIVE and not value > 0:
        raise ConfigError(f"{section}.{name}: must be > 0, got {value!r}")
    if key == ("gateway", "port") and not 0 <= value <= 65535:
        raise ConfigError(f"gateway.port: must be in 0..65535, got {value!r}")
    if key == ("engine", "gpu_memory_utilization") and not 0 < value <= 1:
        raise ConfigError(f"engine.gpu_memory_utilization: must be in (0, 1], got {value!r}")
    if key == ("engine", "decoder_lookahead_steps") and value < -1:
        raise ConfigError(f"engine.decoder_lookahead_steps: must be >= -1 (-1 = exact), got {value!r}")
    if key == ("engine", "decoder_torch_threads") and value < 0:
        raise ConfigError(f"engine.decoder_torch_threads: must be >= 0, got {value!r}")
    if key == ("engine", "decoder_device") and not re.fullmatch(r"|cpu|cuda(:\d+)?", value):
        raise ConfigError(f"engine.decoder_device: expected '', 'cpu', 'cuda' or 'cuda:N', got {value!r}")
    if key == ("session", "min_audio_ms_per_unit") and not 0 <= value <= 1000:
        raise ConfigError(f"session.min_audio_ms_per_unit: must be in 0..1000 (0 = off), got {value!r}")
    if key == ("gateway", "load_log_interval_s") and value < 0:
        raise ConfigError(f"gateway.load_log_interval_s: must be >= 0 (0 = off), got {value!r}")
    if key == ("engine", "max_cudagraph_capture_size") and not 0 <= value <= 8192:
        raise ConfigError(f"engine.max_cudagraph_capture_size: must be in 0..8192 (0 = vLLM's), got {value!r}")
    if key == ("engine", "admit_interval_ms") and not 0 <= value <= 1000:
        raise ConfigError(f"engine.admit_interval_ms: must be in 0..1000 (0 = off), got {value!r}")
    if key == ("engine", "data_parallel_size") and value < 1:
        raise ConfigError(f"engine.data_parallel_size: must be >= 1, got {value!r}")


def load_config(
    toml_path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build the config: defaults < TOML < env ``VOICEGW_SECTION_FIELD`` < overrides.

    ``overrides`` maps ``"section.field"`` to a value (the CLI passes parsed flags here).
    Raises ``ConfigError`` with a message naming the key.
    """
    env = os.environ if env is None else env
    raw: dict[str, dict[str, Any]] = {s: {} for s in _SECTIONS}
    toml_path = toml_path or env.get("VOICEGW_CONFIG") or None
    if toml_path:
        path = Path(toml_path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path}: not found") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path}: invalid TOML ({exc})") from None
        top = ", ".join(k for k in _SECTIONS if "." not in k)
        for section, values in data.items():
            if section not in _SECTIONS or "." in section:
                raise ConfigError(f"config file {path}: unknown section [{section}]; known: {top}")
            if not isinstance(values, dict):
                raise ConfigError(f"config file {path}: [{section}] must be a table")
            for name, value in values.items():
                if f"{section}.{name}" in _SECTIONS:
                    if not isinstance(value, dict):
                        raise ConfigError(f"config file {path}: [{section}.{name}] must be a table")
                    raw[f"{section}.{name}"].update(value)
                else:
                    raw[section][name] = value
    # longest prefix first: VOICEGW_SESSION_SEGMENTER_* is the segmenter's, not session's
    claimed: set[str] = set()
    for section in sorted(_SECTIONS, key=len, reverse=True):
        prefix = f"VOICEGW_{section.upper().replace('.', '_')}_"
        for k, v in env.items():
            if k.startswith(prefix) and k not in claimed:
                claimed.add(k)
                raw[section][k[len(prefix) :].lower()] = v
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        section, _, name = dotted.rpartition(".")
        if section not in _SECTIONS:
            raise ConfigError(f"{dotted}: unknown section {section!r}")
        raw[section][name] = value

    built: dict[str, Any] = {}
    for section in sorted(_SECTIONS, key=lambda k: -k.count(".")):  # tables inside others first
        cls = _SECTIONS[section]
        hints = typing.get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls) if f"{section}.{f.name}" not in _SECTIONS}
        kwargs: dict[str, Any] = {}
        for name, value in raw[section].items():
            if name not in names:
                raise ConfigError(
                    f"{section}.{name}: unknown setting; known: {', '.join(sorted(names))}"
                )
            kwargs[name] = _coerce(section, name, hints[name], value)
        for f in dataclasses.fields(cls):
            if f"{section}.{f.name}" in built:
                kwargs[f.name] = built.pop(f"{section}.{f.name}")
        built[section] = cls(**kwargs)  # validates (``_Checked``)
    explicit = frozenset(f"{section}.{name}" for section, values in raw.items() for name in values)
    return Config(**built, explicit=explicit)


def describe() -> str:
    """The configuration reference as Markdown (docs/configuration.md is generated from it)."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `voicegw/config.py` (`voicegw config-doc`). Precedence: defaults < TOML "
        "(`--config FILE` or `VOICEGW_CONFIG`) < environment `VOICEGW_<SECTION>_<FIELD>` < CLI "
        "`--<section>.<field> VALUE`. A default shown as \"(CUDA: ...)\" is what `voicegw serve` uses "
        "instead when ChatTTS runs on vLLM on a CUDA GPU and the key is not set (`GPU_DEFAULTS`).",
        "",
    ]
    for section, cls in _SECTIONS.items():
        docs = field_docs(cls)
        lines += [f"## [{section}]", "", (cls.__doc__ or "").strip(), "", "| key | default | env | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            if f"{section}.{f.name}" in _SECTIONS:
                continue  # its own table
            default = f.default if f.default is not dataclasses.MISSING else None
            env_name = f"VOICEGW_{section.upper().replace('.', '_')}_{f.name.upper()}"
            shown = f"`{default!r}`"
            if f"{section}.{f.name}" in GPU_DEFAULTS:
                shown += f" (CUDA: `{GPU_DEFAULTS[f'{section}.{f.name}']!r}`)"
            lines.append(f"| `{f.name}` | {shown} | `{env_name}` | {docs.get(f.name, '')} |")
        lines.append("")
    return "\n".join(lines)


def cli_fields() -> list[tuple[str, type, Any, str]]:
    """(``section.field``, type, default, help) for every setting: the CLI builds flags from it."""
    out = []
    for section, cls in _SECTIONS.items():
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f"{section}.{f.name}" in _SECTIONS:
                continue  # its own table
            # argparse %-formats help strings: a literal % must be doubled
            out.append((f"{section}.{f.name}", hints[f.name], f.default, docs.get(f.name, "").replace("%", "%%")))
    return out

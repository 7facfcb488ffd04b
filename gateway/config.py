"""The gateway's settings: its sections of the configuration, and what a gateway process runs with.

``GatewaySettings`` bundles the sections the gateway reads (``[gateway]``, ``[scheduler]``,
``[limits]``, ``[session]`` with ``[session.segmenter]``) with the engine's settings admission
control needs (``engine.config.EngineConfig``: the batch limit, the steps to first audio).
``voicegw.config`` reads them from TOML, environment and CLI; the gateway imports nothing above it.
Frozen dataclasses, one attribute docstring per field, validated in the dataclass
(``engine.config.Checked``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from engine.config import Checked, ConfigError, EngineConfig

__all__ = [
    "ConfigError", "GatewayConfig", "GatewaySettings", "LimitsConfig", "SchedulerConfig", "SegmenterConfig",
    "SessionConfig",
]


@dataclass(frozen=True)
class GatewayConfig(Checked):
    """The WebSocket/HTTP server."""

    _section: ClassVar[str] = "gateway"
    _choices: ClassVar[Mapping[str, tuple[str, ...]]] = {"log_level": ("DEBUG", "INFO", "WARNING", "ERROR")}
    _positive: ClassVar[frozenset[str]] = frozenset({"write_limit_bytes", "send_timeout_ms"})

    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = 8765
    """TCP port for WebSocket, demo page, /healthz and /metrics."""
    processes: int = 0
    """Gateway processes (sessions, flow control, WebSocket I/O) sharing the port
    (``SO_REUSEPORT``), ``engine_cores`` vLLM engine cores through vLLM's multi-client front end, and
    one decoder process for them all (``voicegw.group``). 0: 4 when the engine is vLLM on a CUDA GPU
    (docs/gpu.md), else 1 (rounded up to a multiple of ``engine_cores``).
    Above 1 needs the ``vllm`` backend and a fixed ``port``;
    ``limits.max_sessions`` then applies per process."""
    engine_cores: int = 1
    """vLLM engine-core processes the gateway processes are spread over, evenly (``processes``
    must be a multiple), all on the one device: each core has its own scheduler, batch, KV cache
    (``engine.gpu_memory_utilization`` split evenly on a GPU; ``engine.kv_cache_gib`` each on CPU);
    one decoder process serves them all. The kernel spreads connections over the gateway processes,
    so sessions spread over the cores. One core steps one batch at a time from one Python thread: a second
    core adds the host time the first cannot give (bench/RESULTS.md)."""
    cuda_mps: bool = False
    """Run the GPU processes (engine cores, the decoder process) as clients of a CUDA MPS daemon that
    ``voicegw serve`` starts for itself (``nvidia-cuda-mps-control`` on PATH, from the NVIDIA
    driver's compute utilities), so that their kernels share the GPU at the same time instead of
    taking turns (``voicegw.mps``). An MPS daemon set up already (``CUDA_MPS_PIPE_DIRECTORY`` in the
    environment) is used as it is. True on a CUDA GPU where not set (without the program: a
    warning, then without MPS); set true, a missing program stops the start. False keeps each
    process's GPU faults its own (under MPS a fatal fault of one client can end the others' work;
    the group then restarts them)."""
    auth_tokens: tuple[str, ...] = ()
    """Bearer tokens accepted (header ``Authorization: Bearer``, subprotocol ``voicegw.token.<t>``
    or query ``?token=``). Empty: no auth (development only)."""
    allowed_origins: tuple[str, ...] = ()
    """Origin allow-list for browser connections. Empty: same-host origins only
    (http(s)://host:port of this server, localhost and 127.0.0.1); ``*`` allows any."""
    trusted_proxies: tuple[str, ...] = ()
    """Addresses or CIDR networks of the load balancers in front: from these peers the client's
    address is read from ``X-Forwarded-For`` (the first hop from the right that is not a trusted
    proxy; ``gateway.forwarded``), for ``limits.max_sessions_per_client`` and the logs. Empty:
    the header is ignored and the peer is the client (docs/deploy.md)."""
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

    def _check_field(self, name: str, value: Any) -> None:
        super()._check_field(name, value)
        if name == "port" and not 0 <= value <= 65535:
            self._fail(name, f"must be in 0..65535, got {value!r}")
        if name == "load_log_interval_s" and value < 0:
            self._fail(name, f"must be >= 0 (0 = off), got {value!r}")
        if name == "trusted_proxies":
            from gateway.forwarded import parse_networks

            try:
                parse_networks(value)
            except ValueError as exc:
                self._fail(name, str(exc))

    def _cross_check(self) -> None:
        if self.processes < 0:
            self._fail("processes", "must be >= 0 (0: automatic)")
        if self.processes > 1 and self.port == 0:
            self._fail("processes", "more than one process needs a fixed port (gateway.port 0 picks one per process)")
        if self.engine_cores < 1:
            self._fail("engine_cores", f"must be >= 1, got {self.engine_cores!r}")
        if self.processes and self.processes % self.engine_cores:
            self._fail("engine_cores", f"gateway.processes ({self.processes}) must be a multiple of it "
                       f"({self.engine_cores})")


@dataclass(frozen=True)
class SchedulerConfig(Checked):
    """Admission control (the engine schedules first come, first served: vLLM's default)."""

    _section: ClassVar[str] = "scheduler"
    _positive: ClassVar[frozenset[str]] = frozenset({"ttfa_target_ms"})

    ttfa_target_ms: float = 500.0
    """Admission: refuse a new utterance early when it cannot start within this time."""
    admission: bool = True
    """Admission control for the first segment of an utterance: when the engine has no free batch
    slot (``engine.max_num_seqs``) and the estimated time to first audio (queue length, learned
    step time and segment length) exceeds ``ttfa_target_ms``, the utterance fails at once with
    error ``engine_overloaded`` (the session stays open; the client may retry)."""
    realtime_guard: bool = False
    """Admission: also refuse a new utterance, free batch slot or not, when the step time learned
    from chunk arrivals at the batch it would join exceeds real time (one ChatTTS GPT step is
    21.3 ms of audio): starting it would make the answers already playing fall behind. Acts once
    32 chunk intervals were seen; on a machine slower than real time at batch 1, only past 1.5x
    its batch-1 step. Off until a GPU A/B decides (bench/RESULTS.md)."""


@dataclass(frozen=True)
class LimitsConfig(Checked):
    """Per-connection and global limits (see SECURITY.md)."""

    _section: ClassVar[str] = "limits"
    _positive: ClassVar[frozenset[str]] = frozenset({"max_sessions", "max_message_bytes", "max_utterance_chars", "max_chars_per_s", "max_messages_per_s", "idle_timeout_s", "flow_window_ms", "max_queued_utterances", "openai_max_input_chars", "elevenlabs_max_text_chars", "deepgram_max_text_chars"})

    max_sessions: int = 256
    """Concurrent sessions; over it: HTTP 503 at the handshake."""
    max_sessions_per_client: int = 0
    """Concurrent WebSocket sessions from one client address (behind ``gateway.trusted_proxies``:
    the forwarded one); over it: HTTP 429 at the handshake. 0: no per-client cap."""
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
    elevenlabs_max_text_chars: int = 10_000
    """ElevenLabs dialect: longest ``text`` of ``POST /v1/text-to-speech/{voice_id}`` (ElevenLabs'
    per-request limit, 10,000 characters); longer: 422 ``text_too_long``. ``max_utterance_chars``
    still caps it."""
    deepgram_max_text_chars: int = 2_000
    """Deepgram dialect: longest ``text`` of ``POST /v1/speak`` (Deepgram documents 2,000
    characters); longer: 400 ``TEXT_TOO_LONG``. ``max_utterance_chars`` still caps it."""
    max_queued_utterances: int = 16
    """Unfinished utterances a session may hold (queued behind the one speaking included); a new
    utterance beyond it is refused with ``queue_full`` (the wire's ``max_queued_utterances``)."""

    def _check_field(self, name: str, value: Any) -> None:
        super()._check_field(name, value)
        if name == "max_sessions_per_client" and value < 0:
            self._fail(name, f"must be >= 0 (0 = no cap), got {value!r}")


@dataclass(frozen=True)
class SegmenterConfig(Checked):
    """Where text is cut into segments (``gateway/segmenter.py``); a unit is a letter or digit, a
    CJK character counts 3."""

    _section: ClassVar[str] = "session.segmenter"
    _positive: ClassVar[frozenset[str]] = frozenset({"first_min_units", "first_max_units", "first_wait_ms", "min_units", "max_units", "idle_wait_ms"})

    first_min_units: int = 10
    """First segment: shortest text cut at a clause boundary."""
    first_max_units: int = 80
    """First segment: without any boundary, cut at a space once this long."""
    first_wait_ms: float = 200.0
    """First segment: after this long since the first character, send complete words."""
    min_units: int = 24
    """Later segments: shortest text cut at a sentence boundary (unless idle or forced)."""
    max_units: int = 200
    """Any segment: longest text."""
    idle_wait_ms: float = 400.0
    """Later segments: when nothing is in flight, text that waited this long goes out."""
    urgent_left_ms: float = 400.0
    """Later segments: when no segment is generating and the listener has less than this much
    audio left to play (at the client and not yet sent), the complete words waiting go out without
    waiting for a sentence end (cut at a clause boundary when there is one, at least
    ``first_min_units`` long). 0: off (always wait for a sentence end, ``idle_wait_ms`` or
    ``max_units``)."""

    def _check_field(self, name: str, value: Any) -> None:
        super()._check_field(name, value)
        if name == "urgent_left_ms" and not 0 <= value <= 10_000:
            self._fail(name, f"must be in [0, 10000] (0 = off), got {value!r}")

    def _cross_check(self) -> None:
        if self.first_min_units > self.first_max_units:
            self._fail("first_min_units", f"must be <= first_max_units ({self.first_max_units})")
        if self.min_units > self.max_units:
            self._fail("min_units", f"must be <= max_units ({self.max_units})")


@dataclass(frozen=True)
class SessionConfig(Checked):
    """One session's pacing and bookkeeping (``gateway/session.py``), and its segmenter."""

    _section: ClassVar[str] = "session"
    _positive: ClassVar[frozenset[str]] = frozenset({"max_in_flight", "frame_ms", "prefetch_ms", "stale_report_ms", "playback_report_interval_ms", "rate_strikes_to_close", "history_utterances", "est_ms_per_unit"})

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
    session; two generating at once make a full batch late (bench/RESULTS.md)."""
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
    tell_engine_queued_audio: bool = True
    """Each segment's request carries the audio the listener holds ahead of it
    (``SpeechRequest.queued_audio_ms``: the client's buffer, ``FlowControl.left_estimate``, and
    audio held here unsent), so the decoder sizes the segment's chunks by the listener's whole
    lead: a segment queued behind seconds of audio is decoded in whole chunks, one decoder row per
    ``engine.chunk_steps``, instead of small ones that each cost a row. False: every segment's
    chunks start small, as if the listener had nothing else to play."""
    min_audio_ms_per_unit: float = 0.0
    """Floor on a segment's audio per text unit (``gateway.segmenter.text_units``): the GPT may not
    stop (EOS is masked through ``min_new_tokens``) before ``units x this`` ms of audio. Guards
    against a GPT that stops before the end of its text; typical speech is ``est_ms_per_unit``.
    0: off, the model alone decides. The GPU benchmarks set 32 (half of typical speech) so that
    random-weight checkpoints, which stop at random, give segments of speech-like length."""

    def _check_field(self, name: str, value: Any) -> None:
        super()._check_field(name, value)
        if name == "min_audio_ms_per_unit" and not 0 <= value <= 1000:
            self._fail(name, f"must be in 0..1000 (0 = off), got {value!r}")


@dataclass(frozen=True)
class GatewaySettings(Checked):
    """What a gateway process runs with: its sections, and the engine's settings admission control
    reads. ``voicegw.config.Config`` is one (with where its keys came from)."""

    _section: ClassVar[str] = ""

    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    session: SessionConfig = field(default_factory=SessionConfig)

    def _cross_check(self) -> None:
        if self.session.frame_ms > self.limits.flow_window_ms:
            raise ConfigError(f"session.frame_ms: must be <= limits.flow_window_ms ({self.limits.flow_window_ms})")

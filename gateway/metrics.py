"""Prometheus metrics of the gateway (one registry per server, so tests can run several)."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gateway import protocol as P
from gateway.session import SessionObserver, TtfaParts

CONTENT_TYPE = CONTENT_TYPE_LATEST

_TTFA_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
_LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
_PART_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 1.0, 2.0, 5.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.sessions = Gauge("voicegw_open_sessions", "Open WebSocket sessions", registry=r)
        self.sessions_total = Counter("voicegw_sessions_accepted_total", "Sessions accepted", registry=r)
        self.rejected = Counter(
            "voicegw_handshakes_rejected_total", "Handshakes refused, by reason", ["reason"], registry=r
        )
        self.closes = Counter("voicegw_closes_total", "Sessions closed, by close code", ["code"], registry=r)
        self.errors = Counter("voicegw_errors_total", "error messages sent, by code", ["code"], registry=r)
        self.ttfa = Histogram(
            "voicegw_ttfa_seconds", "Time to first audio: first text of an utterance -> its first "
            "audio frame written to the socket", buckets=_TTFA_BUCKETS, registry=r,
        )
        self.ttfa_part = Histogram(
            "voicegw_ttfa_part_seconds", "TTFA split: text_wait (first text -> first segment ready), "
            "queue (ready -> submitted), engine (submitted -> first audio), send (first audio -> "
            "written to the socket)", ["part"], buckets=_PART_BUCKETS, registry=r,
        )
        self.underruns = Counter("voicegw_client_underruns_total", "Underruns reported by clients", registry=r)
        self.audio_sent = Counter("voicegw_audio_sent_seconds_total", "Audio sent to clients", registry=r)
        self.frames_sent = Counter("voicegw_audio_frames_sent_total", "Audio frames sent", registry=r)
        self.dropped = Counter(
            "voicegw_audio_dropped_seconds_total",
            "Audio generated or sent but never played, by reason (cancel, error, disconnect, "
            "slow_reader, shutdown)", ["reason"], registry=r,
        )
        self.utterances = Counter(
            "voicegw_utterances_total", "Utterances finished, by outcome", ["outcome"], registry=r
        )
        self.segments = Counter("voicegw_segments_total", "Segments submitted to the engine", registry=r)
        self.admission_refused = Counter(
            "voicegw_admission_refused_total",
            "Utterances refused by admission control (error engine_overloaded, with retry_after_ms)",
            registry=r,
        )
        self.loop_lag = Histogram(
            "voicegw_event_loop_lag_seconds", "How much later than asked the event loop ran a 20 ms "
            "sleep (gateway.monitor)", buckets=_LAG_BUCKETS, registry=r,
        )
        self.engine_running = Gauge(
            "voicegw_engine_running_requests", "Engine requests running (engine health)", registry=r
        )

    def observe_ttfa(self, parts: TtfaParts, written_s: float) -> None:
        self.ttfa.observe(max(0.0, written_s - parts.first_text_s))
        self.ttfa_part.labels("text_wait").observe(max(0.0, parts.text_wait_s))
        self.ttfa_part.labels("queue").observe(max(0.0, parts.queue_s))
        self.ttfa_part.labels("engine").observe(max(0.0, parts.engine_s))
        self.ttfa_part.labels("send").observe(max(0.0, written_s - parts.first_chunk_s))

    def observer(self) -> SessionObserver:
        return _Observer(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Observer(SessionObserver):
    def __init__(self, m: GatewayMetrics) -> None:
        self.m = m

    def error(self, code: P.ErrorCode) -> None:
        self.m.errors.labels(code.value).inc()

    def underruns(self, count: int) -> None:
        self.m.underruns.inc(count)

    def audio_dropped(self, seconds: float, reason: str) -> None:
        self.m.dropped.labels(reason).inc(seconds)

    def utterance_finished(self, outcome: str) -> None:
        self.m.utterances.labels(outcome).inc()

    def segment_submitted(self) -> None:
        self.m.segments.inc()

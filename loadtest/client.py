"""One simulated chat session: streams LLM-like text in, plays audio out in real time.

Runs a ``SessionPlan`` (``plan.py``) against a voicegw server and records timestamps of
everything that matters into plain dicts (``SessionRecord``/``UtteranceRecord``, JSON-able), so
worker processes can hand them back and ``metrics`` can aggregate them.

The protocol is the product's Python client's (``clients.python.Client``: connect, session,
``text.delta``/``text.end``, ``cancel``, ``playback`` reports, receiving); a session records
through its recorder hook (``clients.python.client.ClientRecorder``) and plays the audio on
its own simulated listener (``ClockedPlayout``, ``playback="none"``, no audio kept).

Clock: ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for all processes of the machine), so
times from different worker processes compare directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import websockets

from clients.python.client import NO_RETRY, Client, ClientRecorder, Utterance, VoicegwError
from clients.python.playout import ClockedPlayout
from gateway import protocol as P
from loadtest.metrics import summarize
from loadtest.netguard import check_local_url
from loadtest.plan import MAX_UTTERANCES_PER_SESSION, SessionPlan, UtterancePlan, split_deltas, tokenize

#: Client playback report period (browsers report about every 250 ms).
REPORT_PERIOD_S = 0.25
#: Most buffer-level samples kept per session (for the plot).
MAX_LEVEL_SAMPLES = 4_000
#: Client stall detector: the worker's event loop is probed every ``STALL_PROBE_S``; a probe
#: that wakes more than ``CLIENT_STALL_MS`` late records a stall (the load generator itself
#: was not running: its timestamps, and the playback it simulates, are not the server's doing).
STALL_PROBE_S = 0.05
CLIENT_STALL_MS = 200.0
MAX_CLIENT_STALLS = 2_000
#: Most probe lateness samples a worker keeps (``watch_stalls``: 20 minutes of 50 ms probes).
MAX_LAG_SAMPLES = 24_000
#: Receive buffer of a slow-reader session's socket.
SLOW_READER_RCVBUF_BYTES = 8_192
#: Longest wait for an utterance to finish after its text ended.
UTTERANCE_TIMEOUT_S = 60.0


@dataclass
class SegmentRecord:
    index: int
    t_started: float | None = None
    """``segment.started`` received."""
    t_first_audio: float | None = None
    t_last_audio: float | None = None
    t_done: float | None = None
    samples: int = 0
    text_chars: int | None = None
    buffered_ms_at_first_audio: float | None = None
    """Client buffer just before this segment's first audio arrived."""
    gap_ms: float | None = None
    """Silence heard before this segment's first audio (an underrun that this audio ended)."""
    t_text_complete: float | None = None
    """The ``text.delta`` that completed this segment's text was sent."""
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class UtteranceRecord:
    index: int
    chars: int
    utterance_id: int | None = None
    t_first_text: float | None = None
    """The first ``text.delta`` was sent."""
    t_first_segment_text: float | None = None
    """The ``text.delta`` that completed the first segment's text was sent (when the server
    tells the segment's text length)."""
    t_text_end: float | None = None
    t_first_audio: float | None = None
    t_last_audio: float | None = None
    t_done: float | None = None
    """``utterance.done`` received."""
    done: dict[str, Any] = field(default_factory=dict)
    """``utterance.done`` fields (engine-side breakdown when the server provides it)."""
    samples: int = 0
    frames: int = 0
    segments: dict[int, SegmentRecord] = field(default_factory=dict)
    t_cancel: float | None = None
    t_cancelled: float | None = None
    t_last_audio_after_cancel: float | None = None
    frames_after_cancel: int = 0
    error: str | None = None
    timed_out: bool = False
    """No ``utterance.done`` within ``UTTERANCE_TIMEOUT_S`` of its text end."""
    cut: bool = False
    """Still running when the scenario ended (e.g. a burst's background answers)."""


@dataclass
class SessionRecord:
    session_id: int
    role: str
    t0: float = 0.0
    """The run's common start (monotonic); ``underruns`` and ``levels`` are relative to it."""
    t_connect: float | None = None
    t_started: float | None = None
    connect_error: str | None = None
    close_code: int | None = None
    """How the server ended the connection (1006: without a close frame); None while open."""
    close_reason: str = ""
    t_closed: float | None = None
    t_stop_reading: float | None = None
    utterances: list[UtteranceRecord] = field(default_factory=list)
    underruns: list[tuple[float, float | None]] = field(default_factory=list)
    underrun_ms: float = 0.0
    levels: list[tuple[float, float]] = field(default_factory=list)
    """(t, client buffered ms) every report period."""
    errors: list[str] = field(default_factory=list)
    bad_frames: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class _Session(ClientRecorder):
    """One plan's session: drives a ``clients.python.Client`` and records what it receives
    through the client's recorder hook (the callbacks below)."""

    def __init__(self, plan: SessionPlan, url: str, t0: float, hard_end: float) -> None:
        self.plan = plan
        self.url = check_local_url(url)
        self.t0 = t0
        self.hard_end = min(hard_end, t0 + plan.end_s)
        self.rec = SessionRecord(plan.session_id, plan.role, t0)
        self.jb = ClockedPlayout(plan.sample_rate_hz, prebuffer_ms=plan.prebuffer_ms)
        self.instant = plan.instant_playback
        self.rng = random.Random(plan.seed)
        self.client: Client | None = None
        self.cur: UtteranceRecord | None = None
        self.finished = asyncio.Event()
        self.first_audio = asyncio.Event()
        self.reading = True
        self.by_id: dict[int, UtteranceRecord] = {}
        self.sent_text = ""
        self.sent_marks: list[tuple[int, float]] = []
        """(cumulative chars sent, time) of the current utterance's deltas."""
        self.bytes_per_sample = 2

    # ------------------------------------------------------------------------- receive (recorder hook)

    def _utt_for(self, u: Utterance | None, uid: int | None) -> UtteranceRecord | None:
        """The record of a server utterance id: known ids keep their record (late frames of a
        cancelled answer); a new one the client attributes to its open utterance is the current
        record's; no id at all means the current one."""
        if uid is None:
            return self.cur
        rec = self.by_id.get(uid)
        if rec is not None:
            return rec
        cur = self.cur
        if u is not None and cur is not None and cur.utterance_id is None:
            cur.utterance_id = uid
            self.by_id[uid] = cur
            return cur
        return None

    def on_session_started(self, msg: dict[str, Any], t: float) -> None:
        self.rec.t_started = t

    def on_audio(self, u: Utterance | None, header: P.AudioFrameHeader, payload: bytes, now: float) -> None:
        utt = self.by_id.get(header.utterance_id) or self._utt_for(u, header.utterance_id)
        if utt is None:
            self.rec.bad_frames += 1
            return
        samples = len(payload) // self.bytes_per_sample
        if utt.t_cancel is not None:
            utt.frames_after_cancel += 1
            utt.t_last_audio_after_cancel = now
            return
        utt.frames += 1
        utt.samples += samples
        if utt.t_first_audio is None:
            utt.t_first_audio = now
            self.first_audio.set()
        utt.t_last_audio = now
        seg = utt.segments.get(header.segment)
        if seg is None:
            seg = utt.segments[header.segment] = SegmentRecord(header.segment)
        if seg.t_first_audio is None:
            seg.t_first_audio = now
            self.jb.advance(now)
            seg.buffered_ms_at_first_audio = round(self.jb.buffered_ms, 1)
            open_ev = self.jb.open_underrun
            seg.gap_ms = 0.0 if open_ev is None else round((now - open_ev.start_s) * 1000.0, 1)
        seg.t_last_audio = now
        seg.samples += samples
        if self.instant:
            self.jb.play_at_once(samples)  # a consumer as fast as the wire (throughput runs)
        else:
            self.jb.push(now, samples)

    @staticmethod
    def _uid(msg: dict[str, Any]) -> int | None:
        uid = msg.get("utterance_id")
        return uid if isinstance(uid, int) else None

    def on_segment_started(self, u: Utterance | None, msg: dict[str, Any], now: float) -> None:
        utt = self._utt_for(u, self._uid(msg))
        if utt is None:
            return
        idx = int(msg.get("segment", msg.get("index", len(utt.segments))))
        seg = utt.segments.setdefault(idx, SegmentRecord(idx))
        seg.t_started = now
        seg.info = {k: v for k, v in msg.items() if k not in ("type",)}
        end = self._segment_text_end(msg)
        if end is not None:
            seg.text_chars = end
            seg.t_text_complete = self._sent_time_of_char(end)
            if idx == 0 and utt.t_first_segment_text is None:
                utt.t_first_segment_text = seg.t_text_complete

    def on_segment_done(self, u: Utterance | None, msg: dict[str, Any], now: float) -> None:
        utt = self._utt_for(u, self._uid(msg))
        if utt is not None:
            idx = int(msg.get("segment", msg.get("index", -1)))
            seg = utt.segments.setdefault(idx, SegmentRecord(idx))
            seg.t_done = now

    def on_utterance_done(self, u: Utterance | None, msg: dict[str, Any], now: float) -> None:
        utt = self._utt_for(u, self._uid(msg))
        if utt is not None:
            utt.t_done = now
            utt.done = {k: v for k, v in msg.items() if k != "type"}
            if msg.get("status") not in (None, "ok") and utt.error is None:
                utt.error = str(msg.get("status"))
            self.jb.end_of_audio(now)
            self.finished.set()

    def on_cancelled(self, u: Utterance | None, msg: dict[str, Any], now: float) -> None:
        utt = self._utt_for(u, self._uid(msg)) or self.cur
        if utt is not None:
            utt.t_cancelled = now
            self.finished.set()

    def on_error(self, u: Utterance | None, msg: dict[str, Any], now: float) -> None:
        code = str(msg.get("code"))
        self.rec.errors.append(code)
        utt = self._utt_for(u, self._uid(msg))
        if utt is not None and utt.error is None and code not in ("rate_limited",):
            utt.error = code
            self.jb.end_of_audio(now)
            self.finished.set()

    def on_closed(self, code: int | None, reason: str, now: float) -> None:
        self.rec.close_code = code
        self.rec.close_reason = reason
        self.rec.t_closed = now
        self.finished.set()

    def _segment_text_end(self, msg: dict[str, Any]) -> int | None:
        """End (exclusive, in characters of the text sent so far) of a segment's text: from an
        explicit offset if the server gives one, else by finding the segment's ``text`` in what
        was sent (the first segment is a prefix of the utterance, modulo whitespace)."""
        for key in ("char_end", "text_end"):
            v = msg.get(key)
            if isinstance(v, int) and v >= 0:
                return v
        text = msg.get("text")
        if not isinstance(text, str) or not text.strip():
            return None
        words = text.split()
        pos = 0
        for w in words:  # match word by word: the segmenter may normalise spaces
            i = self.sent_text.find(w, pos)
            if i < 0:
                return None
            pos = i + len(w)
        return pos

    def _sent_time_of_char(self, char_end: int) -> float | None:
        for chars, t in self.sent_marks:
            if chars >= char_end:
                return t
        return self.sent_marks[-1][1] if self.sent_marks else None

    async def _reporter(self, client: Client) -> None:
        while True:
            await asyncio.sleep(REPORT_PERIOD_S)
            now = time.monotonic()
            self.jb.advance(now)
            if len(self.rec.levels) < MAX_LEVEL_SAMPLES:
                self.rec.levels.append((round(now - self.t0, 4), round(self.jb.buffered_ms, 1)))
            if not self.reading:
                continue  # a stalled client sends nothing either
            await client.send_playback(self.jb.played_samples, self.jb.buffered_ms, self.jb.underrun_count)

    # ------------------------------------------------------------------------- drive

    async def run(self) -> SessionRecord:
        plan = self.plan
        await _sleep_until(self.t0 + plan.start_s)
        self.rec.t_connect = time.monotonic()
        try:
            async with asyncio.timeout(max(1.0, self.hard_end - time.monotonic())):
                await self._run_connected()
        except TimeoutError:
            if self.cur is not None and self.cur.t_done is None and not self.cur.timed_out:
                self.cur.cut = True
        except VoicegwError as exc:
            if exc.code == "handshake_failed":
                self.rec.connect_error = f"{type(exc).__name__}: {exc}"[:200]
            elif exc.code == "closed" and self.rec.close_code is None and exc.detail.get("code") is not None:
                self.rec.close_code = exc.detail["code"]
                self.rec.close_reason = exc.detail.get("reason") or ""
            # else: the gateway refused the session (its error code is in ``errors``) or never
            # answered ``session.start``
        except (OSError, ValueError, websockets.InvalidHandshake, websockets.InvalidURI) as exc:
            self.rec.connect_error = f"{type(exc).__name__}: {exc}"[:200]
        finally:
            if self.client is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.client.close(), 2.0)
                self.rec.bad_frames += self.client.bad_frames
                self.rec.errors += ["bad_json"] * self.client.bad_messages
        end = time.monotonic()
        self.jb.advance(end)
        self.rec.underruns = [(u.start_s - self.t0, None if u.end_s is None else u.end_s - self.t0)
                              for u in self.jb.underruns]
        self.rec.underrun_ms = self.jb.underrun_ms(end)
        return self.rec

    async def _small_buffer_socket(self) -> socket.socket:
        """A connected socket with a tiny receive buffer: a client that stops reading then
        blocks the server's writes within ~``SLOW_READER_RCVBUF_BYTES`` instead of the
        megabytes a loopback socket buffers by default."""
        parts = urlsplit(self.url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SLOW_READER_RCVBUF_BYTES)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, (host, port))
        except BaseException:
            sock.close()
            raise
        return sock

    async def _run_connected(self) -> None:
        plan = self.plan
        slow = plan.stop_reading_after_audio_s is not None
        # no playback of its own ("none"), no audio kept (the recorder counts it), no retries or
        # reconnects (the server is measured as it is), the load generator's socket settings
        self.client = client = Client(
            self.url, voice=plan.voice, sample_rate_hz=plan.sample_rate_hz,
            options={"seed": plan.seed % (2**31 - 1)}, playback="none", max_queued_chunk_s=0,
            open_timeout_s=10.0, retry=NO_RETRY, recorder=self,
            connect_options={"max_size": 2**20, "max_queue": 16, "ping_interval": None},
            socket_factory=self._small_buffer_socket if slow else None,
        )
        await client.connect()
        reporter = asyncio.create_task(self._reporter(client))
        try:
            await self._speak_all(client)
        finally:
            reporter.cancel()
            with contextlib.suppress(BaseException):
                await reporter

    async def _speak_all(self, client: Client) -> None:
        plan = self.plan
        n = 0
        while n < MAX_UTTERANCES_PER_SESSION:
            for up in plan.utterances:
                if plan.loop_until_s is not None and n and time.monotonic() >= self.t0 + plan.loop_until_s:
                    return
                if up.think_s:
                    await asyncio.sleep(up.think_s)
                ok = await self._speak(client, n, up)
                n += 1
                if not ok or self.rec.close_code is not None or self.rec.t_closed is not None:
                    return
            if plan.loop_until_s is None:
                return

    async def _speak(self, client: Client, index: int, up: UtterancePlan) -> bool:
        plan = self.plan
        utt = UtteranceRecord(index=index, chars=len(up.text))
        self.rec.utterances.append(utt)
        self.cur = utt
        self.sent_marks = []
        self.sent_text = ""
        self.finished.clear()
        self.first_audio.clear()
        self.jb.begin_utterance(time.monotonic())
        aux: list[asyncio.Task[None]] = []
        if up.cancel_after_audio_s is not None:
            aux.append(asyncio.create_task(self._cancel_later(client, utt, up.cancel_after_audio_s)))
        if plan.stop_reading_after_audio_s is not None:
            aux.append(asyncio.create_task(self._stall_later(client, plan.stop_reading_after_audio_s)))
        try:
            sent = 0
            pieces = (split_deltas(up.text, *plan.delta_chars, self.rng) if plan.delta_chars
                      else tokenize(up.text, plan.token_chars, self.rng))
            for tok in pieces:
                if utt.t_cancel is not None or self.finished.is_set():
                    break
                await client.send_text(tok)
                now = time.monotonic()
                sent += len(tok)
                self.sent_text += tok
                self.sent_marks.append((sent, now))
                if utt.t_first_text is None:
                    utt.t_first_text = now
                await asyncio.sleep(self.rng.uniform(0.5, 1.5) / plan.tokens_per_s)
            if utt.t_cancel is None and not self.finished.is_set():
                await client.end()
                utt.t_text_end = time.monotonic()
            try:
                await asyncio.wait_for(self.finished.wait(), UTTERANCE_TIMEOUT_S)
            except TimeoutError:
                utt.timed_out = True
                return False
            if utt.t_cancel is not None and utt.t_cancelled is not None:
                # let late frames of the cancelled utterance arrive (cancel-to-silence)
                await asyncio.sleep(0.05)
            if plan.wait_playback:
                await self._wait_played()
            return utt.error is None or utt.error == P.ErrorCode.RATE_LIMITED
        finally:
            for t in aux:
                t.cancel()
                with contextlib.suppress(BaseException):
                    await t

    async def _wait_played(self) -> None:
        """A chat client lets the answer play out before the next turn."""
        while True:
            now = time.monotonic()
            self.jb.advance(now)
            drained = self.jb.drained_at()
            if drained is None or drained <= now or self.jb.queued_samples == 0:
                return
            await asyncio.sleep(min(0.5, drained - now + 0.001))

    async def _cancel_later(self, client: Client, utt: UtteranceRecord, after_s: float) -> None:
        await self.first_audio.wait()
        await asyncio.sleep(after_s)
        if utt.t_done is not None or utt.error is not None:
            return
        now = time.monotonic()
        self.jb.cancel(now)
        utt.t_cancel = now
        with contextlib.suppress(VoicegwError):  # the reply is recorded (on_cancelled), not awaited here
            await client.cancel(played_samples=self.jb.played_samples)

    async def _stall_later(self, client: Client, after_s: float) -> None:
        await self.first_audio.wait()
        await asyncio.sleep(after_s)
        self.reading = False
        client.stop_reading()
        now = time.monotonic()
        self.rec.t_stop_reading = now
        self.jb.cancel(now)  # a stalled client plays nothing more: no underrun accounting


async def _sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


async def watch_stalls(t0: float, out: list[tuple[float, float]], probe_s: float = STALL_PROBE_S,
                       stall_ms: float = CLIENT_STALL_MS, limit: int = MAX_CLIENT_STALLS,
                       lags_ms: list[float] | None = None) -> None:
    """Record (start, end) in seconds after ``t0`` whenever this event loop did not run for more
    than ``stall_ms`` (a probe sleeping ``probe_s`` woke that late), and every probe's lateness in
    ``lags_ms`` (at most ``MAX_LAG_SAMPLES``). Runs until cancelled."""
    while True:
        t = time.monotonic()
        await asyncio.sleep(probe_s)
        now = time.monotonic()
        late_ms = (now - t - probe_s) * 1000.0
        if lags_ms is not None and len(lags_ms) < MAX_LAG_SAMPLES:
            lags_ms.append(late_ms)
        if late_ms > stall_ms and len(out) < limit:
            out.append((round(t + probe_s - t0, 4), round(now - t0, 4)))


def lag_summary(lags_ms: list[float]) -> dict[str, float | int]:
    """A worker's probe lateness: sample count, p50 / p99 / max in ms (zeros without samples)."""
    s = summarize(lags_ms)
    return {"n": s["n"] or 0, **{f"{k}_ms": round(float(s[k] or 0.0), 1) for k in ("p50", "p99", "max")}}


async def run_sessions(plans: list[SessionPlan], url: str, t0: float, hard_end: float) -> list[dict[str, Any]]:
    """Run plans concurrently in this event loop; return their records as dicts. Every record
    carries ``client_stalls``: this worker's own stalls (``watch_stalls``), shared by its sessions,
    and ``client_lag``: its event loop's lateness (``lag_summary``; ``worker`` tells workers apart)."""
    stalls: list[tuple[float, float]] = []
    lags_ms: list[float] = []
    watcher = asyncio.create_task(watch_stalls(t0, stalls, lags_ms=lags_ms), name="client stall watch")
    sessions = [_Session(p, url, t0, hard_end) for p in plans]
    try:
        results = await asyncio.gather(*(s.run() for s in sessions), return_exceptions=True)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    lag = {"worker": os.getpid(), **lag_summary(lags_ms)}
    out: list[dict[str, Any]] = []
    for s, r in zip(sessions, results, strict=True):
        if isinstance(r, BaseException):
            s.rec.errors.append(f"client crash: {type(r).__name__}: {r}"[:300])
            rec = s.rec.to_json()
        else:
            rec = r.to_json()
        rec["client_stalls"] = [list(x) for x in stalls]
        rec["client_lag"] = lag
        out.append(rec)
    return out

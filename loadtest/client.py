"""One simulated chat session: streams LLM-like text in, plays audio out in real time.

Runs a ``SessionPlan`` (``plan.py``) against a voicegw server and records timestamps of
everything that matters into plain dicts (``SessionRecord``/``UtteranceRecord``, JSON-able), so
worker processes can hand them back and ``metrics`` can aggregate them.

Clock: ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for all processes of the machine), so
times from different worker processes compare directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import orjson
import websockets
from websockets.asyncio.client import ClientConnection

from clients.python.playout import ClockedPlayout
from gateway import protocol as P
from loadtest.netguard import check_local_url
from loadtest.plan import MAX_UTTERANCES_PER_SESSION, SessionPlan, UtterancePlan, tokenize

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


class _Session:
    def __init__(self, plan: SessionPlan, url: str, t0: float, hard_end: float) -> None:
        self.plan = plan
        self.url = check_local_url(url)
        self.t0 = t0
        self.hard_end = min(hard_end, t0 + plan.end_s)
        self.rec = SessionRecord(plan.session_id, plan.role, t0)
        self.jb = ClockedPlayout(plan.sample_rate_hz)
        self.rng = random.Random(plan.seed)
        self.ws: ClientConnection | None = None
        self.cur: UtteranceRecord | None = None
        self.cur_plan: UtterancePlan | None = None
        self.finished = asyncio.Event()
        self.first_audio = asyncio.Event()
        self.reading = True
        self.resume_reading = asyncio.Event()
        self.ids_seen: set[int] = set()
        self.by_id: dict[int, UtteranceRecord] = {}
        self.sent_text = ""
        self.sent_marks: list[tuple[int, float]] = []
        """(cumulative chars sent, time) of the current utterance's deltas."""
        self.bytes_per_sample = 2

    # ------------------------------------------------------------------------- receive

    def _utt_for(self, uid: int | None) -> UtteranceRecord | None:
        if uid is None:
            return self.cur
        if uid in self.by_id:
            return self.by_id[uid]
        cur = self.cur
        if cur is not None and cur.utterance_id is None and cur.t_first_text is not None:
            cur.utterance_id = uid
            self.by_id[uid] = cur
            return cur
        return None

    def _on_audio(self, data: bytes, now: float) -> None:
        try:
            header, payload = P.unpack_audio_frame(data)
        except ValueError:
            self.rec.bad_frames += 1
            return
        utt = self._utt_for(header.utterance_id)
        samples = len(payload) // self.bytes_per_sample
        if utt is None:
            self.rec.bad_frames += 1
            return
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
        seg = utt.segments.setdefault(header.segment, SegmentRecord(header.segment))
        if seg.t_first_audio is None:
            seg.t_first_audio = now
            self.jb.advance(now)
            seg.buffered_ms_at_first_audio = round(self.jb.buffered_ms, 1)
            open_ev = self.jb.open_underrun
            seg.gap_ms = 0.0 if open_ev is None else round((now - open_ev.start_s) * 1000.0, 1)
        seg.t_last_audio = now
        seg.samples += samples
        if self.plan.instant_playback:
            self.jb.play_at_once(samples)  # a consumer as fast as the wire (throughput runs)
        else:
            self.jb.push(now, samples)

    def _on_json(self, msg: dict[str, Any], now: float) -> None:
        mtype = msg.get("type")
        uid = msg.get("utterance_id")
        uid = uid if isinstance(uid, int) else None
        if mtype == P.ServerType.SEGMENT_STARTED:
            utt = self._utt_for(uid)
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
        elif mtype == P.ServerType.SEGMENT_DONE:
            utt = self._utt_for(uid)
            if utt is not None:
                idx = int(msg.get("segment", msg.get("index", -1)))
                seg = utt.segments.setdefault(idx, SegmentRecord(idx))
                seg.t_done = now
        elif mtype == P.ServerType.UTTERANCE_DONE:
            utt = self._utt_for(uid)
            if utt is not None:
                utt.t_done = now
                utt.done = {k: v for k, v in msg.items() if k != "type"}
                if msg.get("status") not in (None, "ok") and utt.error is None:
                    utt.error = str(msg.get("status"))
                self.jb.end_of_audio(now)
                self.finished.set()
        elif mtype == P.ServerType.CANCELLED:
            utt = self._utt_for(uid) or self.cur
            if utt is not None:
                utt.t_cancelled = now
                self.finished.set()
        elif mtype == P.ServerType.ERROR:
            code = str(msg.get("code"))
            self.rec.errors.append(code)
            utt = self._utt_for(uid) if uid is not None else self.cur
            if utt is not None and utt.error is None and code not in ("rate_limited",):
                utt.error = code
                self.jb.end_of_audio(now)
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

    async def _reader(self) -> None:
        assert self.ws is not None
        ws = self.ws
        try:
            while True:
                if not self.reading:
                    await self._stalled(ws)
                    return
                data = await ws.recv()
                now = time.monotonic()
                if isinstance(data, bytes):
                    self._on_audio(data, now)
                else:
                    try:
                        msg = orjson.loads(data)
                    except orjson.JSONDecodeError:
                        self.rec.errors.append("bad_json")
                        continue
                    if isinstance(msg, dict):
                        self._on_json(msg, now)
        except websockets.ConnectionClosed as exc:
            rcvd = exc.rcvd
            if rcvd is not None:
                self.rec.close_code = rcvd.code
                self.rec.close_reason = rcvd.reason
            self.rec.t_closed = time.monotonic()
            self.finished.set()

    async def _stalled(self, ws: ClientConnection) -> None:
        """Slow reader: never read again; notice when the server gives up on us."""
        await ws.wait_closed()
        self.rec.t_closed = time.monotonic()
        self.rec.close_code = ws.close_code
        self.rec.close_reason = ws.close_reason or ""
        self.finished.set()

    async def _reporter(self) -> None:
        assert self.ws is not None
        while True:
            await asyncio.sleep(REPORT_PERIOD_S)
            now = time.monotonic()
            self.jb.advance(now)
            if len(self.rec.levels) < MAX_LEVEL_SAMPLES:
                self.rec.levels.append((round(now - self.t0, 4), round(self.jb.buffered_ms, 1)))
            if not self.reading:
                continue  # a stalled client sends nothing either
            await self._send(
                {
                    "type": P.ClientType.PLAYBACK.value,
                    "played_samples": self.jb.played_samples,
                    "buffered_ms": round(self.jb.buffered_ms, 1),
                    "underruns": self.jb.underrun_count,
                }
            )

    async def _send(self, msg: dict[str, Any]) -> None:
        assert self.ws is not None
        await self.ws.send(orjson.dumps(msg).decode())

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
        except (OSError, websockets.InvalidHandshake, websockets.InvalidURI) as exc:
            self.rec.connect_error = f"{type(exc).__name__}: {exc}"[:200]
        except websockets.ConnectionClosed as exc:
            if exc.rcvd is not None:
                self.rec.close_code = exc.rcvd.code
                self.rec.close_reason = exc.rcvd.reason
        finally:
            if self.ws is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.ws.close(), 2.0)
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
        sock = await self._small_buffer_socket() if plan.stop_reading_after_audio_s is not None else None
        self.ws = await websockets.connect(
            self.url,
            sock=sock,
            subprotocols=[P.SUBPROTOCOL],  # type: ignore[list-item]
            compression=None,
            open_timeout=10,
            max_size=2**20,
            max_queue=16,
            ping_interval=None,
        )
        start: dict[str, Any] = {"type": P.ClientType.SESSION_START.value, "sample_rate": plan.sample_rate_hz,
                                 "format": "pcm16", "options": {"seed": plan.seed % (2**31 - 1)}}
        if plan.voice is not None:
            start["voice"] = plan.voice
        await self._send(start)
        reply = orjson.loads(await asyncio.wait_for(self.ws.recv(), 10.0))
        if reply.get("type") != P.ServerType.SESSION_STARTED:
            self.rec.errors.append(str(reply.get("code", reply.get("type"))))
            return
        self.rec.t_started = time.monotonic()
        reader = asyncio.create_task(self._reader())
        reporter = asyncio.create_task(self._reporter())
        try:
            await self._speak_all()
        finally:
            for task in (reporter, reader):
                task.cancel()
            for task in (reporter, reader):
                with contextlib.suppress(BaseException):
                    await task

    async def _speak_all(self) -> None:
        plan = self.plan
        n = 0
        while n < MAX_UTTERANCES_PER_SESSION:
            for up in plan.utterances:
                if plan.loop_until_s is not None and n and time.monotonic() >= self.t0 + plan.loop_until_s:
                    return
                if up.think_s:
                    await asyncio.sleep(up.think_s)
                ok = await self._speak(n, up)
                n += 1
                if not ok or self.rec.close_code is not None or self.rec.t_closed is not None:
                    return
            if plan.loop_until_s is None:
                return

    async def _speak(self, index: int, up: UtterancePlan) -> bool:
        plan = self.plan
        utt = UtteranceRecord(index=index, chars=len(up.text))
        self.rec.utterances.append(utt)
        self.cur, self.cur_plan = utt, up
        self.sent_marks = []
        self.sent_text = ""
        self.finished.clear()
        self.first_audio.clear()
        self.jb.begin_utterance(time.monotonic())
        aux: list[asyncio.Task[None]] = []
        if up.cancel_after_audio_s is not None:
            aux.append(asyncio.create_task(self._cancel_later(utt, up.cancel_after_audio_s)))
        if plan.stop_reading_after_audio_s is not None:
            aux.append(asyncio.create_task(self._stall_later(plan.stop_reading_after_audio_s)))
        try:
            sent = 0
            for tok in tokenize(up.text, plan.token_chars, self.rng):
                if utt.t_cancel is not None or self.finished.is_set():
                    break
                await self._send({"type": P.ClientType.TEXT_DELTA.value, "text": tok})
                now = time.monotonic()
                sent += len(tok)
                self.sent_text += tok
                self.sent_marks.append((sent, now))
                if utt.t_first_text is None:
                    utt.t_first_text = now
                await asyncio.sleep(self.rng.uniform(0.5, 1.5) / plan.tokens_per_s)
            if utt.t_cancel is None and not self.finished.is_set():
                await self._send({"type": P.ClientType.TEXT_END.value})
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

    async def _cancel_later(self, utt: UtteranceRecord, after_s: float) -> None:
        await self.first_audio.wait()
        await asyncio.sleep(after_s)
        if utt.t_done is not None or utt.error is not None:
            return
        now = time.monotonic()
        self.jb.cancel(now)
        utt.t_cancel = now
        await self._send({"type": P.ClientType.CANCEL.value, "played_samples": self.jb.played_samples})

    async def _stall_later(self, after_s: float) -> None:
        await self.first_audio.wait()
        await asyncio.sleep(after_s)
        self.reading = False
        now = time.monotonic()
        self.rec.t_stop_reading = now
        self.jb.cancel(now)  # a stalled client plays nothing more: no underrun accounting


async def _sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


async def watch_stalls(t0: float, out: list[tuple[float, float]], probe_s: float = STALL_PROBE_S,
                       stall_ms: float = CLIENT_STALL_MS, limit: int = MAX_CLIENT_STALLS) -> None:
    """Record (start, end) in seconds after ``t0`` whenever this event loop did not run for more
    than ``stall_ms`` (a probe sleeping ``probe_s`` woke that late). Runs until cancelled."""
    while True:
        t = time.monotonic()
        await asyncio.sleep(probe_s)
        now = time.monotonic()
        if (now - t - probe_s) * 1000.0 > stall_ms and len(out) < limit:
            out.append((round(t + probe_s - t0, 4), round(now - t0, 4)))


async def run_sessions(plans: list[SessionPlan], url: str, t0: float, hard_end: float) -> list[dict[str, Any]]:
    """Run plans concurrently in this event loop; return their records as dicts. Every record
    carries ``client_stalls``: this worker's own stalls (``watch_stalls``), shared by its sessions."""
    stalls: list[tuple[float, float]] = []
    watcher = asyncio.create_task(watch_stalls(t0, stalls), name="client stall watch")
    sessions = [_Session(p, url, t0, hard_end) for p in plans]
    try:
        results = await asyncio.gather(*(s.run() for s in sessions), return_exceptions=True)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    out: list[dict[str, Any]] = []
    for s, r in zip(sessions, results, strict=True):
        if isinstance(r, BaseException):
            s.rec.errors.append(f"client crash: {type(r).__name__}: {r}"[:300])
            rec = s.rec.to_json()
        else:
            rec = r.to_json()
        rec["client_stalls"] = [list(x) for x in stalls]
        out.append(rec)
    return out

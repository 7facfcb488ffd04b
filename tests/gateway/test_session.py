"""The pure session core, fed events by hand (no asyncio, no sockets)."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import numpy as np
import orjson
import pytest

from engine.api import AudioChunk
from gateway import protocol as P
from gateway.audio import mulaw_decode, mulaw_encode
from gateway.config import LimitsConfig
from gateway.segmenter import SegmenterConfig
from gateway.session import (
    AbortStream,
    Action,
    Close,
    EngineFailure,
    SendAudio,
    SendMessage,
    Session,
    SessionObserver,
    SessionSettings,
    StartStream,
)

RATE = 16_000
MS = RATE // 1000  # samples per ms


class Recorder(SessionObserver):
    def __init__(self) -> None:
        self.errors: list[P.ErrorCode] = []
        self.dropped: list[tuple[float, str]] = []
        self.outcomes: list[str] = []
        self.underrun_count = 0

    def error(self, code: P.ErrorCode) -> None:
        self.errors.append(code)

    def audio_dropped(self, seconds: float, reason: str) -> None:
        self.dropped.append((seconds, reason))

    def utterance_finished(self, outcome: str) -> None:
        self.outcomes.append(outcome)

    def underruns(self, count: int) -> None:
        self.underrun_count += count


class Harness:
    def __init__(self, limits: dict[str, Any] | None = None, **settings: Any) -> None:
        lim = dataclasses.replace(LimitsConfig(), **(limits or {}))
        settings.setdefault("segmenter", SegmenterConfig(first_min_units=5, min_units=10))
        self.obs = Recorder()
        self.s = Session("S", SessionSettings(limits=lim, engine_name="t", **settings),
                         0.0, observer=self.obs)
        self.now = 0.0
        self.actions: list[Action] = []

    def feed(self, acts: list[Action]) -> list[Action]:
        self.actions += acts
        return acts

    def msg(self, obj: dict[str, Any] | str, at: float | None = None) -> list[Action]:
        if at is not None:
            self.now = at
        raw = obj if isinstance(obj, str) else orjson.dumps(obj).decode()
        return self.feed(self.s.on_text_frame(self.now, raw))

    def start(self, **fields: Any) -> dict[str, Any]:
        acts = self.msg({"type": "session.start", "sample_rate": RATE, **fields})
        return messages(acts)[0]

    def audio(self, rid: str, ms: int, finished: bool = False, at: float | None = None) -> list[Action]:
        if at is not None:
            self.now = at
        pcm = (np.arange(ms * MS) % 100).astype("<i2").tobytes()
        return self.feed(self.s.on_audio(self.now, rid, AudioChunk(rid, pcm, RATE, finished=finished)))

    def timer(self, at: float) -> list[Action]:
        self.now = at
        return self.feed(self.s.on_timer(at))


def messages(acts: list[Action], mtype: str | None = None) -> list[dict[str, Any]]:
    """The session's messages as the client receives them (through the one encoder)."""
    return [orjson.loads(P.encode_server(a.message)) for a in acts
            if isinstance(a, SendMessage) and (mtype is None or a.message.TYPE == mtype)]


def starts(acts: list[Action]) -> list[StartStream]:
    return [a for a in acts if isinstance(a, StartStream)]


def audio(acts: list[Action]) -> list[SendAudio]:
    return [a for a in acts if isinstance(a, SendAudio)]


def sent_samples(acts: list[Action]) -> int:
    return sum(a.samples for a in audio(acts))


# ---------------------------------------------------------------------------------------------


def test_start_and_stream_one_utterance():
    h = Harness()
    started = h.start(format="pcm16", voice=3)
    assert started["type"] == "session.started" and started["sample_rate"] == RATE and started["voice"] == 3
    acts = h.msg({"type": "text.delta", "text": "Hello world, this is"})
    (st,) = starts(acts)
    assert st.request.text == "Hello world,"
    assert st.request.sample_rate_hz == RATE and st.request.speaker == 3
    rid = st.request.request_id
    assert h.s.may_pull(h.now, rid)
    acts = h.audio(rid, 100, at=0.1)
    seg_started = messages(acts, "segment.started")
    assert seg_started == [{"type": "segment.started", "utterance_id": 1, "segment": 0,
                            "text": "Hello world,", "sample_offset": 0,
                            "start_char": 0, "end_char": 12}]
    frames = audio(acts)
    assert [f.samples for f in frames] == [640, 640, 320]  # 40 ms frames
    assert frames[0].ttfa is not None and frames[0].ttfa.engine_s == pytest.approx(0.1)
    headers = [P.unpack_audio_frame(f.data)[0] for f in frames]
    assert [(x.seq, x.sample_offset, x.segment, x.utterance_id) for x in headers] == \
        [(0, 0, 0, 1), (1, 640, 0, 1), (2, 1280, 0, 1)]
    h.audio(rid, 50, finished=True)
    acts = h.msg({"type": "text.end"})
    (st2,) = starts(acts)
    assert st2.request.text == "a test." or st2.request.text == "this is"
    acts = h.audio(st2.request.request_id, 30, finished=True)
    done = messages(acts, "utterance.done")
    assert done == [{"type": "utterance.done", "utterance_id": 1, "status": "ok", "samples": 180 * MS,
                     "duration_ms": 180.0, "segments": 2}]
    assert h.obs.outcomes == ["ok"]
    assert not h.s.busy


def test_later_segments_are_submitted_once_the_current_one_has_all_its_audio():
    h = Harness(limits={"flow_window_ms": 500}, max_in_flight=2)
    h.start()
    text = "First clause here, then a whole sentence follows. "
    s1, s2 = starts(h.msg({"type": "text.delta", "text": text}))  # the short first one does not count
    assert not starts(h.msg({"type": "text.delta", "text": "And a third sentence that waits. "}))
    assert not starts(h.audio(s1.request.request_id, 300, finished=True))
    acts = h.timer(10.0)  # segment 0 played and retired; segment 1 still generating
    assert not starts(acts)
    acts = h.audio(s2.request.request_id, 900)
    assert not starts(acts)
    acts = h.audio(s2.request.request_id, 100, finished=True)  # all its audio in, most of it unsent
    (s3,) = starts(acts)
    assert s3.request.request_id.endswith("-1-2")
    assert h.s.running_requests == [s3.request.request_id]


def test_segments_are_pipelined_and_audio_stays_in_order():
    h = Harness(max_in_flight=2)
    h.start()
    acts = h.msg({"type": "text.delta", "text": "First clause here, then a whole sentence follows. "})
    s1, s2 = starts(acts)  # two in flight at once
    assert not starts(h.msg({"type": "text.delta", "text": "And a third sentence that waits. "}))
    # audio of segment 2 arrives first: it is held, not sent
    acts = h.audio(s2.request.request_id, 200)
    assert not audio(acts)
    assert h.s.may_pull(h.now, s2.request.request_id)  # its prefetch is not full yet
    h.audio(s2.request.request_id, 900)
    assert not h.s.may_pull(h.now, s2.request.request_id)  # now it is (1 s)
    acts = h.audio(s1.request.request_id, 100, finished=True)
    segs = [P.unpack_audio_frame(a.data)[0].segment for a in audio(acts)]
    assert segs == sorted(segs) and segs[0] == 0 and segs[-1] == 1
    # segment 0 finished: the third waits while segment 1 still generates (one at a time)
    assert not starts(acts)
    assert [m["type"] for m in messages(acts)] == ["segment.started", "segment.done", "segment.started"]
    (s3,) = starts(h.audio(s2.request.request_id, 100, finished=True))
    assert s3.request.request_id.endswith("-1-2")


def test_flow_window_without_reports_paces_in_real_time():
    h = Harness(limits={"flow_window_ms": 200})
    h.start()
    (st,) = starts(h.msg({"type": "text.delta", "text": "Hello world, and"}))
    rid = st.request.request_id
    acts = h.audio(rid, 500)
    assert sent_samples(acts) == 200 * MS  # the window
    assert not h.s.may_pull(h.now, rid)  # held audio + nothing to send: stop pulling
    deadline = h.s.next_deadline_s(h.now)
    assert deadline == pytest.approx(0.04, abs=0.002)  # one 40 ms frame of credit
    acts = h.timer(0.1)
    assert sent_samples(acts) == 80 * MS  # 100 ms played, frames of 40 ms fit
    acts = h.timer(10.0)
    assert sent_samples(acts) == 200 * MS  # a full window again
    assert sent_samples(h.timer(20.0)) == 20 * MS
    assert h.s.may_pull(h.now, rid)


def test_flow_follows_playback_reports():
    h = Harness(limits={"flow_window_ms": 200})
    h.start()
    (st,) = starts(h.msg({"type": "text.delta", "text": "Hello world, and"}))
    h.msg({"type": "playback", "played_samples": 0})
    acts = h.audio(st.request.request_id, 500)
    assert sent_samples(acts) == 200 * MS
    assert not audio(h.timer(0.5))  # the report is fresh: no extrapolation
    acts = h.msg({"type": "playback", "played_samples": 120 * MS, "underruns": 2}, at=0.6)
    assert sent_samples(acts) == 120 * MS
    assert h.obs.underrun_count == 2
    h.msg({"type": "playback", "played_samples": 120 * MS, "underruns": 3})
    assert h.obs.underrun_count == 3


def test_cancel_aborts_drops_and_accounts():
    h = Harness(limits={"flow_window_ms": 10_000})
    h.start()
    text = "Hello there, my friend. This is the second sentence here. "
    s1, s2 = starts(h.msg({"type": "text.delta", "text": text}))
    h.audio(s1.request.request_id, 1000, finished=True)  # "Hello there," takes 1 s
    h.audio(s2.request.request_id, 400)
    acts = h.msg({"type": "cancel", "played_samples": 1200 * MS, "id": 9})
    aborts = [a for a in acts if isinstance(a, AbortStream)]
    assert aborts == [AbortStream(s2.request.request_id, True)]  # segment 0 was done and sent
    (c,) = messages(acts, "cancelled")
    assert c["utterance_id"] == 1 and c["cancelled_utterances"] == [1] and c["id"] == 9
    assert c["generated_ms"] == 1400.0 and c["sent_ms"] == 1400.0 and c["played_ms"] == 1200.0
    # segment 0, then 200 ms into segment 1, still generating: its length is estimated from its text
    assert c["heard_text"] == "Hello there, my"
    assert h.obs.dropped == [(0.2, "cancel")]
    assert not h.s.busy and not h.s.running_requests
    # audio of an aborted stream is ignored; a new utterance starts with id 2
    assert h.audio(s2.request.request_id, 100) == []
    (st,) = starts(h.msg({"type": "text.delta", "text": "New answer, please."}))
    assert st.request.request_id.startswith("S-2-")
    # flow: the client flushed its buffer, so the window is free again
    assert h.s.flow.ahead(h.now) == 0


def test_cancel_of_one_utterance_leaves_the_others():
    h = Harness(limits={"flow_window_ms": 10_000})
    h.start()
    (a,) = starts(h.msg({"type": "text.delta", "text": "First answer, "}))
    h.msg({"type": "text.end"})
    h.audio(a.request.request_id, 300)  # utterance 1 is playing
    h.msg({"type": "text.delta", "text": "Second answer here. "})
    h.msg({"type": "text.end"})
    h.msg({"type": "text.delta", "text": "Third answer here. "})
    h.msg({"type": "text.end"})
    # a queued one goes without touching the one playing
    acts = h.msg({"type": "cancel", "utterance_id": 2})
    started = starts(acts)
    (c,) = messages(acts, "cancelled")
    assert c["utterance_id"] == 2 and c["cancelled_utterances"] == [2] and c["sent_ms"] == 0.0
    assert not [x for x in acts if isinstance(x, AbortStream) and x.request_id == a.request.request_id]
    # the one playing: its engine work stops, the third one starts
    acts = h.msg({"type": "cancel", "utterance_id": 1, "played_samples": 100 * MS})
    (c,) = messages(acts, "cancelled")
    assert c["utterance_id"] == 1 and c["played_ms"] == 100.0 and c["cancelled_utterances"] == [1]
    assert AbortStream(a.request.request_id, True) in acts
    (third,) = started + starts(acts)  # it takes the place freed in the pipeline
    assert third.request.text == "Third answer here." and third.request.request_id.startswith("S-3-")
    assert h.s.flow.ahead(h.now) == 0
    # an unknown or finished one: nothing stops
    (c,) = messages(h.msg({"type": "cancel", "utterance_id": 9}), "cancelled")
    assert c["utterance_id"] is None and c["cancelled_utterances"] == []
    assert h.s.busy


def test_cancel_of_a_done_utterance_still_playing_names_it_stopped():
    """All of an utterance's audio sent (``utterance.done`` out) but still playing: ``cancel`` cuts
    its unplayed audio, so it is listed in ``cancelled_utterances`` (was ``[]``)."""
    h = Harness(limits={"flow_window_ms": 10_000})
    h.start()
    (st,) = starts(h.msg({"type": "text.delta", "text": "Hello there, "}))
    acts = h.msg({"type": "text.end"}) + h.audio(st.request.request_id, 1000, finished=True)
    (done,) = messages(acts, "utterance.done")
    assert done["status"] == "ok" and not h.s.busy
    (c,) = messages(h.msg({"type": "cancel", "played_samples": 517 * MS}), "cancelled")
    assert c["utterance_id"] == 1 and c["played_ms"] == 517.0 and c["cancelled_utterances"] == [1]
    # played out entirely: nothing is cut, nothing is listed
    (c,) = messages(h.msg({"type": "cancel", "played_samples": 1000 * MS}), "cancelled")
    assert c["cancelled_utterances"] == []


def test_cancel_with_nothing_playing():
    h = Harness()
    h.start()
    (c,) = messages(h.msg({"type": "cancel"}), "cancelled")
    assert c["utterance_id"] is None and c["heard_text"] == "" and c["cancelled_utterances"] == []


def test_heard_text_uses_output_latency_and_word_cut():
    h = Harness(limits={"flow_window_ms": 10_000})
    h.start()
    (st,) = starts(h.msg({"type": "text.delta", "text": "alpha beta gamma delta, "}))
    h.audio(st.request.request_id, 1000, finished=True)
    h.msg({"type": "playback", "played_samples": 0, "output_latency_ms": 100})
    (c,) = messages(h.msg({"type": "cancel", "played_samples": 700 * MS}), "cancelled")
    # heard = 600 ms of 1000 ms of "alpha beta gamma delta," (23 chars) -> 13 chars -> whole words
    assert c["heard_text"] == "alpha beta"


def test_engine_error_fails_the_utterance_only():
    h = Harness()
    h.start()
    (st,) = starts(h.msg({"type": "text.delta", "text": "Hello world, more"}))
    acts = h.feed(h.s.on_engine_error(h.now, st.request.request_id, EngineFailure.RECOVERABLE))
    (err,) = messages(acts, "error")
    assert err["code"] == "engine_error" and err["utterance_id"] == 1 and not err["fatal"]
    assert [a.request_id for a in acts if isinstance(a, AbortStream)] == [st.request.request_id]
    assert not starts(h.msg({"type": "text.delta", "text": " text that is absorbed. Yes. "}))
    (done,) = messages(h.msg({"type": "text.end"}), "utterance.done")
    assert done["status"] == "error" and done["error"] == "engine_error"
    assert starts(h.msg({"type": "text.delta", "text": "Next utterance, works."}))


def test_overload_and_unrecoverable(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness()
    h.start()
    (st,) = starts(h.msg({"type": "text.delta", "text": "Hello world, more"}))
    acts = h.feed(h.s.on_engine_error(h.now, st.request.request_id, EngineFailure.OVERLOADED, 120.4))
    err = messages(acts, "error")[0]
    assert err["code"] == "engine_overloaded" and err["retry_after_ms"] == 121
    (done,) = messages(h.msg({"type": "text.end"}), "utterance.done")
    assert done["status"] == "error" and done["segments"] == 0 and done["samples"] == 0  # none started
    # the refusal is logged once, by the server with its reason; the session core adds no second warning
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "engine_overloaded" in r.getMessage()]
    (st,) = starts(h.msg({"type": "text.delta", "text": "Hello world, more"}))
    acts = h.feed(h.s.on_engine_error(h.now, st.request.request_id, EngineFailure.UNRECOVERABLE))
    assert messages(acts, "error")[0]["code"] == "engine_unavailable"
    assert acts[-1] == Close(P.CloseCode.INTERNAL_ERROR, P.CloseReason.ENGINE_UNAVAILABLE)
    assert h.s.closed and h.msg({"type": "ping"}) == []


def test_errors_leave_the_session_usable():
    h = Harness()
    assert messages(h.msg({"type": "text.delta", "text": "x"}))[0]["code"] == "session_not_started"
    assert messages(h.msg({"type": "ping", "id": 1}))[0]["type"] == "pong"
    h.start()
    assert messages(h.msg("{bad"))[0]["code"] == "invalid_json"
    assert messages(h.feed(h.s.on_binary_frame(h.now, b"\x00")))[0]["code"] == "binary_not_allowed"
    assert messages(h.msg({"type": "session.start"}))[0]["code"] == "session_already_started"
    assert starts(h.msg({"type": "text.delta", "text": "Still fine, thanks."}))
    assert h.obs.errors == [P.ErrorCode.SESSION_NOT_STARTED, P.ErrorCode.INVALID_JSON,
                            P.ErrorCode.BINARY_NOT_ALLOWED, P.ErrorCode.SESSION_ALREADY_STARTED]


def test_text_limits_rate_and_flood():
    h = Harness(limits={"max_utterance_chars": 20, "max_chars_per_s": 10, "max_messages_per_s": 5})
    h.start()
    assert messages(h.msg({"type": "text.delta", "text": "x" * 21}))[0]["code"] == "text_too_long"
    h.msg({"type": "text.delta", "text": "y" * 15})  # accepted: credit was left (debt now)
    err = messages(h.msg({"type": "text.delta", "text": "z"}))[0]
    assert err["code"] == "rate_limited" and err["utterance_id"] == 1
    # message flood: bucket of 2 x 5 messages, no time passes
    acts: list[Action] = []
    for _ in range(10):
        acts = h.msg({"type": "ping"})
        if h.s.closed:
            break
    assert acts[-1] == Close(P.CloseCode.POLICY_VIOLATION, P.CloseReason.MESSAGE_FLOOD)


def test_rate_abuse_closes():
    h = Harness(limits={"max_chars_per_s": 1, "max_messages_per_s": 1000}, rate_strikes_to_close=3)
    h.start()
    h.msg({"type": "text.delta", "text": "aaaa"})
    codes = []
    for _ in range(3):
        acts = h.msg({"type": "text.delta", "text": "b"})
        codes += [m["code"] for m in messages(acts, "error")]
    assert codes == ["rate_limited"] * 3
    assert acts[-1] == Close(P.CloseCode.POLICY_VIOLATION, P.CloseReason.RATE_LIMIT)


def test_queue_full_and_draining():
    h = Harness(limits={"max_queued_utterances": 2})
    h.start()
    for _ in range(2):
        h.msg({"type": "text.delta", "text": "An utterance."})
        h.msg({"type": "text.end"})
    assert messages(h.msg({"type": "text.delta", "text": "Third."}))[0]["code"] == "queue_full"
    acts = h.feed(h.s.on_shutdown(h.now))
    assert not any(isinstance(a, Close) for a in acts)
    # a new utterance is refused while draining; the queued ones finish, then 1012
    rids = [a.request.request_id for a in h.actions if isinstance(a, StartStream)]
    assert len(rids) == 2
    for rid in rids:
        acts = h.audio(rid, 10, finished=True)
    assert messages(acts, "utterance.done")
    assert acts[-1] == Close(P.CloseCode.SERVICE_RESTART, P.CloseReason.SHUTDOWN)


def test_shutdown_deadline_and_disconnect_abort_everything():
    h = Harness()
    h.start()
    (st,) = starts(h.msg({"type": "text.delta", "text": "Hello world, more"}))
    h.audio(st.request.request_id, 10)
    acts = h.feed(h.s.on_disconnect(h.now))
    assert acts == [AbortStream(st.request.request_id, True)]
    assert h.s.closed and not h.s.running_requests
    h2 = Harness()
    h2.start()
    (st,) = starts(h2.msg({"type": "text.delta", "text": "Hello world, more"}))
    acts = h2.feed(h2.s.on_shutdown_deadline(h2.now))
    assert acts == [AbortStream(st.request.request_id, True), Close(P.CloseCode.SERVICE_RESTART, P.CloseReason.SHUTDOWN)]


def test_idle_timeout():
    h = Harness(limits={"idle_timeout_s": 5})
    h.start()
    assert h.s.next_deadline_s(0.0) == 5.0
    assert h.timer(4.0) == []
    assert h.timer(5.0) == [Close(P.CloseCode.NORMAL, P.CloseReason.IDLE)]


def test_idle_timeout_asked_by_the_session_is_capped_by_the_limit():
    h = Harness(limits={"idle_timeout_s": 5})
    assert h.start(idle_timeout_s=2)["limits"]["idle_timeout_s"] == 2.0
    assert h.timer(1.9) == []
    assert h.timer(2.0) == [Close(P.CloseCode.NORMAL, P.CloseReason.IDLE)]
    h = Harness(limits={"idle_timeout_s": 5})
    assert h.start(idle_timeout_s=60)["limits"]["idle_timeout_s"] == 5.0
    assert h.s.next_deadline_s(0.0) == 5.0


def test_first_segment_timer():
    h = Harness(segmenter=SegmenterConfig(first_wait_ms=300))
    h.start()
    assert not starts(h.msg({"type": "text.delta", "text": "Thinking about"}, at=1.0))
    assert h.s.next_deadline_s(1.0) == pytest.approx(1.3)
    (st,) = starts(h.timer(1.3))
    assert st.request.text == "Thinking"


def test_a_later_segment_goes_before_its_sentence_ends_when_the_listener_is_about_to_run_dry():
    def run(urgent_left_ms: float, report: bool) -> tuple[list[StartStream], float | None]:
        h = Harness(limits={"flow_window_ms": 2_000},
                    segmenter=SegmenterConfig(first_min_units=5, min_units=10, urgent_left_ms=urgent_left_ms))
        h.start()
        (s1,) = starts(h.msg({"type": "text.delta", "text": "Sure thing, the old laptop usually ta"}, at=0.0))
        assert s1.request.text == "Sure thing,"
        if report:
            h.msg({"type": "playback", "played_samples": 0}, at=0.1)
        # 600 ms of audio, all sent at 0.1 s: the listener runs dry at 0.7 s
        assert not starts(h.audio(s1.request.request_id, 600, finished=True, at=0.1))
        deadline = h.s.next_deadline_s(h.now)
        return starts(h.timer(0.301)), deadline

    later, deadline = run(400.0, report=False)
    assert deadline == pytest.approx(0.301, abs=1e-6)  # 400 ms before it runs dry
    assert [s.request.text for s in later] == ["the old laptop usually"]  # complete words only
    # a reporting client: its playhead moves on between reports in the estimate
    later, deadline = run(400.0, report=True)
    assert deadline == pytest.approx(0.301, abs=1e-6)
    assert [s.request.text for s in later] == ["the old laptop usually"]
    # off: the sentence end is awaited, or idle_wait_ms (400) after the last text, 0.1 s too late
    later, deadline = run(0.0, report=False)
    assert later == [] and deadline == pytest.approx(0.4)


def test_a_segment_request_carries_the_audio_the_listener_holds_ahead_of_it():
    """``SpeechRequest.queued_audio_ms``: the client's buffer (extrapolated) and audio held unsent
    when the segment is submitted, so the decoder can size its chunks by the listener's whole
    lead; 0 for an utterance's first segment with nothing playing, and with the setting off."""
    def run(tell: bool) -> tuple[float, float]:
        h = Harness(limits={"flow_window_ms": 2_000}, tell_engine_queued_audio=tell,
                    segmenter=SegmenterConfig(first_min_units=5, min_units=10, urgent_left_ms=400.0))
        h.start()
        (s1,) = starts(h.msg({"type": "text.delta", "text": "Sure thing, the old laptop usually ta"}, at=0.0))
        h.audio(s1.request.request_id, 600, finished=True, at=0.1)  # sent at once: 600 ms ahead
        (s2,) = starts(h.timer(0.301))  # the listener has ~399 ms left: the next segment goes
        return s1.request.queued_audio_ms, s2.request.queued_audio_ms

    first, later = run(True)
    assert first == 0.0
    assert later == pytest.approx(399.0, abs=2.0)
    assert run(False) == (0.0, 0.0)


def test_send_buffer_congestion_pauses_frames():
    h = Harness(limits={"flow_window_ms": 10_000})
    h.start()
    (st,) = starts(h.msg({"type": "text.delta", "text": "Hello world, more"}))
    h.feed(h.s.on_send_buffer(h.now, True))
    assert not audio(h.audio(st.request.request_id, 200))
    acts = h.feed(h.s.on_send_buffer(h.now, False))
    assert sent_samples(acts) == 200 * MS


def test_slow_reader():
    h = Harness()
    h.start()
    (st,) = starts(h.msg({"type": "text.delta", "text": "Hello world, more"}))
    acts = h.feed(h.s.on_slow_reader(h.now))
    assert acts == [AbortStream(st.request.request_id, True),
                    Close(P.CloseCode.POLICY_VIOLATION, P.CloseReason.SLOW_READER)]


def test_mulaw_frames_and_bad_engine_audio():
    h = Harness()
    h.start(format="mulaw")
    (st,) = starts(h.msg({"type": "text.delta", "text": "Hello world, more"}))
    frames = audio(h.audio(st.request.request_id, 40))
    hdr, payload = P.unpack_audio_frame(frames[0].data)
    assert hdr.format is P.AudioFormat.MULAW and len(payload) == 40 * MS
    # an engine chunk at the wrong rate fails the utterance (never crashes the session)
    bad = AudioChunk(st.request.request_id, b"\x00\x00" * 10, 8000)
    acts = h.feed(h.s.on_audio(h.now, st.request.request_id, bad))
    assert messages(acts, "error")[0]["code"] == "engine_error"


def test_mulaw_matches_g711():
    x = np.array([0, 1, -1, 100, -100, 1000, -1000, 32767, -32768, 8031, -8031], dtype="<i2")
    enc = mulaw_encode(x.tobytes())
    # classic Sun g711 (== CPython's former audioop.lin2ulaw, checked bit-exact over all int16)
    assert enc == bytes([255, 255, 126, 242, 114, 206, 78, 128, 0, 160, 32])
    y = mulaw_decode(enc)
    assert np.all(np.abs(y.astype(int) - x.astype(int)) <= np.maximum(8, np.abs(x.astype(int)) // 16))


def test_idle_timeout_applies_to_an_open_utterance_with_nothing_in_flight():
    h = Harness(limits={"idle_timeout_s": 5})
    h.start()
    (st,) = starts(h.msg({"type": "text.delta", "text": "Hello world, "}, at=1.0))
    h.audio(st.request.request_id, 10, finished=True, at=2.0)  # retired at 2.0
    assert h.s.busy  # the utterance is still open
    assert h.s.next_deadline_s(2.0) == pytest.approx(7.0)
    assert h.timer(6.9) == []
    assert h.timer(7.0)[-1] == Close(P.CloseCode.NORMAL, P.CloseReason.IDLE)



def test_min_audio_ms_per_unit_floors_min_new_tokens() -> None:
    """``session.min_audio_ms_per_unit``: a segment's EOS is masked until units x floor ms of audio."""
    from gateway.segmenter import text_units
    from gateway.session import STEP_MS

    off = Harness()
    off.start()
    off.msg({"type": "text.delta", "text": "Hello there, this is a test."})
    off.msg({"type": "text.end"})
    assert all(a.request.params.min_new_tokens == 0 for a in starts(off.actions))

    h = Harness(min_audio_ms_per_unit=32.0)
    h.start()
    h.msg({"type": "text.delta", "text": "Hello there, this is a test."})
    h.msg({"type": "text.end"})
    reqs = [a.request for a in starts(h.actions)]
    assert reqs
    for r in reqs:
        want = math.ceil(text_units(r.text) * 32.0 / STEP_MS - 1e-9)
        assert r.params.min_new_tokens == want > 0
        assert r.params.min_new_tokens < r.params.max_new_tokens


def test_a_voice_the_engine_refuses_is_an_invalid_field_at_session_start():
    """``SessionSettings.check_voice`` (the engine's ``check_voice``): a voice it refuses answers
    ``invalid_field`` on ``voice`` (the reason stays in the log), the session does not start, and
    a ``session.start`` with a good voice then starts it."""
    h = Harness(check_voice=lambda v: "not a seed or a speaker embedding of this model" if v == "garbage" else None)
    err = h.start(voice="garbage", id=7)
    assert err["type"] == "error" and err["code"] == "invalid_field" and err["field"] == "voice", err
    assert err["id"] == 7 and "embedding" not in orjson.dumps(err).decode()
    assert not h.s.started
    assert h.start(voice=3)["type"] == "session.started"
    assert Harness(check_voice=lambda v: "no").start()["type"] == "session.started"  # no voice: not checked

"""Resuming inside a segment (the pure session core): an opening ``text.delta`` with ``resume``
gives the segment whole, the engine's first ``samples`` are not sent again, a ``codes`` engine
gets the frames back as the request's prefix, and sessions that asked ``resume`` get each
segment's ``segment.codes`` before the audio frames they cover."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest

from engine.api import AudioChunk, ResumeMode, codes_from_bytes, codes_to_bytes
from gateway import protocol as P
from tests.gateway.test_session import MS, RATE, Harness, audio, messages, starts

TEXT = "Then choose the network tab, near the top. Next, turn the switch on."
FIRST = "Then choose the network tab,"


def _codes(n: int, start: int = 0) -> np.ndarray:
    return (np.arange(start * 4, (start + n) * 4).reshape(n, 4) % 600).astype(np.int64)


def _chunk(rid: str, ms: int, codes: np.ndarray | None = None, finished: bool = False) -> AudioChunk:
    pcm = (np.arange(ms * MS) % 100).astype("<i2").tobytes()
    return AudioChunk(rid, pcm, RATE, finished=finished, codes=codes_to_bytes(codes) if codes is not None else b"")


def _resume(chars: int = len(FIRST), samples: int = 0, codes: np.ndarray | None = None,
            seed: int | None = None) -> dict[str, Any]:
    r: dict[str, Any] = {"chars": chars, "samples": samples}
    if seed is not None:
        r["seed"] = seed
    if codes is not None:
        r["codes"] = base64.b64encode(codes_to_bytes(codes)).decode()
    return r


@pytest.mark.parametrize("mode", list(ResumeMode))
def test_session_started_says_how_it_resumes_when_asked(mode: ResumeMode) -> None:
    assert Harness(resume_mode=mode).start(resume=True)["resume"] == mode.value
    assert "resume" not in Harness(resume_mode=mode).start()


def test_codes_engine_continues_from_the_prefix_and_drops_what_the_client_has() -> None:
    h = Harness(resume_mode=ResumeMode.CODES)
    h.start(resume=True)
    prefix = _codes(30)
    st, st2 = starts(h.msg({"type": "text.delta", "text": TEXT,
                            "resume": _resume(samples=250 * MS, codes=prefix, seed=99)}))
    assert st.request.text == FIRST and not st.first  # admission never refuses a resumed (playing) answer
    np.testing.assert_array_equal(st.request.prefix_codes, prefix)
    assert st.request.params.seed == 99, "the rest of the segment is sampled with its own seed"
    assert st2.request.params.seed is not None and st2.request.params.seed != 99
    rid = st.request.request_id
    # the engine's audio starts at the segment's start: its first 250 ms are the client's already
    acts = h.audio(rid, 200)
    assert audio(acts) == [] and messages(acts) == []
    acts = h.s.on_audio(h.now, rid, _chunk(rid, 100, codes=_codes(5, 30)))
    msgs = messages(acts)
    assert [m["type"] for m in msgs] == ["segment.started", "segment.codes"]
    assert msgs[0]["sample_offset"] == 0 and (msgs[0]["start_char"], msgs[0]["end_char"]) == (0, len(FIRST))
    assert msgs[1]["frame"] == 30, "frames are numbered from the segment's start, the prefix included"
    assert msgs[1]["seed"] == 99
    np.testing.assert_array_equal(codes_from_bytes(base64.b64decode(msgs[1]["codes"])), _codes(5, 30))
    assert sum(a.samples for a in audio(acts)) == 50 * MS
    first_frame = P.unpack_audio_frame(audio(acts)[0].data)[0]
    assert (first_frame.sample_offset, first_frame.segment) == (0, 0)
    acts = h.s.on_audio(h.now, rid, _chunk(rid, 40, codes=_codes(2, 35), finished=True))
    assert messages(acts, "segment.codes")[0]["frame"] == 35
    done = messages(acts, "segment.done")[0]
    assert done["samples"] == 90 * MS
    # words are timed over the whole segment: the ones the client had are left out
    assert done["words"] and done["words"][0]["start_ms"] >= 0.0 and done["words"][-1]["end_ms"] == 90.0
    assert [w["word"] for w in done["words"]] != FIRST.split()
    # the rest of the text is segmented as usual, its chars counted in the utterance's text
    rid2 = st2.request.request_id
    assert st2.request.prefix_codes is None
    msgs = messages(h.s.on_audio(h.now, rid2, _chunk(rid2, 40, codes=_codes(3))))
    seg1 = next(m for m in msgs if m["type"] == "segment.started")
    assert TEXT[seg1["start_char"]:seg1["end_char"]] == seg1["text"] and seg1["start_char"] > len(FIRST)
    codes1 = next(m for m in msgs if m["type"] == "segment.codes")
    assert codes1["frame"] == 0 and codes1["seed"] == st2.request.params.seed


def test_samples_engine_regenerates_and_drops_what_the_client_has() -> None:
    h = Harness(resume_mode=ResumeMode.SAMPLES)
    h.start(resume=True)
    (st,) = starts(h.msg({"type": "text.delta", "text": FIRST, "resume": _resume(samples=120 * MS)}))
    assert st.request.prefix_codes is None and st.request.text == FIRST
    acts = h.audio(st.request.request_id, 100) + h.audio(st.request.request_id, 100, finished=True)
    assert sum(a.samples for a in audio(acts)) == 80 * MS
    assert messages(acts, "segment.codes") == []
    acts = h.msg({"type": "text.end"})
    assert messages(acts, "utterance.done")[0]["samples"] == 80 * MS


def test_codes_are_sent_only_to_sessions_that_asked() -> None:
    h = Harness(resume_mode=ResumeMode.CODES)
    h.start()
    st = starts(h.msg({"type": "text.delta", "text": TEXT}))[0]
    acts = h.s.on_audio(h.now, st.request.request_id, _chunk(st.request.request_id, 100, codes=_codes(8)))
    assert messages(acts, "segment.codes") == [] and audio(acts)


@pytest.mark.parametrize(("mode", "delta", "field"), [
    (ResumeMode.SEGMENT, {"text": TEXT, "resume": _resume()}, "resume"),
    (ResumeMode.CODES, {"text": FIRST, "resume": _resume(chars=len(FIRST) + 1)}, "resume.chars"),
    (ResumeMode.CODES, {"text": " ,. ", "resume": _resume(chars=3)}, "resume.chars"),
    (ResumeMode.CODES, {"text": TEXT, "resume": _resume(samples=10)}, "resume.codes"),
    (ResumeMode.CODES, {"text": TEXT, "resume": {"chars": 5}}, "resume.samples"),
    (ResumeMode.CODES, {"text": TEXT, "resume": {"chars": 5, "samples": 1, "codes": "AQAC"}}, "resume.codes"),
    (ResumeMode.CODES, {"text": TEXT, "resume": {"chars": 5, "samples": 1, "codes": "////////////"}}, "resume.codes"),
    (ResumeMode.CODES, {"text": TEXT, "resume": {"chars": 5, "samples": 1, "extra": 1}}, "resume.extra"),
    (ResumeMode.CODES, {"text": TEXT, "resume": "yes"}, "resume"),
])
def test_a_resume_that_cannot_be_honoured_is_refused(mode: ResumeMode, delta: dict[str, Any], field: str) -> None:
    h = Harness(resume_mode=mode)
    h.start(resume=True)
    acts = h.msg({"type": "text.delta", "id": 7, **delta})
    (err,) = messages(acts, "error")
    assert (err["code"], err["field"], err["id"], err["fatal"]) == ("invalid_field", field, 7, False)
    assert starts(acts) == []
    # nothing opened: a plain delta opens utterance 1
    st = starts(h.msg({"type": "text.delta", "text": TEXT}))[0]
    assert st.request.request_id.endswith("-1-0")


def test_resume_on_a_later_delta_is_refused() -> None:
    h = Harness(resume_mode=ResumeMode.CODES)
    h.start(resume=True)
    h.msg({"type": "text.delta", "text": "Hello there"})
    (err,) = messages(h.msg({"type": "text.delta", "text": FIRST, "resume": _resume()}), "error")
    assert err["field"] == "resume"


def test_every_segment_is_sampled_with_a_seed_the_client_can_give_back() -> None:
    h = Harness(resume_mode=ResumeMode.CODES)
    h.start(resume=True)
    seeds = {st.request.params.seed for st in starts(h.msg({"type": "text.delta", "text": TEXT}))}
    assert None not in seeds
    h2 = Harness(resume_mode=ResumeMode.CODES)
    h2.start(resume=True, options={"seed": 5})
    assert {st.request.params.seed for st in starts(h2.msg({"type": "text.delta", "text": TEXT}))} == {5}

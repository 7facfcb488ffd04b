"""The dialects' pure parts: turn bookkeeping, voices (and their documented tables), request
parsing, A-law, the front's request-line sniffing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gateway import protocol as P
from gateway.dialects import deepgram, elevenlabs, http, openai, voices
from gateway.dialects.audio import Encoder, OutputFormat, alaw_decode, alaw_encode, mp3_available
from gateway.dialects.base import Alignment, Turns
from gateway.dialects.front import classify

DOCS = Path(__file__).resolve().parents[2] / "docs" / "dialects"


def _ids(msgs: list[dict]) -> list[str]:
    return [m["id"] for m in msgs if "id" in m]


def _pong(mid: str) -> P.Pong:
    return P.Pong(server_time_ms=0.0, id=mid)


def _done(status: str, error: P.ErrorCode | None = None, uid: int = 1) -> P.UtteranceDone:
    return P.UtteranceDone(utterance_id=uid, status=P.UtteranceStatus(status), samples=0, duration_ms=0.0,
                           segments=0, error=error)


def test_turns_complete_in_order_after_audio_or_pong():
    t = Turns()
    d1 = t.delta("Hello there.")
    assert d1[0]["type"] == "text.delta" and t.has_text
    b1 = t.boundary("one")
    assert [m["type"] for m in b1] == ["text.end", "ping"]
    b2 = t.boundary("empty")  # nothing sent since: opens no utterance
    t.delta("")  # empty text is not sent
    t.delta("More.")
    b3 = t.boundary("three")
    # pongs arrive first (replies come in order, audio takes longer)
    for b in (b1, b2, b3):
        assert t.on_server_message(_pong(b[1]["id"])) == []
    # utterance 1 done -> "one", and "empty" right behind it
    assert t.on_server_message(_done("ok")) == [("one", "ok"), ("empty", "empty")]
    assert t.on_server_message(_done("error", P.ErrorCode.ENGINE_ERROR)) == [("three", "error")]
    assert t.pending == 0


def test_turns_done_before_pong_and_refused_text():
    t = Turns()
    d = t.delta("Hi.")
    b = t.boundary("a")
    # the utterance was already sent when text.end arrived: done precedes the pong
    assert t.on_server_message(_done("ok")) == []
    assert t.on_server_message(_pong(b[1]["id"])) == [("a", "ok")]
    # every delta refused: no utterance, complete at the pong
    d = t.delta("x" * 10)
    assert t.on_server_message(P.ErrorMessage(code=P.ErrorCode.RATE_LIMITED, id=_ids(d)[0])) == []
    b = t.boundary("refused")
    assert t.on_server_message(_pong(b[1]["id"])) == [("refused", "empty")]


def test_turns_cancel_drops_boundaries_until_cancelled():
    t = Turns()
    t.delta("One.")
    b1 = t.boundary("one")
    t.on_server_message(_pong(b1[1]["id"]))
    t.delta("open text")
    t.cancel_all()
    t.delta("After.")  # sent after the cancel: a new turn
    b2 = t.boundary("two")
    assert t.on_server_message(P.Cancelled(utterance_id=None)) == []
    t.on_cancelled()
    assert t.on_server_message(_pong(b2[1]["id"])) == []
    assert t.on_server_message(_done("ok")) == [("two", "ok")]


def test_alignment_covers_the_text_and_the_audio_segment_by_segment():
    al = Alignment()
    for piece in ("  Hello there.  ", "How are", " you?"):
        al.add_text(piece)
    text = al.text
    spans = [(2, 14), (16, 28)]  # the segments the segmenter cut (whitespace-trimmed)
    assert [text[a:b] for a, b in spans] == ["Hello there.", "How are you?"]
    got = []
    for (a, b), samples in zip(spans, (24_000, 12_001), strict=True):
        al.started(P.SegmentStarted(utterance_id=1, segment=0, text=text[a:b], sample_offset=0, start_char=a,
                                      end_char=b))
        chars, starts, durs = al.done(samples, 24_000)
        assert len(chars) == len(starts) == len(durs) and starts[0] == 0
        assert starts[-1] + durs[-1] == round(samples / 24)  # the span is the segment's audio
        assert all(t1 == t0 + d for t0, t1, d in zip(starts, starts[1:], durs, strict=False))
        got += chars
    assert "".join(got) == text.rstrip()  # the gaps ride at the next segment's start, length 0
    assert al.done(100, 24_000) is None  # no segment started


def test_voices():
    assert voices.openai_voice("Alloy") == voices.OPENAI["alloy"]
    assert voices.openai_voice("1234") == 1234 and voices.openai_voice("seed:77") == 77
    assert voices.openai_voice("default") is None
    assert voices.elevenlabs_voice("21m00Tcm4TlvDq8ikWAM") == voices.elevenlabs_voice("rachel")
    assert voices.deepgram_voice("aura-2-thalia-en") == voices.DEEPGRAM["aura-2-thalia-en"]
    for bad in ("nobody", "99999999999", "seed-", ""):
        with pytest.raises(voices.UnknownVoice):
            voices.openai_voice(bad)
    with pytest.raises(voices.UnknownVoice):
        voices.deepgram_voice("aura-2-agustina-es")


@pytest.mark.parametrize("dialect", ["openai", "elevenlabs", "deepgram"])
def test_voice_tables_are_documented(dialect: str):
    assert voices.markdown_table(dialect) in (DOCS / f"{dialect}.md").read_text()


def test_openai_body():
    b = openai.parse_body(b'{"model":"tts-1","input":"Hi","voice":"ash","response_format":"wav","speed":1}',
                          max_input_chars=10)
    assert (b.speaker, b.response_format, b.stream_format) == (voices.OPENAI["ash"], "wav", "audio")
    default = b'{"model":"tts-1","input":"Hi","voice":"ash"}'  # OpenAI's default format: mp3
    if mp3_available():
        assert openai.parse_body(default, max_input_chars=10).response_format == "mp3"
    else:
        with pytest.raises(openai.ApiError) as exc:
            openai.parse_body(default, max_input_chars=10)
        assert exc.value.param == "response_format"
    with pytest.raises(openai.ApiError) as exc:
        openai.parse_body(b'{"input":"Hi","voice":"ash"}', max_input_chars=10)
    assert exc.value.code == "missing_required_parameter" and exc.value.param == "model"


def test_openai_responder_errors_before_and_after_audio():
    body = openai.parse_body(b'{"model":"m","input":"Hi.","voice":"ash","response_format":"pcm"}',
                             max_input_chars=100)
    r = openai.SpeechResponder(body)
    out = r.on_server_message(P.ErrorMessage(code=P.ErrorCode.ENGINE_OVERLOADED, utterance_id=1))
    assert out == []  # utterance.done carries the failure
    out = r.on_server_message(_done("error", P.ErrorCode.ENGINE_OVERLOADED))
    assert isinstance(out[0], http.Head) and out[0].status == 503
    r = openai.SpeechResponder(body)
    hdr = P.AudioFrameHeader(1, 0, 0, 0)
    assert isinstance(r.on_server_audio(hdr, b"\x00\x00" * 10)[0], http.Head)
    assert r.on_server_close(1011, "internal error") == [http.Abort()]


def test_handshake_parsing():
    o = deepgram.parse_query("model=aura-zeus-en&encoding=mulaw&sample_rate=16000")
    assert o.fmt == OutputFormat("mulaw", 16_000) and o.language == "en"
    assert deepgram.parse_query("").fmt == OutputFormat("pcm16", 24_000)
    with pytest.raises(deepgram.QueryError):
        deepgram.parse_query("encoding=linear16&sample_rate=22050")
    e = elevenlabs.parse_request("/v1/text-to-speech/2222/stream-input", "output_format=pcm_44100&seed=4294967295")
    assert e.speaker == 2222 and e.fmt.session_rate_hz == 24_000 and e.seed == (2**32 - 1) % 2**31
    with pytest.raises(elevenlabs.HandshakeError):
        elevenlabs.parse_request("/v1/text-to-speech/2222/stream-input", "output_format=opus_16000_32")


def test_alaw_g711():
    assert alaw_encode(np.array([0, -1, 32767, -32768], dtype="<i2").tobytes()) == bytes([0xD5, 0x55, 0xAA, 0x2A])
    codes = bytes(range(256))
    assert alaw_encode(alaw_decode(codes).astype("<i2").tobytes()) == codes
    x = np.arange(-32768, 32768, 7, dtype=np.int32)
    err = np.abs(alaw_decode(alaw_encode(x.astype("<i2").tobytes())).astype(np.int32) - x)
    assert err.max() <= 512


def test_encoder_resamples_with_exact_length():
    enc = Encoder(OutputFormat("pcm16", 44_100))
    out = b"".join(enc.encode(np.full(960, 1000, dtype="<i2").tobytes()) for _ in range(25)) + enc.flush()
    assert len(out) // 2 == 44_100  # one second in, one second out
    assert enc.flush() == b""


def test_classify_request_line():
    assert classify(b"GET /ws HTTP/1.1\r\n") == "ws"
    assert classify(b"POST /v1/audio/speech HTTP/1.1") == "http"
    assert classify(b"PO") is None and classify(b"G") is None
    assert classify(b"\x16\x03\x01\x02\x00") == "ws"  # not HTTP: websockets rejects it as before
    assert classify(b"OPTIONS * HTTP/1.1") == "http"


def test_mp3_refused_without_lameenc(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(openai, "mp3_available", lambda: False)
    monkeypatch.setattr(elevenlabs, "mp3_available", lambda: False)
    with pytest.raises(openai.ApiError) as exc:
        openai.parse_body(b'{"model":"tts-1","input":"Hi","voice":"ash","response_format":"mp3"}',
                          max_input_chars=10)
    assert exc.value.code == "unsupported_value" and "mp3" not in exc.value.message.split("use one of")[1]
    with pytest.raises(elevenlabs.HandshakeError) as exc2:
        elevenlabs.parse_request("/v1/text-to-speech/2222/stream-input", "")
    assert exc2.value.status == "invalid_output_format"

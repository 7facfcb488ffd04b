from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway import protocol as P

DOC = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()


def test_audio_header_roundtrip():
    h = P.AudioFrameHeader(utterance_id=7, seq=123456, sample_offset=2**32 - 1, segment=65535,
                           format=P.AudioFormat.MULAW)
    data = P.pack_audio_frame(h, b"\x01\x02\x03")
    assert len(data) == P.AUDIO_HEADER_BYTES + 3 == 19
    h2, payload = P.unpack_audio_frame(data)
    assert h2 == h and payload == b"\x01\x02\x03"
    assert data[:2] == bytes([1, 1])
    assert data[4:8] == (7).to_bytes(4, "little")


@pytest.mark.parametrize("bad", [b"", b"\x01" * 15, b"\x02" + b"\x00" * 15, b"\x01\x09" + b"\x00" * 14])
def test_audio_header_rejects_malformed(bad: bytes):
    with pytest.raises(ValueError):
        P.unpack_audio_frame(bad)


def test_parse_valid_messages():
    m = P.parse_client_message('{"type":"session.start","sample_rate":16000,"format":"mulaw",'
                               '"voice":"abc","options":{"top_k":5},"id":"x"}')
    assert m.type is P.ClientType.SESSION_START and m.id == "x"
    assert m.fields["options"] == {"top_k": 5}
    assert P.parse_client_message(b'{"type":"text.delta","text":""}').fields["text"] == ""
    assert P.parse_client_message('{"type":"playback","played_samples":0,"buffered_ms":1.5}').type \
        is P.ClientType.PLAYBACK
    assert P.parse_client_message('{"type":"cancel"}').fields == {}


@pytest.mark.parametrize(
    ("raw", "code", "field"),
    [
        ("nope", P.ErrorCode.INVALID_JSON, None),
        (b"\xff\xfe", P.ErrorCode.INVALID_JSON, None),
        ("null", P.ErrorCode.INVALID_MESSAGE, None),
        ('{"type":null}', P.ErrorCode.INVALID_MESSAGE, None),
        ('{"type":"hello"}', P.ErrorCode.UNKNOWN_TYPE, None),
        ('{"type":"text.delta","text":["a"]}', P.ErrorCode.INVALID_FIELD, "text"),
        ('{"type":"text.end","now":true}', P.ErrorCode.INVALID_FIELD, "now"),
        ('{"type":"session.start","format":"opus"}', P.ErrorCode.INVALID_FIELD, "format"),
        ('{"type":"session.start","voice":true}', P.ErrorCode.INVALID_FIELD, "voice"),
        ('{"type":"session.start","voice":-3}', P.ErrorCode.INVALID_FIELD, "voice"),
        ('{"type":"session.start","options":[]}', P.ErrorCode.INVALID_FIELD, "options"),
        ('{"type":"session.start","options":{"temperature":5}}', P.ErrorCode.INVALID_FIELD, "options.temperature"),
        ('{"type":"session.start","options":{"speed":1}}', P.ErrorCode.INVALID_FIELD, "options.speed"),
        ('{"type":"playback","played_samples":1.5}', P.ErrorCode.INVALID_FIELD, "played_samples"),
        ('{"type":"playback","buffered_ms":1}', P.ErrorCode.INVALID_FIELD, "played_samples"),
        ('{"type":"ping","t":"now"}', P.ErrorCode.INVALID_FIELD, "t"),
        ('{"type":"ping","id":{"a":1}}', P.ErrorCode.INVALID_FIELD, "id"),
        ('{"type":"ping","id":"' + "x" * 65 + '"}', P.ErrorCode.INVALID_FIELD, "id"),
    ],
)
def test_parse_errors(raw: str | bytes, code: P.ErrorCode, field: str | None):
    with pytest.raises(P.ProtocolError) as ei:
        P.parse_client_message(raw)
    assert ei.value.code is code and ei.value.field == field


def test_error_id_is_echoed_when_valid():
    with pytest.raises(P.ProtocolError) as ei:
        P.parse_client_message('{"type":"text.delta","text":1,"id":"abc"}')
    assert ei.value.msg_id == "abc"
    msg = P.ErrorMessage(code=ei.value.code, field=ei.value.field, id=ei.value.msg_id)
    assert orjson.loads(P.encode_server(msg)) == {
        "type": "error", "code": "invalid_field", "message": P.ERROR_MESSAGES[P.ErrorCode.INVALID_FIELD],
        "fatal": False, "field": "text", "id": "abc"}


def test_error_field_echo_is_bounded():
    """A client-chosen key comes back cut to a bounded length (a 65,000-character key used to come
    back whole, in a 65 KB error)."""
    long_key = "k" * 65_000
    msg = P.ErrorMessage(code=P.ErrorCode.INVALID_FIELD, field=f"options.{long_key}")
    assert msg.field is not None and len(msg.field) == P.MAX_FIELD_ECHO_CHARS and msg.field.startswith("options.k")
    assert len(P.encode_server(msg)) < 512
    assert P.ErrorMessage(code=P.ErrorCode.INVALID_FIELD, field="text").field == "text"


def test_every_error_code_has_fixed_text_and_fatality():
    assert set(P.ERRORS) == set(P.ErrorCode) == set(P.ERROR_MESSAGES)
    assert all(400 <= e.http_status < 600 for e in P.ERRORS.values())
    assert P.FATAL_ERRORS <= set(P.ErrorCode)
    for code, spec in P.ERRORS.items():
        msg = P.ErrorMessage(code=code)
        assert (msg.message, msg.fatal) == (spec.message, spec.fatal)
    assert P.ErrorMessage(code=P.ErrorCode.ENGINE_UNAVAILABLE).fatal is True


def test_docs_cover_every_wire_constant():
    for values in (P.ClientType, P.ServerType, P.ErrorCode, P.AudioFormat, P.UtteranceStatus):
        for v in values:
            assert f"`{v.value}`" in DOC, v
    for code in P.CloseCode:
        assert f"| {int(code)} |" in DOC, code
    for reason in P.CloseReason:
        assert f"`{reason.value}`" in DOC, reason
    for spec in P.SCHEMAS.values():
        for f in spec:
            assert f"`{f.name}`" in DOC, f.name
    for f in P.OPTION_FIELDS:
        assert f"`{f.name}`" in DOC, f.name
    assert "`<BBHIII`" in DOC and P.AUDIO_HEADER.format == "<BBHIII"
    assert P.SUBPROTOCOL in DOC and P.TOKEN_SUBPROTOCOL_PREFIX in DOC and P.WS_PATH in DOC


def test_wire_constants_are_json():
    c = orjson.loads(orjson.dumps(P.wire_constants()))
    assert c["audio_header"]["bytes"] == 16
    assert c["error_codes"]["RATE_LIMITED"] == "rate_limited"
    assert c["close_codes"]["TRY_AGAIN_LATER"] == 1013


# ---- server messages: one dataclass per type, one encoder --------------------------------------

_LIMITS = P.SessionLimits(max_message_bytes=65536, max_utterance_chars=20000, max_chars_per_s=2000.0,
                          max_messages_per_s=200.0, max_queued_utterances=16, idle_timeout_s=300.0,
                          flow_window_ms=2000.0)

#: (message, its exact wire bytes): every type, with its optional fields left out and filled in.
WIRE: list[tuple[P.ServerMessage, bytes]] = [
    (P.SessionStarted(session_id="s1", engine="t", sample_rate=16000, format=P.AudioFormat.MULAW, limits=_LIMITS,
                      playback_report_interval_ms=250.0),
     b'{"type":"session.started","session_id":"s1","protocol":"voicegw.v1","engine":"t","sample_rate":16000,'
     b'"format":"mulaw","channels":1,"frame_header_bytes":16,"limits":{"max_message_bytes":65536,'
     b'"max_utterance_chars":20000,"max_chars_per_s":2000.0,"max_messages_per_s":200.0,"max_queued_utterances":16,'
     b'"idle_timeout_s":300.0,"flow_window_ms":2000.0},"playback_report_interval_ms":250.0}'),
    (P.SessionStarted(session_id="s1", engine="t", sample_rate=24000, format=P.AudioFormat.PCM16, limits=_LIMITS,
                      playback_report_interval_ms=250.0, voice="abc", language="en", id=7),
     b'{"type":"session.started","session_id":"s1","protocol":"voicegw.v1","engine":"t","sample_rate":24000,'
     b'"format":"pcm16","channels":1,"frame_header_bytes":16,"limits":{"max_message_bytes":65536,'
     b'"max_utterance_chars":20000,"max_chars_per_s":2000.0,"max_messages_per_s":200.0,"max_queued_utterances":16,'
     b'"idle_timeout_s":300.0,"flow_window_ms":2000.0},"playback_report_interval_ms":250.0,"voice":"abc",'
     b'"language":"en","id":7}'),
    (P.SegmentStarted(utterance_id=1, segment=0, text="Hi.", sample_offset=0, start_char=0, end_char=3),
     b'{"type":"segment.started","utterance_id":1,"segment":0,"text":"Hi.","sample_offset":0,"start_char":0,'
     b'"end_char":3}'),
    (P.SegmentDone(utterance_id=1, segment=0, samples=960, words=(P.Word(word="Hi.", start_ms=0.0, end_ms=40.0),)),
     b'{"type":"segment.done","utterance_id":1,"segment":0,"samples":960,'
     b'"words":[{"word":"Hi.","start_ms":0.0,"end_ms":40.0}],"word_timing":"estimate"}'),
    (P.SegmentDone(utterance_id=1, segment=1, samples=0, words=()),
     b'{"type":"segment.done","utterance_id":1,"segment":1,"samples":0,"words":[],"word_timing":"estimate"}'),
    (P.UtteranceDone(utterance_id=1, status=P.UtteranceStatus.OK, samples=960, duration_ms=40.0, segments=1),
     b'{"type":"utterance.done","utterance_id":1,"status":"ok","samples":960,"duration_ms":40.0,"segments":1}'),
    (P.UtteranceDone(utterance_id=2, status=P.UtteranceStatus.ERROR, samples=0, duration_ms=0.0, segments=0,
                     error=P.ErrorCode.ENGINE_OVERLOADED),
     b'{"type":"utterance.done","utterance_id":2,"status":"error","samples":0,"duration_ms":0.0,"segments":0,'
     b'"error":"engine_overloaded"}'),
    (P.Cancelled(utterance_id=None),
     b'{"type":"cancelled","utterance_id":null,"generated_ms":0.0,"sent_ms":0.0,"played_ms":0.0,"heard_text":"",'
     b'"cancelled_utterances":[]}'),
    (P.Cancelled(utterance_id=3, generated_ms=1.5, sent_ms=1.0, played_ms=0.5, heard_text="a b",
                 cancelled_utterances=(3, 4), id="c"),
     b'{"type":"cancelled","utterance_id":3,"generated_ms":1.5,"sent_ms":1.0,"played_ms":0.5,"heard_text":"a b",'
     b'"cancelled_utterances":[3,4],"id":"c"}'),
    (P.ErrorMessage(code=P.ErrorCode.UNKNOWN_TYPE),
     b'{"type":"error","code":"unknown_type","message":"unknown message type","fatal":false}'),
    (P.ErrorMessage(code=P.ErrorCode.ENGINE_OVERLOADED, id="x", utterance_id=4, retry_after_ms=-5),
     b'{"type":"error","code":"engine_overloaded","message":"speech engine at capacity; the utterance was stopped",'
     b'"fatal":false,"id":"x","utterance_id":4,"retry_after_ms":0}'),
    (P.ErrorMessage(code=P.ErrorCode.INTERNAL_ERROR),
     b'{"type":"error","code":"internal_error","message":"internal error; the session is closed","fatal":true}'),
    (P.SegmentCodes(utterance_id=1, segment=2, frame=30, codes="AQACAAMABAA=", seed=7),
     b'{"type":"segment.codes","utterance_id":1,"segment":2,"frame":30,"codes":"AQACAAMABAA=","seed":7}'),
    (P.Pong(server_time_ms=12.5), b'{"type":"pong","server_time_ms":12.5}'),
    (P.Pong(server_time_ms=12.5, id=1, t=3), b'{"type":"pong","server_time_ms":12.5,"id":1,"t":3}'),
]


def test_every_server_type_has_one_frozen_message_class():
    assert set(P.SERVER_MESSAGES) == set(P.ServerType)
    for mtype, cls in P.SERVER_MESSAGES.items():
        assert cls.TYPE is mtype and dataclasses.is_dataclass(cls)
        assert cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert {type(m) for m, _ in WIRE} == set(P.SERVER_MESSAGES.values())  # WIRE covers every type


@pytest.mark.parametrize(("msg", "wire"), WIRE, ids=lambda v: v.TYPE.value if hasattr(v, "TYPE") else "")
def test_server_message_wire_bytes(msg: P.ServerMessage, wire: bytes):
    assert P.encode_server(msg) == wire
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(msg, dataclasses.fields(msg)[0].name, None)


def test_error_text_comes_only_from_the_table():
    """``message`` and ``fatal`` are not arguments: exception text has no way in."""
    with pytest.raises(TypeError):
        P.ErrorMessage(code=P.ErrorCode.INTERNAL_ERROR, message="Traceback ...")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        P.ErrorMessage(code=P.ErrorCode.INTERNAL_ERROR, fatal=False)  # type: ignore[call-arg]


def _server_rows() -> dict[str, str]:
    section = DOC.split("### Server → client", 1)[1].split("\n### ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| `([a-z.]+)` \|(.*)", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def test_docs_list_every_server_message_field():
    rows = _server_rows()
    assert set(rows) == {t.value for t in P.ServerType}
    for mtype, cls in P.SERVER_MESSAGES.items():
        fields_doc = rows[mtype.value].split(" | ")[0]
        for f in dataclasses.fields(cls):
            assert f"`{f.name}`" in fields_doc, (mtype, f.name)
    started = rows[P.ServerType.SESSION_STARTED.value]
    for f in dataclasses.fields(P.SessionLimits):
        assert f"`{f.name}`" in started, f.name
    done = rows[P.ServerType.SEGMENT_DONE.value]
    assert all(f.name in done for f in dataclasses.fields(P.Word))
    # the omission rule names every field the encoder leaves out when None
    rule = DOC.split("Server messages are JSON objects", 1)[1].split("\n\n", 1)[0]
    for mtype, cls in P.SERVER_MESSAGES.items():
        for f in dataclasses.fields(cls):
            if f.metadata.get("voicegw_omit_none"):
                assert f"`{f.name}`" in rule and f"`{mtype.value}`" in rule, (mtype, f.name)


def _from_wire(obj: dict[str, Any]) -> P.ServerMessage:
    """A decoded server message back into its dataclass (tests only: the server never decodes)."""
    obj = dict(obj)
    cls = P.SERVER_MESSAGES[P.ServerType(obj.pop("type"))]
    if cls is P.ErrorMessage:
        assert obj.pop("message") == P.ERRORS[P.ErrorCode(obj["code"])].message
        assert obj.pop("fatal") == P.ERRORS[P.ErrorCode(obj["code"])].fatal
    conv: dict[str, Any] = {"limits": lambda v: P.SessionLimits(**v), "format": P.AudioFormat,
                            "words": lambda v: tuple(P.Word(**w) for w in v), "status": P.UtteranceStatus,
                            "code": P.ErrorCode, "error": P.ErrorCode, "cancelled_utterances": tuple}
    return cls(**{k: conv[k](v) if k in conv else v for k, v in obj.items()})  # type: ignore[arg-type]


def test_the_documented_example_is_what_the_encoder_writes():
    """Every complete server message of docs/protocol.md's example exchange, byte for byte."""
    example = DOC.split("## Example exchange", 1)[1]
    found = set()
    for block in re.findall(r"^S: (\{.*?\})$(?=\n[A-Z]: |\n```)", example, flags=re.M | re.S):
        if "..." in block:
            continue
        raw = "".join(line.strip() for line in block.splitlines()).encode()
        msg = _from_wire(orjson.loads(raw))
        assert P.encode_server(msg) == raw
        found.add(msg.TYPE)
    assert found >= {P.ServerType.SESSION_STARTED, P.ServerType.SEGMENT_STARTED, P.ServerType.SEGMENT_DONE,
                     P.ServerType.CANCELLED, P.ServerType.UTTERANCE_DONE, P.ServerType.ERROR}

"""Hostile values that pass the protocol schema and hurt further in: a decompression bomb in
``voice`` and log amplification through ``voice``.

``voice`` may be an upstream-encoded speaker embedding (lzma + base16384). Before issue 8 it could
be up to 65,536 characters and the engine decompressed it without a size limit
(``engine.checkpoint.decode_speaker``), synchronously, on the event loop: a 21,000-character string
(a 63 kB message, under ``max_message_bytes``) expanded to 240 MiB, ~1.5 s of blocked event loop
and ~530 MB allocated per decode (measured). Fixed twice over: the schema caps ``voice`` at
``MAX_VOICE_CHARS`` (4096; a real 768-value embedding is ~840 characters: ``invalid_field``), and
``decode_speaker(s, max_values=hidden)`` never produces more than ``2 * hidden + 1`` bytes, so
the largest bomb the schema lets through (~40 MiB of zeros) is refused in microseconds.
"""

from __future__ import annotations

import json
import logging
import lzma
import time
import tracemalloc

import pytest

from gateway import protocol as P
from gateway.app import JsonFormatter
from loadtest.fakes import FakeSpeechEngine
from tests.gateway.conftest import GatewayFactory
from tests.transcript import fast_client
from voicegw.config import LimitsConfig

HIDDEN = 768  # ChatTTS GPT hidden size (speaker embedding length)


def _bomb(mib: int = 200) -> str:
    """``mib`` MiB of zeros as an upstream-style speaker string (raw LZMA2, base16384), built
    without holding the plaintext."""
    import pybase16384 as b14

    comp = lzma.LZMACompressor(format=lzma.FORMAT_RAW, filters=[{"id": lzma.FILTER_LZMA2, "preset": 6}])
    chunk = b"\0" * (1 << 20)
    raw = b"".join(comp.compress(chunk) for _ in range(mib)) + comp.flush()
    return str(b14.encode_to_string(raw))


@pytest.fixture(scope="module")
def bomb() -> str:
    return _bomb()


def largest_bomb() -> str:
    """The biggest bomb the protocol lets through (40 MiB of zeros, ~3,500 characters)."""
    s = _bomb(40)
    assert len(s) <= P.MAX_VOICE_CHARS
    return s


def test_bomb_is_refused_by_the_protocol(bomb: str) -> None:
    """A 200 MiB bomb (21,000 characters) no longer fits ``voice``: ``invalid_field``."""
    with pytest.raises(P.ProtocolError) as err:
        P.parse_client_message(json.dumps({"type": "session.start", "voice": bomb}))
    assert err.value.code is P.ErrorCode.INVALID_FIELD and err.value.field == "voice"


def test_largest_bomb_fits_the_protocol() -> None:
    """What the schema still lets through; the engine's bounded decode must refuse it."""
    s = largest_bomb()
    assert len(json.dumps({"type": "session.start", "voice": s}, ensure_ascii=False).encode()) \
        <= LimitsConfig().max_message_bytes
    msg = P.parse_client_message(json.dumps({"type": "session.start", "voice": s}))
    assert msg.fields["voice"] == s


@pytest.mark.parametrize("which", ["200MiB", "largest-allowed"])
def test_speaker_bomb_is_refused_fast_and_small(which: str, bomb: str) -> None:
    from engine._compat import ensure_torch_companions

    ensure_torch_companions()  # before anything imports transformers, vocos or chattts
    from engine.speaker import SpeakerError, resolve_speaker

    value = bomb if which == "200MiB" else largest_bomb()
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(SpeakerError):
            resolve_speaker(value, HIDDEN)
        took = time.monotonic() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert took < 0.05 and peak < 8 << 20, (took, peak)


def test_speaker_string_with_too_many_values_is_refused() -> None:
    """A well-formed embedding of another size (more values than the model's hidden size)."""
    import numpy as np

    from engine._compat import ensure_torch_companions


    ensure_torch_companions()  # before anything imports transformers, vocos or chattts
    from engine.checkpoint import encode_speaker
    from engine.speaker import SpeakerError, resolve_speaker

    rng = np.random.default_rng(1)
    with pytest.raises(SpeakerError):
        resolve_speaker(encode_speaker(rng.standard_normal(HIDDEN + 1).astype(np.float16)), HIDDEN)
    with pytest.raises(SpeakerError):
        resolve_speaker(encode_speaker(rng.standard_normal(HIDDEN - 1).astype(np.float16)), HIDDEN)
    assert resolve_speaker(encode_speaker(rng.standard_normal(HIDDEN).astype(np.float16)), HIDDEN) is not None


def test_real_speaker_strings_are_short() -> None:
    """What a real embedding costs: the cap proposed for ``voice`` leaves room to spare."""
    import numpy as np

    from engine._compat import ensure_torch_companions


    ensure_torch_companions()  # before anything imports transformers, vocos or chattts
    from engine.checkpoint import decode_speaker, encode_speaker

    rng = np.random.default_rng(0)
    s = encode_speaker(rng.standard_normal(HIDDEN).astype(np.float16))
    assert len(s) < 1_500 < P.MAX_VOICE_CHARS
    assert decode_speaker(s).shape == (HIDDEN,)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(JsonFormatter())
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


async def test_session_log_lines_are_bounded(make_gateway: GatewayFactory) -> None:
    """A client controls a few fields that get logged; a log line must stay small whatever it sends."""
    lines = _Lines()
    logger = logging.getLogger("voicegw")
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(lines)
    try:
        async with make_gateway(FakeSpeechEngine()) as server:
            async with fast_client(server.ws_url, voice="v" * P.MAX_VOICE_CHARS, language="x" * 16) as c:
                await c.speak("Hello.").wait_played()
    finally:
        logger.removeHandler(lines)
        logger.setLevel(old_level)
    longest = max(len(line) for line in lines.lines)
    assert longest < 2_048, longest

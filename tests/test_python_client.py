"""clients.python over a real socket against the real gateway (gateway.server.GatewayServer).

The engine is EspeakSpeech (real speech, offline) unless ``VOICEGW_CLIENT_TEST_ENGINE=fake``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import os
import sys
import threading
import time
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from clients.python import Client, ClientRecorder, Playout, VoicegwError, chat, read_wav, say, ws_url
from gateway.server import GatewayServer
from voicegw.config import Config, GatewayConfig, LimitsConfig

TEXT = "Hello from the Python client. This sentence streams while it is still being sent."
LONG = " ".join(["This is a long utterance that we are going to interrupt halfway."] * 6)


async def _make_engine() -> Any:
    if os.environ.get("VOICEGW_CLIENT_TEST_ENGINE", "espeak") == "fake":
        from loadtest.fakes import FakeSpeechEngine

        return FakeSpeechEngine()
    from engine.espeak import EspeakSpeech

    return EspeakSpeech()


@pytest.fixture(scope="module")
async def engine() -> AsyncIterator[Any]:
    eng = await _make_engine()
    await eng.start()
    yield eng
    await eng.close()


async def _start(engine: Any, **gateway_fields: Any) -> GatewayServer:
    limits = gateway_fields.pop("limits", LimitsConfig())
    cfg = Config(gateway=dataclasses.replace(GatewayConfig(host="127.0.0.1", port=0), **gateway_fields),
                 limits=limits)
    server = GatewayServer(cfg, engine)
    await server.start()
    return server


@pytest.fixture(scope="module")
async def gateway(engine: Any) -> AsyncIterator[GatewayServer]:
    server = await _start(engine)
    yield server
    await server.shutdown(grace_s=1.0)


async def _until(pred: Any, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not pred():  # noqa: ASYNC110 - polling a counter another task advances
            await asyncio.sleep(0.01)


async def _engine_idle(engine: Any) -> bool:
    for _ in range(200):
        if engine.health().running_requests == 0:
            return True
        await asyncio.sleep(0.01)
    return False


# ------------------------------------------------------------------ pure parts


def test_ws_url() -> None:
    assert ws_url("http://127.0.0.1:8765") == "ws://127.0.0.1:8765/ws"
    assert ws_url("https://h.example/") == "wss://h.example/ws"
    assert ws_url("127.0.0.1:9000") == "ws://127.0.0.1:9000/ws"
    assert ws_url("ws://h:1/ws?token=x") == "ws://h:1/ws?token=x"


def test_playout_rules() -> None:
    p = Playout(24_000, prebuffer_ms=80)
    p.push(960)  # 40 ms: below the prebuffer target
    assert p.pull(480) == (0, False) and p.state == "prebuffering"
    p.push(1920)  # 120 ms buffered: starts
    assert p.pull(2400) == (2400, False)
    k, drained = p.pull(960)  # runs dry mid-utterance: an underrun, target +20 ms
    assert (k, drained) == (480, False) and p.underruns == 1 and p.target_ms == 100
    p.push(1200)  # 50 ms < 100 ms target
    assert p.pull(480) == (0, False)
    p.end()  # ...but the utterance is complete: play it out
    assert p.pull(1200) == (1200, False)
    assert p.pull(128) == (0, True) and p.state == "idle" and p.drains == 1
    assert p.played == p.written == 960 + 1920 + 1200
    p.push(4800)
    p.pull(2400)
    assert p.cancel() == p.played and p.buffered == 0 and p.state == "idle"
    assert p.pull(480) == (0, False)


# ------------------------------------------------------------------ over a socket


async def test_say_writes_wav(gateway: GatewayServer, tmp_path: Path) -> None:
    out = tmp_path / "out.wav"
    t0 = time.perf_counter()
    stats = await say(gateway.url, TEXT, out)
    wall = time.perf_counter() - t0
    assert stats.status == "ok", stats
    pcm, rate = read_wav(out)
    assert rate == 24_000
    assert len(pcm) // 2 == stats.samples == stats.server_samples
    assert 1.0 < stats.duration_ms / 1000 < 12.0, stats
    assert stats.ttfa_ms is not None and stats.ttfa_ms < 2000
    assert wall < stats.duration_ms / 1000, "instant (recorder) mode must not wait for real time"
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float64)
    assert np.sqrt(np.mean(samples**2)) > 300, "silent audio"
    assert "ok:" in str(stats)


@pytest.mark.parametrize("rate", [8_000, 16_000, 48_000])
async def test_say_sample_rates(gateway: GatewayServer, tmp_path: Path, rate: int) -> None:
    ref = await say(gateway.ws_url, "One two three four.", None)
    stats = await say(gateway.ws_url, "One two three four.", tmp_path / "r.wav", sample_rate_hz=rate)
    pcm, got_rate = read_wav(tmp_path / "r.wav")
    assert got_rate == rate and len(pcm) // 2 == stats.samples
    assert abs(stats.duration_ms - ref.duration_ms) < 60


async def test_token_stream_realtime_playback(gateway: GatewayServer, engine: Any) -> None:
    async def tokens() -> AsyncIterator[str]:
        for w in TEXT.split(" "):
            await asyncio.sleep(0.02)
            yield w + " "

    async with Client(gateway.url, playback="realtime") as c:
        utt = c.speak(tokens())
        chunks = [ch async for ch in utt]
        assert [ch.seq for ch in chunks] == list(range(len(chunks)))
        assert all(ch.utterance_id == utt.id for ch in chunks)
        stats = await asyncio.wait_for(utt.wait_played(), 20)
        assert stats.status == "ok" and stats.server_samples and stats.samples == stats.server_samples
        assert c.playout.played == c.received_samples == stats.samples
        assert stats.underruns == 0 and c.playout.underruns == 0
        assert stats.play_start_ms is not None and stats.ttfa_ms is not None
        assert stats.play_start_ms >= stats.ttfa_ms
        # ~4 reports per second of audio, like the browser, and the gateway's flow accounting
        # catches up with the reported playhead (the drain report was sent before
        # wait_played() returned; the server reads it on its own time)
        assert c.reports_sent >= stats.duration_ms / 1000 * 3
        conn = next(iter(gateway.connections))
        flow = conn.session.flow
        assert flow.reporting and flow.sent == stats.samples
        loop = asyncio.get_running_loop()
        await _until(lambda: flow.consumed(loop.time()) == flow.sent, timeout_s=2.0)
        assert len(stats.segments) >= 2


async def test_cancel(gateway: GatewayServer, engine: Any) -> None:
    async with Client(gateway.url, playback="realtime") as c:
        utt = c.speak(LONG)
        got: list[int] = []

        async def consume() -> None:
            async for ch in utt:
                got.append(ch.samples)

        task = asyncio.create_task(consume())
        await _until(lambda: c.playout.played >= 12_000)  # 0.5 s played
        t0 = time.perf_counter()
        reply = await c.cancel()
        assert time.perf_counter() - t0 < 1.0
        await asyncio.wait_for(task, 2)
        assert reply is not None and reply["utterance_id"] == utt.id == 1
        assert reply["cancelled_utterances"] == [1]
        assert 400 < reply["played_ms"] < reply["sent_ms"]
        assert utt.stats.cancelled and utt.stats.status == "cancelled"
        assert utt.stats.heard_text == reply["heard_text"] and LONG.startswith(reply["heard_text"])
        assert c.playout.buffered == 0 and c.playout.state == "idle"
        assert await _engine_idle(engine)
        # the session goes on: no audio of the cancelled utterance leaks into the next one
        utt2 = c.speak("After the barge-in.")
        chunks = [ch async for ch in utt2]
        assert utt2.id == 2 and chunks and all(ch.utterance_id == 2 for ch in chunks)
        assert chunks[0].sample_offset == 0
        st = await asyncio.wait_for(utt2.wait_played(), 10)
        assert st.status == "ok" and st.underruns == 0


async def test_cancel_queued_utterances(gateway: GatewayServer, engine: Any) -> None:
    async with Client(gateway.url, playback="realtime") as c:
        a = c.speak(LONG)
        b = c.speak("Queued behind the first one.")
        await asyncio.wait_for(_first_chunk(a), 5)
        reply = await c.cancel()
        assert reply is not None and set(reply["cancelled_utterances"]) == {1, 2}
        for u in (a, b):
            await asyncio.wait_for(u.done.wait(), 2)
            assert u.stats.cancelled
        assert await _engine_idle(engine)


async def _first_chunk(u: Any) -> None:
    async for _ in u:
        return


async def test_mulaw(gateway: GatewayServer) -> None:
    async with Client(gateway.url, playback="instant", format="mulaw", sample_rate_hz=8_000) as c:
        utt = c.speak("Telephone quality audio.")
        pcm = await utt.collect()
        assert utt.stats.status == "ok" and utt.stats.server_samples and len(pcm) // 2 == utt.stats.server_samples
        assert np.abs(np.frombuffer(pcm, dtype="<i2")).max() > 1000


async def test_errors_and_auth(engine: Any) -> None:
    server = await _start(engine, auth_tokens=("s3cret",), limits=LimitsConfig(max_utterance_chars=40))
    try:
        with pytest.raises(VoicegwError) as ei:
            async with Client(server.url):
                pass
        assert ei.value.code == "handshake_failed" and ei.value.detail["status"] == 401
        async with Client(server.url, token="s3cret", playback="instant") as c:
            utt = c.speak("x" * 60)  # the opening delta is refused: the utterance never opens
            with pytest.raises(VoicegwError) as ei2:
                await utt.collect()
            assert ei2.value.code == "text_too_long"
            ok = c.speak("Short one.")
            assert len(await ok.collect()) > 0 and ok.stats.status == "ok"
    finally:
        await server.shutdown(grace_s=0.5)


async def test_chat(gateway: GatewayServer, tmp_path: Path) -> None:
    out = io.StringIO()
    wav = tmp_path / "chat.wav"
    code = await chat(gateway.url, out_wav=wav, play=False, lines=["Hello there.\n", "\n", "Second line.\n"], out=out)
    assert code == 0, out.getvalue()
    text = out.getvalue()
    assert text.count("ok:") == 2, text
    pcm, rate = read_wav(wav)
    assert rate == 24_000 and len(pcm) / 2 / rate > 0.4


async def test_speakers_mode_with_fake_sound_card(gateway: GatewayServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """``playback="speakers"`` drives the playout from the sound card's callback thread."""
    played = bytearray()

    class RawOutputStream:
        def __init__(self, samplerate: int, channels: int, dtype: str, latency: str, callback: Any) -> None:
            self.rate, self.cb, self.latency = samplerate, callback, 0.02
            self._stop = threading.Event()

        def start(self) -> None:
            def run() -> None:
                block = 256
                while not self._stop.is_set():
                    buf = bytearray(2 * block)
                    self.cb(memoryview(buf), block, None, None)
                    played.extend(buf)
                    time.sleep(block / self.rate)

            self._t = threading.Thread(target=run, daemon=True)
            self._t.start()

        def stop(self) -> None:
            self._stop.set()
            self._t.join()

        def close(self) -> None:
            pass

    monkeypatch.setitem(sys.modules, "sounddevice", types.SimpleNamespace(RawOutputStream=RawOutputStream))
    async with Client(gateway.url, playback="speakers") as c:
        assert c.playback_mode == "speakers" and c.output_latency_ms == 20.0
        utt = c.speak("Played on a sound card.")
        pcm = await utt.collect()
        stats = await asyncio.wait_for(utt.wait_played(), 10)
        assert c.playout.played == len(pcm) // 2 == stats.samples
    assert bytes(pcm) in bytes(played), "the sound card must get exactly the received samples"


async def test_overlapping_cancels_and_instant_mode(gateway: GatewayServer, engine: Any) -> None:
    async with Client(gateway.url, playback="instant") as c:
        utt = c.speak(LONG)
        first = await asyncio.wait_for(utt.__anext__(), 5)
        assert first.samples > 0
        r1, r2 = await asyncio.gather(c.cancel(), c.cancel())
        assert r1 is not None and r2 is not None and r1["cancelled_utterances"] == [1]
        assert r2["cancelled_utterances"] == []
        assert [ch async for ch in utt] == [], "queued audio of a cancelled utterance is dropped"
        assert utt.stats.cancelled
        # the recorder's played counter equals what it took; the gateway agrees after the cancel
        conn = next(iter(gateway.connections))
        assert conn.session.flow.client_played(asyncio.get_running_loop().time()) == c.consumed_samples
        nxt = c.speak("Next.")
        assert len(await nxt.collect()) > 0 and nxt.stats.status == "ok"
        assert await _engine_idle(engine)


class _Times(ClientRecorder):
    """What a recorder sees: (kind, utterance id, time) in order; it breaks on the first frame."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Any, float]] = []
        self.samples = 0
        self.broke = False

    def on_session_started(self, msg: dict[str, Any], t: float) -> None:
        self.seen.append(("session.started", None, t))

    def on_segment_started(self, utterance: Any, msg: dict[str, Any], t: float) -> None:
        self.seen.append(("segment.started", utterance, t))

    def on_utterance_done(self, utterance: Any, msg: dict[str, Any], t: float) -> None:
        self.seen.append(("utterance.done", utterance, t))

    def on_audio(self, utterance: Any, header: Any, payload: bytes, t: float) -> None:
        self.samples += len(payload) // header.format.bytes_per_sample
        self.seen.append(("audio", utterance, t))
        if not self.broke:
            self.broke = True
            raise RuntimeError("a broken recorder")

    def on_cancelled(self, utterance: Any, msg: dict[str, Any], t: float) -> None:
        self.seen.append(("cancelled", utterance, t))


async def test_recorder_sees_the_wire_and_an_app_reports_its_own_playhead(gateway: GatewayServer) -> None:
    """The recorder hook: every message and frame in order with monotonic times, attributed to the
    client's utterance; a failing callback breaks nothing. ``playback="none"`` with
    ``send_playback`` and ``max_queued_chunk_s=0``: the application plays (and reports) itself."""
    rec = _Times()
    t0 = time.monotonic()
    async with Client(gateway.url, playback="none", max_queued_chunk_s=0, recorder=rec) as c:
        utt = c.speak(TEXT)
        await asyncio.wait_for(utt.done.wait(), 20)
        assert utt.stats.status == "ok" and rec.samples == utt.stats.samples == utt.stats.server_samples
        assert await utt.collect() == b""  # nothing kept: the recorder had the audio
        await c.send_playback(rec.samples, 0.0, 0)
        await c.ping()  # a round trip: the report has been handled
        conn = next(iter(gateway.connections))
        assert conn.session.flow.client_played(asyncio.get_running_loop().time()) == rec.samples
        long = c.speak(LONG)
        await _until(lambda: any(k == "audio" and u is long for k, u, _ in rec.seen))
        reply = await c.cancel(played_samples=utt.stats.samples)  # the first one played out, none of this
        assert reply is not None and reply["utterance_id"] == long.id and reply["played_ms"] == 0.0, reply
    kinds = [k for k, _, _ in rec.seen]
    done = kinds.index("utterance.done")
    assert kinds[0] == "session.started" and kinds[1] == "segment.started" and "audio" in kinds[:done]
    assert all(u is utt for _, u, _ in rec.seen[1:done + 1])  # attributed to the client's utterance
    assert rec.seen[-1][:2] == ("cancelled", long)
    times = [t for _, _, t in rec.seen]
    assert times == sorted(times) and t0 <= times[0] <= times[-1] <= time.monotonic()


def test_playout_truncate() -> None:
    p = Playout(1000, prebuffer_ms=0)
    p.push(500)
    assert p.pull(100) == (100, False)
    assert p.truncate(300) == 200 and p.buffered == 200  # dropped past stream position 300
    assert p.pull(300) == (200, True)  # what is left ends cleanly: a drain, not an underrun
    assert p.underruns == 0 and p.state == "idle"
    p.push(50)
    assert p.truncate(0) == 50 and p.buffered == 0 and p.state == "idle"  # never below the playhead


def test_retry_policy() -> None:
    import random

    from clients.python import RetryPolicy

    rnd = random.Random(1)
    pol = RetryPolicy(reconnect_initial_ms=100, reconnect_max_ms=1000, jitter=0.2)
    waits = [pol.backoff_ms(a, rnd) for a in range(1, 8)]
    for a, w in enumerate(waits, start=1):
        base = min(1000, 100 * 2 ** (a - 1))
        assert 0.8 * base <= w <= 1.2 * base
    for bad in ({"overload_attempts": 0}, {"jitter": 1.0}, {"reconnect_timeout_s": 0}, {"reconnect_max_ms": -1}):
        with pytest.raises(ValueError):
            RetryPolicy(**bad)  # type: ignore[arg-type]


async def test_text_streamed_during_an_outage_is_sent_after_the_reconnect() -> None:
    """The gateway drops every connection (no close frame) while the application is still
    streaming tokens, and comes back on the same port: the client reconnects, re-sends the
    unfinished utterance from its first segment not received whole, then the tokens produced
    meanwhile, and the utterance ends with every word spoken once."""
    from clients.python import ClientEvent, RetryPolicy
    from loadtest.fakes import FakeSpeechEngine

    eng = FakeSpeechEngine()
    server = await _start(eng)
    port = server.port
    words = ("Here we go, one step at a time. First comes the opening part of the answer. "
             "Then the middle part follows it. And finally the end arrives, right here.").split()
    outage = asyncio.Event()
    back = asyncio.Event()
    sent_during_outage: list[str] = []

    async def tokens() -> AsyncIterator[str]:
        for i, w in enumerate(words):
            if i == 12:
                outage.set()
            if outage.is_set() and not back.is_set():
                sent_during_outage.append(w)
            yield w + " "
            await asyncio.sleep(0.03)

    events: list[ClientEvent] = []
    policy = RetryPolicy(reconnect_initial_ms=50, reconnect_max_ms=200, reconnect_timeout_s=20)
    server2: GatewayServer | None = None
    try:
        async with Client(server.ws_url, playback="instant", retry=policy, on_event=events.append) as c:
            u = c.speak(tokens())
            await asyncio.wait_for(outage.wait(), 10)
            for conn in list(server.connections):
                conn.ws.abort()  # a crash, as the client sees it: no close frame
            await server.shutdown(grace_s=0)
            await asyncio.sleep(0.3)  # the application keeps streaming meanwhile
            server2 = await _start(eng, port=port)
            back.set()
            pcm = await asyncio.wait_for(u.collect(), 30)
        assert sent_during_outage, "no token was produced during the outage"
        assert u.stats.status == "ok" and u.stats.resumes == 1 and len(pcm) > 0, u.stats
        assert [e.type for e in events][:1] == ["disconnected"] and "resumed" in [e.type for e in events]
        whole = [p for p in u.stats.plays if p.complete]
        assert [p.segment for p in whole] == sorted({p.segment for p in whole})  # each once, in order
        assert " ".join(p.text for p in whole).split() == words
    finally:
        if server2 is not None:
            await server2.shutdown(grace_s=0.5)

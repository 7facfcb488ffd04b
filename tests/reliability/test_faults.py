"""Client-side faults against the gateway in a child process (``gwproc``), measured from outside:
clients SIGKILLed mid-stream, 1,000 abrupt disconnects, clients that stop reading (network
stall), clients that stop answering pings. After each: zero sessions, zero running engine
requests (``/healthz``), and the gateway's RSS and fd count back near their baseline.

Bounds (stated here, checked below):
* fds: back to the baseline exactly (+2 slack for a lazily opened file);
* RSS: at most ``RSS_SLACK_BYTES`` (24 MiB) above the baseline taken after a warm-up of the same
  traffic (allocator high-water marks and lazily built caches are not leaks; a leak of even 10 kB
  per session would show as 10 MB over 1,000 sessions).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from gateway import protocol as P
from tests.reliability.gwproc import ROOT, GatewayProcess
from tests.reliability.rawws import OP_BINARY, OP_TEXT, RawConn, handshake_request, read_http_response

RSS_SLACK_BYTES = 24 << 20
FD_SLACK = 2
LONG_TEXT = "This is a long answer that keeps the engine busy for a while, sentence after sentence. " * 6


def _settled(gw: GatewayProcess, within_s: float = 10.0) -> dict[str, Any]:
    """Wait until the gateway has no session and the engine no request; return /healthz."""
    deadline = time.monotonic() + within_s
    while True:
        status, h = gw.healthz()
        if h.get("sessions") == 0 and h.get("running_requests") == 0:
            return h
        if time.monotonic() > deadline:
            raise AssertionError(f"not settled after {within_s} s: {h}")
        time.sleep(0.02)


async def _asettled(gw: GatewayProcess, within_s: float = 10.0) -> tuple[dict[str, Any], float]:
    t0 = time.monotonic()
    h = await asyncio.to_thread(_settled, gw, within_s)
    return h, time.monotonic() - t0


def _report(name: str, **numbers: Any) -> None:
    """Numbers for the report (visible with ``-s`` or in the captured output of a failure)."""
    print(f"[reliability] {name}: " + ", ".join(f"{k}={v}" for k, v in numbers.items()), file=sys.stderr)


@pytest.fixture(scope="module")
def gw() -> Iterator[GatewayProcess]:
    settings = {
        "limits.max_sessions": 512,
        "gateway.send_timeout_ms": 1000,
        "gateway.write_limit_bytes": 16384,
        "gateway.open_timeout_s": 2.0,
    }
    with GatewayProcess("fake", settings=settings) as g:
        yield g
        assert g.alive()


async def _session(port: int, text: str = LONG_TEXT, *, rcvbuf: int | None = None) -> RawConn:
    """A raw client with a started session and an utterance in flight."""
    if rcvbuf is None:
        conn = await RawConn.open("127.0.0.1", port)
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.connect(("127.0.0.1", port))
        sock.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=sock)
        req, _ = handshake_request("127.0.0.1", port)
        writer.write(req)
        await writer.drain()
        resp = await read_http_response(reader)
        assert resp.status == 101
        conn = RawConn(reader, writer, resp)
    await conn.send_json({"type": "session.start"})
    started = await conn.read_json()
    assert started["type"] == "session.started", started
    if text:
        await conn.send_json({"type": "text.delta", "text": text})
    return conn


async def _first_audio(conn: RawConn, within_s: float = 10.0) -> None:
    """Until the first audio frame, or an error that ends the utterance without audio (under a
    wave of sessions admission control may refuse it: ``engine_overloaded``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        f = await conn.read_frame(max(0.01, deadline - loop.time()))
        if f.opcode == OP_BINARY:
            return
        assert f.opcode == OP_TEXT, f
        if orjson.loads(f.payload).get("type") == "error":
            return


# ---- client killed -------------------------------------------------------------------------------

CLIENT = textwrap.dedent(
    """
    import asyncio, sys, orjson
    from websockets.asyncio.client import connect

    async def main(url):
        async with connect(url, subprotocols=["voicegw.v1"], compression=None) as ws:
            await ws.send(orjson.dumps({"type": "session.start"}).decode())
            await ws.send(orjson.dumps({"type": "text.delta", "text": sys.argv[2]}).decode())
            frames = 0
            async for m in ws:
                if isinstance(m, bytes):
                    frames += 1
                    if frames == 3:
                        print("streaming", flush=True)
    asyncio.run(main(sys.argv[1]))
    """
)


async def test_clients_sigkilled_mid_stream(gw: GatewayProcess):
    _settled(gw)
    fds0, rss0 = gw.fds(), gw.rss()
    procs = []
    for _ in range(4):
        procs.append(await asyncio.create_subprocess_exec(
            sys.executable, "-c", CLIENT, gw.ws_url, LONG_TEXT, cwd=ROOT,
            stdout=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)}))
    survivor = await _session(gw.port, "A bystander keeps talking through all of this.")
    await _first_audio(survivor)
    for p in procs:
        assert p.stdout is not None
        line = await asyncio.wait_for(p.stdout.readline(), 30)
        assert line.strip() == b"streaming"
    _, before = gw.healthz()
    assert before["sessions"] == 5 and before["running_requests"] >= 4
    t_kill = time.monotonic()
    for p in procs:
        p.send_signal(signal.SIGKILL)
    for p in procs:
        await p.wait()
    deadline = t_kill + 5
    while True:
        _, h = gw.healthz()
        if h["sessions"] == 1:
            break
        assert time.monotonic() < deadline, h
        await asyncio.sleep(0.01)
    cleanup_s = time.monotonic() - t_kill
    # the bystander's utterance is untouched
    await survivor.send_json({"type": "text.end"})
    while True:
        m = await survivor.read_json(within_s=20)
        if m["type"] == "utterance.done":
            assert m["status"] == "ok"
            break
        assert m["type"] != "error", m
    await survivor.close()
    h, settle_s = await _asettled(gw)
    await asyncio.sleep(0.2)
    fds1, rss1 = gw.fds(), gw.rss()
    _report("sigkill-clients", killed=4, sessions_gone_s=round(cleanup_s, 3), running_requests=h["running_requests"],
            fds_before=fds0, fds_after=fds1, rss_before_mb=round(rss0 / 2**20, 1), rss_after_mb=round(rss1 / 2**20, 1))
    assert cleanup_s < 2.0
    assert fds1 <= fds0 + FD_SLACK and rss1 - rss0 < RSS_SLACK_BYTES


# ---- 1,000 abrupt disconnects ----------------------------------------------------------------------


async def _abrupt(port: int, i: int) -> None:
    """Disconnect styles, by i % 5: mid-handshake, right after the upgrade, after session start
    with text pending, mid-stream (after the first audio frame), mid-stream with a half close."""
    style = i % 5
    if style == 0:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        req, _ = handshake_request("127.0.0.1", port)
        writer.write(req[: len(req) // 2])
        await writer.drain()
        writer.transport.abort()
        return
    if style == 1:
        conn = await RawConn.open("127.0.0.1", port)
        conn.abort()
        return
    conn = await _session(port, f"Client {i} says something and vanishes. " * 3)
    if style >= 3:
        await _first_audio(conn)
    if style == 4:
        with contextlib.suppress(Exception):
            conn.writer.write_eof()
        await asyncio.sleep(0)
    conn.abort()


async def _abrupt_wave(port: int, n: int, concurrency: int) -> None:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            await _abrupt(port, i)

    await asyncio.gather(*(one(i) for i in range(n)))


async def test_1000_abrupt_disconnects_leak_nothing(gw: GatewayProcess):
    await _abrupt_wave(gw.port, 200, 25)  # warm-up: same traffic, so caches and arenas exist
    await _asettled(gw)
    rss0, fds0 = gw.rss(), gw.fds()
    t0 = time.monotonic()
    await _abrupt_wave(gw.port, 1000, 50)
    wave_s = time.monotonic() - t0
    h, settle_s = await _asettled(gw, within_s=15)
    await asyncio.sleep(0.2)
    rss1, fds1 = gw.rss(), gw.fds()
    _report("1000-abrupt-disconnects", wave_s=round(wave_s, 1), settle_s=round(settle_s, 2),
            running_requests=h["running_requests"], rss_before_mb=round(rss0 / 2**20, 1),
            rss_after_mb=round(rss1 / 2**20, 1), fds_before=fds0, fds_after=fds1)
    assert h["running_requests"] == 0 and h["sessions"] == 0
    assert fds1 <= fds0 + FD_SLACK, (fds0, fds1)
    assert rss1 - rss0 < RSS_SLACK_BYTES, (rss0, rss1)
    assert wave_s < 60


# ---- network stall: the client stops reading ---------------------------------------------------------


async def test_stalled_reader_is_evicted_by_send_timeout(gw: GatewayProcess):
    """Tiny receive window, never read (but keep reporting playback, so the server has audio to
    push as fast as the engine makes it): the server's send blocks; after send_timeout_ms (1 s
    here) the client is evicted (1008, or an abort since the close cannot pass a full buffer) and
    its engine work aborted; a bystander is unaffected."""
    _settled(gw)
    fds0 = gw.fds()
    bystander = await _session(gw.port, "The bystander speaks while other clients stall. " * 2)
    stalled = [await _session(gw.port, LONG_TEXT * 3, rcvbuf=2048) for _ in range(3)]

    async def report(conn: RawConn) -> None:
        with contextlib.suppress(Exception):
            while True:
                await conn.send_json({"type": "playback", "played_samples": 10**12})
                await asyncio.sleep(0.05)

    reporters = [asyncio.create_task(report(s)) for s in stalled]
    for s in stalled:
        await s.send_json({"type": "text.end"})
    t0 = time.monotonic()
    deadline = t0 + 10
    while True:
        _, h = gw.healthz()
        if h["sessions"] == 1:
            break
        assert time.monotonic() < deadline, h
        await asyncio.sleep(0.02)
    evicted_s = time.monotonic() - t0
    for t in reporters:
        t.cancel()
    await bystander.send_json({"type": "text.end"})
    while True:
        m = await bystander.read_json(within_s=20)
        assert m["type"] != "error", m
        if m["type"] == "utterance.done":
            assert m["status"] == "ok"
            break
    await bystander.close()
    h, _ = await _asettled(gw)
    for s in stalled:
        s.abort()
    await asyncio.sleep(0.2)
    fds1 = gw.fds()
    _report("stalled-readers", stalled=3, evicted_after_s=round(evicted_s, 2), send_timeout_s=1.0,
            running_requests=h["running_requests"], fds_before=fds0, fds_after=fds1)
    assert evicted_s < 1.0 + 2.0
    assert fds1 <= fds0 + FD_SLACK


async def test_unresponsive_client_is_dropped_by_keepalive():
    """A client that is idle and answers no WebSocket ping is closed after ping_interval +
    ping_timeout."""
    settings = {"gateway.ping_interval_s": 0.5, "gateway.ping_timeout_s": 0.5}
    with GatewayProcess("fake", settings=settings) as g:
        conn = await _session(g.port, "")
        t0 = time.monotonic()
        # the raw client never answers pings; read (and ignore) whatever comes until the close
        code, _ = await conn.expect_close(within_s=5)
        gone_s = time.monotonic() - t0
        await conn.close()
        h, _ = await _asettled(g)
        _report("keepalive", closed_after_s=round(gone_s, 2), code=code)
        assert code in (1011, 1006) and gone_s < 3.0
        assert h["sessions"] == 0


def test_close_codes_used_here_are_documented() -> None:
    assert {1008, 1011} <= {int(c) for c in P.CloseCode}


# ---- a client whose played counter goes back ------------------------------------------------------
#
# Found by the soak: a client that restarts ``played_samples`` from 0 for each utterance (the
# protocol says the counter is never reset, but a buggy client is one bug away) made its 3rd
# utterance crawl at one 40 ms frame per 1.66 s: FlowControl.on_playback keeps the larger counter,
# but every (non-advancing) report still refreshes the report time and pulls the virtual playhead
# back to it, so the playhead never runs: each frame sent triggers a report that freezes it for
# another stale_report_ms. Fixed (issue 8, gateway/flow.py FlowControl.on_playback): a report whose
# counter is below the last one is ignored (the virtual playhead then paces that client in real time).


def test_regressing_report_does_not_freeze_the_virtual_playhead() -> None:
    from gateway.flow import FlowConfig, FlowControl

    f = FlowControl(FlowConfig(sample_rate_hz=1000, window_ms=100.0, stale_report_ms=500.0), now_s=0.0)
    f.on_sent(0.0, 1000)
    f.on_playback(0.0, 1000)  # played all of it
    f.on_sent(0.0, 1000)
    t = 0.0
    for _ in range(40):  # a report from a counter reset to 0 every 50 ms
        t += 0.05
        f.on_playback(t, 10)
    # the last good report went stale at 0.5 s; the virtual playhead then played in real time
    assert f.consumed(t) == 2000, f.consumed(t)


REGRESS_TEXT = "Numbers like 3.14 and 1,000 stay whole. Then we train the model for a while, and look at the curves."


async def _utterances_with_reports(server: Any, played_of: Any, n: int, within_s: float) -> list[float]:
    """A raw client that answers every audio frame with a ``playback`` report of
    ``played_of(samples of this utterance, samples of the session)``."""
    c = await RawConn.open("127.0.0.1", server.port)
    await c.send_json({"type": "session.start"})
    await c.wait_json("session.started")
    took = []
    total = 0
    try:
        for _ in range(n):
            per_utt = 0
            for i in range(0, len(REGRESS_TEXT), 4):
                await c.send_json({"type": "text.delta", "text": REGRESS_TEXT[i:i + 4]})
            await c.send_json({"type": "text.end"})
            t0 = time.monotonic()
            deadline = t0 + within_s
            while True:
                f = await c.read_frame(max(0.01, deadline - time.monotonic()))
                if f.opcode == OP_TEXT:
                    m = orjson.loads(f.payload)
                    if m["type"] == "utterance.done":
                        assert m["status"] == "ok"
                        break
                    continue
                if f.opcode != OP_BINARY:
                    continue
                samples = len(P.unpack_audio_frame(f.payload)[1]) // 2
                per_utt += samples
                total += samples
                await c.send_json({"type": "playback", "played_samples": played_of(per_utt, total)})
            took.append(time.monotonic() - t0)
    finally:
        await c.close()
    return took


async def test_cumulative_played_counter_paces_by_the_engine(make_gateway: Any):
    from loadtest.fakes import FakeSpeechEngine

    async with make_gateway(FakeSpeechEngine()) as server:
        took = await _utterances_with_reports(server, lambda per_utt, total: total, 4, within_s=5)
        assert max(took) < 1.0, took


async def test_client_that_resets_its_played_counter_still_gets_its_utterances(make_gateway: Any):
    from loadtest.fakes import FakeSpeechEngine

    async with make_gateway(FakeSpeechEngine()) as server:
        # each utterance is ~2 s of audio; a reset counter is not trusted, so real-time pacing is fine
        took = await _utterances_with_reports(server, lambda per_utt, total: per_utt, 4, within_s=8)
        assert max(took) < 6.0, took

"""Preemption through the gateway (``scheduler.preempt``) on the real engine: a playing session's
running continuing segment is paused and resumed for a new session's first segment; both
utterances complete, and the preempted stream's frames stay contiguous (no gap, no duplicate).

The client plays instantly (engine-paced) and any buffer qualifies, so the test shows the plumbing,
not the policy's thresholds (tests/engine/test_preempt_policy.py). The gateway is told ``engine.max_num_seqs = 1`` so that it sees the engine as full with one
stream; the session's vLLM engine itself has more slots (the resume then just re-queues)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path

import pytest

from engine.api import SpeechEngine
from gateway.dispatch import EngineScheduler
from gateway.server import GatewayServer
from gateway.session import SessionSettings
from tests.gateway.conftest import wait_until
from tests.gateway.test_server import _check_stream
from tests.gateway.wsclient import Client
from voicegw.config import Config, EngineConfig, GatewayConfig, LimitsConfig, SchedulerConfig

LONG = " ".join(["This sentence is here to make the utterance long enough to preempt."] * 6)


@pytest.mark.xfail(strict=False, reason="timing-dependent scenario: in the full suite (loaded 2-core host) A sometimes "
                   "never has a continuing segment generating while buffered (passes alone); preemption itself is "
                   "covered by tests/engine/test_speech_preempt.py and tests/gateway/test_preempt_dispatch.py")
async def test_preempted_stream_continues_seamlessly(speech_engine: SpeechEngine, tmp_path: Path) -> None:
    if not getattr(speech_engine, "supports_preempt", False):
        pytest.skip("preemption needs the vLLM code engine (VOICEGW_TEST_ENGINE=vllm)")
    config = Config(
        gateway=GatewayConfig(port=0, shutdown_grace_s=2.0),
        engine=dataclasses.replace(EngineConfig(), max_num_seqs=1, scheduling_policy="priority"),
        scheduler=dataclasses.replace(SchedulerConfig(), preempt=True, preempt_min_buffer_ms=200.0, admission=False),
        limits=dataclasses.replace(LimitsConfig(), flow_window_ms=2_000.0),
    )
    st = SessionSettings.from_config(config, speech_engine.name)
    server = GatewayServer(config, speech_engine, static_dir=tmp_path, settings=st)
    await server.start()
    try:
        sched = EngineScheduler.for_server(server)
        assert sched.preempt_enabled
        # real-time client (no playback reports): its buffer fills to the flow window, its
        # segments' consumers are gated, so the code request is still running when B arrives
        a = await Client.open(server.ws_url)
        await a.start()
        await a.speak(LONG, piece_chars=60)
        stop = asyncio.Event()

        async def receive_a() -> None:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await a.recv_one(within_s=0.2)

        a_rx = asyncio.create_task(receive_a())
        # wait until A plays, with audio buffered at its client, and a continuing segment of it
        # is generating (a segment whose code stream the gateway has not read to the end)
        def a_preemptible() -> bool:
            return a.received_samples > 36_000 and any(
                not t.first and speech_engine.can_preempt(k)  # type: ignore[attr-defined]
                for k, t in list(sched._tracked.items()))

        b = await Client.open(server.ws_url, fast_playback=True)
        await b.start()
        # A's segment may finish in the moment B takes to arrive: a few new utterances on B,
        # each arriving while a continuing segment of A is generating
        for i in range(5):
            assert await wait_until(a_preemptible, within_s=90)
            await b.speak(f"A new speaker says hello, number {i}.")
            b_done = await b.wait_for("utterance.done", within_s=60)
            assert b_done["status"] == "ok" and not b.errors()
            if sched.preempted:
                break
        assert sched.preempted >= 1, "no preemption happened"
        n0 = a.received_samples
        assert await wait_until(
            lambda: a.received_samples > n0 + 48_000 or "utterance.done" in a.types(), within_s=30
        ), "A stalled after the preemption"
        stop.set()
        await a_rx
        assert not a.errors()
        _check_stream(a, 1)  # contiguous: seq and sample offsets add up across the resume
        await a.close()
        await b.close()
        assert await wait_until(lambda: speech_engine.health().running_requests == 0, within_s=5)
    finally:
        await server.shutdown(grace_s=0.5)
        speech_engine.enable_preemption(False)  # type: ignore[attr-defined]  # shared session engine

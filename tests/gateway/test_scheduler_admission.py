"""Admission control over a real socket (fake engine, 127.0.0.1)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from gateway.admission import EngineScheduler
from gateway.server import GatewayServer
from loadtest.fakes import FakeSpeechEngine
from tests.gateway.conftest import wait_until
from tests.transcript import Transcript, fast_client, quiet_client
from voicegw.config import Config, EngineConfig, GatewayConfig, SchedulerConfig

LONG = "This answer goes on for quite a while, sentence after sentence. " * 6


@contextlib.asynccontextmanager
async def _gateway(engine: FakeSpeechEngine, tmp_path: Path, engine_cfg: dict[str, Any],
                   scheduler: dict[str, Any]) -> AsyncIterator[GatewayServer]:
    config = Config(gateway=GatewayConfig(port=0, shutdown_grace_s=1.0),
                    engine=dataclasses.replace(EngineConfig(), **engine_cfg),
                    scheduler=dataclasses.replace(SchedulerConfig(), **scheduler))
    server = GatewayServer(config, engine, static_dir=tmp_path)
    await server.start()
    try:
        yield server
    finally:
        await server.shutdown(grace_s=0.5)


async def test_admission_refuses_new_utterance_when_engine_full_then_recovers(tmp_path: Path) -> None:
    engine = FakeSpeechEngine(speed=2.0)
    async with _gateway(engine, tmp_path, {"max_num_seqs": 1}, {"ttfa_target_ms": 100.0}) as server:
        bt = Transcript()
        busy = quiet_client(server.ws_url, bt)  # never reports playback: its stream stays in the engine
        await busy.connect()
        busy.speak(LONG)
        await bt.wait_for("segment.started")
        assert engine.running  # the one batch slot is taken

        t = Transcript()
        c = fast_client(server.ws_url, t)  # no retries: the refusal is what is looked at
        await c.connect()
        c.speak("Hello there, may I speak?")
        err = await t.wait_for("error")
        assert err["code"] == "engine_overloaded" and err["fatal"] is False and err["utterance_id"] == 1
        assert isinstance(err["retry_after_ms"], int) and err["retry_after_ms"] > 0, err
        done = await t.wait_for("utterance.done")
        assert done["status"] == "error" and done["error"] == "engine_overloaded" and done["samples"] == 0
        assert EngineScheduler.for_server(server).refused == 1
        assert server.metrics.admission_refused._value.get() == 1
        assert b"voicegw_admission_refused_total 1.0" in server.metrics.render()
        assert c.session is not None
        sid = c.session["session_id"]
        assert not [r for r in engine.requests if r.request_id.startswith(sid)]  # never reached the engine

        await busy.cancel()
        assert await wait_until(lambda: not engine.running, within_s=5)
        c.speak("Now there is room.")  # the session survived; the retry is admitted
        done = await t.wait_for("utterance.done", within_s=20)
        assert done["status"] == "ok" and done["samples"] > 0
        await c.close()
        await busy.close()


async def test_realtime_guard_refuses_a_new_answer_that_would_slow_the_playing_ones(tmp_path: Path) -> None:
    """``scheduler.realtime_guard``: batch slots are free (``max_num_seqs`` 64), but the step time
    learned at the batch a new answer would join is past real time (21.3 ms a step): it is refused,
    and the answer already playing goes on. Off (the default): the same answer is admitted."""
    for guard in (True, False):
        engine = FakeSpeechEngine(speed=2.0)
        async with _gateway(engine, tmp_path, {"max_num_seqs": 64}, {"realtime_guard": guard}) as server:
            sched = EngineScheduler.for_server(server)
            assert sched.admission is not None
            for _ in range(4):  # learned: 2 + 10 ms per sequence (batch 1: 12 ms, batch 2: 22 ms)
                for b in range(1, 9):
                    sched.admission.observe_step(b, 2.0 + 10.0 * b)
            bt = Transcript()
            busy = quiet_client(server.ws_url, bt)
            await busy.connect()
            busy.speak(LONG)
            await bt.wait_for("segment.started")
            assert engine.health().running_requests >= 1

            t = Transcript()
            c = fast_client(server.ws_url, t)
            await c.connect()
            c.speak("Hello there, may I speak?")
            if guard:
                err = await t.wait_for("error")
                assert err["code"] == "engine_overloaded" and err["retry_after_ms"] > 0, err
                assert sched.refused == 1
            else:
                assert (await t.wait_for("segment.started"))["utterance_id"] == 1
                assert sched.refused == 0
            assert not [m for m in bt.messages if m.get("type") == "error"]  # the playing answer goes on
            await c.close()
            await busy.close()

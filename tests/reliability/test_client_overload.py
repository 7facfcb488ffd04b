"""The Python client retries an utterance an overloaded engine refused, after the hinted wait,
against the real gateway and the real engine (vLLM on the tiny checkpoint, one batch slot).
(Reconnect and resume after a gateway restart: tests/browser/test_resume.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from clients.python import Client, ClientEvent, RetryPolicy
from gateway.server import GatewayServer
from tests.transcript import Transcript, quiet_client
from voicegw.config import Config, EngineConfig, GatewayConfig, SchedulerConfig

ANSWER = "This answer goes on for quite a while, sentence after sentence, holding the one slot. " * 6


def _report(name: str, **numbers: Any) -> None:
    print(f"[reliability] {name}: " + ", ".join(f"{k}={v}" for k, v in numbers.items()), file=sys.stderr)


async def test_overload_is_retried_after_the_hinted_wait(speech_engine: Any, tmp_path: Path) -> None:
    """One engine batch slot (engine.max_num_seqs = 1, admission on): a second speaker is refused
    with engine_overloaded and retry_after_ms; the client waits about that long, tries again, and
    the utterance is spoken once the slot is free."""
    config = Config(gateway=GatewayConfig(port=0, shutdown_grace_s=1.0),
                    engine=dataclasses.replace(EngineConfig(), max_num_seqs=1),
                    scheduler=dataclasses.replace(SchedulerConfig(), ttfa_target_ms=50.0, admission=True))
    server = GatewayServer(config, speech_engine, static_dir=tmp_path)
    await server.start()
    try:
        bt = Transcript()
        busy = quiet_client(server.ws_url, bt)  # never reports playback: its stream holds the slot
        await busy.connect()
        busy.speak(ANSWER)
        await bt.wait_for("segment.started", within_s=60)
        events: list[ClientEvent] = []
        freed = asyncio.Event()

        def on_event(ev: ClientEvent) -> None:
            events.append(ev)
            if ev.type == "retry":
                freed.set()

        policy = RetryPolicy(overload_attempts=20, overload_max_wait_ms=2000.0)
        async with Client(server.ws_url, playback="instant", retry=policy, on_event=on_event) as c:
            u = c.speak("Hello there, may I speak now?")
            await asyncio.wait_for(freed.wait(), 60)
            t_refused = time.monotonic()
            await busy.cancel()  # the slot frees while the client waits
            pcm = await asyncio.wait_for(u.collect(), 120)
        refusals = [m for m in c.errors if m.get("code") == "engine_overloaded"]
        assert refusals and all(isinstance(m.get("retry_after_ms"), int) for m in refusals), c.errors
        retries = [e for e in events if e.type == "retry"]
        assert u.stats.status == "ok" and len(pcm) > 0, u.stats
        assert u.stats.attempts == len(retries) + 1 >= 2, (u.stats.attempts, retries)
        first_wait_ms = retries[0].detail["wait_ms"]
        hinted = refusals[0]["retry_after_ms"]
        assert min(hinted, 2000) * 0.79 <= first_wait_ms <= min(hinted * 1.21, 2000) + 1, (first_wait_ms, hinted)
        _report("python-client-overload", attempts=u.stats.attempts, hinted_ms=hinted, waited_ms=first_wait_ms,
                after_slot_freed_ms=round((time.monotonic() - t_refused) * 1000))
        await busy.close()
    finally:
        await server.shutdown(grace_s=0.5)

"""The Python client rides out a bad minute against the real gateway and the real engine (vLLM on
the tiny checkpoint): a gateway process killed mid-answer and started again (reconnect, resume at
the first segment not wholly heard), and an overloaded engine (retry after the hinted wait).

The figures (outage-to-audio time, the gateway's restart excluded) are printed as
``[reliability] ...`` lines (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from clients.python import Client, ClientEvent, RetryPolicy
from gateway.server import GatewayServer
from tests.conftest import RestartableGateway
from tests.gateway.wsclient import Client as RawClient
from voicegw.config import Config, EngineConfig, GatewayConfig, SchedulerConfig

ANSWER = ("Let me walk you through it, one step at a time. First, open the settings page. "
          "Then choose the network tab, near the top. Next, turn the switch on and wait a moment. "
          "After that, pick your home network from the list. Type the password and press join. "
          "Finally, check that the little icon turns green. That is all there is to it.")


def _report(name: str, **numbers: Any) -> None:
    print(f"[reliability] {name}: " + ", ".join(f"{k}={v}" for k, v in numbers.items()), file=sys.stderr)


async def _until(pred: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():  # noqa: ASYNC110 - polling state other tasks advance
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def _words(text: str) -> list[str]:
    return text.split()


async def test_gateway_killed_mid_answer_resumes_at_first_unheard_segment(
        restartable_gateway: RestartableGateway) -> None:
    gw = restartable_gateway
    gw.ensure_up()
    events: list[ClientEvent] = []
    policy = RetryPolicy(reconnect_timeout_s=300.0, reconnect_max_ms=1000.0)
    async with Client(gw.ws_url, playback="realtime", prebuffer_ms=300, retry=policy,
                      on_event=events.append) as c:
        u = c.speak(ANSWER)
        # mid-answer: the second segment's audio is arriving (the first one plays or has played)
        await _until(lambda: any(p.segment >= 1 and p.samples > 0 for p in u.stats.plays), 120,
                     "the second segment's audio")
        assert not u.done.is_set(), "the whole answer arrived before the kill: nothing to resume"
        plays_at_kill = [dataclasses.replace(p) for p in u.stats.plays]
        t_kill = time.monotonic()
        gw.kill()
        await asyncio.to_thread(gw.start)  # the same port: a restart under an orchestrator
        restart_s = time.monotonic() - t_kill
        stats = await asyncio.wait_for(u.wait_played(), 300)
        outage = c.last_outage

    assert stats.status == "ok" and stats.resumes == 1, stats
    kinds = [e.type for e in events]
    assert kinds[0] == "disconnected" and "reconnected" in kinds and "resumed" in kinds, kinds
    assert events[0].detail["code"] in (1006, 1011, 1012, 1013), events[0]
    # what was heard: every segment wholly once, in order, and together they are the answer
    heard = [p for p in stats.plays if p.complete and p.played >= p.samples > 0]
    indexes = [p.segment for p in heard]
    assert indexes == sorted(indexes) and len(indexes) == len(set(indexes)), (
        f"a segment heard twice or out of order: {indexes}")
    every = sorted({p.segment for p in stats.plays if p.samples > 0 or p.complete})
    assert indexes == every, f"segments skipped: {sorted(set(every) - set(indexes))}"
    assert _words(" ".join(p.text for p in heard)) == _words(ANSWER), [p.text for p in heard]
    interrupted = [p for p in stats.plays if not p.complete]
    assert len(interrupted) <= 1 and all(p.take == 0 for p in interrupted), stats.plays
    assert outage is not None and outage["to_audio_ms"] is not None, outage
    _report("python-client-resume", segments=len(indexes), heard_before_kill=len(
        [p for p in plays_at_kill if p.complete]), gateway_restart_s=round(restart_s, 1),
        outage_ms=outage["outage_ms"], reconnected_to_audio_ms=outage["to_audio_ms"], gap_ms=outage["gap_ms"],
        reconnect_attempts=outage["attempts"])


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
        busy = await RawClient.open(server.ws_url)  # never reports playback: its stream holds the slot
        await busy.start()
        await busy.speak(ANSWER)
        await busy.wait_for("segment.started", within_s=60)
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
            await busy.send({"type": "cancel"})  # the slot frees while the client waits
            await busy.wait_for("cancelled")
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

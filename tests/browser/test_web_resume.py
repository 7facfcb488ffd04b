"""The browser client rides out a gateway restart: headless chromium on a page served by the real
gateway (vLLM on the tiny checkpoint, in its own process); the process is SIGKILLed mid-answer and
started again on the same port; the page reconnects, resumes at the first segment not wholly
received and reports the gap (``audioresumed``)."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import pytest

from tests.conftest import RestartableGateway
from tests.reliability.test_client_resume import ANSWER

pytestmark = pytest.mark.browser

START_JS = """
async ({text}) => {
  const { VoiceGateway } = await import("/voicegw.js");
  const gw = new VoiceGateway(undefined, {
    prebufferMs: 300,
    retry: { reconnectTimeoutMs: 300000, reconnectMaxMs: 1000 },
  });
  await gw.connect();
  window.gw = gw;
  window.events = [];
  window.audioBySegment = {};
  for (const k of ["disconnected", "reconnecting", "reconnected", "resumed", "audioresumed", "gaveup", "close"]) {
    gw.addEventListener(k, (e) => window.events.push({ type: k, detail: e.detail }));
  }
  window.result = null;
  window.failure = null;
  gw.speak(text).then((r) => (window.result = r), (e) => (window.failure = String(e)));
  return true;
}
"""

STATE_JS = """
() => {
  const u = window.gw._utterances[0];
  return {
    plays: u ? u.plays.map((p) => ({ ...p })) : [],
    result: window.result,
    failure: window.failure,
    events: window.events,
    consumed: window.gw._consumed,
    lastOutage: window.gw.lastOutage,
  };
}
"""


def _words(text: str) -> list[str]:
    return text.split()


async def test_gateway_restart_mid_answer_resumes_playback(browser: Any,
                                                          restartable_gateway: RestartableGateway) -> None:
    gw = restartable_gateway
    gw.ensure_up()
    page = await browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))
    try:
        await page.goto(gw.url + "/")
        await page.evaluate(START_JS, {"text": ANSWER})
        deadline = time.monotonic() + 120
        while True:
            st = await page.evaluate(STATE_JS)
            if any(p["segment"] >= 1 and p["samples"] > 0 for p in st["plays"]):
                break
            assert st["result"] is None, f"the whole answer played before the kill: {st}"
            assert time.monotonic() < deadline, f"no second segment: {st}"
            await asyncio.sleep(0.05)
        t_kill = time.monotonic()
        gw.kill()
        await asyncio.to_thread(gw.start)
        restart_s = time.monotonic() - t_kill
        deadline = time.monotonic() + 240
        while True:
            st = await page.evaluate(STATE_JS)
            if st["result"] is not None or st["failure"] is not None:
                break
            assert time.monotonic() < deadline, f"the answer did not finish after the restart: {st}"
            await asyncio.sleep(0.1)
    finally:
        await page.close()
    assert not errors, errors
    assert st["failure"] is None, st
    res = st["result"]
    kinds = [e["type"] for e in st["events"]]
    assert res["status"] == "ok" and res["resumes"] == 1, (res, kinds)
    assert kinds[0] == "disconnected" and "reconnected" in kinds and "resumed" in kinds and "audioresumed" in kinds, kinds
    assert "gaveup" not in kinds and "close" not in kinds, kinds
    outage = st["lastOutage"]
    assert outage and outage["gapMs"] >= 0 and outage["toAudioMs"] >= 0, outage
    resumed = next(e for e in st["events"] if e["type"] == "audioresumed")["detail"]
    assert resumed == outage, (resumed, outage)
    # every segment delivered whole exactly once, in order, played through, and together the answer
    whole = [p for p in res["plays"] if p["complete"] and p["samples"] > 0]
    idx = [p["segment"] for p in whole]
    assert idx == sorted(set(idx)), f"a segment twice or out of order: {idx}"
    assert idx == sorted({p["segment"] for p in res["plays"] if p["samples"] > 0}), res["plays"]
    assert all(p["startPos"] + p["samples"] <= st["consumed"] for p in whole), (whole, st["consumed"])
    assert _words(" ".join(p["text"] for p in whole)) == _words(ANSWER), [p["text"] for p in whole]
    print(f"[reliability] browser-client-resume: segments={len(idx)}, gateway_restart_s={restart_s:.1f}, "
          f"outage_ms={outage['outageMs']}, reconnected_to_audio_ms={outage['toAudioMs']}, "
          f"gap_ms={outage['gapMs']}, attempts={outage['attempts']}", file=sys.stderr)

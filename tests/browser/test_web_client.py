"""The browser client (clients/web/) in headless Debian chromium against the real gateway.

Headless chromium renders audio into a timer-driven fake sink at 1.00x wall time, so the
AudioWorklet plays (and reports) in real time like on a sound card.
"""

from __future__ import annotations

import asyncio
import os
import urllib.request
from typing import Any

import pytest

from tests.browser.conftest import engine_kind

pytestmark = pytest.mark.browser

# The client's prebuffer target: the page's 80 ms, or 300 ms for ChatTTS-on-vLLM on CPU, whose
# first chunks (6 steps = 128 ms, then growing) come slower than real time on a busy 2-core
# machine (measured: 80 ms -> 1-11 underruns per utterance, 300 ms -> none).
# VOICEGW_BROWSER_PREBUFFER_MS overrides.
PREBUFFER_MS = int(os.environ.get("VOICEGW_BROWSER_PREBUFFER_MS") or (300 if engine_kind() == "vllm" else 80))
# Underruns tolerated per utterance: 0 for the engines that are many times faster than real time
# (espeak, fake); 1 for ChatTTS on CPU (vLLM or reference), whose GPT, decoder and this browser
# share 2 cores: the tiny model runs ~2.3x real time alone, but a stall of the host (measured:
# reports frozen 2.4 s while g++ compiled a vLLM kernel, fixed by the engine's warm-up) or a
# long random-checkpoint segment generated beside the next one can still cost one underrun in
# a full CI run (seen in about 1 of 2 runs before this allowance, never 2 in one utterance).
# VOICEGW_BROWSER_MAX_UNDERRUNS overrides.
MAX_UNDERRUNS = int(os.environ.get("VOICEGW_BROWSER_MAX_UNDERRUNS")
                    or (1 if engine_kind() in ("vllm", "reference") else 0))
# A sanity bound on time-to-first-audio (not a latency target). ChatTTS on vLLM on 2 CPU cores
# runs exact decoding (52 steps of lookahead) beside chromium's resampling: 2.6 s was seen once in
# a CI run with a 48 kHz context, while the same test took ~1 s in other runs.
TTFA_BOUND_MS = 5000 if engine_kind() in ("vllm", "reference") else 2000
#: Engines whose audio length follows the text (a random-weight ChatTTS checkpoint stops at random).
PREDICTABLE = engine_kind() in ("espeak", "fake")

TEXT = "Hello there! This is the browser client speaking. It plays audio while text still arrives."

# Connect a VoiceGateway in the page, speak, and return what the client and the worklet saw.
SPEAK_JS = """
async ({text, opts, tokens, msPerToken}) => {
  const { VoiceGateway } = await import("/voicegw.js");
  const gw = new VoiceGateway(undefined, opts);
  const session = await gw.connect();
  window.gw = gw;
  const reports = [];
  gw.addEventListener("report", (e) => reports.push(e.detail));
  const t0 = performance.now();
  const timeline = [];  // for failure messages: when segments started and underruns happened
  const note = (k) => (e) => timeline.push([Math.round(performance.now() - t0), k, e.detail.segment ?? e.detail.playedSamples ?? e.detail.ms]);
  for (const k of ["segment", "ttfa", "playing", "underrun"]) gw.addEventListener(k, note(k));
  let source = text;
  if (tokens) {
    source = (async function* () {
      for (const w of text.match(/\\s*\\S+/g)) {
        await new Promise((r) => setTimeout(r, msPerToken));
        yield w;
      }
    })();
  }
  const result = await gw.speak(source);
  // speak() resolves once every sample is consumed; the worklet flags the drain on its next
  // render quantum: wait for that report
  if (!reports.some((r) => r.drained)) {
    await Promise.race([
      new Promise((res) => gw.addEventListener("drained", res, { once: true })),
      new Promise((res) => setTimeout(res, 1000)),
    ]);
  }
  const last = reports[reports.length - 1];
  const stats = { ...gw.stats };
  const contextRate = gw.contextSampleRate;
  await gw.close();
  return { session, result, last, stats, contextRate, nReports: reports.length, timeline };
}
"""


def _http_get(url: str) -> tuple[int, str, bytes]:
    with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - local test server
        return r.status, r.headers.get("Content-Type", ""), r.read()


async def test_static_files_served(gateway: Any) -> None:
    status, ctype, body = await asyncio.to_thread(_http_get, gateway.url + "/")
    assert status == 200 and ctype.startswith("text/html") and b"voicegw" in body
    for name in ("voicegw.js", "player-worklet.js", "protocol.js", "demo.js"):
        status, ctype, _ = await asyncio.to_thread(_http_get, f"{gateway.url}/{name}")
        assert status == 200 and ctype.startswith("text/javascript"), (name, ctype)


def _check_clean_run(out: dict[str, Any]) -> None:
    r, last, stats = out["result"], out["last"], out["stats"]
    assert r["status"] == "ok", r
    assert r["samples"] > 0 and r["samples"] == r["serverSamples"], r
    # the worklet played exactly what the server sent, with no underrun
    assert last["drained"] is True
    assert last["playedSamples"] == r["serverSamples"] == stats["receivedSamples"], (last, r)
    assert last["underruns"] <= MAX_UNDERRUNS and stats["underruns"] == last["underruns"], (last, out["timeline"])
    assert r["ttfaMs"] is not None and 0 < r["ttfaMs"] < TTFA_BOUND_MS, r
    assert out["nReports"] >= 2


@pytest.mark.parametrize(
    ("rate", "context_rate"),
    [(24_000, None), (24_000, 48_000), (16_000, 44_100)],
    ids=["24k-native", "24k-in-48k-context-resampled", "16k-in-44.1k-context-resampled"],
)
async def test_played_equals_sent_no_underruns(page: Any, gateway: Any, rate: int, context_rate: int | None) -> None:
    await page.goto(gateway.url + "/")
    opts: dict[str, Any] = {"sampleRate": rate, "prebufferMs": PREBUFFER_MS}
    if context_rate:
        opts["contextSampleRate"] = context_rate
    out = await page.evaluate(SPEAK_JS, {"text": TEXT, "opts": opts, "tokens": False, "msPerToken": 0})
    assert out["contextRate"] == (context_rate or rate)
    _check_clean_run(out)
    # played time matches audio length (real-time playback, not a dump)
    assert out["result"]["durationMs"] > 1000
    # the gateway got playback reports and its flow accounting agrees
    await _assert_server_saw_reports(gateway)


async def _assert_server_saw_reports(gateway: Any) -> None:
    for _ in range(50):  # the connection closes right after speak(): reports were already in
        if not gateway.connections:
            break
        await asyncio.sleep(0.02)
    metrics = gateway.metrics.render().decode()
    assert "voicegw" in metrics


async def test_llm_token_stream(page: Any, gateway: Any) -> None:
    await page.goto(gateway.url + "/")
    out = await page.evaluate(
        SPEAK_JS,
        {"text": TEXT, "opts": {"sampleRate": 24_000, "prebufferMs": PREBUFFER_MS}, "tokens": True, "msPerToken": 30},
    )
    _check_clean_run(out)


async def test_cancel_silences_within_100ms(page: Any, gateway: Any, speech_engine: Any) -> None:
    await page.goto(gateway.url + "/")
    long_text = " ".join([TEXT] * 8)
    out = await page.evaluate(
        """
        async (text) => {
          const { VoiceGateway } = await import("/voicegw.js");
          const gw = new VoiceGateway(undefined, { sampleRate: 24000 });
          await gw.connect();
          // tap the player's output: an analyser over ~10 ms windows
          const an = new AnalyserNode(gw.ctx, { fftSize: 256 });
          gw.node.connect(an);
          const buf = new Float32Array(an.fftSize);
          const peak = () => { an.getFloatTimeDomainData(buf); return buf.reduce((m, x) => Math.max(m, Math.abs(x)), 0); };
          const speaking = gw.speak(text);
          // wait until it has played ~1 s and is audible
          await new Promise((resolve) => {
            const h = (e) => { if (e.detail.playedSamples > 24000) { gw.removeEventListener("report", h); resolve(); } };
            gw.addEventListener("report", h);
          });
          let loud = 0;
          for (let i = 0; i < 50 && loud < 1e-3; i++) { loud = Math.max(loud, peak()); await new Promise((r) => setTimeout(r, 5)); }
          const t0 = performance.now();
          const reply = gw.cancel();
          let silentAt = null;
          while (performance.now() - t0 < 1000) {
            if (peak() === 0) { silentAt = performance.now() - t0; break; }
            await new Promise((r) => setTimeout(r, 1));
          }
          const cancelled = await reply;
          const replyMs = performance.now() - t0;
          const result = await speaking;
          const playedAtCancel = gw.stats.playedSamples;
          // nothing more plays after the cancel
          await new Promise((r) => setTimeout(r, 600));
          const after = { ...gw.stats, peak: peak() };
          await gw.close();
          return { loud, silentAt, replyMs, cancelled, result, playedAtCancel, after };
        }
        """,
        long_text,
    )
    assert out["loud"] > 1e-3, "audio must be audible before the cancel"
    assert out["silentAt"] is not None and out["silentAt"] < 100, out["silentAt"]
    assert out["result"]["cancelled"] is True and out["result"]["status"] == "cancelled"
    c = out["cancelled"]
    assert c["type"] == "cancelled" and c["utterance_id"] == out["result"]["utteranceId"]
    assert 0 < c["played_ms"] < c["sent_ms"] <= c["generated_ms"] + 1e-6
    # (a random checkpoint's segment may run long: the first word may not be complete yet)
    assert (c["heard_text"] or not PREDICTABLE) and long_text.startswith(c["heard_text"]), c
    assert out["after"]["playedSamples"] == out["playedAtCancel"], "playback continued after cancel"
    assert out["after"]["peak"] == 0
    # the engine stopped generating
    for _ in range(100):
        if speech_engine.health().running_requests == 0:
            break
        await asyncio.sleep(0.02)
    assert speech_engine.health().running_requests == 0


async def test_speak_again_after_cancel(page: Any, gateway: Any) -> None:
    await page.goto(gateway.url + "/")
    out = await page.evaluate(
        """
        async ({ text, prebufferMs }) => {
          const { VoiceGateway } = await import("/voicegw.js");
          const gw = new VoiceGateway(undefined, { sampleRate: 24000, prebufferMs });
          await gw.connect();
          const first = gw.speak(text + " " + text);
          await new Promise((resolve) => gw.addEventListener("playing", resolve, { once: true }));
          await new Promise((r) => setTimeout(r, 300));
          gw.cancel();
          const second = await gw.speak("Second utterance after the barge-in.");  // sent right away
          const r1 = await first;
          const s = { ...gw.stats };
          await gw.close();
          return { r1, second, s };
        }
        """,
        {"text": TEXT, "prebufferMs": PREBUFFER_MS},
    )
    # (a random checkpoint may end the first utterance before the cancel)
    assert out["r1"]["cancelled"] is True or (not PREDICTABLE and out["r1"]["status"] == "ok"), out["r1"]
    r2 = out["second"]
    assert r2["status"] == "ok" and r2["samples"] == r2["serverSamples"] > 0, r2
    assert r2["underruns"] <= MAX_UNDERRUNS, r2


async def test_demo_page_shows_ttfa(page: Any, gateway: Any) -> None:
    await page.goto(f"{gateway.url}/?prebuffer={PREBUFFER_MS}")
    await page.wait_for_function("window.voicegwDemo && window.voicegwDemo.ready")
    await page.fill("#text", "Short demo sentence. Another one.")
    await page.click("#speak")
    await page.wait_for_function("window.voicegwDemo.results.length >= 1", timeout=20_000)
    ttfa = await page.text_content("#ttfa")
    assert ttfa is not None and ttfa.strip().isdigit(), ttfa
    result = await page.evaluate("window.voicegwDemo.results[0]")
    assert result["status"] == "ok" and abs(int(ttfa) - result["ttfaMs"]) <= 1
    underruns = int(await page.text_content("#underruns") or "-1")
    if underruns > MAX_UNDERRUNS:
        events = await page.evaluate(
            "window.voicegwDemo.events.map(e => e.type == 'report' ? [Math.round(e.t), 'r', Math.round(e.detail.bufferedMs), e.detail.receivedSamples, e.detail.playedSamples] : [Math.round(e.t), e.type, JSON.stringify(e.detail)])")
        log = await page.text_content("#log")
        raise AssertionError(f"{underruns} underruns; result {result}; events {events}; log {log}")
    played, received = (await page.text_content("#samples") or "").split(" / ")
    assert int(played) == int(received) == result["samples"]

    # simulated LLM token stream through the page's button
    await page.click("#simulate")
    await page.wait_for_function("window.voicegwDemo.results.length >= 2", timeout=20_000)
    assert (await page.evaluate("window.voicegwDemo.results[1].status")) == "ok"


async def test_demo_stream_as_i_type_and_stop(page: Any, gateway: Any) -> None:
    await page.goto(f"{gateway.url}/?prebuffer={PREBUFFER_MS}")
    await page.wait_for_function("window.voicegwDemo && window.voicegwDemo.ready")
    await page.fill("#text", "")
    await page.check("#stream-typing")
    await page.focus("#text")
    await page.keyboard.type("Typing streams text to the gateway as it is typed.", delay=15)
    await page.keyboard.press("Enter")
    await page.wait_for_function("window.voicegwDemo.results.length >= 1", timeout=20_000)
    r = await page.evaluate("window.voicegwDemo.results[0]")
    assert r["status"] == "ok" and r["samples"] > 0

    # speak a long text, then barge in with the stop button
    await page.uncheck("#stream-typing")
    long_text = " ".join([TEXT] * 5)
    await page.fill("#text", long_text)
    base = await page.evaluate("window.voicegwDemo.gw.stats.playedSamples")
    await page.click("#speak")
    # 1.25 s played, or (a random checkpoint may stop early) the utterance already over
    await page.wait_for_function(f"window.voicegwDemo.gw.stats.playedSamples > {base} + 30000"
                                 " || window.voicegwDemo.results.length >= 2", timeout=20_000)
    await page.click("#stop")
    await page.wait_for_function("window.voicegwDemo.lastCancel", timeout=5_000)
    heard = await page.text_content("#heard")
    assert (heard or not PREDICTABLE) and long_text.startswith(heard or ""), heard
    await page.wait_for_function("window.voicegwDemo.results.length >= 2", timeout=5_000)
    status = await page.evaluate("window.voicegwDemo.results[1].status")
    reply = await page.evaluate("window.voicegwDemo.lastCancel.reply")
    if PREDICTABLE or reply["cancelled_utterances"]:
        assert status == "cancelled", (status, reply)
    else:  # a random checkpoint may have finished the utterance before the click
        assert status == "ok", (status, reply)


async def test_stop_during_token_stream_stops_reading_and_opens_nothing(page: Any, gateway: Any) -> None:
    """Stop while an LLM token stream is still arriving: the source is no longer read, no new
    utterance opens with the rest of the text, speak() resolves "cancelled", and nothing is
    rendered from 100 ms after the stop on."""
    await page.goto(gateway.url + "/")
    long_text = " ".join([TEXT] * 8)
    out = await page.evaluate(
        """
        async (text) => {
          const { VoiceGateway } = await import("/voicegw.js");
          const gw = new VoiceGateway(undefined, { sampleRate: 24000 });
          await gw.connect();
          const an = new AnalyserNode(gw.ctx, { fftSize: 256 });
          gw.node.connect(an);
          const buf = new Float32Array(an.fftSize);
          const peak = () => { an.getFloatTimeDomainData(buf); return buf.reduce((m, x) => Math.max(m, Math.abs(x)), 0); };
          let stopped = false, yieldedAfterStop = 0, yielded = 0;
          const words = text.match(/\\s*\\S+/g);
          const source = (async function* () {
            for (const w of words) {
              await new Promise((r) => setTimeout(r, 60));
              if (stopped) yieldedAfterStop++;
              yielded++;
              yield w;
            }
          })();
          const sent = [];
          const send = gw._send.bind(gw);
          gw._send = (m) => { if (stopped) sent.push(m); return send(m); };
          const speaking = gw.speak(source);
          await new Promise((resolve) => {
            const h = (e) => { if (e.detail.playedSamples > 4800) { gw.removeEventListener("report", h); resolve(); } };
            gw.addEventListener("report", h);
          });
          stopped = true;
          const t0 = performance.now();
          await gw.cancel();
          while (performance.now() - t0 < 100) await new Promise((r) => setTimeout(r, 5));
          let loudAfter = 0;
          while (performance.now() - t0 < 1600) {
            loudAfter = Math.max(loudAfter, peak());
            await new Promise((r) => setTimeout(r, 5));
          }
          const result = await speaking;
          await gw.close();
          return { result, loudAfter, yieldedAfterStop, yielded, total: words.length,
                   sentAfterStop: sent.map((m) => m.type + (m.id ? ":new" : "")) };
        }
        """,
        long_text,
    )
    assert out["yielded"] < out["total"], "the stream ended before the stop: the test proves nothing"
    assert out["result"]["status"] == "cancelled" and out["result"]["cancelled"] is True, out["result"]
    assert out["loudAfter"] == 0, f"audio rendered from 100 ms after stop: peak {out['loudAfter']}"
    assert out["yieldedAfterStop"] <= 1, "the token source kept being read after stop"
    assert not [m for m in out["sentAfterStop"] if m.startswith("text.")], out["sentAfterStop"]


async def test_demo_page_says_when_the_gateway_is_unreachable(page: Any, gateway: Any) -> None:
    """Speak with the gateway down: the page says so (pill, alert line, log) instead of an
    uncaught promise rejection; the finished-utterance history is kept beside the live meters."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # nothing listens here once the socket is closed
    await page.goto(f"{gateway.url}/?url=ws://127.0.0.1:{dead}/ws")
    await page.wait_for_function("window.voicegwDemo && window.voicegwDemo.ready")
    await page.click("#speak")
    await page.wait_for_function("!document.getElementById('conn-error').hidden", timeout=10_000)
    assert "Cannot reach the gateway" in (await page.text_content("#conn-error") or "")
    assert (await page.text_content("#conn")) == "unreachable"
    assert "cannot connect" in (await page.text_content("#log") or "")
    # the browser itself logs the refused WebSocket; anything else (an uncaught rejection) fails
    page.errors[:] = [e for e in page.errors if "WebSocket connection to" not in e]
    assert not page.errors, page.errors

    # the real gateway: the history line keeps the finished utterance's figures
    await page.goto(f"{gateway.url}/?prebuffer={PREBUFFER_MS}")
    await page.wait_for_function("window.voicegwDemo && window.voicegwDemo.ready")
    await page.fill("#text", "Short demo sentence.")
    await page.click("#speak")
    await page.wait_for_function("window.voicegwDemo.results.length >= 1", timeout=20_000)
    history = await page.text_content("#history") or ""
    assert history.startswith("recent: ok · TTFA "), history


async def test_demo_page_says_when_the_voice_is_refused(page: Any, gateway: Any, speech_engine: Any) -> None:
    """A custom voice the engine cannot use (issue 34 item 8): ``session.start`` is refused
    ``invalid_field`` on ``voice``, and the page says so (pill, alert line), with no uncaught
    rejection and no utterance (it used to be accepted, then fail with ``engine_error``)."""
    if speech_engine.check_voice("not a speaker") is None:
        pytest.skip(f"{speech_engine.name} takes any voice string")
    await page.goto(f"{gateway.url}/?voice=not%20a%20speaker&prebuffer={PREBUFFER_MS}")
    await page.wait_for_function("window.voicegwDemo && window.voicegwDemo.ready")
    await page.fill("#text", "Short demo sentence.")
    await page.click("#speak")
    await page.wait_for_function("!document.getElementById('conn-error').hidden", timeout=20_000)
    assert "cannot use this voice" in (await page.text_content("#conn-error") or "")
    assert (await page.text_content("#conn")) == "voice refused"
    log = await page.text_content("#log") or ""
    assert "voice refused" in log and "NaN" not in log, log
    assert await page.evaluate("window.voicegwDemo.results.length") == 0
    assert not page.errors, page.errors


async def test_demo_page_state_follows_the_audio(page: Any, gateway: Any) -> None:
    """Issue 34 item 9: the page connects on load (the pill says so before any click); the
    "speaking:" caption is cleared once playback ends; a stop reports what was heard (the played
    part, not everything received); a connection dropped while nothing played counts no gap heard."""
    await page.goto(f"{gateway.url}/?prebuffer={PREBUFFER_MS}")
    await page.wait_for_function("window.voicegwDemo && window.voicegwDemo.ready")
    await page.wait_for_function("document.getElementById('conn').textContent === 'connected'", timeout=30_000)
    assert await page.evaluate("window.voicegwDemo.results.length") == 0  # connected, nothing spoken

    await page.fill("#text", "The first sentence is here. And here comes the second one.")
    await page.click("#speak")
    await page.wait_for_function("window.voicegwDemo.results.length >= 1", timeout=30_000)
    await page.wait_for_function("document.getElementById('segment-text').textContent === ''", timeout=5_000)

    await page.fill("#text", "This answer is long enough to be stopped while it plays. " * 4)
    await page.click("#speak")
    await page.wait_for_function("window.voicegwDemo.events.some(e => e.type == 'playing')", timeout=30_000)
    await page.wait_for_timeout(400)
    await page.click("#stop")
    await page.wait_for_function("window.voicegwDemo.results.length >= 2", timeout=30_000)
    r = await page.evaluate("window.voicegwDemo.results[1]")
    assert r["status"] == "cancelled" and 0 < r["playedMs"] < r["durationMs"], r
    assert f"spoken: {round(r['playedMs'])} of {round(r['durationMs'])} ms heard" in (await page.text_content("#log") or "")

    # dropped while idle (the server restarts the connection: 1012), then spoken again: no gap was heard
    await page.wait_for_timeout(300)
    for conn in list(gateway.connections):
        await conn.ws.close(1012, "restart")
    await page.wait_for_function("window.voicegwDemo.events.some(e => e.type == 'reconnected')", timeout=30_000)
    await page.wait_for_timeout(1000)
    await page.fill("#text", "Spoken after the drop.")
    await page.click("#speak")
    await page.wait_for_function("window.voicegwDemo.results.length >= 3", timeout=30_000)
    gap = await page.evaluate("window.voicegwDemo.lastOutage ? window.voicegwDemo.lastOutage.gapMs : 0")
    assert gap == 0, gap
    assert not page.errors, page.errors


async def test_demo_caption_follows_the_playhead(page: Any, gateway: Any) -> None:
    """The "speaking:" caption changes when the player reaches the segment, not when the server
    starts sending it (it used to run ~2 s ahead of the audio)."""
    await page.goto(f"{gateway.url}/?prebuffer={PREBUFFER_MS}")
    await page.wait_for_function("window.voicegwDemo && window.voicegwDemo.ready")
    await page.fill("#text", "The first sentence is here. And here comes the second one.")
    await page.click("#speak")
    await page.wait_for_function("window.voicegwDemo.results.length >= 1", timeout=30_000)
    log = await page.evaluate("window.voicegwDemo.captionLog")
    segments = await page.evaluate("window.voicegwDemo.events.filter(e => e.type == 'segment').length")
    assert len(log) == segments >= 2, (log, segments)
    assert all(c["consumed"] >= c["at"] for c in log), log
    assert log[1]["at"] > 0, "the second caption waits for its audio"


def _typed_utterances(sent: list[dict[str, Any]]) -> list[str]:
    """The texts of the utterances the page opened, from its ``text.delta`` messages (an opening
    delta carries an ``id``)."""
    out: list[str] = []
    for m in sent:
        if m["type"] == "text.delta":
            if "id" in m:
                out.append("")
            out[-1] += m["text"]
    return out


async def test_demo_stream_as_i_type_edits_respeak_the_tail_once(page: Any, gateway: Any) -> None:
    """Issue 34 item 7, "stream as I type": text typed at the end streams into one utterance;
    each burst of edits of text already sent (backspaces, typing over a selection, a paste, a
    deleted word) stops the audio once and, once the edits settle, speaks the tail once, from
    the edit point (or the first character not heard) to the end. The spoken text (each
    utterance's text laid at its offset, later ones replacing what follows them) is the final
    text; nothing is refused and no promise is left rejected."""
    await page.goto(f"{gateway.url}/?prebuffer={PREBUFFER_MS}")
    await page.wait_for_function("window.voicegwDemo && window.voicegwDemo.ready")
    await page.fill("#text", "")
    await page.check("#stream-typing")
    await page.wait_for_function("window.voicegwDemo.gw && window.voicegwDemo.gw.session")
    await page.evaluate(
        """() => {
          const gw = window.voicegwDemo.gw;
          window.sentLog = [];
          const send = gw._send.bind(gw);
          gw._send = (m) => { window.sentLog.push(m); return send(m); };
        }"""
    )
    await page.focus("#text")
    await page.keyboard.type("The weather on Tuesday is sunny, with a light breeze", delay=5)
    opened = [len(_typed_utterances(await page.evaluate("window.sentLog")))]

    async def burst() -> None:
        """The burst's tail goes out once the edits settle (the page's EDIT_SETTLE_MS, 600 ms, then
        its cancel's reply): wait for one more utterance, then make sure no second one follows."""
        want = opened[-1] + 1
        await page.wait_for_function(
            f"window.voicegwDemo.typedLog.length >= {want}", timeout=15_000)
        await page.wait_for_timeout(800)
        opened.append(len(_typed_utterances(await page.evaluate("window.sentLog"))))

    # 1. five backspaces at the end, then more typing in the same burst
    for _ in range(5):
        await page.keyboard.press("Backspace")
    await page.keyboard.type("wind", delay=5)
    await burst()
    # 2. type over a selection ("Tuesday" -> "Friday")
    await page.evaluate("""() => { const el = document.getElementById('text');
                             const i = el.value.indexOf('Tuesday'); el.setSelectionRange(i, i + 7); }""")
    await page.keyboard.type("Friday", delay=5)
    await burst()
    # 3. a paste in the middle
    await page.evaluate("""() => { const el = document.getElementById('text');
                             const i = el.value.indexOf(' is '); el.setSelectionRange(i, i); }""")
    await page.keyboard.insert_text(" morning")
    await burst()
    # 4. delete a word (Ctrl+Backspace after "weather")
    await page.evaluate("""() => { const el = document.getElementById('text');
                             const i = el.value.indexOf('weather') + 7; el.setSelectionRange(i, i); }""")
    await page.keyboard.press("Control+Backspace")
    await burst()
    await page.keyboard.press("End")
    await page.keyboard.type(" today.", delay=5)
    await page.keyboard.press("Enter")

    final = await page.input_value("#text")
    log = await page.evaluate("window.voicegwDemo.typedLog")
    spoken = ""
    for u in log:
        spoken = spoken[: u["start"]] + u["text"]
    assert spoken.rstrip() == final.rstrip(), (spoken, final, log)
    # one utterance typed, then one re-spoken tail per edit burst
    assert opened == [1, 2, 3, 4, 5], (opened, log)
    wire = _typed_utterances(await page.evaluate("window.sentLog"))
    assert [w.rstrip() for w in wire] == [u["text"].rstrip() for u in log], (wire, log)
    assert "Friday" in log[2]["text"] and "Tuesday" not in log[2]["text"], log
    errors = await page.evaluate("window.voicegwDemo.events.filter(e => e.type == 'error').map(e => e.detail.code)")
    assert not errors, errors
    assert not page.errors, page.errors


async def test_overload_is_retried_after_the_hinted_wait(browser: Any, speech_engine: Any) -> None:
    """One engine batch slot (engine.max_num_seqs = 1, admission on), held by another session: the
    page's utterance is refused with engine_overloaded; the client waits about retry_after_ms
    (capped), tries again once the slot is free, and speaks it (``result.attempts`` >= 2)."""
    import dataclasses

    from gateway.server import GatewayServer
    from tests.transcript import Transcript, quiet_client
    from voicegw.config import Config, EngineConfig, GatewayConfig, SchedulerConfig

    config = Config(gateway=GatewayConfig(host="127.0.0.1", port=0),
                    engine=dataclasses.replace(EngineConfig(), max_num_seqs=1),
                    scheduler=dataclasses.replace(SchedulerConfig(), ttfa_target_ms=50.0, admission=True))
    # the one slot must be free first: the session's shared engine may still be finishing (or aborting)
    # what earlier tests left, and admission control counts the engine's requests, not this server's
    for _ in range(300):
        if speech_engine.health().running_requests == 0:
            break
        await asyncio.sleep(0.1)
    server = GatewayServer(config, speech_engine)
    await server.start()
    pg = await browser.new_page()
    try:
        bt = Transcript()
        busy = quiet_client(server.ws_url, bt)  # never reports playback: its stream holds the slot
        await busy.connect()
        busy.speak("This answer goes on for quite a while, sentence after sentence, holding the slot. " * 6)
        await bt.wait_for("segment.started", within_s=60)
        await pg.goto(server.url + "/")
        await pg.evaluate("""
          async () => {
            const { VoiceGateway } = await import("/voicegw.js");
            const gw = new VoiceGateway(undefined, { prebufferMs: 300, retry: { overloadAttempts: 20, overloadMaxWaitMs: 1500 } });
            await gw.connect();
            window.retries = [];
            gw.addEventListener("retry", (e) => window.retries.push(e.detail));
            window.done = gw.speak("Hello there, may I speak now?");
          }
        """)
        await pg.wait_for_function("window.retries.length > 0", timeout=60_000)
        await busy.cancel()  # the slot frees while the page waits
        out = await asyncio.wait_for(pg.evaluate("(async () => ({ r: await window.done, retries: window.retries }))()"), 120)
        await busy.close()
    finally:
        await pg.close()
        await server.shutdown(grace_s=0.5)
    r, retries = out["r"], out["retries"]
    assert r["status"] == "ok" and r["samples"] > 0 and r["attempts"] == len(retries) + 1 >= 2, out
    assert all(0 < x["waitMs"] <= 1500 for x in retries), retries

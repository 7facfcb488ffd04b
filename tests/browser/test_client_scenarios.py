"""The browser client's decisions against the shared scenario table, in chromium.

``clients/scenarios.json`` (also run against the Python core by tests/test_client_core.py) is
loaded into the page and fed to the browser client's decision functions: ``client-core.js``
(overload retry, final refusals, reconnect backoff and give-up, resume planning) and
``playout-rules.js`` (the jitter-buffer rules the AudioWorklet player runs). The page's files are
served from ``clients/web`` by a plain HTTP server (no gateway or engine needed); the worklet
itself is loaded too, to check that it runs on the shared rules.
"""

from __future__ import annotations

import functools
import http.server
import json
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.test_client_core import SCENARIOS, TABLE, expected, same

pytestmark = pytest.mark.browser

WEB = Path(__file__).resolve().parents[2] / "clients" / "web"

RUN_JS = """
async (table) => {
  const core = await import("/client-core.js");
  const rules = await import("/playout-rules.js");
  const rand = (scn) => { const r = scn.random && scn.random.length ? scn.random : [0.5]; let i = 0; return () => r[i++ % r.length]; };
  const policy = (scn) => core.policyFromJson({ ...table.defaults.policy, ...(scn.policy || {}) });
  const results = {};
  for (const scn of table.scenarios) {
    const out = [];
    if (scn.kind === "overload") {
      const p = policy(scn), rnd = rand(scn);
      for (const ev of scn.events) {
        out.push(core.overloadDecision(p, ev.error, { attempts: ev.attempts, receivedSamples: ev.received_samples,
                                                      nowMs: ev.t_ms, rand: rnd, cancelled: ev.cancelled }));
      }
    } else if (scn.kind === "reconnect") {
      const rec = new core.Reconnector(policy(scn), rand(scn));
      for (const ev of scn.events) {
        if ("lost" in ev) out.push(rec.lost(ev.lost, ev.t_ms));
        else if ("failed" in ev) out.push(rec.failed(ev.failed, ev.t_ms));
        else out.push(rec.connected(ev.t_ms));
      }
    } else if (scn.kind === "resume") {
      const segs = new Map(scn.segments.map((s) => [s.index, { startChar: s.start_char, endChar: s.end_char,
        sampleOffset: s.sample_offset, play: { samples: s.samples }, done: s.done, pos: s.pos,
        codeFrames: s.code_frames || 0 }]));
      out.push(core.planResume(segs, { segBase: scn.seg_base, baseChar: scn.base_char, sampleBase: scn.sample_base,
        mode: scn.mode || "segment", rateHz: scn.rate_hz || 24000 }));
    } else if (scn.kind === "playout") {
      const c = scn.playout;
      const p = new rules.Playout(c.rate_hz, { prebufferMs: c.prebuffer_ms, stepMs: c.step_ms, maxTargetMs: c.max_target_ms });
      for (const op of scn.ops) {
        const got = {};
        if (op.op === "push") p.push(op.n);
        else if (op.op === "end") p.end();
        else if (op.op === "pull") [got.got, got.drained] = p.pull(op.n);
        else if (op.op === "cancel") p.cancel();
        else if (op.op === "truncate") p.truncate(op.keep);
        Object.assign(got, { state: p.state, played: p.played, buffered: p.buffered, underruns: p.underruns,
                             target_ms: p.targetMs, drains: p.drains });
        out.push(Object.fromEntries(Object.keys(op.expect || {}).map((k) => [k, got[k]])));
      }
    }
    results[scn.name] = out;
  }
  return results;
}
"""

WORKLET_JS = """
async () => {
  const ctx = new AudioContext({ sampleRate: 24000, latencyHint: "interactive" });
  await ctx.audioWorklet.addModule("/player-worklet.js");
  const node = new AudioWorkletNode(ctx, "voicegw-player", {
    numberOfInputs: 0, numberOfOutputs: 1, outputChannelCount: [1],
    processorOptions: { streamRate: 24000, prebufferMs: 80, maxTargetMs: 300, reportIntervalMs: 50 },
  });
  node.connect(ctx.destination);
  await ctx.resume();
  const msgs = [];
  node.port.onmessage = (e) => msgs.push(e.data);
  const send = (n) => { const b = new ArrayBuffer(16 + 2 * n); new DataView(b).setUint8(0, 1); node.port.postMessage(b, [b]); };
  const waitFor = (pred, ms = 3000) => new Promise((resolve, reject) => {
    const t0 = performance.now();
    const tick = () => { const m = msgs.find(pred); if (m) return resolve(m);
      if (performance.now() - t0 > ms) return reject(new Error("timeout")); setTimeout(tick, 5); };
    tick();
  });
  send(960);                                  // 40 ms < 80 ms: waits
  await new Promise((r) => setTimeout(r, 150));
  const early = msgs.some((m) => m.type === "started");
  send(2400);                                 // starts, runs dry: underrun, target 100
  const u = await waitFor((m) => m.type === "underrun");
  send(480); node.port.postMessage({ type: "end" });   // complete below target: plays, drains
  const d = await waitFor((m) => m.type === "report" && m.drained);
  await ctx.close();
  return { early, underruns: u.underruns, targetMs: u.targetMs, drainedUnderruns: d.underruns, played: d.playedSamples };
}
"""


class _Quiet(http.server.SimpleHTTPRequestHandler):
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map, ".js": "text/javascript"}

    def do_GET(self) -> None:  # noqa: N802 - the http.server name
        if self.path in ("/", "/favicon.ico"):  # a blank page to run the modules in; no icon
            body = b"<!doctype html><title>scenarios</title>" if self.path == "/" else b""
            self.send_response(200 if body else 204)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        super().do_GET()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def web_origin() -> Iterator[str]:
    """``clients/web`` over HTTP on 127.0.0.1 (a secure context, as AudioWorklet needs; no gateway)."""
    handler = functools.partial(_Quiet, directory=str(WEB))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


@pytest.fixture
async def web_page(browser: Any, web_origin: str) -> AsyncIterator[Any]:
    pg = await browser.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))
    pg.on("console", lambda m: errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
    await pg.goto(f"{web_origin}/")
    yield pg
    await pg.close()
    assert not errors, errors


async def test_browser_core_passes_the_scenario_table(web_page: Any) -> None:
    got = await web_page.evaluate(RUN_JS, json.loads(json.dumps(TABLE)))
    bad = []
    for scn in SCENARIOS:
        want = expected(scn)
        if not same(got.get(scn["name"]), want):
            bad.append(f"{scn['name']}:\n  got  {got.get(scn['name'])}\n  want {want}")
    assert not bad, f"{len(bad)} of {len(SCENARIOS)} scenarios differ in the browser:\n" + "\n".join(bad)


async def test_worklet_runs_on_the_shared_rules(web_page: Any) -> None:
    out = await web_page.evaluate(WORKLET_JS)
    assert out["early"] is False
    assert out["underruns"] == 1 and out["targetMs"] == 100
    assert out["drainedUnderruns"] == 1  # the drain at the utterance end is not an underrun
    assert out["played"] == 960 + 2400 + 480


async def test_browser_reconnect_honours_a_final_refusal(web_page: Any) -> None:
    """The JS shell carries out the core's reconnect decisions on real sockets: a session dropped
    with 1012 is reconnected; an attempt closed with 1008 before ``session.started`` (do not
    retry) ends the reconnecting at once (``gaveup``, reason ``final``), not at the deadline."""
    from websockets.asyncio.server import serve

    from gateway import protocol as P

    conns: list[int] = []

    async def handler(ws: Any) -> None:
        conns.append(len(conns) + 1)
        if len(conns) > 1:
            await ws.close(1008, "text rate abuse")
            return
        await ws.recv()  # session.start
        await ws.send(json.dumps({"type": "session.started", "session_id": "s1", "sample_rate": 24000}))
        await ws.close(1012, "server shutting down")

    async with serve(handler, "127.0.0.1", 0, subprotocols=[P.SUBPROTOCOL]) as server:  # type: ignore[list-item]
        port = next(iter(server.sockets)).getsockname()[1]
        out = await web_page.evaluate("""
          async (url) => {
            const { VoiceGateway } = await import("/voicegw.js");
            const gw = new VoiceGateway(url, { audio: false, retry: { reconnectInitialMs: 50, reconnectTimeoutMs: 60000 } });
            const events = [];
            for (const t of ["disconnected", "reconnecting", "reconnected", "gaveup", "close"]) {
              gw.addEventListener(t, (e) => events.push({ type: t, ...e.detail }));
            }
            const t0 = performance.now();
            await gw.connect();
            await new Promise((resolve) => gw.addEventListener("gaveup", resolve));
            return { events, ms: performance.now() - t0, closed: gw.closed };
          }
        """, f"ws://127.0.0.1:{port}/ws")
    types = [e["type"] for e in out["events"]]
    assert types[:3] == ["disconnected", "reconnecting", "gaveup"], out
    assert out["events"][2]["reason"] == "final" and out["closed"], out
    assert len(conns) == 2 and out["ms"] < 10_000, out

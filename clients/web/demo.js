// voicegw demo page: speak typed or simulated-LLM text, barge in, watch TTFA and buffer meters.
// Query parameters (handy for tests): ?rate=24000&contextRate=48000&prebuffer=80&voice=2222&token=...

import { VoiceGateway } from "./voicegw.js";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);

const MAX_EVENTS = 2000;

const demo = {
  gw: null,
  results: [],
  events: [], // the last MAX_EVENTS client events (tests read them for failure messages)
  lastTtfaMs: null,
  lastPlayStartMs: null,
  connecting: null,
  captionLog: [], // {text, at, consumed, t}: when each caption was shown (tests read it)
};
window.voicegwDemo = demo;

function log(line) {
  const el = $("log");
  const t = (performance.now() / 1000).toFixed(2);
  el.textContent += `${t}  ${line}\n`;
  el.scrollTop = el.scrollHeight;
}

function voiceValue() {
  const v = $("voice").value === "custom" ? $("voice-custom").value.trim() : $("voice").value;
  if (v === "") return undefined;
  return /^\d+$/.test(v) ? Number(v) : v;
}

function settingsKey() {
  return `${voiceValue()}|${$("rate").value}`;
}

const HISTORY_ITEMS = 5;

/** The page's feedback when the gateway cannot be reached: the pill, an alert line, the log. */
function showConnectError(err) {
  const msg = err && err.message ? err.message : String(err);
  const el = $("conn-error");
  if (err && err.code === "invalid_field" && err.detail && err.detail.field === "voice") {
    // the gateway is up but cannot use this voice (session.start refused)
    $("conn").textContent = "voice refused";
    $("conn").className = "pill off";
    el.textContent = "The gateway cannot use this voice: give a seed (a number) or a speaker embedding of its model.";
    el.hidden = false;
    log(`voice refused: ${msg}`);
    return;
  }
  $("conn").textContent = "unreachable";
  $("conn").className = "pill off";
  el.textContent = `Cannot reach the gateway (${msg}). Is \`voicegw serve\` running? Press a button to try again.`;
  el.hidden = false;
  log(`cannot connect: ${msg}`);
}

/** ensureConnected() for button handlers: null (and the page says why) when it fails. */
async function connectOrReport() {
  try {
    const gw = await ensureConnected();
    $("conn-error").hidden = true;
    return gw;
  } catch (err) {
    showConnectError(err);
    return null;
  }
}

async function ensureConnected() {
  if (demo.gw && !demo.gw.closed && demo.key === settingsKey()) {
    await demo.gw.resumeAudio();
    return demo.gw;
  }
  if (demo.connecting) return demo.connecting;
  demo.connecting = (async () => {
    if (demo.gw) await demo.gw.close();
    const opts = {
      sampleRate: Number($("rate").value),
      voice: voiceValue(),
      token: params.get("token") || undefined,
    };
    if (params.get("contextRate")) opts.contextSampleRate = Number(params.get("contextRate"));
    if (params.get("prebuffer")) opts.prebufferMs = Number(params.get("prebuffer"));
    const gw = new VoiceGateway(params.get("url") || undefined, opts);
    wire(gw);
    const session = await gw.connect();
    demo.gw = gw;
    demo.key = settingsKey();
    $("conn").textContent = "connected";
    $("conn").className = "pill on";
    $("engine").textContent = `engine ${session.engine} · ${session.sample_rate} Hz · context ${gw.contextSampleRate} Hz`;
    log(`session ${session.session_id} (${session.engine}, ${session.sample_rate} Hz)`);
    return gw;
  })();
  try {
    return await demo.connecting;
  } finally {
    demo.connecting = null;
  }
}

function wire(gw) {
  const record = (type) => (e) => {
    demo.events.push({ type, t: performance.now(), detail: e.detail });
    if (demo.events.length > MAX_EVENTS) demo.events.splice(0, demo.events.length - MAX_EVENTS);
  };
  for (const type of ["ttfa", "playing", "segment", "report", "utterancedone", "drained", "cancelled", "error", "close", "underrun",
    "retry", "disconnected", "reconnecting", "reconnected", "resumed", "audioresumed", "gaveup"]) {
    gw.addEventListener(type, record(type));
  }
  gw.addEventListener("ttfa", (e) => {
    demo.lastTtfaMs = e.detail.ms;
    $("ttfa").textContent = e.detail.ms == null ? "–" : Math.round(e.detail.ms);
    log(`utterance ${e.detail.utteranceId}: first audio after ${Math.round(e.detail.ms)} ms`);
  });
  gw.addEventListener("playing", (e) => {
    demo.lastPlayStartMs = e.detail.ms;
    $("playstart").textContent = e.detail.ms == null ? "–" : Math.round(e.detail.ms);
  });
  // Captions follow the playhead: a segment's text shows when the player reaches its first sample
  // (segment.started comes right before that sample arrives; the player reports how far into the
  // received stream it is, cancelled audio included), not when the server starts sending it.
  const captions = [];
  gw.addEventListener("segment", (e) => {
    captions.push({ at: gw.streamPosition, text: e.detail.text });
    if (captions.length > 64) captions.shift();
  });
  gw.addEventListener("report", (e) => {
    const consumed = e.detail.consumedSamples;
    while (captions.length && consumed != null && captions[0].at <= consumed) {
      const c = captions.shift();
      $("segment-text").textContent = c.text;
      demo.captionLog.push({ text: c.text, at: c.at, consumed, t: performance.now() });
      if (demo.captionLog.length > 64) demo.captionLog.shift();
    }
  });
  gw.addEventListener("cancelled", () => (captions.length = 0));
  // the player ran out of audio: nothing is speaking (the caption goes with the sound)
  gw.addEventListener("drained", () => ($("segment-text").textContent = ""));
  gw.addEventListener("report", (e) => {
    const d = e.detail;
    $("buffered").textContent = Math.round(d.bufferedMs);
    $("target").textContent = Math.round(d.targetMs);
    $("underruns").textContent = d.underruns;
    $("samples").textContent = `${d.playedSamples} / ${d.receivedSamples}`;
    const windowMs = (gw.session && gw.session.limits && gw.session.limits.flow_window_ms) || 2000;
    $("buffer-bar").style.width = `${Math.min(100, (100 * d.bufferedMs) / windowMs)}%`;
    $("target-mark").style.left = `${Math.min(100, (100 * d.targetMs) / windowMs)}%`;
  });
  gw.addEventListener("underrun", (e) => log(`underrun #${e.detail.underruns}, prebuffer target ${e.detail.targetMs} ms`));
  gw.addEventListener("utterancedone", (e) =>
    log(`utterance ${e.detail.utterance_id} ${e.detail.status}: ${e.detail.duration_ms} ms in ${e.detail.segments} segments`),
  );
  gw.addEventListener("cancelled", (e) => {
    $("segment-text").textContent = ""; // nothing is speaking after a stop
    $("heard").textContent = e.detail.heard_text || "";
    log(`cancelled: played ${e.detail.played_ms} of ${e.detail.sent_ms} ms sent`);
  });
  gw.addEventListener("error", (e) => log(`error ${e.detail.code}: ${e.detail.message}`));
  // riding out a bad minute: the pill and the log say what the connection goes through
  const pill = (text, cls) => {
    $("conn").textContent = text;
    $("conn").className = `pill ${cls}`;
  };
  gw.addEventListener("retry", (e) => log(`engine busy: trying again in ${e.detail.waitMs} ms (attempt ${e.detail.attempt})`));
  gw.addEventListener("disconnected", (e) => {
    pill("reconnecting…", "warn");
    log(`connection lost (${e.detail.code}): reconnecting`);
  });
  gw.addEventListener("reconnecting", (e) => {
    pill(`reconnecting… (attempt ${e.detail.attempt})`, "warn");
  });
  gw.addEventListener("reconnected", (e) => {
    while (captions.length && captions[captions.length - 1].at >= gw.streamPosition) captions.pop();
    pill("connected", "on");
    log(`reconnected after ${e.detail.outageMs} ms (${e.detail.attempts} attempts)`);
  });
  gw.addEventListener("resumed", (e) => log(`resuming ${e.detail.localId} from segment ${e.detail.fromSegment}`));
  gw.addEventListener("audioresumed", (e) => {
    demo.lastOutage = e.detail;
    log(`audio resumed ${e.detail.toAudioMs} ms after reconnecting; gap heard ${e.detail.gapMs} ms`);
  });
  gw.addEventListener("gaveup", () => pill("disconnected", "off"));
  gw.addEventListener("close", (e) => {
    $("conn").textContent = `closed ${e.detail.code}`;
    $("conn").className = "pill off";
    log(`connection closed ${e.detail.code} ${e.detail.reason || ""}`);
  });
}

function track(promise) {
  return promise
    .then((r) => {
      if (!r) return r;
      demo.results.push(r);
      // the meters above follow the utterance playing now; this line keeps the finished ones
      const done = demo.results.filter((x) => x.status !== "error").slice(-HISTORY_ITEMS).reverse();
      $("history").textContent =
        "recent: " +
        done
          .map((x) => `${x.status} · TTFA ${x.ttfaMs == null ? "–" : Math.round(x.ttfaMs)} ms · ${Math.round(x.playedMs)} ms`)
          .join("  |  ");
      const ttfa = r.ttfaMs == null ? "–" : `${Math.round(r.ttfaMs)} ms`;
      const heard = r.cancelled ? `${Math.round(r.playedMs)} of ${Math.round(r.durationMs)} ms heard` : `${Math.round(r.playedMs)} ms`;
      log(`spoken: ${heard}, status ${r.status}, ttfa ${ttfa}, underruns ${r.underruns}`);
      return r;
    })
    .catch((err) => {
      demo.results.push({ status: "error", error: String(err) });
      log(`failed: ${err.message || err}`);
    });
}

/** Split text the way an LLM streams it: words and word pieces, spaces attached in front. */
export function llmTokens(text) {
  const out = [];
  for (const word of text.match(/\s*\S+/g) || []) {
    for (let i = 0; i < word.length; i += 6) out.push(word.slice(i, i + 6));
  }
  return out;
}

/** An async token stream with LLM-like pacing (~20 tokens/s with jitter). */
export async function* simulatedLlm(text, msPerToken = 45) {
  for (const tok of llmTokens(text)) {
    await new Promise((r) => setTimeout(r, msPerToken * (0.5 + Math.random())));
    yield tok;
  }
}
demo.llmTokens = llmTokens;
demo.simulatedLlm = simulatedLlm;

// ---- buttons ------------------------------------------------------------------------------

$("voice").addEventListener("change", () => ($("voice-custom").hidden = $("voice").value !== "custom"));

$("speak").addEventListener("click", async () => {
  const gw = await connectOrReport();
  if (!gw) return;
  demo.pending = track(gw.speak($("text").value));
});

$("simulate").addEventListener("click", async () => {
  const gw = await connectOrReport();
  if (!gw) return;
  log("simulating an LLM token stream");
  demo.pending = track(gw.speak(simulatedLlm($("text").value)));
});

$("stop").addEventListener("click", async () => {
  if (!demo.gw) return;
  typed.sent = $("text").value;
  if (typed.burst) clearTimeout(typed.burst.timer);
  typed.burst = null;
  typed.open = false;
  typed.utts = [];
  const t0 = performance.now();
  const reply = await demo.gw.cancel();
  demo.lastCancel = { reply, ms: performance.now() - t0 };
});

// ---- stream as I type ----------------------------------------------------------------------

// Text typed at the end streams into the open utterance. An edit of text already sent (a
// deletion, typing over a selection, a paste, an insertion before the end) cannot be unsaid: the
// first keystroke of an edit burst stops the audio once (cancel), and once the edits settle
// (EDIT_SETTLE_MS without input) the text from the first character not heard (or the edit
// point, if earlier) to the end is spoken once, as a new utterance that typing continues.
const EDIT_SETTLE_MS = 600;
const typed = {
  sent: "", // the text as last handled: sent, or waiting for its edit burst to settle
  open: false, // an utterance is open for typed text
  burst: null, // the edit burst in progress: {from, timer, stopped: Promise<heard offset>}
  utts: [], // typed utterances not yet played to the end: {start, text, settled}
};
demo.typedLog = []; // {start, text} per utterance the typing opened (tests read it)

/** Where ``value`` first differs from ``sent`` (the edit point; ``sent.length`` when text was added). */
function editPoint(sent, value) {
  const n = Math.min(sent.length, value.length);
  let i = 0;
  while (i < n && sent.charCodeAt(i) === value.charCodeAt(i)) i += 1;
  return i;
}

$("stream-typing").addEventListener("change", async () => {
  typed.sent = $("text").value;
  if ($("stream-typing").checked) await connectOrReport();
  else endTyped();
});

function endTyped() {
  if (typed.open && demo.gw) track(demo.gw.end());
  typed.open = false;
}

/** Send typed text that starts at offset ``start`` of the text box (opens an utterance if none is). */
function sendTyped(gw, start, text) {
  if (!text) return;
  if (!typed.open) {
    const entry = { start, text: "", settled: false };
    typed.utts.push(entry);
    demo.typedLog.push(entry);
    typed.open = true;
  }
  const entry = typed.utts[typed.utts.length - 1];
  entry.text += text;
  const done = gw.sendText(text);
  if (done) {
    done.then(
      () => (entry.settled = true),
      () => (entry.settled = true),
    );
  }
}

/** Stop the audio of the typed text at an edit; resolves with the offset heard up to. */
async function stopForEdit(gw, sent) {
  const playing = typed.utts.filter((u) => !u.settled);
  typed.open = false;
  typed.utts = [];
  if (playing.length === 0) return sent.length; // everything sent was heard
  const reply = await gw.cancel();
  const heard = (reply && reply.heard_text) || "";
  return playing[0].start + heard.length;
}

$("text").addEventListener("input", async () => {
  if (!$("stream-typing").checked) return;
  // read everything about this edit before awaiting: the next keystroke may come meanwhile
  const value = $("text").value;
  const sent = typed.sent;
  const at = editPoint(sent, value);
  typed.sent = value;
  const gw = await connectOrReport();
  if (!gw) {
    typed.sent = sent; // nothing went out: retry this text with the next edit
    return;
  }
  const appended = at >= sent.length && value.startsWith(sent);
  if (appended && !typed.burst) {
    sendTyped(gw, sent.length, value.slice(sent.length));
    return;
  }
  // an edit (or typing while an edit burst settles): stop once, speak the tail once it settles
  if (!typed.burst) typed.burst = { from: at, timer: null, stopped: stopForEdit(gw, sent), end: false };
  const burst = typed.burst;
  burst.from = Math.min(burst.from, at);
  clearTimeout(burst.timer);
  burst.timer = setTimeout(async () => {
    const heard = await burst.stopped;
    if (typed.burst !== burst) return;
    typed.burst = null;
    const text = $("text").value;
    const from = Math.min(burst.from, heard, text.length);
    typed.sent = text;
    sendTyped(gw, from, text.slice(from));
    if (burst.end) endTyped();
  }, EDIT_SETTLE_MS);
});

$("text").addEventListener("keydown", (e) => {
  if ($("stream-typing").checked && e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    if (typed.burst) {
      typed.burst.end = true; // the settling edit speaks the text, then ends the utterance
      return;
    }
    if (demo.gw && typed.open) demo.gw.sendText(" ");
    typed.sent = $("text").value;
    endTyped();
  }
});

$("end").addEventListener("click", endTyped);

if (params.get("voice")) {
  $("voice").value = "custom";
  $("voice-custom").hidden = false;
  $("voice-custom").value = params.get("voice");
}
if (params.get("rate")) $("rate").value = params.get("rate");
// connect on load (the pill says whether the gateway is there); audio starts on the first click
demo.ready = true;
connectOrReport();

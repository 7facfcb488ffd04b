// voicegw browser client: stream text in, play speech out while text still arrives.
// Dependency-free ES module, no build step. See docs/clients.md.
//
//   import { VoiceGateway } from "./voicegw.js";
//   const gw = new VoiceGateway();                 // same origin, /ws
//   await gw.connect();                            // call from a user gesture (audio autoplay rules)
//   const result = await gw.speak(llmTokens);      // string | Iterable | AsyncIterable | ReadableStream
//   gw.cancel();                                   // barge-in: silence at once, server aborts
//
// Events (CustomEvent, payload in `detail`): session, segment, segmentdone, ttfa, playing, report,
// underrun, utterancedone, drained, cancelled, error, close.

import { PROTOCOL } from "./protocol.js";

export { PROTOCOL };

const T = Object.fromEntries(Object.entries(PROTOCOL.client_types));
const S = Object.fromEntries(Object.entries(PROTOCOL.server_types));
const E = Object.fromEntries(Object.entries(PROTOCOL.error_codes));
const C = Object.fromEntries(Object.entries(PROTOCOL.close_codes));
const HEADER_BYTES = PROTOCOL.audio_header.bytes;
const TOKEN_CHARS = /^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$/;
const CANCEL_ACK_TIMEOUT_MS = 50;

export class VoicegwError extends Error {
  constructor(code, message, detail = {}) {
    super(`${code}: ${message}`);
    this.code = code;
    this.detail = detail;
  }
}

/** Default WebSocket URL: this page's origin + the protocol's path. */
export function defaultUrl() {
  const u = new URL(PROTOCOL.ws_path, location.href);
  u.protocol = u.protocol === "https:" ? "wss:" : "ws:";
  return u.toString();
}

/** Turn a string / (async) iterable / ReadableStream of text into an async iterable. */
export async function* textPieces(source) {
  if (source == null) return;
  if (typeof source === "string") {
    yield source;
  } else if (typeof ReadableStream !== "undefined" && source instanceof ReadableStream) {
    const reader = source.getReader();
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;
        yield typeof value === "string" ? value : new TextDecoder().decode(value);
      }
    } finally {
      reader.releaseLock();
    }
  } else if (source[Symbol.asyncIterator] || source[Symbol.iterator]) {
    for await (const piece of source) yield String(piece);
  } else {
    throw new TypeError("speak(): expected a string, an (async) iterable of strings or a ReadableStream");
  }
}

export class VoiceGateway extends EventTarget {
  /**
   * @param {string} [url] ws(s):// URL of the gateway's /ws (default: this page's origin)
   * @param {object} [opts]
   * @param {string} [opts.token] bearer token (sent as subprotocol voicegw.token.<t>, or ?token=)
   * @param {string|number} [opts.voice] speaker: int seed or encoded embedding; default: server's
   * @param {number} [opts.sampleRate=24000] 8000 | 16000 | 24000 | 48000
   * @param {"pcm16"|"mulaw"} [opts.format="pcm16"]
   * @param {string} [opts.language] e.g. "en", "zh"
   * @param {object} [opts.options] sampling options {temperature, top_p, top_k, seed}
   * @param {boolean} [opts.audio=true] play audio (false: events only, no playback reports)
   * @param {AudioContext} [opts.audioContext] bring your own context
   * @param {number} [opts.contextSampleRate] force the context's rate (the worklet resamples)
   * @param {number} [opts.prebufferMs=80] playback starts once this much is buffered
   * @param {number} [opts.maxTargetMs=300] cap of the adaptive prebuffer target
   * @param {string|URL} [opts.workletUrl] URL of player-worklet.js (default: next to this module)
   */
  constructor(url, opts = {}) {
    super();
    this.url = url || defaultUrl();
    this.opts = {
      sampleRate: 24000,
      format: "pcm16",
      audio: true,
      prebufferMs: 80,
      maxTargetMs: 300,
      reportIntervalMs: 250,
      ...opts,
    };
    this.ws = null;
    this.session = null;
    this.ctx = null;
    this.node = null;
    this.closed = false;
    this.stats = {
      receivedSamples: 0,
      playedSamples: 0,
      bufferedMs: 0,
      targetMs: this.opts.prebufferMs,
      underruns: 0,
      outputLatencyMs: 0,
      frames: 0,
      droppedFrames: 0,
    };
    this._utterances = []; // local records, in order
    this._open = null; // utterance accepting text
    this._localSeq = 0;
    this._byId = new Map(); // server utterance id -> record
    this._maxId = 0;
    this._cancelReplies = []; // resolvers of cancel() calls awaiting the server's `cancelled`, FIFO
    this._hold = null; // outgoing messages held while a cancel waits for the worklet
    this._cancelSeq = 0;
    this._cancelCount = 0;
    this._cancelWaiters = new Map();
    this._sessionWaiter = null;
    this._lastReport = null;
    this._consumed = 0; // stream samples the worklet is done with (played or cancelled)
  }

  // ------------------------------------------------------------------ connection

  /** Open the socket, start the session and the audio graph. Resolves with session.started. */
  async connect() {
    const protocols = [PROTOCOL.subprotocol];
    let url = this.url;
    const tok = this.opts.token;
    if (tok) {
      if (TOKEN_CHARS.test(tok)) protocols.push(PROTOCOL.token_subprotocol_prefix + tok);
      else {
        const u = new URL(url);
        u.searchParams.set("token", tok);
        url = u.toString();
      }
    }
    const audioReady = this.opts.audio ? this._setupAudio() : Promise.resolve();
    const ws = new WebSocket(url, protocols);
    ws.binaryType = "arraybuffer";
    this.ws = ws;
    await new Promise((resolve, reject) => {
      ws.onopen = resolve;
      ws.onerror = () => reject(new VoicegwError("connect_failed", `cannot connect to ${this.url}`));
      ws.onclose = (e) => reject(new VoicegwError("connect_failed", `closed ${e.code} ${e.reason}`));
    });
    ws.onmessage = (e) => this._onMessage(e.data);
    ws.onerror = () => {};
    ws.onclose = (e) => this._onClose(e);
    const started = new Promise((resolve, reject) => (this._sessionWaiter = { resolve, reject }));
    const start = { type: T.SESSION_START, sample_rate: this.opts.sampleRate, format: this.opts.format };
    if (this.opts.voice != null && this.opts.voice !== "") start.voice = this.opts.voice;
    if (this.opts.language) start.language = this.opts.language;
    if (this.opts.options) start.options = this.opts.options;
    this._send(start);
    const [session] = await Promise.all([started, audioReady]);
    return session;
  }

  async _setupAudio() {
    const rate = this.opts.sampleRate;
    let ctx = this.opts.audioContext;
    if (!ctx) {
      const want = this.opts.contextSampleRate || rate;
      try {
        ctx = new AudioContext({ sampleRate: want, latencyHint: "interactive" });
      } catch {
        ctx = new AudioContext({ latencyHint: "interactive" }); // the worklet resamples
      }
    }
    this.ctx = ctx;
    const workletUrl = this.opts.workletUrl || new URL("./player-worklet.js", import.meta.url);
    await ctx.audioWorklet.addModule(workletUrl);
    const node = new AudioWorkletNode(ctx, "voicegw-player", {
      numberOfInputs: 0,
      numberOfOutputs: 1,
      outputChannelCount: [1],
      processorOptions: {
        streamRate: rate,
        prebufferMs: this.opts.prebufferMs,
        maxTargetMs: this.opts.maxTargetMs,
        reportIntervalMs: this.opts.reportIntervalMs,
      },
    });
    node.port.onmessage = (e) => this._onWorklet(e.data);
    node.connect(ctx.destination);
    this.node = node;
    if (ctx.state !== "running") {
      try {
        await ctx.resume();
      } catch {
        /* needs a user gesture: resume() again from one (see resumeAudio) */
      }
    }
  }

  /** Resume the AudioContext (call from a user gesture if the browser blocked autoplay). */
  async resumeAudio() {
    if (this.ctx && this.ctx.state !== "running") await this.ctx.resume();
  }

  /** Close the session (and the AudioContext this client created). */
  async close(code = C.NORMAL) {
    this.closed = true;
    if (this.ws && this.ws.readyState <= 1) this.ws.close(code);
    if (this.node) this.node.disconnect();
    if (this.ctx && !this.opts.audioContext) await this.ctx.close().catch(() => {});
  }

  get contextSampleRate() {
    return this.ctx ? this.ctx.sampleRate : null;
  }

  // ------------------------------------------------------------------ text in

  /** Send the next piece of text (opens an utterance if none is open). */
  sendText(text) {
    if (!text) return;
    let u = this._open;
    const msg = { type: T.TEXT_DELTA, text };
    if (!u) {
      u = this._newUtterance();
      msg.id = u.localId;
    }
    if (u.tFirstText == null) u.tFirstText = performance.now();
    u.chars += text.length;
    this._send(msg);
  }

  /** Speak what was sent so far without waiting for a sentence end. */
  flush() {
    if (this._open) this._send({ type: T.TEXT_FLUSH });
  }

  /** End the open utterance. Resolves like speak() when it has been spoken (or cancelled). */
  end() {
    const u = this._open;
    if (!u) return Promise.resolve(null);
    this._open = null;
    u.ended = true;
    this._send({ type: T.TEXT_END });
    if (u.chars === 0) this._settle(u, { status: "empty" });
    return u.promise;
  }

  /**
   * Speak a text or a token stream: every piece goes out as soon as it arrives; resolves once the
   * audio has been played to the end (or cancelled) with
   * {utteranceId, status, ttfaMs, playStartMs, samples, durationMs, underruns, cancelled, heardText}.
   */
  async speak(source) {
    if (this._open) this.end().catch(() => {}); // the typed utterance goes first; this one queues behind it
    const cancelsAtStart = this._cancelCount;
    let mine = null;
    for await (const piece of textPieces(source)) {
      if (this.closed) break;
      // Stop means stop: after cancel() no more of the source is read (leaving the loop ends the
      // source's iterator) and nothing opens a new utterance with the rest of the text.
      if (this._cancelCount !== cancelsAtStart) break;
      this.sendText(piece);
      mine = mine || this._open;
    }
    if (this._cancelCount !== cancelsAtStart) {
      if (mine) return mine.promise; // resolves with status "cancelled"
      return { utteranceId: null, status: "cancelled", cancelled: true, samples: 0, durationMs: 0, heardText: "" };
    }
    return this.end();
  }

  // ------------------------------------------------------------------ cancel

  /**
   * Barge-in: silence now, drop audio in flight, abort generation of every queued utterance.
   * Resolves with the server's `cancelled` message.
   */
  cancel() {
    this._cancelCount += 1; // speak() loops stop reading their sources
    if (!this.ws || this.ws.readyState !== 1) return Promise.resolve(null);
    this._open = null;
    for (const u of this._utterances) u.cancelling = true;
    // audio frames are dropped while a cancel awaits its `cancelled` (see _onAudio)
    const reply = new Promise((resolve) => this._cancelReplies.push(resolve));
    if (!this.node) {
      this._send({ type: T.CANCEL });
      return reply;
    }
    // The worklet empties its ring and answers with its exact played count; messages sent
    // meanwhile (new text) are held so the server sees the cancel first.
    const id = ++this._cancelSeq;
    this._hold = this._hold || [];
    let sent = false;
    const sendCancel = (played) => {
      if (sent) return;
      sent = true;
      const msg = { type: T.CANCEL };
      if (played != null) msg.played_samples = played;
      const held = this._hold || [];
      this._hold = null;
      this._send(msg);
      for (const m of held) this._send(m);
    };
    this._cancelWaiters.set(id, (ack) => sendCancel(ack.playedSamples));
    this.node.port.postMessage({ type: "cancel", id });
    setTimeout(() => {
      if (this._cancelWaiters.delete(id)) sendCancel(this._lastReport ? this._lastReport.playedSamples : null);
    }, CANCEL_ACK_TIMEOUT_MS);
    return reply;
  }

  // ------------------------------------------------------------------ internals

  _newUtterance() {
    const u = {
      localId: `u${++this._localSeq}`,
      id: null,
      chars: 0,
      ended: false,
      tFirstText: null,
      tFirstAudio: null,
      tPlay: null,
      ttfaMs: null,
      playStartMs: null,
      received: 0,
      endPos: null,
      done: null,
      settled: false,
      underrunsAtStart: this.stats.underruns,
    };
    u.promise = new Promise((resolve, reject) => {
      u.resolve = resolve;
      u.reject = reject;
    });
    this._open = u;
    this._utterances.push(u);
    return u;
  }

  _send(obj) {
    if (this._hold && obj.type !== T.CANCEL) {
      this._hold.push(obj);
      return;
    }
    if (this.ws && this.ws.readyState === 1) this.ws.send(JSON.stringify(obj));
  }

  _emit(type, detail) {
    this.dispatchEvent(new CustomEvent(type, { detail }));
  }

  /** The local record of server utterance `id` (server ids count utterances opened, from 1). */
  _record(id) {
    let u = this._byId.get(id);
    if (!u && id > this._maxId) {
      u = this._utterances.find((x) => x.id == null && !x.settled && x.chars > 0);
      if (u) {
        u.id = id;
        this._maxId = id;
        this._byId.set(id, u);
      }
    }
    return u;
  }

  _onMessage(data) {
    if (data instanceof ArrayBuffer) {
      this._onAudio(data);
      return;
    }
    let msg;
    try {
      msg = JSON.parse(data);
    } catch {
      return;
    }
    switch (msg.type) {
      case S.SESSION_STARTED:
        this.session = msg;
        if (this._sessionWaiter) this._sessionWaiter.resolve(msg);
        this._sessionWaiter = null;
        this._emit("session", msg);
        break;
      case S.SEGMENT_STARTED:
        this._record(msg.utterance_id);
        this._emit("segment", msg);
        break;
      case S.SEGMENT_DONE:
        this._emit("segmentdone", msg);
        break;
      case S.UTTERANCE_DONE: {
        const u = this._record(msg.utterance_id);
        if (u && !u.settled) {
          u.done = msg;
          u.endPos = this.stats.receivedSamples;
          if (this.node) this.node.port.postMessage({ type: "end" });
          this._checkDrained();
          if (!this.node) this._settle(u, {});
        }
        this._emit("utterancedone", msg);
        break;
      }
      case S.CANCELLED: {
        const ids = new Set(msg.cancelled_utterances || []);
        if (msg.utterance_id != null) ids.add(msg.utterance_id);
        for (const u of this._utterances.slice()) {
          if (!u.settled && (u.cancelling || ids.has(u.id))) {
            this._settle(u, { cancelled: true, heardText: msg.heard_text });
          }
        }
        const resolve = this._cancelReplies.shift();
        if (resolve) resolve(msg);
        this._emit("cancelled", msg);
        break;
      }
      case S.ERROR: {
        this._emit("error", msg);
        let u = null;
        if (msg.utterance_id != null) u = this._record(msg.utterance_id);
        else if (msg.id != null) u = this._utterances.find((x) => x.localId === msg.id && x.id == null);
        if (u && msg.utterance_id == null && u.received === 0) {
          // the opening delta was refused: this utterance never opened on the server
          if (this._open === u) this._open = null;
          u.chars = 0;
          this._settle(u, null, new VoicegwError(msg.code, msg.message, msg));
        }
        if (msg.fatal && this._sessionWaiter) {
          this._sessionWaiter.reject(new VoicegwError(msg.code, msg.message, msg));
          this._sessionWaiter = null;
        }
        break;
      }
      default:
        this._emit(msg.type, msg);
    }
  }

  _onAudio(buf) {
    if (buf.byteLength < HEADER_BYTES) return;
    if (this._cancelReplies.length > 0) {
      this.stats.droppedFrames++;
      return;
    }
    const dv = new DataView(buf);
    const format = dv.getUint8(1);
    const utteranceId = dv.getUint32(4, true);
    const bytesPerSample = format === PROTOCOL.formats.mulaw ? 1 : 2;
    const n = (buf.byteLength - HEADER_BYTES) / bytesPerSample;
    const now = performance.now();
    const u = this._record(utteranceId);
    this.stats.receivedSamples += n;
    this.stats.frames++;
    if (u) {
      u.received += n;
      if (u.tFirstAudio == null) {
        u.tFirstAudio = now;
        u.ttfaMs = u.tFirstText != null ? now - u.tFirstText : null;
        this._emit("ttfa", { utteranceId, ms: u.ttfaMs });
      }
    }
    if (this.node) this.node.port.postMessage(buf, [buf]);
  }

  _onWorklet(m) {
    switch (m.type) {
      case "report":
      case "cancelled": {
        this._lastReport = m;
        this.stats.playedSamples = m.playedSamples;
        this.stats.bufferedMs = m.bufferedMs;
        this.stats.underruns = m.underruns;
        this.stats.targetMs = m.targetMs;
        this._consumed = m.consumedSamples;
        if (m.type === "cancelled") {
          const w = this._cancelWaiters.get(m.id);
          if (w) {
            this._cancelWaiters.delete(m.id);
            w(m);
          }
        } else {
          this._sendPlayback(m);
        }
        this._emit("report", { ...m, ...this.stats });
        if (m.drained) this._emit("drained", m);
        this._checkDrained();
        break;
      }
      case "started": {
        for (const u of this._utterances) {
          if (!u.settled && u.tPlay == null && u.received > 0) {
            u.tPlay = performance.now();
            u.playStartMs = u.tFirstText != null ? u.tPlay - u.tFirstText : null;
            this._emit("playing", { utteranceId: u.id, ms: u.playStartMs });
            break;
          }
        }
        break;
      }
      case "underrun":
        this.stats.underruns = m.underruns;
        this.stats.targetMs = m.targetMs;
        this._emit("underrun", m);
        break;
    }
  }

  _sendPlayback(m) {
    const lat = this.ctx ? (this.ctx.outputLatency || this.ctx.baseLatency || 0) * 1000 : 0;
    this.stats.outputLatencyMs = lat;
    this._send({
      type: T.PLAYBACK,
      played_samples: m.playedSamples,
      buffered_ms: Math.round(Math.max(0, m.bufferedMs) * 10) / 10,
      underruns: m.underruns,
      output_latency_ms: Math.round(Math.min(60000, Math.max(0, lat)) * 10) / 10,
    });
  }

  _checkDrained() {
    for (const u of this._utterances) {
      if (!u.settled && u.done && u.endPos != null && this._consumed >= u.endPos) this._settle(u, {});
    }
  }

  _settle(u, extra, err) {
    if (u.settled) return;
    u.settled = true;
    this._utterances = this._utterances.filter((x) => x !== u);
    if (u.id != null) this._byId.delete(u.id);
    if (err) {
      u.reject(err);
      return;
    }
    const rate = this.opts.sampleRate;
    u.resolve({
      utteranceId: u.id,
      status: extra.status || (extra.cancelled ? "cancelled" : (u.done && u.done.status) || "ok"),
      error: u.done && u.done.error,
      ttfaMs: u.ttfaMs,
      playStartMs: u.playStartMs,
      samples: u.received,
      serverSamples: u.done ? u.done.samples : null,
      durationMs: (u.received * 1000) / rate,
      underruns: this.stats.underruns - u.underrunsAtStart,
      cancelled: !!extra.cancelled,
      heardText: extra.heardText,
    });
  }

  _onClose(e) {
    this.closed = true;
    const err = new VoicegwError("closed", `connection closed ${e.code} ${e.reason || ""}`.trim(), {
      code: e.code,
      reason: e.reason,
    });
    if (this._sessionWaiter) this._sessionWaiter.reject(err);
    this._sessionWaiter = null;
    for (const u of this._utterances.slice()) {
      if (u.done && this.node) continue; // already fully received: let it play out
      this._settle(u, null, err);
    }
    for (const resolve of this._cancelReplies.splice(0)) resolve(null);
    this._emit("close", { code: e.code, reason: e.reason });
  }
}

export { T as CLIENT_TYPES, S as SERVER_TYPES, E as ERROR_CODES, C as CLOSE_CODES };

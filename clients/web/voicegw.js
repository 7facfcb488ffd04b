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
// underrun, utterancedone, drained, cancelled, error, close; and, riding out a bad minute
// (opts.retry): retry, disconnected, reconnecting, reconnected, resumed, audioresumed, gaveup.
//
// The decisions are client-core.js's (the same as the Python client's clients/python/core.py;
// clients/scenarios.json checks both); this module carries them out.
// Overload: an utterance refused with engine_overloaded before any of its audio arrived is sent
// again after the server's retry_after_ms (jittered, capped), up to retry.overloadAttempts in all;
// any other error about an utterance is a final refusal (not retried).
// Dropped connection (1006, 1011, 1012, 1013): reconnect with exponential backoff and jitter for
// up to retry.reconnectTimeoutMs, a new session with the same settings, and every unfinished
// utterance is sent again from its first segment not wholly received, going on at its next sample
// where the server can (session.started's resume: codes kept from segment.codes, or samples; what
// was received plays on from the buffer meanwhile), else from its start (the rest of the
// interrupted segment is dropped). Text given meanwhile
// is kept (retry.maxBufferedChars) and sent after. A browser cannot see why a handshake failed
// (401 and 503 look alike): such attempts are retried until the deadline; a socket that opens and
// is closed with a do-not-retry code (1002, 1007, 1008, 1009) ends the reconnecting.

import { DEFAULT_RETRY, Reconnector, SESSION_START_ID, overloadDecision, planResume } from "./client-core.js";
import { PROTOCOL } from "./protocol.js";

export { DEFAULT_RETRY, PROTOCOL };

const T = Object.fromEntries(Object.entries(PROTOCOL.client_types));
const S = Object.fromEntries(Object.entries(PROTOCOL.server_types));
const E = Object.fromEntries(Object.entries(PROTOCOL.error_codes));
const C = Object.fromEntries(Object.entries(PROTOCOL.close_codes));
const HEADER_BYTES = PROTOCOL.audio_header.bytes;
const TOKEN_CHARS = /^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$/;
const CANCEL_ACK_TIMEOUT_MS = 50;
const MAX_PIECE_CHARS = 4000;
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

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
   * @param {object} [opts.retry] overload retry and reconnect policy (fields of DEFAULT_RETRY)
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
    this.retry = { ...DEFAULT_RETRY, ...(opts.retry || {}) };
    this.reconnects = 0;
    this.lastOutage = null; // {outageMs, toAudioMs, gapMs, attempts} of the last reconnect
    this._linkUp = false;
    this._pos = 0; // stream position of the next sample posted to the worklet
    this._playedBase = 0; // played samples before this session's audio
    this._outage = null;
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
    const audioReady = this.opts.audio ? this._setupAudio() : Promise.resolve();
    const [session] = await Promise.all([this._openSession(), audioReady]);
    return session;
  }

  async _openSession() {
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
    const ws = new WebSocket(url, protocols);
    ws.binaryType = "arraybuffer";
    this.ws = ws;
    await new Promise((resolve, reject) => {
      ws.onopen = resolve;
      ws.onerror = () => reject(new VoicegwError("connect_failed", `cannot connect to ${this.url}`));
      ws.onclose = (e) => reject(new VoicegwError("connect_failed", `closed ${e.code} ${e.reason}`, { code: e.code }));
    });
    const started = new Promise((resolve, reject) => (this._sessionWaiter = { resolve, reject }));
    ws.onmessage = (e) => this._onMessage(e.data);
    ws.onerror = () => {};
    ws.onclose = (e) => {
      if (this.ws !== ws) return;
      if (this._sessionWaiter) {
        // the session never started on this socket: the attempt that opened it fails
        this._sessionWaiter.reject(new VoicegwError("connect_failed", `closed ${e.code} ${e.reason}`, { code: e.code }));
        this._sessionWaiter = null;
        return;
      }
      this._onClose(e);
    };
    // its id: an error that echoes it refused the session (a voice the engine cannot use ...)
    const start = {
      type: T.SESSION_START, sample_rate: this.opts.sampleRate, format: this.opts.format, resume: true,
      id: SESSION_START_ID,
    };
    if (this.opts.voice != null && this.opts.voice !== "") start.voice = this.opts.voice;
    if (this.opts.language) start.language = this.opts.language;
    if (this.opts.options) start.options = this.opts.options;
    ws.send(JSON.stringify(start));
    const session = await started;
    this._linkUp = true;
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
    this._linkUp = false;
    if (this.ws && this.ws.readyState <= 1) this.ws.close(code);
    if (this.node) this.node.disconnect();
    if (this.ctx && !this.opts.audioContext) await this.ctx.close().catch(() => {});
  }

  /** Stream position (samples) of the next audio the player gets: where a caption starts. */
  get streamPosition() {
    return this._pos;
  }

  /** A session is up (false while reconnecting). */
  get connected() {
    return this._linkUp && !this.closed;
  }

  get contextSampleRate() {
    return this.ctx ? this.ctx.sampleRate : null;
  }

  // ------------------------------------------------------------------ text in

  /** Send the next piece of text (opens an utterance if none is open). Returns the utterance's
   * promise (resolves like speak() once it has been spoken or cancelled). */
  sendText(text) {
    if (!text) return undefined;
    let u = this._open;
    if (!u) u = this._newUtterance();
    if (u.text.length + text.length - u.sent > this.retry.maxBufferedChars) {
      this._settle(u, null, new VoicegwError("buffer_full", "text kept while it cannot be sent is over retry.maxBufferedChars"));
      return u.promise;
    }
    if (u.tFirstText == null) u.tFirstText = performance.now();
    u.text += text;
    this._pump(u);
    return u.promise;
  }

  /** Speak what was sent so far without waiting for a sentence end. */
  flush() {
    if (this._open && this._linkUp && !this._open.parked) this._send({ type: T.TEXT_FLUSH });
  }

  /** End the open utterance. Resolves like speak() when it has been spoken (or cancelled). */
  end() {
    const u = this._open;
    if (!u) return Promise.resolve(null);
    this._open = null;
    u.ended = true;
    if (u.text.length === 0) this._settle(u, { status: "empty" });
    else this._pump(u);
    return u.promise;
  }

  /**
   * Speak a text or a token stream: every piece goes out as soon as it arrives; resolves once the
   * audio has been played to the end (or cancelled) with
   * {utteranceId, status, ttfaMs, playStartMs, samples, durationMs (received), playedMs (heard),
   * underruns, cancelled, heardText}.
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
      return { utteranceId: null, status: "cancelled", cancelled: true, samples: 0, durationMs: 0, playedMs: 0, heardText: "" };
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
    if (!this._linkUp && !this.closed && this.session) {
      // reconnecting: no server session to stop; silence and forget locally
      this._open = null;
      if (this.node) this.node.port.postMessage({ type: "cancel", id: ++this._cancelSeq });
      const msg = { type: S.CANCELLED, local: true, cancelled_utterances: [] };
      for (const u of this._utterances.slice()) this._settle(u, { cancelled: true, heardText: "" });
      this._emit("cancelled", msg);
      return Promise.resolve(msg);
    }
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
      if (played != null) msg.played_samples = Math.max(0, played - this._playedBase);
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
      text: "", // all text given to it
      baseChar: 0, // where the current sending starts in `text`
      sent: 0, // chars of `text` sent in the current sending
      endSent: false,
      parked: !this._linkUp, // text kept, not sent (outage, overload wait)
      retrying: false,
      inside: 0, // samples kept of the segment the current sending goes on inside (a resume)
      resumeWith: null, // the next sending's `resume`, until its opening delta
      attempts: 1,
      resumes: 0,
      take: 0,
      segBase: 0,
      sampleBase: 0,
      segs: new Map(), // segment index -> {startChar, endChar, sampleOffset, pos, done, take, text, samples}
      plays: [], // every take of every segment: {segment, take, text, startPos, samples, complete}
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

  /** Send what `u` holds that its current sending lacks: text, then text.end when asked. */
  _pump(u) {
    if (u.parked || !this._linkUp || u.settled) return;
    while (u.sent < u.text.length) {
      const opening = u.sent === u.baseChar;
      const n = opening && u.resumeWith ? Math.max(MAX_PIECE_CHARS, u.resumeWith.chars) : MAX_PIECE_CHARS;
      const piece = u.text.slice(u.sent, u.sent + n);
      const msg = { type: T.TEXT_DELTA, text: piece };
      if (opening) {
        msg.id = u.localId;
        if (u.resumeWith) {
          msg.resume = u.resumeWith; // go on inside the segment the connection was lost in
          u.resumeWith = null;
        }
      }
      u.sent += piece.length;
      u.sentAny = true;
      this._send(msg);
    }
    if (u.ended && !u.endSent) {
      u.endSent = true;
      this._send({ type: T.TEXT_END });
    }
  }

  _emit(type, detail) {
    this.dispatchEvent(new CustomEvent(type, { detail }));
  }

  /** The local record of server utterance `id` (server ids count utterances opened, from 1). */
  _record(id) {
    let u = this._byId.get(id);
    if (!u && id > this._maxId) {
      u = this._utterances.find((x) => x.id == null && !x.settled && !x.parked && x.sent > x.baseChar);
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
      case S.SEGMENT_STARTED: {
        const u = this._record(msg.utterance_id);
        if (u) {
          const index = u.segBase + msg.segment;
          const seg = this._seg(u, index);
          if (!(u.inside > 0 && index === u.segBase)) {
            // (a segment resumed inside keeps its own start: the sending began past it)
            seg.startChar = u.baseChar + (msg.start_char || 0);
            seg.endChar = u.baseChar + (msg.end_char || 0);
            seg.sampleOffset = u.sampleBase + (msg.sample_offset || 0);
          }
          seg.play.text = msg.text;
          this._emit("segment", { ...msg, segment: index, sample_offset: seg.sampleOffset, localId: u.localId });
        } else this._emit("segment", msg);
        break;
      }
      case S.SEGMENT_CODES: {
        const u = this._cancelReplies.length ? null : this._record(msg.utterance_id);
        const seg = u ? u.segs.get(u.segBase + msg.segment) : null;
        if (seg && msg.frame === seg.codeFrames) {
          try {
            const bin = atob(msg.codes);
            if (bin.length % PROTOCOL.codes.frame_bytes === 0) {
              seg.codeBin += bin;
              seg.codeFrames += bin.length / PROTOCOL.codes.frame_bytes;
              if (Number.isInteger(msg.seed)) seg.seed = msg.seed;
            }
          } catch {
            /* not base64: not kept */
          }
        }
        break;
      }
      case S.SEGMENT_DONE: {
        const u = this._record(msg.utterance_id);
        if (u) {
          const seg = u.segs.get(u.segBase + msg.segment);
          if (seg) seg.done = seg.play.complete = true;
        }
        this._emit("segmentdone", msg);
        break;
      }
      case S.UTTERANCE_DONE: {
        const u = this._record(msg.utterance_id);
        if (u && u.retrying) {
          this._byId.delete(msg.utterance_id); // the refused sending ended; the retry follows
        } else if (u && !u.settled) {
          u.done = msg;
          u.endPos = this._pos;
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
          u.text = "";
          u.sent = u.baseChar = 0;
          this._settle(u, null, new VoicegwError(msg.code, msg.message, msg));
        } else if (u && msg.utterance_id != null) {
          this._maybeRetry(u, msg);
        }
        if ((msg.fatal || msg.id === SESSION_START_ID) && this._sessionWaiter) {
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
    const segment = dv.getUint16(2, true);
    const utteranceId = dv.getUint32(4, true);
    const bytesPerSample = format === PROTOCOL.formats.mulaw ? 1 : 2;
    const n = (buf.byteLength - HEADER_BYTES) / bytesPerSample;
    const now = performance.now();
    const u = this._record(utteranceId);
    this.stats.receivedSamples += n;
    this.stats.frames++;
    if (u) {
      u.received += n;
      const seg = this._seg(u, u.segBase + segment);
      if (seg.pos == null) {
        seg.pos = this._pos;
        seg.play.startPos = this._pos;
      }
      seg.play.samples += n;
      if (u.tFirstAudio == null) {
        u.tFirstAudio = now;
        u.ttfaMs = u.tFirstText != null ? now - u.tFirstText : null;
        this._emit("ttfa", { utteranceId, ms: u.ttfaMs });
      }
    }
    this._pos += n;
    if (this.node) this.node.port.postMessage(buf, [buf]);
  }

  _seg(u, index) {
    let seg = u.segs.get(index);
    if (!seg) {
      const play = { segment: index, take: u.take, text: "", startPos: null, samples: 0, complete: false };
      u.plays.push(play);
      seg = { startChar: u.baseChar, endChar: u.baseChar, sampleOffset: u.sampleBase, pos: null, done: false, play,
        codeBin: "", codeFrames: 0 }; // codeBin: its segment.codes, decoded (binary string)
      u.segs.set(index, seg);
    }
    return seg;
  }

  _onWorklet(m) {
    switch (m.type) {
      case "truncated":
        this._pos = m.receivedSamples;
        if (this._outage && this._outage.owed && m.bufferedMs <= 0 && this._outage.tDry == null) {
          this._outage.tDry = performance.now();
        }
        break;
      case "report":
      case "cancelled": {
        this._lastReport = m;
        if (this._outage && this._outage.owed && this._outage.tDry == null && (m.drained || m.bufferedMs <= 0)) {
          this._outage.tDry = performance.now();
        }
        this.stats.playedSamples = m.playedSamples;
        this.stats.bufferedMs = m.bufferedMs;
        this.stats.underruns = m.underruns;
        this.stats.targetMs = m.targetMs;
        this._consumed = m.consumedSamples;
        if (m.type === "cancelled") {
          for (const u of this._utterances) if (u.playedTo == null) u.playedTo = m.playedTo;
          const w = this._cancelWaiters.get(m.id);
          if (w) {
            this._cancelWaiters.delete(m.id);
            w(m);
          }
        } else {
          this._sendPlayback(m);
        }
        if (m.type === "report") this._noteResumedAudio(m.playedSamples, false);
        this._emit("report", { ...m, ...this.stats });
        if (m.drained) this._emit("drained", m);
        this._checkDrained();
        break;
      }
      case "started": {
        this._noteResumedAudio(m.playedSamples, true);
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

  /** The outage is over for the listener once audio of the new session plays. */
  _noteResumedAudio(played, started) {
    const o = this._outage;
    if (!o || !o.based || !this._linkUp) return;
    if (started ? played < this._playedBase : played <= this._playedBase) return;
    const now = performance.now();
    this.lastOutage = {
      outageMs: Math.round(o.tUp - o.tDrop),
      toAudioMs: Math.round(now - o.tUp),
      gapMs: Math.round(now - (o.tDry ?? now)),
      attempts: o.attempts,
    };
    this._outage = null;
    const u = this._utterances.find((x) => x.resumes > 0);
    if (u) u.gapMs = (u.gapMs || 0) + this.lastOutage.gapMs;
    this._emit("audioresumed", this.lastOutage);
  }

  _sendPlayback(m) {
    if (!this._linkUp) return;
    const lat = this.ctx ? (this.ctx.outputLatency || this.ctx.baseLatency || 0) * 1000 : 0;
    this.stats.outputLatencyMs = lat;
    this._send({
      type: T.PLAYBACK,
      played_samples: Math.max(0, m.playedSamples - this._playedBase),
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

  /** Samples of ``u`` the listener heard: its takes up to the stream position played (at a
   * cancel: where the cancel cut the audio off). */
  _playedOf(u) {
    const to = u.playedTo ?? this._consumed;
    let n = 0;
    for (const p of u.plays) if (p.startPos != null) n += Math.max(0, Math.min(p.samples, to - p.startPos));
    return n;
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
      serverSamples: u.done ? u.sampleBase + u.done.samples : null, // the utterance's, across resumes
      durationMs: (u.received * 1000) / rate,
      playedMs: (this._playedOf(u) * 1000) / rate,
      underruns: this.stats.underruns - u.underrunsAtStart,
      cancelled: !!extra.cancelled,
      heardText: extra.heardText,
      attempts: u.attempts,
      resumes: u.resumes,
      gapMs: u.gapMs || 0,
      plays: u.plays.map((p) => ({ ...p })),
    });
  }

  _onClose(e) {
    this._linkUp = false;
    const rec = new Reconnector(this.retry);
    const now = performance.now();
    const first = rec.lost(e.code, now, { sessionStarted: !!this.session, closing: this.closed });
    if (first.action !== "fail") {
      this._emit("disconnected", { code: e.code, reason: e.reason });
      for (const resolve of this._cancelReplies.splice(0)) resolve({ type: S.CANCELLED, local: true });
      this._hold = null;
      // owed: audio was still coming (an utterance not done); only then is running dry a gap heard
      const owed = this._utterances.some((u) => !u.settled && !u.done);
      this._outage = { tDrop: now, tUp: null, tDry: null, attempts: 0, owed };
      this._planResume();
      this._reconnect(rec, first).catch(() => {});
      return;
    }
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

  // ------------------------------------------------------------------ retry and resume

  /** An error about `u` (overloadDecision): a final refusal, or audio already received, fails it
   * (its utterance.done reports it); engine_overloaded before any audio parks the text, ends the
   * refused sending and sends it again after the hinted wait. */
  _maybeRetry(u, msg) {
    const now = performance.now();
    const act = overloadDecision(this.retry, msg, {
      attempts: u.attempts,
      receivedSamples: u.received,
      nowMs: now,
      cancelled: u.settled || u.cancelling || this.closed,
    });
    if (act.action !== "retry") return;
    const waitMs = act.wait_ms;
    u.parked = true;
    u.retrying = true;
    if (!u.endSent) {
      u.endSent = true;
      this._send({ type: T.TEXT_END }); // ends the refused sending (the server absorbs its text until then)
    }
    this._emit("retry", { localId: u.localId, attempt: act.attempt, waitMs: Math.round(waitMs) });
    setTimeout(() => {
      if (u.settled || !u.retrying || !this._linkUp || this.closed) return; // a reconnect took it over
      u.attempts += 1;
      u.retrying = false;
      if (u.id != null) this._byId.delete(u.id);
      u.id = null;
      u.baseChar = u.sent = 0;
      u.inside = 0;
      u.resumeWith = null;
      u.endSent = false;
      u.take += 1;
      u.parked = false;
      this._pump(u);
    }, Math.max(0, act.at_ms - performance.now()));
  }

  /** Park every unfinished utterance at its first segment not wholly received; drop the audio
   * after that point from the worklet (what is left plays on meanwhile). */
  _planResume() {
    let keep = null;
    for (const u of this._utterances) {
      if (u.settled || (u.done && !u.retrying)) continue;
      u.parked = true;
      u.retrying = false;
      const mode = (this.session && this.session.resume) || "segment";
      const plan = planResume(u.segs, { segBase: u.segBase, baseChar: u.baseChar, sampleBase: u.sampleBase,
        mode, rateHz: this.opts.sampleRate });
      const k = plan.segment;
      const char = plan.char;
      const sample = plan.sample;
      if (keep == null) keep = plan.keep;
      u.inside = plan.inside;
      u.resumeWith = null;
      if (plan.inside > 0) {
        const seg = u.segs.get(k);
        u.resumeWith = { chars: seg.endChar - seg.startChar, samples: plan.inside };
        if (mode === "codes") {
          u.resumeWith.codes = btoa(seg.codeBin);
          if (seg.seed != null) u.resumeWith.seed = seg.seed;
        }
      }
      for (const j of [...u.segs.keys()]) if (j >= k + (plan.inside > 0 ? 1 : 0)) u.segs.delete(j);
      if (u.id != null) this._byId.delete(u.id);
      u.id = null;
      u.baseChar = u.sent = char;
      u.endSent = false;
      u.segBase = k;
      u.sampleBase = sample;
      u.received = sample;
      u.take += 1;
      if (u.sentAny) {
        u.resumes += 1;
        u.resumeNote = true;
      }
    }
    if (keep != null && this.node) {
      this._pos = keep;
      this.node.port.postMessage({ type: "truncate", keep, id: ++this._cancelSeq });
    } else if (this.node) {
      this.node.port.postMessage({ type: "report" });
    }
  }

  /** Carry out the Reconnector's decisions: wait, open, repeat; give up when it says so. */
  async _reconnect(rec, first) {
    const o = this._outage;
    let act = first;
    while (!this.closed && act.action === "reconnect") {
      this._emit("reconnecting", { attempt: act.attempt, waitMs: Math.round(act.wait_ms) });
      await sleep(Math.max(0, act.at_ms - performance.now()));
      if (this.closed) return;
      try {
        await this._openSession();
      } catch (err) {
        const code = err && err.detail ? err.detail.code : null;
        act = rec.failed({ close_code: typeof code === "number" ? code : null, error: String(err && err.message) }, performance.now());
        continue;
      }
      this.reconnects += 1;
      o.tUp = performance.now();
      const up = rec.connected(o.tUp);
      o.attempts = up.attempts;
      this._emit("reconnected", { attempts: up.attempts, outageMs: up.outage_ms });
      await this._replay();
      return;
    }
    if (this.closed) return;
    this.closed = true;
    this._outage = null;
    this._emit("gaveup", { attempts: act.attempts, reason: act.reason, error: rec.lastError });
    const err = new VoicegwError(
      "closed",
      act.reason === "final"
        ? `reconnect refused (${rec.lastError})`
        : `could not reconnect within ${this.retry.reconnectTimeoutMs} ms`,
    );
    for (const u of this._utterances.slice()) {
      if (u.done && this.node) continue;
      this._settle(u, null, err);
    }
    this._emit("close", { code: 1006, reason: "gave up reconnecting" });
  }

  /** A new session is up: its ids and played counter start afresh; send the parked utterances. */
  async _replay() {
    this._byId.clear();
    this._maxId = 0;
    if (this.node) {
      const rep = await new Promise((resolve) => {
        const prev = this.node.port.onmessage;
        const t = setTimeout(() => resolve(this._lastReport), 200);
        this.node.port.onmessage = (e) => {
          prev(e);
          if (e.data && e.data.type === "report") {
            clearTimeout(t);
            this.node.port.onmessage = prev;
            resolve(e.data);
          }
        };
        this.node.port.postMessage({ type: "report" });
      });
      this._playedBase = rep ? rep.playedSamples + Math.max(0, this._pos - rep.consumedSamples) : 0;
    }
    if (this._outage) this._outage.based = true; // from here, played past the base is resumed audio
    for (const u of this._utterances.slice()) {
      if (!u.parked || u.settled || !this._linkUp) continue;
      u.parked = false;
      if (u.resumeNote) {
        u.resumeNote = false;
        this._emit("resumed", { localId: u.localId, fromSegment: u.segBase, fromChar: u.baseChar });
      }
      this._pump(u);
    }
  }
}

export { T as CLIENT_TYPES, S as SERVER_TYPES, E as ERROR_CODES, C as CLOSE_CODES };

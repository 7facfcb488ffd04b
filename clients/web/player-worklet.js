// voicegw streaming player: an AudioWorkletProcessor fed with the gateway's binary audio frames.
//
// Main thread -> worklet (port.postMessage):
//   ArrayBuffer (transferred: postMessage(buf, [buf]))   one binary frame: 16-byte header + samples
//   {type: "end"}         the audio received so far ends an utterance: when playback reaches this
//                         point with nothing after it, go idle (not an underrun) and report "drained"
//   {type: "cancel", id}  empty the ring at once (silence from the next render quantum); replies
//                         {type: "cancelled", id, playedTo, ...report} (playedTo: the stream
//                         position played up to; the skipped rest counts as consumed)
//   {type: "truncate", keep, id}  drop what is buffered past stream position `keep` (never what
//                         has played); what is left ends there; replies {type: "truncated", id, ...report}
//   {type: "config", prebufferMs?, maxTargetMs?, stepMs?}
// Worklet -> main thread:
//   {type: "report", playedSamples, bufferedMs, underruns, targetMs, state, drained, ...}
//       every ~reportIntervalMs while not idle, and once at drain (drained: true)
//   {type: "started", playedSamples, contextTime}   playback (re)started after a prebuffer
//   {type: "underrun", underruns, targetMs}
//
// The buffer's decisions (prebuffer, underrun and target raise, drain, cancel, truncate) are
// playout-rules.js's, the same as clients/python/playout.py (clients/scenarios.json checks both).
//
// Counting is in samples of the stream (the gateway's rate), not of the AudioContext: with a
// context at another rate, a linear resampler runs here and playedSamples still counts stream
// samples. playedSamples counts real audio only (not underrun silence, not cancelled audio).

import { cancelled, ended, pushed, starved, startIfReady, truncated } from "./playout-rules.js";

const HEADER_BYTES = 16; // gateway/protocol.py AUDIO_HEADER_BYTES (checked by tests/browser)
const FORMAT_PCM16 = 0;
const FORMAT_MULAW = 1;
const MIN_CAPACITY = 1 << 15;
const MAX_CAPACITY = 1 << 23; // ~5.8 min at 24 kHz; beyond it audio is dropped and counted

const MULAW_TABLE = (() => {
  const t = new Float32Array(256);
  for (let i = 0; i < 256; i++) {
    const u = ~i & 0xff;
    const sign = u & 0x80;
    const exponent = (u >> 4) & 0x07;
    const mantissa = u & 0x0f;
    const mag = (((mantissa << 3) + 0x84) << exponent) - 0x84;
    t[i] = (sign ? -mag : mag) / 32768;
  }
  return t;
})();

function nextPow2(n) {
  let c = MIN_CAPACITY;
  while (c < n) c *= 2;
  return c;
}

class VoicegwPlayer extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const o = (options && options.processorOptions) || {};
    this.streamRate = o.streamRate || 24000;
    this.ratio = this.streamRate / sampleRate; // stream samples per output sample
    this.resampling = Math.abs(this.ratio - 1) > 1e-9;
    this.prebufferMs = o.prebufferMs ?? 80;
    this.targetMs = this.prebufferMs;
    this.maxTargetMs = o.maxTargetMs ?? 300;
    this.stepMs = o.stepMs ?? 20;
    this.reportEvery = Math.max(128, Math.round(((o.reportIntervalMs ?? 250) / 1000) * sampleRate));

    this.capacity = nextPow2(Math.ceil(this.streamRate * (o.initialCapacitySeconds ?? 8)));
    this.mask = this.capacity - 1;
    this.ring = new Float32Array(this.capacity);
    this.written = 0; // stream samples ever written (monotonic)
    this.read = 0; // stream samples ever consumed (played or skipped by cancel)
    this.played = 0; // stream samples actually played
    this.endMark = -1; // `written` at the last "end" message
    this.frac = 0; // resampler phase between ring[read] and ring[read + 1]

    this.state = "idle"; // idle | prebuffering | playing
    this.underruns = 0;
    this.dropped = 0; // samples dropped because the ring hit MAX_CAPACITY
    this.frames = 0; // frames received
    this.sinceReport = 0;
    this.port.onmessage = (e) => this.onMessage(e.data);
  }

  onMessage(msg) {
    if (msg instanceof ArrayBuffer) {
      this.push(msg);
      return;
    }
    switch (msg && msg.type) {
      case "end":
        ended(this);
        break;
      case "cancel": {
        const playedTo = this.read; // the stream position heard up to (what follows is skipped)
        cancelled(this);
        this.frac = 0;
        this.port.postMessage({ ...this.report(false), type: "cancelled", id: msg.id, playedTo });
        break;
      }
      case "truncate": {
        truncated(this, msg.keep);
        if (this.written <= this.read) this.frac = 0;
        this.port.postMessage({ ...this.report(false), type: "truncated", id: msg.id });
        break;
      }
      case "config":
        if (msg.prebufferMs != null) this.prebufferMs = this.targetMs = msg.prebufferMs;
        if (msg.maxTargetMs != null) this.maxTargetMs = msg.maxTargetMs;
        if (msg.stepMs != null) this.stepMs = msg.stepMs;
        break;
      case "report":
        this.port.postMessage(this.report(false));
        break;
    }
  }

  push(buf) {
    if (buf.byteLength <= HEADER_BYTES) return;
    const format = new DataView(buf).getUint8(1);
    let n;
    let src;
    if (format === FORMAT_MULAW) {
      src = new Uint8Array(buf, HEADER_BYTES);
      n = src.length;
    } else if (format === FORMAT_PCM16) {
      src = new Int16Array(buf, HEADER_BYTES, (buf.byteLength - HEADER_BYTES) >> 1);
      n = src.length;
    } else {
      return;
    }
    this.frames++;
    if (!this.ensureCapacity(this.written - this.read + n)) {
      this.dropped += n;
      return;
    }
    const ring = this.ring;
    const mask = this.mask;
    let w = this.written;
    if (format === FORMAT_MULAW) {
      for (let i = 0; i < n; i++) ring[(w + i) & mask] = MULAW_TABLE[src[i]];
    } else {
      for (let i = 0; i < n; i++) ring[(w + i) & mask] = src[i] / 32768;
    }
    this.written = w + n;
    pushed(this);
  }

  ensureCapacity(needed) {
    if (needed <= this.capacity) return true;
    if (needed > MAX_CAPACITY) return false;
    const cap = nextPow2(needed);
    const ring = new Float32Array(cap);
    for (let i = this.read; i < this.written; i++) ring[i & (cap - 1)] = this.ring[i & this.mask];
    this.ring = ring;
    this.capacity = cap;
    this.mask = cap - 1;
    return true;
  }

  bufferedMs() {
    return ((this.written - this.read - this.frac) * 1000) / this.streamRate;
  }

  report(drained) {
    return {
      type: "report",
      playedSamples: this.played,
      bufferedMs: Math.max(0, this.bufferedMs()),
      underruns: this.underruns,
      targetMs: this.targetMs,
      state: this.state,
      drained,
      receivedSamples: this.written,
      consumedSamples: this.read,
      frames: this.frames,
      dropped: this.dropped,
      contextRate: sampleRate,
      streamRate: this.streamRate,
      contextTime: currentTime,
    };
  }

  // Called when the ring cannot feed the next output sample.
  starve() {
    if (starved(this) === "drained") {
      // the utterance ended exactly here: a clean drain
      this.frac = 0;
      this.port.postMessage(this.report(true));
      this.sinceReport = 0;
    } else {
      this.port.postMessage({
        type: "underrun",
        underruns: this.underruns,
        targetMs: this.targetMs,
        playedSamples: this.played,
        contextTime: currentTime,
      });
    }
  }

  process(inputs, outputs) {
    const out = outputs[0];
    const ch0 = out[0];
    const frames = ch0.length;
    let i = 0;
    if (startIfReady(this)) {
      this.port.postMessage({ type: "started", playedSamples: this.played, contextTime: currentTime });
    }
    if (this.state === "playing") {
      const ring = this.ring;
      const mask = this.mask;
      if (!this.resampling) {
        const n = Math.min(frames, this.written - this.read);
        let r = this.read;
        for (; i < n; i++) ch0[i] = ring[(r + i) & mask];
        this.read = r + n;
        this.played += n;
        if (n < frames) this.starve();
      } else {
        // linear interpolation between ring[read] and ring[read + 1]
        const step = this.ratio;
        let r = this.read;
        let frac = this.frac;
        const end = this.written;
        for (; i < frames; i++) {
          if (r + 1 < end) {
            const a = ring[r & mask];
            ch0[i] = a + (ring[(r + 1) & mask] - a) * frac;
          } else if (r < end && end === this.endMark) {
            ch0[i] = ring[r & mask] * (1 - frac); // last sample of an utterance: fade to zero
          } else {
            break;
          }
          frac += step;
          while (frac >= 1 && r < end) {
            frac -= 1;
            r++;
            this.played++;
          }
        }
        if (r >= end) frac = 0;
        this.read = r;
        this.frac = frac;
        if (i < frames) this.starve();
      }
    }
    for (let k = i; k < frames; k++) ch0[k] = 0;
    for (let c = 1; c < out.length; c++) out[c].set(ch0);

    this.sinceReport += frames;
    if (this.sinceReport >= this.reportEvery) {
      this.sinceReport = 0;
      if (this.state !== "idle") this.port.postMessage(this.report(false));
    }
    return true;
  }
}

registerProcessor("voicegw-player", VoicegwPlayer);

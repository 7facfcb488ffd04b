// voicegw playout rules: the jitter buffer's decisions as plain functions, shared by the
// AudioWorklet player (player-worklet.js) and the scenario tests (tests/browser/
// test_client_scenarios.py runs clients/scenarios.json against `Playout` below). The same rules
// as clients/python/playout.py; the table keeps the two in step.
//
// A playout state is any object with: state ("idle" | "prebuffering" | "playing"), written and
// read (stream samples ever written / consumed), endMark (`written` at the last utterance end,
// -1 for none), targetMs, stepMs, maxTargetMs, underruns, streamRate (Hz); drains is counted.

/** Samples arrived: an idle player waits for its prebuffer. */
export function pushed(p) {
  if (p.state === "idle") p.state = "prebuffering";
}

/** The audio so far ends an utterance: reaching this point with nothing after it is a drain. */
export function ended(p) {
  p.endMark = p.written;
  if (p.state === "idle" && p.written > p.read) p.state = "prebuffering";
}

/** Prebuffering and the target is buffered (or the utterance is complete): start. Returns true
 * when playback starts now. */
export function startIfReady(p) {
  if (p.state !== "prebuffering") return false;
  const avail = p.written - p.read;
  const complete = p.endMark >= p.written; // everything up to an "end" is here
  if (avail > 0 && ((avail * 1000) / p.streamRate >= p.targetMs || complete)) {
    p.state = "playing";
    return true;
  }
  return false;
}

/** The buffer cannot feed the device: a clean drain at an utterance end, else an underrun (the
 * target rises by stepMs, capped at maxTargetMs, and playback waits for it). */
export function starved(p) {
  if (p.read >= p.endMark && p.written === p.endMark) {
    p.state = "idle";
    p.drains = (p.drains || 0) + 1;
    return "drained";
  }
  p.underruns++;
  p.targetMs = Math.min(p.maxTargetMs, p.targetMs + p.stepMs);
  p.state = "prebuffering";
  return "underrun";
}

/** Barge-in: drop everything buffered at once. */
export function cancelled(p) {
  p.read = p.written;
  p.endMark = p.written;
  p.state = "idle";
}

/** Drop what is buffered past stream position `keep` (never what has played); what is left ends
 * there. Returns the samples dropped. */
export function truncated(p, keep) {
  const k = Math.max(p.read, Math.min(p.written, keep));
  const dropped = p.written - k;
  p.written = k;
  p.endMark = k;
  if (p.written <= p.read) p.state = "idle";
  else if (p.state === "idle") p.state = "prebuffering";
  return dropped;
}

/** The rules driven by sample counts instead of render quanta (clients/python/playout.py's
 * `Playout`): what the scenario table runs. */
export class Playout {
  constructor(rateHz, { prebufferMs = 80, stepMs = 20, maxTargetMs = 300 } = {}) {
    this.streamRate = rateHz;
    this.targetMs = prebufferMs;
    this.stepMs = stepMs;
    this.maxTargetMs = maxTargetMs;
    this.written = 0;
    this.read = 0;
    this.played = 0;
    this.underruns = 0;
    this.drains = 0;
    this.endMark = -1;
    this.state = "idle";
  }

  get buffered() {
    return this.written - this.read;
  }

  push(n) {
    if (n <= 0) return;
    this.written += n;
    pushed(this);
  }

  end() {
    ended(this);
  }

  /** The device consumes n samples of time: [real samples played, drained now]. */
  pull(n) {
    startIfReady(this);
    if (this.state !== "playing") return [0, false];
    const k = Math.min(n, this.buffered);
    this.read += k;
    this.played += k;
    return [k, k < n && starved(this) === "drained"];
  }

  cancel() {
    cancelled(this);
    return this.played;
  }

  truncate(keep) {
    return truncated(this, keep);
  }
}

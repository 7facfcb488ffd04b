// voicegw browser client's decisions, sans I/O: overload retry (final refusal vs retry after
// retry_after_ms, capped), the reconnect loop (backoff, give-up at the deadline, final refusals),
// resume planning. No sockets, timers or clocks: times are passed in (ms), random draws come from
// `rand`. The same decisions as clients/python/core.py; clients/scenarios.json is run against
// both (tests/test_client_core.py, tests/browser/test_client_scenarios.py).
//
// Actions are plain objects, as the scenario table writes them:
//   {action: "retry", attempt, wait_ms, at_ms}        send the refused utterance again at at_ms
//   {action: "fail", code, reason}                    surface the error (reason: final |
//                                                     audio_received | attempts_exhausted |
//                                                     cancelled | not_resumable)
//   {action: "reconnect", attempt, wait_ms, at_ms}    open a new connection at at_ms
//   {action: "give_up", attempts, reason}             stop reconnecting (reason: deadline | final)
//   {action: "reconnected", attempts, outage_ms}
//   {action: "resume", segment, char, sample, keep, inside}   send again from there; drop audio past
//                                                     keep; inside > 0: that many samples of the
//                                                     segment are kept, the sending goes on after them

import { PROTOCOL } from "./protocol.js";

/** Close codes after which a session is worth resuming (docs/protocol.md, close codes). */
/** The id both clients give session.start: an error that echoes it refused the session. */
export const SESSION_START_ID = "session.start";

export const RESUMABLE_CLOSES = new Set([1006, 1011, 1012, 1013]);
/** Close codes that say: do not retry. */
export const FINAL_CLOSES = new Set([1002, 1007, 1008, 1009]);
/** Handshake refusals no retry can fix (a browser rarely sees them: a failed handshake is 1006). */
export const FINAL_HTTP = new Set([400, 401, 403, 404, 405]);
/** Utterance errors worth sending the utterance again for; any other is a final refusal. */
export const RETRYABLE_ERRORS = new Set(["engine_overloaded"]);

/** Defaults of opts.retry (docs/clients.md). */
export const DEFAULT_RETRY = Object.freeze({
  overloadAttempts: 3, // attempts in all for an utterance refused before any of its audio
  overloadMaxWaitMs: 5000, // cap on one overload wait (the server's retry_after_ms, jittered)
  reconnect: true, // reconnect and resume after a dropped connection
  reconnectInitialMs: 250, // first backoff wait, doubling per failed attempt
  reconnectMaxMs: 5000, // cap on one backoff wait
  reconnectTimeoutMs: 60000, // give up this long after the drop
  jitter: 0.2, // each wait times a random factor in [1 - jitter, 1 + jitter]
  maxBufferedChars: 20000, // text kept per utterance while it cannot be sent
});

/** A policy from the Python names (RetryPolicy's fields, as the scenario table writes them). */
export function policyFromJson(d) {
  const names = {
    overload_attempts: "overloadAttempts",
    overload_max_wait_ms: "overloadMaxWaitMs",
    reconnect: "reconnect",
    reconnect_initial_ms: "reconnectInitialMs",
    reconnect_max_ms: "reconnectMaxMs",
    jitter: "jitter",
    max_buffered_chars: "maxBufferedChars",
  };
  const out = { ...DEFAULT_RETRY };
  for (const [k, v] of Object.entries(d || {})) {
    if (k === "reconnect_timeout_s") out.reconnectTimeoutMs = v * 1000;
    else if (names[k]) out[names[k]] = v;
  }
  return out;
}

export function jitteredMs(policy, ms, rand = Math.random) {
  return Math.max(0, ms * (1 + policy.jitter * (2 * rand() - 1)));
}

/** Wait before reconnect attempt `attempt` (1-based). */
export function backoffMs(policy, attempt, rand = Math.random) {
  const base = Math.min(policy.reconnectMaxMs, policy.reconnectInitialMs * 2 ** Math.max(0, attempt - 1));
  return jitteredMs(policy, base, rand);
}

/**
 * An `error` about an utterance arrived: send it again, or let it fail. Retried only for a
 * retryable code (engine_overloaded), before any of its audio arrived, while attempts are left;
 * the wait is the server's retry_after_ms (else reconnectInitialMs), jittered, capped at
 * overloadMaxWaitMs.
 */
export function overloadDecision(policy, msg, { attempts, receivedSamples, nowMs, rand = Math.random, cancelled = false }) {
  const code = String(msg.code);
  if (!RETRYABLE_ERRORS.has(code) || msg.fatal) return { action: "fail", code, reason: "final" };
  if (cancelled) return { action: "fail", code, reason: "cancelled" };
  if (receivedSamples > 0) return { action: "fail", code, reason: "audio_received" };
  if (attempts >= policy.overloadAttempts) return { action: "fail", code, reason: "attempts_exhausted" };
  const base = typeof msg.retry_after_ms === "number" ? msg.retry_after_ms : policy.reconnectInitialMs;
  const waitMs = Math.min(policy.overloadMaxWaitMs, jitteredMs(policy, base, rand));
  return { action: "retry", attempt: attempts + 1, wait_ms: waitMs, at_ms: nowMs + waitMs };
}

/** A failed connection attempt is final when no retry can fix it. */
export function isFinalFailure(failure) {
  return FINAL_HTTP.has(failure.status) || FINAL_CLOSES.has(failure.close_code);
}

/** The reconnect loop's decisions for one outage. */
export class Reconnector {
  constructor(policy, rand = Math.random) {
    this.policy = policy;
    this.rand = rand;
    this.attempt = 0;
    this.tDropMs = null;
    this.deadlineMs = 0;
    this.lastError = "";
  }

  resumable(code, { sessionStarted = true, closing = false } = {}) {
    return !!(this.policy.reconnect && sessionStarted && !closing && (code == null || RESUMABLE_CLOSES.has(code)));
  }

  /** The connection dropped (close code; null: no close frame). */
  lost(code, nowMs, opts = {}) {
    if (!this.resumable(code, opts)) return { action: "fail", code: "closed", reason: "not_resumable" };
    this.attempt = 0;
    this.tDropMs = nowMs;
    this.deadlineMs = nowMs + this.policy.reconnectTimeoutMs;
    this.lastError = "";
    return this._next(nowMs);
  }

  /** An attempt failed: {status?, close_code?, retry_after_ms?, error?}. */
  failed(failure, nowMs) {
    this.lastError = failure.error || "";
    if (isFinalFailure(failure)) return { action: "give_up", attempts: this.attempt, reason: "final" };
    let t = nowMs;
    if (typeof failure.retry_after_ms === "number") {
      t = nowMs + Math.max(0, Math.min(failure.retry_after_ms, this.deadlineMs - nowMs));
    }
    return this._next(t);
  }

  connected(nowMs) {
    const tDrop = this.tDropMs ?? nowMs;
    return { action: "reconnected", attempts: this.attempt, outage_ms: Math.round(nowMs - tDrop) };
  }

  _next(t) {
    this.attempt += 1;
    const waitMs = backoffMs(this.policy, this.attempt, this.rand);
    if (t + waitMs > this.deadlineMs) return { action: "give_up", attempts: this.attempt, reason: "deadline" };
    return { action: "reconnect", attempt: this.attempt, wait_ms: waitMs, at_ms: t + waitMs };
  }
}

/**
 * Whether the server (session.started's `resume`: mode) can go on with `seg` at its next sample:
 * "samples" always, "codes" when its codes (codeFrames) cover every sample received.
 */
export function canResumeInside(seg, mode, rateHz) {
  const n = seg.samples ?? seg.play.samples;
  if (n <= 0) return false;
  if (mode === "samples") return true;
  const c = PROTOCOL.codes;
  return mode === "codes" && (seg.codeFrames || 0) * c.samples_per_frame * rateHz >= n * c.native_rate_hz;
}

/**
 * Where an unfinished utterance is sent again from: its first segment not wholly received (from
 * the current sending's first, segBase), at its next sample when the server can go on inside it
 * (canResumeInside), else at its start (its audio dropped); with none seen, the sending's start;
 * past the last whole one, its end. `segs`: Map index -> {startChar, endChar, sampleOffset,
 * samples (or play.samples), done, pos, codeFrames}.
 */
export function planResume(segs, { segBase, baseChar, sampleBase, mode = "segment", rateHz = 24000 }) {
  let k = segBase;
  while (segs.has(k) && segs.get(k).done) k++;
  const seg = segs.get(k);
  if (seg && canResumeInside(seg, mode, rateHz)) {
    const n = seg.samples ?? seg.play.samples;
    return { action: "resume", segment: k, char: seg.startChar, sample: seg.sampleOffset + n, keep: null, inside: n };
  }
  if (seg) return { action: "resume", segment: k, char: seg.startChar, sample: seg.sampleOffset, keep: seg.pos ?? null, inside: 0 };
  const prev = segs.get(k - 1);
  if (prev) {
    const n = prev.samples ?? prev.play.samples;
    return { action: "resume", segment: k, char: prev.endChar, sample: prev.sampleOffset + n, keep: null, inside: 0 };
  }
  return { action: "resume", segment: k, char: baseChar, sample: sampleBase, keep: null, inside: 0 };
}

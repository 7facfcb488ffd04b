"""Chunk pacing regression: the decoder's chunk policy against a client jitter buffer (pure, fast).

A stream from an engine at ``rate_x`` times real time is decoded by ``ChunkPolicy`` (lazy pull:
the policy is consulted when a step arrives or a forward returns; one forward in flight, each
taking ``decode_ms`` plus a periodic jitter), and played by the load test's ``ClockedPlayout``
(80 ms prebuffer, like the browser client). The old rule (chunk size doubling with the audio
emitted, ``lead_steps=None``) underruns at every stream start once the engine is under 2x real
time (the H200 gateway runs: bench/results/gpu-2026-11-30); following the stream's lead does not.
"""

from __future__ import annotations

import pytest

from clients.python.playout import ClockedPlayout
from engine.api import NATIVE_SAMPLE_RATE_HZ, SAMPLES_PER_STEP
from engine.decoder.window import ChunkPolicy, StreamLead

STEP_S = SAMPLES_PER_STEP / NATIVE_SAMPLE_RATE_HZ


def simulate(rate_x: float, lead_aware: bool, lookahead: int, *, steps: int = 600, decode_ms: float = 15.0,
             jitter_ms: float = 30.0, ttft_s: float = 0.04) -> tuple[int, list[int]]:
    """Underruns heard, and the audible steps of each chunk."""
    policy = ChunkPolicy(first_chunk_steps=6, chunk_steps=16, lookahead_steps=lookahead)
    lead = StreamLead(STEP_S)
    jb = ClockedPlayout(NATIVE_SAMPLE_RATE_HZ)
    jb.begin_utterance(0.0)
    arrivals = [ttft_s + k * STEP_S / rate_x for k in range(steps)]
    received = decoded = audible_done = pushes = 0
    in_flight: tuple[float, int, bool] | None = None  # (done at, steps pushed, last)
    check = False
    chunks: list[int] = []
    t = 0.0
    while t < arrivals[-1] + 30.0:
        t = round(t + 0.001, 6)
        while received < steps and arrivals[received] <= t:
            received += 1
            check = True
        if in_flight is not None and in_flight[0] <= t:
            _, n, last = in_flight
            in_flight = None
            decoded += n
            audible = steps if last else policy.audible_steps(decoded)
            new = audible - audible_done
            audible_done = audible
            if new:
                chunks.append(new)
                lead.emitted(new, t)
                jb.push(t, new * SAMPLES_PER_STEP)
            if last:
                jb.end_of_audio(t)
                break
            check = True
        if in_flight is None and check:
            check = False
            final = received == steps
            n = policy.push_steps(received, decoded, final, lead.lead_steps(t) if lead_aware else None)
            last = final and decoded + n == received
            if n or last:
                pushes += 1
                jitter = jitter_ms if pushes % 3 == 0 else 0.0
                in_flight = (t + (decode_ms + jitter) / 1000.0, n, last)
    jb.advance(t)
    return jb.underrun_count, chunks


@pytest.mark.parametrize("rate_x", [1.17, 1.4, 1.9])
@pytest.mark.parametrize("lookahead", [4, 52])
def test_lead_policy_never_underruns(rate_x: float, lookahead: int) -> None:
    under, chunks = simulate(rate_x, lead_aware=True, lookahead=lookahead)
    assert under == 0, chunks[:12]
    assert chunks[0] == 6  # TTFA unchanged: the first chunk is still first_chunk_steps
    assert max(chunks[:-1]) == 16  # chunks still grow to chunk_steps once the stream is ahead


@pytest.mark.parametrize("rate_x", [1.17, 1.4])
def test_doubling_policy_underruns_under_2x(rate_x: float) -> None:
    """The rule the lead replaced: documents why (margin E * (1 - 2/r) before each chunk)."""
    under, chunks = simulate(rate_x, lead_aware=False, lookahead=4)
    assert chunks[:4] == [6, 6, 12, 16]
    assert under > 0


def test_push_cap_splits_a_backlog() -> None:
    p = ChunkPolicy(first_chunk_steps=6, chunk_steps=16, lookahead_steps=4)
    assert p.push_steps(200, 0, False) == 200  # before the first audio: everything (TTFA)
    assert p.push_steps(300, 100, False, lead_steps=40.0) == 32  # after it: 2 * chunk_steps at most
    assert p.push_steps(300, 100, True) == 200  # the end: everything
    assert p.push_steps(104, 100, False, lead_steps=40.0) == 0  # 4 new steps: not due (lead 40 -> 16)
    assert p.push_steps(104, 100, False, lead_steps=2.0) == 4  # lead nearly gone: min_chunk_steps


def test_stream_lead() -> None:
    lead = StreamLead(STEP_S)
    assert lead.lead_steps(1.0) is None
    lead.emitted(6, 1.0)
    assert lead.lead_steps(1.0) == pytest.approx(6)
    assert lead.lead_steps(1.0 + 3 * STEP_S) == pytest.approx(3)
    lead.emitted(0, 5.0)
    assert lead.t_first_s == 1.0

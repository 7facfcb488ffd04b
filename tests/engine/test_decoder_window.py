"""The decoder's pure windowing core (engine.decoder.window), checked with numpy only."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.decoder.window import (
    ChunkPolicy,
    DecoderGeometry,
    Reach,
    StreamLead,
    WindowSpec,
    conv_reach,
)


def test_core_is_pure() -> None:
    """The core imports only the standard library (the ``engine`` package itself pulls torch in
    through its torchaudio shim, so check the module's own imports)."""
    import ast

    import engine.decoder.window as mod

    tree = ast.parse(open(mod.__file__).read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add((node.module or "").split(".")[0])
    assert names <= {"__future__", "collections", "dataclasses"}, names


def test_conv_reach() -> None:
    assert conv_reach(3, 1, 1) == Reach(1, 1)
    assert conv_reach(7, 2, 6) == Reach(6, 6)  # DVAE ConvNeXt depthwise conv
    assert conv_reach(7, 1, 3) == Reach(3, 3)  # Vocos
    assert conv_reach(1, 1, 0) == Reach(0, 0)
    with pytest.raises(ValueError):
        conv_reach(3, 1, 1, stride=2)
    with pytest.raises(ValueError):
        conv_reach(4, 1, 1)  # changes the length


def test_chattts_geometry() -> None:
    """Full ChatTTS: conv_in 2x(k3) + 12 ConvNeXt (k7, d2) + out_conv k3 + Vocos embed k7 + 8 ConvNeXt k7."""
    dvae = [conv_reach(3, 1, 1)] * 2 + [conv_reach(7, 2, 6)] * 12 + [conv_reach(1, 1, 0), conv_reach(3, 1, 1)]
    vocos = [conv_reach(7, 1, 3)] * 9
    g = DecoderGeometry(2, tuple(dvae + vocos), n_fft=1024, hop=256)
    assert g.reach == Reach(102, 102)
    assert g.samples_per_step == 512
    assert g.exact_lookahead_steps == 52  # (102*256 + 512) / 512
    for t in (1, 2, 10, 469):
        assert g.whole_samples(t) == (2 * t - 1) * 256
    assert g.exact_left_steps == 52  # (102 + 1) / 2: the first sample's frames reach back 103


def _full() -> DecoderGeometry:
    dvae = [conv_reach(3, 1, 1)] * 2 + [conv_reach(7, 2, 6)] * 12 + [conv_reach(1, 1, 0), conv_reach(3, 1, 1)]
    return DecoderGeometry(2, tuple(dvae + [conv_reach(7, 1, 3)] * 9), n_fft=1024, hop=256)


@example(chunk=1, la=0, pushes=[1, 0])  # found by CI: a stream that ends with no new step
@settings(max_examples=80, deadline=None)
@given(chunk=st.integers(1, 20), la=st.integers(0, 60), pushes=st.lists(st.integers(0, 40), min_size=1, max_size=12))
def test_rows_cover_each_step_once(chunk: int, la: int, pushes: list[int]) -> None:
    """Emissions cut into rows: contiguous, at most ``chunk`` steps, every window reaching at least
    ``la`` steps past its row (or to the end), and the samples add up to the whole decode's."""
    g = _full()
    spec = WindowSpec(g, chunk, la)
    received = emitted = total = 0
    for i, n in enumerate(pushes):
        received += n
        final = i == len(pushes) - 1
        # what the stream emits (ChunkPolicy.emit_steps): the newest step waits for the end
        target = received if final else max(emitted, ChunkPolicy(1, chunk, la).emit_steps(received))
        rows = spec.rows(emitted, target, received, final)
        pos = emitted
        for r in rows:
            assert r.start == pos and 1 <= r.steps <= chunk
            assert r.end == min(received, r.start + chunk + la) >= min(received, r.start + r.steps + la)
            assert r.start - spec.left_steps + spec.window_steps >= r.end  # the window holds its input
            total += r.samples
            pos += r.steps
        assert pos == target
        emitted = target
    assert total == g.whole_samples(received)


def test_window_spec_shape() -> None:
    g = _full()
    assert g.exact_left_steps == 52
    exact = WindowSpec(g, 16, 52)
    assert exact.exact and exact.xfade == 0 and exact.window_steps == 120
    la4 = WindowSpec(g, 16, 4)
    assert not la4.exact and la4.window_steps == 72 and la4.out_samples == 16 * 512 + 256
    assert la4.out_offset == 52 * 512 + 512
    with pytest.raises(ValueError):
        la4.rows(5, 4, 10, False)


def test_window_left_context() -> None:
    """``left_context_steps`` shortens the window in lookahead mode only; exact mode keeps the exact
    left reach (its rows equal the whole decode), and no setting widens it past that reach."""
    g = _full()
    short = WindowSpec(g, 16, 8, left_context_steps=24)
    assert short.left_steps == 24 and short.window_steps == 48 and short.out_offset == 24 * 512 + 512
    assert WindowSpec(g, 16, 52, left_context_steps=24).left_steps == 52  # exact mode
    assert WindowSpec(g, 16, 8, left_context_steps=80).left_steps == 52
    assert WindowSpec(g, 16, 8).left_steps == 52  # -1: the exact reach
    for bad in (0, -2):
        with pytest.raises(ValueError, match="left context"):
            WindowSpec(g, 16, 8, left_context_steps=bad)


def test_chunk_policy_sequence() -> None:
    p = ChunkPolicy(first_chunk_steps=6, chunk_steps=16, lookahead_steps=10)
    assert p.first_audio_steps() == 16
    # simulate one step at a time; record the audible chunk sizes
    decoded = 0
    sizes = []
    prewarm = 0
    for received in range(1, 200):
        if p.ready(received, decoded, finished=False):
            a = p.audible_steps(received) - p.audible_steps(decoded)
            if a:
                sizes.append(a)
            else:
                prewarm += 1
            decoded = received
    assert sizes[:5] == [6, 6, 12, 16, 16]
    assert prewarm == 0  # chunk_steps > lookahead: the first chunk comes first
    p2 = ChunkPolicy(first_chunk_steps=4, chunk_steps=8, lookahead_steps=52)
    decoded = 0
    pushes = []
    for received in range(1, 60):
        if p2.ready(received, decoded, finished=False):
            pushes.append(received)
            decoded = received
    assert pushes[0] == 56  # first audio at 4 + 52 steps (windows are stateless: nothing to pre-decode)
    assert p2.ready(3, 3, finished=True)
    assert not p2.ready(3, 3, finished=False)


def test_a_stream_slower_than_real_time_gets_whole_chunks() -> None:
    """Below ``full_chunks_below_x`` times real time a chunk is ``chunk_steps`` whatever the lead (small
    chunks build no lead then and each costs the decoder a whole window); at or above it, and
    before the first audio, the lead rule and the first chunk as before."""
    p = ChunkPolicy(first_chunk_steps=2, chunk_steps=16, lookahead_steps=8, full_chunks_below_x=1.0)
    assert p.next_chunk_steps(0, 0.0, 0.5) == 2  # the first chunk is never held back
    assert p.next_chunk_steps(10, 2.0, 0.9) == 16  # slower than real time: a whole chunk
    assert p.next_chunk_steps(10, 2.0, 1.0) == 3  # keeping up: min_chunk_steps, the lead is nearly gone
    assert p.next_chunk_steps(10, 2.0, None) == 3  # rate unknown: the lead rule
    assert p.push_steps(110, 100, False, lead_steps=2.0, rate_x=0.9) == 0  # 2 audible steps: not due
    assert p.push_steps(124, 100, False, lead_steps=2.0, rate_x=0.9) == 24
    assert p.push_steps(124, 100, True, lead_steps=2.0, rate_x=0.9) == 24  # the end always runs
    off = ChunkPolicy(first_chunk_steps=2, chunk_steps=16, lookahead_steps=8)
    assert off.next_chunk_steps(10, 2.0, 0.5) == 3  # 0 (the field's default): the lead rule at every rate
    step_s = 512 / 24000
    # idle_s derives the rate from the arrival: 30 steps/s is 0.64x real time -> waits for 16
    assert p.steps_short(104, 100, 100.0, 0.64) == 16 - (104 - 8 - 92)
    with pytest.raises(ValueError):
        ChunkPolicy(2, 16, 8, full_chunks_below_x=-1.0)
    # idle_s passes the rate on: the wait covers the rest of a whole chunk, not of a lead-sized one
    assert p.idle_s(104, 100, 60.0, step_s, 30.0) == pytest.approx(0.75 * 12 / 30.0)
    assert off.idle_s(104, 100, 60.0, step_s, 30.0) == pytest.approx(0.75 * 12 / 30.0)  # lead 60 -> 16 too
    assert (p.steps_short(104, 100, 24.0, 0.64), off.steps_short(104, 100, 24.0, 0.64)) == (12, 8)


def test_stream_lead_counts_the_audio_queued_ahead() -> None:
    """``StreamLead.queued_until_s``: the listener starts on this stream once the audio ahead of it
    is played, so until then the whole wait counts as lead; nothing queued (or already played by
    the first chunk): the lead of a listener who starts on the first chunk."""
    step_s = 0.02
    plain = StreamLead(step_s)
    queued = StreamLead(step_s, queued_until_s=11.0)  # 1 s of audio ahead, submitted at 10.0
    late = StreamLead(step_s, queued_until_s=10.1)  # ran out before the first chunk came
    for lead in (plain, queued, late):
        assert lead.lead_steps(10.0) is None
        lead.emitted(4, 10.2)
    assert plain.lead_steps(10.3) == pytest.approx(4 - 5)
    assert late.lead_steps(10.3) == pytest.approx(4 - 5)
    assert queued.lead_steps(10.3) == pytest.approx(4 + 35)  # 0.7 s of the queue left + 4 steps
    assert queued.lead_steps(11.06) == pytest.approx(4 - 3)
    p = ChunkPolicy(first_chunk_steps=2, chunk_steps=16, lookahead_steps=8)
    assert p.next_chunk_steps(4, queued.lead_steps(10.3)) == 16  # whole chunks from the start
    assert p.next_chunk_steps(4, plain.lead_steps(10.3)) == p.min_chunk_steps


def test_idle_s_reads_once_per_chunk_without_moving_a_forward() -> None:
    """The wait before the code stream is read again (ChunkPolicy.idle_s): none before the first
    audio or when a forward is due; with a comfortable lead, about the time the engine needs for
    the rest of the next chunk, and never into the last COALESCE_MARGIN_S of the lead."""
    from engine.decoder.window import COALESCE_MARGIN_S, COALESCE_MAX_S

    p = ChunkPolicy(first_chunk_steps=4, chunk_steps=16, lookahead_steps=8)
    step_s = 512 / 24_000
    assert p.idle_s(5, 0, None, step_s, 100.0) == 0.0  # before the first audio
    # 40 decoded (32 audible), lead 60 steps: the next chunk wants 16 audible steps
    assert p.steps_short(40, 40, 60.0) == 16
    w = p.idle_s(40, 40, 60.0, step_s, 100.0)
    assert w == pytest.approx(0.75 * 16 / 100.0)
    assert not p.ready(40 + int(w * 100.0), 40, finished=False, lead_steps=60.0 - w / step_s)
    assert p.idle_s(56, 40, 60.0, step_s, 100.0) == 0.0  # due now
    assert p.idle_s(40, 40, 60.0, step_s, None) == 0.0  # no rate yet
    # a slow engine: the wait is capped by the lead, which keeps its margin
    lead = 30.0
    w = p.idle_s(40, 40, lead, step_s, 5.0)
    assert 0 < w <= 0.5 * (lead * step_s - COALESCE_MARGIN_S) + 1e-9
    assert lead * step_s - w >= COALESCE_MARGIN_S
    assert p.idle_s(40, 40, 10.0, step_s, 5.0) == 0.0  # lead under the margin: read at once
    assert p.idle_s(40, 40, 1e6, step_s, 1.0) == COALESCE_MAX_S

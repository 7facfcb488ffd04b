"""The decoder's pure windowing core (engine.decoder.window), checked with numpy only."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.decoder.window import (
    ChunkPolicy,
    DecoderGeometry,
    OlaWindow,
    Reach,
    StackWindow,
    conv_reach,
    total_reach,
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
    # after n steps (not final) exactly n - 52 steps of audio are final
    assert g.exact_samples(52) == 0
    assert g.exact_samples(60) == 8 * 512


def _conv_valid(x: np.ndarray, w: np.ndarray, dil: int) -> np.ndarray:
    k = len(w)
    span = dil * (k - 1)
    n = len(x) - span
    return np.array([sum(w[i] * x[t + i * dil] for i in range(k)) for t in range(max(0, n))])


def _conv_padded(x: np.ndarray, w: np.ndarray, dil: int, pad: int) -> np.ndarray:
    return _conv_valid(np.concatenate([np.zeros(pad), x, np.zeros(pad)]), w, dil)


def _schedule(n: int, pushes: list[int], extra_final: bool) -> list[tuple[int, bool]]:
    """Push sizes covering ``n`` items (zero-size pushes included), the last one final; with
    ``extra_final`` the final push is a separate empty one."""
    sizes = []
    pos = i = 0
    while pos < n:
        k = min(pushes[i % len(pushes)] or (1 if i > 50 else 0), n - pos)
        sizes.append(k)
        pos += k
        i += 1
    if extra_final or not sizes:
        sizes.append(0)
    return [(k, j == len(sizes) - 1) for j, k in enumerate(sizes)]


def _layers_strategy():  # type: ignore[no-untyped-def]
    return st.lists(st.tuples(st.sampled_from([1, 3, 5, 7]), st.integers(1, 3)), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(
    layers=_layers_strategy(),
    n=st.integers(0, 60),
    pushes=st.lists(st.integers(0, 9), min_size=1, max_size=30),
    seed=st.integers(0, 2**16),
)
def test_stack_window_equals_whole_convolution(
    layers: list[tuple[int, int]], n: int, pushes: list[int], seed: int
) -> None:
    """Streaming a chain of padded convolutions (with a nonlinearity between) through the
    window core gives exactly the whole-sequence result, each output once."""
    rng = np.random.default_rng(seed)
    ws = [rng.normal(size=k) for k, _ in layers]
    reaches = [conv_reach(k, d, d * (k // 2)) for k, d in layers]
    x = rng.normal(size=n)
    whole = x
    for (k, d), w in zip(layers, ws, strict=True):
        whole = np.tanh(_conv_padded(whole, w, d, d * (k // 2)))

    stack = StackWindow(reaches)
    caches: list[np.ndarray] = [np.zeros(0) for _ in layers]
    out: list[np.ndarray] = []
    pos = 0
    for step_n, final in _schedule(n, pushes, extra_final=seed % 2 == 0):
        new = x[pos : pos + step_n]
        pos += step_n
        steps = stack.push(step_n, final)
        for li, ((_k, d), w, s) in enumerate(zip(layers, ws, steps, strict=True)):
            assert s.n_new == len(new)
            body = np.concatenate([np.zeros(s.pad_left), caches[li], new])
            assert s.cached == len(caches[li])
            caches[li] = body[len(body) - s.keep :] if s.keep else np.zeros(0)
            win = np.concatenate([body, np.zeros(s.pad_right)])
            new = np.tanh(_conv_valid(win, w, d)) if s.runs else np.zeros(0)
            assert len(new) == s.n_out
        out.append(new)
    got = np.concatenate(out)
    assert len(got) == len(whole)
    np.testing.assert_allclose(got, whole, atol=1e-12)
    assert stack.lookahead == total_reach(reaches).right


def _ola_whole(frames: np.ndarray, win: np.ndarray, hop: int) -> np.ndarray:
    nf, n_fft = frames.shape
    total = (nf - 1) * hop + n_fft
    y = np.zeros(total)
    env = np.zeros(total)
    for f in range(nf):
        y[f * hop : f * hop + n_fft] += frames[f] * win
        env[f * hop : f * hop + n_fft] += win**2
    t = n_fft // 2
    return y[t : total - t] / env[t : total - t]


@settings(max_examples=40, deadline=None)
@given(nf=st.integers(1, 30), pushes=st.lists(st.integers(0, 5), min_size=1, max_size=10), seed=st.integers(0, 999))
def test_ola_window_equals_istft(nf: int, pushes: list[int], seed: int) -> None:
    n_fft, hop = 16, 4
    rng = np.random.default_rng(seed)
    win = np.hanning(n_fft + 1)[:-1]  # periodic Hann, as torch.hann_window
    frames = rng.normal(size=(nf, n_fft))
    whole = _ola_whole(frames, win, hop)
    ola = OlaWindow(n_fft, hop)
    acc = np.zeros(n_fft - hop)
    env = np.zeros(n_fft - hop)
    out = []
    f = 0
    for k, final in _schedule(nf, pushes, extra_final=seed % 2 == 0):
        step = ola.push(k, final)
        if k:
            acc = np.concatenate([acc, np.zeros(k * hop)])
            env = np.concatenate([env, np.zeros(k * hop)])
            off = len(acc) - ((k - 1) * hop + n_fft)
            for j in range(k):
                acc[off + j * hop : off + j * hop + n_fft] += frames[f + j] * win
                env[off + j * hop : off + j * hop + n_fft] += win**2
        a, b = step.drop, step.drop + step.emit
        out.append(acc[a:b] / env[a:b] if step.emit else np.zeros(0))
        acc, env = acc[b:], env[b:]
        f += k
    got = np.concatenate(out)
    assert len(got) == (nf - 1) * hop == ola.samples_for(nf)
    np.testing.assert_allclose(got, whole, atol=1e-9)


def test_ola_nothing_final_before_first_frames() -> None:
    ola = OlaWindow(1024, 256)
    s = ola.push(2)
    assert (s.drop, s.emit) == (512, 0)  # abs frontier 512 = the centre trim: nothing yet
    s = ola.push(1)
    assert (s.drop, s.emit) == (0, 256)
    s = ola.push(0, final=True)
    assert s.emit == (3 - 1) * 256 - 256


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
    assert pushes[:6] == [8, 16, 24, 32, 40, 48]  # pre-decoding the context
    assert 56 in pushes  # first audio at 4 + 52 steps
    assert p2.ready(3, 3, finished=True)
    assert not p2.ready(3, 3, finished=False)

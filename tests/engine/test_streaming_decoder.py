"""Streaming decoder (engine.decoder): streamed == whole-sequence decode, batched == alone,
both vocoding paths (codes -> DVAE, hidden states -> Decoder), on tiny and full-size random
checkpoints; the derived receptive field is the network's true dependency set; upstream's
``Chat._decode_to_wavs`` is the oracle for the whole decode; ChatTTSSpeech over a fake
CodeEngine (chunking, flow control, sample rates, abort).

"full" here is the released model's DVAE / Decoder / Vocos shapes (the GPT and the DVAE
encoder, which decoding never touches, are shrunk so the fixture writes 335 MB instead of
1.1 GB). Layer scales are randomised ("spiced") so that distant frames matter: upstream's
random init (DVAE layer scale 1e-6) makes the deep stack almost an identity.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.api import AudioChunk, CodeFrames, EngineHealth, SpeechRequest
from engine.audio_format import float_to_pcm16
from engine.checkpoint import FULL, make_checkpoint
from engine.config import EngineConfig
from engine.decoder import ChunkPolicy, Reach
from engine.decoder.client import DecoderClient, DecoderSettings
from engine.decoder.nets import Vocoder, load_vocoder, stage_reaches
from engine.decoder.window import WindowSpec
from engine.decoder.windowed import WindowDecoder
from engine.decoder.worker import FLAG_FINAL, FLAG_RESET, STATUS_BAD_INPUT, STATUS_OK, WorkerCore
from engine.speech import ChatTTSSpeech, build_decoder
from loadtest.fakes import FakeCodeEngine

TOL = 1e-4

# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():  # type: ignore[no-untyped-def]
    """Small streaming windows gain nothing from intra-op threads, and on a shared 2-core
    machine OpenMP barriers make them ~10x slower; restored after the module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _spice(src: Path, dst: Path, seed: int) -> Path:
    """Copy a checkpoint with random layer scales in U(0.2, 1) (DVAE/Decoder ``weight``,
    Vocos ``gamma``); other files are symlinked."""
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed)
    for rel in ["asset/gpt", "asset/tokenizer", "asset/Embed.safetensors"]:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(src / rel, dst / rel)
    for name in ["DVAE", "Decoder", "Vocos"]:
        state = load_file(str(src / f"asset/{name}.safetensors"))
        for k, v in state.items():
            parts = k.split(".")
            if (len(parts) == 4 and parts[1] == "decoder_block" and parts[3] == "weight") or parts[-1] == "gamma":
                state[k] = 0.2 + 0.8 * torch.rand(v.shape, generator=gen)
        save_file(state, str(dst / f"asset/{name}.safetensors"))
    return dst


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("decoder_ckpt")
    full_spec = dataclasses.replace(
        FULL, gpt_layers=1, gpt_intermediate=256, gpt_vocab=256, dvae_enc_layers=1, dvae_enc_hidden=32
    )
    full = make_checkpoint(root / "full", full_spec, seed=0)
    return {
        "tiny": _spice(tiny_model_dir, root / "tiny_spiced", 1),
        "full": _spice(full, root / "full_spiced", 2),
    }


@pytest.fixture(scope="module")
def upstream_chats(model_dirs: dict[str, Path]) -> dict[str, object]:
    from tests.upstream import load_upstream_chat

    return {size: load_upstream_chat(d) for size, d in model_dirs.items()}


@pytest.fixture(scope="module")
def vocoders(model_dirs: dict[str, Path]) -> dict[tuple[str, str], Vocoder]:
    return {
        (size, path): load_vocoder(d, use_hidden=(path == "hidden"))
        for size, d in model_dirs.items()
        for path in ("codes", "hidden")
    }


def _inputs(voc: Vocoder, steps: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if voc.uses_codes:
        return rng.integers(0, 625, (steps, 4))
    return rng.normal(size=(steps, voc.front.step_dim)).astype(np.float32)


def _whole(voc: Vocoder, x: np.ndarray) -> np.ndarray:
    return voc.decode_whole(torch.from_numpy(x)).numpy()


def _core(voc: Vocoder, la: int, chunk: int = 16, max_batch: int = 8, slots: int = 4, left: int = -1) -> WorkerCore:
    """The decoder process's core, in this process (no socket)."""
    g = voc.geometry
    la = g.exact_lookahead_steps if la < 0 else la
    spec = WindowSpec(g, chunk, la, left_context_steps=left)
    dec = WindowDecoder(voc, spec, max_batch)
    dec.warm_up()
    out = np.zeros((slots, 4 * chunk * g.samples_per_step), np.float32)
    dtype = np.int64 if voc.uses_codes else np.float32
    return WorkerCore(spec, dec.run, out, voc.front.step_dim, dtype, max_batch, 4096, 625 if voc.uses_codes else None)


def _stream(core: WorkerCore, x: np.ndarray, sizes: list[int], slot: int = 0) -> tuple[np.ndarray, list[int]]:
    """Push ``x`` in pieces of ``sizes`` (targets: what the lookahead allows), collect the samples."""
    parts = []
    pos = 0
    la = core.spec.lookahead_steps
    emitted = 0
    for i, k in enumerate(sizes):
        final = pos + k >= len(x)
        target = pos + k if final else max(emitted, pos + k - la)
        # an emission longer than a job's output holds is cut into several jobs, as the client does
        first = True
        while True:
            tgt = min(target, emitted + core.out_cap_steps)
            fin = final and tgt == target
            flags = (FLAG_FINAL if fin else 0) | (FLAG_RESET if (i == 0 and first) else 0)
            res = core.submit(7, slot, x[pos : pos + k] if first else x[:0], tgt, flags)
            first = False
            if res is None:
                done = []
                while not done:
                    done = core.step()
                assert done == [(7, STATUS_OK, done[0][2])]
                n = done[0][2]
            else:
                assert res[0] == STATUS_OK
                n = res[1]
            parts.append(core.out[slot, :n].copy())
            emitted = tgt
            if tgt == target:
                break
        pos += k
    seams = list(np.cumsum([len(p) for p in parts])[:-1])
    return np.concatenate(parts) if parts else np.zeros(0, np.float32), seams


def _sizes(steps: int, chunk: int, first: int | None = None) -> list[int]:
    out: list[int] = []
    pos = 0
    while pos < steps or not out:
        k = min(first if (first and not out) else chunk, steps - pos)
        out.append(k)
        pos += k
    return out


# --------------------------------------------------------------------------- receptive field


@pytest.mark.parametrize("size", ["tiny", "full"])
def test_receptive_field_derived_from_modules(size: str, vocoders: dict, upstream_chats: dict) -> None:
    """Our stage list walks the same convolutions as upstream's modules (kernel, dilation, padding)."""
    chat: Any = upstream_chats[size]
    ups_dvae = stage_reaches(chat.dvae.decoder) + stage_reaches(chat.dvae.out_conv)
    ups_dec = stage_reaches(chat.decoder.decoder) + stage_reaches(chat.decoder.out_conv)
    ups_vocos = stage_reaches(chat.vocos.backbone)

    def total(rs: list[Reach]) -> Reach:
        return Reach(sum(r.left for r in rs), sum(r.right for r in rs))

    for path, ups in (("codes", ups_dvae), ("hidden", ups_dec)):
        g = vocoders[(size, path)].geometry
        assert g.reach == total(ups) + total(ups_vocos)
        assert [r for r in g.stage_reaches if r.span] == [r for r in ups + ups_vocos if r.span]
    if size == "full":
        g = vocoders[("full", "codes")].geometry
        assert g.reach == Reach(102, 102)  # 2 + 12*6 + 1 (DVAE) + 3 + 8*3 (Vocos), mel frames
        assert g.exact_lookahead_steps == 52
        assert vocoders[("full", "hidden")].geometry.exact_lookahead_steps == 52


@pytest.mark.parametrize("path", ["codes", "hidden"])
def test_receptive_field_is_the_true_dependency_set(path: str, model_dirs: dict) -> None:
    """Autograd in float64: an output sample depends on exactly the input frames the derived
    reach (plus the ISTFT's frame coverage) says, no more, no fewer."""
    v64 = load_vocoder(model_dirs["tiny"], use_hidden=(path == "hidden")).double()
    r = v64.geometry.reach
    n_frames = 160
    hop, n_fft = v64.hop, v64.n_fft
    frames = torch.randn(1, v64.front.in_dim, n_frames, dtype=torch.float64, requires_grad=True)
    y = frames
    for s in v64.stages:
        y = s.padded(y)
    audio = v64.overlap_add(y)[0]
    for j in (5000, 20000 + 77, 30000 + 3):
        p = j + n_fft // 2  # absolute position; not a multiple of hop (w[0] = 0 would hide a frame)
        assert p % hop
        (g,) = torch.autograd.grad(audio[j], frames, retain_graph=True)
        dep = torch.nonzero(g[0].abs().sum(0)).flatten()
        f_lo = -(-(p - n_fft + 1) // hop)  # frames covering p: f*hop <= p < f*hop + n_fft
        f_hi = p // hop
        assert int(dep.min()) == max(0, f_lo - r.left)
        assert int(dep.max()) == min(n_frames - 1, f_hi + r.right)


# --------------------------------------------------------------------------- whole decode


@pytest.mark.parametrize("size", ["tiny", "full"])
def test_whole_decode_matches_upstream(size: str, vocoders: dict, upstream_chats: dict) -> None:
    """Our plain-torch whole decode == upstream ``Chat._decode_to_wavs`` (both paths), and T steps
    give (2T-1)*256 samples."""
    chat: Any = upstream_chats[size]
    for path in ("codes", "hidden"):
        voc = vocoders[(size, path)]
        for steps in (1, 7, 60):
            x = _inputs(voc, steps, seed=steps)
            ours = _whole(voc, x)
            ups = chat._decode_to_wavs([torch.from_numpy(x)], path == "hidden")
            assert ups.shape == (1, (2 * steps - 1) * 256) == (1, ours.shape[0])
            assert voc.geometry.whole_samples(steps) == ours.shape[0]
            np.testing.assert_allclose(ours, ups[0], atol=TOL)


# --------------------------------------------------------------------------- streaming == whole

CASES = [
    ("tiny", 1, [1, 3]),
    ("tiny", 2, [1, 3]),
    ("tiny", 13, [1, 4, 16]),
    ("tiny", 100, [1, 3, 7, 16]),
    ("full", 1, [1]),
    ("full", 37, [1, 6, 16]),
    ("full", 150, [4, 16, 24]),
]


@pytest.mark.parametrize("path", ["codes", "hidden"])
@pytest.mark.parametrize(("size", "steps", "chunks"), CASES)
def test_streamed_equals_whole(size: str, steps: int, chunks: list[int], path: str, vocoders: dict) -> None:
    """Exact mode: the windows' samples are the whole decode's, whatever the pieces."""
    voc = vocoders[(size, path)]
    core = _core(voc, -1)
    x = _inputs(voc, steps, seed=steps * 7 + len(path))
    whole = _whole(voc, x)
    assert whole.shape[0] == (2 * steps - 1) * 256
    for chunk in chunks:
        out, seams = _stream(core, x, _sizes(steps, chunk, first=max(1, chunk // 2)))
        assert out.shape == whole.shape
        err = np.abs(out - whole)
        assert err.max() <= TOL, (chunk, float(err.max()))
        for s in seams:
            if 0 < s < len(out):
                assert abs((out[s] - out[s - 1]) - (whole[s] - whole[s - 1])) <= 2 * TOL


def test_streamed_single_final_push_and_empty(vocoders: dict) -> None:
    voc = vocoders[("tiny", "codes")]
    core = _core(voc, -1)
    x = _inputs(voc, 40, seed=3)
    np.testing.assert_allclose(_stream(core, x, [40])[0], _whole(voc, x), atol=TOL)
    assert core.submit(1, 1, x[:0], 0, FLAG_FINAL | FLAG_RESET) == (STATUS_OK, 0)
    assert core.submit(2, 2, x[:5], 0, FLAG_RESET) == (STATUS_OK, 0)  # nothing exact yet (lookahead 13)
    assert core.submit(3, 3, np.full((2, 4), 625), 0, FLAG_RESET) == (STATUS_BAD_INPUT, 0)  # EOS is no code


def test_exact_emission_follows_geometry(vocoders: dict) -> None:
    """After n steps (not final) the samples of n - 52 steps are out, every one exact."""
    voc = vocoders[("full", "codes")]
    core = _core(voc, -1)
    x = _inputs(voc, 80, seed=5)
    whole = _whole(voc, x)
    total = 0
    for n in range(8, 80, 8):
        res = core.submit(1, 0, x[n - 8 : n], n - 52, FLAG_RESET if n == 8 else 0)
        got = core.step()[0][2] if res is None else res[1]
        np.testing.assert_allclose(core.out[0, :got], whole[total : total + got], atol=TOL)
        total += got
        assert total == max(0, (n - 52) * 512)


def test_batched_equals_alone(vocoders: dict) -> None:
    """Rows of many streams in one forward (padded to a bucket) give each stream's own samples."""
    voc = vocoders[("full", "codes")]
    core = _core(voc, 4, chunk=8, max_batch=8, slots=6)
    xs = [_inputs(voc, n, seed=n) for n in (9, 30, 31, 17, 32, 3)]  # each fits one job (32 steps)
    alone = []
    for i, x in enumerate(xs):
        alone.append(_stream(core, x, [len(x)], slot=i)[0])
    for i, x in enumerate(xs):
        assert core.submit(100 + i, i, x, len(x), FLAG_FINAL | FLAG_RESET) is None
    got: dict[int, int] = {}
    while len(got) < len(xs):
        got.update({j: n for j, _, n in core.step()})
    assert core.stats.max_batch_seen == 8 and core.stats.padded_rows == 0  # no bucket_of: nothing counted
    for i, a in enumerate(alone):
        np.testing.assert_allclose(core.out[i, : got[100 + i]], a, atol=1e-5)


def test_worker_counts_the_rows_that_fill_a_bucket(vocoders: dict) -> None:
    """Three rows in one forward run in the 4-row bucket: one padded row (the load line's
    ``decoder_padding``)."""
    voc = vocoders[("tiny", "codes")]
    spec = WindowSpec(voc.geometry, 8, 4)
    dec = WindowDecoder(voc, spec, 8)
    out = np.zeros((3, 4 * 8 * voc.geometry.samples_per_step), np.float32)
    core = WorkerCore(spec, dec.run, out, voc.front.step_dim, np.int64, 8, 4096, 625, bucket_of=dec.bucket)
    for slot in range(3):
        assert core.submit(slot, slot, _inputs(voc, 6, seed=slot), 6, FLAG_FINAL | FLAG_RESET) is None
    assert len(core.step()) == 3
    assert (core.stats.forwards, core.stats.rows, core.stats.padded_rows) == (1, 3, 1)


def test_provisional_mode(vocoders: dict) -> None:
    """lookahead below the exact value: same length, finite, first audio la steps behind the
    newest, error shrinking as the lookahead grows, no seam jump beyond what the signal does.
    (Random weights give noise-like audio: audible quality cannot be judged here; see
    bench/decoder_bench.py for the table on the full checkpoint.)"""
    voc = vocoders[("full", "codes")]
    steps = 120
    x = _inputs(voc, steps, seed=9)
    whole = _whole(voc, x)
    biggest_step = float(np.abs(np.diff(whole)).max())
    errs = {}
    for la in (0, 4, 16):
        core = _core(voc, la)
        out, seams = _stream(core, x, [12] + [8] * 14 + [steps - 12 - 8 * 14])
        assert out.shape == whole.shape
        assert np.isfinite(out).all()
        errs[la] = float(np.abs(out - whole).max())
        jumps = [abs(float(out[s] - out[s - 1])) for s in seams if 0 < s < len(out)]
        assert max(jumps) <= biggest_step, (la, max(jumps), biggest_step)
    assert errs[16] < errs[4] < errs[0]


def test_default_lookahead_deviation(vocoders: dict) -> None:
    """The default lookahead (8 steps) and left context (24 steps) with the default chunks (2, then
    16) on the full-size checkpoint with strong layer scales: within 40 dB SNR of the exact decode,
    max deviation under 3% of the peak (bench/decoder_bench.py measures 43.6 dB, 2.3%)."""
    cfg = EngineConfig()
    voc = vocoders[("full", "codes")]
    core = _core(voc, cfg.decoder_lookahead_steps, chunk=cfg.chunk_steps, left=cfg.decoder_left_steps)
    assert core.spec.left_steps == 24
    for seed in (21, 22):
        x = _inputs(voc, 150, seed=seed)
        whole = _whole(voc, x)
        first = cfg.first_chunk_steps + cfg.decoder_lookahead_steps
        out, _ = _stream(core, x, [first] + [cfg.chunk_steps] * 8 + [150 - first - 8 * cfg.chunk_steps])
        err = out - whole
        assert 10 * np.log10(np.sum(whole**2) / np.sum(err**2)) >= 40.0
        assert np.abs(err).max() <= 0.03 * np.abs(whole).max()


def test_decoder_dtype_stays_close_to_float32(vocoders: dict) -> None:
    """``engine.decoder_dtype`` float16: the stages computed in half precision under autocast, the
    overlap-add in float32, on the full-size checkpoint with strong layer scales: float32 samples
    out, within 50 dB SNR of the float32 forward (bench/decoder_bench.py's dtype section measures
    about 59 dB on CPU and GPU), rows at the utterance's start and end included."""
    voc = vocoders[("full", "codes")]
    spec = WindowSpec(voc.geometry, 16, 8)
    rng = np.random.default_rng(3)
    x = rng.integers(0, 625, (4, spec.window_steps, voc.front.step_dim))
    start = np.array([-spec.left_steps, 0, 40, 100])
    end = start + np.array([spec.window_steps, spec.window_steps, 30, spec.window_steps])
    ref = WindowDecoder(voc, spec, 4).run(x, start, end)
    out = WindowDecoder(voc, spec, 4, compute_dtype="float16").run(x, start, end)
    assert out.dtype == np.float32 and out.shape == ref.shape and np.isfinite(out).all()
    err = out - ref
    assert 10 * np.log10(np.sum(ref**2) / np.sum(err**2)) >= 50.0
    for unknown in ("bfloat16", "int8"):
        with pytest.raises(ValueError, match="compute_dtype"):
            WindowDecoder(voc, spec, 4, compute_dtype=unknown)


def test_forwards_of_different_sizes_in_one_bucket_are_independent(vocoders: dict) -> None:
    """A forward's inputs and samples pass through host buffers that every call reuses: a batch of
    one after a batch of three in the same bucket (rows left over from the larger batch are padding),
    and the three again, each give what a fresh decoder gives; the returned samples are a view that
    the next call overwrites (the decoder process copies them out before its next forward)."""
    voc = vocoders[("tiny", "codes")]
    spec = WindowSpec(voc.geometry, 16, 8)
    rng = np.random.default_rng(5)
    x = rng.integers(0, 625, (3, spec.window_steps, voc.front.step_dim))
    start = np.array([0, -spec.left_steps, 60])
    end = start + np.array([spec.window_steps, 20, spec.window_steps])
    one = (rng.integers(0, 625, (1, spec.window_steps, voc.front.step_dim)), np.array([10]), np.array([40]))
    fresh3 = WindowDecoder(voc, spec, 4).run(x, start, end).copy()
    fresh1 = WindowDecoder(voc, spec, 4).run(*one).copy()
    dec = WindowDecoder(voc, spec, 4)
    first = dec.run(x, start, end)
    np.testing.assert_array_equal(first, fresh3)
    np.testing.assert_array_equal(dec.run(*one), fresh1)
    assert not np.array_equal(first[0], fresh3[0])  # overwritten by the second call
    np.testing.assert_array_equal(dec.run(x, start, end), fresh3)


def test_default_left_context_is_float32_exact(vocoders: dict) -> None:
    """The default left context (24 of the 52 steps the reach allows), alone: with a lookahead one
    step short of exact, the streamed samples equal the whole decode's to float32 noise on the
    full-size checkpoint with strong layer scales (the reach is a bound; the dependence on distant
    input decays far sooner: docs/decoder.md, "The left context: measured"), while 8 steps would not."""
    voc = vocoders[("full", "codes")]
    g = voc.geometry
    x = _inputs(voc, 120, seed=31)
    whole = _whole(voc, x)
    snr = {}
    for left in (EngineConfig().decoder_left_steps, 8):
        core = _core(voc, g.exact_lookahead_steps - 1, left=left)
        out, _ = _stream(core, x, [10] + [16] * 6 + [120 - 10 - 96])
        snr[left] = 10 * np.log10(np.sum(whole**2) / np.sum((out - whole) ** 2))
    assert snr[24] >= 100.0 > 60.0 > snr[8], snr


def test_a_compiled_decoder_has_no_one_row_bucket(vocoders: dict) -> None:
    """torch.compile specialises a batch of one (a compile of its own at warm-up, bench/RESULTS.md):
    compiled, one row runs in the bucket of two."""
    from engine.decoder.windowed import buckets_for

    voc = vocoders[("tiny", "codes")]
    spec = WindowSpec(voc.geometry, 16, 8)
    assert buckets_for(8) == [1, 2, 4, 8] and buckets_for(8, 2) == [2, 4, 8] and buckets_for(1, 2) == [1]
    assert WindowDecoder(voc, spec, 8).buckets == [1, 2, 4, 8]
    compiled = WindowDecoder(voc, spec, 8, compile_forward=True)  # compiles at warm_up, not here
    assert compiled.buckets == [2, 4, 8] and compiled.bucket(1) == 2


def test_compiled_forward_equals_eager(vocoders: dict) -> None:
    """``engine.decoder_compile``: the torch.compile'd forward (inductor, dynamic batch) gives the
    eager forward's samples, rows at the utterance's start and end included (one bucket: a cold
    compile costs ~25 s on the CI's CPU)."""
    voc = vocoders[("tiny", "codes")]
    spec = WindowSpec(voc.geometry, 16, 8)
    rng = np.random.default_rng(4)
    x = rng.integers(0, 625, (3, spec.window_steps, voc.front.step_dim))
    start = np.array([-spec.left_steps, 0, 50])
    end = start + np.array([spec.window_steps, 30, spec.window_steps])
    eager = WindowDecoder(voc, spec, 1)
    compiled = WindowDecoder(voc, spec, 1, compile_forward=True)
    compiled.warm_up()
    for i in range(3):
        row = slice(i, i + 1)
        np.testing.assert_allclose(compiled.run(x[row], start[row], end[row]), eager.run(x[row], start[row], end[row]),
                                   atol=1e-5)


# --------------------------------------------------------------------------- the decoder process


async def _client(d: Path, **kw: Any) -> DecoderClient:
    c = DecoderClient(DecoderSettings(model_dir=str(d), **{"chunk_steps": 8, "max_batch": 8, "slots": 4, **kw}))
    await c.start()
    return c


async def test_client_streams_equal_whole(model_dirs: dict) -> None:
    """Through the worker process: concurrent streams, each equal to its whole decode; a closed
    stream's slot comes back; a slot closed mid-job is reused only after its reply."""
    from engine.decoder.nets import load_vocoder

    voc = load_vocoder(model_dirs["tiny"])
    c = await _client(model_dirs["tiny"])
    try:
        assert c.healthy and c.geometry == voc.geometry and c.info["exact"] and c.info["dtype"] == "float32"
        assert c.info["left_steps"] == voc.geometry.exact_left_steps
        xs = [_inputs(voc, n, seed=n) for n in (1, 20, 77, 130)]

        async def one(x: np.ndarray) -> np.ndarray:
            s = c.open_stream()
            parts, pos = [], 0
            for k in _sizes(len(x), 7, first=3):
                parts.append(await s.push(x[pos : pos + k], final=pos + k >= len(x)))
                pos += k
            assert s.closed
            return np.concatenate(parts)

        outs = await asyncio.gather(*(one(x) for x in xs))
        for x, out in zip(xs, outs, strict=True):
            np.testing.assert_allclose(out, _whole(voc, x), atol=TOL)
        assert c.free_slots == 4
        s = c.open_stream()
        task = asyncio.create_task(s.push(xs[3], final=True))
        await asyncio.sleep(0)
        task.cancel()
        s.close()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for _ in range(200):  # the slot comes back with the cancelled job's reply
            if c.free_slots == 4:
                break
            await asyncio.sleep(0.01)
        assert c.free_slots == 4 and (await c.worker_stats())["jobs"] >= 4
        c.refresh_worker_counters()  # the load monitor's path: no waiting, the reply lands later
        for _ in range(200):
            if c.worker_counters:
                break
            await asyncio.sleep(0.01)
        assert c.worker_counters["rows"] >= 4 and c.worker_counters["forwards"] >= 1
        assert "padded_rows" in c.worker_counters and c.worker_counters["busy_s"] > 0
        with pytest.raises(Exception, match="out of range"):
            await c.open_stream().push(np.full((2, 4), 625))
    finally:
        await c.close()


async def test_client_left_context_reaches_the_worker(model_dirs: dict) -> None:
    """``DecoderSettings.left_steps`` (``engine.decoder_left_steps``) sizes the worker's windows."""
    c = await _client(model_dirs["full"], lookahead_steps=8, left_steps=24)
    try:
        assert c.info["left_steps"] == 24 and c.info["window_steps"] == 24 + 8 + 8 and not c.info["exact"]
    finally:
        await c.close()


async def test_client_worker_death_is_unrecoverable(model_dirs: dict) -> None:
    from engine.api import EngineError, EngineErrorKind

    c = await _client(model_dirs["tiny"])
    try:
        assert c._proc is not None
        c._proc.kill()
        with pytest.raises(EngineError) as ei:  # at once (the SIGKILL pending) or at the first push
            s = c.open_stream()
            for _ in range(100):
                await s.push(np.zeros((4, 4), np.int64))
                await asyncio.sleep(0.01)
        assert ei.value.kind == EngineErrorKind.UNRECOVERABLE
        assert not c.healthy
    finally:
        await c.close()


# --------------------------------------------------------------------------- ChatTTSSpeech


async def _speech(voc: Vocoder, engine: FakeCodeEngine, **cfg_kw: object) -> ChatTTSSpeech:
    cfg = EngineConfig(**{"first_chunk_steps": 4, "chunk_steps": 8, "max_num_seqs": 8, "decoder_lookahead_steps": -1,
                          **cfg_kw})  # type: ignore[arg-type]
    sp = ChatTTSSpeech(engine, build_decoder(cfg, str(voc.model_dir)), cfg)
    await sp.start()
    return sp


async def _collect(sp: ChatTTSSpeech, req: SpeechRequest) -> list[AudioChunk]:
    return [c async for c in sp.synthesize(req)]


@pytest.mark.parametrize("path", ["codes", "hidden"])
async def test_speech_equals_whole_decode(path: str, vocoders: dict) -> None:
    voc = vocoders[("tiny", path)]
    rng = np.random.default_rng(3)
    codes = {f"r{i}": rng.integers(0, 625, (n, 4)) for i, n in enumerate((1, 20, 77))}
    hidden = {k: _inputs(voc, len(v), seed=i) for i, (k, v) in enumerate(codes.items())} if path == "hidden" else None
    eng = FakeCodeEngine(codes, piece=3, hidden=hidden)
    sp = await _speech(voc, eng, use_hidden_decoder=(path == "hidden"))
    try:
        results = await asyncio.gather(*(_collect(sp, SpeechRequest(rid, "x")) for rid in codes))
        for rid, chunks in zip(codes, results, strict=True):
            assert chunks[-1].finished and all(not c.finished for c in chunks[:-1])
            assert all(c.sample_rate_hz == 24000 and c.request_id == rid for c in chunks)
            assert sum(c.steps for c in chunks) == len(codes[rid])
            pcm = np.frombuffer(b"".join(c.pcm for c in chunks), "<i2")
            x = hidden[rid] if hidden else codes[rid]
            want = float_to_pcm16(_whole(voc, x))
            assert pcm.shape == want.shape
            assert np.abs(pcm.astype(np.int32) - want).max() <= 1
        assert eng.running == 0
        assert sp.health().healthy
    finally:
        await sp.close()


async def test_speech_first_chunk_and_flow_control(vocoders: dict) -> None:
    voc = vocoders[("tiny", "codes")]
    la = voc.geometry.exact_lookahead_steps  # 13 for tiny
    eng = FakeCodeEngine({"a": np.random.default_rng(0).integers(0, 625, (200, 4))}, piece=1)
    sp = await _speech(voc, eng)
    try:
        gen: Any = sp.synthesize(SpeechRequest("a", "x"))
        first = await gen.__anext__()
        assert len(first.pcm) == 4 * 512 * 2  # first_chunk_steps of audio
        assert eng.pulled["a"] == 4 + la  # first audio after first_chunk_steps + lookahead steps
        jobs = sp._decoder.stats.jobs
        await asyncio.sleep(0.1)  # consumer does not pull: nothing is read or decoded
        assert eng.pulled["a"] == 4 + la and sp._decoder.stats.jobs == jobs
        second = await gen.__anext__()
        # the 0.1 s pause ate the 85 ms lead of the first chunk: the next chunks are the smallest
        # (ChunkPolicy.min_chunk_steps) until the stream is ahead of real time again
        assert len(second.pcm) == sp.policy.min_chunk_steps * 512 * 2
        third = await gen.__anext__()
        assert len(third.pcm) == sp.policy.min_chunk_steps * 512 * 2
        await gen.aclose()  # consumer goes away: the code stream is closed and aborted
        assert "a" in eng.closed_iters and "a" in eng.aborted
        assert eng.running == 0
    finally:
        await sp.close()


async def test_a_stream_slower_than_real_time_gets_whole_chunks(vocoders: dict) -> None:
    """An engine at 0.7x real time per stream: after the first chunk every chunk is
    ``chunk_steps`` long (one decoder row each), not the smallest chunks its vanishing lead would
    ask for; with ``engine.full_chunks_below_x=0`` the lead rule sizes them as before."""
    voc = vocoders[("tiny", "codes")]
    codes = np.random.default_rng(5).integers(0, 625, (60, 4))
    sizes = {}
    for below_x in (1.0, 0.0):
        eng = FakeCodeEngine({"a": codes}, piece=1, step_s=0.03)  # 0.71x real time
        sp = await _speech(voc, eng, full_chunks_below_x=below_x)
        try:
            chunks = await _collect(sp, SpeechRequest("a", "x"))
        finally:
            await sp.close()
        assert sum(c.steps for c in chunks) == 60
        sizes[below_x] = [c.steps for c in chunks[1:-1]]
    assert sizes[1.0] and set(sizes[1.0]) == {8}  # chunk_steps in _speech
    assert min(sizes[0.0]) < 8 and len(sizes[0.0]) > len(sizes[1.0])


async def test_a_segment_queued_behind_audio_starts_with_whole_chunks(vocoders: dict) -> None:
    """``SpeechRequest.queued_audio_ms``: with 2 s of audio ahead of it, a segment's chunks after
    the first are whole (``chunk_steps``) at once, even from an engine just above real time; with
    nothing queued they start at ``min_chunk_steps`` and grow with the lead."""
    voc = vocoders[("tiny", "codes")]
    codes = np.random.default_rng(6).integers(0, 625, (60, 4))
    sizes = {}
    for queued_ms in (2000.0, 0.0):
        eng = FakeCodeEngine({"a": codes}, piece=1, step_s=0.018)  # 1.2x real time
        sp = await _speech(voc, eng)
        try:
            chunks = await _collect(sp, SpeechRequest("a", "x", queued_audio_ms=queued_ms))
        finally:
            await sp.close()
        sizes[queued_ms] = [c.steps for c in chunks[1:-1]]
    assert sizes[2000.0] and set(sizes[2000.0]) == {8}  # chunk_steps in _speech
    assert sizes[0.0][0] == 3 and len(sizes[0.0]) > len(sizes[2000.0])


@pytest.mark.parametrize("rate", [8000, 16000, 48000])
async def test_speech_sample_rates(rate: int, vocoders: dict) -> None:
    voc = vocoders[("tiny", "codes")]
    codes = np.random.default_rng(rate).integers(0, 625, (60, 4))
    sp = await _speech(voc, FakeCodeEngine({"a": codes}, piece=5))
    try:
        chunks = await _collect(sp, SpeechRequest("a", "x", sample_rate_hz=rate))
        n = len(b"".join(c.pcm for c in chunks)) // 2
        want = (2 * 60 - 1) * 256 * rate / 24000
        assert abs(n - want) <= 2
        assert all(c.sample_rate_hz == rate for c in chunks)
    finally:
        await sp.close()


async def test_speech_abort_and_empty(vocoders: dict) -> None:
    voc = vocoders[("tiny", "codes")]
    eng = FakeCodeEngine({"a": np.zeros((300, 4), np.int64), "e": np.zeros((0, 4), np.int64)}, piece=2)
    sp = await _speech(voc, eng)
    try:
        gen = sp.synthesize(SpeechRequest("a", "x"))
        await gen.__anext__()
        await sp.abort("a")
        rest = [c async for c in gen]
        assert rest[-1].finished and rest[-1].pcm == b""
        assert "a" in eng.aborted and eng.running == 0
        chunks = await _collect(sp, SpeechRequest("e", "x"))
        assert len(chunks) == 1 and chunks[0].finished and chunks[0].pcm == b""
        from engine.api import EngineError

        with pytest.raises(EngineError):
            sp.synthesize(SpeechRequest("z", "x", sample_rate_hz=44100))
    finally:
        await sp.close()


def test_chunk_policy_from_config(vocoders: dict) -> None:
    from engine.speech import chunk_policy

    g = vocoders[("full", "codes")].geometry
    p = chunk_policy(EngineConfig(), g.exact_lookahead_steps)
    assert p == ChunkPolicy(2, 16, 8, full_chunks_below_x=1.0)  # the defaults (docs/decoder.md: chunking and the lookahead table)
    assert chunk_policy(EngineConfig(decoder_lookahead_steps=-1), g.exact_lookahead_steps).lookahead_steps == 52
    settings = build_decoder(EngineConfig(decoder_dtype="float16"), "m").settings
    assert settings.dtype == "float16" and settings.left_steps == 24 and settings.lookahead_steps == 8
    assert not settings.compile and build_decoder(EngineConfig(decoder_compile=True), "m").settings.compile


class _Recorder:
    """CodeEngine proxy that keeps every frame it passes on."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.frames: dict[str, list[CodeFrames]] = {}

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    def health(self) -> EngineHealth:
        return self.inner.health()  # type: ignore[no-any-return]

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    async def generate(self, request: SpeechRequest) -> AsyncIterator[CodeFrames]:
        got = self.frames.setdefault(request.request_id, [])
        async for f in self.inner.generate(request):
            got.append(f)
            yield f


@pytest.mark.parametrize("path", ["codes", "hidden"])
async def test_speech_over_reference_engine(path: str, tiny_model_dir: Path) -> None:
    """Real GPT output (upstream chattts, tiny random checkpoint) through ChatTTSSpeech equals
    upstream's whole decode of the same codes / hidden states (``Chat._decode_to_wavs``)."""
    from engine.api import SamplingParams
    from engine.reference import ReferenceCodeEngine

    cfg = EngineConfig(first_chunk_steps=4, chunk_steps=8, use_hidden_decoder=(path == "hidden"), decoder_lookahead_steps=-1)
    rec = _Recorder(ReferenceCodeEngine(tiny_model_dir, cfg))
    sp = ChatTTSSpeech(rec, build_decoder(cfg, str(tiny_model_dir)), cfg)  # type: ignore[arg-type]
    await sp.start()
    try:
        req = SpeechRequest("ref1", "hello world", speaker=7, params=SamplingParams(seed=3, max_new_tokens=40, ignore_eos=True))
        chunks = await _collect(sp, req)
        frames = rec.frames["ref1"]
        codes = np.concatenate([f.codes for f in frames])
        assert codes.shape == (40, 4)
        chat: Any = rec.inner._chat
        if path == "hidden":
            x = torch.from_numpy(np.concatenate([f.hidden for f in frames if f.hidden is not None]))
        else:
            x = torch.from_numpy(codes)
        want = float_to_pcm16(chat._decode_to_wavs([x], path == "hidden")[0])
        pcm = np.frombuffer(b"".join(c.pcm for c in chunks), "<i2")
        assert pcm.shape == want.shape == ((2 * 40 - 1) * 256,)
        assert np.abs(pcm.astype(np.int32) - want).max() <= 1
        assert len(chunks) >= 3 and chunks[-1].finished
    finally:
        await sp.close()

"""Synchronous batched streaming decoder: per-stream state, one batched forward for many streams.

Each stream keeps, per stage, the cache of input frames that the next outputs still need
(``engine.decoder.window.ConvWindow`` says how many), and an overlap-add accumulator for the
ISTFT. A push of new steps runs every stage on ``cache + new frames`` with *valid*
convolutions, so every code/hidden state is decoded once per layer and the concatenated
output equals the whole-sequence decode (``Vocoder.decode_whole``).

Batching: at every stage the windows of all streams that produce outputs are stacked; windows
of different lengths are right-padded with zeros. A valid convolution's output ``t`` reads
window frames ``t .. t + span`` only, so the first ``len - span`` outputs of a padded row are
exactly the outputs of that stream alone; the rest is cut off. Per-frame ops are unaffected by
padding.

Provisional output (``lookahead_steps`` below the exact value): after the exact push, the
samples between the exact frontier and the requested end are taken from a *provisional
flush* (the same stages on copies of the caches, with the sequence treated as ending now:
what a whole decode of the prefix gives). They are emitted once and never revised; the
stream state stays exact, so errors never accumulate, and the next output starts with a
short crossfade (``crossfade_samples``) from the provisional continuation, so the seam where
provisional audio meets revised audio stays continuous. Whole-sequence equality holds only in
exact mode (the default), where no provisional audio and no crossfade exist.

Not thread-safe: one caller at a time (``BatchingDecoder`` runs it in a single worker thread).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from engine.decoder.nets import Stage, Vocoder
from engine.decoder.window import ConvStep, OlaStep, OlaWindow, StackWindow


@dataclass
class StreamState:
    """One utterance's decoder state. Create with ``StreamingVocoder.open``."""

    stack: StackWindow
    ola: OlaWindow
    caches: list[Tensor | None]
    acc: Tensor
    """Overlap-add accumulator, absolute samples ``[ola.consumed, n_frames*hop + n_fft - hop)``."""
    env: Tensor
    """Window envelope (sum of squared windows) over the same samples."""
    steps_in: int = 0
    """Steps pushed so far."""
    exact_samples: int = 0
    """Samples produced by exact decoding so far."""
    emitted_samples: int = 0
    """Samples handed out so far (>= exact_samples when provisional audio was emitted)."""
    finished: bool = False
    xfade_tail: np.ndarray | None = None
    """Provisional continuation after the emitted frontier (provisional mode only): the next
    output starts with a crossfade from it, so a revised seam does not click."""
    tag: object = field(default=None, compare=False)


@dataclass(frozen=True)
class DecodeJob:
    """Push ``x`` (``[n, step_dim]``: codes int or hidden float) to ``state``.

    ``emit_steps``: emit audio up to this many steps even when not yet exact (provisional
    tail); ``None`` emits exact audio only.
    """

    state: StreamState
    x: np.ndarray
    final: bool = False
    emit_steps: int | None = None


@dataclass
class _Pass:
    steps: list[ConvStep]
    caches: list[Tensor | None]
    new: Tensor  # first-stage input frames [C, n]


class StreamingVocoder:
    """The batched core over a ``Vocoder``; see the module docstring."""

    def __init__(self, vocoder: Vocoder, crossfade_samples: int = 256) -> None:
        self.vocoder = vocoder
        self.crossfade_samples = crossfade_samples
        self.geometry = vocoder.geometry
        p = next(vocoder.parameters())
        self.device, self.dtype = p.device, p.dtype
        self._in_ch = vocoder.front.in_dim
        self._win_sq = vocoder.vocos.window.square()
        self._empty = torch.zeros(0, 0, device=self.device, dtype=self.dtype)

    # ------------------------------------------------------------------ streams

    def open(self, tag: object = None) -> StreamState:
        g = self.geometry
        tail = g.n_fft - g.hop
        return StreamState(
            stack=StackWindow(g.stage_reaches),
            ola=OlaWindow(g.n_fft, g.hop, g.center),
            caches=[None] * len(g.stage_reaches),
            acc=torch.zeros(tail, device=self.device, dtype=self.dtype),
            env=torch.zeros(tail, device=self.device, dtype=self.dtype),
            tag=tag,
        )

    @property
    def step_dim(self) -> int:
        return self.vocoder.front.step_dim

    # ------------------------------------------------------------------ decoding

    @torch.inference_mode()
    def decode(self, jobs: Sequence[DecodeJob]) -> list[np.ndarray]:
        """Run one batched forward; return each job's new float32 audio (24 kHz), in order."""
        seen: set[int] = set()
        for j in jobs:
            if id(j.state) in seen:
                raise ValueError("a stream may appear only once per batch")
            seen.add(id(j.state))
            if j.state.finished:
                raise ValueError("push to a finished stream")
        frames = self._input_frames([j.x for j in jobs])
        passes = []
        for j, fr in zip(jobs, frames, strict=True):
            st = j.state
            st.steps_in += j.x.shape[0]
            passes.append(_Pass(st.stack.push(fr.shape[1], j.final), st.caches, fr))
        outs = self._run(passes)
        results: list[np.ndarray] = []
        spec_jobs: list[int] = []
        for i, (j, p, frames_out) in enumerate(zip(jobs, passes, outs, strict=True)):
            st = j.state
            st.caches = p.caches
            audio = self._overlap_add(st, frames_out, j.final)
            before = st.exact_samples
            st.exact_samples += audio.shape[0]
            skip = min(audio.shape[0], max(0, st.emitted_samples - before))
            audio = audio[skip:]
            st.emitted_samples += audio.shape[0]
            st.finished = j.final
            results.append(audio.float().cpu().numpy())
            if not j.final and j.emit_steps is not None:
                want = min(j.emit_steps, st.steps_in) * self.geometry.samples_per_step
                if want > st.emitted_samples:
                    spec_jobs.append(i)
        tails: dict[int, np.ndarray] = {}
        if spec_jobs:
            extra = self._provisional([jobs[i] for i in spec_jobs])
            for i, (more, tail) in zip(spec_jobs, extra, strict=True):
                results[i] = np.concatenate([results[i], more])
                tails[i] = tail
        for i, j in enumerate(jobs):
            st = j.state
            prev = st.xfade_tail
            if prev is not None and results[i].shape[0]:
                n = min(prev.shape[0], results[i].shape[0])
                ramp = (np.arange(1, n + 1, dtype=np.float32) / (n + 1)).astype(np.float32)
                out = results[i].copy()
                out[:n] = ramp * out[:n] + (1.0 - ramp) * prev[:n]
                results[i] = out
                st.xfade_tail = None
            if i in tails:
                st.xfade_tail = tails[i] if tails[i].shape[0] else None
        return results

    def decode_stream_whole(self, x: np.ndarray) -> np.ndarray:
        """Decode one utterance in a single final push (equals ``Vocoder.decode_whole``)."""
        return self.decode([DecodeJob(self.open(), x, final=True)])[0]

    # ------------------------------------------------------------------ internals

    def _input_frames(self, xs: Sequence[np.ndarray]) -> list[Tensor]:
        """Per-step inputs -> first-stage frames, one batched (per-step) op for all jobs."""
        sd = self.step_dim
        lens = [int(x.shape[0]) for x in xs]
        for x in xs:
            if x.ndim != 2 or x.shape[1] != sd:
                raise ValueError(f"decoder input must be [n, {sd}], got {x.shape}")
        if self.vocoder.uses_codes:
            cat = np.concatenate([np.asarray(x, dtype=np.int64) for x in xs]) if xs else np.zeros((0, sd), np.int64)
            if cat.size and (cat.min() < 0 or cat.max() >= self.vocoder.front.vq_layer.quantizer.codebook_size):  # type: ignore[union-attr]
                raise ValueError("code out of range (EOS frames must not reach the decoder)")
            t = torch.from_numpy(cat).to(self.device)
        else:
            cat = np.concatenate([np.asarray(x, dtype=np.float32) for x in xs]) if xs else np.zeros((0, sd), np.float32)
            t = torch.from_numpy(cat).to(self.device, self.dtype)
        feats = self.vocoder.front.step_features(t)
        out = []
        for part in torch.split(feats, lens):
            out.append(self.vocoder.front.to_frames(part))
        return out

    def _run(self, passes: Sequence[_Pass]) -> list[Tensor]:
        """Run all stages for all passes (batched per stage); update ``caches`` in place."""
        news = [p.new for p in passes]
        stage: Stage
        for s, stage in enumerate(self.vocoder.stages):
            windows: list[Tensor | None] = []
            for p, new in zip(passes, news, strict=True):
                step = p.steps[s]
                parts = []
                ch = stage.in_channels
                if step.pad_left:
                    parts.append(new.new_zeros(ch, step.pad_left))
                cache = p.caches[s]
                if cache is not None and cache.shape[1]:
                    parts.append(cache)
                if new.shape[1]:
                    parts.append(new)
                body = torch.cat(parts, dim=1) if len(parts) > 1 else (parts[0] if parts else new)
                p.caches[s] = body[:, body.shape[1] - step.keep :] if step.keep else None
                if step.runs:
                    win = torch.cat([body, body.new_zeros(ch, step.pad_right)], dim=1) if step.pad_right else body
                    windows.append(win)
                else:
                    windows.append(None)
            outs = self._batched(stage, windows)
            news = [o if o is not None else self._empty for o in outs]
        return news

    def _batched(self, stage: Stage, windows: list[Tensor | None]) -> list[Tensor | None]:
        idx = [i for i, w in enumerate(windows) if w is not None]
        out: list[Tensor | None] = [None] * len(windows)
        if not idx:
            return out
        span = stage.reach.span
        wins = [w for w in windows if w is not None]
        lens = [w.shape[1] for w in wins]
        lmax = max(lens)
        rows = [w if w.shape[1] == lmax else F.pad(w, (0, lmax - w.shape[1])) for w in wins]
        y = stage.valid(torch.stack(rows))
        for k, i in enumerate(idx):
            out[i] = y[k, :, : lens[k] - span]
        return out

    def _overlap_add(self, st: StreamState, frames: Tensor, final: bool) -> Tensor:
        """Add new windowed frames ``[n_fft, n]`` to the stream's accumulator; return final samples."""
        step: OlaStep = st.ola.push(frames.shape[1] if frames.numel() else 0, final)
        st.acc, st.env, audio = self._ola_apply(st.acc, st.env, frames, step)
        return audio

    def _ola_apply(self, acc: Tensor, env: Tensor, frames: Tensor, step: OlaStep) -> tuple[Tensor, Tensor, Tensor]:
        g = self.geometry
        n = step.n_new
        if n:
            length = (n - 1) * g.hop + g.n_fft
            acc = torch.cat([acc, acc.new_zeros(n * g.hop)])
            env = torch.cat([env, env.new_zeros(n * g.hop)])
            off = acc.shape[0] - length
            folded = F.fold(frames[None], (1, length), (1, g.n_fft), stride=(1, g.hop))[0, 0, 0]
            wsq = self._win_sq[:, None].expand(g.n_fft, n)[None]
            env_new = F.fold(wsq, (1, length), (1, g.n_fft), stride=(1, g.hop))[0, 0, 0]
            acc = torch.cat([acc[:off], acc[off:] + folded])
            env = torch.cat([env[:off], env[off:] + env_new])
        a, b = step.drop, step.drop + step.emit
        audio = acc[a:b] / env[a:b] if step.emit else acc.new_zeros(0)
        return acc[b:], env[b:], audio

    def _provisional(self, jobs: Sequence[DecodeJob]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Flush copies of the streams' states (sequence treated as ending now) and return, per
        job, the samples from the emitted frontier up to ``emit_steps`` and the provisional
        continuation after them (up to ``crossfade_samples``, blended into the next output)."""
        passes = []
        olas = []
        for j in jobs:
            st = j.state
            stack = st.stack.copy()
            passes.append(_Pass(stack.push(0, final=True), list(st.caches), torch.zeros(self._in_ch, 0, device=self.device, dtype=self.dtype)))
            olas.append(st.ola.copy())
        outs = self._run(passes)
        res = []
        for j, frames, ola in zip(jobs, outs, olas, strict=True):
            st = j.state
            step = ola.push(frames.shape[1] if frames.numel() else 0, final=True)
            _, _, audio = self._ola_apply(st.acc, st.env, frames, step)
            # audio starts at the exact frontier; skip what was already emitted provisionally
            start = st.emitted_samples - st.exact_samples
            want = min(j.emit_steps or 0, st.steps_in) * self.geometry.samples_per_step
            stop = min(audio.shape[0], want - st.exact_samples)
            piece = audio[start:stop] if stop > start else audio.new_zeros(0)
            tail = audio[max(start, stop) : max(start, stop) + self.crossfade_samples]
            st.emitted_samples += piece.shape[0]
            res.append((piece.float().cpu().numpy(), tail.float().cpu().numpy()))
        return res


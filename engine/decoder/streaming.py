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

Per-stream work is index arithmetic, not tensor ops: the stage caches of all streams live in one
pool tensor per stage (``[slots, channels, span]``, a slot per open stream), and a stage's windows
are gathered in one ``index_select`` from ``[zero column | the batch's caches | new frames]``;
the new caches go back with one ``index_copy_``. A forward therefore launches a fixed number of
kernels per stage whatever the batch size (on a GPU the per-stream ops, not the arithmetic, were
what limited a batch: ~0.75 ms per stream per forward on an H200).

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

import heapq
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from engine.decoder.nets import Vocoder
from engine.decoder.window import ConvStep, OlaStep, OlaWindow, StackWindow


@dataclass
class StreamState:
    """One utterance's decoder state. Create with ``StreamingVocoder.open``."""

    stack: StackWindow
    ola: OlaWindow
    slot: int
    """Row of this stream's stage caches in the decoder's cache pools."""
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
    release: Callable[[], object] = field(default=lambda: None, compare=False, repr=False)
    """Gives the slot back (once; also when the state is garbage-collected)."""


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


_SMALL_BATCH = 8
"""Up to this many streams in a forward, ``StreamingVocoder._plan`` builds indices in plain Python."""


def _body_index(pos: np.ndarray, pl: np.ndarray, ca: np.ndarray, nn: np.ndarray, cache0: np.ndarray,
                new0: np.ndarray) -> np.ndarray:
    """Source column of body position ``pos`` (per pass, broadcast): 0 (the zero column) in the
    left padding and past the body, ``cache0 + j`` in the cached part, ``new0 + j`` in the new."""
    in_cache = (pos >= pl) & (pos < pl + ca)
    in_new = (pos >= pl + ca) & (pos < pl + ca + nn)
    return np.where(in_cache, cache0 + pos - pl, 0) + np.where(in_new, new0 + pos - pl - ca, 0)


@dataclass
class _StagePlan:
    """One stage of one forward, planned on the host (``StreamingVocoder._plan``)."""

    read: bool
    """Some pass has cached frames at this stage (gather the batch's pool rows)."""
    write: bool
    """Some pass keeps frames (scatter the new caches back)."""
    running: list[int]
    """Passes that produce outputs, in window-row order."""
    n_out: list[int]
    """Output frames per pass."""
    lmax: int = 0
    """Window length (the longest running window; shorter ones are zero-padded)."""
    keep_at: tuple[int, int] = (0, 0)
    win_at: tuple[int, int] = (0, 0)
    """Slices of the packed index array."""


@dataclass
class _Pass:
    steps: list[ConvStep]
    slot: int
    offset: int
    """Column of this pass's first-stage input frames in the batch's frame tensor."""


class _Slots:
    """Cache-pool rows: the lowest free one is handed out (thread-safe: streams are opened on the
    event loop, released there, in the decoder thread, or by the garbage collector)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[int] = []
        self._next = 0

    def take(self) -> int:
        with self._lock:
            if self._free:
                return heapq.heappop(self._free)
            self._next += 1
            return self._next - 1

    def give(self, slot: int) -> None:
        with self._lock:
            heapq.heappush(self._free, slot)

    @property
    def in_use(self) -> int:
        with self._lock:
            return self._next - len(self._free)


class StreamingVocoder:
    """The batched core over a ``Vocoder``; see the module docstring."""

    def __init__(self, vocoder: Vocoder, crossfade_samples: int = 256) -> None:
        self.vocoder = vocoder
        self.crossfade_samples = crossfade_samples
        self.geometry = vocoder.geometry
        p = next(vocoder.parameters())
        self.device, self.dtype = p.device, p.dtype
        self._win_sq = vocoder.vocos.window.square()
        self._empty = torch.zeros(0, 0, device=self.device, dtype=self.dtype)
        stages = vocoder.stages
        self._in_chs = [int(st.in_channels) for st in stages]
        self._spans = [int(st.reach.span) for st in stages]
        self._slots = _Slots()
        self._pools: list[Tensor] = [
            torch.zeros(0, c, k, device=self.device, dtype=self.dtype) for c, k in zip(self._in_chs, self._spans, strict=True)
        ]
        """Per stage: ``[slots, in_channels, span]``; a stream's cache is the first ``ConvStep.keep``
        columns of its row. Grown (never shrunk) in the decoder thread: the peak of open streams."""
        self._zero_cols = [torch.zeros(c, 1, device=self.device, dtype=self.dtype) for c in self._in_chs]

    # ------------------------------------------------------------------ streams

    def open(self, tag: object = None) -> StreamState:
        g = self.geometry
        tail = g.n_fft - g.hop
        slot = self._slots.take()
        st = StreamState(
            stack=StackWindow(g.stage_reaches),
            ola=OlaWindow(g.n_fft, g.hop, g.center),
            slot=slot,
            acc=torch.zeros(tail, device=self.device, dtype=self.dtype),
            env=torch.zeros(tail, device=self.device, dtype=self.dtype),
            tag=tag,
        )
        st.release = weakref.finalize(st, self._slots.give, slot)
        return st

    @property
    def open_streams(self) -> int:
        """Streams opened and neither finished nor garbage-collected (cache-pool rows in use)."""
        return self._slots.in_use

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
        flat, spans = self._input_frames([j.x for j in jobs])
        passes = []
        for j, (off, n) in zip(jobs, spans, strict=True):
            st = j.state
            st.steps_in += j.x.shape[0]
            passes.append(_Pass(st.stack.push(n, j.final), st.slot, off))
        outs = self._run(passes, flat)
        pieces: list[Tensor] = []
        spec_jobs: list[int] = []
        for j, frames_out in zip(jobs, outs, strict=True):
            st = j.state
            audio = self._overlap_add(st, frames_out, j.final)
            before = st.exact_samples
            st.exact_samples += audio.shape[0]
            skip = min(audio.shape[0], max(0, st.emitted_samples - before))
            audio = audio[skip:]
            st.emitted_samples += audio.shape[0]
            st.finished = j.final
            if j.final:
                st.release()
            pieces.append(audio)
        results = self._to_numpy(pieces)
        for i, j in enumerate(jobs):
            st = j.state
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

    def _input_frames(self, xs: Sequence[np.ndarray]) -> tuple[Tensor, list[tuple[int, int]]]:
        """Per-step inputs -> first-stage frames of all jobs side by side ``[C, frames]`` (one
        batched per-step op), and each job's ``(first column, frames)``."""
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
        flat = self.vocoder.front.to_frames(self.vocoder.front.step_features(t))  # per step, in order
        per_step = flat.shape[1] // max(1, sum(lens))
        spans, off = [], 0
        for n in lens:
            spans.append((off * per_step, n * per_step))
            off += n
        return flat, spans

    def _grow_pools(self, slots: Sequence[int]) -> None:
        need = max(slots, default=-1) + 1
        cap = self._pools[0].shape[0] if self._pools else 0
        if need <= cap:
            return
        new_cap = max(need, 2 * cap, 16)
        for s, old in enumerate(self._pools):
            grown = old.new_zeros(new_cap, old.shape[1], old.shape[2])
            grown[: old.shape[0]] = old
            self._pools[s] = grown

    def _plan(self, passes: Sequence[_Pass]) -> tuple[list[_StagePlan], np.ndarray]:
        """Every stage's gather indices, computed on the host before any kernel runs (they depend
        on the windows' geometry only), packed in one array: ``[slots | stage 0 | stage 1 | ...]``.

        In ``src = [zero column | the batch's caches (pass i at 1 + i*k) | new frames]``: a body is
        ``pad_left`` zeros + cached + new; a window is its body + ``pad_right`` zeros, then zeros up
        to the longest window; a new cache is the body's last ``keep`` columns, then zeros (never
        read: the next push's ``cached`` is ``keep``). Small batches build the lists in Python
        (a numpy call costs more than a short list), large ones in numpy; the same indices.
        """
        n_pass = len(passes)
        small = n_pass <= _SMALL_BATCH
        packed: list[Any] = [[p.slot for p in passes]]
        at = n_pass
        offsets = [p.offset for p in passes]
        plans: list[_StagePlan] = []
        for s, k in enumerate(self._spans):
            steps = [p.steps[s] for p in passes]
            running = [i for i, st in enumerate(steps) if st.n_out > 0]
            plan = _StagePlan(read=k > 0 and any(st.cached for st in steps),
                              write=k > 0 and any(st.keep for st in steps),
                              running=running, n_out=[st.n_out for st in steps])
            new_base = 1 + (n_pass * k if plan.read else 0)
            if running:
                plan.lmax = max(steps[i].window for i in running)
            if small:
                bodies = [[0] * st.pad_left + list(range(1 + i * k, 1 + i * k + st.cached))
                          + list(range(new_base + offsets[i], new_base + offsets[i] + st.n_new))
                          for i, st in enumerate(steps)]
                if plan.write:
                    idx = [c for st, body in zip(steps, bodies, strict=True)
                           for c in (body[len(body) - st.keep :] if st.keep else []) + [0] * (k - st.keep)]
                    plan.keep_at = (at, at + len(idx))
                    packed.append(idx)
                    at += len(idx)
                if running:
                    idx = [c for i in running for c in bodies[i] + [0] * (plan.lmax - len(bodies[i]))]
                    plan.win_at = (at, at + len(idx))
                    packed.append(idx)
                    at += len(idx)
            else:
                geo = np.array([(st.pad_left, st.cached, st.n_new, st.keep) for st in steps], dtype=np.int64)
                pl, ca, nn, kp = (geo[:, c : c + 1] for c in range(4))
                cache0 = 1 + np.arange(n_pass, dtype=np.int64)[:, None] * k
                new0 = new_base + np.asarray(offsets, dtype=np.int64)[:, None]
                if plan.write:
                    pos = (pl + ca + nn - kp) + np.arange(k, dtype=np.int64)[None, :]
                    arr = _body_index(pos, pl, ca, nn, cache0, new0).reshape(-1)
                    plan.keep_at = (at, at + arr.size)
                    packed.append(arr)
                    at += arr.size
                if running:
                    r = np.asarray(running, dtype=np.int64)
                    pos = np.broadcast_to(np.arange(plan.lmax, dtype=np.int64)[None, :], (len(running), plan.lmax))
                    arr = _body_index(pos, pl[r], ca[r], nn[r], cache0[r], new0[r]).reshape(-1)
                    plan.win_at = (at, at + arr.size)
                    packed.append(arr)
                    at += arr.size
            offsets = [0] * n_pass
            for row, i in enumerate(running):
                offsets[i] = row * (plan.lmax - k)  # valid outputs per window row: lmax - span
            plans.append(plan)
        return plans, np.concatenate([np.asarray(x, dtype=np.int64) for x in packed])

    def _run(self, passes: Sequence[_Pass], flat: Tensor) -> list[Tensor]:
        """Run all stages for all passes (batched per stage; caches read from and written back
        to the pools); return each pass's last-stage output frames.

        ``flat``: first-stage input frames of all passes side by side, ``_Pass.offset`` into it.
        Kernels only: the indices go to the device in one copy before the first stage, so the
        host never waits for the device inside a forward.
        """
        n_pass = len(passes)
        self._grow_pools([p.slot for p in passes])
        plans, packed = self._plan(passes)
        dev = torch.from_numpy(packed).to(self.device)
        slots_t = dev[:n_pass]
        outs: list[Tensor] = [self._empty] * n_pass
        last = len(plans) - 1
        for s, (stage, plan) in enumerate(zip(self.vocoder.stages, plans, strict=True)):
            ch, k = self._in_chs[s], self._spans[s]
            if not plan.running and not plan.write:
                flat = self._empty
                continue
            parts = [self._zero_cols[s]]
            if plan.read:  # [slots, C, k] -> [C, n_pass * k]
                parts.append(self._pools[s].index_select(0, slots_t).permute(1, 0, 2).reshape(ch, n_pass * k))
            if flat.shape[1]:
                parts.append(flat)
            src = torch.cat(parts, dim=1)
            if plan.write:
                kept = src.index_select(1, dev[plan.keep_at[0] : plan.keep_at[1]])
                self._pools[s].index_copy_(0, slots_t, kept.view(ch, n_pass, k).permute(1, 0, 2))
            if not plan.running:
                flat = self._empty
                continue
            n_run = len(plan.running)
            wins = src.index_select(1, dev[plan.win_at[0] : plan.win_at[1]])
            y = stage.valid(wins.view(ch, n_run, plan.lmax).permute(1, 0, 2).contiguous())
            if s < last:
                flat = y.permute(1, 0, 2).reshape(y.shape[1], n_run * y.shape[2])
            else:
                for r, i in enumerate(plan.running):
                    outs[i] = y[r, :, : plan.n_out[i]]
        return outs

    def _to_numpy(self, pieces: Sequence[Tensor]) -> list[np.ndarray]:
        """Each job's audio as float32 numpy, with one device-to-host copy for the batch."""
        lens = [int(p.shape[0]) for p in pieces]
        if not sum(lens):
            return [np.zeros(0, dtype=np.float32) for _ in pieces]
        host = torch.cat([p for p in pieces if p.shape[0]]).float().cpu().numpy()
        out, off = [], 0
        for n in lens:
            out.append(host[off : off + n])
            off += n
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
            # a final push of nothing: keep is 0 at every stage, so the pools are only read
            passes.append(_Pass(stack.push(0, final=True), st.slot, 0))
            olas.append(st.ola.copy())
        outs = self._run(passes, self._empty)
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


"""``WindowDecoder``: the static-shape batched forward of the streaming decoder.

Every forward decodes ``B`` rows of one fixed window (``WindowSpec.window_steps`` steps, see
``engine.decoder.window``) whole, with padded convolutions, and returns each row's chunk
samples (plus the crossfade continuation in provisional mode). Per row only three things vary:
the window's inputs, its first step (``start - left_steps``) and the step where the stream's
known input ends; the frames outside ``[0, end)`` are zeroed before every convolution (exactly
the zero padding of a whole-utterance decode) and left out of the overlap-add and its window
envelope, so a row at the start or the end of an utterance is exact too.

Shapes never change: a batch of ``B`` rows runs in the smallest bucket (powers of two up to
``max_batch``) that holds it, padded with empty rows. On CUDA each bucket is one CUDA graph,
captured at ``warm_up`` and replayed (TF32 matmuls and convolutions, or ``compute_dtype`` under
autocast; with ``compile_forward``, the torch.compile'd forward, whose fused kernels the graph
replays); on CPU the same code runs eager (or compiled).

On CUDA a forward waits for the device once: the inputs go through pinned host buffers with
asynchronous copies, the graph replays, the samples come back asynchronously into a pinned buffer,
and only then does the host synchronize. A synchronous copy from pageable memory would wait for
the device at each of the three inputs too; while the engine cores keep the GPU busy, every such
wait is a turn in the GPU's time-slicing between processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from engine.decoder.nets import Vocoder
from engine.decoder.window import WindowSpec


def buckets_for(max_batch: int, smallest: int = 1) -> list[int]:
    """Powers of two from ``smallest`` below ``max_batch``, then ``max_batch``."""
    out, b = [], smallest
    while b < max_batch:
        out.append(b)
        b *= 2
    return [*out, max_batch]


class _Bucket:
    """Static input/output buffers of one batch size (and its graph on CUDA)."""

    def __init__(self, size: int, x: Tensor, start: Tensor, end: Tensor) -> None:
        self.size = size
        self.x, self.start, self.end = x, start, end
        self.out: Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None


class _Staging:
    """Host buffers of ``max_batch`` rows that a forward's inputs and samples pass through (pinned on
    CUDA, for the asynchronous copies)."""

    def __init__(self, rows: int, window_steps: int, step_dim: int, in_dtype: torch.dtype, out_samples: int,
                 pin: bool) -> None:
        self.x = torch.zeros(rows, window_steps, step_dim, dtype=in_dtype, pin_memory=pin)
        self.start = torch.zeros(rows, dtype=torch.int64, pin_memory=pin)
        self.end = torch.zeros(rows, dtype=torch.int64, pin_memory=pin)
        self.out = torch.zeros(rows, out_samples, dtype=torch.float32, pin_memory=pin)


class WindowDecoder:
    """See the module docstring. Not thread-safe: the decoder process calls it from one thread."""

    def __init__(self, vocoder: Vocoder, spec: WindowSpec, max_batch: int, compute_dtype: str = "float32",
                 compile_forward: bool = False) -> None:
        if max_batch < 1:
            raise ValueError("max_batch >= 1")
        if compute_dtype not in ("float32", "float16"):
            raise ValueError(f"compute_dtype: float32 or float16, got {compute_dtype!r}")
        self.voc = vocoder
        self.spec = spec
        g = spec.geometry
        p = next(vocoder.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.compute_dtype: torch.dtype = getattr(torch, compute_dtype)
        """The stages' dtype (autocast when it differs from the weights'); the overlap-add is float32."""
        self.cuda = self.device.type == "cuda"
        self.compile_forward = compile_forward
        """``warm_up`` compiles the forward (torch.compile, dynamic batch) before the graphs are captured."""
        self._forward: Callable[[Tensor, Tensor, Tensor], Tensor] = self._compute
        self.step_dim = vocoder.front.step_dim
        self.max_batch = max_batch
        # compiled: no bucket of one row, which torch.compile would specialise (a compile of its own)
        self.buckets = buckets_for(max_batch, 2 if compile_forward else 1)
        w = spec.window_steps
        self._frames = g.frames_per_step * w
        self._frame_idx = torch.arange(self._frames, device=self.device)
        self._win_sq = vocoder.vocos.window.square()[None, :, None]
        self._total = (self._frames - 1) * g.hop + g.n_fft
        if spec.out_offset + spec.out_samples > self._total:
            raise ValueError("window too short for its output")
        in_dtype = torch.int64 if vocoder.uses_codes else self.dtype
        self._host = _Staging(max_batch, w, self.step_dim, in_dtype, spec.out_samples, pin=self.cuda)
        self._b: dict[int, _Bucket] = {}
        for size in self.buckets:
            self._b[size] = _Bucket(
                size,
                torch.zeros(size, w, self.step_dim, dtype=in_dtype, device=self.device),
                torch.zeros(size, dtype=torch.int64, device=self.device),
                torch.zeros(size, dtype=torch.int64, device=self.device),
            )

    # ------------------------------------------------------------------ the forward

    def _compute(self, x: Tensor, start: Tensor, end: Tensor) -> Tensor:
        """``x [B, W, step_dim]``, window first step ``start [B]``, input end ``end [B]`` (steps)
        -> ``[B, out_samples]`` float32."""
        voc, spec = self.voc, self.spec
        g = spec.geometry
        b, w, _ = x.shape
        fps = g.frames_per_step
        feats = voc.front.step_features(x.reshape(b * w, -1))
        y = feats.reshape(b, w * fps, voc.front.in_dim).transpose(1, 2)
        pos = fps * start[:, None] + self._frame_idx[None, :]
        inside = ((pos >= 0) & (pos < fps * end[:, None]))[:, None, :]
        cdt = self.compute_dtype
        m = inside.to(cdt)
        with torch.autocast(self.device.type, dtype=cdt) if cdt != self.dtype else contextlib.nullcontext():
            y = y.to(cdt)
            for stage in voc.stages:
                y = stage.padded(y * m)
        mask = inside.to(self.dtype)
        frames = y.float() * mask
        acc = F.fold(frames, (1, self._total), (1, g.n_fft), stride=(1, g.hop))[:, 0, 0]
        env = F.fold(self._win_sq * mask, (1, self._total), (1, g.n_fft), stride=(1, g.hop))[:, 0, 0]
        a = spec.out_offset
        acc, env = acc[:, a : a + spec.out_samples], env[:, a : a + spec.out_samples]
        return torch.where(env > 1e-8, acc / env.clamp_min(1e-8), torch.zeros_like(acc)).float()

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run every bucket once (cuDNN picks its algorithms); on CUDA capture its graph."""
        if self.cuda:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
            torch.backends.cudnn.benchmark = True
        if self.compile_forward and self._forward == self._compute:
            self._forward = torch.compile(self._compute, dynamic=True)
        for bk in self._b.values():
            if not self.cuda:
                self._forward(bk.x, bk.start, bk.end)
                continue
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    self._forward(bk.x, bk.start, bk.end)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                bk.out = self._forward(bk.x, bk.start, bk.end)
            bk.graph = graph
        if self.cuda:
            torch.cuda.synchronize()

    def bucket(self, rows: int) -> int:
        for size in self.buckets:
            if size >= rows:
                return size
        raise ValueError(f"{rows} rows > max_batch {self.max_batch}")

    @torch.inference_mode()
    def run(self, x: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """Decode ``B <= max_batch`` rows: ``x [B, W, step_dim]`` (window inputs; anything where
        masked), ``start``/``end [B]`` in steps -> ``[B, out_samples]`` float32 (host): a view of a
        host buffer that the next call overwrites."""
        n = int(x.shape[0])
        bk = self._b[self.bucket(n)]
        h = self._host
        m = bk.size
        h.x[:n].numpy()[...] = x
        h.start[:n].numpy()[...] = start
        h.end[:n].numpy()[...] = end
        h.end[n:m].zero_()  # empty rows: every frame masked
        bk.x[:n].copy_(h.x[:n], non_blocking=True)
        bk.start.copy_(h.start[:m], non_blocking=True)
        bk.end.copy_(h.end[:m], non_blocking=True)
        if bk.graph is not None:
            bk.graph.replay()
            assert bk.out is not None
            out = bk.out
        else:
            out = self._forward(bk.x, bk.start, bk.end)
        host = h.out[:n]
        host.copy_(out[:n], non_blocking=True)
        if self.cuda:
            torch.cuda.current_stream().synchronize()  # the forward's one wait for the device
        return host.numpy()

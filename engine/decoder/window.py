"""Windowing core of the streaming decoder: pure bookkeeping, no torch, no numpy, no asyncio.

The vocoder (GFSQ -> DVAE/Decoder conv stack -> Vocos conv stack -> ISTFT) is a chain of
*stages*. Between stages everything is per-frame (LayerNorm, Linear, GELU, ...); only the
1-D convolutions look at neighbouring frames. A convolution with kernel ``k``, dilation ``d``
and zero padding ``p`` (stride 1) reads, for output frame ``t``, inputs ``t - p`` ..
``t - p + d*(k-1)``: its *reach* is ``left = p`` frames back and ``right = d*(k-1) - p``
frames ahead (``conv_reach``). Whole-sequence decoding pads every convolution's input with
``left`` zeros before frame 0 and ``right`` zeros after the last frame.

``ConvWindow`` runs one such stage over a sequence that arrives in pieces and produces
exactly the outputs of the whole-sequence convolution, each output once:

* it keeps the last ``left + right`` input frames (a cache) between pushes;
* a push feeds ``[left zeros on the first push] + cache + new frames [+ right zeros when the
  sequence ends]`` to a *valid* (unpadded) convolution, which yields
  ``len(window) - left - right`` outputs: every output whose whole reach is known;
* ``ConvStep`` says how many zeros to add on each side, how many outputs come out and how
  many trailing input frames to keep.

``StackWindow`` chains the stages (the outputs of one are the new inputs of the next);
its ``lookahead`` is the sum of the right reaches: the frames an output waits for.

``OlaWindow`` is the ISTFT overlap-add at the end: frame ``f`` (``n_fft`` windowed samples)
lands on absolute samples ``[f*hop, f*hop + n_fft)``; a sample is final once every frame that
covers it has been added, i.e. once frame ``floor(p / hop)`` exists. ``center`` padding
(torch.istft ``center=True``, what Vocos uses) trims ``n_fft // 2`` samples at both ends, so
``F`` frames give ``(F - 1) * hop`` samples. The window-envelope normalisation is computed
with the same frames on the tensor side, so it is exact at the seams and at both ends.

``ChunkPolicy`` decides when a stream is worth a decoder forward (first chunk small, later
chunks larger, everything at the end).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Reach:
    """Frames a stage reads before (``left``) and after (``right``) the frame it outputs."""

    left: int
    right: int

    def __post_init__(self) -> None:
        if self.left < 0 or self.right < 0:
            raise ValueError(f"reach must be >= 0 on both sides, got {self.left}, {self.right}")

    def __add__(self, other: Reach) -> Reach:
        return Reach(self.left + other.left, self.right + other.right)

    @property
    def span(self) -> int:
        return self.left + self.right


ZERO_REACH = Reach(0, 0)


def conv_reach(kernel_size: int, dilation: int = 1, padding: int = 0, stride: int = 1) -> Reach:
    """Reach of a 1-D convolution with symmetric zero ``padding`` (PyTorch ``Conv1d`` semantics)."""
    if stride != 1:
        raise ValueError(f"only stride 1 convolutions stream frame by frame, got stride {stride}")
    if kernel_size < 1 or dilation < 1:
        raise ValueError(f"bad convolution: kernel {kernel_size}, dilation {dilation}")
    span = dilation * (kernel_size - 1)
    if not 0 <= padding <= span:
        raise ValueError(f"padding {padding} outside 0..{span}: the convolution would change the length")
    if 2 * padding != span:
        # Conv1d pads both sides by `padding`: the output is longer or shorter than the input.
        raise ValueError(f"padding {padding} does not keep the length (kernel {kernel_size}, dilation {dilation})")
    return Reach(padding, span - padding)


def total_reach(reaches: Sequence[Reach]) -> Reach:
    out = ZERO_REACH
    for r in reaches:
        out = out + r
    return out


@dataclass(frozen=True)
class ConvStep:
    """What to feed one stage for one push, and what comes out.

    The window is ``pad_left`` zeros, the ``cached`` frames kept from the previous push, the
    ``n_new`` new frames and ``pad_right`` zeros. A valid convolution over it yields ``n_out``
    frames (the next outputs of the stage, in order). Afterwards keep the last ``keep``
    frames of ``pad_left zeros + cached + new`` (never the right zeros) as the next cache.
    """

    pad_left: int
    cached: int
    n_new: int
    pad_right: int
    n_out: int
    keep: int

    @property
    def window(self) -> int:
        return self.pad_left + self.cached + self.n_new + self.pad_right

    @property
    def runs(self) -> bool:
        """True when the stage produces outputs this push (else it only caches)."""
        return self.n_out > 0


class ConvWindow:
    """One stage over a growing sequence; see the module docstring."""

    def __init__(self, reach: Reach) -> None:
        self.reach = reach
        self.n_in = 0
        """Real input frames received."""
        self.n_out = 0
        """Output frames produced (= positions 0 .. n_out-1 of the whole-sequence output)."""
        self.cached = 0
        """Frames held in the cache (positions n_out - left .. n_in - 1, zeros for < 0)."""
        self.finished = False

    def push(self, n_new: int, final: bool = False) -> ConvStep:
        if self.finished:
            raise RuntimeError("push after the final push")
        if n_new < 0:
            raise ValueError(f"n_new must be >= 0, got {n_new}")
        first = self.n_in == 0 and self.cached == 0
        pad_left = self.reach.left if first else 0
        self.n_in += n_new
        have = pad_left + self.cached + n_new
        if final:
            self.finished = True
            if self.n_in == 0:  # empty sequence: no outputs at all
                return ConvStep(pad_left, self.cached, n_new, 0, 0, 0)
            pad_right = self.reach.right
            n_out = have + pad_right - self.reach.span
            step = ConvStep(pad_left, self.cached, n_new, pad_right, n_out, 0)
            self.n_out += n_out
            self.cached = 0
            return step
        n_out = max(0, have - self.reach.span)
        keep = have - n_out
        step = ConvStep(pad_left, self.cached, n_new, 0, n_out, keep)
        self.n_out += n_out
        self.cached = keep
        return step

    def copy(self) -> ConvWindow:
        other = ConvWindow(self.reach)
        other.n_in, other.n_out, other.cached, other.finished = self.n_in, self.n_out, self.cached, self.finished
        return other


class StackWindow:
    """A chain of stages; the outputs of stage i are the new inputs of stage i+1."""

    def __init__(self, reaches: Sequence[Reach]) -> None:
        self.stages = [ConvWindow(r) for r in reaches]

    @property
    def reach(self) -> Reach:
        return total_reach([s.reach for s in self.stages])

    @property
    def lookahead(self) -> int:
        """Input frames an output frame waits for (sum of right reaches)."""
        return self.reach.right

    def push(self, n_new: int, final: bool = False) -> list[ConvStep]:
        steps = []
        n = n_new
        for stage in self.stages:
            step = stage.push(n, final)
            steps.append(step)
            n = step.n_out
        return steps

    @property
    def n_out(self) -> int:
        return self.stages[-1].n_out if self.stages else 0

    def copy(self) -> StackWindow:
        other = StackWindow([])
        other.stages = [s.copy() for s in self.stages]
        return other


@dataclass(frozen=True)
class OlaStep:
    """One overlap-add push: add ``n_new`` frames after the accumulator, then drop ``drop``
    samples from its front (the ``center`` trim) and emit the next ``emit`` samples."""

    n_new: int
    drop: int
    emit: int


class OlaWindow:
    """ISTFT overlap-add bookkeeping (absolute sample positions; see the module docstring).

    The tensor side keeps an accumulator of samples ``[consumed, n_frames*hop + n_fft - hop)``
    (and the same for the window envelope): frames are added at ``f*hop - consumed``.
    """

    def __init__(self, n_fft: int, hop: int, center: bool = True) -> None:
        if hop <= 0 or n_fft < hop:
            raise ValueError(f"bad ISTFT geometry n_fft={n_fft} hop={hop}")
        self.n_fft = n_fft
        self.hop = hop
        self.trim = n_fft // 2 if center else 0
        self.center = center
        self.n_frames = 0
        self.consumed = 0
        """Absolute samples dropped or emitted so far (front of the accumulator)."""
        self.emitted = 0
        self.finished = False

    def end(self, n_frames: int) -> int:
        """Absolute end of the whole-sequence output for ``n_frames`` frames."""
        if n_frames == 0:
            return self.trim
        full = (n_frames - 1) * self.hop + self.n_fft
        return full - self.trim

    def push(self, n_new: int, final: bool = False) -> OlaStep:
        if self.finished:
            raise RuntimeError("push after the final push")
        if n_new < 0:
            raise ValueError(f"n_new must be >= 0, got {n_new}")
        self.n_frames += n_new
        frontier = self.end(self.n_frames) if final else self.n_frames * self.hop
        self.finished = final
        drop = max(0, min(frontier, self.trim) - self.consumed)
        start = max(self.consumed, self.trim)
        emit = max(0, frontier - start)
        self.consumed = max(self.consumed, frontier)
        self.emitted += emit
        return OlaStep(n_new, drop, emit)

    def samples_for(self, n_frames: int) -> int:
        """Samples of the whole-sequence output for ``n_frames`` frames."""
        return max(0, self.end(n_frames) - self.trim)

    def copy(self) -> OlaWindow:
        other = OlaWindow(self.n_fft, self.hop, self.center)
        other.n_frames, other.consumed, other.emitted, other.finished = (
            self.n_frames,
            self.consumed,
            self.emitted,
            self.finished,
        )
        return other


@dataclass(frozen=True)
class DecoderGeometry:
    """Static shape of a streaming vocoder, derived from its modules."""

    frames_per_step: int
    """Mel frames per GPT step (2 for ChatTTS)."""
    stage_reaches: tuple[Reach, ...]
    """Reach of each convolution stage, in mel frames, in order."""
    n_fft: int
    hop: int
    center: bool = True

    @property
    def reach(self) -> Reach:
        return total_reach(self.stage_reaches)

    @property
    def samples_per_step(self) -> int:
        return self.frames_per_step * self.hop

    @property
    def exact_lookahead_steps(self) -> int:
        """Steps beyond the last emitted one that must be known for exact (whole-sequence) output.

        After ``n`` steps (not final), the stack yields ``frames_per_step*n - right`` frames and
        the overlap-add finalises samples up to ``frames * hop`` (absolute), i.e.
        ``frames*hop - trim`` output samples. Audio of step ``s`` ends at output sample
        ``(s+1) * samples_per_step``.
        """
        trim = self.n_fft // 2 if self.center else 0
        deficit = self.reach.right * self.hop + trim  # samples behind n * samples_per_step
        return -(-deficit // self.samples_per_step)

    def exact_samples(self, n_steps: int, final: bool = False) -> int:
        """Output samples final after ``n_steps`` steps have been pushed."""
        frames_in = self.frames_per_step * n_steps
        if final:
            ola = OlaWindow(self.n_fft, self.hop, self.center)
            return ola.samples_for(frames_in)
        frames = max(0, frames_in - self.reach.right)
        trim = self.n_fft // 2 if self.center else 0
        return max(0, frames * self.hop - trim)

    def whole_samples(self, n_steps: int) -> int:
        """Samples of a whole-sequence decode of ``n_steps`` steps (upstream: (2T-1)*256)."""
        return self.exact_samples(n_steps, final=True)


@dataclass(frozen=True)
class ChunkPolicy:
    """When a stream is worth a decoder forward, in GPT steps.

    ``lookahead_steps`` is how far behind the newest step audio is emitted: the exact value
    (``DecoderGeometry.exact_lookahead_steps``) gives output identical to whole-sequence
    decoding; less emits the newest audio from a provisional decode (see docs/decoder.md).

    Rules (``ready``):

    * the end of the utterance always runs (flush);
    * the first chunk is due when ``first_chunk_steps`` steps are audible;
    * later chunks: with the stream's *lead* known (``lead_steps``: audio emitted minus the
      time since the first chunk, i.e. what a client that started playing at the first chunk
      still has buffered), a chunk is due once ``lead_fraction`` of the lead is audible and
      not emitted, at least ``min_chunk_steps``, at most ``chunk_steps``. Waiting for a chunk
      of ``S`` steps costs ``S / r`` of the lead when the engine makes ``r`` x real time, so
      the chunk size must follow the lead, not the audio already emitted: a rule that
      doubles the chunk with the emitted audio (``first, first, 2*first, ...``, the rule
      without a lead) leaves ``E * (1 - 2/r)`` of margin before each chunk and underruns at
      every stream start once the engine is under 2x real time (measured: bench/gateway_pacing.py);
    * without a lead (``lead_steps=None``) the doubling rule above, capped at ``chunk_steps``;
    * before the first audio, once ``chunk_steps`` steps are pending they are pushed anyway
      (pre-decoding the context): the decoder computes each layer as far as its context allows,
      so the forward that makes the first chunk due has little left to do.

    ``push_steps`` caps one forward at ``max_push_steps`` after the first chunk, so a backlog
    (a consumer that paused) is decoded in several forwards instead of one long one that every
    other stream in its batch would wait for.
    """

    first_chunk_steps: int
    chunk_steps: int
    lookahead_steps: int
    min_chunk_steps: int = 3
    lead_fraction: float = 0.5
    max_push_steps: int = 0
    """0: ``2 * chunk_steps``."""

    def __post_init__(self) -> None:
        if self.first_chunk_steps < 1 or self.chunk_steps < 1 or self.lookahead_steps < 0:
            raise ValueError(f"bad chunk policy {self}")
        if self.min_chunk_steps < 1 or not 0.0 < self.lead_fraction <= 1.0 or self.max_push_steps < 0:
            raise ValueError(f"bad chunk policy {self}")

    @property
    def push_cap_steps(self) -> int:
        return self.max_push_steps or 2 * self.chunk_steps

    def audible_steps(self, decoded_steps: int) -> int:
        """Steps whose audio is emitted once ``decoded_steps`` steps are decoded (not final)."""
        return max(0, decoded_steps - self.lookahead_steps)

    def next_chunk_steps(self, audible_done: int, lead_steps: float | None = None) -> int:
        """Audible steps the next chunk waits for, given ``audible_done`` already emitted and the
        stream's current lead (``None``: unknown)."""
        if audible_done <= 0:
            return self.first_chunk_steps
        if lead_steps is None:
            return max(1, min(self.chunk_steps, max(self.first_chunk_steps, audible_done)))
        want = int(max(0.0, lead_steps) * self.lead_fraction)
        return max(1, min(self.chunk_steps, max(self.min_chunk_steps, want)))

    def ready(self, received_steps: int, decoded_steps: int, finished: bool,
              lead_steps: float | None = None) -> bool:
        """True when a forward should run for this stream now.

        ``decoded_steps``: steps already pushed to the decoder; ``received_steps`` includes them.
        """
        if finished:
            return True
        pending = received_steps - decoded_steps
        if pending <= 0:
            return False
        done = self.audible_steps(decoded_steps)
        if self.audible_steps(received_steps) - done >= self.next_chunk_steps(done, lead_steps):
            return True
        # before the first audio: pre-decode the context (a push that would emit a chunk
        # smaller than first_chunk_steps waits for the rule above instead)
        return pending >= self.chunk_steps and self.audible_steps(received_steps) == 0

    def push_steps(self, received_steps: int, decoded_steps: int, finished: bool,
                   lead_steps: float | None = None) -> int:
        """Steps to push now (0: wait). Everything pending at the end or before the first
        audio; else at most ``push_cap_steps`` (call again after the push: the rest may be due)."""
        if not self.ready(received_steps, decoded_steps, finished, lead_steps):
            return 0
        pending = received_steps - decoded_steps
        if finished or self.audible_steps(decoded_steps) == 0:
            return pending
        return min(pending, self.push_cap_steps)

    def emit_steps(self, received_steps: int) -> int:
        """Steps of audio to emit after decoding ``received_steps`` (not final)."""
        return self.audible_steps(received_steps)

    def first_audio_steps(self) -> int:
        """Steps the GPT must produce before the first chunk (utterances that long or longer)."""
        return self.first_chunk_steps + self.lookahead_steps


@dataclass
class StreamLead:
    """How far a stream's emitted audio is ahead of a listener who started playing at its first
    chunk (pure: the caller passes ``now_s``). Feeds ``ChunkPolicy``'s ``lead_steps``."""

    step_s: float
    """Seconds of audio per step."""
    emitted_steps: float = 0.0
    t_first_s: float | None = None

    def emitted(self, steps: float, now_s: float) -> None:
        if steps <= 0:
            return
        if self.t_first_s is None:
            self.t_first_s = now_s
        self.emitted_steps += steps

    def lead_steps(self, now_s: float) -> float | None:
        """Emitted audio not yet played, in steps (None before the first chunk)."""
        if self.t_first_s is None:
            return None
        return self.emitted_steps - max(0.0, now_s - self.t_first_s) / self.step_s

"""Windowing core of the streaming decoder: pure arithmetic, no torch, no numpy, no asyncio.

The vocoder (GFSQ -> DVAE/Decoder conv stack -> Vocos conv stack -> ISTFT) is a chain of
*stages*. Between stages everything is per-frame (LayerNorm, Linear, GELU, ...); only the
1-D convolutions look at neighbouring frames. A convolution with kernel ``k``, dilation ``d``
and zero padding ``p`` (stride 1) reads, for output frame ``t``, inputs ``t - p`` ..
``t - p + d*(k-1)``: its *reach* is ``left = p`` frames back and ``right = d*(k-1) - p``
frames ahead (``conv_reach``); the stack's reach is the sum (``DecoderGeometry``).

The streaming decoder has one static shape (``WindowSpec``): a forward decodes, per row, a
window of ``left_steps + chunk_steps + lookahead_steps`` GPT steps whole (padded convolutions,
every frame outside ``[0, end)`` zeroed at every convolution's input, as a whole decode pads
the utterance), and keeps the samples of its chunk. ``left_steps`` is the stack's left reach
(``DecoderGeometry.exact_left_steps``), so a chunk's samples equal the whole-utterance decode's
once ``exact_lookahead_steps`` steps after it are known; with fewer, its newest samples are
those of a decode of the utterance so far (provisional) and seams are crossfaded.

``ChunkPolicy`` decides when a stream is worth a forward (first chunk small, later chunks
following the listener's lead, everything at the end); ``WindowSpec.rows`` cuts an emission
into rows of at most ``chunk_steps`` steps.
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

    @property
    def trim(self) -> int:
        """Samples the ISTFT ``center`` padding cuts at both ends."""
        return self.n_fft // 2 if self.center else 0

    @property
    def exact_left_steps(self) -> int:
        """Steps before a chunk's first step that its first sample depends on.

        Output sample ``o`` is absolute ISTFT sample ``o + trim``; the frames covering sample ``p``
        start at ``ceil((p - n_fft + 1) / hop)``, and each reads ``reach.left`` input frames back.
        """
        k = -((self.n_fft - self.trim - 1) // self.hop)  # ceil((trim - n_fft + 1) / hop)
        return -(-(self.reach.left - k) // self.frames_per_step)

    def whole_samples(self, n_steps: int) -> int:
        """Samples of a whole-sequence decode of ``n_steps`` steps (upstream: (2T-1)*256)."""
        frames = self.frames_per_step * n_steps
        if frames == 0:
            return 0
        return max(0, (frames - 1) * self.hop + self.n_fft - 2 * self.trim)


@dataclass(frozen=True)
class Row:
    """One window of a batched forward: emit output samples ``[start*S, start*S + samples)`` of
    one stream (``S`` = samples per step), decoded from the window of steps
    ``[start - left_steps, start - left_steps + window_steps)`` with every step at or after
    ``end`` treated as absent (the sequence ends there, as in a whole decode of ``end`` steps)."""

    start: int
    steps: int
    end: int
    samples: int


@dataclass(frozen=True)
class WindowSpec:
    """The decoder's one static shape: every forward decodes windows of ``window_steps`` steps,
    ``left_steps`` of left context, up to ``chunk_steps`` new ones and ``lookahead_steps`` after
    them. With ``lookahead_steps >= geometry.exact_lookahead_steps`` a row's samples equal the
    whole-utterance decode's (exact mode); below, the newest samples are decoded as if the
    utterance ended at the newest step (provisional), and each row's first ``crossfade_samples``
    blend from the previous row's continuation so the seam does not click, and the left context may
    be shorter than the exact left reach (``left_context_steps``): a sample's dependence on distant
    input decays fast, far faster than the reach (docs/decoder.md, "The left context: measured")."""

    geometry: DecoderGeometry
    chunk_steps: int
    lookahead_steps: int
    crossfade_samples: int = 256
    left_context_steps: int = -1
    """Steps of left context in lookahead mode (-1: the exact left reach). Exact mode always takes
    the exact left reach, so its rows stay equal to the whole decode."""

    def __post_init__(self) -> None:
        if self.chunk_steps < 1 or self.lookahead_steps < 0 or self.crossfade_samples < 0:
            raise ValueError(f"bad window: chunk {self.chunk_steps}, lookahead {self.lookahead_steps}")
        if self.left_context_steps < -1 or self.left_context_steps == 0:
            raise ValueError(f"bad window: left context {self.left_context_steps} (-1: exact, else >= 1)")
        if self.crossfade_samples > self.geometry.n_fft - self.geometry.hop:
            raise ValueError("crossfade longer than the ISTFT overlap")

    @property
    def exact(self) -> bool:
        return self.lookahead_steps >= self.geometry.exact_lookahead_steps

    @property
    def left_steps(self) -> int:
        exact_left = self.geometry.exact_left_steps
        if self.exact or self.left_context_steps < 0:
            return exact_left
        return min(self.left_context_steps, exact_left)

    @property
    def window_steps(self) -> int:
        return self.left_steps + self.chunk_steps + self.lookahead_steps

    @property
    def xfade(self) -> int:
        """Continuation samples each row returns after its own (0 in exact mode)."""
        return 0 if self.exact else self.crossfade_samples

    @property
    def out_samples(self) -> int:
        """Samples a row's forward returns: its chunk at most, then the continuation."""
        return self.chunk_steps * self.geometry.samples_per_step + self.xfade

    @property
    def out_offset(self) -> int:
        """Window-local ISTFT sample where a row's output starts."""
        return self.left_steps * self.geometry.samples_per_step + self.geometry.trim

    def rows(self, emitted_steps: int, target_steps: int, received_steps: int, final: bool) -> list[Row]:
        """Rows that emit steps ``[emitted_steps, target_steps)`` of a stream with
        ``received_steps`` known (``final``: that is all of it; the last row stops at the
        whole decode's end)."""
        if not 0 <= emitted_steps <= target_steps <= received_steps:
            raise ValueError(f"bad emission {emitted_steps}..{target_steps} of {received_steps}")
        g = self.geometry
        sps = g.samples_per_step
        end_total = g.whole_samples(received_steps) if final else None
        out = []
        a = emitted_steps
        while a < target_steps:
            n = min(self.chunk_steps, target_steps - a)
            samples = n * sps
            if end_total is not None:
                samples = max(0, min(samples, end_total - a * sps))
            out.append(Row(a, n, min(received_steps, a + self.chunk_steps + self.lookahead_steps), samples))
            a += n
        return out


COALESCE_MARGIN_S = 0.3
"""``ChunkPolicy.idle_s``: lead a stream keeps in hand whatever it waits for."""
COALESCE_MIN_S = 0.004
"""Shorter waits are not worth a timer."""
COALESCE_MAX_S = 0.5
"""Longest single wait (the stream re-reads its lead and the engine's rate after it)."""


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
      every stream start once the engine is under 2x real time;
    * without a lead (``lead_steps=None``) the doubling rule above, capped at ``chunk_steps``;
    * a stream generated slower than ``full_chunks_below_x`` times real time (``rate_x``, when known)
      gets whole chunks (``chunk_steps``) whatever its lead: no chunk size builds a lead then,
      and every forward costs the decoder one window whatever the chunk's size, so small chunks
      would only multiply the decoder's share of a GPU that is already short for the GPT.

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
    full_chunks_below_x: float = 0.0
    """Whole chunks for a stream generated slower than this multiple of real time (0: never)."""

    def __post_init__(self) -> None:
        if self.first_chunk_steps < 1 or self.chunk_steps < 1 or self.lookahead_steps < 0:
            raise ValueError(f"bad chunk policy {self}")
        if self.min_chunk_steps < 1 or not 0.0 < self.lead_fraction <= 1.0 or self.max_push_steps < 0 \
                or self.full_chunks_below_x < 0:
            raise ValueError(f"bad chunk policy {self}")

    @property
    def push_cap_steps(self) -> int:
        return self.max_push_steps or 2 * self.chunk_steps

    def audible_steps(self, decoded_steps: int) -> int:
        """Steps whose audio is emitted once ``decoded_steps`` steps are decoded (not final). The
        newest step is always held back, even with no lookahead: the stream may end right after
        it, and a whole decode's last step is shorter (the centred STFT's tail) than the one
        emitted mid-stream."""
        return max(0, decoded_steps - max(1, self.lookahead_steps))

    def next_chunk_steps(self, audible_done: int, lead_steps: float | None = None,
                         rate_x: float | None = None) -> int:
        """Audible steps the next chunk waits for, given ``audible_done`` already emitted, the
        stream's current lead and the rate its steps arrive at, x real time (``None``: unknown)."""
        if audible_done <= 0:
            return self.first_chunk_steps
        if rate_x is not None and rate_x < self.full_chunks_below_x:
            return self.chunk_steps
        if lead_steps is None:
            return max(1, min(self.chunk_steps, max(self.first_chunk_steps, audible_done)))
        want = int(max(0.0, lead_steps) * self.lead_fraction)
        return max(1, min(self.chunk_steps, max(self.min_chunk_steps, want)))

    def ready(self, received_steps: int, decoded_steps: int, finished: bool,
              lead_steps: float | None = None, rate_x: float | None = None) -> bool:
        """True when a forward should run for this stream now.

        ``decoded_steps``: steps already pushed to the decoder; ``received_steps`` includes them.
        """
        if finished:
            return True
        pending = received_steps - decoded_steps
        if pending <= 0:
            return False
        done = self.audible_steps(decoded_steps)
        return self.audible_steps(received_steps) - done >= self.next_chunk_steps(done, lead_steps, rate_x)

    def push_steps(self, received_steps: int, decoded_steps: int, finished: bool,
                   lead_steps: float | None = None, rate_x: float | None = None) -> int:
        """Steps to push now (0: wait). Everything pending at the end or before the first
        audio; else at most ``push_cap_steps`` (call again after the push: the rest may be due)."""
        if not self.ready(received_steps, decoded_steps, finished, lead_steps, rate_x):
            return 0
        pending = received_steps - decoded_steps
        if finished or self.audible_steps(decoded_steps) == 0:
            return pending
        return min(pending, self.push_cap_steps)

    def steps_short(self, received_steps: int, decoded_steps: int, lead_steps: float | None,
                    rate_x: float | None = None) -> int:
        """Audible steps still to arrive before the next forward is due (0: due now, or before
        the first audio, where every step counts)."""
        done = self.audible_steps(decoded_steps)
        if done <= 0 or lead_steps is None:
            return 0
        have = self.audible_steps(received_steps) - done
        return max(0, self.next_chunk_steps(done, lead_steps, rate_x) - have)

    def idle_s(self, received_steps: int, decoded_steps: int, lead_steps: float | None, step_s: float,
               arrival_steps_per_s: float | None, margin_s: float = COALESCE_MARGIN_S) -> float:
        """How long a stream may leave its code stream unread without changing when a forward
        runs: the time the engine needs for the steps the next chunk still waits for (at the rate
        steps arrived so far), less a quarter for the estimate, and never eating into the last
        ``margin_s`` of the stream's lead (halved: the wait also spends lead). Reading once per
        chunk instead of once per GPT step is what keeps the consumer's event loop off the hot
        path at hundreds of streams (the code stream merges what arrives meanwhile)."""
        rate_x = arrival_steps_per_s * step_s if arrival_steps_per_s else None
        short = self.steps_short(received_steps, decoded_steps, lead_steps, rate_x)
        if short <= 0 or not arrival_steps_per_s or arrival_steps_per_s <= 0 or lead_steps is None:
            return 0.0
        wait_s = 0.75 * short / arrival_steps_per_s
        spare_s = 0.5 * (lead_steps * step_s - margin_s)
        wait_s = min(wait_s, spare_s, COALESCE_MAX_S)
        return wait_s if wait_s >= COALESCE_MIN_S else 0.0

    def emit_steps(self, received_steps: int) -> int:
        """Steps of audio to emit after decoding ``received_steps`` (not final)."""
        return self.audible_steps(received_steps)

    def first_audio_steps(self) -> int:
        """Steps the GPT must produce before the first chunk (utterances that long or longer)."""
        return self.first_chunk_steps + max(1, self.lookahead_steps)


@dataclass
class StreamLead:
    """How far a stream's emitted audio is ahead of a listener who starts playing it at its first
    chunk, or once the audio queued ahead of it is played, whichever is later (pure: the caller
    passes ``now_s``). Feeds ``ChunkPolicy``'s ``lead_steps``."""

    step_s: float
    """Seconds of audio per step."""
    emitted_steps: float = 0.0
    t_first_s: float | None = None
    queued_until_s: float | None = None
    """When the listener finishes the audio queued ahead of this stream (``now_s`` clock); None:
    nothing is queued, the listener starts on the first chunk."""

    def emitted(self, steps: float, now_s: float) -> None:
        if steps <= 0:
            return
        if self.t_first_s is None:
            self.t_first_s = now_s
        self.emitted_steps += steps

    def lead_steps(self, now_s: float) -> float | None:
        """Audio the listener has before this stream runs dry, in steps: the emitted audio not
        yet played, plus what is still queued ahead of it (None before the first chunk)."""
        if self.t_first_s is None:
            return None
        t_play = self.t_first_s if self.queued_until_s is None else max(self.t_first_s, self.queued_until_s)
        return self.emitted_steps - (now_s - t_play) / self.step_s

"""ChatTTS code sampling, batched over requests with per-request parameters (torch only).

Upstream (``ChatTTS/core.py`` ``_infer_code`` + ``gpt.generate``) processes the logits of each
codebook in this order: divide by temperature -> repetition penalty (``penalty ** count`` of
each code in the last ``window`` frames of the same codebook; positive logits divided,
negative multiplied) -> top-p (keep >= 3) -> top-k (keep >= 3) -> EOS blocked before
``min_new_token`` steps -> softmax -> multinomial. Greedy rows (temperature 0) take the
argmax of the penalised, EOS-masked logits: temperature, top-p and top-k never move the
argmax.

Everything here works on ``[rows, codebooks, codes]`` float32 tensors; the per-row
parameters are 1-D tensors of length ``rows``. No function here reads a device value on the
host or loops over rows: the worker runs it inside the GPU step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

#: Both upstream warpers keep at least this many candidates.
MIN_TOKENS_TO_KEEP = 3


@dataclass
class RowParams:
    """Per-row sampling parameters, as tensors on the logits' device."""

    temperature: torch.Tensor
    """float32 [R]; rows with ``greedy`` ignore it."""
    top_p: torch.Tensor
    """float32 [R]."""
    top_k: torch.Tensor
    """int64 [R]; <= 0 disables top-k."""
    penalty: torch.Tensor
    """float32 [R]; 1.0 disables the repetition penalty."""
    block_eos: torch.Tensor
    """bool [R]: the step is before ``min_new_tokens``."""
    greedy: torch.Tensor
    """bool [R]."""


def repetition_counts(history: torch.Tensor, num_codes: int) -> torch.Tensor:
    """Counts of each code per (row, codebook) in ``history`` ``[R, C, W]`` (-1 = padding)."""
    rows, books, _ = history.shape
    counts = torch.zeros(rows, books, num_codes + 1, dtype=torch.int64, device=history.device)
    idx = torch.where(history < 0, num_codes, history)
    counts.scatter_add_(2, idx, torch.ones_like(idx))
    return counts[..., :num_codes]


def apply_repetition_penalty(logits: torch.Tensor, counts: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    alpha = torch.pow(penalty.view(-1, 1, 1), counts.to(logits.dtype))
    return torch.where(logits < 0, logits * alpha, logits / alpha)


def apply_top_p_top_k(logits: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Top-p then top-k on the last dim with HF semantics, from ONE sort.

    Top-p (HF ``TopPLogitsWarper``): in ascending order, drop tokens whose cumulative
    probability is <= 1 - p, keeping the last 3. The kept tokens are a prefix of the descending
    order, so top-k (``TopKLogitsWarper``: drop scores below the k-th largest of the top-p
    result, k >= 3) reads its threshold from the same sort. The ascending cumulative sums are
    computed over the flipped descending sort: the same values in the same order as HF's.
    """
    n = logits.shape[-1]
    sorted_desc, idx_desc = torch.sort(logits, dim=-1, descending=True)
    cum_asc = sorted_desc.flip(-1).softmax(dim=-1).cumsum(dim=-1)
    remove_asc = cum_asc <= (1.0 - top_p).view(-1, 1, 1)
    remove_asc[..., -MIN_TOKENS_TO_KEEP:] = False
    remove_desc = remove_asc.flip(-1)
    filtered_desc = sorted_desc.masked_fill(remove_desc, float("-inf"))
    k = torch.where(top_k <= 0, n, top_k).clamp(min=MIN_TOKENS_TO_KEEP, max=n)
    kth = filtered_desc.gather(-1, (k - 1).view(-1, 1, 1).expand(-1, logits.shape[1], 1))
    remove_desc = remove_desc | (filtered_desc < kth)
    remove = torch.empty_like(remove_desc).scatter_(-1, idx_desc, remove_desc)
    return logits.masked_fill(remove, float("-inf"))


def process_logits(
    logits: torch.Tensor, history: torch.Tensor, params: RowParams, eos_code: int
) -> torch.Tensor:
    """Upstream's logits pipeline for ``logits`` ``[R, C, N]`` (float32). Returns new logits.

    For greedy rows the result is only meaningful through its argmax. Every stage runs for
    every row (a penalty of 1.0 and an unblocked EOS leave the logits bit-identical), so the
    step never asks the device which rows need it.
    """
    temp = torch.where(params.greedy, torch.ones_like(params.temperature), params.temperature)
    x = logits / temp.view(-1, 1, 1)
    x = apply_repetition_penalty(x, repetition_counts(history, logits.shape[-1]), params.penalty)
    x = apply_top_p_top_k(x, params.top_p, params.top_k)
    x[..., eos_code] = torch.where(params.block_eos.view(-1, 1), float("-inf"), x[..., eos_code])
    return x


# --------------------------------------------------------------------------- counter-based RNG

_M32 = 0xFFFFFFFF
_MUL = 0x045D9F3B  # < 2**27: products of 32-bit values stay inside int64


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) on int64 tensors holding 32-bit values."""
    x = ((x >> 16) ^ x) * _MUL & _M32
    x = ((x >> 16) ^ x) * _MUL & _M32
    return (x >> 16) ^ x


_CODE_KEYS: dict[tuple[int, int, str], torch.Tensor] = {}


def code_keys(books: int, n: int, device: torch.device) -> torch.Tensor:
    """Per (codebook, code) hash constants ``[books, n]`` (computed once per device)."""
    key = (books, n, str(device))
    t = _CODE_KEYS.get(key)
    if t is None:
        idx = torch.arange(books * n, device=device, dtype=torch.int64).view(books, n)
        t = _CODE_KEYS[key] = _mix32(_mix32(idx * 0x2545 + 0x7F4A))
    return t


def uniform_noise(seed: torch.Tensor, step: torch.Tensor, code_keys: torch.Tensor) -> torch.Tensor:
    """Uniform (0, 1) float32 ``[R, books, n]``, a pure function of (seed, step, book, code).

    A counter-based generator: a row's draws depend on its own seed and frame index only, not
    on the batch it shares, so seeded rows reproduce whatever runs beside them, and the step
    keeps no generator objects (one tensor expression for the whole batch).
    """
    lo, hi = seed & _M32, (seed >> 32) & _M32
    key = _mix32(lo ^ _mix32(hi ^ (step & _M32)))  # [R]
    bits = _mix32(key.view(-1, 1, 1) ^ code_keys.unsqueeze(0))  # [R, books, n]
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def draw(processed: torch.Tensor, greedy: torch.Tensor, seed: torch.Tensor, step: torch.Tensor,
         code_keys: torch.Tensor) -> torch.Tensor:
    """One code per (row, codebook) of ``processed`` ``[R, C, N]`` -> int64 ``[R, C]``.

    Sampled rows draw from ``softmax(processed)`` by the Gumbel-max rule (argmax of the logits
    plus Gumbel noise ``-log(-log(u))``: exactly a categorical draw, as upstream's
    softmax + multinomial), with ``u`` from :func:`uniform_noise`; greedy rows take the argmax.
    """
    u = uniform_noise(seed, step, code_keys)
    noise = torch.where(greedy.view(-1, 1, 1), torch.zeros_like(u), -torch.log(-torch.log(u)))
    return (processed + noise).argmax(dim=-1)


def sample_step(
    hidden: torch.Tensor, heads: torch.Tensor, slot: torch.Tensor, samples: torch.Tensor,
    codes: torch.Tensor, n_frames: torch.Tensor, gen: torch.Tensor, window: torch.Tensor,
    temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, penalty: torch.Tensor,
    min_new: torch.Tensor, greedy: torch.Tensor, seed: torch.Tensor, code_keys: torch.Tensor,
    scratch: int, eos_code: int, max_window: int, code_bits: int, gen_shift: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sampling step for the rows of a batch, as a pure function of the device state.

    ``hidden [R, H]`` -> the four heads -> the slot's history of the last ``window`` frames ->
    :func:`process_logits` -> one draw per codebook (codebook 0 forced to EOS where any
    codebook drew EOS, as upstream stops on any EOS). Returns (codes ``[R, C]``, packed frame
    for the frame table ``[R]``, write slot ``[R]`` (scratch for rows that do not sample),
    frame index ``[R]``); the caller scatters them into the state. Flat tensor arguments keep
    it a plain function for ``torch.compile``.
    """
    h = hidden.to(torch.float32)
    books = heads.shape[0]
    logits = torch.stack([torch.nn.functional.linear(h, heads[i]) for i in range(books)], 1)
    k = n_frames[slot]
    j = torch.arange(max_window, device=h.device, dtype=torch.int64)
    fidx = k.unsqueeze(1) - max_window + j  # [R, W]
    valid = (fidx >= 0) & (j.unsqueeze(0) >= max_window - window[slot].unsqueeze(1))
    hist = codes[slot.unsqueeze(1), fidx.clamp(min=0, max=codes.shape[1] - 1)]  # [R, W, C]
    hist = torch.where(valid.unsqueeze(-1), hist, torch.full_like(hist, -1)).transpose(1, 2)
    g = greedy[slot]
    params = RowParams(temperature[slot], top_p[slot], top_k[slot], penalty[slot], k < min_new[slot], g)
    out = draw(process_logits(logits, hist, params, eos_code), g, seed[slot], k, code_keys)
    any_eos = (out == eos_code).any(dim=1)
    out = torch.cat([torch.where(any_eos, torch.full_like(out[:, 0], eos_code), out[:, 0]).unsqueeze(1), out[:, 1:]], 1)
    packed = gen[slot] << gen_shift
    for i in range(books):
        packed = packed | (out[:, i] << (i * code_bits))
    wslot = torch.where(samples, slot, torch.full_like(slot, scratch))
    return out, packed, wslot, k.clamp(max=codes.shape[1] - 1)


_COMPILED: dict[str, Callable[..., Any]] = {}


def frame_sampler(device: torch.device) -> Callable[..., Any]:
    """:func:`sample_step` for ``device``: compiled with inductor (dynamic batch size) on CUDA,
    so the ~60 small elementwise kernels of the pipeline and the RNG launch as a few fused
    ones (the host's launch work is what limits a small batch); eager on CPU."""
    key = device.type
    fn = _COMPILED.get(key)
    if fn is None:
        fn = sample_step if key == "cpu" else torch.compile(sample_step, dynamic=True)
        _COMPILED[key] = fn
    return fn


def use_eager(device: torch.device) -> None:
    """Fall back to the eager sampler on ``device`` (the compiled one failed)."""
    _COMPILED[device.type] = sample_step

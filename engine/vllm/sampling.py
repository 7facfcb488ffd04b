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

from dataclasses import dataclass

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


def uniform_noise(seed: torch.Tensor, step: torch.Tensor, books: int, n: int) -> torch.Tensor:
    """Uniform (0, 1) float32 ``[R, books, n]``, a pure function of (seed, step, book, code).

    A counter-based generator: a row's draws depend on its own seed and frame index only, not
    on the batch it shares, so seeded rows reproduce whatever runs beside them, and the step
    keeps no generator objects (one fused tensor expression for the whole batch).
    """
    dev = seed.device
    lo, hi = seed & _M32, (seed >> 32) & _M32
    book = torch.arange(books, device=dev, dtype=torch.int64)
    key = _mix32(lo ^ _mix32(hi ^ _mix32(step & _M32)))  # [R]
    key = _mix32(key.view(-1, 1) ^ _mix32(book + 0x9E37).view(1, -1))  # [R, books]
    code = _mix32(torch.arange(n, device=dev, dtype=torch.int64) * 0x2545 + 0x7F4A)  # [n]
    bits = _mix32(key.unsqueeze(-1) ^ code.view(1, 1, -1))  # [R, books, n]
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def sample_codes(processed: torch.Tensor, greedy: torch.Tensor, seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """One code per (row, codebook) of ``processed`` ``[R, C, N]`` -> int64 ``[R, C]``.

    Sampled rows draw from ``softmax(processed)`` by the Gumbel-max rule (argmax of the logits
    plus Gumbel noise ``-log(-log(u))``: exactly a categorical draw, as upstream's
    softmax + multinomial), with ``u`` from :func:`uniform_noise`; greedy rows take the argmax.
    """
    rows, books, n = processed.shape
    u = uniform_noise(seed, step, books, n)
    gumbel = -torch.log(-torch.log(u))
    noise = torch.where(greedy.view(-1, 1, 1), torch.zeros_like(gumbel), gumbel)
    return (processed + noise).argmax(dim=-1)

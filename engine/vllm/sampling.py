"""ChatTTS code sampling, batched over requests with per-request parameters (torch only).

Upstream (``ChatTTS/core.py`` ``_infer_code`` + ``gpt.generate``) processes the logits of each
codebook in this order: divide by temperature -> repetition penalty (``penalty ** count`` of
each code in the last ``window`` frames of the same codebook; positive logits divided,
negative multiplied) -> top-p (keep >= 3) -> top-k (keep >= 3) -> EOS blocked before
``min_new_token`` steps -> softmax -> multinomial. Greedy rows (temperature 0) take the
argmax of the penalised, EOS-masked logits: temperature, top-p and top-k never move the
argmax.

Everything here works on ``[rows, codebooks, codes]`` float32 tensors; the per-row
parameters are 1-D tensors of length ``rows``.
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


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filter on the last dim, HF semantics (ascending sort, keep the last 3)."""
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cum <= (1.0 - top_p).view(-1, 1, 1)
    remove_sorted[..., -MIN_TOKENS_TO_KEEP:] = False
    remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Top-k filter on the last dim, HF semantics (k >= 3, ties at the k-th value kept)."""
    n = logits.shape[-1]
    k = torch.where(top_k <= 0, n, top_k).clamp(min=MIN_TOKENS_TO_KEEP, max=n)
    sorted_desc = torch.sort(logits, dim=-1, descending=True).values
    kth = sorted_desc.gather(-1, (k - 1).view(-1, 1, 1).expand(-1, logits.shape[1], 1))
    return logits.masked_fill(logits < kth, float("-inf"))


def process_logits(
    logits: torch.Tensor, history: torch.Tensor, params: RowParams, eos_code: int
) -> torch.Tensor:
    """Upstream's logits pipeline for ``logits`` ``[R, C, N]`` (float32). Returns new logits.

    For greedy rows the result is only meaningful through its argmax.
    """
    temp = torch.where(params.greedy, torch.ones_like(params.temperature), params.temperature)
    x = logits / temp.view(-1, 1, 1)
    if bool((params.penalty != 1.0).any()):
        x = apply_repetition_penalty(x, repetition_counts(history, logits.shape[-1]), params.penalty)
    x = apply_top_p(x, params.top_p)
    x = apply_top_k(x, params.top_k)
    if bool(params.block_eos.any()):
        x[..., eos_code] = torch.where(params.block_eos.view(-1, 1), float("-inf"), x[..., eos_code])
    return x


def sample_codes(
    processed: torch.Tensor,
    greedy: torch.Tensor,
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    """One code per (row, codebook) of ``processed`` ``[R, C, N]`` -> int64 ``[R, C]``.

    Greedy rows take the argmax; seeded rows draw from their own generator (reproducible
    whatever the batch); the others share the default generator.
    """
    rows, books, n = processed.shape
    out = processed.argmax(dim=-1)
    if bool(greedy.all()):
        return out
    probs = torch.softmax(processed, dim=-1)
    unseeded = [r for r in range(rows) if not bool(greedy[r]) and generators[r] is None]
    if unseeded:
        sel = torch.tensor(unseeded, device=processed.device)
        drawn = torch.multinomial(probs[sel].reshape(-1, n), 1).view(len(unseeded), books)
        out[sel] = drawn
    for r in range(rows):
        gen = generators[r]
        if gen is not None and not bool(greedy[r]):
            out[r] = torch.multinomial(probs[r], 1, generator=gen).view(books)
    return out

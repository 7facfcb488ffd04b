"""Per-request ChatTTS state inside the vLLM worker, shared by the logits processor and the model.

vLLM samples codebook 0 (the unified vocabulary's code range); codebooks 1..3 are sampled
by the model in ``compute_logits`` and kept here, per request, for the whole request: the
next step's input embedding adds them to codebook 0's, and a preempted request that is
recomputed from scratch reads them back frame by frame.

Lifetime: the state object is attached to the request's ``SamplingParams`` (the worker keeps
that object for exactly as long as it keeps the request, preemption included), so it is
freed with the request and needs no bookkeeping of finished requests.

Which batch row is which request: the logits processor's ``update_state(BatchUpdate)``
(called before each forward pass) keeps :class:`BatchRegistry.slots` in batch order.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

#: Key of our entry in ``SamplingParams.extra_args``.
EXTRA_KEY = "voicegw_chattts"
_STATE_ATTR = "_voicegw_state"


@dataclass
class RequestParams:
    """Request parameters carried in ``SamplingParams.extra_args[EXTRA_KEY]`` (plain JSON types)."""

    key: str
    temperature: float
    top_p: float
    top_k: int
    penalty: float
    window: int
    min_new: int
    max_new: int
    greedy: bool
    seed: int | None
    speaker: list[float] | None
    side_codes: bool = True
    """Debug switch: False drops codebooks 1..3 from the input embedding (negative control)."""
    prefix: list[list[int]] | None = None
    """Resumed request: the ``[k][num_vq]`` frames generated before (their codebook-0 tokens
    end the prompt). The state starts with them as frames 0..k-1, so the model embeds them like
    a recompute after preemption and samples frame k at the end of the prefill."""

    def to_extra(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "penalty": self.penalty,
            "window": self.window,
            "min_new": self.min_new,
            "max_new": self.max_new,
            "greedy": self.greedy,
            "seed": self.seed,
            "speaker": self.speaker,
            "side_codes": self.side_codes,
            "prefix": self.prefix,
        }

    @classmethod
    def from_extra(cls, d: dict[str, Any]) -> RequestParams:
        return cls(
            key=str(d["key"]),
            temperature=float(d["temperature"]),
            top_p=float(d["top_p"]),
            top_k=int(d["top_k"]),
            penalty=float(d["penalty"]),
            window=int(d["window"]),
            min_new=int(d["min_new"]),
            max_new=int(d["max_new"]),
            greedy=bool(d["greedy"]),
            seed=None if d.get("seed") is None else int(d["seed"]),
            speaker=None if d.get("speaker") is None else [float(x) for x in d["speaker"]],
            side_codes=bool(d.get("side_codes", True)),
            prefix=None if d.get("prefix") is None else [[int(c) for c in row] for row in d["prefix"]],
        )


@dataclass
class RequestState:
    params: RequestParams
    prompt_len: int
    codes: np.ndarray
    """int64 ``[max_new + 1, num_vq]``: codes of frames 0..n_frames-1 (column 0 is filled from
    the input ids of later steps)."""
    n_frames: int = 0
    """Frames whose codebooks 1..3 have been sampled (= steps vLLM has sampled or is sampling)."""
    generator: torch.Generator | None = None
    speaker: torch.Tensor | None = None
    """Speaker vector (model dtype/device), created lazily by the model."""
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def create(cls, params: RequestParams, prompt_len: int, num_vq: int, device: torch.device) -> RequestState:
        """``prompt_len``: all prompt tokens vLLM holds; for a resumed request the last
        ``len(params.prefix)`` of them are the prefix frames' codebook-0 tokens, and the state's
        ``prompt_len`` is the text prompt's length before them."""
        gen = None
        if params.seed is not None and not params.greedy:
            gen = torch.Generator(device=device)
            # Codebooks 1..3 draw from their own stream, distinct from vLLM's codebook-0 one.
            gen.manual_seed((params.seed * 1_000_003 + 0x5EED) % (2**63))
        codes = np.zeros((params.max_new + 1, num_vq), dtype=np.int64)
        k = 0
        if params.prefix:
            pre = np.asarray(params.prefix, dtype=np.int64).reshape(-1, num_vq)
            k = int(pre.shape[0])
            if k > params.max_new or k > prompt_len:
                raise ValueError(f"prefix of {k} frames does not fit (max_new {params.max_new})")
            codes[:k] = pre
        return cls(
            params=params,
            prompt_len=prompt_len - k,
            codes=codes,
            n_frames=k,
            generator=gen,
        )


def attach_state(sampling_params: Any, make: Any) -> RequestState | None:
    """The state attached to ``sampling_params`` (created by ``make()`` on first sight)."""
    st = getattr(sampling_params, _STATE_ATTR, None)
    if st is None:
        st = make()
        if st is not None:
            setattr(sampling_params, _STATE_ATTR, st)
    return st


class BatchRegistry:
    """Batch row -> request state, in vLLM's persistent-batch order (one per worker process)."""

    def __init__(self) -> None:
        self.slots: list[RequestState | None] = []
        self.batch_size = 0
        #: Rows of the current step that really sample (set by the model's forward).
        self.step_rows: list[int] = []
        self.lock = threading.Lock()
        #: Counters for tests and debugging (read through ``worker_stats``).
        self.stats: dict[str, int] = {
            "requests": 0,
            "resumed": 0,
            "recomputed_frames": 0,
            "sampled_frames": 0,
            "steps": 0,
            "embed_ns": 0,
            "decoder_ns": 0,
            "logits_ns": 0,
        }

    def _ensure(self, n: int) -> None:
        if len(self.slots) < n:
            self.slots.extend([None] * (n - len(self.slots)))

    def remove(self, index: int) -> None:
        self._ensure(index + 1)
        self.slots[index] = None

    def add(self, index: int, state: RequestState | None) -> None:
        self._ensure(index + 1)
        self.slots[index] = state

    def move(self, a: int, b: int, swap: bool) -> None:
        self._ensure(max(a, b) + 1)
        if swap:
            self.slots[a], self.slots[b] = self.slots[b], self.slots[a]
        else:
            self.slots[b] = self.slots[a]
            self.slots[a] = None

    def active(self) -> list[RequestState | None]:
        self._ensure(self.batch_size)
        return self.slots[: self.batch_size]


_REGISTRY = BatchRegistry()


def registry() -> BatchRegistry:
    return _REGISTRY


def worker_stats(worker: Any = None) -> dict[str, int]:
    """Counters of this worker process, plus ``batch_size``: requests in the persistent batch
    as of the last step (a finished request leaves it at the next step)."""
    out = dict(_REGISTRY.stats)
    out["batch_size"] = sum(1 for s in _REGISTRY.active() if s is not None)
    return out

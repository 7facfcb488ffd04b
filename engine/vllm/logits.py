"""The v1 logits processor: per-request state in, codebook 0 only out.

* ``update_state(BatchUpdate)`` runs before every forward pass and tells which request sits in
  which batch row: it keeps :mod:`engine.vllm.state`'s registry in step, so the model's
  ``forward``/``compute_logits`` see each row's parameters and code history.
* ``apply(logits)`` masks everything outside codebook 0's id range. The model's
  ``compute_logits`` writes markers for the codes it sampled for codebooks 1..3 into their
  own id ranges; vLLM's returned logprobs are taken from the logits *before* this processor,
  so those markers reach the caller as the top logprobs of each step (the side channel), while
  vLLM itself can only sample codebook 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor.interface import BatchUpdate, LogitsProcessor, MoveDirectionality

from engine.vllm.state import EXTRA_KEY, RequestParams, RequestState, attach_state, registry

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class ChatTTSLogitsProcessor(LogitsProcessor):
    """Registered through the engine argument ``logits_processors``."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        hf = vllm_config.model_config.hf_config
        self.num_text_tokens = int(hf.chattts_num_text_tokens)
        self.num_audio_tokens = int(hf.chattts_num_audio_tokens)
        self.num_vq = int(hf.chattts_num_vq)
        self.device = device
        self.registry = registry()
        self.registry.slots.clear()
        self.registry.batch_size = 0

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        extra = sampling_params.extra_args or {}
        if EXTRA_KEY not in extra:
            raise ValueError(f"ChatTTS requests need extra_args[{EXTRA_KEY!r}]")
        RequestParams.from_extra(extra[EXTRA_KEY])

    def is_argmax_invariant(self) -> bool:
        return False

    def _make_state(self, params: SamplingParams, prompt_ids: list[int] | None) -> RequestState | None:
        extra = (params.extra_args or {}).get(EXTRA_KEY)
        if extra is None or prompt_ids is None:
            return None
        return RequestState.create(RequestParams.from_extra(extra), len(prompt_ids), self.num_vq, self.device)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        reg = self.registry
        if batch_update is None:
            return
        for index in batch_update.removed:
            reg.remove(index)
        for added in batch_update.added:
            index, params, prompt_ids = added[0], added[1], added[2]
            state = None
            if isinstance(params, SamplingParams):
                state = attach_state(params, lambda p=params, ids=prompt_ids: self._make_state(p, ids))
                if state is not None:
                    reg.stats["resumed" if state.n_frames else "requests"] += 1
            reg.add(index, state)
        for a, b, direction in batch_update.moved:
            reg.move(a, b, swap=direction == MoveDirectionality.SWAP)
        reg.batch_size = batch_update.batch_size

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        start = self.num_text_tokens + self.num_audio_tokens
        logits[:, start:] = float("-inf")
        return logits


def logits_processor_fqcn() -> str:
    return f"{__name__}:{ChatTTSLogitsProcessor.__name__}"


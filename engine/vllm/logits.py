"""The v1 logits processor: vLLM's batch bookkeeping in, nothing else.

``update_state(BatchUpdate)`` runs before a forward pass whenever the persistent batch changed
and tells which request sits in which batch row; it hands that to the worker's
:class:`engine.vllm.state.DeviceState`, which keeps the row -> slot map and initialises the
device state of arriving requests. ``apply`` leaves the logits as they are: the model's
``compute_logits`` already samples all four codebooks and hands vLLM a one-hot row (codebook
0's code; vLLM samples greedily), see :mod:`engine.vllm.model`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor.interface import BatchUpdate, LogitsProcessor

from engine.vllm.state import EXTRA_KEY, RequestParams, device_state

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class ChatTTSLogitsProcessor(LogitsProcessor):
    """Registered through the engine argument ``logits_processors``."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self.state = device_state(vllm_config, device)
        # A new input batch (vLLM may rebuild it) starts empty.
        self.state.row_slot_host[:] = self.state.scratch
        self.state.row_slot.fill_(self.state.scratch)
        self.state.rows_on_device = 0
        self.state.batch_size = 0

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        extra = sampling_params.extra_args or {}
        if EXTRA_KEY not in extra:
            raise ValueError(f"ChatTTS requests need extra_args[{EXTRA_KEY!r}]")
        RequestParams.from_extra(extra[EXTRA_KEY])

    def is_argmax_invariant(self) -> bool:
        return True  # apply() changes nothing

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self.state.update(batch_update)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


def logits_processor_fqcn() -> str:
    return f"{__name__}:{ChatTTSLogitsProcessor.__name__}"

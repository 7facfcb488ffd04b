"""Engine-test fixtures: ONE vLLM code engine and one upstream reference engine per session.

Both run the same checkpoint: the session's tiny random checkpoint with its attention
projections scaled by ``ATTENTION_GAIN``. A freshly initialised 2-layer model barely attends
(initializer range 0.02), so its greedy codes would not depend on the speaker or on earlier
tokens and a wrong speaker, a wrong prefix-cache hit or a wrong recompute could not show up in
the codes. With the gain, every prompt token changes the codes (checked by the tests).

The vLLM engine gets a KV cache of ``KV_BLOCKS`` blocks (CPU block = 128 tokens), small enough
that the preemption test forces requests out and back in (recompute).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import engine  # noqa: F401  (torch companion shim)

ATTENTION_GAIN = 3.0
KV_BLOCKS = 6
BLOCK_TOKENS = 128
MAX_MODEL_LEN = 512


def _kv_bytes(model_dir: Path, blocks: int) -> int:
    cfg = json.loads((model_dir / "asset" / "gpt" / "config.json").read_text())
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg["hidden_size"]) // heads
    per_token = 2 * int(cfg["num_hidden_layers"]) * kv_heads * head_dim * 4  # fp32 K and V
    return blocks * BLOCK_TOKENS * per_token + 4096


@pytest.fixture(scope="session")
def parity_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with attention q/k/v/o projections scaled by ``ATTENTION_GAIN``."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("ckpt") / "tiny-attn"
    shutil.copytree(tiny_model_dir, out)
    path = out / "asset" / "gpt" / "model.safetensors"
    state = load_file(str(path))
    for name, tensor in state.items():
        if any(p in name for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            state[name] = (tensor * ATTENTION_GAIN).contiguous()
    save_file(state, str(path))
    return out


@pytest.fixture(scope="session")
async def vllm_engine(parity_model_dir: Path) -> AsyncIterator[object]:
    from engine.vllm.engine import VllmCodeEngine
    from voicegw.config import EngineConfig

    cfg = EngineConfig(
        backend="vllm",
        device="cpu",
        max_num_seqs=16,
        max_num_batched_tokens=256,
        max_model_len=MAX_MODEL_LEN,
        enforce_eager=True,
        enable_prefix_caching=True,
        default_speaker="2222",
    )
    eng = VllmCodeEngine(parity_model_dir, cfg, kv_cache_bytes=_kv_bytes(parity_model_dir, KV_BLOCKS))
    await eng.start()
    yield eng
    await eng.close()


@pytest.fixture(scope="session")
async def reference_engine(parity_model_dir: Path) -> AsyncIterator[object]:
    from engine.reference import ReferenceCodeEngine
    from voicegw.config import EngineConfig

    eng = ReferenceCodeEngine(parity_model_dir, EngineConfig(backend="reference", device="cpu"))
    await eng.start()
    yield eng
    await eng.close()

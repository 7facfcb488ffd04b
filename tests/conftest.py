"""Shared fixtures: ONE tiny random checkpoint, ONE vLLM engine and ONE speech engine per session.

``speech_engine`` is the engine behind every integration test (gateway, dialects, browser,
reliability). ``VOICEGW_TEST_ENGINE`` picks it: ``vllm`` (default: ChatTTS GPT in vLLM on the
tiny checkpoint + the streaming decoder, sharing the session's ``vllm_engine`` with the parity
tests), ``reference`` (upstream chattts in-process + the decoder), ``espeak``, or ``fake`` (the
sine-tone double ``loadtest.fakes.FakeSpeechEngine``, for quick local runs). Tests that need the
double's knobs use ``fake_engine`` instead.

The checkpoint is the tiny random one with its attention projections scaled by
``ATTENTION_GAIN``: a freshly initialised 2-layer model barely attends (initializer range
0.02), so its greedy codes would not depend on the speaker or on earlier tokens, and a wrong
speaker, a wrong prefix-cache hit or a wrong recompute could not show up in the codes. With
the gain every prompt token changes the codes (checked by the parity tests). The vLLM engine
gets a KV cache of ``KV_BLOCKS`` blocks (CPU block = 128 tokens), small enough that the
preemption parity test forces requests out and back in (recompute).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from engine.vllm._env import prepare

# before anything imports transformers, vocos or chattts: torch companions importable, Triton hidden
# beside a CPU-only torch (its nanobind extension prints "leaked" lines at every process exit)
prepare()

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

ENGINE_KIND = os.environ.get("VOICEGW_TEST_ENGINE", "vllm")
ATTENTION_GAIN = 3.0
KV_BLOCKS = 6
BLOCK_TOKENS = 128
MAX_MODEL_LEN = 512


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny ChatTTS-shaped checkpoint with random weights (seed 0), upstream layout."""
    from engine.checkpoint import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=0)


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


def session_engine_config() -> Any:
    """The EngineConfig of the session's engines (tiny checkpoint, CPU, small KV cache)."""
    from engine.config import EngineConfig

    return EngineConfig(
        backend="vllm",
        device="cpu",
        max_num_seqs=16,
        max_num_batched_tokens=256,
        max_model_len=MAX_MODEL_LEN,
        enforce_eager=True,
        enable_prefix_caching=True,
        default_speaker="2222",
    )


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_engine(parity_model_dir: Path) -> AsyncIterator[Any]:
    """THE vLLM code engine of the test session (parity tests and, wrapped, ``speech_engine``)."""
    from engine.build import build_code_engine

    eng = build_code_engine(
        session_engine_config(), parity_model_dir, kv_cache_bytes=_kv_bytes(parity_model_dir, KV_BLOCKS)
    )
    await eng.start()
    yield eng
    await eng.close()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def reference_engine(parity_model_dir: Path) -> AsyncIterator[Any]:
    """Upstream chattts in-process on the same checkpoint (the oracle)."""
    from dataclasses import replace

    from engine.build import build_code_engine

    eng = build_code_engine(replace(session_engine_config(), backend="reference"), parity_model_dir)
    await eng.start()
    yield eng
    await eng.close()


class _Borrowed:
    """A code engine owned by another fixture: start/close are the owner's business."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.name = inner.name
        self.device = getattr(inner, "device", "cpu")

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def __getattr__(self, item: str) -> Any:
        return getattr(self._inner, item)


@pytest.fixture(scope="session")
def _session_code_engine(request: pytest.FixtureRequest) -> Any:
    if ENGINE_KIND == "vllm":
        return request.getfixturevalue("vllm_engine")
    if ENGINE_KIND == "reference":
        return request.getfixturevalue("reference_engine")
    return None


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def speech_engine(_session_code_engine: Any, request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """THE SpeechEngine of the integration tests (see the module docstring)."""
    from dataclasses import replace

    eng: Any
    if _session_code_engine is not None:
        from engine.speech import ChatTTSSpeech, build_decoder

        model_dir = request.getfixturevalue("parity_model_dir")
        ecfg = replace(session_engine_config(), backend=ENGINE_KIND)
        eng = ChatTTSSpeech(_Borrowed(_session_code_engine), build_decoder(ecfg, str(model_dir)), ecfg)
    elif ENGINE_KIND == "fake":
        from loadtest.fakes import FakeSpeechEngine

        eng = FakeSpeechEngine()
    else:
        from engine.build import build_speech_engine
        from engine.config import EngineConfig

        eng = build_speech_engine(EngineConfig(backend=ENGINE_KIND, device="cpu"))
    await eng.start()
    # as `voicegw serve` does once its engine is up: a full GC of the start-up heap (torch, vLLM,
    # Playwright in this process) would stall the in-process gateways' event loop for seconds
    from gateway.app import freeze_startup_heap

    freeze_startup_heap()
    yield eng
    await eng.close()


@pytest.fixture
def fake_engine() -> Any:
    """A fresh sine-tone test double (failure injection, exact lengths)."""
    from loadtest.fakes import FakeSpeechEngine

    return FakeSpeechEngine()


#: Known failures on the real vLLM engine (2-core CPU, tiny checkpoint), open work recorded in the
#: session's closing note: marked xfail (non-strict, reported in every run), never skipped silently.
KNOWN_VLLM_FAILURES: dict[str, str] = {
    # test name -> reason; tests known to fail on the vLLM engine only (none at present).
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if ENGINE_KIND != "vllm":
        return
    for item in items:
        reason = KNOWN_VLLM_FAILURES.get(getattr(item, "originalname", item.name))
        if reason:
            item.add_marker(pytest.mark.xfail(reason=reason, strict=False))


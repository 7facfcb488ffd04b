"""Shared fixtures. The tiny random ChatTTS checkpoint is generated once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import engine  # noqa: F401  (torch companion shim before anything imports transformers)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny ChatTTS-shaped checkpoint with random weights (seed 0), upstream layout."""
    from engine.checkpoint import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=0)

"""The one engine builder (``engine.build``): one list of backend names, no silent fallback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from engine.build import CODE_ENGINES, BackendUnavailable, build_code_engine, build_speech_engine
from engine.config import BACKENDS, EngineConfig


def test_one_list_of_backend_names() -> None:
    from loadtest.serve import ENGINES, TEST_ENGINES

    assert set(CODE_ENGINES) | {"espeak"} == set(BACKENDS)
    assert ENGINES == (*TEST_ENGINES, *BACKENDS)


@pytest.mark.parametrize("backend", ["auto", "vllm"])
def test_vllm_not_importable_is_an_error_not_the_reference_engine(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``auto`` with weights means vLLM: when vLLM cannot be imported the build fails with a
    message naming it (it used to fall back to the in-process reference engine silently)."""
    import engine.vllm._env as env

    monkeypatch.setattr(env, "prepare", lambda: None)
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(BackendUnavailable, match="vLLM is not importable"):
        build_code_engine(EngineConfig(backend=backend), tmp_path)


def test_espeak_has_no_code_engine(tmp_path: Path) -> None:
    with pytest.raises(BackendUnavailable, match="no code engine"):
        build_code_engine(EngineConfig(backend="espeak"), tmp_path)


def test_a_model_asked_for_that_does_not_load_fails(tmp_path: Path) -> None:
    from engine.model_dir import ModelNotFound

    with pytest.raises(ModelNotFound):
        build_speech_engine(EngineConfig(backend="auto", model_dir=str(tmp_path / "missing")))
    with pytest.raises(ModelNotFound):
        build_speech_engine(EngineConfig(backend="reference", model_dir=str(tmp_path / "missing")))

"""Code engine factory: ``EngineConfig.backend`` -> a ``CodeEngine``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.api import CodeEngine
from voicegw.config import EngineConfig


class BackendUnavailable(RuntimeError):
    """The configured code backend cannot run here (message says why)."""


def create_code_engine(cfg: EngineConfig, model_dir: str | Path, *, shared: Any = None) -> CodeEngine:
    """``vllm``, ``reference`` or ``synthetic`` (``auto`` means ``vllm``). The engine is not started.

    ``model_dir`` must hold a complete checkpoint in upstream layout
    (see ``engine.model_dir.resolve_model_dir``). ``shared``: an ``engine.vllm.engine.SharedClient``
    (a client of an engine core another process launched: ``engine.vllm.group``; vLLM only).
    """
    if shared is not None:
        from engine.vllm.engine import VllmCodeEngine

        return VllmCodeEngine(model_dir, cfg, shared=shared)
    backend = cfg.backend
    if backend in ("auto", "vllm"):
        try:
            from engine.vllm._env import prepare

            prepare()
            import vllm  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any import failure: not usable here
            if backend == "vllm":
                raise BackendUnavailable(f"vLLM is not importable: {exc!r}") from exc
            from engine.reference import ReferenceCodeEngine

            return ReferenceCodeEngine(model_dir, cfg)
        from engine.vllm.engine import VllmCodeEngine

        return VllmCodeEngine(model_dir, cfg)
    if backend == "synthetic":
        from engine.synthetic import SyntheticCodeEngine, SyntheticPace

        device = cfg.device
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        return SyntheticCodeEngine(SyntheticPace(
            ttft_ms=cfg.synthetic_ttft_ms,
            steps_per_s=cfg.synthetic_steps_per_s,
            ms_per_char=cfg.synthetic_ms_per_char,
        ), device=device)
    if backend == "reference":
        from engine.reference import ReferenceCodeEngine

        return ReferenceCodeEngine(model_dir, cfg)
    raise BackendUnavailable(f"engine.backend={backend!r} has no code engine (espeak is a SpeechEngine)")

"""Building the speech engine from its settings: the one place (``voicegw serve``, the group's
gateway processes, the load test's server, the benchmarks and the tests all build here).

``engine.backend`` (the names: ``engine.config.BACKENDS``):

- ``vllm``: ChatTTS GPT in vLLM + the streaming decoder. Needs weights and an importable vLLM.
- ``reference``: upstream chattts in-process + the streaming decoder (the native pipeline).
- ``espeak``: eSpeak NG (bundled by the ``espeakng-loader`` wheel), no weights needed.
- ``auto`` (default): ``vllm`` when ChatTTS weights are found (or downloaded with
  ``engine.download``), else ``espeak`` with a WARNING naming what is missing. When a model was
  asked for (``model_dir`` or ``download`` set) and it does not load, that is an error.

A backend that was asked for starts or fails with an error naming why; it is never replaced by
another one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.api import CodeEngine, SpeechEngine
from engine.config import BACKENDS, EngineConfig

log = logging.getLogger("voicegw")


class BackendUnavailable(RuntimeError):
    """The configured backend cannot run here (the message says why)."""


def _vllm(cfg: EngineConfig, model_dir: str | Path, shared: Any, options: dict[str, Any]) -> CodeEngine:
    if shared is None:
        try:
            from engine.vllm._env import prepare

            prepare()
            import vllm  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any import failure: not usable here
            raise BackendUnavailable(
                f"engine.backend vllm: vLLM is not importable ({exc!r}); "
                "engine.backend = \"reference\" runs the GPT in-process instead"
            ) from exc
    from engine.vllm.engine import VllmCodeEngine

    return VllmCodeEngine(model_dir, cfg, shared=shared, **options)


def _reference(cfg: EngineConfig, model_dir: str | Path, shared: Any, options: dict[str, Any]) -> CodeEngine:
    if shared is not None:
        raise BackendUnavailable("engine.backend reference: a shared engine core is vLLM's only")
    from engine.reference import ReferenceCodeEngine

    return ReferenceCodeEngine(model_dir, cfg, **options)


CODE_ENGINES: dict[str, Callable[[EngineConfig, str | Path, Any, dict[str, Any]], CodeEngine]] = {
    "vllm": _vllm,
    "reference": _reference,
}
"""The backends that run ChatTTS's GPT (a ``CodeEngine`` under ``ChatTTSSpeech``); ``espeak`` is a
``SpeechEngine`` of its own."""
assert set(CODE_ENGINES) | {"espeak"} == set(BACKENDS), "engine.config.BACKENDS and the builders differ"


def _code_backend(cfg: EngineConfig) -> str:
    return "vllm" if cfg.backend == "auto" else cfg.backend


def build_code_engine(cfg: EngineConfig, model_dir: str | Path, *, shared: Any = None, **options: Any) -> CodeEngine:
    """An unstarted ``CodeEngine`` of ``cfg.backend`` (``auto``: ``vllm``) on the complete
    checkpoint ``model_dir`` (``engine.model_dir.resolve_model_dir``). ``shared``: an
    ``engine.vllm.engine.SharedClient`` (a client of an engine core another process launched:
    ``voicegw.group``; vLLM only). ``options`` go to the engine's constructor (benchmarks)."""
    backend = _code_backend(cfg)
    make = CODE_ENGINES.get(backend)
    if make is None:
        raise BackendUnavailable(f"engine.backend={cfg.backend!r} has no code engine (espeak is a SpeechEngine)")
    return make(cfg, model_dir, shared, options)


def build_speech_engine(cfg: EngineConfig, *, shared: Any = None) -> SpeechEngine:
    """An unstarted ``SpeechEngine`` for ``cfg`` (see the module docstring). ``shared``: a client
    of the group's engine core (``voicegw.group``)."""
    from engine._compat import ensure_torch_companions

    ensure_torch_companions()  # before anything imports transformers, vocos or chattts
    from engine.model_dir import ModelNotFound, resolve_model_dir

    if cfg.backend != "espeak":
        try:
            model_dir = resolve_model_dir(cfg.model_dir, allow_download=cfg.download)
        except ModelNotFound as exc:
            if cfg.backend != "auto" or cfg.model_dir or cfg.download:
                raise  # a model was asked for: fail, never serve something else in its place
            log.warning("%s Serving with the eSpeak NG engine instead of ChatTTS (engine.backend auto).", exc)
        else:
            return _chattts(cfg, model_dir, shared)
    from engine.espeak import EspeakSpeech

    return EspeakSpeech(default_speaker=cfg.default_speaker)


def _chattts(cfg: EngineConfig, model_dir: Path, shared: Any) -> SpeechEngine:
    from engine.speech import ChatTTSSpeech, build_decoder

    if cfg.decoder_torch_threads > 0:
        import torch

        torch.set_num_threads(cfg.decoder_torch_threads)
    code = build_code_engine(cfg, model_dir, shared=shared)
    device = cfg.decoder_device or getattr(code, "device", "cpu")
    decoder = build_decoder(cfg, str(model_dir), device=str(device), attach=getattr(shared, "decoder", None))
    log.info("engine: ChatTTS (%s) from %s", code.name, model_dir)
    return ChatTTSSpeech(code, decoder, cfg)

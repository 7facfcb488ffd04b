"""vLLM general plugin: registers ChatTTS's GPT (entry point ``vllm.general_plugins``).

vLLM calls :func:`register` in every process it starts (the engine core is spawned, so
registering only in the caller's process would not be seen there).
"""

from __future__ import annotations

ARCHITECTURE = "ChatTTSForVllm"


def register() -> None:
    from engine.vllm._env import prepare

    prepare()
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "engine.vllm.model:ChatTTSForVllm")

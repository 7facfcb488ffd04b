"""Worker extension (engine arg ``worker_extension_cls``): methods callable with
``AsyncLLM.collective_rpc("<name>")`` inside the worker process."""

from __future__ import annotations


class ChatTTSWorkerExtension:
    def voicegw_stats(self) -> dict[str, int]:
        """Counters of the ChatTTS request registry (requests, resumes, recomputed frames)."""
        from engine.vllm.state import worker_stats

        return worker_stats()

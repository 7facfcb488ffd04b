"""Worker extension (engine arg ``worker_extension_cls``): methods callable with
``AsyncLLM.collective_rpc("<name>")`` inside the worker process."""

from __future__ import annotations


class ChatTTSWorkerExtension:
    def voicegw_stats(self) -> dict[str, int]:
        """Counters of the ChatTTS device state (requests, resumes, recomputed frames)."""
        from engine.vllm.state import worker_stats

        return worker_stats()

    def voicegw_slot_frames(self, slot: int, n: int) -> list[list[int]]:
        """The first ``n`` frames of ``slot`` in the worker's device history (tests)."""
        from engine.vllm.state import device_state

        return device_state().codes[slot, :n].tolist()  # type: ignore[no-any-return]

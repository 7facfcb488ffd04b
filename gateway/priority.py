"""Engine priority for a segment: the one place the gateway decides it (swappable).

Lower runs sooner (vLLM ``scheduling_policy="priority"``). ``engine/scheduler.py`` may later
provide a richer policy with the same signature; the session takes the function as a parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

from voicegw.config import SchedulerConfig

#: ``(first_in_utterance, client_buffered_ms) -> priority``; client_buffered_ms is the audio the
#: client still has to play before this segment's audio (sent-not-played plus held in the gateway).
PriorityFn: TypeAlias = Callable[[bool, float], int]


def segment_priority(first_in_utterance: bool, client_buffered_ms: float, cfg: SchedulerConfig) -> int:
    """0 for an utterance's first segment (time to first audio); continuing segments get
    ``1 + bucket`` of the audio the client still has to play before this segment's audio
    (``bucket_ms`` wide, at most ``priority_levels - 1``): less buffered, sooner."""
    if first_in_utterance:
        return 0
    bucket = int(max(0.0, client_buffered_ms) // cfg.bucket_ms)
    return 1 + min(bucket, cfg.priority_levels - 1)


def default_priority_fn(cfg: SchedulerConfig) -> PriorityFn:
    def fn(first_in_utterance: bool, client_buffered_ms: float) -> int:
        return segment_priority(first_in_utterance, client_buffered_ms, cfg)

    return fn

"""Speakers: an int seed (random voice from the checkpoint's speaker statistics), an
upstream-encoded embedding string (``Chat.sample_random_speaker``: fp16, raw LZMA2,
base16384), or "" for none (prompt with ``[empty_spk]``).

A seed ``s`` gives the same voice as upstream's ``torch.manual_seed(s);
chat.sample_random_speaker()``. The vector placed at ``[spk_emb]`` is upstream's
``F.normalize`` of the fp16 embedding (computed in fp16, as ``Speaker.apply`` does).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ResolvedSpeaker:
    raw_f16: np.ndarray
    """The embedding as upstream stores it (float16)."""
    normalized: np.ndarray
    """float32 copy of the fp16 L2-normalised vector (what replaces the [spk_emb] embedding)."""
    salt: str
    """Stable id of the voice: vLLM ``cache_salt`` (prefix caching must not mix voices)."""

    def encoded(self) -> str:
        """Upstream string form (``Chat.sample_random_speaker`` format)."""
        from engine.checkpoint import encode_speaker

        return encode_speaker(self.raw_f16)


class SpeakerError(ValueError):
    """The speaker value cannot be used with this checkpoint."""


def _is_seed(value: str | int) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    s = value.strip()
    return s.isascii() and s.lstrip("-").isdigit()


@functools.lru_cache(maxsize=8)
def _stat(hidden: int) -> np.ndarray:
    """(std, mean) of random voices, decoded once per hidden size."""
    import pybase16384 as b14

    from engine.checkpoint import speaker_stat

    stat = np.frombuffer(b14.decode_from_string(speaker_stat(hidden)), dtype=np.float16).copy()
    stat.setflags(write=False)
    return stat


def sample_from_seed(seed: int, hidden: int) -> np.ndarray:
    """fp16 random voice: ``randn * std + mean`` (fp16 ops, as upstream ``_sample_random``)."""
    import torch

    std, mean = torch.from_numpy(_stat(hidden).copy()).chunk(2)
    gen = torch.Generator().manual_seed(int(seed))
    spk = torch.randn(hidden, generator=gen, dtype=torch.float16).mul_(std).add_(mean)
    return spk.numpy().copy()


BAD_SPEAKER = "not a seed or a speaker embedding of this model"
"""What a client is told about a voice ``resolve_speaker`` refuses (the detail stays in the log)."""


def resolve_speaker(value: str | int | None, hidden: int) -> ResolvedSpeaker | None:
    """Speaker value -> embedding (None or "" -> no speaker). Raises ``SpeakerError``."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if _is_seed(value):
        raw = sample_from_seed(int(value), hidden)
    else:
        from engine.checkpoint import decode_speaker

        try:
            raw = decode_speaker(str(value).strip(), max_values=hidden)  # bounded: no decompression bomb
        except Exception as exc:  # lzma/base16384 errors, too many values
            raise SpeakerError(f"speaker string does not decode: {exc}") from None
    if raw.shape != (hidden,):
        raise SpeakerError(f"speaker embedding has {raw.shape[0]} values, the model needs {hidden}")
    if not np.all(np.isfinite(raw)):
        raise SpeakerError("speaker embedding has non-finite values")
    return ResolvedSpeaker(raw_f16=raw, normalized=normalize_f16(raw), salt=speaker_salt(raw))


def normalize_f16(raw: np.ndarray) -> np.ndarray:
    import torch
    import torch.nn.functional as F

    t = torch.from_numpy(np.asarray(raw, dtype=np.float16).copy())
    return F.normalize(t, p=2.0, dim=0, eps=1e-12).to(torch.float32).numpy()


def speaker_salt(raw: np.ndarray) -> str:
    return "spk-" + hashlib.sha256(np.asarray(raw, dtype=np.float16).tobytes()).hexdigest()[:32]

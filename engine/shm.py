"""Shared-memory files: created by one process, mapped by the ones it starts (numpy only).

Used by the vLLM frame table (``engine.vllm.channel``) and the decoder process's sample slots
(``engine.decoder.client`` / ``engine.decoder.worker``).
"""

from __future__ import annotations

import mmap
import os
import secrets
from pathlib import Path

import numpy as np


def shm_dir() -> Path:
    """``/dev/shm`` where writable, else ``$TMPDIR`` (or /tmp)."""
    d = Path("/dev/shm")
    return d if d.is_dir() and os.access(d, os.W_OK) else Path(os.environ.get("TMPDIR", "/tmp"))


def new_path(kind: str) -> str:
    """A fresh file name under :func:`shm_dir` for this process."""
    return str(shm_dir() / f"voicegw-{kind}-{os.getpid()}-{secrets.token_hex(6)}")


def create_file(path: str, nbytes: int) -> None:
    """A new file of ``nbytes`` at ``path`` (exclusive), for other processes to map."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)


def map_file(path: str, nbytes: int, create: bool, dtype: type = np.int64) -> tuple[mmap.mmap, np.ndarray]:
    """Map ``path`` (``create``: a new file of ``nbytes``, exclusive) read-write; return the
    mapping and a flat ``dtype`` view of it."""
    if create:
        create_file(path, nbytes)
    fd = os.open(path, os.O_RDWR, 0o600)
    try:
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return mm, np.frombuffer(mm, dtype=dtype)

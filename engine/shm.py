"""Shared-memory files: created by one process, mapped by the ones it starts (numpy only).

Used by the vLLM frame table (``engine.vllm.channel``) and the decoder process's sample slots
(``engine.decoder.client`` / ``engine.decoder.worker``).
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
from pathlib import Path

import numpy as np

from engine.lifeline import left_by_dead


def shm_dir() -> Path:
    """``/dev/shm`` where writable, else ``$TMPDIR`` (or /tmp)."""
    d = Path("/dev/shm")
    return d if d.is_dir() and os.access(d, os.W_OK) else Path(os.environ.get("TMPDIR", "/tmp"))


def new_path(kind: str) -> str:
    """A fresh file name under :func:`shm_dir` for this process: ``voicegw-<kind>-<owner pid>-<hex>``
    (:func:`remove_stale` reads the owner back)."""
    return str(shm_dir() / f"voicegw-{kind}-{os.getpid()}-{secrets.token_hex(6)}")


_NAME = re.compile(r"voicegw-([a-z]+)-(?P<pid>\d+)-([0-9a-f]{12})")


def remove_stale(directory: Path | None = None) -> list[str]:
    """Remove the files :func:`new_path` named for owners that are dead (a run killed by SIGKILL
    leaves its frame table and decoder samples file behind); returns the paths removed.

    Only ``voicegw-<kind>-<pid>-<12 hex>`` files of this user whose owner pid does not exist are
    touched: a live run's files (any owner pid that exists, even a reused one), other users' and
    other programs' files stay. Owner pids are this pid namespace's: hosts that share ``/dev/shm``
    between pid namespaces (containers given the host's) must not run two gateways' sweeps."""
    removed: list[str] = []
    uid = os.getuid()
    for entry in left_by_dead(directory or shm_dir(), _NAME):
        try:
            if not entry.is_file(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != uid:
                continue
            os.unlink(entry.path)
        except OSError:
            continue
        removed.append(entry.path)
    return removed


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

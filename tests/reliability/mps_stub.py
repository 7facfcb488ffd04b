"""The stand-in for ``nvidia-cuda-mps-control`` (``fake_mps/``) as tests use it: the environment that
puts it first on PATH, and what it logged (``control <pid> server <pid>`` per daemon start)."""

from __future__ import annotations

import os
from pathlib import Path

FAKE_MPS = Path(__file__).resolve().parent / "fake_mps"


def mps_env(d: Path) -> dict[str, str]:
    """``FAKE_MPS`` first on PATH, the MPS directories (``voicegw-mps-*``) under ``d``."""
    return {"PATH": f"{FAKE_MPS}{os.pathsep}{os.environ['PATH']}", "TMPDIR": str(d)}


def mps_root(d: Path) -> Path:
    """The one MPS directory ``voicegw.mps`` made under ``d``."""
    (root,) = d.glob("voicegw-mps-*")
    return root


def logged_pids(log_dir: Path) -> list[tuple[int, int]]:
    """(daemon, server) of every daemon start the stand-in logged in ``log_dir``, oldest first."""
    path = log_dir / "control.log"
    text = path.read_text() if path.exists() else ""
    return [(int(w[1]), int(w[3])) for w in (ln.split() for ln in text.splitlines()) if w[:1] == ["control"]]

"""Make ``import vllm`` work in this process and in the processes vLLM spawns.

vLLM imports ``transformers`` (which probes torchvision) and ``torchcodec`` at import time.
Beside a CPU-only torch the PyPI builds of torchvision/torchaudio/torchcodec carry native
libraries linked against CUDA and fail to load. ``engine._compat`` handles torchvision and
torchaudio; torchcodec raises ``OSError`` (which vLLM does not catch), so it is hidden here
when it cannot load. The engine-core process is *spawned* (CPU platform forces spawn) and
imports vLLM before any plugin runs, so :func:`child_env` returns environment additions
that make the child run :func:`prepare` first (a ``sitecustomize`` in ``_boot/``).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from pathlib import Path

_log = logging.getLogger(__name__)
_done = False

#: Environment flag read by ``_boot/sitecustomize.py``.
BOOT_FLAG = "VOICEGW_VLLM_BOOT"
BOOT_DIR = Path(__file__).parent / "_boot"


def prepare() -> None:
    """Idempotent: make torch companions importable, hide Triton beside a CPU-only torch, then
    hide a broken torchcodec."""
    global _done
    if _done:
        return
    _done = True
    from engine._compat import ensure_torch_companions

    ensure_torch_companions()
    _hide_triton_without_a_device()
    if "torchcodec" in sys.modules:
        return
    try:
        importlib.import_module("torchcodec")
    except ModuleNotFoundError:
        pass
    except Exception as exc:  # noqa: BLE001 - any load failure means: hide it
        for name in [m for m in sys.modules if m == "torchcodec" or m.startswith("torchcodec.")]:
            del sys.modules[name]
        sys.modules["torchcodec"] = None  # type: ignore[assignment]
        _log.debug("torchcodec unusable beside this torch (%s); hidden", exc)


def _hide_triton_without_a_device() -> None:
    """Beside a CPU-only torch Triton has no backend (vLLM disables it: "doesn't include CPU
    backend"), yet importing it (torch's dynamo probes it) loads its nanobind extension, which
    prints dozens of "nanobind: leaked ..." lines at every process exit (Ctrl-C of
    ``voicegw serve`` included). Hidden there (``sys.modules[...] = None``: an ImportError for
    ``import triton``, absent for ``find_spec``); a CUDA or ROCm torch keeps it."""
    if "triton" in sys.modules:
        return
    import torch

    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        sys.modules["triton"] = None  # type: ignore[assignment]
        _log.debug("triton hidden: torch %s has no GPU backend", torch.__version__)


def child_env() -> dict[str, str]:
    """Environment entries that make spawned Python children call :func:`prepare` first."""
    path = os.environ.get("PYTHONPATH", "")
    parts = [p for p in path.split(os.pathsep) if p]
    if str(BOOT_DIR) not in parts:
        parts.insert(0, str(BOOT_DIR))
    repo_root = str(Path(__file__).resolve().parents[2])
    if repo_root not in parts:
        parts.append(repo_root)
    return {"PYTHONPATH": os.pathsep.join(parts), BOOT_FLAG: "1"}

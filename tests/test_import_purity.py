"""The pure cores stay pure at import: no torch, asyncio, sockets or websockets.

Each module is imported in a fresh interpreter (``-X importtime`` is not needed: the test looks
at ``sys.modules`` afterwards), so one module's imports cannot hide another's. The torch/vLLM
compatibility boot (``engine._compat``) runs only where an engine starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PURE = [
    "gateway.session",
    "gateway.protocol",
    "gateway.segmenter",
    "gateway.flow",
    "gateway.scheduling",
    "engine.api",
    "engine.decoder.window",
]
FORBIDDEN = ["torch", "asyncio", "websockets", "socket", "vllm", "transformers"]
#: A user's interpreter: not the vLLM child boot an engine of this test process may be starting
#: with at this moment (``engine/vllm/_env.py``).
ENV = {k: v for k, v in os.environ.items() if k != "VOICEGW_VLLM_BOOT"}


@pytest.mark.parametrize("module", PURE)
def test_pure_core_imports_nothing_heavy(module: str) -> None:
    code = (
        f"import sys, json; import {module}; "
        f"print(json.dumps([m for m in {FORBIDDEN!r} if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, env=ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == [], f"importing {module} loads {loaded}"


def test_python_client_imports_without_torch() -> None:
    code = "import sys; import clients.python.client, loadtest.client; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, env=ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"

"""The vLLM boot (engine/vllm/_boot/sitecustomize.py) runs in the processes vLLM starts, not in
multiprocessing's resource tracker, which inherits the same environment while vLLM starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from engine.vllm._env import child_env

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> tuple[str, int]:
    env = {**os.environ, **child_env()}
    out = subprocess.run([sys.executable, "-c", code], cwd="/", env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1], 0


def test_resource_tracker_does_not_load_torch_or_vllm() -> None:
    line, _ = _run(
        "from multiprocessing.resource_tracker import main as _tracker_main; import sys; "
        "print('torch' in sys.modules, 'vllm' in sys.modules)"
    )
    assert line == "False False", line


def test_a_vllm_child_still_gets_the_boot() -> None:
    line, _ = _run("import sys; print('engine.vllm.plugin' in sys.modules)")
    assert line == "True", line

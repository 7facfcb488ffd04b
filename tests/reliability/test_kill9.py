"""Issue 33: no process outlives its gateway. ``kill -9`` of a real ``voicegw serve`` (vLLM on CPU,
the tiny checkpoint) once healthy: every process it started (engine core, its worker, the decoder,
multiprocessing's resource tracker; the gateway processes of a group) is gone within 2 s
(``engine.lifeline``), and a new ``voicegw serve`` on the same port comes up healthy and removes
the dead run's shared-memory files (``engine.shm.remove_stale``).

One vLLM engine at a time on the 2-core CI host: ``flock /tmp/voicegw-heavy.lock pytest
tests/reliability/test_kill9.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.reliability.kill9 import cleanup, free_port, kill9_and_check, restart_after_kill9, start_serve

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(os.environ.get("VOICEGW_TEST_ENGINE", "vllm") != "vllm", reason="vLLM engine tests"),
]


def test_kill9_of_serve_leaves_no_process_and_a_restart_on_the_port_is_healthy(tiny_model_dir: Path, tmp_path: Path) -> None:
    """One gateway process: the engine core, its worker, the decoder, the resource tracker.
    (A group's launcher: ``tests/engine/test_group.py``, after its own checks.)"""
    port = free_port()
    proc = start_serve(tiny_model_dir, port, 1, tmp_path / "serve.log")
    second: subprocess.Popen[bytes] | None = None
    try:
        files = kill9_and_check(proc.pid, expect=4)
        proc.wait()
        second = restart_after_kill9(tiny_model_dir, port, 1, tmp_path, proc.pid, files)
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) == 0
    finally:
        cleanup(proc)
        if second is not None:
            cleanup(second)

"""CLI errors a newcomer meets first: one readable line each, no traceback, and fast.

Real subprocesses of the ``voicegw`` command line (``python -m voicegw.cli``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, timeout: float = 120) -> tuple[int, str, float]:
    t0 = time.monotonic()
    # not the environment a vLLM engine core patches in while it starts (another test's engine may be
    # restarting in the background): a user's shell has none of it
    env = {k: v for k, v in os.environ.items() if k != "VOICEGW_VLLM_BOOT"}
    out = subprocess.run([sys.executable, "-m", "voicegw.cli", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout, env=env)
    return out.returncode, out.stdout + out.stderr, time.monotonic() - t0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if "error" in ln.lower() or "cannot" in ln.lower() or "no gateway" in ln]


def test_say_without_a_gateway_says_what_to_run(tmp_path: Path) -> None:
    rc, text, _ = _cli("say", "hello", "-o", str(tmp_path / "x.wav"), "--port", str(_free_port()))
    assert rc == 1
    assert "Traceback" not in text
    assert text.strip().count("\n") == 0, text
    assert "voicegw serve" in text and "--port" in text


def test_chat_without_a_gateway_says_what_to_run_like_say() -> None:
    out = subprocess.run([sys.executable, "-m", "voicegw.cli", "chat", "--port", str(_free_port())], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, input="hi\n")
    text = out.stdout + out.stderr
    assert out.returncode == 1 and "Traceback" not in text and "Errno" not in text
    assert text.strip().count("\n") == 0, text
    assert "voicegw chat: no gateway answers" in text and "voicegw serve" in text


def test_serve_on_a_taken_port_fails_before_the_engine_starts() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        rc, text, took_s = _cli("serve", "--port", str(port), "--backend", "espeak")
    assert rc == 2
    assert "Traceback" not in text
    assert len(_error_lines(text)) == 1 and "already in use" in text, text
    assert took_s < 20, f"{took_s:.1f} s: the engine was loaded first"


def test_serve_with_a_missing_model_dir_fails_instead_of_falling_back(tmp_path: Path) -> None:
    rc, text, _ = _cli("serve", "--port", str(_free_port()), "--model-dir", str(tmp_path / "no-such-model"))
    assert rc == 2
    assert "Traceback" not in text
    assert "eSpeak" not in text, "an explicitly asked-for model must not be replaced by the fallback"
    assert len(_error_lines(text)) == 1, text

"""``run_gateway`` end to end in a subprocess: uvloop, signals, graceful shutdown, JSON logs."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import textwrap
import urllib.request
from pathlib import Path

import orjson

from tests.gateway.wsclient import Client

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import sys
    from gateway.app import run_gateway
    from loadtest.simengine import FakeSpeechEngine
    from voicegw.config import load_config
    config = load_config(env={}, overrides={"gateway.port": int(sys.argv[1]), "gateway.log_json": True,
                                            "gateway.shutdown_grace_s": 5.0})
    sys.exit(run_gateway(config, FakeSpeechEngine()))
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _get(url: str) -> int:
    def get() -> int:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return int(r.status)
        except Exception:
            return 0

    return await asyncio.to_thread(get)


async def test_run_gateway_serves_and_stops_gracefully_on_sigterm():
    port = _free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SCRIPT, str(port), cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        for _ in range(300):
            if await _get(f"http://127.0.0.1:{port}/healthz") == 200:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("gateway did not come up")
        c = await Client.open(f"ws://127.0.0.1:{port}/ws", fast_playback=True)
        await c.start()
        await c.speak("A sentence that is speaking while the server gets SIGTERM.", end=False)
        await c.recv_one()
        proc.send_signal(signal.SIGTERM)
        await c.speak(" And it still finishes.")
        done = await c.wait_for("utterance.done")
        assert done["status"] == "ok"
        spoken = "".join(m["text"] for m in c.messages if m["type"] == "segment.started")
        assert spoken.replace(" ", "").endswith("finishes.")
        await asyncio.wait_for(c.ws.wait_closed(), 5)
        assert c.ws.close_code == 1012
        rc = await asyncio.wait_for(proc.wait(), 10)
        assert rc == 0
        assert proc.stderr is not None
        records = [orjson.loads(line) for line in (await proc.stderr.read()).splitlines() if line.startswith(b"{")]
        msgs = [r["msg"] for r in records]
        assert any("uvloop" in m for m in msgs)
        assert any(m == "gateway stopped" for m in msgs)
        first_audio = [r for r in records if "first audio" in r["msg"]]
        assert first_audio and first_audio[0]["session"] and first_audio[0]["utterance"] == 1
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()

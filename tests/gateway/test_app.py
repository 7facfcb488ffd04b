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

from tests.transcript import Transcript, fast_client

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import sys
    from gateway.app import run_gateway
    from loadtest.fakes import FakeSpeechEngine
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
        t = Transcript()
        c = fast_client(f"ws://127.0.0.1:{port}/ws", t)  # no reconnect after the 1012
        await c.connect()
        await c.send_text("A sentence that is speaking while the server gets SIGTERM.")
        await t.next_arrival()
        proc.send_signal(signal.SIGTERM)
        await c.send_text(" And it still finishes.")
        await c.end()
        done = await t.wait_for("utterance.done")
        assert done["status"] == "ok"
        spoken = "".join(m["text"] for m in t.of_type("segment.started"))
        assert spoken.replace(" ", "").endswith("finishes.")
        assert (await t.wait_closed(5))[0] == 1012
        await c.close()
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

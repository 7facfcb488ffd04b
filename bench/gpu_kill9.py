"""``kill -9`` of ``voicegw serve`` under load on a GPU host, and a restart on the same port (#33).

Starts ``voicegw serve`` with its own defaults (on a CUDA vLLM engine: a group of gateway processes,
one engine core, one decoder process), opens ``--sessions`` sessions that are all receiving audio,
snapshots the process tree, SIGKILLs the launcher alone, then samples the GPU's memory in use
(``nvidia-smi``) and the old processes until the memory is back at its idle level. Then starts a
new ``voicegw serve`` on the same port and speaks one sentence through it. Prints and writes one
JSON object (``--out``).

    python3 -m bench.gpu_kill9 --model-dir /tmp/ckfull --sessions 64 --out /tmp/out/kill9.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
_TEXT = ("This answer goes on for a while, so that every session is still receiving audio when "
         "the gateway is killed. It has several sentences. Here is another one. And one more.")


def _gpu_used_mib() -> float:
    """The GPU's memory in use (0 where there is no ``nvidia-smi``: a smoke run on a CPU host)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True).stdout
    except FileNotFoundError:
        return 0.0
    return float(out.split()[0])


def _tree(pid: int) -> list[int]:
    """``pid``'s descendants (from /proc)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" not in f.read()
    except OSError:
        return False


def _cmd(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:80]
    except OSError:
        return ""


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
            return bool(json.loads(r.read()).get("healthy"))
    except Exception:  # noqa: BLE001
        return False


def _serve(args: argparse.Namespace, port: int, log: Path) -> tuple[subprocess.Popen[bytes], float]:
    cmd = [sys.executable, "-m", "voicegw.cli", "serve", "--engine.model_dir", args.model_dir,
           "--gateway.port", str(port), "--limits.max_sessions", str(max(256, 2 * args.sessions)), *args.serve_arg]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    while time.monotonic() - t0 < args.start_timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited {proc.returncode}: {log.read_text()[-3000:]}")
        if _healthy(port):
            return proc, time.monotonic() - t0
        time.sleep(0.25)
    raise TimeoutError(f"serve not healthy in {args.start_timeout_s} s: {log.read_text()[-3000:]}")


async def _load(port: int, sessions: int) -> list[Any]:
    """``sessions`` clients, each receiving audio of a long answer (returned once all have some)."""
    from clients.python import NO_RETRY, Client

    clients = []
    got = [asyncio.Event() for _ in range(sessions)]
    for i in range(sessions):
        c = Client(f"ws://127.0.0.1:{port}/ws", playback="none", retry=NO_RETRY)
        await c.connect()
        u = await c.send_text(_TEXT + " " + _TEXT)
        await c.end()

        async def first(u: Any = u, ev: asyncio.Event = got[i]) -> None:
            with contextlib.suppress(Exception):  # the kill ends every stream
                async for _ in u:
                    ev.set()

        asyncio.get_running_loop().create_task(first())
        clients.append(c)
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in got)), 120)
    return clients


async def _speak_one(port: int) -> float:
    from clients.python import NO_RETRY, Client

    async with Client(f"ws://127.0.0.1:{port}/ws", playback="instant", retry=NO_RETRY) as c:
        t0 = time.monotonic()
        u = await c.send_text("A new gateway speaks after the kill.")
        await c.end()
        async for _ in u:
            return (time.monotonic() - t0) * 1000
    return float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default="/tmp/ckfull")
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--start-timeout-s", type=float, default=240.0)
    ap.add_argument("--out", default="kill9.json")
    ap.add_argument("--serve-arg", action="append", default=[], help="more `voicegw serve` arguments")
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"sessions": args.sessions}

    def write() -> None:
        out.write_text(json.dumps(res, indent=1))

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    res["idle_gpu_mib"] = idle = _gpu_used_mib()
    proc, res["start_s"] = _serve(args, port, out.parent / "kill9-serve-1.log")
    res["serving_gpu_mib"] = _gpu_used_mib()
    loop = asyncio.new_event_loop()
    clients = loop.run_until_complete(_load(port, args.sessions))
    tree = _tree(proc.pid)
    res["tree_before"] = [f"{p} {_cmd(p)}" for p in tree]
    t_kill = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    samples = []
    alive_at: dict[str, list[str]] = {}
    while time.monotonic() - t_kill < 15:
        dt = time.monotonic() - t_kill
        mib = _gpu_used_mib()
        samples.append((round(dt, 2), mib))
        for mark in (2.0, 5.0):
            if dt >= mark and f"{mark:.0f}s" not in alive_at:
                alive_at[f"{mark:.0f}s"] = [f"{p} {_cmd(p)}" for p in tree if _alive(p)]
        if dt > 5.5 and mib <= idle + 512:
            break
        time.sleep(0.2)
    proc.wait()
    back = next((t for t, m in samples if m <= idle + 512), None)
    res.update(gpu_mib_after_kill=samples, gpu_back_to_idle_s=back, alive_after=alive_at)
    write()
    del clients  # their server is gone (NO_RETRY: they do not reconnect to the next one)
    proc2, res["restart_s"] = _serve(args, port, out.parent / "kill9-serve-2.log")
    res["restart_first_audio_ms"] = round(loop.run_until_complete(_speak_one(port)), 1)
    proc2.send_signal(signal.SIGTERM)
    try:
        proc2.wait(60)
    except subprocess.TimeoutExpired:
        proc2.kill()
    write()
    print(json.dumps({k: v for k, v in res.items() if k != "gpu_mib_after_kill"}, indent=1))
    ok = back is not None and back <= 5.0 and not alive_at.get("2s")
    print("kill9:", "ok" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Shared checks for the reliability tests."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from gateway.server import GatewayServer
from tests.gateway.conftest import wait_until
from tests.transcript import fast_client


async def assert_still_serving(server: GatewayServer, text: str = "Still here, and still speaking.",
                               token: str | None = None) -> None:
    """A fresh, well-behaved client (the product's) gets a session and a complete utterance."""
    async with fast_client(server.ws_url, token=token) as c:
        stats = await asyncio.wait_for(c.speak(text).wait_played(), 30)
        assert stats.status == "ok" and stats.server_samples, stats
        assert not c.errors, c.errors


async def assert_drained(server: GatewayServer, within_s: float = 5.0) -> None:
    """No connection left and no request running in the engine."""
    assert await wait_until(lambda: not server.connections, within_s=within_s), \
        f"{len(server.connections)} connections left"
    assert await wait_until(lambda: server.engine.health().running_requests == 0, within_s=within_s), \
        server.engine.health()


# ---- process resources (Linux /proc) ----------------------------------------------------------


def rss_bytes(pid: int | None = None) -> int:
    """Resident set size of a process (VmRSS)."""
    status = Path(f"/proc/{pid or os.getpid()}/status").read_text()
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def fd_count(pid: int | None = None) -> int:
    """Open file descriptors of a process."""
    return len(os.listdir(f"/proc/{pid or os.getpid()}/fd"))


def children(pid: int) -> list[int]:
    """Direct child processes of ``pid``."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(d))
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""

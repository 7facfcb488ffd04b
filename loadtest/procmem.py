"""Resident memory of a process and its descendants (Linux /proc), sampled in a thread."""

from __future__ import annotations

import threading
from pathlib import Path


def _children(pid: int) -> list[int]:
    out: list[int] = []
    task_dir = Path(f"/proc/{pid}/task")
    try:
        tasks = list(task_dir.iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            out.extend(int(x) for x in (task / "children").read_text().split())
        except OSError:
            continue
    return out


def tree_pids(pid: int, limit: int = 512) -> list[int]:
    """``pid`` and all its descendants (bounded)."""
    seen: list[int] = []
    stack = [pid]
    while stack and len(seen) < limit:
        p = stack.pop()
        if p in seen:
            continue
        seen.append(p)
        stack.extend(_children(p))
    return seen


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def tree_rss_bytes(pid: int) -> int:
    """Sum of RSS over the process tree (shared pages counted once per process: an upper bound)."""
    return sum(rss_bytes(p) for p in tree_pids(pid))


class RssSampler:
    """Samples ``tree_rss_bytes(pid)`` every ``period_s`` until stopped; keeps peak and last."""

    def __init__(self, pid: int, period_s: float = 0.5) -> None:
        self.pid = pid
        self.period_s = period_s
        self.peak_bytes = 0
        self.last_bytes = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def reset_peak(self) -> None:
        self.peak_bytes = self.last_bytes

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.period_s)

    def sample(self) -> int:
        v = tree_rss_bytes(self.pid)
        self.last_bytes = v
        self.peak_bytes = max(self.peak_bytes, v)
        self.samples += 1
        return v

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2)

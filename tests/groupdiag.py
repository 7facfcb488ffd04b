"""Diagnostics for tests that start a ``voicegw serve`` group: the log without interpreter-exit
noise, and py-spy stacks of every process of a group that did not come up in time."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import psutil

_NOISE = ("nanobind:", " - leaked ", "See https://nanobind")


def log_tail(path: Path, lines: int = 60) -> str:
    """The last ``lines`` lines of a serve log, nanobind's exit-time leak report removed."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    kept = [ln for ln in text.splitlines() if not ln.startswith(_NOISE) and "voicegw.load" not in ln]
    return "\n".join(kept[-lines:])


def spy_group(root_pid: int, only: tuple[str, ...] = ()) -> str:
    """py-spy stacks (Python frames, GIL holder marked) of ``root_pid`` and all its descendants
    (those whose command line holds one of ``only``, when given)."""
    beside = Path(sys.executable).with_name("py-spy")  # the test environment's, before PATH's
    spy = str(beside) if beside.exists() else shutil.which("py-spy")
    if spy is None:
        return "(py-spy not installed)"
    try:
        procs = [psutil.Process(root_pid), *psutil.Process(root_pid).children(recursive=True)]
    except psutil.Error:
        return "(group gone)"
    out: list[str] = []
    for p in procs:
        try:
            name = " ".join(p.cmdline())[:90] or p.name()
        except psutil.Error:
            continue
        if only and not any(o in name for o in only):
            continue
        r = subprocess.run([spy, "dump", "--native", "--pid", str(p.pid)], capture_output=True, text=True, timeout=30)
        out.append(f"=== pid {p.pid}: {name}\n{r.stdout}{r.stderr}")
    return "\n".join(out)


def no_end_report(fates: list[tuple[str, int | None]], session_ids: list[str | None], log: Path,
                  root_pid: int) -> str:
    """Why answers had no end, for a failure message that is printed cut in the middle: the fates,
    stacks of the gateway and decoder processes, the log's tail, and last each such session's own
    log lines (by session id)."""
    stacks = spy_group(root_pid, only=("voicegw-gateway-", "engine.decoder.worker"))
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    own = []
    for (fate, _), sid in zip(fates, session_ids, strict=True):
        if fate in ("ok", "engine_unavailable"):
            continue
        own.append(f"--- session {sid}: {fate}")
        own += [ln for ln in lines if sid and sid in ln]
    return "\n".join([str(fates), stacks, log_tail(log, 80), *own])

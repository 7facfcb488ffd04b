"""Run a scenario: sessions split over worker processes, each with its own event loop.

The coordinator builds the plans, spawns the workers, waits until each has imported what it
needs and said so (a spawned interpreter can take seconds to start on a loaded host: a start
time fixed before spawning would make late workers start their sessions late and bunched), then
picks the common start ``t0`` (``time.monotonic()`` is one clock for every process of the
machine), waits for them with a hard deadline, kills stragglers, and merges their records.
Workers write their records to a JSON file (no big pipes to block on).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import queue
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtest.netguard import check_local_url
from loadtest.plan import MAX_DURATION_S, ScenarioParams, SessionPlan, build_plans, split_plans

#: Longest wait for the worker processes to start and report ready.
READY_TIMEOUT_S = 60.0
#: Seconds between the last worker's "ready" and t0.
START_MARGIN_S = 0.5
#: Seconds after the last planned session end before workers are killed.
KILL_GRACE_S = 10.0
#: Sessions per worker process at most (more processes are used beyond it).
MAX_SESSIONS_PER_WORKER = 256


def _worker_main(plans: list[SessionPlan], url: str, span_s: float, out_path: str, index: int,
                 ready: Any, start: Any, t0_value: Any) -> None:
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:  # pragma: no cover - non-Linux
        runner = asyncio.run
    from loadtest.client import run_sessions

    ready.put(index)
    if not start.wait(READY_TIMEOUT_S + 5.0):
        return
    t0 = float(t0_value.value)
    records = runner(run_sessions(plans, url, t0, t0 + span_s))
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(records, f)
    os.replace(tmp, out_path)


def default_workers(n_sessions: int) -> int:
    """One worker per 64 sessions, at least 1, at most the CPU count (and enough to keep each
    worker under ``MAX_SESSIONS_PER_WORKER``)."""
    cpus = os.cpu_count() or 1
    want = max(1, -(-n_sessions // 64))
    need = -(-n_sessions // MAX_SESSIONS_PER_WORKER)
    return max(need, min(want, cpus))


def run_plans(plans: list[SessionPlan], url: str, workers: int | None = None) -> dict[str, Any]:
    """Execute plans against ``url`` (127.0.0.1 only); return raw records and timing."""
    url = check_local_url(url)
    if not plans:
        raise ValueError("no sessions planned")
    n_workers = workers or default_workers(len(plans))
    n_workers = max(n_workers, -(-len(plans) // MAX_SESSIONS_PER_WORKER))
    groups = split_plans(plans, n_workers)
    ctx = mp.get_context("spawn")
    span_s = min(max(p.end_s for p in plans), MAX_DURATION_S)
    ready = ctx.Queue(maxsize=len(groups))
    start = ctx.Event()
    t0_value = ctx.Value("d", 0.0)
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="voicegw-loadtest-") as tmpdir:
        procs = []
        paths = []
        for i, group in enumerate(groups):
            path = str(Path(tmpdir) / f"worker{i}.json")
            proc = ctx.Process(target=_worker_main, args=(group, url, span_s, path, i, ready, start, t0_value),
                               daemon=True, name=f"loadtest-worker-{i}")
            proc.start()
            procs.append(proc)
            paths.append(path)
        ready_by = time.monotonic() + READY_TIMEOUT_S
        n_ready = 0
        while n_ready < len(procs) and time.monotonic() < ready_by:
            try:
                ready.get(timeout=max(0.01, min(1.0, ready_by - time.monotonic())))
                n_ready += 1
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    break
        t0 = time.monotonic() + START_MARGIN_S
        t0_value.value = t0
        start.set()
        deadline = t0 + span_s + KILL_GRACE_S
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        killed = 0
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
                killed += 1
        for path in paths:
            if os.path.exists(path):
                with open(path) as f:
                    records.extend(json.load(f))
    t_end = time.monotonic()
    records.sort(key=lambda r: r["session_id"])
    return {
        "t0": t0,
        "wall_s": round(t_end - t0, 3),
        "workers": len(groups),
        "workers_killed": killed,
        "workers_ready": n_ready,
        "sessions": records,
        "missing_sessions": sorted({p.session_id for p in plans} - {r["session_id"] for r in records}),
    }


def run_scenario(params: ScenarioParams, url: str, workers: int | None = None) -> dict[str, Any]:
    from loadtest import metrics, scrape

    plans = build_plans(params)
    before = scrape.scrape(url)
    raw = run_plans(plans, url, workers)
    after = scrape.scrape(url)
    first_start = min(p.start_s for p in plans)
    active_s = max(0.001, raw["wall_s"] - first_start)
    return {
        "scenario": params.scenario,
        "params": params.__dict__,
        "url": url,
        "workers": raw["workers"],
        "workers_ready": raw["workers_ready"],
        "workers_killed": raw["workers_killed"],
        "missing_sessions": raw["missing_sessions"],
        "wall_s": raw["wall_s"],
        "metrics": metrics.compute(raw["sessions"], active_s, params.sample_rate_hz,
                                   since_s=params.burst_at_s if params.scenario == "burst" else None),
        "server_breakdown": scrape.server_breakdown(before, after),
        "sessions": raw["sessions"],
    }

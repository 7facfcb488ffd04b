"""The sans-I/O client core (clients/python/core.py) against the shared scenario table.

``clients/scenarios.json`` is run here against the Python core and, in chromium, against the
browser client's core (tests/browser/test_client_scenarios.py): both clients make the same
decisions (overload retry, final refusals, reconnect backoff and give-up, resume planning, the
playout rules).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from clients.python import core
from clients.python.playout import Playout

TABLE = json.loads((Path(__file__).resolve().parents[1] / "clients" / "scenarios.json").read_text())
SCENARIOS = TABLE["scenarios"]


def _policy(scn: dict[str, Any]) -> core.RetryPolicy:
    return core.RetryPolicy.from_json({**TABLE["defaults"]["policy"], **scn.get("policy", {})})


def _rand(scn: dict[str, Any]) -> core.Rand:
    it = itertools.cycle(scn.get("random") or [0.5])
    return lambda: float(next(it))


def run_scenario(scn: dict[str, Any]) -> list[dict[str, Any]]:
    """Feed one scenario's events to the core; the actions out, as the table writes them."""
    kind = scn["kind"]
    out: list[dict[str, Any]] = []
    if kind == "overload":
        policy, rnd = _policy(scn), _rand(scn)
        for ev in scn["events"]:
            out.append(core.overload_decision(policy, ev["error"], attempts=ev["attempts"],
                                              received_samples=ev["received_samples"], now_s=ev["t_ms"] / 1000.0,
                                              rnd=rnd, cancelled=ev.get("cancelled", False)).to_json())
    elif kind == "reconnect":
        rec = core.Reconnector(_policy(scn), _rand(scn))
        for ev in scn["events"]:
            now = ev["t_ms"] / 1000.0
            if "lost" in ev:
                out.append(rec.lost(ev["lost"], now).to_json())
            elif "failed" in ev:
                out.append(rec.failed(core.Failure(**ev["failed"]), now).to_json())
            else:
                out.append(rec.connected(now).to_json())
    elif kind == "resume":
        segs = {s["index"]: core.SegmentView(s["start_char"], s["end_char"], s["sample_offset"], s["samples"],
                                             s["done"], s["pos"]) for s in scn["segments"]}
        out.append(core.plan_resume(segs, seg_base=scn["seg_base"], base_char=scn["base_char"],
                                    sample_base=scn["sample_base"]).to_json())
    elif kind == "playout":
        c = scn["playout"]
        p = Playout(c["rate_hz"], prebuffer_ms=c["prebuffer_ms"], step_ms=c["step_ms"], max_target_ms=c["max_target_ms"])
        for op in scn["ops"]:
            got: dict[str, Any] = {}
            if op["op"] == "push":
                p.push(op["n"])
            elif op["op"] == "end":
                p.end()
            elif op["op"] == "pull":
                got["got"], got["drained"] = p.pull(op["n"])
            elif op["op"] == "cancel":
                p.cancel()
            elif op["op"] == "truncate":
                p.truncate(op["keep"])
            got.update(state=p.state, played=p.played, buffered=p.buffered, underruns=p.underruns,
                       target_ms=p.target_ms, drains=p.drains)
            out.append({k: got[k] for k in op.get("expect", {})})
    else:
        raise AssertionError(f"unknown scenario kind {kind}")
    return out


def expected(scn: dict[str, Any]) -> list[dict[str, Any]]:
    if scn["kind"] == "playout":
        return [op.get("expect", {}) for op in scn["ops"]]
    return list(scn["expect"])


def same(got: Any, want: Any) -> bool:
    """Equal, numbers within 1e-6 (float noise of the jitter)."""
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(same(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(same, got, want))
    if isinstance(want, (int, float)) and not isinstance(want, bool) and isinstance(got, (int, float)):
        return abs(got - want) < 1e-6
    return bool(got == want)


def test_table_covers_every_kind() -> None:
    kinds = {s["kind"] for s in SCENARIOS}
    assert kinds == {"overload", "reconnect", "resume", "playout"}
    names = [s["name"] for s in SCENARIOS]
    assert len(names) == len(set(names)), "scenario names must be unique"


@pytest.mark.parametrize("scn", SCENARIOS, ids=[s["name"] for s in SCENARIOS])
def test_scenario(scn: dict[str, Any]) -> None:
    got, want = run_scenario(scn), expected(scn)
    assert same(got, want), f"{scn['name']}:\n got  {got}\n want {want}"

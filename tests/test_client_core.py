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
                                             s["done"], s["pos"], s.get("code_frames", 0)) for s in scn["segments"]}
        out.append(core.plan_resume(segs, seg_base=scn["seg_base"], base_char=scn["base_char"],
                                    sample_base=scn["sample_base"], mode=scn.get("mode", "segment"),
                                    rate_hz=scn.get("rate_hz", 24000)).to_json())
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


# ---- the session core: messages in, actions out (Python; the browser client has no such layer yet)


def _session(text: str = "Hello there. How are you?") -> tuple[core.ClientCore[core.UtteranceState], core.UtteranceState]:
    c: core.ClientCore[core.UtteranceState] = core.ClientCore(core.RetryPolicy(), lambda: 0.5)
    u = c.registry.add(core.UtteranceState("u1"))
    u.text, u.end_requested = text, True
    assert u.next_message() == {"type": "text.delta", "text": text, "id": "u1"}
    assert u.next_message() == {"type": "text.end"}
    assert u.next_message() is None
    return c, u


def test_core_overload_before_audio_parks_and_retries_then_resends_whole_text() -> None:
    c, u = _session()
    acts = c.receive({"type": "error", "code": "engine_overloaded", "utterance_id": 1, "retry_after_ms": 700}, 10.0)
    assert len(acts) == 1 and isinstance(acts[0], core.RetryUtterance) and acts[0].u is u
    assert acts[0].retry == core.Retry(2, 700.0, 10.7) and u.parked and u.retrying
    assert c.receive({"type": "utterance.done", "utterance_id": 1, "status": "error", "error": "engine_overloaded"},
                     10.1) == []  # the refused sending ended: not the utterance's end
    u.restart_for_retry()
    assert u.stats.attempts == 2 and u.take == 1 and u.id is None
    assert u.next_message() == {"type": "text.delta", "text": u.text, "id": "u1"}


def test_core_final_refusal_then_done_finishes_in_error() -> None:
    c, u = _session()
    assert c.receive({"type": "error", "code": "engine_error", "utterance_id": 1}, 0.0) == []
    acts = c.receive({"type": "utterance.done", "utterance_id": 1, "status": "error", "samples": 0}, 0.1)
    assert len(acts) == 1 and isinstance(acts[0], core.Finished) and acts[0].error == "engine_error"


def test_core_resume_from_the_first_segment_not_wholly_received() -> None:
    c, u = _session("One. Two. Three.")
    c.receive({"type": "segment.started", "utterance_id": 1, "segment": 0, "text": "One.", "start_char": 0,
               "end_char": 5, "sample_offset": 0}, 0.0)
    u.on_audio(0, 0, 4800)
    c.receive({"type": "segment.done", "utterance_id": 1, "segment": 0}, 0.1)
    c.receive({"type": "segment.started", "utterance_id": 1, "segment": 1, "text": "Two.", "start_char": 5,
               "end_char": 10, "sample_offset": 4800}, 0.2)
    u.on_audio(1, 4800, 1000)
    plan = u.resume()
    assert (plan.segment, plan.char, plan.sample) == (1, 5, 4800)
    assert u.parked and u.stats.resumes == 1 and u.stats.samples == 4800 and 1 not in u.segs
    u.parked = False
    assert u.next_message() == {"type": "text.delta", "text": "Two. Three.", "id": "u1"}
    # the resumed sending numbers its segments from 0: they land after the heard one
    c.registry.new_session()
    c.receive({"type": "segment.started", "utterance_id": 1, "segment": 0, "text": "Two.", "start_char": 0,
               "end_char": 5, "sample_offset": 0}, 1.0)
    assert u.segs[1].start_char == 5 and u.segs[1].sample_offset == 4800 and u.stats.segments == ["One.", "Two."]


def test_core_refused_opening_delta_and_cancel() -> None:
    c, u = _session()
    acts = c.receive({"type": "error", "code": "queue_full", "id": "u1", "message": "m"}, 0.0)
    assert len(acts) == 1 and isinstance(acts[0], core.Refused) and acts[0].u is u and u not in c.registry.items
    v = c.registry.add(core.UtteranceState("u2"))
    v.text = "x"
    v.next_message()
    c.registry.record(7)
    got = c.receive({"type": "cancelled", "utterance_id": 7, "heard_text": "", "cancelled_utterances": [7]}, 0.0)
    assert isinstance(got[0], core.CancelledUtterances) and got[0].utterances == [v]
    assert v.stats.status == "cancelled" and v.stats.cancelled

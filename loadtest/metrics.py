"""Aggregate session records into the numbers a load test reports. Pure (numpy only).

Definitions (also in docs/loadtest.md):

* ``ttfa_ms``: first audio byte of an utterance received by the client minus the time its
  first ``text.delta`` was sent. What a user of an LLM voice chat waits for: it includes the
  time the LLM takes to produce enough text for a first segment (at ``tokens_per_s``).
* ``ttfa_segment_ms``: first audio byte minus the time the ``text.delta`` that completed the
  first segment's text was sent (needs ``segment.started`` to carry the segment's end offset):
  the server's own share (segmenter wait excluded).
* ``underruns`` / ``underrun_ms``: the simulated jitter buffer ran dry while the utterance was
  still expected to deliver audio (count, total silence heard). ``private_underruns_since``:
  those after ``since_s`` that did NOT hit at least half of the other playing sessions at the
  same moment (``shared_underruns``: whole-server stalls); what a scheduling policy decides.
* ``segment_gap_ms``: silence heard at a segment boundary: when segment i+1's first audio
  arrives during an underrun, the time since that underrun began (else 0).
  ``segment_gaps_heard`` counts boundaries with a gap; ``underruns_text_starved`` those whose
  text was complete less than ``TEXT_STARVED_SLACK_S`` before the buffer ran dry. ``boundary_buffer_ms``: client buffer
  just before segment i+1's first audio (how close the boundary came to a gap).
  ``wire_gap_ms``: arrival of segment i+1's first audio minus segment i's last audio (includes
  flow-control pauses; only informative).
* ``cancel_to_silence_ms``: from ``cancel`` sent to the later of the last audio frame of that
  utterance received and the ``cancelled`` reply. ``cancel_to_ack_ms``: to the reply only.
* engine breakdown: every numeric field of ``utterance.done`` summarised (p50/p95/mean).
* ``client_stalls``: periods when the load generator's own event loop did not run (a worker
  process starved or blocked; ``loadtest.client.watch_stalls``), and the worst worker's probe
  lateness (``client_lag``: p50 / p99 / max). What the client measured then
  is not the server's doing: a TTFA whose wait overlaps one (``client_stalled`` rows) and an
  underrun within ``STALL_MARGIN_S`` of one are reported again without them
  (``ttfa_ms_unstalled``, ``*_unstalled``). Many client stalls mean the run is invalid as a
  measurement of the server.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np


def summarize(values: Iterable[float]) -> dict[str, float | int | None]:
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=float)
    if v.size == 0:
        return {"n": 0, "mean": None, "p5": None, "p50": None, "p95": None, "p99": None, "max": None}
    return {
        "n": int(v.size),
        "p5": round(float(np.percentile(v, 5)), 2),
        "mean": round(float(v.mean()), 2),
        "p50": round(float(np.percentile(v, 50)), 2),
        "p95": round(float(np.percentile(v, 95)), 2),
        "p99": round(float(np.percentile(v, 99)), 2),
        "max": round(float(v.max()), 2),
    }


def _ms(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return (a - b) * 1000.0


#: A segment-boundary gap whose text was complete less than this before the buffer ran dry is
#: text-starved (``text_starved_gap``): the seg-TTFA goal at 64 sessions.
TEXT_STARVED_SLACK_S = 0.1
#: An underrun starting or ending this close to a client stall is counted as caused by it.
STALL_MARGIN_S = 0.3


def _overlaps(a: float, b: float, spans: Iterable[Iterable[float]], margin_s: float = 0.0) -> bool:
    return any(lo - margin_s < b and a < hi + margin_s for lo, hi in spans)


def client_stall_summary(sessions: list[dict[str, Any]]) -> dict[str, Any]:
    """The load generator's own stalls: count, total seconds, longest (ms); and its event loops'
    lateness (``client_lag``): the worst worker's p50 / p99 and the largest. Sessions of one
    worker share one list; each list is counted once."""
    seen: dict[tuple[Any, ...], list[list[float]]] = {}
    lags: dict[Any, dict[str, Any]] = {}
    for s in sessions:
        st = s.get("client_stalls") or []
        seen[(s.get("t0"), tuple(tuple(x) for x in st))] = st
        if s.get("client_lag"):
            lags[s["client_lag"].get("worker")] = s["client_lag"]
    spans = [x for st in seen.values() for x in st]
    lengths = [(b - a) for a, b in spans]
    ls = list(lags.values())
    return {"count": len(spans), "total_s": round(sum(lengths), 2),
            "max_ms": round(max(lengths) * 1000.0, 1) if lengths else 0.0,
            "workers": len(ls),
            "lag_p50_ms_worst": max((x["p50_ms"] for x in ls), default=0.0),
            "lag_p99_ms_worst": max((x["p99_ms"] for x in ls), default=0.0),
            "lag_max_ms": max((x["max_ms"] for x in ls), default=0.0)}


def text_starved_gap(seg: dict[str, Any], slack_s: float = TEXT_STARVED_SLACK_S) -> bool:
    """A gap before a segment whose text the client completed less than ``slack_s`` before the
    listener's buffer ran dry: no server could have filled it (the previous segment's audio was
    shorter than the time the text took to arrive; random-weight checkpoints stop early)."""
    gap, t_audio, t_text = seg.get("gap_ms"), seg.get("t_first_audio"), seg.get("t_text_complete")
    if not gap or t_audio is None or t_text is None:
        return False
    return bool(t_text > t_audio - gap / 1000.0 - slack_s)


def stalled_underruns(sessions: list[dict[str, Any]], margin_s: float = STALL_MARGIN_S) -> set[tuple[int, int]]:
    """(session_id, underrun index) of underruns within ``margin_s`` of a client stall."""
    out: set[tuple[int, int]] = set()
    for s in sessions:
        stalls = s.get("client_stalls") or []
        for i, (a, b) in enumerate(s["underruns"]):
            if stalls and _overlaps(a, b if b is not None else a, stalls, margin_s):
                out.add((s["session_id"], i))
    return out


def utterance_rows(sessions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One flat row per utterance (role, session, derived latencies)."""
    rows = []
    for s in sessions:
        stalls = s.get("client_stalls") or []
        t0 = s.get("t0")
        for u in s["utterances"]:
            stalled = False
            if stalls and t0 is not None and u["t_first_text"] is not None and u["t_first_audio"] is not None:
                stalled = _overlaps(u["t_first_text"] - t0, u["t_first_audio"] - t0, stalls)
            segs = sorted(u["segments"].values(), key=lambda g: g["index"]) if u["segments"] else []
            gaps = [g["gap_ms"] for g in segs[1:] if g.get("gap_ms") is not None]
            wire_gaps = []
            for a, b in zip(segs, segs[1:], strict=False):
                g = _ms(b["t_first_audio"], a["t_last_audio"])
                if g is not None:
                    wire_gaps.append(g)
            text_starved = sum(1 for g in segs[1:] if text_starved_gap(g))
            boundary_buffer = [g["buffered_ms_at_first_audio"] for g in segs[1:]
                               if g.get("buffered_ms_at_first_audio") is not None]
            silence = None
            if u["t_cancel"] is not None:
                ends = [t for t in (u["t_cancelled"], u["t_last_audio_after_cancel"]) if t is not None]
                silence = _ms(max(ends), u["t_cancel"]) if ends else None
            rows.append(
                {
                    "session": s["session_id"],
                    "role": s["role"],
                    "index": u["index"],
                    "chars": u["chars"],
                    "ttfa_ms": _ms(u["t_first_audio"], u["t_first_text"]),
                    "ttfa_segment_ms": _ms(u["t_first_audio"], u["t_first_segment_text"]),
                    "client_stalled": stalled,
                    "t_first_text": u["t_first_text"],
                    "t_first_audio": u["t_first_audio"],
                    "total_ms": _ms(u["t_done"], u["t_first_text"]),
                    "samples": u["samples"],
                    "segment_gaps_ms": gaps,
                    "wire_gaps_ms": wire_gaps,
                    "boundary_buffer_ms": boundary_buffer,
                    "text_starved_gaps": text_starved,
                    "cancelled": u["t_cancel"] is not None,
                    "cancel_to_silence_ms": silence,
                    "cancel_to_ack_ms": _ms(u["t_cancelled"], u["t_cancel"]),
                    "frames_after_cancel": u["frames_after_cancel"],
                    "completed": u["t_done"] is not None,
                    "error": u["error"],
                    "timed_out": u["timed_out"],
                    "cut": u.get("cut", False),
                    "done": u["done"],
                }
            )
    return rows


def _active_spans(sessions: list[dict[str, Any]]) -> dict[int, tuple[float, float]]:
    """Per session: (first audio, last audio) relative to t0 -- when it was playing."""
    spans = {}
    for s in sessions:
        firsts = [u["t_first_audio"] for u in s["utterances"] if u["t_first_audio"] is not None]
        lasts = [u["t_last_audio"] for u in s["utterances"] if u.get("t_last_audio") is not None]
        t0 = s.get("t0")
        if firsts and lasts and t0 is not None:
            spans[s["session_id"]] = (min(firsts) - t0, max(lasts) - t0)
    return spans


def shared_underruns(sessions: list[dict[str, Any]], window_s: float = 0.25) -> set[tuple[int, int]]:
    """Underruns that hit at least half of the other sessions playing at that moment (within
    ``window_s``): whole-server stalls (CPU contention, GC) rather than one stream losing out
    to others. Returns (session_id, underrun index) pairs."""
    spans = _active_spans(sessions)
    out: set[tuple[int, int]] = set()
    for s in sessions:
        for i, (start, _end) in enumerate(s["underruns"]):
            others = [o for o in sessions if o is not s and o["session_id"] in spans
                      and spans[o["session_id"]][0] <= start <= spans[o["session_id"]][1] + 1.0]
            if not others:
                continue
            hit = sum(1 for o in others if any(a - window_s <= start <= (b if b is not None else a) + window_s
                                               for a, b in o["underruns"]))
            if hit >= max(1, len(others) / 2):
                out.add((s["session_id"], i))
    return out


def _underruns_since(sessions: list[dict[str, Any]], since_s: float,
                     skip: set[tuple[int, int]] | None = None) -> tuple[int, float]:
    n, ms = 0, 0.0
    for s in sessions:
        for i, (start, end) in enumerate(s["underruns"]):
            if skip and (s["session_id"], i) in skip:
                continue
            if end is None or end >= since_s:
                n += 1 if start >= since_s else 0
                ms += ((end if end is not None else start) - max(start, since_s)) * 1000.0
    return n, round(ms, 1)


def _group_metrics(sessions: list[dict[str, Any]], rows: list[dict[str, Any]], wall_s: float,
                   sample_rate_hz: int, since_s: float | None = None,
                   shared: set[tuple[int, int]] | None = None) -> dict[str, Any]:
    errors: dict[str, int] = defaultdict(int)
    for r in rows:
        if r["error"]:
            errors[r["error"]] += 1
    for s in sessions:
        if s["connect_error"]:
            errors["connect_error"] += 1
    engine: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        for k, v in (r["done"] or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("utterance_id",):
                engine[k].append(float(v))
            elif isinstance(v, dict):
                for k2, v2 in v.items():
                    if isinstance(v2, (int, float)) and not isinstance(v2, bool):
                        engine[f"{k}.{k2}"].append(float(v2))
    completed = [r for r in rows if r["completed"] and not r["error"]]
    audio_s = sum(r["samples"] for r in rows) / max(1, sample_rate_hz)
    cancelled = [r for r in rows if r["cancelled"]]
    extra: dict[str, Any] = {}
    if since_s is not None:
        n, ms = _underruns_since(sessions, since_s)
        pn, pms = _underruns_since(sessions, since_s, shared or set())
        un, ums = _underruns_since(sessions, since_s, stalled_underruns(sessions))
        extra = {"since_s": since_s, "underruns_since": n, "underrun_ms_since": ms,
                 "private_underruns_since": pn, "private_underrun_ms_since": pms,
                 "underruns_since_unstalled": un, "underrun_ms_since_unstalled": ums}
    return extra | {
        "wall_s": round(wall_s, 3),
        "sessions": len(sessions),
        "utterances": len(rows),
        "completed": len(completed),
        "cancelled": len(cancelled),
        "timed_out": sum(1 for r in rows if r["timed_out"]),
        "cut_at_end": sum(1 for r in rows if r["cut"]),
        "errors": dict(errors),
        "ttfa_ms": summarize(r["ttfa_ms"] for r in rows),
        "ttfa_segment_ms": summarize(r["ttfa_segment_ms"] for r in rows),
        "ttfa_ms_unstalled": summarize(r["ttfa_ms"] for r in rows if not r["client_stalled"]),
        "client_stalled_utterances": sum(1 for r in rows if r["client_stalled"]),
        "total_ms": summarize(r["total_ms"] for r in completed),
        "underruns": sum(len(s["underruns"]) for s in sessions),
        "underrun_ms": round(sum(s["underrun_ms"] for s in sessions), 1),
        "sessions_with_underruns": sum(1 for s in sessions if s["underruns"]),
        "segment_gap_ms": summarize(g for r in rows for g in r["segment_gaps_ms"]),
        "segment_gaps_heard": sum(1 for r in rows for g in r["segment_gaps_ms"] if g > 0),
        "underruns_text_starved": sum(r["text_starved_gaps"] for r in rows),
        "wire_gap_ms": summarize(g for r in rows for g in r["wire_gaps_ms"]),
        "boundary_buffer_ms": summarize(g for r in rows for g in r["boundary_buffer_ms"]),
        "cancel_to_silence_ms": summarize(r["cancel_to_silence_ms"] for r in cancelled),
        "cancel_to_ack_ms": summarize(r["cancel_to_ack_ms"] for r in cancelled),
        "frames_after_cancel": sum(r["frames_after_cancel"] for r in cancelled),
        "qps": round(len(completed) / wall_s, 3) if wall_s > 0 else None,
        "audio_s": round(audio_s, 2),
        "engine": {k: summarize(v) for k, v in sorted(engine.items())},
    }


def compute(sessions: list[dict[str, Any]], wall_s: float, sample_rate_hz: int = 24_000,
            since_s: float | None = None) -> dict[str, Any]:
    """Metrics for all sessions and per role (``background``, ``burst``, ``slow`` ...). ``all``
    leaves out deliberately stalled sessions (role ``slow``).

    ``qps`` is completed utterances per second of the active period (first text sent to last
    ``utterance.done``); ``wall_s`` is used only when the records have no such period.
    ``since_s`` (seconds after t0, e.g. the burst): also count underruns from then on
    (``underruns_since``, ``underrun_ms_since``: silence heard after ``since_s``)."""
    rows = utterance_rows(sessions)
    starts = [r["t_first_text"] for r in rows if r["t_first_text"] is not None]
    dones = [u["t_done"] for s in sessions for u in s["utterances"] if u["t_done"] is not None]
    if starts and dones and max(dones) > min(starts):
        wall_s = max(dones) - min(starts)  # first text sent .. last utterance done
    normal = [s for s in sessions if s["role"] != "slow"]
    normal_rows = [r for r in rows if r["role"] != "slow"]
    shared = shared_underruns(normal)
    out: dict[str, Any] = {"all": _group_metrics(normal, normal_rows, wall_s, sample_rate_hz, since_s, shared),
                           "roles": {}, "shared_underruns": len(shared),
                           "client_stalls": client_stall_summary(sessions)}
    for role in sorted({s["role"] for s in sessions}):
        ss = [s for s in sessions if s["role"] == role]
        rr = [r for r in rows if r["role"] == role]
        out["roles"][role] = _group_metrics(ss, rr, wall_s, sample_rate_hz, since_s, shared)
    slow = [s for s in sessions if s["t_stop_reading"] is not None]
    if slow:
        out["slow_readers"] = [
            {
                "session": s["session_id"],
                "close_code": s["close_code"],
                "close_reason": s["close_reason"],
                "stop_to_close_ms": _ms(s["t_closed"], s["t_stop_reading"]),
            }
            for s in slow
        ]
    return out

"""loadtest: pure parts (the simulated listener's playout, plans, metrics, host guard) and tiny bounded runs
against a gateway subprocess serving the fake engine (each run ~10 s)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.python.playout import ClockedPlayout
from loadtest.metrics import compute, summarize
from loadtest.netguard import NotLocalError, check_local_url
from loadtest.plan import (
    CONVERSATION_ANSWER_CHARS,
    MAX_SESSIONS,
    ScenarioParams,
    build_plans,
    split_deltas,
    split_plans,
    tokenize,
)

RATE = 24_000


# ----------------------------------------------------------------------------- simulated listener


def test_jitter_buffer_prebuffers_then_plays_in_real_time() -> None:
    jb = ClockedPlayout(RATE, prebuffer_ms=80.0)
    jb.begin_utterance(0.0)
    jb.push(0.0, RATE // 20)  # 50 ms < prebuffer: not playing yet
    jb.advance(1.0)
    assert not jb.playing and jb.played_samples == 0 and jb.underrun_count == 0
    jb.push(1.0, RATE // 10)  # 150 ms queued: starts
    jb.advance(1.1)
    assert jb.playing and jb.played_samples == pytest.approx(RATE // 10, abs=1)
    assert jb.buffered_ms == pytest.approx(50.0, abs=0.1)


def test_jitter_buffer_counts_underruns_only_while_audio_is_expected() -> None:
    jb = ClockedPlayout(RATE, prebuffer_ms=80.0, step_ms=20.0)
    jb.begin_utterance(0.0)
    jb.push(0.0, RATE // 10)  # 100 ms
    jb.advance(0.3)  # dry at 0.1 while expecting more: underrun
    assert jb.underrun_count == 1 and jb.open_underrun is not None
    assert jb.target_ms == 100.0  # raised by 20 ms
    jb.push(0.4, RATE // 5)  # 200 ms >= target: resumes, underrun closed
    assert jb.playing and jb.open_underrun is None
    assert jb.underrun_ms() == pytest.approx(300.0, abs=1.0)
    jb.end_of_audio(0.45)
    jb.advance(2.0)  # runs out after the end: not an underrun
    assert jb.underrun_count == 1 and not jb.playing
    assert jb.played_samples == RATE // 10 + RATE // 5


def test_jitter_buffer_short_clip_and_cancel() -> None:
    jb = ClockedPlayout(RATE, prebuffer_ms=80.0)
    jb.begin_utterance(0.0)
    jb.push(0.0, RATE // 50)  # 20 ms clip, below the prebuffer
    jb.end_of_audio(0.1)
    assert jb.playing
    jb.advance(0.2)
    assert jb.played_samples == RATE // 50 and jb.underrun_count == 0
    jb.begin_utterance(1.0)
    jb.push(1.0, RATE)
    jb.advance(1.5)
    dropped = jb.cancel(1.5)
    assert dropped == pytest.approx(RATE // 2 - RATE // 10 * 0 - int(0.08 * RATE) * 0, abs=RATE // 5)
    assert jb.queued_samples == 0 and not jb.playing


# ----------------------------------------------------------------------------- plans


def test_tokenize_keeps_the_text() -> None:
    rng = random.Random(1)
    text = "Sure, here is a quick overview of extraordinarily long words and tiny ones."
    toks = tokenize(text, 4.0, rng)
    assert "".join(toks) == text
    assert 3.0 <= sum(map(len, toks)) / len(toks) <= 6.0


def test_burst_plan_roles_and_determinism() -> None:
    p = ScenarioParams(scenario="burst", sessions=5, background=3, burst_at_s=2.0)
    plans = build_plans(p)
    assert [q.role for q in plans].count("background") == 3
    burst = [q for q in plans if q.role == "burst"]
    assert len(burst) == 5 and all(q.start_s == 2.0 for q in burst)
    assert all(q.start_s < 2.0 for q in plans if q.role == "background")
    assert build_plans(p) == plans
    groups = split_plans(plans, 3)
    assert sorted(q.session_id for g in groups for q in g) == list(range(8))


def test_conversation_workload_shape() -> None:
    """Answers of 120-600 varied characters in several sentences, 0.5-2 s think time (none before
    the first), 2-6-character deltas, 100 ms prebuffer, arrivals spread over the ramp."""
    p = ScenarioParams(scenario="steady", sessions=40, workload="conversation", ramp_s=10.0, duration_s=40.0)
    plans = build_plans(p)
    assert build_plans(p) == plans
    texts = [u.text for q in plans for u in q.utterances]
    lo, hi = CONVERSATION_ANSWER_CHARS
    assert all(lo <= len(t) <= hi + 200 for t in texts)
    assert sum(len(t) for t in texts) / len(texts) > 250
    assert len(set(texts)) == len(texts)  # no two answers alike
    assert all(t.count(". ") + t.count("? ") + t.count("! ") + t.count("; ") >= 1 for t in texts)
    thinks = [u.think_s for q in plans for u in q.utterances[1:]]
    assert all(0.5 <= t <= 2.0 for t in thinks) and all(q.utterances[0].think_s == 0 for q in plans)
    assert all(q.delta_chars == (2, 6) and q.prebuffer_ms == 100.0 for q in plans)
    assert max(q.start_s for q in plans) > 5.0 and all(q.start_s <= 10.0 for q in plans)
    pieces = split_deltas(texts[0], 2, 6, random.Random(1))
    assert "".join(pieces) == texts[0] and all(2 <= len(x) <= 6 for x in pieces[:-1])
    short = build_plans(ScenarioParams(scenario="steady", sessions=2))
    assert all(q.delta_chars is None and q.prebuffer_ms == 80.0 for q in short)
    with pytest.raises(ValueError):
        build_plans(ScenarioParams(scenario="steady", workload="nope"))


def test_plans_are_capped() -> None:
    with pytest.raises(ValueError):
        build_plans(ScenarioParams(scenario="steady", sessions=MAX_SESSIONS + 1))
    with pytest.raises(ValueError):
        build_plans(ScenarioParams(scenario="steady", duration_s=10_000))
    with pytest.raises(ValueError):
        build_plans(ScenarioParams(scenario="nope"))


def test_barge_in_and_slow_reader_plans() -> None:
    plans = build_plans(ScenarioParams(scenario="barge-in", sessions=20, cancel_prob=0.5))
    cancels = [u.cancel_after_audio_s for q in plans for u in q.utterances if u.cancel_after_audio_s is not None]
    assert 10 <= len(cancels) <= 70
    slow = [q for q in build_plans(ScenarioParams(scenario="slow-reader", sessions=3)) if q.role == "slow"]
    assert len(slow) == 1 and slow[0].stop_reading_after_audio_s is not None


# ----------------------------------------------------------------------------- guard, metrics


@pytest.mark.parametrize("url", ["ws://10.0.0.1:8765/ws", "ws://example.com/ws", "wss://127.0.0.1/ws",
                                 "http://127.0.0.1/ws", "ws://0.0.0.0:1/ws"])
def test_refuses_other_hosts(url: str) -> None:
    with pytest.raises(NotLocalError):
        check_local_url(url)


def test_accepts_loopback() -> None:
    assert check_local_url("ws://127.0.0.1:9/ws") == "ws://127.0.0.1:9/ws"
    assert check_local_url("ws://localhost:9/ws") == "ws://127.0.0.1:9/ws"
    assert check_local_url("ws://[::1]:9/ws") == "ws://[::1]:9/ws"


def test_summarize() -> None:
    s = summarize([1.0, 2.0, 3.0, None, float("nan")])  # type: ignore[list-item]
    assert s["n"] == 3 and s["p50"] == 2.0 and s["max"] == 3.0
    assert summarize([])["p99"] is None


def _session(sid: int, role: str, t_text: float, t_audio: float | None, underruns: list) -> dict:
    return {
        "session_id": sid, "role": role, "t0": 0.0, "connect_error": None, "underruns": underruns,
        "underrun_ms": sum((e - s) * 1000 for s, e in underruns), "t_stop_reading": None,
        "utterances": [{
            "index": 0, "chars": 10, "t_first_text": t_text, "t_first_segment_text": t_text + 0.1,
            "t_first_audio": t_audio, "t_last_audio": None if t_audio is None else t_audio + 8.0, "t_done": None if t_audio is None else t_audio + 1.0, "done": {"samples": 100},
            "samples": 100, "segments": {}, "t_cancel": None, "t_cancelled": None,
            "t_last_audio_after_cancel": None, "frames_after_cancel": 0, "error": None, "timed_out": False,
            "cut": False,
        }],
    }


def test_metrics_by_role_and_since() -> None:
    sessions = [
        _session(0, "background", 0.0, 0.2, [(1.0, 1.1), (5.0, 5.5)]),
        _session(1, "burst", 4.0, 4.3, []),
        _session(2, "burst", 4.0, 4.5, []),
    ]
    m = compute(sessions, wall_s=10.0, since_s=4.0)
    assert m["roles"]["burst"]["ttfa_ms"]["p50"] == pytest.approx(400.0)
    assert m["roles"]["burst"]["ttfa_segment_ms"]["p50"] == pytest.approx(300.0)
    bg = m["roles"]["background"]
    assert bg["underruns"] == 2 and bg["underruns_since"] == 1
    assert bg["underrun_ms_since"] == pytest.approx(500.0)
    assert m["all"]["completed"] == 3 and m["all"]["engine"]["samples"]["p50"] == 100.0
    assert bg["private_underruns_since"] == 1  # nobody else stalled at 5.0 s


def test_shared_underruns_are_whole_server_stalls() -> None:
    sessions = [
        _session(0, "background", 0.0, 0.2, [(5.0, 5.5), (6.5, 6.6)]),
        _session(1, "burst", 4.0, 4.3, [(5.1, 5.4)]),
        _session(2, "burst", 4.0, 4.5, [(4.95, 5.3)]),
    ]
    m = compute(sessions, wall_s=10.0, since_s=4.0)
    assert m["shared_underruns"] == 3  # the three at ~5 s, not the lone one at 6.5 s
    assert m["roles"]["background"]["private_underruns_since"] == 1
    assert m["roles"]["burst"]["private_underruns_since"] == 0


def test_client_stalls_are_reported_and_left_out() -> None:
    stalls = [[4.1, 4.9], [7.0, 7.5]]
    sessions = [
        _session(0, "background", 0.0, 0.2, [(4.5, 4.8), (6.0, 6.2)]),
        _session(1, "burst", 4.0, 4.95, []),  # its wait spans the client's own stall
        _session(2, "burst", 5.0, 5.3, []),
    ]
    for i, s in enumerate(sessions):  # two workers: sessions 0 and 1 share one
        s["client_stalls"] = stalls
        s["client_lag"] = ({"worker": 7, "n": 90, "p50_ms": 0.4, "p99_ms": 12.0, "max_ms": 800.0} if i < 2 else
                           {"worker": 8, "n": 90, "p50_ms": 0.9, "p99_ms": 3.0, "max_ms": 500.0})
    m = compute(sessions, wall_s=10.0, since_s=4.0)
    assert m["client_stalls"] == {"count": 2, "total_s": 1.3, "max_ms": 800.0, "workers": 2,
                                  "lag_p50_ms_worst": 0.9, "lag_p99_ms_worst": 12.0, "lag_max_ms": 800.0}
    burst = m["roles"]["burst"]
    assert burst["ttfa_ms"]["n"] == 2 and burst["client_stalled_utterances"] == 1
    assert burst["ttfa_ms_unstalled"]["n"] == 1 and burst["ttfa_ms_unstalled"]["p50"] == pytest.approx(300.0)
    bg = m["roles"]["background"]
    assert bg["underruns_since"] == 2 and bg["underruns_since_unstalled"] == 1
    assert bg["underrun_ms_since_unstalled"] == pytest.approx(200.0)


async def test_watch_stalls_sees_a_blocked_event_loop() -> None:
    import asyncio
    import time as _time

    from loadtest.client import lag_summary, watch_stalls

    out: list[tuple[float, float]] = []
    lags: list[float] = []
    t0 = _time.monotonic()
    task = asyncio.create_task(watch_stalls(t0, out, probe_s=0.01, stall_ms=100.0, lags_ms=lags))
    await asyncio.sleep(0.05)
    _time.sleep(0.3)  # noqa: ASYNC251  (the point: the loop cannot run)
    await asyncio.sleep(0.05)
    task.cancel()
    assert len(out) == 1 and 0.25 < out[0][1] - out[0][0] < 0.6
    summary = lag_summary(lags)  # every probe's lateness, the blocked one included
    assert summary["n"] >= 3 and 250.0 < summary["max_ms"] < 600.0 and summary["p50_ms"] < 100.0
    assert lag_summary([]) == {"n": 0, "p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def fake_gateway_url() -> Iterator[str]:
    from loadtest.serve import ServerProcess

    with ServerProcess("fake") as srv:
        yield srv.url


def _run(tmp_path: Path, url: str, *args: str) -> dict:
    from loadtest.cli import main

    rc = main(["run", "--url", url, "--out", str(tmp_path), *args])
    assert rc == 0
    name = args[args.index("--scenario") + 1]
    return json.loads((tmp_path / f"{name}.json").read_text())


def test_burst_run_against_fake_gateway(tmp_path: Path, fake_gateway_url: str) -> None:
    r = _run(tmp_path, fake_gateway_url, "--scenario", "burst", "--sessions", "3", "--background", "2",
             "--burst-at", "1.5", "--duration", "4", "--background-chars", "300", "--utterance-chars", "60",
             "--workers", "2")
    assert r["missing_sessions"] == [] and r["workers"] == 2
    gen = r["metrics"]["client_stalls"]  # each worker's own event-loop lateness, once per worker
    assert gen["workers"] == 2 and 0.0 <= gen["lag_p50_ms_worst"] <= gen["lag_p99_ms_worst"] <= gen["lag_max_ms"]
    burst = r["metrics"]["roles"]["burst"]
    assert burst["ttfa_ms"]["n"] == 3 and burst["completed"] == 3
    assert 0 < burst["ttfa_ms"]["p50"] < 3_000
    assert r["metrics"]["roles"]["background"]["ttfa_ms"]["n"] == 2
    assert (tmp_path / "burst.png").stat().st_size > 10_000
    levels = [s["levels"] for s in r["sessions"]]
    assert all(len(lv) > 3 for lv in levels)


def test_barge_in_run_measures_cancel_to_silence(tmp_path: Path, fake_gateway_url: str) -> None:
    r = _run(tmp_path, fake_gateway_url, "--scenario", "barge-in", "--sessions", "3", "--duration", "2.5",
             "--settle", "6", "--cancel-prob", "1.0", "--utterance-chars", "400", "--no-plot")
    # 400 characters take ~2.5 s to stream in: every first answer is still running at its cancel
    # point (0.2-1.5 s after its first audio), so each of the 3 sessions cancels at least once
    assert r["workers_ready"] == r["workers"]
    m = r["metrics"]["all"]
    assert m["cancelled"] >= 3, [(u["t_cancel"], u["t_done"]) for s in r["sessions"] for u in s["utterances"]]
    assert m["cancel_to_silence_ms"]["n"] >= 3
    assert m["cancel_to_silence_ms"]["p95"] < 1_000


def test_scrape_histogram_delta() -> None:
    from loadtest.scrape import histogram_delta, metrics_url, parse

    def text(n_fast: int, n_slow: int) -> str:
        lines = []
        for part in ("engine", "queue"):
            lines += [
                f'voicegw_ttfa_part_seconds_bucket{{le="0.1",part="{part}"}} {n_fast}',
                f'voicegw_ttfa_part_seconds_bucket{{le="1.0",part="{part}"}} {n_fast + n_slow}',
                f'voicegw_ttfa_part_seconds_bucket{{le="+Inf",part="{part}"}} {n_fast + n_slow}',
                f'voicegw_ttfa_part_seconds_sum{{part="{part}"}} {0.05 * n_fast + 0.5 * n_slow}',
                f'voicegw_ttfa_part_seconds_count{{part="{part}"}} {n_fast + n_slow}',
            ]
        return "# HELP x\n" + "\n".join(lines)

    before, after = parse(text(10, 0)), parse(text(20, 10))
    d = histogram_delta(before, after, "voicegw_ttfa_part_seconds", "part")
    assert d["engine"]["n"] == 20
    assert d["engine"]["mean_ms"] == pytest.approx((0.05 * 10 + 0.5 * 10) / 20 * 1000)
    assert 0 < d["engine"]["p50_ms"] <= 100.0 < d["engine"]["p95_ms"] <= 1000.0
    assert metrics_url("ws://127.0.0.1:8765/ws") == "http://127.0.0.1:8765/metrics"


def test_scrape_counter_delta_and_breakdown() -> None:
    from loadtest.scrape import counter_delta, parse, server_breakdown

    before = parse("voicegw_admission_refused_total 2.0\n")
    after = parse("voicegw_admission_refused_total 5.0\nvoicegw_segments_total 1.0\n")
    assert counter_delta(before, after, "voicegw_admission_refused_total") == 3.0
    assert counter_delta(None, after, "voicegw_segments_total") == 1.0
    b = server_breakdown(before, after)
    assert b["admission_refused"] == 3.0


def test_a_gap_before_text_that_had_not_arrived_is_text_starved() -> None:
    from loadtest.metrics import TEXT_STARVED_SLACK_S, text_starved_gap

    # the buffer ran dry at 10.0 s (gap 200 ms before the first audio at 10.2 s)
    seg = {"gap_ms": 200.0, "t_first_audio": 10.2, "t_text_complete": 9.95}
    assert text_starved_gap(seg)  # text completed 50 ms before the buffer ran dry: starved
    seg["t_text_complete"] = 10.0 - TEXT_STARVED_SLACK_S - 0.05
    assert not text_starved_gap(seg)  # the server had the text in time
    assert not text_starved_gap({"gap_ms": 0.0, "t_first_audio": 1.0, "t_text_complete": 2.0})
    assert not text_starved_gap({"gap_ms": 50.0, "t_first_audio": 1.0})

"""bench.gpu_e2e: the decoder's share of a level, read from the gateway's load lines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.gpu_e2e.levels import decoder_jobs
from bench.gpu_e2e.report import render_markdown

LINES = [  # two gateway processes, one line a second each (gateway.monitor's format)
    "2026-12-05 18:37:10,100 INFO voicegw.load: load sessions=300 engine_live=600 steps_per_s=12000 "
    "decode_jobs_per_s=800 mono=100.5",
    "2026-12-05 18:37:10,120 INFO voicegw.load: load sessions=300 engine_live=600 steps_per_s=12800 "
    "decode_jobs_per_s=800 mono=100.6",
    "2026-12-05 18:37:11,100 INFO voicegw.load: load sessions=300 engine_live=600 steps_per_s=11200 "
    "decode_jobs_per_s=800 mono=101.5",
    "2026-12-05 18:37:11,120 INFO voicegw.load: load sessions=300 engine_live=600 steps_per_s=12000 "
    "decode_jobs_per_s=800 decoder_busy=0.4 decoder_mean_batch=30.5 decoder_padding=0.2 mono=101.6",
    "2026-12-05 18:37:30,100 INFO voicegw.load: load sessions=0 engine_live=0 steps_per_s=0 mono=120.0",
]


def test_decoder_jobs_sums_the_processes_inside_the_level() -> None:
    got = decoder_jobs(LINES, 100.0, 102.0)
    assert got == {"decoder_jobs_per_s": 1600.0, "steps_per_decoder_job": 15.0,  # summed over processes
                   "decoder_busy": 0.4, "decoder_mean_batch": 30.5, "decoder_padding": 0.2}  # the decoder's own
    assert decoder_jobs(LINES, 110.0, 125.0)["steps_per_decoder_job"] is None
    assert decoder_jobs([], 0.0, 1.0)["steps_per_decoder_job"] is None


def test_the_report_names_each_levels_steps_per_row() -> None:
    row = {"name": "e2e-closed-400", "scenario": "closed-loop", "sessions": 400, "qps": 6.0,
           "ttfa_ms": {}, "total_ms": {}, "n_errors": 0, "aggregate_x_realtime": 428.1,
           "steps_per_decoder_job": 6.5, "decoder_jobs_per_s": 3100.0}
    md = render_markdown({"e2e": {"levels": [row], "data_parallel_size": 1}})
    assert "e2e-closed-400 6.5 (3100 jobs/s)" in md
    row.update(decoder_busy=0.41, decoder_mean_batch=37.5, decoder_padding=0.21)
    md = render_markdown({"e2e": {"levels": [row], "data_parallel_size": 1}})
    assert "e2e-closed-400 6.5 (3100 jobs/s; decoder busy 0.41, 37.5 rows per forward, padding 0.21)" in md


def test_a_gateway_that_cannot_run_a_level_is_not_started(tmp_path: Path) -> None:
    """--start-estimate-s: with less time left than a start and one level, no gateway process is
    started (the device time a doomed start would cost is kept) and the reason is recorded."""
    from bench.gpu_e2e.cli import apply_defaults, build_parser
    from bench.gpu_e2e.host import Budget
    from bench.gpu_e2e.phases import _start_gateway

    args = build_parser().parse_args(["--device", "cpu", "--workload", "conversation", "--out", str(tmp_path),
                                      "--start-estimate-s", "165"])
    apply_defaults(args)
    args.out = tmp_path  # as main() makes it
    info: dict[str, Any] = {}
    gw = _start_gateway(args, Budget(3.0), 1, "e2e", tmp_path / "state", info, None,  # type: ignore[arg-type]
                        0, True, False)
    assert gw is None and info["error"].startswith("not started: a start (~165 s) and one level")
    assert not list(tmp_path.glob("gateway-*.log"))


def test_the_report_shows_the_load_generators_own_lateness() -> None:
    row = {"name": "e2e-closed-400", "scenario": "closed-loop", "sessions": 400, "qps": 6.0, "ttfa_ms": {}, "total_ms": {},
           "n_errors": 0, "client_stalls": {"count": 1, "total_s": 0.3, "max_ms": 310.0, "workers": 7,
                                            "lag_p50_ms_worst": 0.6, "lag_p99_ms_worst": 41.2, "lag_max_ms": 310.0}}
    md = render_markdown({"e2e": {"levels": [row], "data_parallel_size": 1}})
    assert "e2e-closed-400 p50 0.6 / p99 41.2 / max 310 ms, 1 stalls" in md


def test_the_largest_real_time_level_is_one_figure() -> None:
    """The headline and the summary line name the same largest level with no underrun, arrival-ramp
    levels included (a report once said 600 in one and 64 in the other)."""
    from bench.gpu_e2e.report import headline, max_realtime

    def level(n: int, ramp_s: float, ok: bool) -> dict[str, Any]:
        return {"name": f"e2e-{n}", "scenario": "steady", "sessions": n, "ramp_s": ramp_s, "ramp_level": ramp_s > 0,
                "realtime": ok, "underruns": 0 if ok else 337, "ttfa_ms": {}, "ttfa_segment_ms": {},
                "rtf_p50": 1.0, "rtf_p5": 1.0, "sessions_with_underruns": 0 if ok else 153, "underrun_ms": 0,
                "completed": n, "utterances": n, "n_errors": 0, "server_rss_peak_mib": 900}

    rows = [level(1, 0, True), level(64, 0, True), level(400, 10, True), level(600, 16, True), level(800, 16, False)]
    d = {"e2e": {"levels": rows, "data_parallel_size": 1, "summary": max_realtime(rows)}}
    assert d["e2e"]["summary"]["max_realtime_sessions"] == headline(d)["max_realtime_sessions"] == 600
    assert d["e2e"]["summary"]["first_failing_sessions"] == 800
    md = render_markdown(d)
    assert "**Largest session count real time with zero underruns: 600** (tested [1, 64, 400, 600, 800]" in md


def test_the_engine_floor_counts_under_the_engine_names() -> None:
    """The floor phase is bench.engine_bench: its rows give the run file the engine figures
    (``engine_aggregate_c512``...) of the same call, the compiled run's where it has them."""
    from bench.gpu_e2e.report import headline, latest_figures
    from bench.results import LATEST_KEYS

    def row(c: int, agg: float) -> dict[str, Any]:
        return {"backend": "vllm", "concurrency": c, "ttft_p50_ms": 8.0, "steps_per_s_per_stream": agg / c,
                "aggregate_steps_per_s": agg}

    floor = {"runs": [{"compiled": False, "rows": [row(1, 500.0), row(512, 30000.0), row(256, 20000.0)]},
                      {"compiled": True, "rows": [row(1, 800.0), row(512, 44963.0)]}]}
    figs = latest_figures(headline({"floor": floor, "e2e": {"levels": []}}))
    assert figs["engine_aggregate_c512"] == 44963.0 and figs["engine_stream_steps_per_s_c1"] == 800.0
    assert figs["engine_aggregate_c256"] == 20000.0  # only the eager run had it
    assert figs["engine_ttft_p50_ms_c1"] == 8.0
    assert {"engine_aggregate_c512", "engine_ttft_p50_ms_c1"} <= set(LATEST_KEYS)


def test_a_start_that_times_out_is_not_tried_again(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    """A gateway not healthy in time: the reason (not the log's last line) is what is printed and
    recorded first, and no other engine settings are tried (they would not start sooner)."""
    from bench.gpu_e2e import phases
    from bench.gpu_e2e.cli import apply_defaults, build_parser
    from bench.gpu_e2e.host import Budget

    def slow(self: Any, timeout_s: float) -> None:
        raise TimeoutError(f"gateway not healthy after {timeout_s:.0f} s:\n... WARNING tokenizer is not initialized")

    monkeypatch.setattr(phases.Gateway, "start", slow)
    monkeypatch.setattr(phases, "wait_gpu_released", lambda gpu: None)
    args = build_parser().parse_args(["--device", "cpu", "--workload", "conversation", "--out", str(tmp_path)])
    apply_defaults(args)
    args.out = tmp_path
    info: dict[str, Any] = {}
    gw = phases._start_gateway(args, Budget(3.0), 1, "e2e", tmp_path / "state", info, None,  # type: ignore[arg-type]
                               0, True, False)
    assert gw is None and info["error"].startswith("gateway not healthy after")
    assert info["attempt_failures"][0]["error"] == info["error"]
    assert "tokenizer" in info["attempt_failures"][0]["log_tail"]
    assert "failed to start: gateway not healthy after" in capsys.readouterr().out

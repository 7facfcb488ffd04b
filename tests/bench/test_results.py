"""bench.results: every committed run file is valid, gpu-latest.json is what the runs generate,
and write_run / load_run / latest behave (newest wins, missing figures are null, bad files raise)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import results as br

RESULTS = Path(br.__file__).resolve().parent / "results"
FIXED = {"schema", "generated_from", "date", "commit"}


@pytest.mark.parametrize("path", br.run_files(RESULTS), ids=lambda p: p.name)
def test_committed_run_files_follow_the_schema(path: Path) -> None:
    run = br.load_run(path)
    assert path.name.startswith(f"run-{run['date']}-{run['commit'][:7]}-")


def test_there_are_committed_runs() -> None:
    assert br.run_files(RESULTS)


def test_gpu_latest_is_generated_from_the_runs() -> None:
    on_disk = json.loads((RESULTS / br.LATEST_FILE).read_text())
    assert on_disk == br.latest(RESULTS), "python -m bench.results latest --write"
    assert set(on_disk) == FIXED | set(br.LATEST_KEYS)
    assert list(on_disk)[len(FIXED) :] == list(br.LATEST_KEYS)
    assert br.check(RESULTS) == []


def _write(d: Path, date: str, figures: dict[str, float | int | None], slug: str, device: str = "NVIDIA H200") -> Path:
    return br.write_run(
        d,
        command="python -m bench.x",
        device=device,
        figures=figures,
        date=date,
        slug=slug,
        commit="abcdef1234567890",
    )


def test_write_run_names_and_fills(tmp_path: Path) -> None:
    p = br.write_run(
        tmp_path / "runs",
        command="python3 -m bench.engine_bench --x",
        device="cpu",
        figures={"engine_aggregate_c512": 1.5},
        commit="0123456789abcdef",
        detail={"t": [1]},
    )
    run = br.load_run(p)
    assert p.name == f"run-{run['date']}-0123456-engine-bench.json"
    assert run["time"] and run["detail"] == {"t": [1]} and run["figures"] == {"engine_aggregate_c512": 1.5}
    again = br.write_run(
        tmp_path / "runs",
        command="python3 -m bench.engine_bench",
        device="cpu",
        figures={},
        commit="0123456789abcdef",
        date=run["date"],
    )
    assert again != p and again.name.endswith("-2.json")
    head = br.write_run(tmp_path, command="x", device="cpu", figures={}, date="2026-01-01")
    assert len(br.load_run(head)["commit"]) == 40  # git rev-parse HEAD


def test_latest_newest_wins_and_missing_is_null(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    _write(runs, "2026-12-01", {"engine_aggregate_c512": 1.0, "decoder_ms_batch1": 5.0}, "old")
    _write(runs, "2026-12-02", {"engine_aggregate_c512": 2.0, "engine_ttft_p50_ms_c1": None}, "new")
    got = br.latest(tmp_path)
    assert got["engine_aggregate_c512"] == 2.0
    assert got["decoder_ms_batch1"] == 5.0  # only the older run has it
    assert got["engine_ttft_p50_ms_c1"] is None  # null in the newest, absent elsewhere
    assert got["conversation_underruns_400"] is None
    assert got["generated_from"] == ["run-2026-12-02-abcdef1-new.json", "run-2026-12-01-abcdef1-old.json"]
    assert got["date"] == "2026-12-02" and got["commit"] == "abcdef1234567890"
    assert set(got) == FIXED | set(br.LATEST_KEYS)


def test_latest_takes_the_reference_gpu_only(tmp_path: Path) -> None:
    """A newer run on another device (an H100 lent instead, a CPU) stays a run file; gpu-latest.json
    keeps the H200's figures."""
    runs = tmp_path / "runs"
    _write(runs, "2026-12-01", {"engine_aggregate_c512": 42700.0}, "h200", device="1x NVIDIA H200, vLLM 0.26.0")
    _write(runs, "2026-12-05", {"engine_aggregate_c512": 44963.0, "decoder_ms_batch1": 1.0}, "h100",
           device="NVIDIA H100 80GB HBM3")
    got = br.latest(tmp_path)
    assert got["engine_aggregate_c512"] == 42700.0 and got["decoder_ms_batch1"] is None
    assert got["generated_from"] == ["run-2026-12-01-abcdef1-h200.json"]


def test_latest_orders_one_day_by_time(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    a = _write(runs, "2026-12-03", {"decoder_ms_batch1": 1.0}, "a-late")
    b = _write(runs, "2026-12-03", {"decoder_ms_batch1": 2.0}, "b-early")
    for path, t in ((a, "15:30"), (b, "09:00")):
        data = json.loads(path.read_text())
        path.write_text(json.dumps({**data, "time": t}))
    assert br.latest(tmp_path)["decoder_ms_batch1"] == 1.0


def test_latest_of_nothing(tmp_path: Path) -> None:
    got = br.latest(tmp_path)
    assert got["generated_from"] == [] and got["date"] is None
    assert all(got[k] is None for k in br.LATEST_KEYS)


GOOD = {
    "schema": 1,
    "date": "2026-12-03",
    "commit": "abc",
    "device": "d",
    "command": "c",
    "figures": {"a_ms": 1},
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"schema": 2}, "schema 2"),
        ({"date": "3 Dec"}, "YYYY-MM-DD"),
        ({"figures": {"a_ms": "12 ms"}}, "finite number or null"),
        ({"figures": {"a_ms": True}}, "finite number or null"),
        ({"figures": {"A ms": 1}}, "snake_case"),
        ({"extra": 1}, "unknown keys"),
        ({"figures": []}, "'figures' must be dict"),
        ({"time": "3pm"}, "HH:MM"),
    ],
)
def test_load_run_rejects_bad_files(tmp_path: Path, change: dict[str, object], message: str) -> None:
    p = tmp_path / "run-x.json"
    p.write_text(json.dumps({**GOOD, **change}))
    with pytest.raises(ValueError, match=message):
        br.load_run(p)


def test_load_run_rejects_missing_keys_and_non_json(tmp_path: Path) -> None:
    p = tmp_path / "run-x.json"
    p.write_text(json.dumps({k: v for k, v in GOOD.items() if k != "commit"}))
    with pytest.raises(ValueError, match=r"missing keys \['commit'\]"):
        br.load_run(p)
    p.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        br.load_run(p)
    with pytest.raises(ValueError):
        br.write_run(tmp_path, command="c", device="d", figures={"x": float("nan")}, commit="abc")


def test_check_cli_flags_a_stale_latest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path / "runs", "2026-12-01", {"decoder_ms_batch1": 1.0}, "one")
    assert br.main(["latest", "--dir", str(tmp_path), "--write"]) == 0
    assert br.main(["check", "--dir", str(tmp_path)]) == 0
    _write(tmp_path / "runs", "2026-12-02", {"decoder_ms_batch1": 2.0}, "two")
    assert br.main(["check", "--dir", str(tmp_path)]) == 1
    assert "differs" in capsys.readouterr().err


def test_engine_bench_writes_a_run_file(tmp_path: Path) -> None:
    import argparse

    from bench import engine_bench as eb

    r = eb.RunResult(
        "vllm", 64, ttft_s=[0.05, 0.07], stream_steps_per_s=[380.0, 382.0], frames=1000, wall_s=1.0
    )
    args = argparse.Namespace(
        device="cpu",
        argv=["--concurrency", "1,64"],
        steps=500,
        temperature=0.3,
        compile=False,
        async_scheduling=False,
    )
    path = eb.write_engine_run(
        str(tmp_path), [r, eb.RunResult("vllm", 1), eb.RunResult("stock", 64)], {}, args
    )
    run = br.load_run(path)
    assert run["command"] == "python3 -m bench.engine_bench --concurrency 1,64"
    assert run["figures"]["engine_stream_steps_per_s_c64"] == 381.0
    assert run["figures"]["engine_ttft_p50_ms_c1"] is None  # no sample -> null, not NaN
    assert "engine_aggregate_c64" in run["figures"] and not any("stock" in k for k in run["figures"])
    json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in {path.name}"))  # strict JSON

"""Benchmark results as data: one machine-written JSON file per run, and gpu-latest.json built from them.

A run file (``bench/results/runs/run-<date>-<commit7>-<slug>.json``) holds::

    {"schema": 1, "date": "YYYY-MM-DD", "commit": "<sha>", "device": "...", "command": "...",
     "figures": {"<name>": number | null, ...}, "detail": {...}}

``detail`` (free-form tables) and ``time`` (``HH:MM`` UTC, orders runs of one date) are optional.
``bench/results/gpu-latest.json`` is not edited by hand: ``latest`` builds it from the run files
of the reference GPU (``REFERENCE_DEVICE``), taking each key of ``LATEST_KEYS`` from the newest run
that has it (null where none has). Runs on another device stay as run files, figures and all.

    python -m bench.results latest [--dir bench/results] [--write]   # print (or write) gpu-latest.json
    python -m bench.results check [--dir bench/results]              # validate runs, compare gpu-latest.json

Pure: no torch, no engine imports.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SCHEMA = 1
RESULTS_DIR = Path(__file__).resolve().parent / "results"
RUNS_SUBDIR = "runs"
LATEST_FILE = "gpu-latest.json"

#: The keys of gpu-latest.json besides schema/generated_from/date/commit, in this order. Engine: the
#: GPT in vLLM alone (bench.engine_bench), per-stream steps/s and aggregate steps/s at C streams.
#: Decoder: bench.decoder_bench. Gateway: bench.gpu_e2e's short-answer `steady` workload (160-char
#: answers at 40 tok/s; `400_ramp16` = 400 sessions arriving over 16 s) and its closed loop at 512.
#: Conversation: bench.gpu_e2e --workload conversation.
#: gpu-latest.json holds this GPU's figures (the one the capacity targets are set for): a run file
#: counts when its ``device`` names it.
REFERENCE_DEVICE = "H200"

LATEST_KEYS: tuple[str, ...] = (
    "conversation_max_realtime_sessions",
    "conversation_underruns_400",
    "conversation_ttfa_p99_ms_400",
    "delivered_steps_ratio_400",
    "engine_aggregate_c512",
    "engine_aggregate_c256",
    "engine_stream_steps_per_s_c1",
    "engine_stream_steps_per_s_c64",
    "engine_stream_steps_per_s_c256",
    "engine_stream_steps_per_s_c512",
    "engine_ttft_p50_ms_c1",
    "decoder_ms_batch1",
    "decoder_x_realtime_batch256",
    "gateway_underruns_256",
    "gateway_underruns_400_ramp16",
    "gateway_seg_ttfa_p50_ms_1",
    "gateway_seg_ttfa_p99_ms_1",
    "gateway_seg_ttfa_p50_ms_64",
    "gateway_seg_ttfa_p99_ms_64",
    "gateway_closed_loop_x_realtime",
)

_REQUIRED: dict[str, type] = {
    "schema": int,
    "date": str,
    "commit": str,
    "device": str,
    "command": str,
    "figures": dict,
}
_OPTIONAL: dict[str, type] = {"detail": dict, "time": str}
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_TIME = re.compile(r"^\d{2}:\d{2}$")


def _slug(text: str) -> str:
    """A file-name-safe short form of ``text`` (lower case, ``-`` between words, at most 40 chars)."""
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return s[:40].strip("-") or "run"


def _git_head() -> str:
    """The commit checked out in this repository (``git rev-parse HEAD``); ValueError without git."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError) as e:
        raise ValueError(f"no commit given and git rev-parse HEAD failed ({e}): pass commit=") from e
    return out.stdout.strip()


def validate_run(data: Any, where: str = "run") -> dict[str, Any]:
    """Return ``data`` if it is a run of this schema; else raise ValueError saying what is wrong."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a run is a JSON object, got {type(data).__name__}")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ValueError(f"{where}: missing keys {missing}")
    unknown = sorted(set(data) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown} (free-form data goes under 'detail')")
    for key, kind in {**_REQUIRED, **_OPTIONAL}.items():
        if key in data and (not isinstance(data[key], kind) or isinstance(data[key], bool)):
            raise ValueError(f"{where}: {key!r} must be {kind.__name__}, got {type(data[key]).__name__}")
    if data["schema"] != SCHEMA:
        raise ValueError(f"{where}: schema {data['schema']!r}, this code reads schema {SCHEMA}")
    if not _DATE.match(data["date"]):
        raise ValueError(f"{where}: date {data['date']!r} is not YYYY-MM-DD")
    if "time" in data and not _TIME.match(data["time"]):
        raise ValueError(f"{where}: time {data['time']!r} is not HH:MM")
    if not data["commit"]:
        raise ValueError(f"{where}: empty commit")
    for name, value in data["figures"].items():
        if not re.match(r"^[a-z][a-z0-9_]*$", name):
            raise ValueError(f"{where}: figure name {name!r} is not snake_case")
        ok = value is None or (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        )
        if not ok:
            raise ValueError(f"{where}: figure {name!r} must be a finite number or null, got {value!r}")
    return data


def write_run(
    path_dir: str | Path,
    *,
    command: str,
    device: str,
    figures: Mapping[str, float | int | None],
    detail: dict[str, Any] | None = None,
    commit: str | None = None,
    date: str | None = None,
    slug: str | None = None,
) -> Path:
    """Write one run file into ``path_dir`` (created if needed) and return its path.

    ``commit`` defaults to ``git rev-parse HEAD``; ``date`` to today (UTC), and then ``time`` is
    the current UTC time. The name is ``run-<date>-<commit7>-<slug>.json``, the slug made from
    ``slug`` or else the command's module/first words; an existing file is not overwritten (a
    counter is appended). The content is validated before it is written.
    """
    now = dt.datetime.now(dt.UTC)
    data: dict[str, Any] = {
        "schema": SCHEMA,
        "date": date or now.strftime("%Y-%m-%d"),
        "commit": commit or _git_head(),
        "device": device,
        "command": command,
        "figures": dict(figures),
    }
    if date is None:
        data["time"] = now.strftime("%H:%M")
    if detail is not None:
        data["detail"] = _json_safe(detail)
    validate_run(data, "write_run")
    if slug is None:
        module = re.search(r"-m\s+(\S+)", command)
        slug = module.group(1).split(".")[-1] if module else " ".join(command.split()[:2])
    out_dir = Path(path_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"run-{data['date']}-{data['commit'][:7]}-{_slug(slug)}"
    path = out_dir / f"{stem}.json"
    n = 2
    while path.exists():
        path = out_dir / f"{stem}-{n}.json"
        n += 1
    path.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
    return path


def _json_safe(obj: Any) -> Any:
    """``obj`` with NaN and infinities (no sample, a ratio to nothing) as null: strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    return obj


def load_run(path: str | Path) -> dict[str, Any]:
    """Read one run file and validate it (ValueError naming the file and the fault)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p.name}: not JSON ({e})") from e
    return validate_run(data, p.name)


def run_files(results_dir: str | Path) -> list[Path]:
    """The run files under ``<results_dir>/runs``, sorted by name."""
    return sorted((Path(results_dir) / RUNS_SUBDIR).glob("run-*.json"))


def latest(results_dir: str | Path = RESULTS_DIR) -> dict[str, Any]:
    """gpu-latest.json's content: each of LATEST_KEYS from the newest run on ``REFERENCE_DEVICE``
    that has it, else null.

    Newest = latest (date, time); runs without a time count as the start of their day, and equal
    stamps fall back to the file name. ``generated_from`` lists the runs that gave a value, newest
    first; ``date``/``commit`` are those of the newest of them (null when no run gave one).
    """
    runs = [(p.name, run) for p in run_files(results_dir) if REFERENCE_DEVICE in (run := load_run(p))["device"]]
    runs.sort(key=lambda nr: (nr[1]["date"], nr[1].get("time", ""), nr[0]), reverse=True)
    values: dict[str, float | int | None] = {}
    used: list[tuple[str, dict[str, Any]]] = []
    for key in LATEST_KEYS:
        values[key] = None
        for name, run in runs:
            if run["figures"].get(key) is not None:
                values[key] = run["figures"][key]
                if all(name != u for u, _ in used):
                    used.append((name, run))
                break
    used.sort(key=lambda nr: (nr[1]["date"], nr[1].get("time", ""), nr[0]), reverse=True)
    newest = used[0][1] if used else None
    return {
        "schema": SCHEMA,
        "generated_from": [name for name, _ in used],
        "date": newest["date"] if newest else None,
        "commit": newest["commit"] if newest else None,
        **values,
    }


def _dump(data: dict[str, Any]) -> str:
    """The JSON text gpu-latest.json is written with."""
    return json.dumps(data, indent=1) + "\n"


def check(results_dir: str | Path = RESULTS_DIR) -> list[str]:
    """Problems with the results directory: invalid run files, gpu-latest.json out of date. Empty = fine."""
    problems = []
    for p in run_files(results_dir):
        try:
            load_run(p)
        except ValueError as e:
            problems.append(str(e))
    if problems:
        return problems
    latest_path = Path(results_dir) / LATEST_FILE
    if not latest_path.exists():
        return [f"{latest_path} is missing: python -m bench.results latest --write"]
    if json.loads(latest_path.read_text()) != latest(results_dir):
        problems.append(f"{latest_path} differs from the run files: python -m bench.results latest --write")
    return problems


def main(argv: list[str] | None = None) -> int:
    """The CLI: ``latest`` prints (``--write``: writes) gpu-latest.json; ``check`` validates."""
    ap = argparse.ArgumentParser(prog="python -m bench.results", description=__doc__.split("\n")[0])
    ap.add_argument("action", choices=["latest", "check"])
    ap.add_argument("--dir", default=str(RESULTS_DIR), help="results directory (run files in its runs/)")
    ap.add_argument("--write", action="store_true", help="latest: write <dir>/gpu-latest.json")
    args = ap.parse_args(argv)
    if args.action == "latest":
        text = _dump(latest(args.dir))
        if args.write:
            (Path(args.dir) / LATEST_FILE).write_text(text)
        else:
            sys.stdout.write(text)
        return 0
    problems = check(args.dir)
    for line in problems:
        print(line, file=sys.stderr)
    if not problems:
        print(f"ok: {len(run_files(args.dir))} run files, {LATEST_FILE} up to date")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

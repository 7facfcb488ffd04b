"""SECURITY.md stays accurate: every limit in the config has a row with its current default,
every close code and error code the gateway uses is named, every known issue names its test."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from gateway import protocol as P
from voicegw.config import EngineConfig, GatewayConfig, LimitsConfig

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "SECURITY.md").read_text()

GATEWAY_FIELDS = ("auth_tokens", "allowed_origins", "write_limit_bytes", "send_timeout_ms", "ping_interval_s",
                  "ping_timeout_s", "open_timeout_s", "shutdown_grace_s")
ENGINE_FIELDS = ("max_num_seqs", "max_model_len")


def _rows() -> dict[str, str]:
    rows = {}
    for line in DOC.splitlines():
        m = re.match(r"\| `([a-z_]+\.[a-z_]+)` \| `([^`]*)`", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def test_every_limit_has_a_row_with_its_default() -> None:
    rows = _rows()
    wanted = [("limits", f.name, f.default) for f in dataclasses.fields(LimitsConfig)]
    wanted += [("gateway", n, getattr(GatewayConfig(), n)) for n in GATEWAY_FIELDS]
    wanted += [("engine", n, getattr(EngineConfig(), n)) for n in ENGINE_FIELDS]
    for section, name, default in wanted:
        key = f"{section}.{name}"
        assert key in rows, f"SECURITY.md has no row for {key}"
        assert rows[key] == repr(default), f"{key}: SECURITY.md says {rows[key]}, config says {default!r}"


def test_close_and_error_codes_are_named() -> None:
    for code in P.CloseCode:
        if code is not P.CloseCode.NORMAL:
            assert str(int(code)) in DOC, code
    for reason in (P.CloseReason.SLOW_READER, P.CloseReason.MESSAGE_FLOOD, P.CloseReason.RATE_LIMIT,
                   P.CloseReason.IDLE, P.CloseReason.OVER_CAPACITY, P.CloseReason.SHUTDOWN):
        assert f"`{reason.value}`" in DOC, reason
    for err in (P.ErrorCode.RATE_LIMITED, P.ErrorCode.TEXT_TOO_LONG, P.ErrorCode.QUEUE_FULL,
                P.ErrorCode.BINARY_NOT_ALLOWED, P.ErrorCode.INVALID_FIELD):
        assert f"`{err.value}`" in DOC, err
    assert str(P.MAX_ID_CHARS) in DOC
    assert ", ".join(str(r) for r in P.SUPPORTED_SAMPLE_RATES_HZ) in DOC


def test_known_issues_name_existing_tests() -> None:
    section = DOC.split("## Known issues", 1)[1].split("\n## ", 1)[0]
    for name in re.findall(r"`(test_[a-z_]+\.py)`", section):
        assert (Path(__file__).parent / name).is_file(), name

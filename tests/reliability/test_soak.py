"""The short soak of CI: ``soak.run_soak`` for ``VOICEGW_SOAK_SECONDS`` (default 45 s) against the
gateway in a child process (fake engine unless ``VOICEGW_SOAK_ENGINE`` says espeak/vllm). The long
runs are ``python -m tests.reliability.soak --minutes 10`` / ``--long`` (see soak.py)."""

from __future__ import annotations

import os
import sys

import pytest

from tests.reliability.soak import run_soak

pytestmark = [pytest.mark.soak, pytest.mark.slow]


async def test_short_soak() -> None:
    seconds = float(os.environ.get("VOICEGW_SOAK_SECONDS", "45"))
    engine = os.environ.get("VOICEGW_SOAK_ENGINE", "fake")
    report = await run_soak(minutes=seconds / 60.0, engine=engine, clients=6, sample_s=2.0,
                            rss_bound_mb=24.0, fd_bound=4)
    print(report.summary(), file=sys.stderr)
    assert report.ok, report.summary()
    s = report.stats
    assert s.utterances_ok >= 20 and s.utterances_cancelled >= 1, report.summary()

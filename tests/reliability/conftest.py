"""Reliability fixtures: the gateway fixtures of tests/gateway (same engine selection through
``VOICEGW_TEST_ENGINE``), plus helpers to prove a server still serves after an attack."""

from __future__ import annotations

import pytest

from tests.gateway.conftest import make_gateway  # noqa: F401  (fixture re-exported for this directory)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "soak: bounded soak through a gateway subprocess (opt-in long run: tests/reliability/soak.py)"
    )

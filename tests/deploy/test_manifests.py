"""The Kubernetes example (``deploy/kubernetes/voicegw.yaml``) against the Kubernetes API schemas
(kubernetes-validate, strict: no unknown fields), and against the gateway: its probes' paths
answer as the manifest expects, its arguments are settings ``voicegw serve`` takes, and the grace
period outlasts preStop plus the gateway's drain."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from voicegw.config import load_config

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "voicegw.yaml"
DOCS = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


@pytest.mark.parametrize("version", ["1.30.0", "1.34.0"])
def test_manifest_is_valid_kubernetes(version: str) -> None:
    for doc in DOCS:
        kubernetes_validate.validate(doc, version, strict=True)


def _container() -> dict[str, Any]:
    dep = next(d for d in DOCS if d["kind"] == "Deployment")
    return dep["spec"]["template"]["spec"]["containers"][0]  # type: ignore[no-any-return]


def test_manifest_matches_the_gateway() -> None:
    dep = next(d for d in DOCS if d["kind"] == "Deployment")
    c = _container()
    assert c["args"][0] == "serve"
    cfg = load_config(None, {}, dict(a[2:].split("=", 1) for a in c["args"][1:]))  # every flag is a setting
    assert c["ports"][0]["containerPort"] == cfg.gateway.port
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/livez"
    grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > c["lifecycle"]["preStop"]["sleep"]["seconds"] + cfg.gateway.shutdown_grace_s + 5

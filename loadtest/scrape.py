"""Server-side breakdown from the gateway's Prometheus ``/metrics`` (same port, 127.0.0.1 only).

Scraped before and after a run; the difference of the histograms is what this run caused:
``voicegw_ttfa_seconds`` (first text -> first audio frame written) and
``voicegw_ttfa_part_seconds{part=text_wait|queue|engine|send}``, plus a few counters.
Percentiles are interpolated inside histogram buckets (approximate).
"""

from __future__ import annotations

import math
import re
import urllib.request
from collections import defaultdict
from typing import Any
from urllib.parse import urlsplit

from loadtest.netguard import check_local_url

_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def metrics_url(ws_url: str) -> str:
    parts = urlsplit(check_local_url(ws_url))
    return f"http://{parts.netloc}/metrics"


def parse(text: str) -> Samples:
    out: Samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        try:
            out[(m.group(1), labels)] = float(m.group(3))
        except ValueError:
            continue
    return out


def scrape(ws_url: str, timeout_s: float = 5.0) -> Samples | None:
    try:
        with urllib.request.urlopen(metrics_url(ws_url), timeout=timeout_s) as resp:  # noqa: S310 - loopback only
            return parse(resp.read().decode("utf-8", "replace"))
    except OSError:
        return None


def _quantile(buckets: list[tuple[float, float]], count: float, q: float) -> float | None:
    """``buckets``: (upper bound, cumulative count) sorted by bound (deltas of one run)."""
    if count <= 0:
        return None
    target = q * count
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= target:
            if math.isinf(le):
                return prev_le
            span = c - prev_c
            frac = 0.0 if span <= 0 else (target - prev_c) / span
            return prev_le + frac * (le - prev_le)
        prev_le, prev_c = le, c
    return prev_le


def histogram_delta(before: Samples | None, after: Samples, name: str,
                    label: str | None = None) -> dict[str, dict[str, Any]]:
    """Per label value (or ``""``): n, mean, p50, p95 in ms of what happened between scrapes."""
    before = before or {}
    groups: dict[str, dict[str, Any]] = defaultdict(lambda: {"buckets": [], "sum": 0.0, "count": 0.0})
    for (metric, labels), v in after.items():
        if not metric.startswith(name):
            continue
        d = dict(labels)
        key = d.get(label, "") if label else ""
        dv = v - before.get((metric, labels), 0.0)
        if metric == name + "_bucket":
            groups[key]["buckets"].append((float(d["le"]), dv))
        elif metric == name + "_sum":
            groups[key]["sum"] = dv
        elif metric == name + "_count":
            groups[key]["count"] = dv
    out = {}
    for key, g in groups.items():
        n = g["count"]
        b = sorted(g["buckets"])
        p50, p95 = _quantile(b, n, 0.5), _quantile(b, n, 0.95)
        out[key] = {
            "n": int(n),
            "mean_ms": round(g["sum"] / n * 1000.0, 1) if n > 0 else None,
            "p50_ms": None if p50 is None else round(p50 * 1000.0, 1),
            "p95_ms": None if p95 is None else round(p95 * 1000.0, 1),
        }
    return out


def counter_delta(before: Samples | None, after: Samples, name: str) -> float:
    """Growth of an unlabelled counter between two scrapes (0 when absent)."""
    key = (name, ())
    return after.get(key, 0.0) - ((before or {}).get(key, 0.0))


def server_breakdown(before: Samples | None, after: Samples | None) -> dict[str, Any]:
    if after is None:
        return {}
    return {
        "ttfa": histogram_delta(before, after, "voicegw_ttfa_seconds").get(""),
        "ttfa_parts": histogram_delta(before, after, "voicegw_ttfa_part_seconds", "part"),
        "admission_refused": counter_delta(before, after, "voicegw_admission_refused_total"),
        "loop_lag": histogram_delta(before, after, "voicegw_event_loop_lag_seconds").get(""),
    }

"""The server's Prometheus text: parse one histogram or counter, and what one run added to a histogram."""

from __future__ import annotations

import re
import urllib.request


def parse_histogram(text: str, name: str) -> dict:
    """Buckets, sum and count of one Prometheus histogram (no labels)."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith(name + "_bucket"):
            m = re.search(r'le="([^"]+)"\}\s+([0-9.eE+-]+)', line)
            if m:
                buckets[float(m.group(1))] = float(m.group(2))
        elif line.startswith(name + "_sum"):
            total = float(line.split()[-1])
        elif line.startswith(name + "_count"):
            count = float(line.split()[-1])
    return {"buckets": buckets, "sum": total, "count": count}


def parse_counter(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    return 0.0


def histogram_delta(before: dict, after: dict) -> dict:
    """What one run added to a server histogram: count, mean and bucket-bound quantiles."""
    count = after["count"] - before["count"]
    if count <= 0:
        return {"count": 0}
    buckets = sorted((le, after["buckets"].get(le, 0.0) - before["buckets"].get(le, 0.0)) for le in after["buckets"])

    def quantile(q: float) -> float | None:
        for le, cum in buckets:
            if cum >= q * count:
                return le * 1000.0
        return None

    return {
        "count": int(count),
        "mean_ms": (after["sum"] - before["sum"]) / count * 1000.0,
        "p50_ms_at_most": quantile(0.5),
        "p95_ms_at_most": quantile(0.95),
    }


def fetch_metrics(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=3) as resp:
            return resp.read().decode("utf-8", "replace")
    except Exception:
        return None

"""A service's Prometheus metrics, read by the benchmarks from its ``/metrics`` endpoint."""

from __future__ import annotations

from urllib.request import urlopen


def scrape(port: int, timeout_s: float = 30.0) -> dict[str, float]:
    """Every sample at ``http://127.0.0.1:{port}/metrics``: its name with its labels, as the
    endpoint writes them (``spin:x_total{role="verifier"}``), -> its value."""
    body = urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s).read().decode()
    out = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out

"""common/metrics.py: a worker's metrics port."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest

from common import metrics
from tests.conftest import free_port

# What Prometheus 2.x asks a target for: OpenMetrics first.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


def test_a_worker_serves_its_names_with_the_colon_whatever_the_scraper_accepts() -> None:
    registry = metrics.new_registry()
    metrics.WorkerMetrics.create(registry)
    metrics.KvPoolMetrics.create(registry).pages_free.set(7)
    port = free_port()
    stop = metrics.serve(registry, port)
    try:
        for accept in (PROMETHEUS_ACCEPT, ""):
            request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": accept})
            with urllib.request.urlopen(request, timeout=5) as resp:
                text = resp.read().decode()
                assert resp.headers["Content-Type"].startswith("text/plain")
            assert "\nspillway:kv_pages_free 7.0\n" in text, text
            assert "spillway_" not in text
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=5)
        assert err.value.code == 404
    finally:
        stop()


def test_a_worker_serves_its_metrics_over_ipv6_too() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    registry = metrics.new_registry()
    metrics.KvPoolMetrics.create(registry).pages_used.set(3)
    port = free_port()
    try:
        stop = metrics.serve(registry, port, "::1")
    except OSError as exc:  # IPv6 compiled in, not configured
        pytest.skip(f"no IPv6 loopback: {exc}")
    try:
        with urllib.request.urlopen(f"http://[::1]:{port}/metrics", timeout=5) as resp:
            assert "\nspillway:kv_pages_used 3.0\n" in resp.read().decode()
    finally:
        stop()

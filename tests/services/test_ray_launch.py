"""`spillway serve --ray local --pairs 2`: the pairs under Ray actors on a local Ray cluster, the router here,
all over tcp:// on the node's address; a killed worker is restarted by its pair's host; SIGTERM stops every
process; a lost pair host is replaced alone, the router and the other pair serving on."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.conftest import Server, free_port, free_ports, health, wait_status
from tests.deploy.prometheus import deployed_config, prometheus_binary, running_prometheus, targets
from tests.services.test_serve_pairs import MODEL

pytest.importorskip("ray")
pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def discovery(port: int) -> list[dict]:
    """The router's Prometheus service discovery answer."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics/targets", timeout=5) as answer:
        return json.loads(answer.read())


def _scraped(prometheus: str, service: str) -> tuple[str, str] | None:
    """The URL Prometheus scrapes `service` at and that target's health (None: not a target)."""
    found = [t for t in targets(prometheus) if t["labels"].get("service") == service]
    return (found[0]["scrapeUrl"], found[0]["health"]) if found else None


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def test_pairs_on_ray_serve_restart_and_stop(tmp_path) -> None:
    port, metrics = free_port(), free_ports(1)
    argv = [sys.executable, "-m", "services.cli", "serve", "--ray", "local", "--pairs", "2"]
    argv += ["--port", str(port), "--metrics-port", str(metrics), "--threads", "1", "--max-running", "2"]
    first = free_ports(200)  # every port the launcher and the pair hosts pick: in --port-range
    argv += ["--max-context", "1024", "--expert-cache", "0.5", "--port-range", f"{first}-{first + 199}"]
    env = {**os.environ, "SPILLWAY_CACHE": str(tmp_path), "RAY_USAGE_STATS_ENABLED": "0"}
    server = Server(subprocess.Popen(argv, env=env), port)
    stack = contextlib.ExitStack()
    try:
        body = wait_status(server, "ok", timeout_s=300)
        config = deployed_config(f"127.0.0.1:{port}")  # Prometheus as deploy/ finds the workers
        prom = stack.enter_context(
            running_prometheus(prometheus_binary(), config, tmp_path / "p", free_port())
        )
        workers = {name: body["services"][name] for name in ("prefill", "decode", "prefill-1", "decode-1")}
        for svc in workers.values():  # served over the node's address, not loopback
            assert svc["metrics_url"].startswith("http://") and "127.0.0.1" not in svc["metrics_url"]
            assert first <= int(svc["metrics_url"].rsplit(":", 1)[1].split("/")[0]) < first + 200
        client = server.client()
        replies = {
            client.completions.create(model=MODEL, prompt="On Ray.", max_tokens=8, temperature=0)
            .choices[0]
            .text
            for _ in range(4)
        }
        assert len(replies) == 1 and [p["capacity"] for p in health(port)[1]["pairs"]] == [2, 2]
        victim = workers["decode-1"]["pid"]
        os.kill(victim, signal.SIGKILL)
        body = wait_status(server, "degraded", timeout_s=15)
        body = wait_status(server, "ok", timeout_s=120)
        assert body["services"]["decode-1"]["pid"] != victim, "restarted by its pair's host"
        again = client.completions.create(model=MODEL, prompt="On Ray.", max_tokens=8, temperature=0)
        assert again.choices[0].text in replies
        # The pair's host (the Ray actor, the workers' parent) lost: its workers stop with it, a new host
        # starts them elsewhere (new addresses), told to the router, which stays up and serves the other pair.
        lost = {name: body["services"][name]["pid"] for name in ("prefill-1", "decode-1")}
        kept = body["services"]["decode"]["pid"]
        host = _parent(lost["decode-1"])
        os.kill(host, signal.SIGKILL)
        killed = time.monotonic()
        deadline = killed + 20
        while any(_alive(p) for p in lost.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in lost.values()), "the workers stop with their host"
        meanwhile = client.completions.create(model=MODEL, prompt="On Ray.", max_tokens=8, temperature=0)
        assert meanwhile.choices[0].text in replies, "the other pair answers while one is replaced"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the same router, over the new host's workers
            body = health(port)[1]
            pids = {name: body.get("services", {}).get(name, {}).get("pid") for name in lost}
            if body.get("status") == "ok" and not set(pids.values()) & set(lost.values()):
                break
            time.sleep(0.1)
        replaced_s = time.monotonic() - killed
        assert body.get("status") == "ok" and not set(pids.values()) & set(lost.values()), body
        assert body["router_restarts"] == 0 and body["services"]["decode"]["pid"] == kept, (
            "nothing else restarts"
        )
        assert replaced_s < 15, f"{replaced_s:.1f} s from a killed pair host to serving on all pairs again"
        found = {t["labels"]["service"]: t["targets"][0] for t in discovery(port)}
        assert found["decode-1"] in body["services"]["decode-1"]["metrics_url"], "discovery follows the move"
        moved = body["services"]["decode-1"]["metrics_url"]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and _scraped(prom, "decode-1") != (moved, "up"):
            time.sleep(0.5)
        assert _scraped(prom, "decode-1") == (moved, "up"), "Prometheus scrapes the new port"
        for _ in range(4):  # both pairs (the router sends in turns)
            again = client.completions.create(model=MODEL, prompt="On Ray.", max_tokens=8, temperature=0)
            assert again.choices[0].text in replies
        pids = [svc["pid"] for svc in body["services"].values()]
    finally:
        stack.close()
        code = server.stop()
    assert code == 0
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if _alive(p)], "every worker stopped"

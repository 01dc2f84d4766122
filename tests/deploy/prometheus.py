"""A real Prometheus for the deploy tests: the `prometheus` on PATH, else Debian's package unpacked into the
cache (`apt-get download`: no root, no install), started on a config of the tests' making."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

DEPLOYED = Path(__file__).resolve().parents[2] / "deploy" / "prometheus.yml"


def deployed_config(router: str) -> dict:
    """deploy/prometheus.yml with the router at `router` (host:port) and every interval one second."""
    config = yaml.safe_load(DEPLOYED.read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            static["targets"] = [router]
        for sd in job.get("http_sd_configs", []):
            sd["url"], sd["refresh_interval"] = f"http://{router}/metrics/targets", "1s"
    return config


def prometheus_binary(cache: Path | None = None) -> Path:
    """The Prometheus server: on PATH, or Debian's package unpacked under `cache` (fetched once; default:
    $SPILLWAY_CACHE or ~/.cache/spillway)."""
    cache = cache or Path(os.environ.get("SPILLWAY_CACHE", Path.home() / ".cache" / "spillway"))
    found = shutil.which("prometheus")
    if found:
        return Path(found)
    binary = cache / "prometheus" / "usr" / "bin" / "prometheus"
    if not binary.exists():
        work = cache / "prometheus-download"
        work.mkdir(parents=True, exist_ok=True)
        subprocess.run(["apt-get", "download", "prometheus"], cwd=work, check=True, capture_output=True)
        (deb,) = work.glob("prometheus_*.deb")
        subprocess.run(["dpkg-deb", "-x", str(deb), str(cache / "prometheus")], check=True)
        shutil.rmtree(work)
    return binary


@contextmanager
def running_prometheus(binary: Path, config: dict, work: Path, port: int) -> Iterator[str]:
    """Prometheus on 127.0.0.1:`port` with `config` (its data under `work`), until the block ends: its URL."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    argv = [str(binary), f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}"]
    argv += [f"--web.listen-address=127.0.0.1:{port}"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=(work / "log").open("w"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert proc.poll() is None, (work / "log").read_text()
            try:
                urllib.request.urlopen(f"{url}/-/ready", timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def query(url: str, expr: str) -> list[dict]:
    """An instant query's result vector (AssertionError if Prometheus refuses the query)."""
    params = urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(f"{url}/api/v1/query?{params}", timeout=10) as answer:
        body = json.loads(answer.read())
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def targets(url: str) -> list[dict]:
    """Prometheus's active targets (job, scrape URL, health), as its API lists them."""
    with urllib.request.urlopen(f"{url}/api/v1/targets?state=active", timeout=10) as answer:
        return json.loads(answer.read())["data"]["activeTargets"]

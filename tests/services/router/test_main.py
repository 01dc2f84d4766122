"""The router's command line: argument parsing, and `python -m services.router` as a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from common.ipc.transport import ipc_address
from common.model.defaults import default_model_dir
from services.router import WorkerPair
from services.router.main import config_from_args, parse_args

ROOT = Path(__file__).resolve().parents[3]


def test_arguments_make_a_config() -> None:
    args = parse_args(
        [
            "--model", "/models/m", "--served-model-name", "m", "--port", "9000",
            "--inbox", "ipc:///r/router.sock", "--prefill", "ipc:///r/prefill.sock", "--decode", "tcp://h:5",
            "--max-running", "4", "--max-queue", "2", "--max-context", "1024", "--api-key", "k",
            "--metrics-port", "9100", "--metrics-url", "prefill=http://h:1/metrics",
            "--worker-metrics", "decode=http://h:2/metrics",
            "--heartbeat-timeout", "2.5", "--prefill", "tcp://h:6", "--decode", "tcp://h:7",
        ]
    )  # fmt: skip
    config = config_from_args(args)
    assert config.model_dir == Path("/models/m") and config.model_name == "m"
    assert (config.host, config.port, config.metrics_port) == ("127.0.0.1", 9000, 9100)
    assert config.inbox == "ipc:///r/router.sock"
    assert config.pairs == (
        WorkerPair("ipc:///r/prefill.sock", "tcp://h:5"),
        WorkerPair("tcp://h:6", "tcp://h:7"),
    )
    assert (config.max_running, config.max_queue, config.max_context, config.api_key) == (4, 2, 1024, "k")
    assert dict(config.metrics_urls) == {"prefill": "http://h:1/metrics", "decode": "http://h:2/metrics"}
    assert config.heartbeat_timeout_s == 2.5


def test_prefill_and_decode_addresses_must_pair_up() -> None:
    args = parse_args(
        [
            "--model",
            "m",
            "--inbox",
            "ipc://a",
            "--prefill",
            "ipc://b",
            "--decode",
            "ipc://c",
            "--prefill",
            "ipc://d",
        ]
    )
    with pytest.raises(SystemExit, match="2 prefill and 1 decode"):
        config_from_args(args)


def test_defaults_bind_loopback_and_read_the_key_from_the_environment(monkeypatch: Any) -> None:
    monkeypatch.setenv("SPILLWAY_API_KEY", "from-env")
    args = parse_args(["--model", "m", "--inbox", "ipc://a", "--prefill", "ipc://b", "--decode", "ipc://c"])
    config = config_from_args(args)
    assert config.metrics_urls == {}
    assert config.host == "127.0.0.1" and config.api_key == "from-env" and config.max_running == 0
    assert config.pairs == (WorkerPair("ipc://b", "ipc://c"),) and config.model_name == "m"


def test_restart_counts_come_from_the_launcher(monkeypatch: Any) -> None:
    """A restarted router goes on from its launcher's counts (SPILLWAY_RESTARTS), its own among them."""
    from services.router.supervision import Supervisor

    args = parse_args(["--model", "m", "--inbox", "ipc://a", "--prefill", "ipc://b", "--decode", "ipc://c"])
    assert config_from_args(args).restarts == {}
    monkeypatch.setenv("SPILLWAY_RESTARTS", '{"decode": 2, "prefill": 0, "router": 1}')
    config = config_from_args(args)
    assert config.restarts == {"decode": 2, "prefill": 0, "router": 1}
    report = Supervisor(config, lambda *_: None).service_report()
    assert (report["decode"]["restarts"], report["prefill"]["restarts"]) == (2, 0)
    for bad in ("[1]", '{"decode": "x"}', "{"):
        monkeypatch.setenv("SPILLWAY_RESTARTS", bad)
        with pytest.raises(SystemExit, match="SPILLWAY_RESTARTS"):
            config_from_args(args)


def test_python_m_services_router(run_dir: Path, make_peer: Any, free_port: Any, wait_until: Any) -> None:
    make_peer(run_dir)
    port, metrics_port = free_port(), free_port()
    command = [
        sys.executable, "-m", "services.router", "--model", str(default_model_dir()),
        "--served-model-name", "tiny", "--port", str(port), "--metrics-port", str(metrics_port),
        "--inbox", ipc_address(run_dir, "router"), "--prefill", ipc_address(run_dir, "prefill"),
        "--decode", ipc_address(run_dir, "decode"), "--log-level", "warning",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                return httpx.get(f"{url}/health").status_code == 200
            except httpx.ConnectError:
                return False

        wait_until(healthy, timeout=30)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}])
        assert out.choices[0].finish_reason == "stop"
        scraped = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
        assert "spillway:time_to_first_token_seconds_count 1.0" in scraped
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=15)
        finally:
            proc.kill()
    log = proc.stdout.read().decode() if proc.stdout else ""
    # uvicorn shuts down gracefully, then re-raises the signal so that the exit status tells it was SIGTERM.
    assert code in (0, -signal.SIGTERM), log
    assert "Traceback" not in log, log

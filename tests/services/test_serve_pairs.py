"""`spillway serve --pairs 2` end to end: one router over two prefill/decode pairs, all real processes.

Requests spread over both pairs and answer as one pair would; a decode worker killed mid-stream fails the
stream on its pair only, while the other pair's stream runs on and new requests are served (the router
"degraded", still 200); the launcher restarts the worker and the router is "ok" again.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import openai
import pytest

from tests.conftest import Server, free_port, free_ports, health, wait_status

pytestmark = pytest.mark.slow
MODEL = "tiny-qwen3_moe"


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    port, metrics = free_port(), free_ports(5)
    argv = [sys.executable, "-m", "services.cli", "serve", "--pairs", "2", "--port", str(port)]
    argv += ["--threads", "1", "--max-running", "2", "--max-context", "1024", "--expert-cache", "0.5"]
    argv += ["--metrics-port", str(metrics)]
    env = {**os.environ, "SPILLWAY_CACHE": str(tmp_path_factory.mktemp("cache"))}
    server = Server(subprocess.Popen(argv, env=env), port)
    try:
        wait_status(server, "ok", timeout_s=300)
        yield server, metrics
    finally:
        server.stop()


def test_both_pairs_serve_and_answer_alike(pairs):
    server, metrics = pairs
    body = health(server.port)[1]
    assert set(body["services"]) == {"prefill", "decode", "prefill-1", "decode-1"}
    assert [(p["prefill"], p["decode"], p["capacity"]) for p in body["pairs"]] == [
        ("prefill", "decode", 2),
        ("prefill-1", "decode-1", 2),
    ]
    assert body["router"]["max_running"] == 4, "the pairs' capacities add up"
    client = server.client()

    def ask(_: int) -> str:
        reply = client.completions.create(
            model=MODEL, prompt="Tell me about experts.", max_tokens=12, temperature=0
        )
        return reply.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(ask, range(4)))
    assert len(set(replies)) == 1, "greedy: the same tokens on either pair"
    time.sleep(1.5)  # the cache counters are read with the heartbeat
    for i in range(2):
        assert _expert_lookups(metrics + 2 + 2 * i) > 0, f"pair {i}'s decode worker decoded nothing"


def _expert_lookups(port: int) -> float:
    """The expert cache lookups (hits and misses, every layer) a decode worker's metrics count."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    pattern = r'^spillway:expert_cache_(?:hits|misses)_total\{layer="\d+"\} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def test_a_dead_decode_fails_its_pairs_stream_only(pairs):
    server, _ = pairs
    client = server.client()
    streams = [
        client.completions.create(
            model=MODEL, prompt=f"go {i}", max_tokens=800, stream=True, extra_body={"ignore_eos": True}
        )
        for i in range(2)
    ]
    chunks = [iter(s) for s in streams]
    for it in chunks:
        next(it)
    running = [p["running"] for p in health(server.port)[1]["pairs"]]
    assert running == [1, 1], "one stream a pair"
    victim = health(server.port)[1]["services"]["decode-1"]["pid"]
    os.kill(victim, signal.SIGKILL)
    status = wait_status(server, "degraded", timeout_s=10)
    assert status["pairs"][1]["state"] == "down"
    outcomes = []
    for it in chunks:
        try:
            for _ in range(40):
                next(it)
            outcomes.append("runs")
        except openai.APIError as exc:
            outcomes.append(f"failed: {exc}")
    assert outcomes[0] == "runs" and outcomes[1].startswith("failed"), outcomes
    again = client.completions.create(model=MODEL, prompt="again", max_tokens=4, temperature=0)
    assert again.usage.completion_tokens == 4, "served while degraded"
    for stream in streams:
        stream.close()
    body = wait_status(server, "ok")
    assert body["services"]["decode-1"]["pid"] != victim and body["services"]["decode-1"]["restarts"] == 1

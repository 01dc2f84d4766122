"""`spillway serve` end to end: the launcher, router, prefill and decode as real OS processes over real ZeroMQ
sockets and shared memory, driven by the official `openai` client.

Greedy outputs equal the offline engine's; seeded sampling does not depend on what else runs; a worker killed
mid-request turns into an error for that request and a restart; SIGTERM leaves no process and no shared
memory behind.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import torch

from common.engine import Engine
from common.sampling import SamplingParams
from tests.conftest import free_port, health, wait_healthy

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    port = free_port()
    env = {**os.environ, "SPILLWAY_CACHE": str(cache)}
    argv = [sys.executable, "-m", "services.cli", "serve", "--port", str(port), "--threads", "1"]
    argv += ["--max-running", "4", "--max-context", "512"]
    proc = subprocess.Popen(argv, env=env)
    try:
        wait_healthy(port)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        yield proc, port, client, cache / "models" / "tiny-qwen3_moe"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)


def test_chat_equals_offline_engine_streaming_and_not(server):
    _, _, client, model_dir = server
    messages = [{"role": "user", "content": "Tell me about experts."}]
    reply = client.chat.completions.create(
        model="tiny-qwen3_moe", messages=messages, max_tokens=12, temperature=0
    )
    engine = Engine(model_dir, dtype=torch.float32, max_seqs=1)
    prompt = engine.tokenizer.apply_chat_template(messages, tokenize=True)
    (ref,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == len(ref.token_ids)
    assert reply.choices[0].message.content == engine.tokenizer.decode(ref.token_ids)
    stream = client.chat.completions.create(
        model="tiny-qwen3_moe", messages=messages, max_tokens=12, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == reply.choices[0].message.content


def test_seeded_requests_do_not_depend_on_their_batch(server):
    _, _, client, _ = server

    def ask(i: int) -> str:
        r = client.completions.create(
            model="tiny-qwen3_moe", prompt=f"number {i}", max_tokens=10, temperature=0.9, seed=i
        )
        return r.choices[0].text

    alone = [ask(i) for i in range(3)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        together = list(pool.map(ask, [0, 1, 2, 0, 1, 2]))
    assert together == alone + alone


def test_killed_decode_worker_errors_its_request_and_restarts(server):
    _, port, client, _ = server
    old = health(port)[1]["services"]["decode"]["pid"]

    stream = client.completions.create(
        model="tiny-qwen3_moe",
        prompt="go",
        max_tokens=480,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    with pytest.raises(openai.APIError):
        for i, _ in enumerate(stream):
            if i == 2:
                os.kill(old, signal.SIGKILL)
    body = wait_healthy(port)
    assert body["services"]["decode"]["pid"] != old
    r = client.completions.create(model="tiny-qwen3_moe", prompt="again", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4
    assert not list(Path("/dev/shm").glob(f"spillway-{old}-*"))


def test_sigterm_stops_everything_and_frees_shared_memory(server):
    proc, port, _, _ = server
    pids = _children(proc.pid)
    assert len(pids) == 3
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
        assert not list(Path("/dev/shm").glob(f"spillway-{pid}-*"))
    assert health(port)[0] == 0


def test_offloaded_experts_serve_the_same_tokens(start_server, tmp_path):
    """Decode's expert cache and host store, shared with prefill (its arena reads the frozen cache)."""
    env = {"SPILLWAY_CACHE": str(tmp_path)}
    server = start_server("--expert-cache", "0.25", "--threads", "1", "--max-context", "512", env=env)
    client = server.client()
    engine = Engine(tmp_path / "models" / "tiny-qwen3_moe", dtype=torch.float32, max_seqs=1)
    for text in ["Tell me about experts.", "Hi"]:
        messages = [{"role": "user", "content": text}]
        reply = client.chat.completions.create(
            model="tiny-qwen3_moe", messages=messages, max_tokens=12, temperature=0
        )
        prompt = engine.tokenizer.apply_chat_template(messages, tokenize=True)
        (ref,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))
        assert reply.choices[0].message.content == engine.tokenizer.decode(ref.token_ids)
    assert server.stop() == 0

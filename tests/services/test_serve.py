"""`spillway serve` end to end: the launcher, router, prefill and decode as real OS processes over real ZeroMQ
sockets and shared memory, driven by the official `openai` client, for a qwen3_moe and a qwen4_exp model with
offloaded experts (decode's cache, prefill's arena).

Greedy outputs equal `spillway generate`'s; seeded sampling does not depend on what else runs; admission
answers 429 beyond the queue and loses nothing; a client that disconnects frees its state; bad requests get
their error; a decode worker killed mid-request turns /health to 503, errors that request, and is restarted;
one that hangs (SIGSTOP) does the same after the stall timeout; SIGTERM leaves no process and no shared memory
behind.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import httpx
import openai
import pytest

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.model.synthetic.checkpoint import make_model
from common.protocol import SamplingParams
from tests.conftest import Server, free_port, free_ports, health, wait_healthy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen4_exp"])
def stack(request, tmp_path_factory):
    """A served tiny model: qwen3_moe is the embedded default (created by `serve` itself), qwen4_exp given."""
    cache = tmp_path_factory.mktemp("cache")
    port, metrics = free_port(), free_ports(4)
    args = ["--threads", "1", "--max-running", "2", "--max-queue", "4", "--max-context", "2048"]
    args += ["--expert-cache", "0.5", "--metrics-port", str(metrics), "--port", str(port)]
    if request.param == "qwen3_moe":
        model = cache / "models" / "tiny-qwen3_moe"
    else:
        model = make_model(tmp_path_factory.mktemp("q4") / "tiny-qwen4", preset="tiny", arch="qwen4_exp")
        args += ["--model", str(model)]
    argv = [sys.executable, "-m", "services.cli", "serve", *args]
    server = Server(subprocess.Popen(argv, env={**os.environ, "SPILLWAY_CACHE": str(cache)}), port)
    try:
        wait_healthy(port)
        yield server, Path(model), metrics
    finally:
        server.stop()


def _name(model: Path) -> str:
    return model.name


def _decode_metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port + 2}/metrics", timeout=5) as resp:
        return resp.read().decode()


def _gauge(text: str, name: str) -> float:
    match = re.search(rf"^spillway:{name} (\S+)$", text, re.M)
    assert match, name
    return float(match.group(1))


def _counter_sum(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^spillway:{name}{{layer=\"\d+\"}} (\S+)$", text, re.M))


def test_greedy_chat_equals_spillway_generate(stack):
    server, model, _ = stack
    client = server.client()
    text = "Tell me about experts."
    cli = [sys.executable, "-m", "services.cli", "generate", "--model", str(model), "--chat", text]
    ref = json.loads(subprocess.run([*cli, "--max-tokens", "12", "--json"], capture_output=True,
                                    check=True, text=True).stdout)  # fmt: skip
    messages = [{"role": "user", "content": text}]
    reply = client.chat.completions.create(
        model=_name(model), messages=messages, max_tokens=12, temperature=0
    )
    assert reply.choices[0].message.content == ref["text"]
    assert reply.usage.completion_tokens == len(ref["token_ids"])
    assert reply.usage.prompt_tokens == len(ref["prompt_ids"])
    stream = client.chat.completions.create(
        model=_name(model), messages=messages, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ref["text"]


def test_a_response_is_the_greedy_chat(stack):
    """The Responses API (`client.responses.create`) answers what the chat answers, streamed and not."""
    server, model, _ = stack
    client = server.client()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tell me about experts."},
    ]
    chat = client.chat.completions.create(model=_name(model), messages=messages, max_tokens=12, temperature=0)
    ask = {"model": _name(model), "instructions": "Be brief.", "input": "Tell me about experts."}
    whole = client.responses.create(**ask, max_output_tokens=12, temperature=0)
    status = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert whole.output_text == chat.choices[0].message.content and whole.status == status
    usage = (whole.usage.input_tokens, whole.usage.output_tokens)
    assert usage == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    events = list(client.responses.create(**ask, max_output_tokens=12, temperature=0, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].type == f"response.{status}"


def test_completions_streamed_and_not_agree(stack):
    server, model, _ = stack
    client = server.client()
    whole = client.completions.create(model=_name(model), prompt="Once upon", max_tokens=10, temperature=0)
    stream = client.completions.create(
        model=_name(model), prompt="Once upon", max_tokens=10, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == whole.choices[0].text
    engine = Engine(WorkerConfig(str(model), max_running=1))
    (ref,) = engine.generate([engine.tokenizer.encode("Once upon")], SamplingParams(0.0, max_tokens=10))
    assert whole.choices[0].text == engine.tokenizer.decode(ref.token_ids)


def test_a_prompt_is_scored_with_max_tokens_zero(stack):
    """echo + logprobs + max_tokens 0: the prompt's own log-probabilities (prefill's), as with a token."""
    server, model, _ = stack
    client = server.client()
    ask = {"model": _name(model), "prompt": "Once upon a time", "echo": True, "logprobs": 1}
    scored = client.completions.create(**ask, max_tokens=0)
    one = client.completions.create(**ask, max_tokens=1, temperature=0)
    assert scored.choices[0].text == "Once upon a time" and scored.usage.completion_tokens == 0
    got, want = scored.choices[0].logprobs.token_logprobs, one.choices[0].logprobs.token_logprobs[:-1]
    assert got[0] is None and got[1:] == pytest.approx(want[1:], abs=1e-5)


def test_seeded_requests_do_not_depend_on_their_batch(stack):
    server, model, _ = stack
    client = server.client()

    def ask(i: int) -> str:
        r = client.completions.create(
            model=_name(model), prompt=f"n {i}", max_tokens=8, temperature=0.9, seed=i
        )
        return r.choices[0].text

    alone = [ask(i) for i in range(3)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:  # 2 running + 4 queued: all admitted
        together = list(pool.map(ask, [0, 1, 2, 0, 1, 2]))
    assert together == alone + alone


def test_eight_clients_complete_or_get_429(stack):
    server, model, _ = stack
    client = server.client()

    def ask(i: int) -> str:
        try:
            r = client.completions.create(
                model=_name(model), prompt="go", max_tokens=40, extra_body={"ignore_eos": True}, seed=i
            )
        except openai.RateLimitError:
            return "429"
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 40
        return "ok"

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(ask, range(8), timeout=120))
    assert outcomes.count("ok") >= 6 and set(outcomes) <= {"ok", "429"}, outcomes


def _wait_metrics(port: int, ok, timeout_s: float = 20) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = _decode_metrics(port)
        if ok(text):
            return text
        time.sleep(0.3)
    raise AssertionError(f"decode metrics never got there: {text}")


def _router_generated(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return _gauge(resp.read().decode(), "generation_tokens_total")


def test_disconnect_mid_stream_frees_the_state(stack):
    server, model, metrics = stack
    idle = lambda t: _gauge(t, "requests_running") == 0 and _gauge(t, "kv_pages_used") == 0
    free = _gauge(_wait_metrics(metrics, idle), "kv_pages_free")
    generated = _router_generated(server.port)
    body = {"model": _name(model), "prompt": "go", "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"http://127.0.0.1:{server.port}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()  # (a dropped iterator would close the stream)
        assert r.status_code == 200 and next(lines).startswith("data: ")
        _wait_metrics(metrics, lambda t: _gauge(t, "requests_running") == 1)
    text = _wait_metrics(metrics, idle)  # leaving the block closed the connection mid-stream
    assert _gauge(text, "kv_pages_free") == free
    assert _router_generated(server.port) - generated < 2000  # aborted, not finished


def test_decode_metrics_count_expert_cache_lookups(stack):
    server, model, metrics = stack
    before = _counter_sum(_decode_metrics(metrics), "expert_cache_hits_total")
    before += _counter_sum(_decode_metrics(metrics), "expert_cache_misses_total")
    server.client().completions.create(model=_name(model), prompt="count", max_tokens=8, temperature=0)
    time.sleep(1.5)  # the counters are read with the heartbeat
    text = _decode_metrics(metrics)
    after = _counter_sum(text, "expert_cache_hits_total") + _counter_sum(text, "expert_cache_misses_total")
    assert after > before
    assert 'spillway:expert_cache_hit_rate{layer="' in text and "spillway:expert_h2d_bytes_total" in text


def test_only_decode_exports_the_kv_pool(stack):
    """Decode owns the KV pool: its metrics have the pages; prefill's have none (a 0 would read as full)."""
    _, _, metrics = stack
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics + 1}/metrics", timeout=5) as resp:
        prefill = resp.read().decode()
    assert "spillway:requests_running" in prefill and "kv_pages" not in prefill
    assert _gauge(_decode_metrics(metrics), "kv_pages_free") > 0


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{not json", 400, ""),
        (b'{"prompt": 3, "max_tokens": 4}', 400, "prompt"),
        (b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
        (b'{"prompt": "x", "max_tokens": "four"}', 400, "max_tokens"),
        (json.dumps({"prompt": "word " * 2100, "max_tokens": 4}).encode(), 400, "2048"),
        (b'{"prompt": "x", "model": "no-such-model"}', 404, "no-such-model"),
    ],
)
def test_bad_requests_get_their_error(stack, body, status, needle):
    server, _, _ = stack
    r = httpx.post(
        f"http://127.0.0.1:{server.port}/v1/completions",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and needle in error["message"] + str(
        error["param"]
    )


def test_killed_decode_worker_is_reported_restarted_and_serves_again(stack):
    server, model, _ = stack
    old = health(server.port)[1]["services"]["decode"]["pid"]
    client = server.client()
    stream = client.completions.create(
        model=_name(model), prompt="go", max_tokens=2000, stream=True, extra_body={"ignore_eos": True}
    )
    saw_503 = False
    with pytest.raises(openai.APIError):
        for i, _ in enumerate(stream):
            if i == 2:
                os.kill(old, signal.SIGKILL)
                deadline = time.monotonic() + 10
                while not saw_503 and time.monotonic() < deadline:
                    saw_503 = health(server.port)[0] == 503
    assert saw_503
    assert wait_healthy(server.port)["services"]["decode"]["pid"] != old
    r = client.completions.create(model=_name(model), prompt="again", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4
    assert not list(Path("/dev/shm").glob(f"spillway-{old}-*"))


def test_killed_prefill_worker_is_restarted_and_maps_decode_again(stack):
    """A new prefill asks decode for its exports again (WantExports) and serves the same greedy tokens."""
    server, model, _ = stack
    client = server.client()
    ask = lambda: client.completions.create(model=_name(model), prompt="again", max_tokens=6, temperature=0)
    before = ask().choices[0].text
    old = health(server.port)[1]["services"]["prefill"]["pid"]
    os.kill(old, signal.SIGKILL)
    deadline, saw_503 = time.monotonic() + 10, False
    while not saw_503 and time.monotonic() < deadline:
        saw_503 = health(server.port)[0] == 503
    assert saw_503
    assert wait_healthy(server.port)["services"]["prefill"]["pid"] != old
    assert ask().choices[0].text == before


def test_a_hung_decode_worker_fails_its_request_and_is_restarted(start_server, tmp_path):
    """SIGSTOP: no exit for the launcher to see, only silence; past --stall-timeout the stream errors, the
    launcher kills the process and starts another, and the server answers again."""
    server = start_server("--threads", "1", "--stall-timeout", "3", env={"SPILLWAY_CACHE": str(tmp_path)})
    old = health(server.port)[1]["services"]["decode"]["pid"]
    client = server.client()
    stream = client.completions.create(
        model="tiny-qwen3_moe", prompt="go", max_tokens=2000, stream=True, extra_body={"ignore_eos": True}
    )
    started = None
    with pytest.raises(openai.APIError, match="stopped responding"):
        for i, _ in enumerate(stream):
            if i == 2:
                os.kill(old, signal.SIGSTOP)
                started = time.monotonic()
    assert started is not None and time.monotonic() - started < 30
    assert wait_healthy(server.port)["services"]["decode"]["pid"] != old
    assert not Path(f"/proc/{old}").exists() or Path(f"/proc/{old}/stat").read_text().split()[2] == "Z"
    r = client.completions.create(model="tiny-qwen3_moe", prompt="again", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4


def test_a_hung_router_is_restarted(start_server, tmp_path):
    """SIGSTOP on the router: /health stops answering; past --stall-timeout the launcher kills it and starts
    another, which serves, and aborts the request its predecessor left running (its tokens reach nobody)."""
    server = start_server("--threads", "1", "--stall-timeout", "2", env={"SPILLWAY_CACHE": str(tmp_path)})
    children = lambda: {int(p) for p in subprocess.run(
        ["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True).stdout.split()}  # fmt: skip
    workers = {health(server.port)[1]["services"][s]["pid"] for s in ("prefill", "decode")}
    (old,) = children() - workers
    long = {
        "model": "tiny-qwen3_moe",
        "prompt": "on",
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"http://127.0.0.1:{server.port}/v1/completions", json=long, timeout=30
    ) as resp:
        next(resp.iter_lines())  # it runs
        os.kill(old, signal.SIGSTOP)
    body = wait_healthy(server.port, timeout_s=120)
    assert {body["services"][s]["pid"] for s in ("prefill", "decode")} == workers, "the workers kept running"
    assert old not in children() and len(children() - workers) == 1
    deadline = time.monotonic() + 5  # aborted at its first event the new router gets
    while health(server.port)[1]["services"]["decode"]["running"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert health(server.port)[1]["services"]["decode"]["running"] == 0, "the orphan was aborted"
    r = server.client().completions.create(
        model="tiny-qwen3_moe", prompt="again", max_tokens=4, temperature=0
    )
    assert r.usage.completion_tokens == 4


def test_resident_experts_serve_the_same_tokens(start_server, tmp_path):
    env = {"SPILLWAY_CACHE": str(tmp_path)}
    server = start_server("--threads", "1", "--max-context", "512", env=env)
    engine = Engine(WorkerConfig(str(tmp_path / "models" / "tiny-qwen3_moe"), max_running=1))
    messages = [{"role": "user", "content": "Hi"}]
    reply = server.client().chat.completions.create(
        model="tiny-qwen3_moe", messages=messages, max_tokens=12, temperature=0
    )
    prompt = engine.tokenizer.apply_chat_template(messages, tokenize=True)
    (ref,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))
    assert reply.choices[0].message.content == engine.tokenizer.decode(ref.token_ids)


def test_sigterm_stops_everything_and_frees_shared_memory(start_server, tmp_path):
    server = start_server("--threads", "1", env={"SPILLWAY_CACHE": str(tmp_path)})
    out = subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 3
    assert server.stop() == 0
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists()
        assert not list(Path("/dev/shm").glob(f"spillway-{pid}-*"))
    assert health(server.port)[0] == 0


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _gone(pids: list[int], timeout_s: float) -> bool:
    """Whether every process of `pids` has exited (or is a zombie) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    alive = lambda p: Path(f"/proc/{p}").exists() and Path(f"/proc/{p}/stat").read_text().split()[2] != "Z"
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(map(alive, pids))


@pytest.mark.parametrize("streaming", [False, True])
def test_sigterm_ends_the_launcher_and_its_services_within_3_s(start_server, tmp_path, streaming):
    """SIGTERM, idle or with a stream in flight: the launcher and every service are gone in < 3 s; the stream
    ends (an error event, its connection closed), it does not hang."""
    server = start_server("--threads", "1", env={"SPILLWAY_CACHE": str(tmp_path)})
    pids = _children(server.proc.pid)
    body = {"model": "tiny-qwen3_moe", "prompt": "on", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    lines: list[str] = []
    with contextlib.ExitStack() as stack:
        if streaming:
            url = f"http://127.0.0.1:{server.port}/v1/completions"
            resp = stack.enter_context(httpx.stream("POST", url, json=body, timeout=10))
            lines_in = resp.iter_lines()
            lines.append(next(lines_in))
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        if streaming:
            with contextlib.suppress(httpx.HTTPError):
                lines.extend(lines_in)
            assert time.monotonic() - started < 3, "the stream ended"
        assert server.proc.wait(timeout=10) == 0
        assert time.monotonic() - started < 3, f"the launcher took {time.monotonic() - started:.1f} s"
    assert _gone(pids, 3 - (time.monotonic() - started) + 0.2)
    if streaming:
        events = [line for line in lines[1:] if line.startswith("data: {")]
        assert events and ('"error"' in events[-1] or '"finish_reason":"' in events[-1]), lines[-4:]


def test_a_killed_launcher_takes_every_service_with_it(start_server, tmp_path):
    """SIGKILL leaves the launcher no chance to stop its children: each sees its parent gone and stops (the
    router through its own graceful shutdown) within seconds, so nothing holds the port or the memory, and
    they remove the launcher's run directory."""
    server = start_server("--threads", "1", env={"SPILLWAY_CACHE": str(tmp_path)})
    pids = _children(server.proc.pid)
    assert len(pids) == 3
    argv = Path(f"/proc/{pids[0]}/cmdline").read_text().split("\0")
    run_dir = Path(argv[argv.index("--inbox") + 1].removeprefix("ipc://")).parent
    assert run_dir.is_dir()
    server.proc.kill()
    server.proc.wait()
    assert _gone(pids, 5), "every service stopped"
    assert not run_dir.exists(), "the services removed their launcher's run directory"
    assert health(server.port)[0] == 0


def test_restart_counts_survive_a_router_restart(start_server, tmp_path):
    """The launcher hands a restarted router every service's restarts so far: /health goes on from them."""
    server = start_server("--threads", "1", env={"SPILLWAY_CACHE": str(tmp_path)})
    _kill_and_restart(server, "decode")
    workers = {health(server.port)[1]["services"][s]["pid"] for s in ("prefill", "decode")}
    (router,) = set(_children(server.proc.pid)) - workers
    os.kill(router, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while router in _children(server.proc.pid) or health(server.port)[0] != 200:
        assert time.monotonic() < deadline, "the router came back"
        time.sleep(0.2)
    body = health(server.port)[1]
    assert body["services"]["decode"]["restarts"] == 1 and body["services"]["prefill"]["restarts"] == 0
    assert body["router_restarts"] == 1


def test_a_missing_shard_is_refused_before_starting(tmp_path):
    """A checkpoint the workers could not load: refused before any process starts (exit 2, the file named),
    not restarted until the launcher gives up."""
    model = make_model(tmp_path / "broken", preset="tiny", arch="qwen3_moe")
    shard = sorted(model.glob("*.safetensors"))[-1]
    shard.unlink()
    argv = [sys.executable, "-m", "services.cli", "serve", "--model", str(model), "--port", str(free_port())]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert shard.name in done.stderr and "started" not in done.stderr


def test_a_bad_model_directory_is_refused_before_starting(tmp_path):
    argv = [sys.executable, "-m", "services.cli", "serve", "--model", str(tmp_path / "nothing")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "config.json" in done.stderr


def _ask(server, text: str) -> str:
    """The tiny model's greedy 12-token reply to one user message."""
    messages = [{"role": "user", "content": text}]
    reply = server.client().chat.completions.create(
        model="tiny-qwen3_moe", messages=messages, max_tokens=12, temperature=0
    )
    return reply.choices[0].message.content


def _engine_replies(model_dir, texts, max_context: int = 4096) -> tuple[list[list[int]], list[str]]:
    """What `_ask` should get: each text's chat prompt and the offline engine's greedy 12-token reply."""
    engine = Engine(WorkerConfig(str(model_dir), max_running=1, max_context=max_context))
    template = engine.tokenizer.apply_chat_template
    chat = [template([{"role": "user", "content": t}], tokenize=True) for t in texts]
    replies = engine.generate(chat, SamplingParams(temperature=0.0, max_tokens=12))
    return chat, [engine.tokenizer.decode(r.token_ids) for r in replies]


def _kill_and_restart(server, service: str) -> None:
    """SIGKILL a worker and wait until the launcher's replacement serves."""
    old = health(server.port)[1]["services"][service]["pid"]
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while health(server.port)[0] != 503 and time.monotonic() < deadline:
        pass
    assert wait_healthy(server.port)["services"][service]["pid"] != old


def test_lent_kv_pages_serve_the_same_tokens(start_server, tmp_path):
    """Decode lends its idle KV pages to the expert cache and exports the aliased pools to prefill, which
    maps them through the fd server; a long prompt takes pages back (stages of 16 pages here), and the
    tokens are those of an engine that lends nothing; the lent bytes are a gauge. A restarted decode (new
    pools, a new fd server) and a restarted prefill (which maps them again) serve the same tokens."""
    env = {"SPILLWAY_CACHE": str(tmp_path)}
    metrics = free_ports(4)
    server = start_server(
        "--threads", "1", "--max-context", "1024", "--max-running", "2", "--expert-cache", "3", "--lend-kv",
        "--metrics-port", str(metrics), env=env,
    )  # fmt: skip
    assert _gauge(_decode_metrics(metrics), "expert_cache_lent_bytes") > 0
    texts = ("Hi", "Tell me about experts and their caches, at length. " * 40)
    prompts, want = _engine_replies(tmp_path / "models" / "tiny-qwen3_moe", texts, max_context=1024)
    assert len(prompts[1]) > 256  # past the first stage: lent slots are taken back for it
    assert [_ask(server, t) for t in texts] == want
    assert _gauge(_decode_metrics(metrics), "expert_cache_lent_bytes") > 0
    for service in ("decode", "prefill"):
        _kill_and_restart(server, service)
        assert [_ask(server, t) for t in texts] == want, service


def test_a_lent_arena_serves_the_same_tokens(start_server, tmp_path):
    """--lend-arena: prefill's arena lives in decode's pool as the cache's bank, lent between prefills (not
    before the first: the prefill worker's warm-up writes it), taken back for each prefill. The tokens are an
    engine's that lends nothing, also after decode, then prefill, is killed and restarted."""
    env = {"SPILLWAY_CACHE": str(tmp_path)}
    metrics = free_ports(4)
    server = start_server(
        "--threads", "1", "--max-running", "2", "--expert-cache", "3", "--lend-arena",
        "--metrics-port", str(metrics), env=env,
    )  # fmt: skip
    assert _gauge(_decode_metrics(metrics), "expert_cache_lent_bytes") == 0
    texts = ("Hi", "Tell me about experts and their caches. " * 4)
    _, want = _engine_replies(tmp_path / "models" / "tiny-qwen3_moe", texts)
    assert [_ask(server, t) for t in texts] == want
    deadline = time.monotonic() + 10  # the gauges refresh once a second
    while _gauge(_decode_metrics(metrics), "expert_cache_lent_bytes") == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _gauge(_decode_metrics(metrics), "expert_cache_lent_bytes") > 0
    for service in ("decode", "prefill"):
        _kill_and_restart(server, service)
        assert [_ask(server, t) for t in texts] == want, service


def test_lookahead_serves_the_same_tokens_and_counts_its_guesses(start_server, tmp_path):
    """--lookahead: decode's MoE layers copy the next layer's guessed experts in ahead. The tokens are an
    engine's without it; the prefetch counters reach /metrics."""
    env = {"SPILLWAY_CACHE": str(tmp_path)}
    metrics = free_ports(4)
    server = start_server(
        "--threads", "1", "--max-running", "2", "--expert-cache", "3", "--lookahead", "4",
        "--metrics-port", str(metrics), env=env,
    )  # fmt: skip
    texts = ("Hi", "Tell me about experts and their caches. " * 4)
    _, want = _engine_replies(tmp_path / "models" / "tiny-qwen3_moe", texts)
    assert [_ask(server, t) for t in texts] == want
    text = _wait_metrics(metrics, lambda t: _counter_sum(t, "expert_cache_prefetch_hits_total") > 0)
    assert _counter_sum(text, "expert_cache_prefetches_total") >= _counter_sum(
        text, "expert_cache_prefetch_hits_total"
    )

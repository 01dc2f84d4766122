"""Admission (429), readiness and health (503), aborts on client disconnect, API keys, worker restarts."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from common.protocol import Abort, Tokens

SLOW = {"model": "tiny", "prompt": "[slow]", "max_tokens": 200, "stream": True}


def health(served: Any) -> tuple[int, dict[str, Any]]:
    response = httpx.get(f"{served.url}/health", timeout=5)
    return response.status_code, response.json()


def rid_of(response: httpx.Response) -> str:
    return response.headers["x-request-id"]


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code
    return error


def test_stream_disconnect_aborts_both_workers(served: Any, wait_until: Any) -> None:
    with httpx.stream("POST", f"{served.url}/v1/completions", json=SLOW, timeout=10) as response:
        rid = rid_of(response)
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    wait_until(lambda: served.peer.aborted_by(rid) == {"prefill", "decode"})
    wait_until(lambda: health(served)[1]["router"]["running"] == 0)


def test_non_streaming_disconnect_aborts(served: Any, wait_until: Any) -> None:
    before = len(served.peer.generates())
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{served.url}/v1/completions", json={**SLOW, "stream": False}, timeout=0.3)
    rid = served.peer.generates()[before].rid
    wait_until(lambda: served.peer.aborted_by(rid) == {"prefill", "decode"})
    wait_until(lambda: health(served)[1]["router"]["running"] == 0)


def test_more_choices_than_admission_holds_is_a_400_not_busy(serve_router: Any) -> None:
    """A request larger than running + queued would refuse itself as busy on an idle server."""
    with serve_router(max_running=2, max_queue=2) as served:
        body = {"model": "tiny", "prompt": ["a", "b", "c", "d", "e"], "max_tokens": 2}
        error = assert_error(httpx.post(f"{served.url}/v1/completions", json=body, timeout=10), 400)
        assert (
            error["code"] == "too_many_choices"
            and error["param"] == "n"
            and "5 prompts × n = 1" in error["message"]
        )
        ok = httpx.post(
            f"{served.url}/v1/completions", json={**body, "prompt": ["a", "b"], "n": 2}, timeout=10
        )
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 4
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "n": 5, "max_tokens": 2}
        error = assert_error(httpx.post(f"{served.url}/v1/chat/completions", json=chat, timeout=10), 400)
        assert "5 choices (n = 5)" in error["message"]


def test_queue_full_is_429_and_waiters_run_in_order(serve_router: Any, wait_until: Any) -> None:
    with serve_router(max_running=1, max_queue=1) as served:
        results: dict[str, httpx.Response] = {}
        with httpx.stream("POST", f"{served.url}/v1/completions", json=SLOW, timeout=10) as running:
            lines = running.iter_lines()  # (an abandoned iterator would close the stream: a disconnect)
            next(lines)
            waiting = {"model": "tiny", "prompt": "[slow] later", "max_tokens": 3}
            thread = threading.Thread(
                target=lambda: results.update(
                    waiter=httpx.post(f"{served.url}/v1/completions", json=waiting, timeout=10)
                )
            )
            thread.start()
            wait_until(lambda: health(served)[1]["router"]["waiting"] == 1)
            assert "spillway:requests_waiting 1.0" in httpx.get(f"{served.url}/metrics").text
            assert len(served.peer.generates()) == 1, "the waiting request is not sent on"
            rejected = httpx.post(f"{served.url}/v1/completions", json=waiting, timeout=10)
            assert_error(rejected, 429, "queue_full")
        thread.join(timeout=10)
        assert results["waiter"].status_code == 200
        assert results["waiter"].json()["usage"]["completion_tokens"] == 3
        assert (
            'spillway:request_errors_total{reason="queue_full"} 1.0'
            in httpx.get(f"{served.url}/metrics").text
        )


def test_disconnect_while_queued_gives_the_place_up(serve_router: Any, wait_until: Any) -> None:
    with serve_router(max_running=1, max_queue=4) as served:
        with httpx.stream("POST", f"{served.url}/v1/completions", json=SLOW, timeout=10) as running:
            lines = running.iter_lines()  # (an abandoned iterator would close the stream: a disconnect)
            next(lines)
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{served.url}/v1/completions", json={**SLOW, "stream": False}, timeout=0.3)
            wait_until(lambda: health(served)[1]["router"]["waiting"] == 0)
        out = httpx.post(f"{served.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert out.status_code == 200
        assert len(served.peer.generates()) == 2, "the abandoned request never reached the workers"


def test_not_ready_until_every_worker_is_up(serve_router: Any, wait_until: Any) -> None:
    urls = {"prefill": "http://127.0.0.1:9101/metrics"}
    with serve_router(peer_ready=False, max_running=0, heartbeat_timeout_s=0.5, metrics_urls=urls) as served:
        status, body = health(served)
        assert status == 503 and body["status"] == "unavailable"
        assert {n: s["state"] for n, s in body["services"].items()} == {
            "prefill": "starting",
            "decode": "starting",
        }
        assert body["services"]["prefill"]["metrics_url"] == urls["prefill"]
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
        assert_error(httpx.post(f"{served.url}/v1/chat/completions", json=chat), 503, "not_ready")

        served.peer.announce("prefill")
        wait_until(lambda: health(served)[1]["services"]["prefill"]["state"] == "up")
        assert health(served)[0] == 503
        served.peer.announce("decode")
        status, body = wait_until(lambda: (h := health(served))[0] == 200 and h)
        assert body["status"] == "ok" and body["router"]["max_running"] == 8, "capacity from Ready"
        assert httpx.post(f"{served.url}/v1/chat/completions", json=chat, timeout=10).status_code == 200

        served.peer.silence("decode")
        status, body = wait_until(lambda: (h := health(served))[0] == 503 and h)
        assert body["services"]["decode"]["state"] == "down"
        assert_error(httpx.post(f"{served.url}/v1/chat/completions", json=chat), 503, "not_ready")


def test_worker_restart_fails_requests_in_flight(serve_router: Any, wait_until: Any) -> None:
    with serve_router() as served:
        with httpx.stream("POST", f"{served.url}/v1/completions", json=SLOW, timeout=10) as response:
            lines = response.iter_lines()
            next(lines)
            served.peer.announce("decode", pid=1)
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert "restarted" in events[-1]["error"]["message"]
        assert health(served)[1]["services"]["decode"]["restarts"] == 1


def test_a_worker_that_exits_fails_requests_in_flight_at_once(serve_router: Any, wait_until: Any) -> None:
    """No launcher to report the exit (one container a service): the router's connection to the worker's
    inbox closes, and the stream ends with an error event then, not after the 120 s stall timeout."""
    with serve_router() as served:
        wait_until(lambda: all(s.linked for s in served.app.state.router.core.services.values()))
        start = time.monotonic()
        with httpx.stream("POST", f"{served.url}/v1/completions", json=SLOW, timeout=30) as response:
            lines = response.iter_lines()
            next(lines)
            served.peer.exit("decode")
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert "connection closed" in events[-1]["error"]["message"]
        assert time.monotonic() - start < 10
        assert health(served)[0] == 503
        served.peer.restart("decode", pid=os.getpid(), instance="b")  # the same pid: a new start id
        wait_until(lambda: health(served)[0] == 200)
        assert health(served)[1]["services"]["decode"]["restarts"] == 1
        body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
        assert httpx.post(f"{served.url}/v1/completions", json=body, timeout=10).status_code == 200


def test_tokens_nobody_waits_for_are_aborted_once(served: Any, wait_until: Any) -> None:
    """A router restarted while requests ran gets their tokens: each is aborted at both workers, once, so
    that it stops holding a lane; a finished request's last event asks for nothing."""
    for index in range(3):
        served.peer.emit(Tokens("orphan-1", [5], index=index))
    served.peer.emit(Tokens("orphan-2", [5], "length", index=0))
    wait_until(lambda: served.peer.aborted_by("orphan-1") == {"prefill", "decode"})
    time.sleep(0.3)
    aborts = [m.rid for _, m in served.peer.received if isinstance(m, Abort)]
    assert aborts.count("orphan-1") == 2 and "orphan-2" not in aborts


def test_a_silent_worker_fails_requests_in_flight_and_recovers(serve_router: Any, wait_until: Any) -> None:
    """Hung, not dead (no exit to report): past the stall timeout the stream ends with an error event."""
    with serve_router(heartbeat_timeout_s=0.3, stall_timeout_s=0.6) as served:
        with httpx.stream("POST", f"{served.url}/v1/completions", json=SLOW, timeout=10) as response:
            lines = response.iter_lines()
            next(lines)
            served.peer.silence("decode")
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert "stopped responding" in events[-1]["error"]["message"]
        assert health(served)[0] == 503
        served.peer.announce("decode")  # heard again (the same process): serving again
        wait_until(lambda: health(served)[0] == 200)
        body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
        assert httpx.post(f"{served.url}/v1/completions", json=body, timeout=10).status_code == 200


def test_the_workers_context_caps_the_routers(serve_router: Any, wait_until: Any) -> None:
    """A worker holding less than the configured context (the model's limit) sets what a request may use."""
    with serve_router(max_context=256) as served:
        served.peer.announce("decode", max_context=40)
        models = lambda: httpx.get(f"{served.url}/v1/models").json()["data"][0]["max_model_len"]
        wait_until(lambda: models() == 40)
        body = {"model": "tiny", "prompt": list(range(3, 53)), "max_tokens": 2}
        response = httpx.post(f"{served.url}/v1/completions", json=body, timeout=10)
        assert "40" in assert_error(response, 400, "context_length_exceeded")["message"]


def test_api_key(serve_router: Any) -> None:
    with serve_router(api_key="sekrit") as served:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
        error = assert_error(httpx.post(f"{served.url}/v1/completions", json=body), 401, "invalid_api_key")
        assert "API key" in error["message"]
        wrong = {"Authorization": "Bearer nope"}
        assert_error(httpx.post(f"{served.url}/v1/completions", json=body, headers=wrong), 401)
        assert_error(httpx.get(f"{served.url}/v1/models"), 401)
        health = httpx.get(f"{served.url}/health")  # for anyone: its status alone
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        key = {"Authorization": "Bearer sekrit"}
        assert {"services", "pairs", "router"} <= httpx.get(f"{served.url}/health", headers=key).json().keys()
        assert_error(httpx.get(f"{served.url}/metrics"), 401, "invalid_api_key")
        assert_error(httpx.get(f"{served.url}/metrics", headers=wrong), 401)
        assert "spillway:" in httpx.get(f"{served.url}/metrics", headers=key).text
        good = openai.OpenAI(base_url=f"{served.url}/v1", api_key="sekrit", max_retries=0)
        assert good.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens == 2

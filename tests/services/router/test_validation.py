"""Request validation over HTTP, in process (httpx.ASGITransport): every failure is OpenAI's error object."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from common.ipc.transport import ipc_address, make_run_dir
from common.model.defaults import default_model_dir
from services.router import RouterConfig, WorkerPair, create_app

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
Call = Callable[[httpx.AsyncClient], Awaitable[httpx.Response]]
LIMIT = 1 << 16


@pytest.fixture(scope="module")
def app() -> Iterator[FastAPI]:
    run_dir = make_run_dir()
    config = RouterConfig(
        model_dir=default_model_dir(),
        served_model_name="tiny",
        inbox=ipc_address(run_dir, "router"),
        pairs=[WorkerPair(ipc_address(run_dir, "prefill"), ipc_address(run_dir, "decode"))],
        max_context=256,
        max_request_bytes=LIMIT,
    )
    app = create_app(config)

    @app.get("/probe")
    def probe(n: int) -> dict[str, int]:  # a FastAPI-validated parameter, to reach its 422 path
        return {"n": n}

    yield app
    shutil.rmtree(run_dir, ignore_errors=True)


def call(app: FastAPI, fn: Call) -> httpx.Response:
    """Run `fn` against the app with its lifespan (the core's sockets) up, as uvicorn would."""

    async def run() -> httpx.Response:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
                return await fn(client)

    return asyncio.run(run())


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**CHAT, "temperature": "hot"}, "temperature"),
        ({**CHAT, "n": 17}, "n"),
        ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({**CHAT, "messages": "hello"}, "messages"),
        ({"model": "tiny"}, "messages"),
    ],
)
def test_schema_errors_are_400(app: FastAPI, body: dict[str, Any], param: str) -> None:
    response = call(app, lambda c: c.post("/v1/chat/completions", json=body))
    error = error_of(response, 400)
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_malformed_json_is_400(app: FastAPI) -> None:
    headers = {"content-type": "application/json"}
    for content in (b"{", b"[1]", b"null"):
        response = call(app, lambda c, b=content: c.post("/v1/completions", content=b, headers=headers))
        assert error_of(response, 400)["code"] == "invalid_json"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_a_body_over_the_limit_is_413_declared_or_streamed(app: FastAPI, path: str) -> None:
    big = json.dumps({"model": "tiny", "prompt": "x" * LIMIT}).encode()

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
        for at in range(0, len(big), 4096):
            yield big[at : at + 4096]

    for content in (big, chunks()):
        error = error_of(call(app, lambda c, b=content: c.post(path, content=b)), 413)
        assert error["code"] == "request_too_large" and f"{LIMIT:,}" in error["message"]
    just_under = {**CHAT, "input": "Hi", "prompt": "y" * (LIMIT - 200)}
    assert len(json.dumps(just_under)) <= LIMIT
    assert call(app, lambda c: c.post(path, json=just_under)).status_code != 413


def test_unknown_model_is_404(app: FastAPI) -> None:
    response = call(app, lambda c: c.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"}))
    error = error_of(response, 404)
    assert error["code"] == "model_not_found" and "gpt-9" in error["message"]


def test_prompt_longer_than_context_names_both_numbers(app: FastAPI) -> None:
    prompt = list(range(3, 303))
    response = call(app, lambda c: c.post("/v1/completions", json={"model": "tiny", "prompt": prompt}))
    error = error_of(response, 400)
    assert "300" in error["message"] and "256" in error["message"]


def test_valid_request_with_extra_fields_reaches_admission(app: FastAPI) -> None:
    """Unknown fields are ignored; with no worker ready the request is then refused with 503."""
    body = {**CHAT, "frobnicate": True, "user": "someone", "tools": []}
    response = call(app, lambda c: c.post("/v1/chat/completions", json=body))
    assert error_of(response, 503)["code"] == "not_ready"


def test_health_before_any_worker(app: FastAPI) -> None:
    response = call(app, lambda c: c.get("/health"))
    assert response.status_code == 503
    assert response.json()["services"]["decode"]["state"] == "starting"


def test_routing_and_framework_errors_use_the_error_object(app: FastAPI) -> None:
    assert error_of(call(app, lambda c: c.get("/v2/nothing")), 404)
    assert error_of(call(app, lambda c: c.get("/v1/chat/completions")), 405)
    assert error_of(call(app, lambda c: c.get("/probe", params={"n": "x"})), 400)["param"] == "query.n"


def test_models(app: FastAPI) -> None:
    data = call(app, lambda c: c.get("/v1/models")).json()["data"]
    assert data[0]["id"] == "tiny" and data[0]["max_model_len"] == 256

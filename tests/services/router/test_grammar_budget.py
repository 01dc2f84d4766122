"""A structured output over the grammar budgets is a 400 (OpenAI's error object), not a 500: refused by
the router before it builds the grammar (over the size budget), or by a worker (`Tokens.refused`: a compile
past the time budget). The official client, a real server, real sockets, a protocol peer."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.services.router.conftest import REFUSAL
from tests.services.router.test_api import client


def _chat(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": prompt}], **extra}


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_a_worker_refuses_is_a_400(served: Any, stream: bool) -> None:
    """The refusal comes before the first token, so a stream too gets its status (no 200 went out)."""
    response = httpx.post(f"{served.url}/v1/chat/completions", json=_chat("[refused]", stream=stream))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error == {"message": REFUSAL, "type": "invalid_request_error", "param": None, "code": "refused"}
    with pytest.raises(openai.BadRequestError, match="did not compile within"):
        client(served).completions.create(model="tiny", prompt="[refused]", stream=stream)


def test_a_form_over_the_size_budget_is_refused_before_any_worker_sees_it(serve_router: Any) -> None:
    enum = {"type": "object", "properties": {"pick": {"enum": [f"item{i}" for i in range(50)]}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": enum}}
    tools = [{"type": "function", "function": {"name": "pick", "parameters": enum}}]
    with serve_router(grammar_max_bytes=300) as served:
        api = client(served)
        with pytest.raises(openai.BadRequestError, match="--grammar-max-bytes") as info:
            api.chat.completions.create(**_chat("Hi"), response_format=fmt)  # type: ignore[call-overload]
        assert info.value.body["param"] == "response_format"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError, match="--grammar-max-bytes") as info:
            api.chat.completions.create(**_chat("Hi"), tools=tools, tool_choice="required")  # type: ignore[call-overload]
        assert info.value.body["param"] == "tool_choice"  # type: ignore[index]
        assert served.peer.choices() == []  # no worker got either
        small = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
        api.chat.completions.create(**_chat("Hi"), response_format=small)  # type: ignore[call-overload]
        assert len(served.peer.choices()) == 1

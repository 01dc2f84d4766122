"""A property-based fuzz of the HTTP API (hypothesis) against a real router (uvicorn on a socket, a peer for
its workers): odd, malformed and hostile bodies for `/v1/chat/completions`, `/v1/completions` and
`/v1/responses` — junk bytes, JSON of the wrong shape, each known field given any JSON value, huge
integers — are each answered with a 2xx (a stream read to its end) or a 4xx with OpenAI's error object,
never a 5xx or a dropped connection. A bounded number of examples: seconds."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = 80
"""Examples per endpoint (a run's seeds vary; each example is one request)."""

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
lengths = st.integers(min_value=1, max_value=40) | st.sampled_from([0, -1, 600, 10**9, 2**63, 2**70])
texts = st.text(max_size=40) | st.sampled_from(["", "Hi", "<|im_start|>", "{{ raise }}", "\u0000", "[tool]"])
parts = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "text", "image_url", "input_text"])},
    optional={"text": texts, "image_url": st.just({"url": "data:,"}) | json_values},
)
roles = st.sampled_from(["system", "developer", "user", "user", "assistant", "tool", "function"])
messages = st.lists(
    st.fixed_dictionaries({"role": roles, "content": texts | st.lists(parts, min_size=1, max_size=3)}),
    min_size=1,
    max_size=3,
)
formats = st.sampled_from(
    [
        {"type": "text"},
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["a", "b"]}}},
        {"type": "regex"},
    ]
)
tools = st.lists(st.just({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}))
SAMPLING = {
    "model": st.sampled_from(["tiny", "tiny", "other"]),
    "max_tokens": lengths,
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(-1, 50),
    "n": st.integers(1, 3),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": texts | st.lists(texts, max_size=4),
    "stream": st.booleans(),
    "stream_options": st.just({"include_usage": True}),
    "logit_bias": st.dictionaries(st.sampled_from(["1", "5", "77"]), st.floats(-100, 100), max_size=2),
    "min_tokens": st.integers(0, 3),
    "stop_token_ids": st.lists(st.integers(0, 100), max_size=2),
    "response_format": formats,
    "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
}
CORE = {
    "/v1/chat/completions": {"messages": messages},
    "/v1/completions": {
        "prompt": texts | st.lists(st.integers(0, 200), max_size=5) | st.lists(texts, max_size=3)
    },
    "/v1/responses": {"input": texts | st.lists(st.fixed_dictionaries({"role": roles, "content": texts}))},
}
"""Each endpoint's one required field, plausibly valued."""
OPTIONAL = {
    "/v1/chat/completions": {
        **SAMPLING,
        "max_completion_tokens": lengths,
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 5),
        "tools": tools,
        "tool_choice": st.sampled_from(["auto", "none", "required"]),
        "parallel_tool_calls": st.booleans(),
        "chat_template_kwargs": st.dictionaries(
            st.sampled_from(["enable_thinking", "messages", "x"]), scalars
        ),
    },
    "/v1/completions": {
        **SAMPLING,
        "echo": st.booleans(),
        "logprobs": st.integers(0, 5),
        "best_of": st.integers(1, 2),
        "suffix": texts,
    },
    "/v1/responses": {
        "model": st.sampled_from(["tiny", "tiny", "other"]),
        "instructions": texts,
        "max_output_tokens": lengths,
        "temperature": st.floats(0, 2),
        "stream": st.booleans(),
        "tools": tools,
        "tool_choice": st.sampled_from(["auto", "none", "required"]),
        "text": st.just({"format": {"type": "json_object"}}),
        "store": st.booleans(),
        "top_logprobs": st.integers(0, 5),
        "include": st.lists(st.sampled_from(["message.output_text.logprobs", "x"]), max_size=2),
    },
}
"""Fields an endpoint takes beside its required one, plausibly valued."""


@st.composite
def requests(draw: st.DrawFn, path: str) -> dict[str, Any]:
    """A request for `path`: its required field and a few optional ones, plausibly valued; then, often,
    one field (known or not) given any JSON value instead, or removed."""
    body = draw(st.fixed_dictionaries(CORE[path], optional=OPTIONAL[path]))
    odd = draw(st.sampled_from([None, None, *CORE[path], *OPTIONAL[path], "unknown"]))
    if odd is not None:
        if draw(st.booleans()):
            body[odd] = draw(json_values)
        else:
            body.pop(odd, None)
    return body


def bodies(path: str) -> st.SearchStrategy[bytes]:
    """Bodies for `path`: mostly requests (`requests`), else any JSON value, JSON that does not parse, or
    bytes."""
    as_json = (requests(path) | json_values).map(lambda v: json.dumps(v).encode())
    broken = requests(path).map(lambda v: json.dumps(v).encode()[:-1])
    return st.one_of(
        requests(path).map(lambda v: json.dumps(v).encode()), as_json, broken, st.binary(max_size=40)
    )


def check_answer(client: httpx.Client, path: str, body: bytes) -> None:
    """The request is answered (a stream to its end) with a 2xx, or a 4xx carrying OpenAI's error object."""
    headers = {"content-type": "application/json"}
    with client.stream("POST", path, content=body, headers=headers) as response:
        data = response.read()
    assert response.status_code < 500, (response.status_code, body, data)
    if response.status_code >= 400:
        error = json.loads(data)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], data
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert data.endswith(b"\n\n") and b'"server_error"' not in data, data
    else:
        json.loads(data)


@pytest.mark.parametrize("path", sorted(CORE))
def test_every_odd_body_gets_a_2xx_or_a_4xx_error_object(served: Any, path: str) -> None:
    with httpx.Client(base_url=served.url, timeout=30) as client:

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        )
        @given(body=bodies(path))
        def answered(body: bytes) -> None:
            check_answer(client, path, body)

        answered()

"""The router's OpenAI API end to end: the official client, a real server, real sockets, a protocol peer."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import httpx
import openai
import pytest

from common.text.tokenizer import Tokenizer

EOS = 2


def client(served: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=10)


def chat_ids(tok: Tokenizer, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True)
    assert isinstance(ids, list)
    return ids


def sse_events(response: httpx.Response) -> list[Any]:
    """The decoded `data:` payloads of an SSE response ("[DONE]" kept as a string)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_chat(served: Any, tok: Tokenizer, reply: str) -> None:
    out = client(served).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], temperature=0.5, seed=3
    )
    assert out.object == "chat.completion" and out.model == "tiny"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == reply
    assert out.choices[0].finish_reason == "stop"
    prompt = chat_ids(tok, "Hi")
    completion = len(tok.encode(reply)) + 1  # the EOS token counts
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), completion)
    assert out.usage.total_tokens == len(prompt) + completion
    gen = next(g for g in served.peer.generates() if f"chatcmpl-{g.rid}" == out.id)
    assert gen.prompt_ids == prompt
    assert (gen.sampling.temperature, gen.sampling.seed) == (0.5, 3)
    assert gen.sampling.max_tokens == served.config.max_context - len(prompt)
    assert not served.peer.aborted_by(gen.rid), "a request the workers finished is not aborted"


def test_chat_stream_with_usage(served: Any, tok: Tokenizer, reply: str) -> None:
    chunks = list(
        client(served).chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(content) == reply
    assert all("\ufffd" not in piece for piece in content)
    assert len([c for c in content if c]) > 3, "the text arrives in several chunks"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(tok.encode(reply)) + 1
    assert all(c.usage is None for c in chunks[:-1])


def test_completion(served: Any, tok: Tokenizer, reply: str) -> None:
    out = client(served).completions.create(model="tiny", prompt="Once upon a time", max_tokens=5)
    ids = tok.encode(reply)[:5]
    assert out.object == "text_completion"
    assert out.choices[0].text == tok.decode(ids)
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 5
    assert out.usage.prompt_tokens == len(tok.encode("Once upon a time"))


def test_completion_stream_from_token_ids(served: Any, tok: Tokenizer, reply: str) -> None:
    prompt = tok.encode("Once upon a time")
    stream = client(served).completions.create(model="tiny", prompt=prompt, max_tokens=100, stream=True)
    chunks = list(stream)
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == reply
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_completion_without_max_tokens_stops_at_openais_default(
    served: Any, tok: Tokenizer, reply: str
) -> None:
    assert len(tok.encode(reply)) > 16
    out = client(served).completions.create(model="tiny", prompt="Once")
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"
    chat = client(served).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}])
    assert chat.choices[0].message.content == reply and chat.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_cut_inside_a_character_matches_decode(served: Any, tok: Tokenizer, reply: str, stream: bool) -> None:
    """max_tokens that ends inside a multi-byte character: the text is decode() of the tokens, once."""
    ids = tok.encode(reply)
    cut = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd"))
    out = client(served).completions.create(model="tiny", prompt="x", max_tokens=cut, stream=stream)
    chunks = list(out) if stream else [out]
    assert "".join(c.choices[0].text for c in chunks) == tok.decode(ids[:cut])


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(served: Any, reply: str, stream: bool) -> None:
    out = client(served).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        stop=["本語 and", "nowhere"],
        stream=stream,
    )
    if stream:
        chunks = list(out)
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
        rid = chunks[0].id.removeprefix("chatcmpl-")
    else:
        text, finish = out.choices[0].message.content, out.choices[0].finish_reason
        rid = out.id.removeprefix("chatcmpl-")
    assert text == reply[: reply.index("本語 and")]
    assert finish == "stop"
    assert "本" not in text, "no part of the stop string is sent"
    assert rid in {g.rid for g in served.peer.generates()}


@pytest.mark.parametrize("stop", ["Hello", "Spillway", "é,"])
def test_usage_counts_the_tokens_up_to_the_stop_string(
    served: Any, tok: Tokenizer, reply: str, stop: str
) -> None:
    """The tokens after the one that completed the stop string are not part of the completion."""
    out = client(served).completions.create(model="tiny", prompt="x", stop=stop)
    ids = tok.encode(reply)
    upto = next(n for n in range(1, len(ids) + 1) if stop in tok.decode(ids[:n]))
    assert out.choices[0].text == reply[: reply.index(stop)] and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == upto


def test_stop_string_aborts_the_workers(served: Any, wait_until: Any) -> None:
    out = client(served).completions.create(model="tiny", prompt="[slow]", stop="日本", max_tokens=200)
    assert out.choices[0].text.endswith("café, ") and out.choices[0].finish_reason == "stop"
    rid = out.id.removeprefix("cmpl-")
    wait_until(lambda: served.peer.aborted_by(rid) == {"prefill", "decode"})


def test_partial_stop_prefix_is_released(served: Any, reply: str) -> None:
    out = client(served).completions.create(model="tiny", prompt="x", stop=["café!", "done!"], max_tokens=100)
    assert out.choices[0].text == reply and out.choices[0].finish_reason == "stop"


def test_events_out_of_order_are_reordered(served: Any, reply: str) -> None:
    out = client(served).completions.create(model="tiny", prompt="[shuffle]", max_tokens=100)
    assert out.choices[0].text == reply


def test_worker_error_non_streaming_is_500(served: Any) -> None:
    with pytest.raises(openai.InternalServerError) as info:
        client(served).completions.create(model="tiny", prompt="[error]")
    assert info.value.status_code == 500
    body = info.value.response.json()
    assert body["error"]["code"] == "worker_error" and "out of KV pages" in body["error"]["message"]


def test_worker_error_before_the_first_token_streaming_is_500(served: Any) -> None:
    body = {"model": "tiny", "prompt": "[error]", "stream": True}
    response = httpx.post(f"{served.url}/v1/completions", json=body, timeout=10)
    assert response.status_code == 500
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_worker_error_mid_stream(served: Any, reply: str) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "[error-mid]"}], "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=body, timeout=10) as response:
        assert response.status_code == 200
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    assert (
        events[-2]["error"]["code"] == "worker_error" and "decode crashed" in events[-2]["error"]["message"]
    )
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2])
    assert reply.startswith(text)
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2])


def test_an_unexpected_error_mid_stream_is_an_error_event(served: Any, monkeypatch: Any) -> None:
    """A bug after the 200 went out still ends the stream with an error event and [DONE], not a cut."""
    from services.router.generation import TextGeneration

    original, calls = TextGeneration._apply, []

    def failing(self: TextGeneration, event: Any) -> Any:
        calls.append(event)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return original(self, event)

    monkeypatch.setattr(TextGeneration, "_apply", failing)
    body = {"model": "tiny", "prompt": "x", "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=10) as response:
        assert response.status_code == 200
        events = sse_events(response)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "internal_error"


def test_worker_abort_is_not_a_finish_reason(served: Any) -> None:
    body = {"model": "tiny", "prompt": "[abort]", "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=10) as response:
        events = sse_events(response)
    assert "error" in events[-2] and events[-1] == "[DONE]"
    assert all(e["choices"][0]["finish_reason"] != "abort" for e in events[:-2])


def test_models(served: Any) -> None:
    models = client(served).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert client(served).models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as info:
        client(served).models.retrieve("gpt-9")
    assert info.value.body["code"] == "model_not_found"


def test_every_response_has_a_request_id(served: Any) -> None:
    """Errors included: the id a client quotes is the one the logs and the workers know the request by."""
    ok = httpx.post(f"{served.url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    rid = ok.headers["x-request-id"]
    assert ok.json()["id"] == f"cmpl-{rid}" and rid in {g.rid for g in served.peer.generates()}
    for response in (
        httpx.post(
            f"{served.url}/v1/completions", content=b"{", headers={"content-type": "application/json"}
        ),
        httpx.post(f"{served.url}/v1/completions", json={"model": "tiny", "prompt": "[error]"}),
        httpx.get(f"{served.url}/v1/nothing"),
    ):
        assert len(response.headers["x-request-id"]) == 32 and response.headers["x-request-id"] != rid


def test_created_is_when_the_request_arrived(served: Any) -> None:
    before = int(time.time())
    out = client(served).completions.create(model="tiny", prompt="[slow]", max_tokens=60)  # ~1.2 s of tokens
    assert before <= out.created <= before + 1 and int(time.time()) >= out.created


def test_metrics(served: Any) -> None:
    client(served).completions.create(model="tiny", prompt="x", max_tokens=3)
    text = httpx.get(f"{served.url}/metrics").text
    for name in (
        "spillway:time_to_first_token_seconds_bucket",
        "spillway:inter_token_latency_seconds_bucket",
        "spillway:prompt_tokens_total",
        "spillway:generation_tokens_total",
        "spillway:requests_running",
        "spillway:requests_waiting",
    ):
        assert name in text
    generated = next(
        line for line in text.splitlines() if line.startswith("spillway:generation_tokens_total")
    )
    assert float(generated.split()[-1]) >= 3
    assert 'spillway:requests_finished_total{finish_reason="length"}' in text


def test_each_request_has_an_access_line(served: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Method, path, status, latency, tokens in and out and the request's id, once its response has ended
    (a stream's last byte); a 400 too."""
    with caplog.at_level(logging.INFO, logger="access"):
        out = client(served).chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        chunks = list(
            client(served).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True
            )
        )
        bad = httpx.post(f"{served.url}/v1/chat/completions", json={"model": "tiny"}, timeout=10)
        httpx.get(f"{served.url}/health", timeout=10)  # polled: debug, not info
        time.sleep(0.2)
    lines = [r.fields for r in caplog.records if r.name == "access"]
    assert [(f["method"], f["path"], f["status"]) for f in lines] == [
        ("POST", "/v1/chat/completions", 200), ("POST", "/v1/chat/completions", 200),
        ("POST", "/v1/chat/completions", 400),
    ]  # fmt: skip
    assert lines[0]["request_id"] == out.headers["x-request-id"] and lines[0]["prompt_tokens"] > 0
    assert lines[0]["completion_tokens"] == 4 and lines[1]["completion_tokens"] == 4 and chunks
    assert lines[2]["request_id"] == bad.headers["x-request-id"] and lines[2]["latency_ms"] >= 0

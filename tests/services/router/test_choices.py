"""`n` choices: a request of its own to the workers each (their ids `<request id>-i`, seeds the request's
+ i), one prompt's sent as one Generate with siblings where they fit a pair's lanes and the admission
limit (else each alone), read as one response, streamed and not; a choice that fails fails the request and
aborts the others; one refused at admission gives the others' slots back."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from common.text.tokenizer import Tokenizer

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}


def client(served: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=10)


def test_three_choices_share_one_prefill(served: Any, tok: Tokenizer, reply: str) -> None:
    response = httpx.post(f"{served.url}/v1/chat/completions", json={**CHAT, "n": 3, "seed": 7}, timeout=10)
    body = response.json()
    rid = response.headers["x-request-id"]
    assert body["id"] == f"chatcmpl-{rid}"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == reply and c["finish_reason"] == "stop" for c in body["choices"])
    each = len(tok.encode(reply)) + 1
    assert body["usage"]["completion_tokens"] == 3 * each
    assert body["usage"]["prompt_tokens"] == len(tok.apply_chat_template(CHAT["messages"], tokenize=True))
    (gen,) = [g for g in served.peer.generates() if g.rid.startswith(rid)]
    assert [(s.rid, s.seed) for s in gen.siblings] == [(f"{rid}-1", 8), (f"{rid}-2", 9)]
    assert (gen.rid, gen.sampling.seed) == (f"{rid}-0", 7)


@pytest.mark.parametrize("chat", [True, False])
def test_streamed_choices_carry_their_index(served: Any, reply: str, chat: bool) -> None:
    if chat:
        stream = client(served).chat.completions.create(
            **CHAT, n=2, stream=True, stream_options={"include_usage": True}, logprobs=True
        )
    else:
        stream = client(served).completions.create(
            model="tiny",
            prompt="x",
            n=2,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=0,
            max_tokens=100,
        )
    chunks = list(stream)
    texts, finishes, logprobs = {0: "", 1: ""}, {}, {0: 0, 1: 0}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += (choice.delta.content or "") if chat else choice.text
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
        if choice.logprobs:
            logprobs[choice.index] += len(choice.logprobs.content if chat else choice.logprobs.tokens)
    assert texts == {0: reply, 1: reply} and finishes == {0: "stop", 1: "stop"}
    assert logprobs[0] == logprobs[1] == chunks[-1].usage.completion_tokens // 2


def test_a_failed_choice_fails_the_request_and_aborts_the_others(served: Any, wait_until: Any) -> None:
    before = len(served.peer.choices())
    with pytest.raises(openai.InternalServerError):
        client(served).completions.create(model="tiny", prompt="[error-second] [slow]", n=3, max_tokens=200)
    rids = [rid for rid, _ in served.peer.choices()[before:]]
    assert len(rids) == 3
    for rid in (rids[0], rids[2]):
        wait_until(lambda rid=rid: served.peer.aborted_by(rid) == {"prefill", "decode"})
    wait_until(lambda: httpx.get(f"{served.url}/health", timeout=5).json()["router"]["running"] == 0)


def test_choices_past_the_queue_give_their_slots_back(serve_router: Any, wait_until: Any) -> None:
    """One slot, held; a queue of two: of three choices two wait and the third is refused, which gives the
    waiters' places back."""
    with serve_router(max_running=1, max_queue=2) as served, _slot_held(served, 20):
        response = httpx.post(f"{served.url}/v1/completions", json={"model": "tiny", "prompt": "x", "n": 3})
        assert response.status_code == 429, response.text
        wait_until(lambda: httpx.get(f"{served.url}/health", timeout=5).json()["router"]["running"] == 0)
        ok = httpx.post(
            f"{served.url}/v1/completions",
            json={"model": "tiny", "prompt": "x", "max_tokens": 100},
            timeout=10,
        )
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "stop"


def test_one_choice_keeps_the_request_id(served: Any) -> None:
    response = httpx.post(f"{served.url}/v1/chat/completions", json=CHAT, timeout=10)
    rid = response.headers["x-request-id"]
    assert any(g.rid == rid for g in served.peer.generates())
    assert [c["index"] for c in response.json()["choices"]] == [0]


def test_more_choices_than_slots_run_in_turn(serve_router: Any, reply: str) -> None:
    """Each choice frees its slot as it finishes, so the next one is admitted: no wait on itself."""
    with serve_router(max_running=1, max_queue=4) as served:
        body = {"model": "tiny", "prompt": "x", "n": 3, "stream": True, "max_tokens": 100}
        chunks = list(client(served).completions.create(**body))
        texts = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(3)]
        assert texts == [reply] * 3


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_of_prompts_numbers_its_choices_prompt_by_prompt(
    served: Any, tok: Tokenizer, reply: str, stream: bool
) -> None:
    """Two prompts, two choices each: choices 0 and 1 answer the first, 2 and 3 the second; each prompt's
    tokens count once."""
    from tests.services.router.conftest import TOOL_REPLY

    prompts = ["x", "[tool] y"]
    body = {"model": "tiny", "prompt": prompts, "n": 2, "stream": stream, "max_tokens": 400}
    if stream:
        body["stream_options"] = {"include_usage": True}
    out = client(served).completions.create(**body)
    if stream:
        chunks = list(out)
        texts = [
            "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
            for i in range(4)
        ]
        usage = chunks[-1].usage
    else:
        texts, usage = [c.text for c in sorted(out.choices, key=lambda c: c.index)], out.usage
    assert texts == [reply, reply, TOOL_REPLY, TOOL_REPLY]
    assert usage.prompt_tokens == sum(len(tok.encode(p, add_special_tokens=True)) for p in prompts)


@contextlib.contextmanager
def _slot_held(served: Any, tokens: int) -> Iterator[threading.Thread]:
    """A slow request of `tokens` tokens (20 ms each) holds a slot while the block runs (its thread)."""
    slow = {"model": "tiny", "prompt": "[slow]", "max_tokens": tokens}
    url = f"{served.url}/v1/completions"
    holder = threading.Thread(target=lambda: httpx.post(url, json=slow, timeout=20))
    holder.start()
    try:
        wait_running = time.monotonic() + 5
        while httpx.get(f"{served.url}/health", timeout=5).json()["router"]["running"] < 1:
            assert time.monotonic() < wait_running
            time.sleep(0.01)
        yield holder
    finally:
        holder.join()


def test_a_refused_choice_fails_the_request_at_once(serve_router: Any) -> None:
    """One slot, held by a request for ~3 s; a queue of two: of three choices two wait for the slot and the
    third is refused, and the 429 comes while the holder still runs, not after the first's wait."""
    with serve_router(max_running=1, max_queue=2) as served, _slot_held(served, 150) as holder:
        response = httpx.post(
            f"{served.url}/v1/completions", json={"model": "tiny", "prompt": "x", "n": 3}, timeout=10
        )
        assert response.status_code == 429, response.text
        assert holder.is_alive(), "the 429 waited for the slot"


def test_a_group_waits_for_all_its_slots_and_gives_them_back_when_refused(serve_router: Any) -> None:
    """Two slots, one held by a slow request: two choices of one prompt take the free one and wait for the
    other (sent as one Generate once both are theirs); with no queue, refused at the second, they give the
    first back."""
    for max_queue, status in [(4, 200), (0, 429)]:
        with serve_router(max_running=2, max_queue=max_queue) as served:
            with _slot_held(served, 40):
                body = {"model": "tiny", "prompt": "x", "n": 2}
                response = httpx.post(f"{served.url}/v1/completions", json=body, timeout=10)
                assert response.status_code == status, response.text
                running = httpx.get(f"{served.url}/health", timeout=5).json()["router"]["running"]
                assert running <= 1  # the holder's, if it still runs: none of the group's left
            if status == 200:
                (gen,) = [g for g in served.peer.generates() if g.siblings]
                assert len(gen.siblings) == 1


def test_two_groups_waiting_for_slots_both_run(serve_router: Any) -> None:
    """Four slots, two held: two requests of four choices each wait, each as one waiter for all four, and run
    in turn once the holders end (taken a slot at a time, each could hold some and wait for the other's)."""
    with serve_router(max_running=4, max_queue=8) as served, _slot_held(served, 10), _slot_held(served, 10):
        url, statuses = f"{served.url}/v1/completions", []
        body = {"model": "tiny", "prompt": "x", "n": 4}
        groups = [
            threading.Thread(
                target=lambda: statuses.append(httpx.post(url, json=body, timeout=10).status_code)
            )
            for _ in range(2)
        ]
        for group in groups:
            group.start()
        for group in groups:
            group.join()
        assert statuses == [200, 200]

"""Log-probabilities through the router: the official client reads OpenAI's chat and legacy shapes, streamed
and not, one entry per token the completion counts (a stop string's tail excluded), from the workers'
`Tokens.logprobs` (the peer's `peer_logprobs`)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from common.text.tokenizer import Tokenizer
from services.router.logprobs import LogprobText
from tests.services.router.conftest import EOS, peer_logprobs


def client(served: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=10)


def chat(served: Any, stream: bool, **extra: Any) -> tuple[str, list[Any], int]:
    """A chat's text, its `logprobs.content` entries and its completion tokens."""
    out = client(served).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        stream=stream,
        stream_options={"include_usage": True} if stream else None,
        **extra,
    )
    if not stream:
        lp = out.choices[0].logprobs
        return out.choices[0].message.content, (lp.content if lp else []), out.usage.completion_tokens
    chunks = list(out)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    entries = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    return text, entries, chunks[-1].usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_one_entry_a_token(served: Any, tok: Tokenizer, reply: str, stream: bool) -> None:
    text, entries, completion = chat(served, stream, logprobs=True, top_logprobs=3)
    ids = [*tok.encode(reply), EOS]
    assert text == reply and len(entries) == completion == len(ids)
    assert b"".join(bytes(e.bytes) for e in entries[:-1]) == reply.encode()
    for i, (entry, token) in enumerate(zip(entries, ids, strict=True)):
        want = peer_logprobs(i, token, 3)
        assert entry.logprob == want.logprob
        assert [t.logprob for t in entry.top_logprobs] == want.top_logprobs
        assert [bytes(t.bytes) for t in entry.top_logprobs] == [tok.token_bytes(t) for t in want.top_ids]
        assert entry.top_logprobs[0].token == entry.token
    assert [e.token for e in entries[:3]] == [tok.token_bytes(i).decode() for i in ids[:3]]


def test_chat_without_top_logprobs_and_without_logprobs(served: Any) -> None:
    _, entries, _ = chat(served, False, logprobs=True)
    assert entries and all(e.top_logprobs == [] for e in entries)
    out = client(served).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}])
    assert out.choices[0].logprobs is None


def test_a_piece_of_a_character_is_its_escaped_bytes(served: Any, tok: Tokenizer, reply: str) -> None:
    _, entries, _ = chat(served, False, logprobs=True)
    ids = tok.encode(reply)
    cut = next(i for i in ids if tok.decode([i]).endswith("\ufffd"))  # a token holding part of a character
    entry = entries[ids.index(cut)]
    assert bytes(entry.bytes) == tok.token_bytes(cut) and "\\x" in entry.token


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_stop_at_the_stop_string(
    served: Any, tok: Tokenizer, reply: str, stream: bool
) -> None:
    """The legacy shape: tokens, token_logprobs, top_logprobs (the chosen token among them) and running
    text offsets; the tokens after the one that completed the stop string are not there."""
    out = client(served).completions.create(
        model="tiny", prompt="x", stop="Spillway", logprobs=1, stream=stream
    )
    chunks = list(out) if stream else [out]
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    tokens = [t for p in parts for t in p.tokens]
    ids = tok.encode(reply)
    upto = next(n for n in range(1, len(ids) + 1) if "Spillway" in tok.decode(ids[:n]))
    assert tokens == [tok.token_bytes(i).decode() for i in ids[:upto]]
    assert [v for p in parts for v in p.token_logprobs] == [
        peer_logprobs(i, 0, 0).logprob for i in range(upto)
    ]
    offsets = [o for p in parts for o in p.text_offset]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(upto)]
    tops = [t for p in parts for t in p.top_logprobs]
    assert all(list(top) == [token] for top, token in zip(tops, tokens, strict=True))


def test_the_legacy_shape_adds_the_chosen_token_to_its_alternatives(tok: Tokenizer) -> None:
    """A sampled token outside the top k is still in `top_logprobs`, as OpenAI's legacy API reports it; the
    offsets run on from one rendered chunk to the next."""
    text = LogprobText(tok, chat=False)
    piece = {i: tok.token_bytes(i).decode() for i in (7, 8, 9, 10)}
    shape = text.render([(7, peer_logprobs(0, 9, 2)), (8, peer_logprobs(1, 8, 1))])
    assert shape["top_logprobs"] == [{piece[9]: -0.25, piece[10]: -1.25, piece[7]: -0.25}, {piece[8]: -0.5}]
    assert shape["text_offset"] == [0, len(piece[7])]
    assert text.render([(9, peer_logprobs(2, 9, 0))])["text_offset"] == [len(piece[7]) + len(piece[8])]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_puts_the_prompt_and_its_logprobs_first(
    served: Any, tok: Tokenizer, reply: str, stream: bool
) -> None:
    """echo: the prompt's text before the completion's; with logprobs, its tokens' (prefill's) before the
    completion's, the first with none, the offsets running on through both."""
    prompt = "Once upon a time"
    out = client(served).completions.create(
        model="tiny", prompt=prompt, max_tokens=3, echo=True, logprobs=2, stream=stream
    )
    chunks = list(out) if stream else [out]
    text = "".join(c.choices[0].text for c in chunks)
    ids = tok.encode(prompt, add_special_tokens=True)
    assert text == prompt + tok.decode(tok.encode(reply)[:3])
    parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    tokens = [t for p in parts for t in p.tokens]
    values = [v for p in parts for v in p.token_logprobs]
    assert tokens == [tok.token_bytes(i).decode() for i in ids + tok.encode(reply)[:3]]
    want = [None] + [peer_logprobs(100 + i, 0, 0).logprob for i in range(len(ids) - 1)]
    assert values == want + [peer_logprobs(i, 0, 0).logprob for i in range(3)]
    tops = [t for p in parts for t in p.top_logprobs]
    assert tops[0] is None and all(len(t) <= 3 for t in tops[1:])
    offsets = [o for p in parts for o in p.text_offset]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    if stream:
        assert chunks[0].choices[0].text == prompt


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_zero_scores_the_prompt_alone(served: Any, tok: Tokenizer, stream: bool) -> None:
    """echo, logprobs and max_tokens 0 (what scoring tools send): the prompt and its tokens'
    log-probabilities, no generated token (the workers' first one is not returned nor counted)."""
    prompt = "Once upon a time"
    out = client(served).completions.create(
        model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1, stream=stream
    )
    chunks = list(out) if stream else [out]
    ids = tok.encode(prompt, add_special_tokens=True)
    assert "".join(c.choices[0].text for c in chunks) == prompt
    values = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert values == [None] + [peer_logprobs(100 + i, 0, 0).logprob for i in range(len(ids) - 1)]
    assert chunks[-1].choices[0].finish_reason == "length"
    if not stream:
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 0)
    refused = httpx.post(f"{served.url}/v1/completions", json={"prompt": prompt, "max_tokens": 0}, timeout=10)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_echo_of_token_ids_is_their_text(served: Any, tok: Tokenizer, reply: str) -> None:
    out = client(served).completions.create(model="tiny", prompt=[300, 301, 302], max_tokens=2, echo=True)
    assert out.choices[0].logprobs is None
    assert out.choices[0].text == tok.decode([300, 301, 302]) + tok.decode(tok.encode(reply)[:2])

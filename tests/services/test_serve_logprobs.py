"""Log-probabilities end to end: `spillway serve` (router, prefill and decode as separate processes) reports
for each generated token what transformers' forward pass over the same tokens gives: the chosen token's
log-softmax and the best alternatives', the first token's from prefill and the rest from decode's pipelined
steps, for a greedy and a sampled request alike (the model's own distribution, before temperature)."""

from __future__ import annotations

import pytest
import torch

from common.model.synthetic import make_model

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 300, 42, 9, 77, 120, 3]
TOKENS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("q3") / "tiny", "tiny", "qwen3_moe", {"torch_dtype": "float32"})


def _reference(model, ids: list[int]) -> torch.Tensor:
    """transformers' log-probabilities [len(ids) - len(PROMPT), V] at each generated position."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + ids])).logits[0].float()  # [T, V]
    return torch.log_softmax(logits[len(PROMPT) - 1 : -1], dim=-1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_served_logprobs_are_transformers_log_softmax(start_server, model, temperature: float) -> None:
    args = ["--model", str(model), "--dtype", "float32", "--threads", "1"]
    server = start_server(*args, "--max-context", "512")
    out = server.client().completions.create(
        model=model.name, prompt=PROMPT, max_tokens=TOKENS, logprobs=3, temperature=temperature, seed=11,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == TOKENS == out.usage.completion_tokens
    ids = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    want = _reference(model, ids)  # [TOKENS, V]
    got = torch.tensor(lp.token_logprobs)
    torch.testing.assert_close(got, want[torch.arange(TOKENS), torch.tensor(ids)], atol=2e-4, rtol=0)
    best, best_ids = want.topk(3, dim=-1)
    for top, values, alternatives, token in zip(lp.top_logprobs, best, best_ids, lp.tokens, strict=True):
        want_top = {f"token_id:{i}": float(v) for i, v in zip(alternatives.tolist(), values, strict=True)}
        assert set(top) == set(want_top) | {token}
        for piece, value in want_top.items():
            assert abs(top[piece] - value) < 2e-4
    if temperature == 0:
        assert ids == best_ids[:, 0].tolist()
    stream = server.client().chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=TOKENS, stream=True,
        logprobs=True, top_logprobs=2, temperature=temperature, seed=11,
    )  # fmt: skip
    entries = [
        e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert 1 <= len(entries) <= TOKENS and all(len(e.top_logprobs) == 2 for e in entries)
    assert all(e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in entries)

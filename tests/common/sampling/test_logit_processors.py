"""LogitProcessors: logit_bias, min_tokens and the repetition, frequency and presence penalties, against
transformers' repetition processor and OpenAI's formula, with the counts kept on the device row of each
request's state slot and advanced there by `count`."""

from __future__ import annotations

import pytest
import torch

from common.kv.state import SequenceState
from common.protocol import SamplingParams
from common.sampling.logit_processors import LogitProcessors
from common.sampling.requests import Request, sample_on_device

V, EOS = 32, 2


def request(slot: int, prompt: list[int], tokens: list[int], **params) -> Request:
    sampling = SamplingParams(**params)
    return Request(prompt, sampling, sampling.seed or 0, SequenceState(slot), token_ids=list(tokens))


def test_a_batch_without_any_leaves_its_logits_alone() -> None:
    logits = torch.randn(2, V)
    procs = LogitProcessors(4, V, torch.device("cpu"), [EOS])
    reqs = [request(0, [1], [], temperature=0.7, min_p=0.1), request(1, [1], [4], min_tokens=1)]
    assert procs.apply(logits, reqs, [0, 0]) is logits


def test_penalties_equal_transformers_and_openai_over_the_counted_tokens() -> None:
    """Rows in slots 3 and 0; the second token of each reaches the counts through `count` (on the device,
    as a pipelined decode's does), the first through `admit`."""
    transformers = pytest.importorskip("transformers")
    procs = LogitProcessors(4, V, torch.device("cpu"), [EOS])
    reqs = [
        request(3, [5, 6, 5], [7], repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3),
        request(0, [9], [9], presence_penalty=-0.5),
    ]
    for r in reqs:
        procs.admit(r)
    procs.count(reqs, torch.tensor([7, 11]))
    for r, t in zip(reqs, (7, 11), strict=True):
        r.token_ids.append(t)
    logits = torch.randn(2, V) * 3
    got = procs.apply(logits, reqs, [0, 0])
    want = logits.clone()
    rep = transformers.RepetitionPenaltyLogitsProcessor(1.5)
    want[:1] = rep(torch.tensor([[5, 6, 5, 7, 7]]), want[:1].clone())
    for b, r in enumerate(reqs):
        counts = torch.bincount(torch.tensor(r.token_ids), minlength=V).float()
        want[b] -= r.params.frequency_penalty * counts + r.params.presence_penalty * (counts > 0)
    torch.testing.assert_close(got, want)
    assert got is not logits and torch.equal(procs.apply(logits, reqs, [0, 0]), got)  # logits untouched


def test_a_readmitted_row_forgets_its_last_request() -> None:
    procs = LogitProcessors(2, V, torch.device("cpu"), [EOS])
    old = request(1, [3], [4, 4, 4], frequency_penalty=1.0)
    procs.admit(old)
    new = request(1, [3], [8], frequency_penalty=1.0)
    procs.admit(new)
    logits = torch.zeros(1, V)
    out = procs.apply(logits, [new], [0])
    assert out[0, 8] == -1.0 and out[0, 4] == 0.0 and (out[0].count_nonzero() == 1)


def test_bias_and_min_tokens() -> None:
    """A -100 bias bans a token and +100 forces it; until min_tokens the end-of-sequence and stop tokens
    cannot be sampled (counting the tokens still in flight), and ignore_eos keeps EOS sampleable."""
    procs = LogitProcessors(4, V, torch.device("cpu"), [EOS])
    logits = torch.zeros(4, V)
    logits[:, EOS] = 50.0
    reqs = [
        request(0, [1], [], temperature=0, logit_bias=((EOS, -100.0), (9, 3.0))),
        request(1, [1], [], temperature=0, logit_bias=((13, 100.0),)),
        request(2, [1], [4], temperature=0, min_tokens=3, stop_token_ids=(21,)),
        request(3, [1], [4], temperature=0, min_tokens=3, ignore_eos=True, stop_token_ids=(21,)),
    ]
    out = procs.apply(logits, reqs, [0, 0, 1, 0])
    assert out[0, EOS] == -50.0 and out[0, 9] == 3.0 and out[1, 13] == 100.0
    assert out[2, EOS] == out[2, 21] == float("-inf")
    assert out[3, EOS] == 50.0 and out[3, 21] == float("-inf")
    assert sample_on_device(logits, reqs, procs, [0, 0, 1, 0]).tolist()[:2] == [9, 13]
    assert procs.apply(logits, reqs[2:3], [2])[0, EOS] == 50.0  # its third token is in flight


def test_min_p_keeps_the_tokens_near_the_best() -> None:
    """min_p 0.5: only tokens at least half as likely as the best are ever drawn."""
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.19, 0.11] + [0.0] * (V - 4)]) + 1e-9).repeat(64, 1)
    procs = LogitProcessors(64, V, torch.device("cpu"), [EOS])
    reqs = [request(0, [1], [], temperature=1.0, min_p=0.5, seed=s) for s in range(64)]
    drawn = set(sample_on_device(logits, reqs, procs).tolist())
    assert drawn == {0, 1}

"""L2 prefetches (common/kernels/l2_prefetch.py) on the GPU: the kernel runs, alone and in a recorded graph,
and changes nothing; a qwen4_exp decode with every site on, on the side stream or in the step's, issues
them and yields the tokens it yields without (recorded graphs: the side stream joins within the step)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.engine import Engine
from common.kernels import l2_prefetch
from common.model.synthetic import make_model
from common.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("bulk", [True, False])
def test_prefetch_changes_nothing_and_records(monkeypatch, bulk: bool) -> None:
    monkeypatch.setattr(l2_prefetch, "BULK", bulk)
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(2560, 6144, device="cuda", generator=g, dtype=torch.bfloat16)
    b = torch.randn(1000 * 8 + 8, device="cuda", generator=g, dtype=torch.bfloat16)  # a partial chunk
    before = a.clone(), b.clone()
    x = torch.randn(1, 6144, device="cuda", generator=g, dtype=torch.bfloat16)
    want = x @ a.T
    l2_prefetch.prefetch(a)
    l2_prefetch.prefetch(a, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        l2_prefetch.prefetch(b, a)
        got = x @ a.T
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])
    assert torch.equal(got, want)
    with pytest.raises(AssertionError, match="multiples of 16"):
        l2_prefetch.prefetch(torch.empty(7, dtype=torch.bfloat16, device="cuda"))


def test_decode_with_every_site_prefetches_and_keeps_its_tokens(tmp_path: Path, monkeypatch) -> None:
    overrides = {"indexer_n_heads": 16, "indexer_budget": 16, "indexer_compress_ratio": 4}
    path = make_model(tmp_path / "q4", preset="tiny", arch="qwen4_exp", overrides=overrides)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (9, 40)]
    issued = []
    plain = l2_prefetch.prefetch
    monkeypatch.setattr(l2_prefetch, "prefetch", lambda *t: issued.append(len(t)) or plain(*t))

    def run(sites: frozenset[str]) -> list[list[int]]:
        monkeypatch.setattr(l2_prefetch, "SITES", sites)
        engine = Engine(path, dtype=torch.bfloat16, device="cuda", max_seqs=2, cuda_graphs=True)
        return [r.token_ids for r in engine.generate(prompts, GREEDY)]

    plain_tokens = run(frozenset())
    assert not issued
    assert run(l2_prefetch.KNOWN_SITES) == plain_tokens  # beside the step, on the side stream
    monkeypatch.setattr(l2_prefetch, "SIDE", False)
    assert run(l2_prefetch.KNOWN_SITES) == plain_tokens  # in the step's stream
    assert 1 in issued and 2 in issued  # the "out" sites (one weight) and the "hc" sites (two)

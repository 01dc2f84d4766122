"""PLE's decode-step n-gram hashing kernel against `ngram_ids` over the history it continues: the same table
rows, bit for bit, and the same context after; end-of-sequence tokens anywhere in the context, and as the
new token."""

from __future__ import annotations

import pytest
import torch

from common.kernels.ngram import ngram_step
from common.model.ngram import NGramSpec, ngram_ids

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EOS = 2


@pytest.mark.parametrize(("ngram_size", "heads"), [(3, 4), (2, 3), (4, 2)])
def test_step_hashes_as_ngram_ids(ngram_size: int, heads: int) -> None:
    spec = NGramSpec.build(151_936, ngram_size, heads, 2_000_000, 64, 7, 1, EOS)
    g = torch.Generator().manual_seed(ngram_size)
    slots, lanes = 12, 9
    context = torch.randint(0, 151_936, (slots, ngram_size - 1), generator=g)
    context[torch.rand(context.shape, generator=g) < 0.3] = EOS  # cuts in every position, some lanes twice
    tokens = torch.randint(0, 151_936, (lanes,), generator=g)
    tokens[::4] = EOS
    lane_slots = torch.randperm(slots, generator=g)[:lanes]
    history = torch.cat([context[lane_slots], tokens[:, None]], dim=1)  # [B, n]
    want = ngram_ids(spec, history, 1)[:, 0]  # [B, heads]
    moved = context.clone()
    moved[lane_slots] = history[:, 1:]
    on_device = context.to(DEVICE)
    got = ngram_step(spec, on_device, tokens.to(DEVICE), lane_slots.to(DEVICE))
    assert torch.equal(got.cpu(), want)
    assert torch.equal(on_device.cpu(), moved)  # lanes' contexts shifted, the other slots untouched

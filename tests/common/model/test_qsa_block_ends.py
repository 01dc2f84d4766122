"""QSA's prefill finds the tokens that complete a compressed block from the host's lengths (no `nonzero`
on the device): the same tokens as a scan of the positions, for passes that start mid-block, end mid-block,
hold no block end, or batch several sequences."""

from __future__ import annotations

import random

import pytest
import torch

from common.kv.batch import ForwardBatch
from common.kv.state import SequenceState
from common.model.qwen4_exp.qsa import _block_ends


@pytest.mark.parametrize("seed", range(8))
def test_block_ends_match_a_scan_of_the_positions(seed: int) -> None:
    rng = random.Random(seed)
    ratio = rng.choice([1, 2, 4, 8])
    page = 16
    seqs, tokens = [], []
    for slot in range(rng.randint(1, 4)):
        cached, new = rng.randint(0, 40), rng.randint(1, 12)
        pages = list(range(slot * 4, slot * 4 + -(-(cached + new) // page)))
        seqs.append(SequenceState(slot=slot, pages=pages, num_cached=cached))
        tokens.append([5] * new)
    batch = ForwardBatch.build(seqs, tokens, page, "cpu")

    ends = _block_ends(batch, ratio, torch.device("cpu"))

    want = (batch.positions % ratio == ratio - 1).nonzero().squeeze(1)
    assert (ends.tolist() if ends is not None else []) == want.tolist()

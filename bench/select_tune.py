"""A tuning aid for QSA's decode selection (common/kernels/qsa_indexer.py `select_blocks`): µs a call of the
threshold search at each number of ways a round (qsa_indexer.SELECT_WAYS; 2 is the bisection), one query
over flashnext's blocks at a few contexts (k = 512 blocks, the indexer's budget of 2,048 tokens in blocks of
4), 50 calls a CUDA graph replay. Every setting's keys are checked against the bisection's.

    python -m bench.select_tune
"""

from __future__ import annotations

import torch

from bench.common import replay_us
from common.kernels import qsa_indexer
from common.kernels.qsa_indexer import select_blocks

CALLS, TOPK, RATIO = 50, 512, 4


def _calls(scores: torch.Tensor, positions: torch.Tensor):
    return lambda: [select_blocks(scores, positions, TOPK, RATIO) for _ in range(CALLS)]


def main() -> None:
    default = qsa_indexer.SELECT_WAYS
    for blocks in (576, 1024, 4096):
        scores = torch.rand(1, blocks, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 3
        positions = torch.tensor([blocks * RATIO - 1], device="cuda")
        want = None
        for ways in (2, 4, 8, 16, 32):
            qsa_indexer.SELECT_WAYS = ways
            got = select_blocks(scores, positions, TOPK, RATIO)
            want = got if want is None else want
            assert torch.equal(got, want), f"{ways} ways: keys differ from the bisection's"
            us = replay_us(_calls(scores, positions))
            print(f"blocks {blocks:5d} k {TOPK} ways {ways:2d}: {us / CALLS:6.2f} us a call")
    qsa_indexer.SELECT_WAYS = default


if __name__ == "__main__":
    main()

"""A tuning aid for QSA's decode selection (common/kernels/qsa_indexer.py `select_blocks`): µs a call of the
ranks (KernelConfig.select_rank, the default) and of the threshold search at each number of ways a round
(qsa_indexer.SELECT_WAYS; 2 is the bisection) and warps a program (qsa_indexer.SELECT_WARPS), one query over
flashnext's blocks at a few contexts (k = 512 blocks, the indexer's budget of 2,048 tokens in blocks of 4),
50 calls a CUDA graph replay. Every setting's keys are checked against the ranks'.

    python -m bench.select_tune
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch

from bench.common import replay_us
from common.kernels import qsa_indexer
from common.kernels.config import KERNELS, KernelConfig
from common.kernels.qsa_indexer import select_blocks

CALLS, TOPK, RATIO = 50, 512, 4


def _calls(scores: torch.Tensor, positions: torch.Tensor, kernels: KernelConfig):
    return lambda: [select_blocks(scores, positions, TOPK, RATIO, kernels) for _ in range(CALLS)]


def main() -> None:
    default = qsa_indexer.SELECT_WAYS, qsa_indexer.SELECT_WARPS
    settings = [(True, 4, 4), *((False, ways, warps) for ways, warps in itertools.product((2, 4, 8), (4, 8)))]
    for blocks in (1024, 576, 4096):
        scores = torch.rand(1, blocks, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 3
        positions = torch.tensor([blocks * RATIO - 1], device="cuda")
        want = None
        for rank, ways, warps in settings:
            qsa_indexer.SELECT_WAYS, qsa_indexer.SELECT_WARPS = ways, warps
            kernels = replace(KERNELS, select_rank=rank)
            got = select_blocks(scores, positions, TOPK, RATIO, kernels)
            want = got if want is None else want
            assert torch.equal(got, want), f"{ways} ways, {warps} warps: keys differ from the ranks'"
            us = replay_us(_calls(scores, positions, kernels))
            name = "ranks" if rank else f"search, ways {ways:2d} warps {warps}"
            print(f"blocks {blocks:5d} k {TOPK} {name}: {us / CALLS:6.2f} us a call", flush=True)
    qsa_indexer.SELECT_WAYS, qsa_indexer.SELECT_WARPS = default


if __name__ == "__main__":
    main()

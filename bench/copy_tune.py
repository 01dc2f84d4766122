"""A tuning aid for the expert copy kernel (common/kernels/expert_copy.py `copy_parts`) at flashnext's int4
expert (H 2560, I 640: 2.57 MB in six components).

GB/s of decode's miss copies as `OffloadedExperts` launches them: per layer, gate_up's components then
down's, from the GPU-mapped host store into pool rows, for a copy list of `--pairs` entries of which the
first `misses` are valid (a step's misses come first). 48 such layers, each on other experts, are replayed
from one CUDA graph, as a decode step's layers run them (without the compute between). Swept: programs a
launch (`all`: one per chunk of every pair) and words a chunk. Beside them, the copy engines' rate for the
same bytes (one cudaMemcpyAsync per component and expert, from the same pinned memory), measured here.

    python -m bench.copy_tune [--pairs 10 80] [--misses 1 2 4 16]
"""

from __future__ import annotations

import argparse

import torch

from bench.common import replay_us
from common.experts.formats import get_format
from common.experts.store import HostExpertStore
from common.kernels.expert_copy import BLOCK_WORDS, copy_parts

HIDDEN, INTER, EXPERTS, LAYERS = 2560, 640, 512, 48


def layer_lists(pairs: int, misses: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """LAYERS copy lists (src ids, dst rows, valid) [pairs]: `misses` valid entries first, distinct experts
    across layers while the store has them (host memory is read once, not from L2)."""
    gen = torch.Generator().manual_seed(misses)
    order = torch.randperm(EXPERTS, generator=gen)
    lists = []
    for layer in range(LAYERS):
        src = order.roll(-layer * misses)[:pairs]
        dst = torch.arange(pairs) + layer * pairs
        valid = torch.arange(pairs) < misses
        lists.append(tuple(t.to(device) for t in (src, dst, valid)))
    return lists


def dma_gbps(host: dict, pool: dict, lists: list, misses: int, expert_bytes: int) -> float:
    """The copy engines' rate for the same copies: a cudaMemcpyAsync per component and valid pair."""
    pairs = [(src[:misses].tolist(), dst[:misses].tolist()) for src, dst, _ in lists]

    def run() -> None:
        for src, dst in pairs:
            for e, r in zip(src, dst, strict=True):
                for name, block in host.items():
                    pool[name][r].copy_(block[e], non_blocking=True)

    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return LAYERS * misses * expert_bytes / start.elapsed_time(end) / 1e6


def kernel_us(host: dict, pool: dict, lists: list, stages: list, programs: int | None, words: int) -> float:
    """µs of LAYERS layers' copies by `copy_parts` (gate_up's components, then down's), one CUDA graph."""

    def run() -> None:
        for src, dst, valid in lists:
            for names in stages:
                assert copy_parts([(host[c], pool[c]) for c in names], src, dst, valid, programs, words)

    return replay_us(run, replays=5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, nargs="+", default=[10, 80])
    ap.add_argument("--misses", type=int, nargs="+", default=[1, 2, 4, 16])
    ap.add_argument("--programs", nargs="+", default=["all", "264", "528", "1056"])
    ap.add_argument(
        "--block-words", type=int, nargs="+", default=[BLOCK_WORDS // 2, BLOCK_WORDS, 2 * BLOCK_WORDS]
    )
    args = ap.parse_args()
    device = torch.device("cuda")
    components = get_format("int4").components(HIDDEN, INTER)
    store = HostExpertStore(1, EXPERTS, components)
    assert store.mapped, "the store must be GPU-mapped"
    store.buffer[::4093] = 7  # some bytes to check the copies by
    host = store.parts[0]
    rows = LAYERS * max(args.pairs)
    pool = {n: torch.empty((rows, *s), dtype=d, device=device) for n, (s, d) in components.items()}
    stages = [[n for n in host if n.startswith(p)] for p in ("gate_up", "down")]
    expert_bytes = sum(b[0].numel() * b.element_size() for b in host.values())
    print(f"expert {expert_bytes / 1e6:.2f} MB; {LAYERS} layers a replay")
    for pairs in args.pairs:
        for misses in (m for m in args.misses if m <= pairs):
            lists = layer_lists(pairs, misses, device)
            moved = LAYERS * misses * expert_bytes
            dma = dma_gbps(host, pool, lists, misses, expert_bytes)
            print(f"pairs {pairs:3d} misses {misses:3d}: DMA {dma:6.1f} GB/s")
            for words in args.block_words:
                for programs in args.programs:
                    n = None if programs == "all" else int(programs)
                    us = kernel_us(host, pool, lists, stages, n, words)
                    print(
                        f"    {words:5d} words, programs {programs:>5}: {us / LAYERS:7.1f} µs a layer, "
                        f"{moved / us / 1e3:6.1f} GB/s"
                    )
            src, dst, _ = lists[-1]
            for name, block in host.items():  # the copies are right
                assert torch.equal(pool[name][dst[:misses]].cpu(), block[src[:misses].cpu()])


if __name__ == "__main__":
    main()

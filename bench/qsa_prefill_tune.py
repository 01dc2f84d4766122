"""A tuning aid for QSA's sparse prefill attention (`paged_decode_attention` of
common/kernels/decode_attention.py with `selected` and `table_rows`): one kernel row per prompt token, each
reading the keys its indexer chose.

At flashnext's shape (24 query heads over 2 KV heads, head dim 256, a selection of 512 compressed blocks of 4
plus the query's own block: 2,052 positions) a chunk of 8,192 queries at the end of a 25,600-token context:
ms per call over keys per block, the loop (every block of the power-of-two bound with a branch, or the
pipelined fixed count), warps and pipelining stages. Each call reads T × 2 KV heads × 2,052 keys × 256 × 2
bytes of K and V (~34 GB at bf16, much of it from L2: a KV head's context is ~13 MB); the rate is reported
against the HBM rate measured in the run. Each setting's output is checked against the default's. In
prefill-25k (4009b49 and a349658 profiles) this kernel took ~9 ms a call, 48 calls, 0.43 s of the prompt.

    python -m bench.qsa_prefill_tune [--tokens 8192] [--context 25600]
"""

from __future__ import annotations

import argparse
import itertools

import torch

from bench.common import measure_hbm_gbps, median_ms
from common.kernels.decode_attention import paged_decode_attention

HEADS, KV_HEADS, DIM, PAGE, BLOCKS, RATIO = 24, 2, 256, 16, 512, 4


def qsa_case(tokens: int, context: int, seed: int = 0) -> dict:
    """The last `tokens` queries of one `context`-token sequence on scattered pages; each selects BLOCKS
    random complete blocks of RATIO keys before its own (as the indexer's top-k would) and its own block's
    keys up to itself; −1 pads."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-context // PAGE)
    kv = [torch.randn(pages, PAGE, KV_HEADS, DIM, device="cuda", generator=gen).bfloat16() for _ in "kv"]
    table = torch.randperm(pages, device="cuda", generator=gen)[None, :]  # [1, pages]
    pos = torch.arange(context - tokens, context, device="cuda")  # [T]
    complete = pos // RATIO  # [T] complete blocks before each query's own
    scores = torch.rand(tokens, context // RATIO, device="cuda", generator=gen)
    later = torch.arange(context // RATIO, device="cuda")[None, :] >= complete[:, None]
    scores = scores.masked_fill(later, -1)
    chosen = scores.topk(BLOCKS, dim=-1).indices  # [T, BLOCKS]
    keys = (chosen[:, :, None] * RATIO + torch.arange(RATIO, device="cuda")).flatten(1)  # [T, BLOCKS·RATIO]
    own = complete[:, None] * RATIO + torch.arange(RATIO, device="cuda")  # [T, RATIO]
    own = torch.where(own <= pos[:, None], own, -1)
    q = torch.randn(tokens, HEADS, DIM, device="cuda", generator=gen).bfloat16()
    return {
        "q": q, "k_pages": kv[0], "v_pages": kv[1], "page_table": table, "kv_lens": pos + 1,
        "scale": DIM**-0.5, "max_keys": context, "selected": torch.cat([keys, own], dim=1),
        "table_rows": torch.zeros(tokens, dtype=torch.int64, device="cuda"),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--context", type=int, default=25600)
    args = ap.parse_args()
    hbm = measure_hbm_gbps()
    case = qsa_case(args.tokens, args.context)
    width = case["selected"].shape[1]
    nbytes = args.tokens * KV_HEADS * width * DIM * 2 * 2
    ref = paged_decode_attention(**case)
    print(f"{args.tokens} queries, {width} keys each, context {args.context}: {nbytes / 1e9:.1f} GB of K, V")
    print(f"HBM {hbm:.0f} GB/s")
    results = []
    grid = itertools.product((16, 32, 64), (False, True), (4, 8), (2, 3, 4))
    for block_n, pipelined, warps, stages in grid:
        if not pipelined and stages != 2:  # the branching loop does not pipeline: stages do not apply
            continue
        setting = {"block_n": block_n, "pipelined": pipelined, "num_warps": warps, "num_stages": stages}
        out = paged_decode_attention(**case, **setting)
        err = (out.float() - ref.float()).abs().max().item()
        ms = median_ms(lambda s=setting: paged_decode_attention(**case, **s))
        results.append((ms, setting, err))
    for ms, setting, err in sorted(results, key=lambda r: r[0]):
        label = " ".join(f"{k} {v}" for k, v in setting.items())
        print(f"  {label}: {ms:7.3f} ms, {nbytes / ms / 1e6:6.0f} GB/s, max diff {err:.1e}")


if __name__ == "__main__":
    main()

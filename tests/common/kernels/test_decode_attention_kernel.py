"""Paged decode attention (one query per sequence) against the torch backend: dense and with a sparse key
selection, grouped query heads (a small group, and a production-like 12 query heads per KV head), pages
scattered, sequences of different lengths, bf16 and fp8 pages, a sliding window, several splits of the
keys and splits that see no key."""

from __future__ import annotations

import itertools

import pytest
import torch

from common.kv.backend import TorchPagedBackend, kv_specs
from common.kv.batch import ForwardBatch
from common.kv.state import StatePool

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(
    fp8: bool, heads=4, kv_heads=2, dim=32, page=4, cached=(9, 3, 14), dtype=torch.float32, seed=0, new=None
):
    """A pool whose sequences hold `cached` tokens and a pass of `new` tokens each (default one: decode)."""
    new = new or (1,) * len(cached)
    gen = torch.Generator().manual_seed(seed + int(fp8))
    specs = [kv_specs(kv_heads, dim, torch.float8_e4m3fn if fp8 else dtype)]
    num_pages = sum(-(-(c + n) // page) for c, n in zip(cached, new, strict=True)) + 4
    pool = StatePool(specs, num_pages=num_pages, page_size=page, max_seqs=len(cached), device=DEVICE)
    if fp8:
        pool.kv_scales.copy_(torch.tensor([[0.05, 0.04]]))
    layer = pool.layer(0)
    for name in ("k", "v"):
        fill = torch.randn(layer.paged[name].shape, generator=gen)
        layer.paged[name].copy_(
            fill.to(layer.paged[name].dtype) if not fp8 else (fill * 8).to(torch.float8_e4m3fn)
        )
    seqs = [pool.new_sequence() for _ in cached]
    for grown in range(1, max(c + n for c, n in zip(cached, new, strict=True)) + 1):  # pages interleave
        for seq, c, n in zip(seqs, cached, new, strict=True):
            pool.reserve(seq, min(grown, c + n))
    for seq, c in zip(seqs, cached, strict=True):
        seq.num_cached = c
    batch = ForwardBatch.build(seqs, [[i + 1] * n for i, n in enumerate(new)], page, DEVICE)
    t = sum(new)
    q = torch.randn(t, heads, dim, generator=gen).to(DEVICE, dtype)
    k = torch.randn(t, kv_heads, dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(t, kv_heads, dim, generator=gen).to(DEVICE, dtype)
    return layer, batch, q, k, v


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("mode", ["dense", "sparse", "window"])
def test_fused_decode_attention_matches_torch(fp8: bool, mode: str) -> None:
    selected = window = None
    if mode == "sparse":  # positions a query may see, −1 unused (its own position always among them)
        selected = torch.tensor([[0, 4, 5, -1, 9], [1, 3, -1, -1, -1], [2, 7, 8, 13, 14]], device=DEVICE)
    if mode == "window":
        window = 5
    outs = []
    for fused in (False, True):
        layer, batch, q, k, v = _case(fp8)
        backend = TorchPagedBackend()
        backend.fused_decode = fused
        plan = backend.plan(batch)
        outs.append(backend.forward(q, k, v, layer, plan, 0.2, window=window, selected=selected))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)


def _selection(cached: tuple[int, ...], width: int, gen: torch.Generator) -> torch.Tensor:
    """[T, width] distinct positions below the longest sequence in random order, the query's own always
    among them; −1 pads; a shorter sequence's row also lists positions past its end (to be skipped)."""
    longest = max(cached) + 1
    rows = []
    for n in cached:
        others = torch.randperm(longest, generator=gen)
        others = others[others != n][: width - 8]
        row = torch.cat([others, torch.tensor([n]), torch.full((7,), -1)])
        rows.append(row[torch.randperm(width, generator=gen)])
    return torch.stack(rows).to(DEVICE)


# bf16 dots need the GPU: Triton's interpreter (CPU) has fp32 ones only.
DTYPES = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("mode", ["dense", "sparse", "window"])
def test_grouped_heads_and_splits_match_torch(mode: str, fp8: bool, dtype: torch.dtype) -> None:
    """12 query heads per KV head (2 KV heads, as in production, a smaller head dim), a few hundred keys
    over several splits: the default split count (one block each), a few splits of several blocks, and one
    split of them all; each with the loop over every block of the bound and the pipelined one."""
    from common.kernels.decode_attention import paged_decode_attention  # Triton

    cached = (300, 37, 451)
    selected = window = None
    if mode == "sparse":
        selected = _selection(cached, 200, torch.Generator().manual_seed(7))
    if mode == "window":
        window = 100
    layer, batch, q, k, v = _case(fp8, heads=24, kv_heads=2, dim=64, page=16, cached=cached, dtype=dtype)
    backend = TorchPagedBackend()
    plan = backend.plan(batch)
    ref = backend.forward(q, k, v, layer, plan, 0.125, window=window, selected=selected)  # writes k, v too
    pages, scale = layer.paged, layer.kv_scale if fp8 else None
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for splits, pipelined in itertools.product((None, 4, 1), (False, True)):
        out = paged_decode_attention(
            q, pages["k"], pages["v"], plan.page_table, plan.k_lens, 0.125, plan.k_slots.shape[1],
            selected, scale, window, splits=splits, pipelined=pipelined,
        )  # fmt: skip
        note = f"splits={splits}, pipelined={pipelined}"
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol, msg=lambda m, n=note: f"{n}: {m}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("splits", [None, 1], ids=["merged", "one-split"])
def test_output_gate_is_applied_as_torch_applies_it(splits: int | None, dtype: torch.dtype) -> None:
    """attention · σ(gate), the gate a strided view (QSA's: the second half of each query head's
    projection): applied by the merge kernel (or, with one split, by torch after), as the backend's torch
    path applies it."""
    from common.kernels.decode_attention import paged_decode_attention  # Triton

    layer, batch, q, k, v = _case(False, 24, 2, 64, 16, cached=(300, 37, 451), dtype=dtype)
    backend = TorchPagedBackend()
    plan = backend.plan(batch)
    both = torch.randn(3, 24, 128, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    gate = both[..., 64:]  # strided: [T, H, D] in rows of 2·D
    ref = backend.forward(q, k, v, layer, plan, 0.125, gate=gate)
    pages = layer.paged
    out = paged_decode_attention(
        q, pages["k"], pages["v"], plan.page_table, plan.k_lens, 0.125, plan.k_max, splits=splits, gate=gate
    )
    plain = paged_decode_attention(
        q, pages["k"], pages["v"], plan.page_table, plan.k_lens, 0.125, plan.k_max, splits=splits
    )
    tol, ulp = (1e-4, 1e-6) if dtype == torch.float32 else (2e-2, 1e-2)  # bf16: σ's exp may round apart
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(out, plain * torch.sigmoid(gate), rtol=ulp, atol=ulp)


def test_dense_bound_past_the_lengths() -> None:
    """A launch bound far past every length (a recorded decode's static bound): splits past a sequence's end
    see no key and must not disturb the merge."""
    from common.kernels.decode_attention import paged_decode_attention  # Triton

    layer, batch, q, k, v = _case(False, heads=2, kv_heads=2, dim=16, page=4, cached=(5, 40))
    backend = TorchPagedBackend()
    plan = backend.plan(batch)
    ref = backend.forward(q, k, v, layer, plan, 0.3)
    pages = layer.paged
    out = paged_decode_attention(q, pages["k"], pages["v"], plan.page_table, plan.k_lens, 0.3, 1024)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fp8", [False, True])
def test_sparse_prefill_matches_torch(fp8: bool) -> None:
    """A prefill pass whose queries each see a selection of their own (QSA past its budget): sequences with
    and without cached tokens, each query a row of the kernel reading its sequence's page-table row,
    against the torch path that scores every key and masks the unselected."""
    cached, new = (9, 0, 14), (5, 7, 3)
    layer, batch, q, k, v = _case(fp8, heads=24, kv_heads=2, dim=32, page=4, cached=cached, new=new)
    gen = torch.Generator().manual_seed(3)
    rows = []
    for pos in batch.positions.tolist():  # earlier positions at random, the query's own, −1 pads
        earlier = torch.randperm(pos, generator=gen)[:5]
        row = torch.cat([earlier, torch.tensor([pos]), torch.full((8 - len(earlier) - 1,), -1)])
        rows.append(row[torch.randperm(8, generator=gen)])
    selected = torch.stack(rows).to(DEVICE)
    outs = []
    for fused in (False, True):
        backend = TorchPagedBackend()
        backend.fused_decode = fused
        outs.append(backend.forward(q, k, v, layer, backend.plan(batch), 0.2, selected=selected))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    from common.kernels.decode_attention import paged_decode_attention  # Triton

    plan, scale = TorchPagedBackend().plan(batch), layer.kv_scale if fp8 else None
    for block_n in (16, 64):  # the pipelined loop, as bench/qsa_prefill_tune.py runs it
        out = paged_decode_attention(
            q, layer.paged["k"], layer.paged["v"], plan.page_table, plan.positions + 1, 0.2,
            plan.k_slots.shape[1], selected, scale, table_rows=plan.seq_index, block_n=block_n,
            pipelined=True,
        )  # fmt: skip
        torch.testing.assert_close(out, outs[0], rtol=1e-4, atol=1e-4)

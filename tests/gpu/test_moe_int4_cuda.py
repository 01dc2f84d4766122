"""The int4 decode MoE kernels against dequantise-then-multiply in fp32, on random experts and routing:
repeated and ragged expert choices, one and several tokens, the tiny and the flashnext expert shapes."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from common.experts.formats import get_format
from common.kernels.config import DecodeConfig, decode_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _pool(rows: int, hidden: int, inter: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    fmt = get_format("int4")
    packed = [
        fmt.pack(
            torch.randn(2 * inter, hidden, generator=gen) * 0.05,
            torch.randn(hidden, inter, generator=gen) * 0.05,
        )
        for _ in range(rows)
    ]
    return {name: torch.stack([p[name] for p in packed]).cuda() for name in packed[0]}


def _reference(x, rows, weights, pool) -> torch.Tensor:
    gate_up, down = get_format("int4").unpack_many(
        {n: t[rows.reshape(-1)] for n, t in pool.items()}, torch.float32
    )
    t, k = rows.shape
    xs = x.float().repeat_interleave(k, dim=0)  # [T·k, H]
    h = torch.einsum("ph,pnh->pn", xs, gate_up)
    gate, up = h.chunk(2, dim=-1)
    y = torch.einsum("pi,phi->ph", F.silu(gate) * up, down)  # [T·k, H]
    return (y * weights.reshape(-1, 1).float()).view(t, k, -1).sum(1)


@pytest.mark.parametrize(
    ("hidden", "inter", "tokens", "k"), [(256, 128, 1, 4), (512, 384, 3, 8), (2560, 640, 1, 10)]
)
def test_int4_decode_matches_dequantised_reference(hidden, inter, tokens, k):
    from common.kernels.moe_int4 import moe_int4_decode

    gen = torch.Generator().manual_seed(hidden + tokens)
    pool = _pool(12, hidden, inter, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).cuda()
    rows = torch.randint(0, 12, (tokens, k), generator=gen).cuda()  # repeats across tokens: ragged use
    rows[0, :2] = 5  # the same row twice in one token too
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), -1).cuda()
    out = moe_int4_decode(x, rows, weights, pool, config=decode_config(x.shape[0]))
    want = _reference(x, rows, weights, pool)
    assert out.dtype == x.dtype and out.shape == want.shape
    assert (out.float() - want).norm() <= 1e-2 * want.norm()


@pytest.mark.parametrize(("block", "groups", "warps"), [(8, 2, 2), (32, 8, 8), (16, 1, 4)])
def test_int4_decode_tuning_knobs_keep_the_result(block, groups, warps):
    """Every setting bench/moe_int4_tune.py sweeps computes the same thing."""
    from common.kernels.moe_int4 import moe_int4_decode

    gen = torch.Generator().manual_seed(block + groups)
    pool = _pool(6, 2560, 640, gen)
    x = torch.randn(2, 2560, generator=gen).to(torch.bfloat16).cuda()
    rows = torch.randint(0, 6, (2, 10), generator=gen).cuda()
    weights = torch.softmax(torch.randn(2, 10, generator=gen), -1).cuda()
    shape = DecodeConfig(block=block, groups_per_step=groups, num_warps=warps)
    out = moe_int4_decode(x, rows, weights, pool, config=shape)
    want = _reference(x, rows, weights, pool)
    assert (out.float() - want).norm() <= 1e-2 * want.norm()


def _routed(hidden: int, inter: int, tokens: int, k: int, seed: int) -> tuple:
    """A pool of 12 random experts, x [tokens, H] bf16 and choices [tokens, k] on the GPU, and the generator
    to draw the rest from."""
    gen = torch.Generator().manual_seed(seed)
    pool = _pool(12, hidden, inter, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).cuda()
    ids = torch.randint(0, 12, (tokens, k), generator=gen).cuda()
    return pool, x, ids, gen


def _matches_and_replays(call, want: torch.Tensor, replays: int = 1) -> None:
    """call() is within 1 % of `want`; recorded in a CUDA graph, each of `replays` replays gives the same
    output bit for bit."""
    out = call()
    assert (out.float() - want).norm() <= 1e-2 * want.norm()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recorded = call()
    for _ in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(recorded, out)


@pytest.mark.parametrize(
    ("hidden", "inter", "tokens", "k"), [(256, 128, 1, 4), (512, 384, 3, 8), (2560, 640, 1, 10)]
)
@pytest.mark.parametrize("rows_per_warp", [1, 2, 4])
@pytest.mark.parametrize("layout", [{"words": True}, {"split_act": True}, {}])
def test_native_gate_up_matches_dequantised_reference(hidden, inter, tokens, k, rows_per_warp, layout):
    """The CUDA C gate_up (DecodeConfig.native_rows), its activations in down's words layout, split or in
    order, the pool rows looked up through row_of; recorded in a CUDA graph (its programmatic launch) and
    replayed."""
    from common.kernels import moe_int4_native
    from common.kernels.moe_int4 import moe_int4_decode

    pool, x, ids, gen = _routed(hidden, inter, tokens, k, hidden + rows_per_warp)
    row_of = torch.randperm(12, generator=gen).cuda()  # expert id → pool row
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), -1).cuda()
    assert moe_int4_native.available(x, hidden, inter, rows_per_warp, 4), "the CUDA kernel did not build"
    shape = DecodeConfig(block=8, native_rows=rows_per_warp, native_warps=4, **layout)
    want = _reference(x, row_of[ids], weights, pool)
    _matches_and_replays(partial(moe_int4_decode, x, ids, weights, pool, config=shape, row_of=row_of), want)


@pytest.mark.parametrize(
    ("hidden", "inter", "tokens", "k"), [(256, 128, 1, 4), (512, 384, 3, 8), (2560, 640, 1, 10)]
)
@pytest.mark.parametrize("warps", [2, 4])
@pytest.mark.parametrize("gated", [True, False])
def test_native_down_matches_dequantised_reference(hidden, inter, tokens, k, warps, gated):
    """The CUDA C down (DecodeConfig.native_down_warps) after the CUDA gate_up: one token folds its choices
    and the shared expert (gated or not) in the kernel, three leave them to the combine kernel; recorded in a
    CUDA graph and replayed, twice (the arrival counters left at zero)."""
    from common.kernels import moe_int4_native
    from common.kernels.moe_int4 import moe_int4_decode

    pool, x, ids, gen = _routed(hidden, inter, tokens, k, hidden + warps + gated)
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), -1).cuda()
    shared = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).cuda()
    gate = torch.randn(tokens, 1, generator=gen).to(torch.bfloat16).cuda() if gated else None
    assert moe_int4_native.down_available(x, inter, warps, gate), "the CUDA kernel did not build"
    shape = DecodeConfig(block=8, words=True, native_rows=1, native_warps=4, native_down_warps=warps)
    scale = torch.sigmoid(gate.float()) if gated else 1.0
    want = _reference(x, ids, weights, pool) + shared.float() * scale
    call = partial(moe_int4_decode, x, ids, weights, pool, config=shape, shared=shared, shared_gate=gate)
    _matches_and_replays(call, want, replays=2)


@pytest.mark.parametrize(
    ("hidden", "inter", "tokens", "k"), [(256, 128, 1, 4), (512, 384, 3, 8), (2560, 640, 1, 10)]
)
@pytest.mark.parametrize("layout", [{"words": True}, {"split_act": True}, {}])
def test_native_mma_gate_up_matches_dequantised_reference(hidden, inter, tokens, k, layout):
    """The CUDA C tensor-core gate_up (DecodeConfig.native_mma): groups split over a block's four warps
    (none for some warps at 256 inputs), row_of lookup, every activation layout; recorded and replayed."""
    from common.kernels import moe_int4_native
    from common.kernels.moe_int4 import moe_int4_decode

    pool, x, ids, gen = _routed(hidden, inter, tokens, k, hidden + inter)
    row_of = torch.randperm(12, generator=gen).cuda()
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), -1).cuda()
    assert moe_int4_native.mma_available(x, hidden, inter), "the CUDA kernel did not build"
    shape = DecodeConfig(block=8, native_rows=2, native_mma=True, **layout)
    want = _reference(x, row_of[ids], weights, pool)
    _matches_and_replays(partial(moe_int4_decode, x, ids, weights, pool, config=shape, row_of=row_of), want)


@pytest.mark.parametrize(
    ("hidden", "inter", "tokens", "k"), [(256, 128, 1, 4), (512, 384, 3, 8), (2560, 640, 1, 10)]
)
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("gate_up_mma", [True, False])
def test_native_mma_down_matches_dequantised_reference(hidden, inter, tokens, k, gated, gate_up_mma):
    """The CUDA C tensor-core down (DecodeConfig.native_down_mma) after either CUDA gate_up, which hands it
    the activations in bf16: the fold of one token's choices and the shared expert, the combine kernel at
    three tokens, row_of lookup; recorded and replayed twice (the arrival counters left at zero)."""
    from common.kernels import moe_int4_native
    from common.kernels.moe_int4 import moe_int4_decode

    pool, x, ids, gen = _routed(hidden, inter, tokens, k, hidden + inter + gated)
    row_of = torch.randperm(12, generator=gen).cuda()
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), -1).cuda()
    shared = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).cuda()
    gate = torch.randn(tokens, 1, generator=gen).to(torch.bfloat16).cuda() if gated else None
    assert moe_int4_native.down_mma_available(x, inter, gate), "the CUDA kernel did not build"
    shape = DecodeConfig(block=8, words=True, native_rows=2, native_warps=2, native_mma=gate_up_mma)
    shape = replace(shape, native_down_warps=4, native_down_mma=True)
    knobs = {"config": shape, "row_of": row_of}
    scale = torch.sigmoid(gate.float()) if gated else 1.0
    want = _reference(x, row_of[ids], weights, pool) + shared.float() * scale
    call = partial(moe_int4_decode, x, ids, weights, pool, shared=shared, shared_gate=gate, **knobs)
    _matches_and_replays(call, want, replays=2)

"""The int4 decode MoE kernels (common/kernels/moe_int4.py) in Triton's interpreter (compiled on CUDA)
against dequantise-then-multiply, at each tuning setting bench/moe_int4_tune.py sweeps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.experts.formats import get_format
from common.kernels.config import RESIDENT_CONFIGS, DecodeConfig, decode_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _two_token_case(
    gen: torch.Generator, experts: int, k: int = 2, hidden: int = 256, inter: int = 128
) -> tuple:
    """A pool of `experts` random int4 experts, two tokens' x and their routing weights over k choices."""
    fmt = get_format("int4")
    packed = [
        fmt.pack(
            torch.randn(2 * inter, hidden, generator=gen) * 0.05,
            torch.randn(hidden, inter, generator=gen) * 0.05,
        )
        for _ in range(experts)
    ]
    pool = {name: torch.stack([e[name] for e in packed]).to(DEVICE) for name in packed[0]}
    x = torch.randn(2, hidden, generator=gen).to(DEVICE)
    return pool, x, torch.softmax(torch.randn(2, k, generator=gen), -1).to(DEVICE)


@pytest.mark.parametrize(
    ("block", "groups", "warps", "down_block", "split", "magic", "words", "stages"),
    [
        (16, 4, 4, None, False, False, False, 1),
        (8, 1, 2, None, True, False, False, 1),
        (32, 2, 8, 64, True, False, False, 1),
        (4, 32, 4, 32, False, False, False, 1),
        (8, 1, 2, None, False, True, False, 1),
        (16, 4, 4, 64, True, True, False, 1),
        (8, 4, 4, None, False, False, True, 1),
        (16, 1, 2, 64, False, False, True, 1),
        (8, 1, 4, None, True, False, False, 3),
        (8, 1, 4, 32, False, False, True, 2),
    ],
)
def test_int4_decode_matches_the_dequantised_reference(
    block: int,
    groups: int,
    warps: int,
    down_block: int | None,
    split: bool,
    magic: bool,
    words: bool,
    stages: int,
) -> None:
    """Several loop steps and a last one past the groups (hidden 256 at one group a step or two; 32 a step:
    clamped to each kernel's groups); down's own block; the activations stored split (inter 256: two groups
    of evens-then-odds); codes made floats through the mantissa; codes read as words (inter 384 at four
    groups a step: down's one step part past its groups); the loop software-pipelined."""
    from common.kernels.moe_int4 import moe_int4_decode

    fmt = get_format("int4")
    gen = torch.Generator().manual_seed(block)
    inter = 384 if words and groups == 4 else 256 if split else 128
    pool, x, weights = _two_token_case(gen, experts=5, k=3, inter=inter)
    rows = torch.tensor([[1, 3, 3], [0, 4, 2]], device=DEVICE)  # a row twice in one token
    knobs = {"groups_per_step": groups, "num_warps": warps, "down_block": down_block, "split_act": split}
    knobs |= {"magic": magic, "words": words, "stages": stages}
    out = moe_int4_decode(x, rows, weights, pool, config=DecodeConfig(block=block, **knobs))
    gate_up, down = fmt.unpack_many({n: t[rows.reshape(-1)] for n, t in pool.items()}, torch.float32)
    h = torch.einsum("ph,pnh->pn", x.float().repeat_interleave(3, dim=0), gate_up)
    gate, up = h.chunk(2, dim=-1)
    y = torch.einsum("pi,phi->ph", F.silu(gate) * up, down) * weights.reshape(-1, 1)
    torch.testing.assert_close(out.float(), y.view(2, 3, -1).sum(1), rtol=1e-4, atol=1e-4)
    if split:  # the interleaved store's sums: bit for bit in the interpreter; compiled, the two layouts'
        # code may contract and reduce apart (seen on the H200 with `magic`), so to fp32 rounding
        plain = {"groups_per_step": groups, "num_warps": warps, "down_block": down_block, "split_act": False}
        plain["magic"] = magic
        interleaved = moe_int4_decode(x, rows, weights, pool, config=DecodeConfig(block=block, **plain))
        torch.testing.assert_close(out, interleaved, rtol=1e-5, atol=1e-6)
        assert DEVICE == "cuda" or torch.equal(out, interleaved)


@pytest.mark.parametrize("words", [False, True])
def test_int4_decode_takes_downs_own_shape(words: bool) -> None:
    """down's own groups a step and warps (gate_up's left as they are): the result of the shared shape, to
    fp32 rounding (the groups are summed in another order)."""
    from common.kernels.moe_int4 import moe_int4_decode

    gen = torch.Generator().manual_seed(5)
    pool, x, weights = _two_token_case(gen, experts=4, inter=384)  # down: 3 groups
    rows = torch.tensor([[0, 2], [3, 1]], device=DEVICE)
    shape = {"block": 8, "groups_per_step": 4, "num_warps": 4, "words": words}
    want = moe_int4_decode(x, rows, weights, pool, config=DecodeConfig(**shape))
    own = DecodeConfig(**shape, down_block=32, down_groups_per_step=1, down_warps=2)
    got = moe_int4_decode(x, rows, weights, pool, config=own)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_int4_decode_takes_a_shape_table() -> None:
    """`decode_config` picks the shape from a table: one token through RESIDENT_CONFIGS (codes as words,
    down's own shape) gives DECODE_CONFIGS' result to fp32 rounding."""
    from common.kernels.moe_int4 import moe_int4_decode

    assert decode_config(1, RESIDENT_CONFIGS).words and not decode_config(1).words
    gen = torch.Generator().manual_seed(9)
    pool, x, weights = _two_token_case(gen, experts=4, inter=384)
    rows = torch.tensor([[0, 2]], device=DEVICE)
    resident = decode_config(1, RESIDENT_CONFIGS)
    want = moe_int4_decode(x[:1], rows, weights[:1], pool, config=decode_config(1))
    got = moe_int4_decode(x[:1], rows, weights[:1], pool, config=resident)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    settled = moe_int4_decode(x[:1], rows, weights[:1], pool, config=resident, settled=True)
    torch.testing.assert_close(settled, got, rtol=0, atol=0)  # rows read before the wait: the same product


def test_int4_decode_waits_before_each_matrix() -> None:
    """Rows still being copied (garbage until each wait writes them, matrix by matrix) are read only after
    their wait: `before_gate_up` runs before gate_up's kernel and `before_down` before down's, and the
    result is the one with the rows in place from the start, bit for bit."""
    from common.kernels.moe_int4 import moe_int4_decode

    gen = torch.Generator().manual_seed(7)
    pool, x, weights = _two_token_case(gen, experts=4)
    rows = torch.tensor([[0, 2], [3, 1]], device=DEVICE)
    want = moe_int4_decode(x, rows, weights, pool, config=decode_config(2))
    moving = [2, 3]  # pool rows "copied" this step
    arriving = {name: t[moving].clone() for name, t in pool.items()}
    for t in pool.values():
        t[moving] = torch.randint(0, 200, t[moving].shape, generator=gen).to(t.dtype).to(DEVICE)
    calls = []

    def arrive(prefix: str) -> None:
        calls.append(prefix)
        for name, t in pool.items():
            if name.startswith(prefix):
                t[moving] = arriving[name]

    got = moe_int4_decode(
        x,
        rows,
        weights,
        pool,
        config=decode_config(2),
        before_gate_up=lambda: arrive("gate_up"),
        before_down=lambda: arrive("down"),
    )
    assert calls == ["gate_up", "down"]
    assert torch.equal(got, want)


@pytest.mark.parametrize("gated", [False, True])
def test_int4_decode_adds_the_shared_expert(gated: bool) -> None:
    """`shared` (gated by σ of a strided [T, 1] logit, as the fused projection hands it over) is added where
    the choices are summed: the result of adding it in torch after the kernel, to fp32 rounding."""
    from common.kernels.moe_int4 import moe_int4_decode

    gen = torch.Generator().manual_seed(11)
    pool, x, weights = _two_token_case(gen, experts=3)
    rows = torch.tensor([[0, 2], [1, 0]], device=DEVICE)
    shared = torch.randn(*x.shape, generator=gen).to(DEVICE)
    fused_out = torch.randn(2, 5, generator=gen).to(DEVICE)  # the logit is column 3 of a wider output
    gate = fused_out[:, 3:4] if gated else None
    config = decode_config(2)
    want = moe_int4_decode(x, rows, weights, pool, config=config)
    want = want + (torch.sigmoid(gate) * shared if gated else shared)
    got = moe_int4_decode(x, rows, weights, pool, config=config, shared=shared, shared_gate=gate)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_int4_decode_looks_up_the_rows_of_expert_ids() -> None:
    """With `row_of` the kernels take expert ids, read row_of[id]: the gathered rows' result, bit for bit."""
    from common.kernels.moe_int4 import moe_int4_decode

    gen = torch.Generator().manual_seed(3)
    pool, x, weights = _two_token_case(gen, experts=6, k=3)
    row_of = torch.tensor([4, 0, 5, 1, 3, 2], device=DEVICE)  # expert → pool row
    ids = torch.tensor([[2, 0, 5], [1, 4, 2]], device=DEVICE)
    want = moe_int4_decode(x, row_of[ids], weights, pool, config=decode_config(2))
    assert torch.equal(moe_int4_decode(x, ids, weights, pool, config=decode_config(2), row_of=row_of), want)

"""The grouped int4 prefill kernels against dequantise-then-multiply: pair grouping with padding and unused
blocks, experts used by many tokens, by one, by none; and a model whose int4 experts are offloaded,
prefilled through the kernels, against the same model through the torch path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.experts.formats import get_format
from common.model.fused_kernels import use_fused_kernels
from common.model.synthetic.checkpoint import make_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter has no bf16 matmul: fp32 without CUDA; bf16 on the GPU, as prefill runs
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
TOLERANCE = 2e-2 if DEVICE == "cuda" else 1e-5


def _pool(rows: int, hidden: int, inter: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    fmt = get_format("int4")
    weight = lambda *shape: torch.randn(*shape, generator=gen) * 0.05
    packed = [fmt.pack(weight(2 * inter, hidden), weight(hidden, inter)) for _ in range(rows)]
    return {name: torch.stack([p[name] for p in packed]).to(DEVICE) for name in packed[0]}


def _assert_matches_dequantised(out, x, ids, weights, rows, pool) -> None:
    """out [T, H] against each chosen expert dequantised to fp32 and applied to x, weighted, summed."""
    tokens, k = ids.shape
    chosen = {n: t[rows[ids.reshape(-1).to(DEVICE)]].cpu() for n, t in pool.items()}
    gate_up, down = get_format("int4").unpack_many(chosen, torch.float32)
    h = torch.einsum("ph,pnh->pn", x.to(DTYPE).float().repeat_interleave(k, 0), gate_up)
    gate, up = h.chunk(2, dim=-1)
    want = (torch.einsum("pi,phi->ph", F.silu(gate) * up, down) * weights.reshape(-1, 1)).view(tokens, k, -1)
    assert (out.float().cpu() - want.sum(1)).norm() <= TOLERANCE * want.sum(1).norm()


def test_grouped_pairs_cover_every_pair_once() -> None:
    from common.kernels.moe_int4_grouped import group_pairs

    ids = torch.tensor([[3, 0], [3, 1], [3, 0], [2, 3]])
    pairs, block_expert = group_pairs(ids, num_experts=5, block=2)
    assert block_expert.numel() == 8  # at most a block a pair: fewer than ⌈8 / 2⌉ + 5
    used = pairs[pairs >= 0]
    assert sorted(used.tolist()) == list(range(8))
    for b, expert in enumerate(block_expert.tolist()):
        chosen = pairs[2 * b : 2 * b + 2]
        assert all(ids.reshape(-1)[p] == expert for p in chosen[chosen >= 0].tolist())
        assert expert >= 0 or (chosen < 0).all()


@pytest.mark.parametrize(
    ("hidden", "inter", "tokens", "k", "shape", "down_tokens"),
    [
        (256, 128, 37, 4, (16, 64, 4, 1), 64),
        (384, 256, 5, 2, (16, 64, 4, 1), 64),
        (256, 128, 37, 4, (64, 128, 8, 3), 64),
        (256, 128, 37, 4, (16, 64, 4, 1), 8),
        (256, 128, 37, 4, (16, 64, 4, 1), 16),
    ],
)
def test_grouped_int4_matches_dequantised_reference(
    hidden: int, inter: int, tokens: int, k: int, shape: tuple[int, int, int, int], down_tokens: int
) -> None:
    """Blocks of 16 pairs, (the tuning sweep's larger end) 64 pairs × 128 columns, 8 warps, 3 stages, and
    down in slices of at most 8 tokens (8, 8, 8, 8, 5) or 16 (equal ones: 13, 13, 11)."""
    from common.kernels.moe_int4_grouped import GroupedConfig, moe_int4_grouped

    gen = torch.Generator().manual_seed(tokens)
    experts = 9
    pool = _pool(12, hidden, inter, gen)
    rows = torch.randperm(12, generator=gen)[:experts].to(DEVICE)  # expert e at pool row rows[e]
    ids = torch.stack([torch.randperm(experts - 1, generator=gen)[:k] for _ in range(tokens)])  # 8 unused
    ids[: tokens // 2, 0] = 0  # a hot expert
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), -1)
    x = torch.randn(tokens, hidden, generator=gen)
    config = GroupedConfig(*shape)
    on = x.to(DEVICE, DTYPE), ids.to(DEVICE), weights.to(DEVICE)
    out = moe_int4_grouped(*on, rows, pool, config, down_tokens)

    _assert_matches_dequantised(out, x, ids, weights, rows, pool)


def test_offloaded_int4_prefill_through_the_kernels(tmp_path: Path) -> None:
    shape = {"hidden_size": 128, "moe_intermediate_size": 128, "intermediate_size": 256}
    path = make_model(tmp_path / "m", preset="tiny", arch="qwen3_moe", overrides=shape)
    prompt = torch.randint(3, 1000, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = []
    for fused in (False, True):
        engine = Engine(
            WorkerConfig(
                str(path),
                dtype=str(DTYPE).removeprefix("torch."),
                device=DEVICE,
                max_running=1,
                expert_cache="0.5",
                expert_format="int4",
                cuda_graphs=False,
            )
        )
        use_fused_kernels(engine.model, fused)
        assert engine.offload.fused_int4_prefill == fused
        logits.append(engine.runner.forward([engine.runner.new_sequence()], [prompt]).float())
    # bf16 on the GPU: the two paths round in different orders through every layer, so the logits agree as
    # a whole (relative norm), not each within 2e-2 (37 of 1,024 were up to 0.06 apart on the H200)
    assert (logits[1] - logits[0]).norm() <= TOLERANCE * logits[0].norm()

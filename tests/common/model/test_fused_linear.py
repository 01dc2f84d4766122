"""Fused same-input projections: the same products as the separate Linears, the Linears' weights become views
of the fused weight (no byte held twice), weights already back to back are viewed rather than copied, and a
whole model with its projections fused gives the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.model.fused_linear import fuse_linears, fuse_projections, project
from common.model.synthetic.checkpoint import make_model


def _linears(bias: bool) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(16, n, bias=bias) for n in (8, 3, 5)]


@pytest.mark.parametrize("bias", [False, True])
def test_fused_products_and_views(bias: bool) -> None:
    linears = _linears(bias)
    x = torch.randn(4, 16)
    separate = [linear(x) for linear in linears]
    before = {name: t.clone() for linear in linears for name, t in linear.state_dict().items()}
    fused = fuse_linears(linears)
    assert fused is not None and fused.weight.shape == (16, 16)
    for got, want in zip(project(x, linears, fused), separate, strict=True):
        torch.testing.assert_close(got, want)
    for linear, got in zip(linears, project(x, linears, None), strict=True):  # each Linear still works
        torch.testing.assert_close(got, linear(x))
    start = fused.weight.data_ptr()
    for linear in linears:  # the Linears' weights are rows of the fused weight
        assert linear.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()
        assert start <= linear.weight.data_ptr() < start + fused.weight.nbytes
    after = {name: t for linear in linears for name, t in linear.state_dict().items()}
    assert all(torch.equal(after[n], before[n]) for n in before)


def test_adjacent_weights_are_viewed_not_copied() -> None:
    linears = _linears(False)
    fused = fuse_linears(linears)
    # a process that maps the fused weights sees each Linear's rows as its own tensor, back to back
    mapped = [nn.Linear(16, linear.out_features, bias=False) for linear in linears]
    for m, linear in zip(mapped, linears, strict=True):
        m.weight = nn.Parameter(linear.weight.detach(), requires_grad=False)
    again = fuse_linears(mapped, copy=False)
    assert again is not None and again.weight.data_ptr() == fused.weight.data_ptr()
    assert fuse_linears(_linears(False), copy=False) is None  # separate allocations: not without a copy


@pytest.mark.parametrize(("dtype", "pad"), [(torch.bfloat16, 7), (torch.float32, 3)])
def test_fused_outputs_are_padded_to_aligned_rows(dtype: torch.dtype, pad: int) -> None:
    """17 output columns get the rows up to a 16-byte output row (24 in bf16, 20 in fp32), whose outputs
    are dropped; a process that maps the padded weight views its padding too."""
    linears = [*_linears(True), nn.Linear(16, 1)]
    for linear in linears:
        linear.to(dtype)
    x = torch.randn(4, 16, dtype=dtype)
    separate = [linear(x) for linear in linears]
    fused = fuse_linears(linears)
    assert fused is not None and fused.pad == pad
    assert fused.weight.shape[0] == 17 + fused.pad and fused.bias.shape[0] == 17 + fused.pad
    for got, want in zip(project(x, linears, fused), separate, strict=True):
        torch.testing.assert_close(got, want)
    mapped = [nn.Linear(16, linear.out_features, dtype=dtype) for linear in linears]
    for m, linear in zip(mapped, linears, strict=True):
        m.weight = nn.Parameter(linear.weight.detach(), requires_grad=False)
        m.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
    again = fuse_linears(mapped, copy=False)
    assert again is not None and again.pad == fused.pad and again.weight.data_ptr() == fused.weight.data_ptr()


def test_mismatched_linears_are_not_fused() -> None:
    assert fuse_linears([nn.Linear(16, 4, bias=False), nn.Linear(8, 4, bias=False)]) is None
    assert fuse_linears([nn.Linear(16, 4, bias=False), nn.Linear(16, 4, bias=True)]) is None


@pytest.mark.parametrize("arch", ["qwen4_exp", "qwen2_moe"])
def test_a_model_with_fused_projections_gives_the_same_logits(tmp_path: Path, arch: str) -> None:
    path = make_model(tmp_path / "m", preset="tiny", arch=arch)
    engine = Engine(WorkerConfig(str(path), device="cpu", max_running=1, fused_kernels=False))
    prompt = torch.randint(3, 1000, (9,), generator=torch.Generator().manual_seed(0)).tolist()

    def logits() -> torch.Tensor:
        seq = engine.runner.new_sequence()
        out = [engine.runner.forward([seq], [prompt])]
        for _ in range(3):
            out.append(engine.runner.forward([seq], [[int(out[-1].argmax(-1))]]))
        engine.runner.release(seq)
        return torch.cat(out)

    reference = logits()
    weights = sum(p.numel() for p in engine.model.parameters())
    fused = fuse_projections(engine.model)
    groups = len(engine.config.moe_layers)  # each MoE block: its shared expert's inputs with the router
    if arch == "qwen4_exp":
        groups += 3 * len(engine.model.model.layers)  # the token mixer's inputs, two hyper-connections
        groups += len(engine.config.ple_layer_ids)  # each PLE layer's key and value
    assert fused == groups
    assert sum(p.numel() for p in engine.model.parameters()) == weights
    torch.testing.assert_close(logits(), reference, rtol=1e-5, atol=1e-5)


def test_loading_fused_allocates_each_weight_once(tmp_path: Path) -> None:
    """Fused at load (the engine's way): the fused weights are allocated before the checkpoint fills them,
    so the model's storages hold exactly its parameters' bytes (and the fused weights' alignment rows), and
    it computes what the unfused one does."""
    from common.model.loader import load_model
    from common.model.qwen4_exp.gdn import GatedDeltaNet

    path = make_model(tmp_path / "m", preset="tiny", arch="qwen4_exp")
    plain, fused = (load_model(path, dtype=torch.float32, fuse=f) for f in (False, True))
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in fused.parameters()}
    groups = [m.fused_in for m in fused.modules() if getattr(m, "fused_in", None) is not None]
    padding = sum(g.pad * g.weight[0].nbytes for g in groups)
    assert sum(storages.values()) == sum(p.nbytes for p in fused.parameters()) + padding
    gdn = next(m for m in fused.modules() if isinstance(m, GatedDeltaNet))
    assert gdn.fused_in is not None and gdn.fused_in.weight.data_ptr() == gdn.in_proj_qkv.weight.data_ptr()
    for (name, a), b in zip(plain.state_dict().items(), fused.state_dict().values(), strict=True):
        assert torch.equal(a, b), name

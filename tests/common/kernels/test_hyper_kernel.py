"""The hyper-connection kernels (common/kernels/hyper.py) against the torch they replace."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from common.kernels.config import KERNELS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize(("rank", "split"), [(20, False), (20, True), (16, True)])
def test_mix_up_matches_gemv_then_mix(rows: int, rank: int, split: bool, monkeypatch) -> None:
    """hc_mix_up (the mix-up GEMV inside the mix) against silu(down / hc) → Linear → hc_mix's torch form,
    down read as a strided view (a fused projection's first columns), hidden and a rank not powers of two,
    the rank in one padded tile or in two (MIX_UP_SPLIT_RANK: 20 as 16 + 4; 16 as one)."""
    from common.kernels.hyper import hc_mix_up

    kernels = replace(KERNELS, mix_up_split_rank=split)
    gen = torch.Generator().manual_seed(rows)
    hc, hidden = 4, 40  # 40 columns: a masked tail of 16-column blocks
    fused = torch.randn(rows, rank + 4, generator=gen)
    down = fused[:, :rank]
    weight = torch.randn(hc * hidden, rank, generator=gen) * 0.3
    normed = torch.randn(rows, hc * hidden, generator=gen)
    up = F.linear(F.silu(down / hc), weight)  # [T, hc·H]
    gate = torch.sigmoid(up).unflatten(-1, (hc, hidden))
    want = (gate * normed.unflatten(-1, (hc, hidden))).mean(dim=-2)
    got = hc_mix_up(
        fused.to(DEVICE)[:, :rank], weight.to(DEVICE), normed.to(DEVICE), hc, block=16, kernels=kernels
    )
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_pow2_tiles() -> None:
    """A kernel's tiles over n: one padded tile, or (split) n's largest power of two and the rest's."""
    from common.kernels.hyper import pow2_tiles

    assert pow2_tiles(320, False) == (512, 0)
    tiles = {n: pow2_tiles(n, True) for n in (2560, 320, 300, 256, 20, 1)}
    assert tiles == {2560: (2048, 512), 320: (256, 64), 300: (256, 64), 256: (256, 0), 20: (16, 4), 1: (1, 0)}


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("split", [False, True])
def test_project_and_mix_up_from_raw_streams(rows: int, split: bool, monkeypatch) -> None:
    """hc_project (the norm applied as the streams are read, then the GEMV) against hc_norm's torch form and
    a Linear; hc_mix_up normalising the raw streams with its scales against the same on the normalised
    streams. Widths not multiples of the blocks; the rank in one tile or two (MIX_UP_SPLIT_RANK)."""
    from common.kernels.hyper import hc_mix_up, hc_project
    from common.model.qwen4_exp.norms import OffsetRMSNorm

    kernels = replace(KERNELS, mix_up_split_rank=split)
    gen = torch.Generator().manual_seed(5 + rows)
    hc, hidden, rank, n_out = 4, 40, 20, 27
    norm = OffsetRMSNorm(hc * hidden, 1e-6, group=hidden)
    norm.weight.data = torch.randn(hc * hidden, generator=gen) * 0.2
    streams = torch.randn(rows, hc * hidden, generator=gen) * 3
    weight = torch.randn(n_out, hc * hidden, generator=gen) * 0.1
    up = torch.randn(hc * hidden, rank, generator=gen) * 0.3
    normed = norm(streams)
    on = {
        name: t.to(DEVICE)
        for name, t in (("s", streams), ("nw", norm.weight.data), ("w", weight), ("up", up))
    }
    parts, scales, same = hc_project(on["s"], on["nw"], norm.eps, on["w"], hc, block_n=4)
    assert same is on["s"]  # no injection: the streams given
    assert parts.shape == (hc, rows, n_out)  # one partial product a stream
    got = parts.sum(0)
    torch.testing.assert_close(got.cpu(), F.linear(normed, weight), rtol=1e-5, atol=1e-5)
    want_scales = torch.rsqrt(streams.unflatten(-1, (hc, hidden)).pow(2).mean(-1) + norm.eps)
    torch.testing.assert_close(scales.cpu(), want_scales, rtol=1e-5, atol=1e-6)
    want = hc_mix_up(got[:, :rank], on["up"], normed.to(DEVICE), hc, kernels=kernels).cpu()
    # the partials summed as they are read
    mixed = hc_mix_up(
        parts[..., :rank], on["up"], on["s"], hc, scales=scales, norm_weight=on["nw"], kernels=kernels
    )
    torch.testing.assert_close(mixed.cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("parts", [0, 4])
def test_inject_from_a_view_or_partial_products(parts: int) -> None:
    """hc_inject against its torch form, the logits read as a fused product's strided last columns (0) or
    as hc_project's partial products [P, T, hc], summed in the kernel."""
    from common.kernels.hyper import hc_inject

    gen = torch.Generator().manual_seed(11 + parts)
    rows, hc, hidden = 3, 4, 40
    streams = torch.randn(rows, hc * hidden, generator=gen)
    out = torch.randn(rows, hidden, generator=gen)
    product = torch.randn(max(parts, 1), rows, 7 + hc, generator=gen)
    logits = product[..., 7:] if parts else product[0, :, 7:]  # [P, T, hc] or [T, hc], strided
    weight = 2 * torch.sigmoid(logits.sum(0) / hc if parts else logits / hc)  # [T, hc]
    want = streams + (out[:, None, :] * weight[:, :, None]).flatten(-2)
    got = hc_inject(streams.to(DEVICE), out.to(DEVICE), logits.to(DEVICE), block=16)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_project_applies_the_previous_injection(dtype: torch.dtype) -> None:
    """hc_project with `inject` against hc_inject then hc_project: the same injected streams (written by the
    kernel, rounded to the streams' dtype as hc_inject stores them), the same partial products and scales,
    bit for bit. The logits as hc_project's partial products [P, T, hc], as a decode step hands them on."""
    from common.kernels.hyper import hc_inject, hc_project

    gen = torch.Generator().manual_seed(17)
    rows, hc, hidden, n_out = 1, 4, 40, 27
    on = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)
    streams, out = on(rows, hc * hidden, scale=3.0), on(rows, hidden)
    logits = (torch.randn(hc, rows, 7 + hc, generator=gen)[..., 7:]).to(DEVICE)  # strided partials
    norm_weight, weight = on(hc * hidden, scale=0.2), on(n_out, hc * hidden, scale=0.1)
    injected = hc_inject(streams, out, logits, block=16)
    want = hc_project(injected, norm_weight, 1e-6, weight, hc, block_n=4)
    got = hc_project(streams, norm_weight, 1e-6, weight, hc, block_n=4, inject=(out, logits))
    assert torch.equal(got[2], injected)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_deferred_injections_decode_as_applied_ones(tmp_path: Path, monkeypatch) -> None:
    """qwen4_exp with the fused kernels: one-row decode passes leave each hyper-connection's injection to the
    next one's projection kernel (but before a PLE layer and the final mixer), and give the logits of the
    same passes with every injection applied by hc_inject, exactly."""
    from common.config import WorkerConfig
    from common.engine.engine import Engine
    from common.kernels import hyper
    from common.model.fused_kernels import use_fused_kernels
    from common.model.synthetic.checkpoint import make_model

    path = make_model(tmp_path / "m", preset="tiny", arch="qwen4_exp")
    prompt = torch.randint(3, 1000, (5,), generator=torch.Generator().manual_seed(0)).tolist()
    plain, injected = hyper.hc_project, []

    def spy(*args, **kwargs):
        injected.append(kwargs.get("inject") is not None)
        return plain(*args, **kwargs)

    monkeypatch.setattr(hyper, "hc_project", spy)

    def decode(defer: bool) -> tuple[list[torch.Tensor], int]:
        kernels = replace(KERNELS, defer_inject=defer)
        engine = Engine(
            WorkerConfig(str(path), device=DEVICE, max_running=1, cuda_graphs=False, kernels=kernels)
        )
        use_fused_kernels(engine.model, True)
        seq = engine.runner.new_sequence()
        logits = [engine.runner.forward([seq], [prompt])]
        for _ in range(2):
            logits.append(engine.runner.forward([seq], [[int(logits[-1][-1].argmax())]]))
        layers = engine.model.model.layers  # a PLE layer takes its streams applied: the chain restarts there
        return logits, 2 * len(layers) - 1 - sum(layer.ple is not None for layer in layers[1:])

    deferred, chained = decode(True)
    assert chained > 1 and injected.count(True) == 2 * chained  # two one-row passes
    injected.clear()
    applied, _ = decode(False)
    assert injected and not any(injected)
    for a, b in zip(deferred, applied, strict=True):
        assert torch.equal(a, b)

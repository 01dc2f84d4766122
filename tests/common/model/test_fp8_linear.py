"""fp8 resident projections: the codes and scales, a qwen4_exp model with its token mixers in fp8 against the
same model in its dtype (each projection on its own; fused ones, through the kernels, are in
tests/common/kernels/test_gemv_kernel.py), and the memory plan against what the quantised model holds."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.engine.memory_plan import plan_for_dir, weight_bytes
from common.kernels.config import KERNELS
from common.model.fp8_linear import BLOCK_K, FP8_MAX, Fp8Fused, Fp8Linear, dequantize_fp8, quantize_fp8
from common.model.fused_kernels import configure_kernels
from common.model.synthetic.checkpoint import make_model


@pytest.mark.parametrize("k", [256, 300])  # whole blocks; a partial last one
def test_codes_and_scales_round_trip(k: int) -> None:
    weight = torch.randn(200, k, generator=torch.Generator().manual_seed(k)) * 0.05
    weight[3, :BLOCK_K] = 0  # an all-zero block
    codes, scale = quantize_fp8(weight)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (200, -(-k // BLOCK_K))
    assert torch.equal(codes[5].float().abs().max(), torch.tensor(FP8_MAX))  # each block's peak → 448
    back = dequantize_fp8(codes, scale, torch.float32)
    assert (back - weight).norm() <= 0.04 * weight.norm()  # 3 mantissa bits
    assert torch.equal(back[3, :BLOCK_K], torch.zeros(BLOCK_K))


def assert_fp8_close(path: Path, fused: bool, device: str = "cpu") -> None:
    """The token mixers' projections in fp8 (with `fused`, one weight per mixer whose members are row views;
    else each on its own): logits within fp8's rounding of the model-dtype ones over a prefill and decode
    steps fed the same tokens (the model-dtype run's greedy ones), and fewer bytes held."""
    prompt = torch.randint(3, 1000, (13,), generator=torch.Generator().manual_seed(0)).tolist()
    logits, held, fed = [], [], None
    for resident in (None, "fp8"):
        engine = Engine(
            WorkerConfig(
                str(path), device=device, max_running=1, fused_kernels=fused, resident_dtype=resident
            )
        )
        steps = teacher_forced(engine, prompt, 3, fed)
        fed = fed or [int(s.argmax(-1)) for s in steps[:-1]]
        logits.append(torch.cat(steps))
        held.append(weight_bytes(engine.model))
    mixers = [m for m in engine.model.modules() if isinstance(getattr(m, "fused_in", None), Fp8Fused)]
    assert (len(mixers) > 0) == fused
    assert any(isinstance(m, Fp8Linear) for m in engine.model.modules()) and held[1] < held[0]
    assert (logits[1] - logits[0]).norm() <= 0.05 * logits[0].norm()


def teacher_forced(
    engine: Engine, prompt: list[int], steps: int, fed: list[int] | None
) -> list[torch.Tensor]:
    """fp32 logits [1, V] of a prefill of `prompt` and `steps` decode passes, each fed the token of `fed`
    (None: the argmax of the pass before): two models compared on the same inputs, which their own greedy
    choices would part after one near tie."""
    seq = engine.runner.new_sequence()
    out = [engine.runner.forward([seq], [prompt]).float()]
    for i in range(steps):
        token = fed[i] if fed is not None else int(out[-1].argmax(-1))
        out.append(engine.runner.forward([seq], [[token]]).float().clone())
    engine.runner.release(seq)
    return out


@pytest.fixture(scope="module")
def qwen4(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("q4"), preset="tiny", arch="qwen4_exp")


def test_fp8_mixers_keep_the_model_close(qwen4: Path) -> None:
    assert_fp8_close(qwen4, fused=False)


def test_the_plan_holds_what_the_fp8_model_holds(qwen4: Path) -> None:
    engine = Engine(WorkerConfig(str(qwen4), max_running=1, resident_dtype="fp8"))
    plan = plan_for_dir(
        qwen4, budget_bytes=1 << 30, max_context=100, max_running=1, expert_format="bf16",
        dtype=torch.float32, resident_dtype="fp8",
    )  # fmt: skip
    assert plan.weights == weight_bytes(engine.model)


def test_fp8_needs_token_mixers_it_covers(tmp_path: Path) -> None:
    path = make_model(tmp_path / "m", preset="tiny", arch="qwen3_moe")
    with pytest.raises(ValueError, match="qwen4_exp's token mixers"):
        Engine(WorkerConfig(str(path), max_running=1, resident_dtype="fp8"))
    with pytest.raises(ValueError, match="--resident-dtype must be one of"):
        Engine(WorkerConfig(str(path), max_running=1, resident_dtype="int8"))


def test_layers_hold_the_mixer_launch_before_a_wide_fp8_projection(qwen4: Path, monkeypatch) -> None:
    """Qwen4DecoderLayer.hold_mixer_launch None: a layer holds its token mixer's launch at one row when the
    mixer's fused projection is fp8 and runs the wide launch (gemv.wide_fp8; CUBLAS_ROWS lowered to the tiny
    model's rows), never at two rows nor in the model dtype; True/False force it."""
    from common.kernels import gemv
    from common.model.qwen4_exp.model import Qwen4DecoderLayer

    monkeypatch.setattr(gemv, "CUBLAS_ROWS", 1)
    held = {}
    for resident in (None, "fp8"):
        engine = Engine(WorkerConfig(str(qwen4), max_running=1, fused_kernels=True, resident_dtype=resident))
        layers = [m for m in engine.model.modules() if isinstance(m, Qwen4DecoderLayer)]
        held[resident] = {(layer._holds_mixer_launch(1), layer._holds_mixer_launch(2)) for layer in layers}
    assert held == {None: {(False, False)}, "fp8": {(True, False)}}
    configure_kernels(engine.model, replace(KERNELS, fp8_large_one_row=False))
    assert not layers[0]._holds_mixer_launch(1)
    configure_kernels(engine.model, replace(KERNELS, hold_mixer_launch=True))
    assert layers[0]._holds_mixer_launch(2)

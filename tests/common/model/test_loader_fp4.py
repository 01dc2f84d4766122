"""NVFP4 (ModelOpt) and MXFP4 (gpt-oss) checkpoints of a tiny qwen3_moe: written as those tools write them,
loaded with the experts in their published bits (the host store takes them byte for byte) and dequantised
bit for bit as the formats' specifications say, generating greedily what transformers generates on the
dequantised weights; a truncated, reshaped or mistyped scale is refused naming its file and key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from common.engine.memory_plan import plan_for_dir
from common.experts.formats import get_format
from common.model.errors import CheckpointError
from common.model.hf_config import load_architecture
from common.model.loader import check_checkpoint, load_model
from common.model.synthetic.checkpoint import make_model
from tests.common.experts.test_fp4_formats import mxfp4_reference, nvfp4_reference
from tests.common.model.published_checks import (
    INDEX,
    assert_greedy_matches_transformers,
    copy_unquantized_config,
    edit_shard,
    tensors,
)

FORMATS = ("nvfp4", "mxfp4")


@pytest.fixture(scope="module", params=FORMATS)
def fp4_dir(request, tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp(request.param), preset="tiny", seed=5, quantize=request.param)


def _format_of(model_dir: Path) -> str:
    return "nvfp4" if (model_dir / "hf_quant_config.json").is_file() else "mxfp4"


def _reference_experts(model_dir: Path, layer: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2I, H], down [E, H, I]) in fp32 from the files, by the specifications' references."""
    t = tensors(model_dir)
    prefix = f"model.layers.{layer}.mlp.experts"
    if _format_of(model_dir) == "mxfp4":
        gate_up, down = (
            torch.stack([mxfp4_reference(t[f"{prefix}.{p}_proj_blocks"][e], t[f"{prefix}.{p}_proj_scales"][e])
                         for e in range(experts)])
            for p in ("gate_up", "down")
        )  # fmt: skip
        return gate_up, down

    def linear(e: int, p: str) -> torch.Tensor:
        m = f"{prefix}.{e}.{p}_proj"
        return nvfp4_reference(t[f"{m}.weight"], t[f"{m}.weight_scale"], t[f"{m}.weight_scale_2"])

    gate_up = torch.stack([torch.cat([linear(e, "gate"), linear(e, "up")]) for e in range(experts)])
    return gate_up, torch.stack([linear(e, "down") for e in range(experts)])


@pytest.fixture(scope="module")
def dequantized_dir(fp4_dir: Path, tmp_path_factory) -> Path:
    """The checkpoint with its experts dequantised by the reference: a plain fp32 qwen3_moe checkpoint."""
    out = tmp_path_factory.mktemp("dequantized")
    copy_unquantized_config(fp4_dir, out)
    t = tensors(fp4_dir)
    plain = {}
    for key, tensor in t.items():
        module = key.removesuffix(".weight")
        if ".mlp.experts." in key or key.endswith(("_scale", "_scale_2")):
            continue
        scaled = f"{module}.weight_scale" in t  # a dense NVFP4 linear
        plain[key] = (
            nvfp4_reference(tensor, t[f"{module}.weight_scale"], t[f"{module}.weight_scale_2"])
            if scaled
            else tensor.float()
        )
    arch_cfg = load_architecture(fp4_dir)[1]
    for layer in arch_cfg.moe_layers:
        gate_up, down = _reference_experts(fp4_dir, layer, arch_cfg.num_experts)
        plain[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = gate_up
        plain[f"model.layers.{layer}.mlp.experts.down_proj"] = down
    save_file(plain, out / "model.safetensors", metadata={"format": "pt"})
    return out


# --- the written layouts -----------------------------------------------------------------------------------


def test_nvfp4_written_as_modelopt(tmp_path: Path) -> None:
    out = make_model(tmp_path, preset="tiny", quantize="nvfp4")
    modelopt = json.loads((out / "hf_quant_config.json").read_text())
    assert modelopt["producer"]["name"] == "modelopt"
    quant = modelopt["quantization"]
    assert quant["quant_algo"] == "NVFP4" and quant["group_size"] == 16
    assert {"lm_head", "model.layers.0.self_attn*", "model.layers.0.mlp.gate"} <= set(
        quant["exclude_modules"]
    )
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "modelopt" and config["ignore"] == quant["exclude_modules"]
    t = tensors(out)
    assert t["model.layers.1.mlp.up_proj.weight"].dtype == torch.uint8  # the dense MLP, quantized too
    m = "model.layers.2.mlp.experts.3.up_proj"
    assert t[f"{m}.weight"].dtype == torch.uint8 and t[f"{m}.weight"].shape == (32, 32)  # I=32, H=64
    assert t[f"{m}.weight_scale"].dtype == torch.float8_e4m3fn and t[f"{m}.weight_scale"].shape == (32, 4)
    assert t[f"{m}.weight_scale_2"].shape == () and t[f"{m}.input_scale"].dtype == torch.float32
    assert t["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.0.mlp.gate.weight_scale" not in t


def test_mxfp4_written_as_gpt_oss(tmp_path: Path) -> None:
    out = make_model(tmp_path, preset="tiny", quantize="mxfp4")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    assert "lm_head" in config["quantization_config"]["modules_to_not_convert"]
    t = tensors(out)
    assert t["model.layers.0.mlp.experts.gate_up_proj_blocks"].shape == (8, 64, 2, 16)  # [E, 2I, H/32, 16]
    assert t["model.layers.0.mlp.experts.gate_up_proj_scales"].shape == (8, 64, 2)
    assert t["model.layers.0.mlp.experts.down_proj_blocks"].shape == (8, 64, 1, 16)  # [E, H, I/32, 16]
    assert not any(".experts.0." in k for k in t)
    index = json.loads((out / INDEX).read_text())["weight_map"]
    assert set(index) == set(t)


# --- loading -----------------------------------------------------------------------------------------------


def test_experts_dequantise_bit_for_bit(fp4_dir: Path) -> None:
    """The resident experts (fp32) are the reference dequantisation of the files; the published components
    are the files' bytes, which a host store takes as they are."""
    model = load_model(fp4_dir, dtype=torch.float32)
    experts = model.experts
    name, layers = experts.published
    assert name == _format_of(fp4_dir)
    cfg = model.config
    comps = get_format(name).components(cfg.hidden_size, cfg.moe_intermediate_size)
    for layer in cfg.moe_layers:
        gate_up, down = _reference_experts(fp4_dir, layer, cfg.num_experts)
        assert torch.equal(experts.weights[layer].gate_up, gate_up)
        assert torch.equal(experts.weights[layer].down, down)
        parts = layers[layer]
        assert {k: (tuple(v.shape[1:]), v.dtype) for k, v in parts.items()} == comps
    if name == "mxfp4":
        stored = tensors(fp4_dir)["model.layers.2.mlp.experts.down_proj_blocks"]
        assert torch.equal(layers[2]["down_blocks"], stored)
    else:
        stored = tensors(fp4_dir)["model.layers.2.mlp.experts.5.up_proj.weight_scale"]
        assert torch.equal(
            layers[2]["gate_up_weight_scale"][5, 32:].view(torch.uint8), stored.view(torch.uint8)
        )


def test_published_only_keeps_no_dequantised_copy(fp4_dir: Path) -> None:
    """A model whose experts go to a host store holds them only in their published bits."""
    model = load_model(fp4_dir, dtype=torch.float32, published_only=True)
    assert model.experts.weights == {}
    assert sorted(model.experts.published[1]) == sorted(model.config.moe_layers)


def test_plan_counts_the_published_bytes(fp4_dir: Path) -> None:
    plan = plan_for_dir(
        fp4_dir,
        expert_format="bf16",
        budget_bytes=1 << 30,
        max_context=64,
        max_running=2,
        dtype=torch.float32,
    )
    fmt = get_format(_format_of(fp4_dir))
    assert plan.expert_format == fmt.name and plan.expert_bytes == fmt.expert_nbytes(64, 32)


# --- against transformers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("expert_cache", [None, pytest.param("0.5", marks=pytest.mark.slow)])
def test_greedy_matches_transformers(fp4_dir: Path, dequantized_dir: Path, expert_cache: str | None) -> None:
    """Spillway on the fp4 checkpoint (experts resident, or from the host store of published bits through a
    cache of half of them) generates what transformers generates on the dequantised weights."""
    assert_greedy_matches_transformers(fp4_dir, dequantized_dir, expert_cache)


# --- errors name the file and the key ----------------------------------------------------------------------


def _scale_keys(model_dir: Path) -> list[str]:
    """An expert's scale, and (nvfp4) a dense MLP linear's, which loads dequantised."""
    if _format_of(model_dir) == "mxfp4":
        return ["model.layers.2.mlp.experts.down_proj_scales"]
    return [
        "model.layers.2.mlp.experts.4.gate_proj.weight_scale",
        "model.layers.1.mlp.down_proj.weight_scale",
    ]


@pytest.fixture
def ckpt(fp4_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(fp4_dir, tmp_path / "model"))


CHECKS = pytest.mark.parametrize("check", [load_model, check_checkpoint], ids=["load", "headers"])


def test_headers_check_passes(fp4_dir: Path) -> None:
    check_checkpoint(fp4_dir)


@CHECKS
@pytest.mark.parametrize("fault", ["truncated", "reshaped", "mistyped"])
def test_bad_scale_refused(ckpt: Path, fault: str, check) -> None:
    for key in _scale_keys(ckpt):
        original = tensors(ckpt)[key]

        def change(t: dict, key: str = key) -> None:
            s = t[key]
            t[key] = {"truncated": s[..., :-1], "reshaped": s.reshape(-1), "mistyped": s.float()}[
                fault
            ].clone()

        shard = edit_shard(ckpt, key, change)
        with pytest.raises(CheckpointError, match="dtype" if fault == "mistyped" else "shape") as err:
            check(ckpt)
        assert err.value.path == shard and err.value.key == key
        edit_shard(ckpt, key, lambda t, key=key, original=original: t.update({key: original}))


@CHECKS
def test_missing_scale_refused(ckpt: Path, check) -> None:
    key = _scale_keys(ckpt)[0]
    edit_shard(ckpt, key, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing") as err:
        check(ckpt)
    assert err.value.key == key


def test_truncated_file_refused(ckpt: Path) -> None:
    """A shard cut short (a download that stopped) is named."""
    key = _scale_keys(ckpt)[0]
    shard = ckpt / json.loads((ckpt / INDEX).read_text())["weight_map"][key]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError) as err:
        load_model(ckpt)
    assert err.value.path == shard

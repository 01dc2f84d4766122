"""GPTQ (GPTQModel, desc_act false and true) and AWQ (AutoAWQ GEMM) checkpoints of a tiny qwen3_moe: written
as those tools write them, loaded with the experts in their published int32 words (the host store takes
them byte for byte) and every linear dequantised bit for bit as the formats' specifications say
(tests/common/experts/test_int4_published_formats.py's reference), generating greedily what transformers
generates on the dequantised weights; a truncated, reshaped or mistyped tensor is refused naming its file
and key. The tiny preset's dims (H 64, I 32) do not fill groups of 128: the writer uses 32."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.engine.memory_plan import plan_for_dir
from common.experts.formats import get_format
from common.model.errors import CheckpointError
from common.model.hf_config import load_architecture
from common.model.loader import check_checkpoint, load_model
from common.model.synthetic.checkpoint import make_model
from common.model.synthetic.config import model_config
from common.model.synthetic.int4_checkpoint import group_size
from tests.common.experts.test_int4_published_formats import awq_reference, gptq_reference
from tests.common.model.published_checks import (
    INDEX,
    assert_greedy_matches_transformers,
    copy_unquantized_config,
    edit_shard,
    tensors,
)

VARIANTS = ("gptq", "gptq-desc-act", "awq")
GROUP = 32


@pytest.fixture(scope="module", params=VARIANTS)
def int4_dir(request, tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp(request.param), preset="tiny", seed=5, quantize=request.param)


def _method(model_dir: Path) -> str:
    quant = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    return "gptq_v2" if quant.get("checkpoint_format") == "gptq_v2" else quant["quant_method"]


def _linear(t: dict[str, torch.Tensor], module: str, method: str) -> torch.Tensor:
    """One linear's w [out, in] (fp32) by the specification's reference."""
    if method == "awq":
        return awq_reference(t[f"{module}.qweight"], t[f"{module}.qzeros"], t[f"{module}.scales"])
    parts = (t[f"{module}.{n}"] for n in ("qweight", "qzeros", "scales", "g_idx"))
    return gptq_reference(*parts, v2=method == "gptq_v2")


def _reference_experts(model_dir: Path, layer: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    t, method = tensors(model_dir), _method(model_dir)
    prefix = f"model.layers.{layer}.mlp.experts"

    def linear(e: int, p: str) -> torch.Tensor:
        return _linear(t, f"{prefix}.{e}.{p}_proj", method)

    gate_up = torch.stack([torch.cat([linear(e, "gate"), linear(e, "up")]) for e in range(experts)])
    return gate_up, torch.stack([linear(e, "down") for e in range(experts)])


@pytest.fixture(scope="module")
def dequantized_dir(int4_dir: Path, tmp_path_factory) -> Path:
    """The checkpoint with every int4 linear dequantised by the reference: a plain fp32 checkpoint."""
    out = tmp_path_factory.mktemp("dequantized")
    copy_unquantized_config(int4_dir, out)
    t, method = tensors(int4_dir), _method(int4_dir)
    plain = {}
    for key, tensor in t.items():
        module, _, name = key.rpartition(".")
        if ".mlp.experts." in key or name in ("qzeros", "scales", "g_idx"):
            continue
        if name == "qweight":
            plain[f"{module}.weight"] = _linear(t, module, method)
        else:
            plain[key] = tensor.float()
    arch_cfg = load_architecture(int4_dir)[1]
    for layer in arch_cfg.moe_layers:
        gate_up, down = _reference_experts(int4_dir, layer, arch_cfg.num_experts)
        plain[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = gate_up
        plain[f"model.layers.{layer}.mlp.experts.down_proj"] = down
    save_file(plain, out / "model.safetensors", metadata={"format": "pt"})
    return out


# --- the written layouts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_written_as_gptqmodel(tmp_path: Path, desc_act: bool) -> None:
    out = make_model(tmp_path, preset="tiny", quantize="gptq-desc-act" if desc_act else "gptq")
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "gptq" and quant["checkpoint_format"] == "gptq" and quant["bits"] == 4
    assert quant["group_size"] == GROUP and quant["desc_act"] is desc_act and quant["sym"] is True
    assert quant["pack_dtype"] == "int32" and quant["meta"]["quantizer"] == ["gptqmodel:4.2.5"]
    assert "modules_to_not_convert" not in quant  # GPTQModel leaves the router out of its module tree
    assert json.loads((out / "quantize_config.json").read_text()) == quant
    t = tensors(out)
    m = "model.layers.2.mlp.experts.3.up_proj"  # I=32, H=64
    assert (t[f"{m}.qweight"].dtype, t[f"{m}.qweight"].shape) == (torch.int32, (8, 32))
    assert (t[f"{m}.qzeros"].dtype, t[f"{m}.qzeros"].shape) == (torch.int32, (2, 4))
    assert (t[f"{m}.scales"].dtype, t[f"{m}.scales"].shape) == (torch.float16, (2, 32))
    assert (t[f"{m}.g_idx"].dtype, t[f"{m}.g_idx"].shape) == (torch.int32, (64,))
    assert torch.all(t[f"{m}.qzeros"] == 0x77777777)  # symmetric: zero 8, stored − 1
    g_idx = t["model.layers.0.self_attn.o_proj.g_idx"]  # 128 inputs, 4 groups
    assert torch.equal(torch.bincount(g_idx.long()), torch.full((4,), GROUP))
    assert torch.equal(g_idx, torch.arange(128, dtype=torch.int32) // GROUP) is not desc_act
    assert "model.layers.1.mlp.gate_proj.qweight" in t  # the dense MLP, quantized too
    for plain in ("model.layers.0.mlp.gate.weight", "lm_head.weight", "model.embed_tokens.weight"):
        assert t[plain].dtype == torch.bfloat16
    assert not any(k.endswith(".weight") and ".self_attn." in k and "norm" not in k for k in t)


def test_awq_written_as_autoawq(tmp_path: Path) -> None:
    out = make_model(tmp_path, preset="tiny", quantize="awq")
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant == {
        "quant_method": "awq",
        "zero_point": True,
        "group_size": GROUP,
        "bits": 4,
        "version": "gemm",
        "modules_to_not_convert": ["mlp.gate"],
    }
    t = tensors(out)
    m = "model.layers.2.mlp.experts.3.down_proj"  # H=64 outputs, I=32 inputs
    assert (t[f"{m}.qweight"].dtype, t[f"{m}.qweight"].shape) == (torch.int32, (32, 8))
    assert (t[f"{m}.qzeros"].dtype, t[f"{m}.qzeros"].shape) == (torch.int32, (1, 8))
    assert (t[f"{m}.scales"].dtype, t[f"{m}.scales"].shape) == (torch.float16, (1, 64))
    assert f"{m}.g_idx" not in t
    assert t["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    # AutoAWQ's substring match spares the dense MLP's gate_proj too, not its up_proj
    assert "model.layers.1.mlp.gate_proj.weight" in t and "model.layers.1.mlp.up_proj.qweight" in t
    index = json.loads((out / INDEX).read_text())["weight_map"]
    assert set(index) == set(t)


def test_group_size_fits_every_quantized_input() -> None:
    """128 where the dims allow; else the largest of 64, 32, 16 that divides every quantized input dim."""
    assert group_size("gptq", model_config("tiny", "qwen3_moe", None)) == GROUP  # H 64, I 32, dense 96
    assert group_size("awq", model_config("tiny", "qwen2_moe", None)) == 16  # the shared expert's 48
    wide = {"hidden_size": 256, "moe_intermediate_size": 128, "intermediate_size": 384, "head_dim": 64}
    assert group_size("gptq", model_config("tiny", "qwen3_moe", wide)) == 128
    assert group_size("awq", model_config("tiny", "qwen3_moe", wide | {"moe_intermediate_size": 40})) == -1


# --- loading -----------------------------------------------------------------------------------------------


def test_weights_dequantise_bit_for_bit(int4_dir: Path) -> None:
    """The resident experts and the other linears (fp32) are the reference dequantisation of the files;
    the published components are the files' words, which a host store takes as they are."""
    model = load_model(int4_dir, dtype=torch.float32)
    experts = model.experts
    name, layers = experts.published
    assert name == _method(int4_dir) + f"-g{GROUP}"
    cfg = model.config
    comps = get_format(name).components(cfg.hidden_size, cfg.moe_intermediate_size)
    for layer in cfg.moe_layers:
        gate_up, down = _reference_experts(int4_dir, layer, cfg.num_experts)
        assert torch.equal(experts.weights[layer].gate_up, gate_up)
        assert torch.equal(experts.weights[layer].down, down)
        assert {k: (tuple(v.shape[1:]), v.dtype) for k, v in layers[layer].items()} == comps
    t = tensors(int4_dir)
    up = "model.layers.2.mlp.experts.5.up_proj"
    for n in ("qweight", "qzeros", "scales"):  # up's columns follow gate's
        width = t[f"{up}.{n}"].shape[-1]
        assert torch.equal(layers[2][f"gate_up_{n}"][5][:, width:], t[f"{up}.{n}"])
    params = dict(model.named_parameters())
    for module in ("model.layers.0.self_attn.q_proj", "model.layers.3.self_attn.o_proj"):
        assert torch.equal(params[f"{module}.weight"], _linear(t, module, _method(int4_dir)))
    if "model.layers.1.mlp.down_proj.qweight" in t:
        dense = _linear(t, "model.layers.1.mlp.down_proj", _method(int4_dir))
        assert torch.equal(params["model.layers.1.mlp.down_proj.weight"], dense)


def test_published_only_keeps_no_dequantised_copy(int4_dir: Path) -> None:
    model = load_model(int4_dir, dtype=torch.float32, published_only=True)
    assert model.experts.weights == {}
    assert sorted(model.experts.published[1]) == sorted(model.config.moe_layers)


def test_plan_counts_the_published_bytes(int4_dir: Path) -> None:
    plan = plan_for_dir(
        int4_dir,
        expert_format="bf16",
        budget_bytes=1 << 30,
        max_context=64,
        max_running=2,
        dtype=torch.float32,
    )
    fmt = get_format(_method(int4_dir) + f"-g{GROUP}")
    assert plan.expert_format == fmt.name and plan.expert_bytes == fmt.expert_nbytes(64, 32)


def test_gptq_v2_zeros(int4_dir: Path, tmp_path: Path) -> None:
    """GPTQModel's gptq_v2 stores the zero itself: the same checkpoint with each zero nibble + 1 and
    checkpoint_format gptq_v2 loads to the same weights."""
    if _method(int4_dir) != "gptq":
        pytest.skip("a GPTQ checkpoint")
    v2 = Path(shutil.copytree(int4_dir, tmp_path / "v2"))
    for shard in v2.glob("*.safetensors"):
        tensors = load_file(shard)
        for key in [k for k in tensors if k.endswith(".qzeros")]:
            tensors[key] = tensors[key] + 0x11111111  # 0x77777777 -> 0x88888888, a negative int32
        save_file(tensors, shard, metadata={"format": "pt"})
    config = json.loads((v2 / "config.json").read_text())
    config["quantization_config"]["checkpoint_format"] = "gptq_v2"
    (v2 / "config.json").write_text(json.dumps(config))
    a, b = load_model(int4_dir, dtype=torch.float32), load_model(v2, dtype=torch.float32)
    assert b.experts.published[0] == f"gptq_v2-g{GROUP}"
    assert torch.equal(a.experts.weights[0].down, b.experts.weights[0].down)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


# --- against transformers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("expert_cache", [None, pytest.param("0.5", marks=pytest.mark.slow)])
def test_greedy_matches_transformers(int4_dir: Path, dequantized_dir: Path, expert_cache: str | None) -> None:
    """Spillway on the int4 checkpoint (experts resident, or from the host store of published words through
    a cache of half of them) generates what transformers generates on the dequantised weights."""
    assert_greedy_matches_transformers(int4_dir, dequantized_dir, expert_cache)


# --- errors name the file and the key ----------------------------------------------------------------------


# An expert's tensor, and an attention linear's, which loads dequantised.
KEYS = [
    "model.layers.2.mlp.experts.4.gate_proj.scales",
    "model.layers.2.mlp.experts.4.down_proj.qweight",
    "model.layers.0.self_attn.k_proj.scales",
    "model.layers.3.self_attn.o_proj.qweight",
]


@pytest.fixture
def ckpt(int4_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(int4_dir, tmp_path / "model"))


CHECKS = pytest.mark.parametrize("check", [load_model, check_checkpoint], ids=["load", "headers"])


def test_headers_check_passes(int4_dir: Path) -> None:
    check_checkpoint(int4_dir)


@CHECKS
@pytest.mark.parametrize("fault", ["truncated", "reshaped", "mistyped"])
def test_bad_tensor_refused(ckpt: Path, fault: str, check) -> None:
    for key in KEYS:
        original = tensors(ckpt)[key]

        def change(t: dict, key: str = key) -> None:
            s = t[key]
            bad = {"truncated": s[..., :-1], "reshaped": s.reshape(-1), "mistyped": s.float()}[fault]
            t[key] = bad.clone()

        shard = edit_shard(ckpt, key, change)
        with pytest.raises(CheckpointError, match="dtype" if fault == "mistyped" else "shape") as err:
            check(ckpt)
        assert err.value.path == shard and err.value.key == key
        edit_shard(ckpt, key, lambda t, key=key, original=original: t.update({key: original}))


@CHECKS
@pytest.mark.parametrize("key", [KEYS[0], KEYS[2]])
def test_missing_tensor_refused(ckpt: Path, check, key: str) -> None:
    edit_shard(ckpt, key, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing") as err:
        check(ckpt)
    assert err.value.key == key


@pytest.mark.parametrize(
    "key", ["model.layers.2.mlp.experts.1.up_proj.g_idx", "model.layers.0.self_attn.v_proj.g_idx"]
)
def test_g_idx_outside_the_groups_refused(ckpt: Path, key: str) -> None:
    if _method(ckpt) == "awq":
        pytest.skip("GPTQ's g_idx")
    shard = edit_shard(ckpt, key, lambda t: t[key].__setitem__(0, 2))  # 64 inputs: groups 0 and 1
    with pytest.raises(CheckpointError, match="g_idx") as err:
        load_model(ckpt)
    assert err.value.path == shard and err.value.key == key


def test_truncated_file_refused(ckpt: Path) -> None:
    """A shard cut short (a download that stopped) is named."""
    shard = ckpt / json.loads((ckpt / INDEX).read_text())["weight_map"][KEYS[0]]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError) as err:
        load_model(ckpt)
    assert err.value.path == shard

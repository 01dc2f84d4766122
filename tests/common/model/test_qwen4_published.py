"""qwen4_exp checkpoints in every published format `make-model --quantize` writes (ModelOpt NVFP4 in the
seed checkpoint's layout, gpt-oss MXFP4, GPTQModel, AutoAWQ, llm-compressor, HF block FP8): the linears each
tool converts (common/model/synthetic/quantized_linears.py), loaded with the experts in their published
bits, generating greedily what transformers generates on the weights dequantised by the formats'
references."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.engine.memory_plan import plan_for_dir
from common.experts.formats import get_format
from common.model.errors import CheckpointError
from common.model.loader import check_checkpoint, load_model
from common.model.synthetic.checkpoint import make_model
from common.model.synthetic.quantized_linears import QWEN4_KEPT
from common.protocol import SamplingParams
from tests.common.experts.test_fp4_formats import mxfp4_reference, nvfp4_reference
from tests.common.experts.test_int4_published_formats import awq_reference, gptq_reference
from tests.common.model.published_checks import (
    EXPERT_FORMAT,
    PROMPTS,
    assert_greedy_matches_transformers,
    copy_unquantized_config,
    edit_shard,
    tensors,
)
from tests.common.model.test_loader_fp8 import _reference as fp8_reference

ct_blocks = pytest.importorskip("tests.common.model.test_ct_blocks")  # needs compressed-tensors

# Many indexer heads: exact-zero ReLU scores tie rarely (see test_qwen4_parity.py).
OVERRIDES = {"indexer_n_heads": 16, "indexer_budget": 16, "indexer_compress_ratio": 4}
LAYER = "model.language_model.layers"


@pytest.fixture(scope="module", params=[*EXPERT_FORMAT, "fp8"])
def q4_dir(request, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(request.param)
    return make_model(out, "tiny", "qwen4_exp", OVERRIDES, seed=4, quantize=request.param)


def _reference(t: dict[str, torch.Tensor], module: str) -> torch.Tensor | None:
    """`module`'s weight [out, in] in fp32 by its format's reference dequantiser; None if not quantized."""
    get = lambda name: t[f"{module}.{name}"]
    if f"{module}.weight_scale_2" in t:  # ModelOpt NVFP4
        return nvfp4_reference(get("weight"), get("weight_scale"), get("weight_scale_2"))
    if f"{module}.weight_scale_inv" in t:  # HF block FP8
        return fp8_reference(get("weight"), get("weight_scale_inv"))
    if f"{module}.g_idx" in t:
        return gptq_reference(get("qweight"), get("qzeros"), get("scales"), get("g_idx"))
    if f"{module}.qweight" in t:
        return awq_reference(get("qweight"), get("qzeros"), get("scales"))
    if f"{module}.weight_global_scale" in t:
        return ct_blocks.nvfp4_reference(
            get("weight_packed"), get("weight_scale"), get("weight_global_scale")
        )
    if f"{module}.weight_packed" in t:
        shape = tuple(get("weight_shape").tolist())
        zero = t.get(f"{module}.weight_zero_point")
        return ct_blocks.w4a16_reference(get("weight_packed"), get("weight_scale").float(), zero, shape)
    return None


_AUX = ("weight_scale", "weight_scale_2", "input_scale", "weight_scale_inv", "qzeros", "scales", "g_idx")
_AUX += ("weight_global_scale", "weight_shape", "weight_zero_point", "weight_packed", "qweight")


def _dequantized(model_dir: Path, out: Path) -> Path:
    """`model_dir` with every quantized tensor dequantised by the references: a plain fp32 checkpoint."""
    copy_unquantized_config(model_dir, out)
    t = tensors(model_dir)
    plain: dict[str, torch.Tensor] = {}
    for key, tensor in t.items():
        module, _, name = key.rpartition(".")
        if key.endswith("_blocks"):  # MXFP4's fused experts [E, out, in/32, 16]
            scales = t[key.removesuffix("_blocks") + "_scales"]
            plain[key.removesuffix("_blocks")] = torch.stack(
                [mxfp4_reference(tensor[e], scales[e]) for e in range(len(tensor))]
            )
        elif name in ("weight", "weight_packed", "qweight"):
            w = _reference(t, module)
            plain[f"{module}.weight"] = tensor.float() if w is None else w
        elif not key.endswith("_scales") and name not in _AUX:
            plain[key] = tensor.float() if tensor.is_floating_point() else tensor
    save_file(plain, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_nvfp4_is_written_in_the_seed_layout(tmp_path: Path) -> None:
    """ModelOpt's NVFP4 export of a hybrid model: attention, Gated DeltaNet's qkv / z / out projections, the
    shared and routed experts in NVFP4; routers, GDN's a / b, the stream mixers, PLE, vision and MTP not."""
    model = make_model(tmp_path / "m", "tiny", "qwen4_exp", quantize="nvfp4")
    modelopt = json.loads((model / "hf_quant_config.json").read_text())["quantization"]
    assert modelopt["quant_algo"] == "NVFP4" and modelopt["exclude_modules"] == list(QWEN4_KEPT)
    t = tensors(model)
    quantized = {k.removesuffix(".weight_scale") for k in t if k.endswith(".weight_scale")}
    for module in (
        f"{LAYER}.0.linear_attn.in_proj_qkv",
        f"{LAYER}.0.linear_attn.in_proj_z",
        f"{LAYER}.0.linear_attn.out_proj",
        f"{LAYER}.3.self_attn.q_proj",
        f"{LAYER}.3.self_attn.indexer.index_qk_proj",
        f"{LAYER}.0.mlp.shared_expert.down_proj",
        f"{LAYER}.0.mlp.experts.7.up_proj",
    ):
        assert module in quantized and t[f"{module}.weight"].dtype == torch.uint8, module
    for module in quantized:
        assert module.startswith(f"{LAYER}.") and not any(
            p in module for p in ("in_proj_a", "in_proj_b", "mlp.gate", "hyper_connection", ".ple.")
        ), module


def test_mxfp4_fuses_only_the_routed_experts(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m", "tiny", "qwen4_exp", quantize="mxfp4")
    blocks = {k for k in tensors(model) if k.endswith("_blocks")}
    layers = json.loads((model / "config.json").read_text())["text_config"]["num_hidden_layers"]
    assert blocks == {
        f"{LAYER}.{i}.mlp.experts.{p}_proj_blocks" for i in range(layers) for p in ("gate_up", "down")
    }


def test_plan_counts_published_bytes(q4_dir: Path) -> None:
    quant = json.loads((q4_dir / "config.json").read_text())["quantization_config"]
    variant = next((q for q in EXPERT_FORMAT if _variant(quant) == q), None)
    if variant is None:  # fp8: its experts are dequantised at load
        pytest.skip("block-FP8 experts are not kept in their bits")
    plan = plan_for_dir(
        q4_dir, expert_format="bf16", budget_bytes=1 << 30, max_context=64, max_running=2, dtype=torch.float32
    )
    fmt = get_format(EXPERT_FORMAT[variant])
    assert plan.expert_format == fmt.name and plan.expert_bytes == fmt.expert_nbytes(64, 32)


def _variant(quant: dict) -> str:
    """The `make-model --quantize` variant that wrote this quantization_config."""
    method = quant.get("quant_method")
    if method == "modelopt":
        return "nvfp4"
    if method == "gptq":
        return "gptq-desc-act" if quant["desc_act"] else "gptq"
    if method == "compressed-tensors":
        weights = quant["config_groups"]["group_0"]["weights"]
        return "nvfp4a16" if weights["type"] == "float" else "w4a16" if weights["symmetric"] else "w4a16-asym"
    return method


@pytest.mark.parametrize("expert_cache", [None, pytest.param("0.5", marks=pytest.mark.slow)])
def test_greedy_matches_transformers(q4_dir: Path, tmp_path: Path, expert_cache: str | None) -> None:
    """Experts resident, and (published formats) from a host store of their bits through a cache of half."""
    dequantized = _dequantized(q4_dir, tmp_path)
    assert_greedy_matches_transformers(q4_dir, dequantized, expert_cache)


def test_truncated_scale_is_refused_naming_file_and_key(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m", "tiny", "qwen4_exp", quantize="nvfp4")
    key = f"{LAYER}.0.linear_attn.in_proj_qkv.weight_scale"
    shard = edit_shard(model, key, lambda t: t.update({key: t[key][:-1]}))
    with pytest.raises(CheckpointError) as e:
        check_checkpoint(model)
    assert key in str(e.value) and shard.name in str(e.value)


@pytest.mark.parametrize(
    ("quantize", "suffix"), [("nvfp4", "weight_scale"), ("gptq", "qzeros"), ("w4a16", "weight_scale")]
)
def test_a_missing_expert_tensor_is_named_by_its_key(quantize: str, suffix: str, tmp_path: Path) -> None:
    model = make_model(tmp_path / "m", "tiny", "qwen4_exp", quantize=quantize)
    key = f"{LAYER}.1.mlp.experts.5.up_proj.{suffix}"
    edit_shard(model, key, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        load_model(model)


def test_resident_fp8_over_a_published_checkpoint(tmp_path: Path) -> None:
    """`--resident-dtype fp8` re-quantises the dequantised token mixers: the same tokens as over the
    reference-dequantised checkpoint."""
    model = make_model(tmp_path / "m", "tiny", "qwen4_exp", OVERRIDES, seed=4, quantize="nvfp4")
    dequantized = _dequantized(model, tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def tokens(model_dir: Path) -> list[list[int]]:
        cfg = WorkerConfig(
            str(model_dir), max_running=2, max_context=64, dtype="float32", resident_dtype="fp8"
        )
        return [r.token_ids for r in Engine(cfg).generate(PROMPTS, params)]

    assert tokens(model) == tokens(dequantized)

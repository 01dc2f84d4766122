"""compressed-tensors checkpoints of a tiny qwen3_moe: W4A16 (symmetric and not) and NVFP4A16 as
`make-model` writes them (llm-compressor's layout), NVFP4 (with activation scales) and FP8 block as
compressed-tensors' own compressors write them. Loaded
with the experts in their published bits (W4A16, NVFP4) and dequantised bit for bit as compressed-tensors
dequantises them, generating greedily what transformers generates on the dequantised weights; a
truncated, reshaped or mistyped tensor is refused naming its file and key.

The tiny preset's input dims (64, 32, 96, 128) do not fit group 128: its W4A16 groups are 32.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.engine.memory_plan import plan_for_dir
from common.experts.formats import get_format
from common.model.ct_blocks import unpack_int32_rows
from common.model.errors import CheckpointError
from common.model.loader import check_checkpoint, load_model
from common.model.synthetic.checkpoint import make_model
from tests.common.model.published_checks import (
    INDEX,
    assert_greedy_matches_transformers,
    copy_unquantized_config,
    edit_shard,
    shard_of,
    tensors,
)
from tests.common.model.test_ct_blocks import nvfp4_reference, nvfp4_scheme, w4a16_reference
from tests.common.model.test_ct_scheme import _FP8_ACTS, _FP8_BLOCK, _NVFP4, _NVFP4_ACTS, quant

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import FloatQuantizationCompressor, NVFP4PackedCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam  # noqa: E402

VARIANTS = ("w4a16", "w4a16-asym", "nvfp4a16", "ct-nvfp4", "fp8-block")
EXPERT_FORMATS = {
    "w4a16": "ct-w4a16-g32", "w4a16-asym": "ct-w4a16-asym-g32",
    "nvfp4a16": "ct-nvfp4a16", "ct-nvfp4": "ct-nvfp4",
}  # fmt: skip
FP8_EDGE = 32  # a block other than 128: the loader takes it from the config
ROUTERS = ["model.layers.0.mlp.gate", "model.layers.2.mlp.gate", "model.layers.3.mlp.gate", "lm_head"]


def _quantized(key: str, t: torch.Tensor) -> bool:
    module = key.removesuffix(".weight")
    return t.dim() == 2 and key.endswith(".weight") and "embed" not in key and module not in ROUTERS


def _fused(key: str) -> tuple[str, ...]:
    """The linears llm-compressor gives one NVFP4 global scale: q/k/v, gate/up."""
    module, name = key.removesuffix(".weight").rsplit(".", 1)
    for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
        if name in group:
            return tuple(f"{module}.{n}.weight" for n in group)
    return (key,)


def _compress_nvfp4(key: str, w: torch.Tensor, plain: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    amax = torch.stack([plain[k].abs().amax() for k in _fused(key)]).amax()
    glob = generate_gparam(-amax.reshape(1), amax.reshape(1))
    blocks = w.reshape(w.shape[0], -1, 16)
    scheme = nvfp4_scheme()
    scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights, global_scale=glob)
    acts = torch.tensor([448 * 6 / 8.0])  # an activation absmax of 8 (unused by weight-only compute)
    state = {"weight": w, "weight_scale": scale, "weight_global_scale": glob, "input_global_scale": acts}
    return NVFP4PackedCompressor.compress(state, scheme)


def fp8_scheme() -> QuantizationScheme:
    args = QuantizationArgs(
        num_bits=8, type="float", strategy="block", block_structure=[FP8_EDGE, FP8_EDGE], symmetric=True
    )
    return QuantizationScheme(
        targets=["Linear"], weights=args, input_activations=QuantizationArgs(**_FP8_ACTS)
    )


def _compress_fp8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    out, inp = w.shape
    blocks = w.reshape(out // FP8_EDGE, FP8_EDGE, inp // FP8_EDGE, FP8_EDGE)
    scheme = fp8_scheme()
    scale, _ = calculate_qparams(blocks.amin((1, 3)), blocks.amax((1, 3)), scheme.weights)
    return FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)


def _compressed_by_ct(src: Path, out: Path, variant: str) -> Path:
    """`src` (bf16) with each linear but the ignored ones compressed by compressed-tensors."""
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors", INDEX))
    config = json.loads((out / "config.json").read_text())
    if variant == "ct-nvfp4":
        q = quant("nvfp4-pack-quantized", _NVFP4, _NVFP4_ACTS)
    else:
        q = quant("float-quantized", {**_FP8_BLOCK, "block_structure": [FP8_EDGE, FP8_EDGE]}, _FP8_ACTS)
    q["ignore"] = ROUTERS
    config["quantization_config"] = q
    (out / "config.json").write_text(json.dumps(config, indent=2))
    plain = tensors(src)
    stored: dict[str, torch.Tensor] = {}
    for key, w in plain.items():
        if not _quantized(key, w):
            stored[key] = w
            continue
        module = key.removesuffix(".weight")
        parts = _compress_nvfp4(key, w, plain) if variant == "ct-nvfp4" else _compress_fp8(w)
        stored.update({f"{module}.{name}": t.contiguous() for name, t in parts.items()})
    save_file(stored, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("bf16"), preset="tiny", seed=5)


@pytest.fixture(scope="module", params=VARIANTS)
def ct_dir(request, bf16_dir: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(request.param)
    if request.param in ("w4a16", "w4a16-asym", "nvfp4a16"):
        return make_model(out, preset="tiny", seed=5, quantize=request.param)
    return _compressed_by_ct(bf16_dir, out / "model", request.param)


def _variant(model_dir: Path) -> str:
    q = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    if q["format"] == "pack-quantized":
        return "w4a16" if q["config_groups"]["group_0"]["weights"]["symmetric"] else "w4a16-asym"
    if q["format"] == "nvfp4-pack-quantized":
        return "ct-nvfp4" if q["config_groups"]["group_0"]["input_activations"] else "nvfp4a16"
    return "fp8-block"


def _reference(t: dict[str, torch.Tensor], module: str) -> torch.Tensor | None:
    """compressed-tensors' dequantisation (fp32) of the quantized linear `module`, else None."""
    if f"{module}.weight_packed" in t and f"{module}.weight_global_scale" in t:
        m = f"{module}.weight"
        return nvfp4_reference(t[m + "_packed"], t[m + "_scale"], t[m + "_global_scale"])
    if f"{module}.weight_packed" in t:
        shape = tuple(t[f"{module}.weight_shape"].tolist())
        scale = t[f"{module}.weight_scale"].float()  # fp32: compressed-tensors' product is then exact
        return w4a16_reference(
            t[f"{module}.weight_packed"], scale, t.get(f"{module}.weight_zero_point"), shape
        )
    if f"{module}.weight_scale" in t:
        state = {"weight": t[f"{module}.weight"], "weight_scale": t[f"{module}.weight_scale"].float()}
        return FloatQuantizationCompressor.decompress(state, fp8_scheme())["weight"]
    return None


def _reference_experts(model_dir: Path, layer: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = tensors(model_dir)

    def linear(e: int, p: str) -> torch.Tensor:
        w = _reference(t, f"model.layers.{layer}.mlp.experts.{e}.{p}_proj")
        assert w is not None
        return w

    gate_up = torch.stack([torch.cat([linear(e, "gate"), linear(e, "up")]) for e in range(experts)])
    return gate_up, torch.stack([linear(e, "down") for e in range(experts)])


@pytest.fixture(scope="module")
def dequantized_dir(ct_dir: Path, tmp_path_factory) -> Path:
    """The checkpoint dequantised by compressed-tensors: a plain fp32 qwen3_moe checkpoint."""
    out = tmp_path_factory.mktemp("dequantized")
    copy_unquantized_config(ct_dir, out)
    t = tensors(ct_dir)
    plain: dict[str, torch.Tensor] = {}
    for key, tensor in t.items():
        module, _, name = key.rpartition(".")
        if name == "weight" and f"{module}.weight_scale" not in t:
            plain[key] = tensor.float()
        elif name in ("weight", "weight_packed"):
            w = _reference(t, module)
            assert w is not None
            plain[f"{module}.weight"] = w
    save_file(plain, out / "model.safetensors", metadata={"format": "pt"})
    return out


# --- the written layout ------------------------------------------------------------------------------------


@pytest.mark.parametrize("quantize", ["w4a16", "w4a16-asym"])
def test_w4a16_written_as_llm_compressor(tmp_path: Path, quantize: str) -> None:
    """config.json's quantization_config as compressed-tensors' ModelCompressor writes it for
    llm-compressor's W4A16 / W4A16_ASYM recipes, and the tensors as its compressor stores them."""
    out = make_model(tmp_path, preset="tiny", quantize=quantize)
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    symmetric = quantize == "w4a16"
    assert q == {
        "config_groups": {
            "group_0": {
                "format": "pack-quantized",
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {
                    "actorder": None,
                    "block_structure": None,
                    "dynamic": False,
                    "group_size": 32,
                    "num_bits": 4,
                    "observer": "memoryless_minmax",
                    "observer_kwargs": {},
                    "scale_dtype": None,
                    "strategy": "group",
                    "symmetric": symmetric,
                    "type": "int",
                    "zp_dtype": None if symmetric else "torch.int8",
                },
            }
        },
        "format": "pack-quantized",
        "global_compression_ratio": None,
        "ignore": ROUTERS,
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.19.0",
    }
    t = tensors(out)
    m = "model.layers.2.mlp.experts.3.up_proj"
    assert t[f"{m}.weight_packed"].dtype == torch.int32 and t[f"{m}.weight_packed"].shape == (32, 8)
    assert t[f"{m}.weight_scale"].dtype == torch.bfloat16 and t[f"{m}.weight_scale"].shape == (32, 2)
    assert t[f"{m}.weight_shape"].tolist() == [32, 64] and t[f"{m}.weight_shape"].dtype == torch.int64
    assert (f"{m}.weight_zero_point" in t) != symmetric
    if not symmetric:
        assert (
            t[f"{m}.weight_zero_point"].shape == (4, 2) and t[f"{m}.weight_zero_point"].dtype == torch.int32
        )
    assert t["model.layers.1.mlp.down_proj.weight_packed"].shape == (64, 12)  # the dense MLP, in=96
    assert t["model.layers.0.self_attn.o_proj.weight_scale"].shape == (64, 4)  # in = 4 heads x 32
    for plain in ("lm_head.weight", "model.layers.0.mlp.gate.weight", "model.embed_tokens.weight"):
        assert t[plain].dtype == torch.bfloat16
    index = json.loads((out / INDEX).read_text())["weight_map"]
    assert set(index) == set(t)


def test_nvfp4a16_written_as_llm_compressor(tmp_path: Path) -> None:
    """NVFP4A16's config, and its tensors: q/k/v and each gate/up share a global scale, as llm-compressor
    fuses them."""
    out = make_model(tmp_path, preset="tiny", quantize="nvfp4a16")
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q["format"] == "nvfp4-pack-quantized" and q["ignore"] == ROUTERS
    group = q["config_groups"]["group_0"]
    assert group["input_activations"] is None and group["weights"] == _NVFP4
    t = tensors(out)
    m = "model.layers.2.mlp.experts.3"
    assert t[f"{m}.up_proj.weight_packed"].dtype == torch.uint8 and t[f"{m}.up_proj.weight_packed"].shape == (
        32,
        32,
    )
    assert t[f"{m}.up_proj.weight_scale"].dtype == torch.float8_e4m3fn
    assert t[f"{m}.up_proj.weight_scale"].shape == (32, 4)
    assert torch.equal(t[f"{m}.up_proj.weight_global_scale"], t[f"{m}.gate_proj.weight_global_scale"])
    assert not torch.equal(t[f"{m}.up_proj.weight_global_scale"], t[f"{m}.down_proj.weight_global_scale"])
    attn = "model.layers.0.self_attn"
    assert torch.equal(t[f"{attn}.q_proj.weight_global_scale"], t[f"{attn}.v_proj.weight_global_scale"])
    assert f"{m}.up_proj.weight_shape" not in t and f"{m}.up_proj.input_global_scale" not in t


# --- loading -----------------------------------------------------------------------------------------------


def test_experts_dequantise_bit_for_bit(ct_dir: Path) -> None:
    """The resident experts (fp32) are compressed-tensors' dequantisation of the files; the published
    components are the files' bytes."""
    model = load_model(ct_dir, dtype=torch.float32)
    cfg = model.config
    experts = model.experts
    for layer in cfg.moe_layers:
        gate_up, down = _reference_experts(ct_dir, layer, cfg.num_experts)
        assert torch.equal(experts.weights[layer].gate_up, gate_up)
        assert torch.equal(experts.weights[layer].down, down)
    variant = _variant(ct_dir)
    if variant == "fp8-block":
        assert experts.published is None  # FP8 block experts load dequantised
        return
    name, layers = experts.published
    assert name == EXPERT_FORMATS[variant]
    comps = get_format(name).components(cfg.hidden_size, cfg.moe_intermediate_size)
    for layer in cfg.moe_layers:
        assert {k: (tuple(v.shape[1:]), v.dtype) for k, v in layers[layer].items()} == comps
    stored = tensors(ct_dir)["model.layers.2.mlp.experts.5.up_proj.weight_packed"]
    assert torch.equal(layers[2]["gate_up_weight_packed"][5, 32:], stored)


def test_dense_linears_dequantised(ct_dir: Path) -> None:
    """Attention and the dense MLP load as compressed-tensors dequantises them; the router as stored."""
    model = load_model(ct_dir, dtype=torch.float32)
    params = dict(model.named_parameters())
    t = tensors(ct_dir)
    for module in ("model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj"):
        target = next(k for k in params if k.endswith(module.removeprefix("model.") + ".weight"))
        assert torch.equal(params[target].detach(), _reference(t, module))


def test_published_only_keeps_no_dequantised_copy(ct_dir: Path) -> None:
    if _variant(ct_dir) == "fp8-block":
        pytest.skip("FP8 block experts load dequantised")
    model = load_model(ct_dir, dtype=torch.float32, published_only=True)
    assert model.experts.weights == {}
    assert sorted(model.experts.published[1]) == sorted(model.config.moe_layers)


def test_plan_counts_the_published_bytes(ct_dir: Path) -> None:
    plan = plan_for_dir(
        ct_dir, expert_format="bf16", budget_bytes=1 << 30, max_context=64, max_running=2, dtype=torch.float32
    )
    fmt = get_format(EXPERT_FORMATS.get(_variant(ct_dir), "bf16"))
    assert plan.expert_format == fmt.name and plan.expert_bytes == fmt.expert_nbytes(64, 32)


# --- against transformers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("expert_cache", [None, pytest.param("0.5", marks=pytest.mark.slow)])
def test_greedy_matches_transformers(ct_dir: Path, dequantized_dir: Path, expert_cache: str | None) -> None:
    """Spillway on the compressed-tensors checkpoint (experts resident, or from the host store of published
    bits through a cache of half of them) generates what transformers generates on the weights
    compressed-tensors dequantises."""
    assert_greedy_matches_transformers(ct_dir, dequantized_dir, expert_cache)


# --- errors name the file and the key ----------------------------------------------------------------------


def _faulty_keys(model_dir: Path) -> list[str]:
    """An expert's scale and packed weight, and a dense linear's (which loads dequantised)."""
    if _variant(model_dir) == "fp8-block":
        return ["model.layers.2.mlp.experts.4.gate_proj.weight_scale", "model.layers.1.mlp.down_proj.weight"]
    return [
        "model.layers.2.mlp.experts.4.gate_proj.weight_scale",
        "model.layers.2.mlp.experts.4.down_proj.weight_packed",
        "model.layers.1.mlp.down_proj.weight_scale",
        "model.layers.0.self_attn.q_proj.weight_packed",
    ]


@pytest.fixture
def ckpt(ct_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(ct_dir, tmp_path / "model"))


CHECKS = pytest.mark.parametrize("check", [load_model, check_checkpoint], ids=["load", "headers"])


def test_headers_check_passes(ct_dir: Path) -> None:
    check_checkpoint(ct_dir)


_MISTYPED = {
    torch.int32: torch.int64, torch.uint8: torch.int8, torch.bfloat16: torch.float32,
    torch.float8_e4m3fn: torch.bfloat16,
}  # fmt: skip
_MISTYPED_FP8 = {torch.float8_e4m3fn: torch.bfloat16, torch.bfloat16: torch.int32}  # any float scale will do


@CHECKS
@pytest.mark.parametrize("fault", ["truncated", "reshaped", "mistyped"])
def test_bad_tensor_refused(ckpt: Path, fault: str, check) -> None:
    mistyped = _MISTYPED_FP8 if _variant(ckpt) == "fp8-block" else _MISTYPED
    for key in _faulty_keys(ckpt):
        original = tensors(ckpt)[key]

        def change(t: dict, key: str = key) -> None:
            s = t[key]
            bad = {
                "truncated": lambda: s[..., :-1],
                "reshaped": lambda: s.reshape(-1),
                "mistyped": lambda: s.to(mistyped[s.dtype]),
            }
            t[key] = bad[fault]().clone()

        shard = edit_shard(ckpt, key, change)
        with pytest.raises(CheckpointError, match="dtype" if fault == "mistyped" else "shape") as err:
            check(ckpt)
        assert err.value.path == shard and err.value.key == key
        edit_shard(ckpt, key, lambda t, key=key, original=original: t.update({key: original}))


@CHECKS
def test_missing_tensor_refused(ckpt: Path, check) -> None:
    variant = _variant(ckpt)
    module = "model.layers.2.mlp.experts.4.up_proj"
    name = {
        "w4a16-asym": "weight_zero_point",
        "ct-nvfp4": "weight_global_scale",
        "nvfp4a16": "weight_global_scale",
    }
    key = f"{module}.{name.get(variant, 'weight_scale')}"
    edit_shard(ckpt, key, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=r"missing|without") as err:
        check(ckpt)
    assert err.value.key in (key, f"{module}.weight", f"{module}.weight_scale_inv")


def test_wrong_weight_shape_refused(ckpt: Path) -> None:
    """pack-quantized's `weight_shape` must name the linear's dims (read with the tensors)."""
    if not _variant(ckpt).startswith("w4a16"):
        pytest.skip("pack-quantized only")
    for key in (
        "model.layers.2.mlp.experts.1.down_proj.weight_shape",
        "model.layers.1.mlp.up_proj.weight_shape",
    ):
        shard = edit_shard(ckpt, key, lambda t, key=key: t.update({key: t[key].flip(0).clone()}))
        with pytest.raises(CheckpointError, match="weight_shape") as err:
            load_model(ckpt)
        assert err.value.path == shard and err.value.key == key
        edit_shard(ckpt, key, lambda t, key=key: t.update({key: t[key].flip(0).clone()}))


def test_truncated_file_refused(ckpt: Path) -> None:
    """A shard cut short (a download that stopped) is named."""
    shard = shard_of(ckpt, _faulty_keys(ckpt)[0])
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError) as err:
        load_model(ckpt)
    assert err.value.path == shard


def test_config_saved_by_transformers_5_loads(ckpt: Path) -> None:
    """transformers 5 saves a qwen3_moe config's expert count as `num_local_experts` (as llm-compressor's
    checkpoints then have it)."""
    config = json.loads((ckpt / "config.json").read_text())
    config["num_local_experts"] = config.pop("num_experts")
    (ckpt / "config.json").write_text(json.dumps(config))
    check_checkpoint(ckpt)
    assert load_model(ckpt, dtype=torch.float32).config.num_experts == 8


def test_unpacked_zero_points_of_older_checkpoints(ckpt: Path) -> None:
    """compressed-tensors before 0.10 wrote asymmetric zero points unpacked (int8 [out, in/group]): they
    load as the packed ones do."""
    if _variant(ckpt) != "w4a16-asym":
        pytest.skip("asymmetric W4A16 only")
    before = load_model(ckpt, dtype=torch.float32)
    for shard in sorted(ckpt.glob("*.safetensors")):
        tensors = load_file(shard)
        for key, t in list(tensors.items()):
            if key.endswith(".weight_zero_point"):
                rows = tensors[key.removesuffix("_zero_point") + "_shape"][0].item()
                tensors[key] = unpack_int32_rows(t, rows).contiguous()
        save_file(tensors, shard, metadata={"format": "pt"})
    check_checkpoint(ckpt)
    after = load_model(ckpt, dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(before.parameters(), after.parameters(), strict=True))
    for layer in before.config.moe_layers:
        assert torch.equal(before.experts.weights[layer].gate_up, after.experts.weights[layer].gate_up)
        packed = before.experts.published[1][layer]["down_weight_zero_point"]
        assert torch.equal(after.experts.published[1][layer]["down_weight_zero_point"], packed)

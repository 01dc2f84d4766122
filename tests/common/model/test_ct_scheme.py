"""Reading a compressed-tensors checkpoint's quantization_config (as llm-compressor writes it): each
supported scheme, its ignore list, and everything else refused naming its key and the supported list,
before the loader reads a tensor."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from common.model.ct_scheme import FP8, NVFP4, PACK
from common.model.errors import CheckpointError
from common.model.loader import check_checkpoint, load_model
from common.model.quantization import SUPPORTED, detect_quantization

_W4A16 = {
    "actorder": None, "block_structure": None, "dynamic": False, "group_size": 128, "num_bits": 4,
    "observer": "memoryless_minmax", "observer_kwargs": {}, "scale_dtype": None, "strategy": "group",
    "symmetric": True, "type": "int", "zp_dtype": None,
}  # fmt: skip
_NVFP4 = {
    "actorder": None, "block_structure": None, "dynamic": False, "group_size": 16, "num_bits": 4,
    "observer": "memoryless_minmax", "observer_kwargs": {}, "scale_dtype": "torch.float8_e4m3fn",
    "strategy": "tensor_group", "symmetric": True, "type": "float", "zp_dtype": None,
}  # fmt: skip
_NVFP4_ACTS = {**_NVFP4, "dynamic": "local", "observer": "static_minmax"}
_FP8_BLOCK = {**_W4A16, "num_bits": 8, "type": "float", "strategy": "block", "group_size": None,
              "block_structure": [128, 128]}  # fmt: skip
_FP8_ACTS = {**_W4A16, "num_bits": 8, "type": "float", "dynamic": True, "observer": None}


def quant(fmt: str, weights: dict[str, Any], acts: dict[str, Any] | None = None) -> dict[str, Any]:
    """A quantization_config as compressed-tensors' ModelCompressor writes it."""
    group = {
        "format": fmt, "input_activations": acts, "output_activations": None, "targets": ["Linear"],
        "weights": weights,
    }  # fmt: skip
    return {
        "config_groups": {"group_0": group}, "format": fmt, "global_compression_ratio": None,
        "ignore": ["model.layers.0.mlp.gate", "re:.*shared_expert_gate$", "lm_head"], "kv_cache_scheme": None,
        "quant_method": "compressed-tensors", "quantization_status": "compressed", "sparsity_config": {},
        "transform_config": {}, "version": "0.19.0",
    }  # fmt: skip


def _write(root: Path, q: dict[str, Any], dtype: str = "bfloat16") -> Path:
    config = {"model_type": "qwen3_moe", "torch_dtype": dtype, "quantization_config": q}
    (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.mark.parametrize(
    ("q", "fmt", "expert_format"),
    [
        (quant(PACK, _W4A16), PACK, "ct-w4a16"),
        (quant(PACK, {**_W4A16, "symmetric": False, "zp_dtype": "torch.int8"}), PACK, "ct-w4a16-asym"),
        (quant(PACK, {**_W4A16, "group_size": 32, "actorder": "weight"}), PACK, "ct-w4a16-g32"),
        (quant(NVFP4, _NVFP4), NVFP4, "ct-nvfp4a16"),
        (quant(NVFP4, _NVFP4, _NVFP4_ACTS), NVFP4, "ct-nvfp4"),
        (quant(FP8, _FP8_BLOCK, _FP8_ACTS), FP8, None),
    ],
    ids=["w4a16", "w4a16-asym", "w4a16-g32", "nvfp4a16", "nvfp4", "fp8-block"],
)
def test_supported(tmp_path: Path, q: dict, fmt: str, expert_format: str | None) -> None:
    scheme = detect_quantization(_write(tmp_path, q))
    assert scheme.method == "compressed-tensors" and scheme.ct is not None
    assert scheme.ct.format == fmt and scheme.expert_format == expert_format
    assert not scheme.quantizes("model.layers.0.mlp.gate") and not scheme.quantizes("lm_head")
    assert not scheme.quantizes("model.layers.3.mlp.shared_expert_gate")  # the re: pattern
    assert scheme.quantizes("model.layers.0.mlp.experts.3.gate_proj")


def test_fp16_model_keeps_fp16_scales(tmp_path: Path) -> None:
    scheme = detect_quantization(_write(tmp_path, quant(PACK, _W4A16), dtype="float16"))
    assert scheme.ct is not None and scheme.ct.scale_dtype == torch.float16
    assert scheme.expert_format == "ct-w4a16-fp16"


def test_older_frozen_status_accepted(tmp_path: Path) -> None:
    """Older compressed-tensors checkpoints say "frozen" of data their `format` packs."""
    q = quant(PACK, _W4A16)
    q["quantization_status"] = "frozen"
    assert detect_quantization(_write(tmp_path, q)).expert_format == "ct-w4a16"


def test_group_format_overrides_the_global_one(tmp_path: Path) -> None:
    q = quant(PACK, _W4A16)
    q["format"] = "mixed-precision"
    assert detect_quantization(_write(tmp_path, q)).expert_format == "ct-w4a16"


def _changed(change) -> dict[str, Any]:
    q = quant(PACK, _W4A16)
    change(q)
    return q


def _mixed(q: dict[str, Any]) -> None:
    second = {**copy.deepcopy(q["config_groups"]["group_0"]), "format": NVFP4, "weights": _NVFP4}
    q["config_groups"]["group_1"] = second


_Q = "quantization_config."
_G = _Q + "config_groups.group_0."
_CALIBRATING = _changed(lambda q: q.update(quantization_status="calibration"))
_SPARSE = _changed(lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask"}))
_ROTATED = _changed(lambda q: q.update(transform_config={"config_groups": {"r": {}}}))


@pytest.mark.parametrize(
    ("q", "key", "named"),
    [
        (quant("marlin-24", _W4A16), _G + "format", "marlin-24"),
        (quant(PACK, {**_W4A16, "num_bits": 8}), _G + "weights", "num_bits=8"),
        (quant(PACK, {**_W4A16, "strategy": "channel", "group_size": None}), _G + "weights", "channel"),
        (quant(PACK, {**_W4A16, "group_size": 256}), _G + "weights.group_size", "256"),
        (quant(PACK, {**_W4A16, "actorder": "group"}), _G + "weights.actorder", "'group'"),
        (quant(PACK, _W4A16, _FP8_ACTS), _G + "input_activations", "quantized activations"),
        (quant("int-quantized", _W4A16), _G + "format", "int-quantized"),
        (quant(FP8, {**_FP8_BLOCK, "strategy": "channel"}), _G + "weights", "strategy=channel"),
        (quant(FP8, {**_FP8_BLOCK, "block_structure": [128, 64]}), _G + "weights.block_structure", "64]"),
        (quant(FP8, _FP8_BLOCK, {**_FP8_ACTS, "dynamic": False}), _G + "input_activations", "static"),
        (quant(NVFP4, {**_NVFP4, "group_size": 32}), _G + "weights", "nvfp4-pack-quantized"),
        (quant("mxfp4-pack-quantized", _NVFP4), _G + "format", "mxfp4-pack-quantized"),
        (_CALIBRATING, _Q + "quantization_status", "calibration"),
        (_SPARSE, _Q + "sparsity_config", "sparsity"),
        (_ROTATED, _Q + "transform_config", "transform"),
        (_changed(_mixed), _Q + "config_groups", "mixed precision"),
    ],
)  # fmt: skip
def test_unsupported_refused_before_loading(tmp_path: Path, q: dict, key: str, named: str) -> None:
    """Detection, load_model and the header check all stop at config.json, naming the key."""
    if "format" in q["config_groups"]["group_0"] and key.endswith("group_0.format"):
        q["format"] = q["config_groups"]["group_0"]["format"]
    _write(tmp_path, q)
    for call in (detect_quantization, load_model, check_checkpoint):
        with pytest.raises(CheckpointError, match=named) as err:
            call(tmp_path)
        assert err.value.path == tmp_path / "config.json" and err.value.key == key
        assert all(name in str(err.value) for name in SUPPORTED)


def test_fp32_scales_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="float32") as err:
        detect_quantization(_write(tmp_path, quant(PACK, _W4A16), dtype="float32"))
    assert err.value.key == "torch_dtype"


def test_missing_groups_named(tmp_path: Path) -> None:
    q = quant(PACK, _W4A16)
    del q["config_groups"]
    with pytest.raises(CheckpointError) as err:
        detect_quantization(_write(tmp_path, q))
    assert err.value.key == "quantization_config.config_groups"

"""Reading a checkpoint's declared quantization: each supported form, the ignore lists in each tool's
syntax, and every other method or algorithm refused naming its file, key and the supported list."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.model.errors import CheckpointError
from common.model.loader import load_model
from common.model.quantization import MODELOPT_FILE, SUPPORTED, detect_quantization


def _write(root: Path, quant: dict | None = None, modelopt: dict | None = None) -> Path:
    config = {"model_type": "qwen3_moe"} | ({"quantization_config": quant} if quant is not None else {})
    (root / "config.json").write_text(json.dumps(config))
    if modelopt is not None:
        (root / MODELOPT_FILE).write_text(json.dumps(modelopt))
    return root


def test_unquantized(tmp_path: Path) -> None:
    scheme = detect_quantization(_write(tmp_path))
    assert scheme.method == "none" and scheme.expert_format is None
    assert not scheme.quantizes("model.layers.0.mlp.experts.0.gate_proj")


def test_fp8(tmp_path: Path) -> None:
    scheme = detect_quantization(
        _write(tmp_path, {"quant_method": "fp8", "modules_to_not_convert": ["lm_head"]})
    )
    assert scheme.method == "fp8" and scheme.expert_format is None
    assert scheme.source == tmp_path / "config.json"
    assert not scheme.quantizes("lm_head") and scheme.quantizes("model.layers.0.self_attn.q_proj")


def test_modelopt_file(tmp_path: Path) -> None:
    body = {
        "quant_algo": "NVFP4",
        "group_size": 16,
        "exclude_modules": ["lm_head", "model.layers.*.mlp.gate"],
    }
    scheme = detect_quantization(_write(tmp_path, modelopt={"producer": {}, "quantization": body}))
    assert scheme.method == "nvfp4" and scheme.expert_format == "nvfp4"
    assert scheme.source == tmp_path / MODELOPT_FILE
    assert not scheme.quantizes("model.layers.3.mlp.gate")
    assert scheme.quantizes("model.layers.3.mlp.experts.0.gate_proj")  # the router glob, not the experts


def test_modelopt_in_config_with_ignore(tmp_path: Path) -> None:
    quant = {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["model.layers.0.self_attn*"]}
    scheme = detect_quantization(_write(tmp_path, quant))
    assert scheme.expert_format == "nvfp4"
    assert not scheme.quantizes("model.layers.0.self_attn.o_proj")
    assert scheme.quantizes("model.layers.1.self_attn.o_proj")


def test_mxfp4_and_pattern_forms(tmp_path: Path) -> None:
    quant = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.embed_tokens", r"re:.*\.mlp\.gate$"]}
    scheme = detect_quantization(_write(tmp_path, quant))
    assert scheme.expert_format == "mxfp4"
    assert not scheme.quantizes("model.embed_tokens")  # a name
    assert scheme.quantizes("model.embed_tokens_extra")  # a name covers submodules, not other names
    assert not scheme.quantizes("model.layers.7.mlp.gate")  # compressed-tensors' re: form
    assert scheme.quantizes("model.layers.7.mlp.gate_proj")


@pytest.mark.parametrize(
    ("quant", "named"),
    [
        ({"quant_method": "hqq"}, "'hqq'"),
        ({"quant_method": "eetq"}, "'eetq'"),
        ({"quant_method": "bitsandbytes"}, "'bitsandbytes'"),
        ({"quant_method": "modelopt", "quant_algo": "FP8"}, "'FP8'"),
    ],
)
def test_other_methods_are_refused_before_loading(tmp_path: Path, quant: dict, named: str) -> None:
    _write(tmp_path, quant)
    key = "quantization_config." + ("quant_algo" if "quant_algo" in quant else "quant_method")
    for call in (detect_quantization, load_model):  # the loader stops there, before reading any tensor
        with pytest.raises(CheckpointError, match=named) as err:
            call(tmp_path)
        assert err.value.path == tmp_path / "config.json" and err.value.key == key
        assert all(name in str(err.value) for name in SUPPORTED)


def test_modelopt_file_algorithm_refused(tmp_path: Path) -> None:
    _write(tmp_path, modelopt={"quantization": {"quant_algo": "W4A8_AWQ"}})
    with pytest.raises(CheckpointError, match="W4A8_AWQ") as err:
        detect_quantization(tmp_path)
    assert err.value.path == tmp_path / MODELOPT_FILE and err.value.key == "quantization.quant_algo"


@pytest.mark.parametrize(
    ("quant", "key"),
    [
        ({"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"}, "modules_to_not_convert"),
        ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}, "group_size"),
    ],
)
def test_malformed_fields_named(tmp_path: Path, quant: dict, key: str) -> None:
    _write(tmp_path, quant)
    with pytest.raises(CheckpointError) as err:
        detect_quantization(tmp_path)
    assert err.value.key == "quantization_config." + key

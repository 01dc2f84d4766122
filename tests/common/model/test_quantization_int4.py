"""Reading GPTQ and AWQ quantization_config: the expert format named by method, zero convention and group
size, the ignore lists in each tool's syntax, and each unsupported field refused naming its key (and, for
a method's variant, the supported list)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.model.errors import CheckpointError
from common.model.loader import load_model
from common.model.quantization import SUPPORTED, detect_quantization


def _write(root: Path, quant: dict) -> Path:
    (root / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "quantization_config": quant}))
    return root


GPTQMODEL = {
    "bits": 4,
    "group_size": 128,
    "desc_act": True,
    "sym": True,
    "lm_head": False,
    "quant_method": "gptq",
    "checkpoint_format": "gptq",
    "pack_dtype": "int32",
    "meta": {"quantizer": ["gptqmodel:4.2.5"]},
}
AUTOAWQ = {
    "quant_method": "awq",
    "zero_point": True,
    "group_size": 128,
    "bits": 4,
    "version": "gemm",
    "modules_to_not_convert": None,
}


def test_gptq(tmp_path: Path) -> None:
    scheme = detect_quantization(_write(tmp_path, GPTQMODEL))
    assert scheme.method == "gptq" and scheme.expert_format == "gptq" and scheme.ignore == ()
    assert scheme.quantizes("model.layers.0.mlp.experts.0.gate_proj")
    autogptq = {"bits": 4, "group_size": 32, "desc_act": False, "sym": False, "quant_method": "gptq"}
    assert detect_quantization(_write(tmp_path, autogptq)).expert_format == "gptq-g32"  # no format: v1
    v2 = GPTQMODEL | {"checkpoint_format": "gptq_v2", "group_size": -1}
    assert detect_quantization(_write(tmp_path, v2)).expert_format == "gptq_v2-g-1"


def test_gptq_dynamic_skips(tmp_path: Path) -> None:
    quant = GPTQMODEL | {"dynamic": {r"-:.*\.mlp\.gate$": {}}, "modules_to_not_convert": ["lm_head"]}
    scheme = detect_quantization(_write(tmp_path, quant))
    assert not scheme.quantizes("model.layers.3.mlp.gate") and not scheme.quantizes("lm_head")
    assert scheme.quantizes("model.layers.3.mlp.gate_proj")


def test_awq_and_its_substring_names(tmp_path: Path) -> None:
    scheme = detect_quantization(_write(tmp_path, AUTOAWQ | {"group_size": 64, "version": "GEMM"}))
    assert scheme.method == "awq" and scheme.expert_format == "awq-g64"
    scheme = detect_quantization(_write(tmp_path, AUTOAWQ | {"modules_to_not_convert": ["mlp.gate"]}))
    assert scheme.expert_format == "awq"
    assert not scheme.quantizes("model.layers.7.mlp.gate")  # AutoAWQ and transformers match substrings
    assert not scheme.quantizes("model.layers.7.mlp.gate_proj")
    assert scheme.quantizes("model.layers.7.mlp.experts.0.gate_proj")


@pytest.mark.parametrize(
    ("quant", "key", "named"),
    [
        (GPTQMODEL | {"bits": 8}, "bits", "bits 8"),
        (GPTQMODEL | {"bits": 3}, "bits", "bits 3"),
        (AUTOAWQ | {"bits": 8}, "bits", "bits 8"),
        (GPTQMODEL | {"checkpoint_format": "marlin"}, "checkpoint_format", "'marlin'"),
        (GPTQMODEL | {"checkpoint_format": "bitblas"}, "checkpoint_format", "'bitblas'"),
        (GPTQMODEL | {"is_marlin_format": True}, "is_marlin_format", "Marlin"),
        (GPTQMODEL | {"pack_dtype": "int16"}, "pack_dtype", "'int16'"),
        (GPTQMODEL | {"dynamic": {r"+:.*down_proj": {"bits": 8}}}, "dynamic", "down_proj"),
        (AUTOAWQ | {"version": "gemv"}, "version", "'gemv'"),
        (AUTOAWQ | {"version": "gemv_fast"}, "version", "'gemv_fast'"),
        (AUTOAWQ | {"version": "exllama"}, "version", "'exllama'"),
        (AUTOAWQ | {"version": "marlin"}, "version", "'marlin'"),
        (AUTOAWQ | {"zero_point": False}, "zero_point", "zero_point"),
    ],
)
def test_unsupported_variants_refused_before_loading(
    tmp_path: Path, quant: dict, key: str, named: str
) -> None:
    _write(tmp_path, quant)
    for call in (detect_quantization, load_model):  # the loader stops there, before reading any tensor
        with pytest.raises(CheckpointError, match=named) as err:
            call(tmp_path)
        assert err.value.path == tmp_path / "config.json" and err.value.key == f"quantization_config.{key}"
        assert all(name in str(err.value) for name in SUPPORTED)


@pytest.mark.parametrize(
    ("quant", "key"),
    [
        (GPTQMODEL | {"group_size": 0}, "group_size"),
        (GPTQMODEL | {"group_size": "128"}, "group_size"),
        (GPTQMODEL | {"desc_act": "yes"}, "desc_act"),
        (AUTOAWQ | {"modules_to_not_convert": "gate"}, "modules_to_not_convert"),
    ],
)
def test_malformed_fields_named(tmp_path: Path, quant: dict, key: str) -> None:
    _write(tmp_path, quant)
    with pytest.raises(CheckpointError) as err:
        detect_quantization(tmp_path)
    assert err.value.key == "quantization_config." + key

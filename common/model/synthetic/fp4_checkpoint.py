"""The NVFP4 and MXFP4 variants of a synthetic checkpoint: routed experts as the producing tools write them,
every other tensor unquantized.

- nvfp4 (ModelOpt's export of a MoE): each expert linear `X.weight` becomes `X.weight` (packed e2m1),
  `X.weight_scale`, `X.weight_scale_2` and `X.input_scale` (common/experts/fp4_formats.py);
  `hf_quant_config.json` names the algorithm and the excluded modules (attention, router gates, lm_head),
  and config.json's `quantization_config` repeats it in the llm-compressor form ModelOpt also writes.
- mxfp4 (gpt-oss's release): a layer's experts fused as `experts.gate_up_proj_blocks` / `_scales`
  [E, 2I, H/32, (16)] and `experts.down_proj_blocks` / `_scales` (qwen3_moe's fused module names, gate rows
  before up rows); config.json's `quantization_config` {"quant_method": "mxfp4", "modules_to_not_convert"}.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch

from common.model.fp4_blocks import NVFP4_GROUP, quantize_mxfp4, quantize_nvfp4
from common.model.synthetic.config import text_config

FP4_QUANTIZE = ("nvfp4", "mxfp4")
MODELOPT_PRODUCER = {"name": "modelopt", "version": "0.39.0"}
"""The ModelOpt version whose export layout the nvfp4 writer follows."""
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def _excluded(cfg: Mapping[str, Any], router: str) -> list[str]:
    """The modules left unquantized: lm_head, each layer's attention and router (`router`: its name)."""
    layers = text_config(cfg)["num_hidden_layers"]
    per_layer = [[f"model.layers.{i}.self_attn*", f"model.layers.{i}.mlp.{router}"] for i in range(layers)]
    return ["lm_head", *(m for pair in per_layer for m in pair)]


def fp4_quantization(cfg: Mapping[str, Any], quantize: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json's quantization_config, extra JSON files by name) for the `quantize` variant."""
    if quantize == "mxfp4":
        skip = ["model.layers.*.self_attn", "model.layers.*.mlp.gate", "model.embed_tokens", "lm_head"]
        return {"quant_method": "mxfp4", "modules_to_not_convert": skip}, {}
    exclude = _excluded(cfg, "gate")
    modelopt = {
        "producer": MODELOPT_PRODUCER,
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": NVFP4_GROUP,
            "exclude_modules": exclude,
        },
    }
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": NVFP4_GROUP}
    config = {
        "config_groups": {"group_0": {"input_activations": fp4, "weights": fp4, "targets": ["Linear"]}},
        "ignore": exclude,
        "quant_algo": "NVFP4",
        "producer": MODELOPT_PRODUCER,
        "quant_method": "modelopt",
    }
    return config, {"hf_quant_config.json": modelopt}


class Fp4Writer:
    """Turns a checkpoint's planned tensors, one at a time, into those the `quantize` variant stores."""

    def __init__(self, cfg: Mapping[str, Any], quantize: str) -> None:
        self.quantize = quantize
        self.num_experts = text_config(cfg)["num_experts"]
        self.pending: dict[int, dict[tuple[int, str], torch.Tensor]] = defaultdict(dict)

    def stored(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors to store for the planned `key` (mxfp4: none until a layer's last expert arrives)."""
        m = _EXPERT.match(key)
        if m is None:
            return {key: tensor}
        if self.quantize == "nvfp4":
            module = key.removesuffix(".weight")
            weight, scale, scale_2 = quantize_nvfp4(tensor)
            return {
                key: weight,
                f"{module}.weight_scale": scale,
                f"{module}.weight_scale_2": scale_2,
                f"{module}.input_scale": torch.ones(()),  # no activations calibrated
            }
        layer = int(m[1])
        self.pending[layer][(int(m[2]), m[3])] = tensor
        if len(self.pending[layer]) < 3 * self.num_experts:
            return {}
        return self._fused(layer, self.pending.pop(layer))

    def _fused(self, layer: int, parts: dict[tuple[int, str], torch.Tensor]) -> dict[str, torch.Tensor]:
        experts = range(self.num_experts)
        gate_up = torch.stack([torch.cat([parts[(e, "gate")], parts[(e, "up")]]) for e in experts])
        down = torch.stack([parts[(e, "down")] for e in experts])
        out: dict[str, torch.Tensor] = {}
        for name, w in (("gate_up", gate_up), ("down", down)):
            prefix = f"model.layers.{layer}.mlp.experts.{name}_proj"
            out[f"{prefix}_blocks"], out[f"{prefix}_scales"] = quantize_mxfp4(w)
        return out

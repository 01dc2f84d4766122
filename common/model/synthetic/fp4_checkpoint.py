"""The NVFP4 and MXFP4 variants of a synthetic checkpoint, written as the producing tools write them.

- nvfp4 (ModelOpt's export of a MoE): each linear `X.weight` but the excluded ones (attention, router gates,
  lm_head; the embedding is no linear) becomes `X.weight` (packed e2m1), `X.weight_scale`,
  `X.weight_scale_2` and `X.input_scale` (common/model/fp4_blocks.py); `hf_quant_config.json` names the
  algorithm and the excluded modules, and config.json's `quantization_config` repeats them in the
  llm-compressor form ModelOpt also writes.
- mxfp4 (gpt-oss's release): only the routed experts, a layer's fused as `experts.gate_up_proj_blocks` /
  `_scales` [E, 2I, H/32, (16)] and `experts.down_proj_blocks` / `_scales` (qwen3_moe's fused module names,
  gate rows before up rows); config.json's `quantization_config` {"quant_method": "mxfp4",
  "modules_to_not_convert"}.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch

from common.model.fp4_blocks import NVFP4_GROUP, quantize_mxfp4, quantize_nvfp4
from common.model.quantization import matches_any
from common.model.synthetic.config import text_config
from common.model.synthetic.quantized_linears import QWEN4_KEPT, is_qwen4

FP4_QUANTIZE = ("nvfp4", "mxfp4")
MODELOPT_PRODUCER = {"name": "modelopt", "version": "0.39.0"}
"""The ModelOpt version whose export layout the nvfp4 writer follows."""
_EXPERT = re.compile(
    r"^(model\.(?:language_model\.)?layers)\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$"
)


def _excluded(cfg: Mapping[str, Any]) -> list[str]:
    """The modules ModelOpt leaves unquantized in a MoE: lm_head, each layer's attention, its router (and
    qwen2_moe's shared-expert gate); in qwen4_exp (NVFP4_DEFAULT_CFG's exclusions with the Qwen3.5 recipes'
    GDN ones) those of quantized_linears.QWEN4_KEPT, attention quantized."""
    if is_qwen4(cfg):
        return list(QWEN4_KEPT)
    moe = "block_sparse_moe" if cfg.get("model_type") == "mixtral" else "mlp"
    names = [
        "self_attn*",
        f"{moe}.gate",
        *(["mlp.shared_expert_gate"] if cfg.get("model_type") == "qwen2_moe" else []),
    ]
    layers = range(text_config(cfg)["num_hidden_layers"])
    return ["lm_head", *(f"model.layers.{i}.{name}" for i in layers for name in names)]


def fp4_quantization(cfg: Mapping[str, Any], quantize: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json's quantization_config, extra JSON files by name) for the `quantize` variant."""
    if quantize == "mxfp4":
        skip = ["model.layers.*.self_attn", "model.layers.*.mlp.gate", "model.embed_tokens", "lm_head"]
        if is_qwen4(cfg):  # only the routed experts are converted
            skip = ["*.self_attn", "*.linear_attn", "*.mlp.shared_expert", *QWEN4_KEPT]
        return {"quant_method": "mxfp4", "modules_to_not_convert": skip}, {}
    exclude = _excluded(cfg)
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
        self.excluded = _excluded(cfg)
        self.pending: dict[int, dict[tuple[int, str], torch.Tensor]] = defaultdict(dict)

    def _nvfp4(self, key: str, tensor: torch.Tensor) -> bool:
        """Whether ModelOpt stores this tensor in NVFP4: a linear's weight that its exclude list spares."""
        module = key.removesuffix(".weight")
        linear = tensor.dim() == 2 and key.endswith(".weight") and not key.endswith("embed_tokens.weight")
        return linear and not matches_any(self.excluded, module)

    def stored(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors to store for the planned `key` (mxfp4: none until a layer's last expert arrives)."""
        m = _EXPERT.match(key)
        if self.quantize == "nvfp4" and self._nvfp4(key, tensor):
            module = key.removesuffix(".weight")
            weight, scale, scale_2 = quantize_nvfp4(tensor)
            return {
                key: weight,
                f"{module}.weight_scale": scale,
                f"{module}.weight_scale_2": scale_2,
                f"{module}.input_scale": torch.ones(()),  # no activations calibrated
            }
        if m is None or self.quantize == "nvfp4":
            return {key: tensor}
        layer = int(m[2])
        self.pending[layer][(int(m[3]), m[4])] = tensor
        if len(self.pending[layer]) < 3 * self.num_experts:
            return {}
        return self._fused(f"{m[1]}.{layer}", self.pending.pop(layer))

    def _fused(self, layer: str, parts: dict[tuple[int, str], torch.Tensor]) -> dict[str, torch.Tensor]:
        experts = range(self.num_experts)
        gate_up = torch.stack([torch.cat([parts[(e, "gate")], parts[(e, "up")]]) for e in experts])
        down = torch.stack([parts[(e, "down")] for e in experts])
        out: dict[str, torch.Tensor] = {}
        for name, w in (("gate_up", gate_up), ("down", down)):
            prefix = f"{layer}.mlp.experts.{name}_proj"
            out[f"{prefix}_blocks"], out[f"{prefix}_scales"] = quantize_mxfp4(w)
        return out

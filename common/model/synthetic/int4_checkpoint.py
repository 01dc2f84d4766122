"""The GPTQ and AWQ variants of a synthetic checkpoint, as GPTQModel and AutoAWQ write them (int4_blocks.py),
the codes by round to nearest.

- gptq / gptq-desc-act (GPTQModel 4.2.5, checkpoint_format "gptq", sym, `desc_act` false / true): each
  decoder layer's attention and MLP linears become
  `X.qweight`, `X.qzeros`, `X.scales` and `X.g_idx`; routers, lm_head and the embedding stay as they are
  With desc_act the inputs fill the groups by the weight's
  column norms, largest first (GPTQ's Hessian order, without calibration data). config.json's
  `quantization_config` and `quantize_config.json` hold GPTQModel's fields.
- awq (AutoAWQ, GEMM, zero_point): every linear of each decoder layer but those `modules_to_not_convert`
  names as substrings ("mlp.gate") becomes
  `X.qweight`, `X.qzeros` and `X.scales`; config.json's `quantization_config` as AutoAWQ writes it.

The group size is 128 where every quantized input dim allows it, else the largest of 64, 32, 16 that does,
else -1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from common.model.int4_blocks import quantize_linear
from common.model.synthetic.plan import plan_tensors
from common.model.synthetic.quantized_linears import LAYER_LINEAR, converted, is_qwen4

INT4_QUANTIZE = ("gptq", "gptq-desc-act", "awq")
GPTQMODEL_VERSION = "4.2.5"
"""The GPTQModel release whose config fields the gptq writer follows."""
_GROUPS = (128, 64, 32, 16)


def _awq_skipped(cfg: Mapping[str, Any]) -> list[str]:
    """AutoAWQ's modules_to_not_convert for a MoE: the router (qwen2_moe: and the shared-expert gate, whose
    single output no int32 word can hold; qwen4_exp: every module of quantized_linears.QWEN4_KEPT inside
    a layer)."""
    if is_qwen4(cfg):
        return ["mlp.gate", "mlp.shared_expert_gate", "in_proj_a", "in_proj_b", "hyper_connection", ".ple."]
    router = "block_sparse_moe.gate" if cfg.get("model_type") == "mixtral" else "mlp.gate"
    return [router, *(["mlp.shared_expert_gate"] if cfg.get("model_type") == "qwen2_moe" else [])]


def quantized(quantize: str, cfg: Mapping[str, Any], key: str, shape: tuple[int, ...]) -> bool:
    """Whether the `quantize` variant stores the planned tensor `key` as int4."""
    m = LAYER_LINEAR.match(key)
    if m is None or not converted(cfg, key, shape):
        return False
    if quantize == "awq":
        return not any(name in m[1] for name in _awq_skipped(cfg))  # AutoAWQ matches substrings
    return True


def group_size(quantize: str, cfg: Mapping[str, Any]) -> int:
    """The group size the variant uses for `cfg` (see the module's docstring)."""
    dims = {s.shape[1] for s in plan_tensors(cfg) if quantized(quantize, cfg, s.key, tuple(s.shape))}
    return next((g for g in _GROUPS if all(d % g == 0 for d in dims)), -1)


def int4_quantization(cfg: Mapping[str, Any], quantize: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json's quantization_config, extra JSON files by name) for the `quantize` variant."""
    group = group_size(quantize, cfg)
    if quantize == "awq":
        config = {
            "quant_method": "awq",
            "zero_point": True,
            "group_size": group,
            "bits": 4,
            "version": "gemm",
            "modules_to_not_convert": _awq_skipped(cfg),
        }
        return config, {}
    meta = {
        "quantizer": [f"gptqmodel:{GPTQMODEL_VERSION}"],
        "uri": "https://github.com/modelcloud/gptqmodel",
        "damp_percent": 0.05,
        "damp_auto_increment": 0.01,
        "static_groups": False,
        "true_sequential": True,
        "mse": 0.0,
        "v2": False,
        "v2_alpha": 0.25,
        "act_group_aware": False,
    }
    config = {
        "bits": 4,
        "group_size": group,
        "desc_act": quantize == "gptq-desc-act",
        "sym": True,
        "lm_head": False,
        "quant_method": "gptq",
        "checkpoint_format": "gptq",
        "pack_dtype": "int32",
        "meta": meta,
    }
    return config, {"quantize_config.json": config}


class Int4Writer:
    """Turns a checkpoint's planned tensors, one at a time, into those the `quantize` variant stores."""

    def __init__(self, cfg: Mapping[str, Any], quantize: str) -> None:
        self.cfg, self.quantize = cfg, quantize
        self.method = "awq" if quantize == "awq" else "gptq"
        self.group = group_size(quantize, cfg)

    def stored(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if not quantized(self.quantize, self.cfg, key, tuple(tensor.shape)):
            return {key: tensor}
        perm = None
        if self.quantize == "gptq-desc-act":
            norms = tensor.float().pow(2).sum(dim=0)
            perm = torch.argsort(norms, descending=True, stable=True)
        module = key.removesuffix(".weight")
        parts = quantize_linear(self.method, tensor, self.group, sym=True, perm=perm)
        return {f"{module}.{name}": t for name, t in parts.items()}

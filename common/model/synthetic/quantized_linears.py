"""Which linears a quantizing tool converts in each family's checkpoint (the writers' shared rule).

A decoder layer's linears are converted; everything outside the layers (embedding, head, vision tower, MTP
head, qwen4_exp's final stream mixer) stays as it is. Inside the layers each tool spares the routers, and in
qwen4_exp also the modules the Qwen3.5 recipes leave in bf16 (Gated DeltaNet's tiny `in_proj_a` /
`in_proj_b`) and qwen4_exp's own low-rank stream mixers and PLE projections (`QWEN4_KEPT`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from common.model.quantization import matches_any

LAYER_LINEAR = re.compile(r"^model\.(?:language_model\.)?layers\.\d+\.(.+)\.weight$")
"""A decoder layer's weight; group 1 is its module path inside the layer."""
ROUTERS = ("mlp.gate", "block_sparse_moe.gate", "mlp.shared_expert_gate")
"""Router modules inside a layer, kept by every tool (GPTQModel's "!" modules, ModelOpt's defaults)."""
QWEN4_KEPT = (
    "model.visual*",
    "mtp.*",
    "lm_head",
    "*embed_tokens",
    "*.mlp.gate",
    "*.mlp.shared_expert_gate",
    "*.linear_attn.in_proj_a",
    "*.linear_attn.in_proj_b",
    "*hyper_connection*",
    "*.ple.*",
)
"""qwen4_exp modules every writer leaves unquantized (glob patterns over module names)."""


def is_qwen4(cfg: Mapping[str, Any]) -> bool:
    return cfg.get("model_type") == "qwen4_exp"


def converted(cfg: Mapping[str, Any], key: str, shape: tuple[int, ...]) -> bool:
    """Whether a tool converts the planned 2-D weight `key` of `cfg`'s checkpoint (see the module doc)."""
    m = LAYER_LINEAR.match(key)
    if m is None or len(shape) != 2 or m[1] in ROUTERS:
        return False
    return not (is_qwen4(cfg) and matches_any(QWEN4_KEPT, key.removesuffix(".weight")))

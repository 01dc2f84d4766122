"""What decode exports and prefill maps (DESIGN §3): resident weights, routed experts held resident, and the
state pools — one copy of each, owned by decode.

Export names: `weights.{parameter or buffer}`, `experts.{layer}.{gate_up|down}` (resident experts),
`state.{layer}.{name}` (state pools).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from common import ipc
from common.config import WorkerConfig
from common.experts.provider import ExpertWeights
from common.experts.resident import ResidentExperts
from common.experts.routing import install_routing_hook, replayer_for
from common.model.hf_config import load_architecture
from common.model.layers import activation
from common.protocol import Exports
from common.workers.decode import DTYPES, DecodeCore


def shared_allocator(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed tensor another process can map (state pools)."""
    return ipc.shared_empty(shape, dtype, device).zero_()


def _shareable(t: torch.Tensor) -> torch.Tensor:
    if ipc.is_exportable(t):
        return t
    return ipc.shared_empty(t.shape, t.dtype, t.device).copy_(t)


def decode_exports(core: DecodeCore) -> Exports:
    """Move decode's weights into exportable memory (a no-op on CUDA) and export them with the pools."""
    model = core.engine.model
    tensors = {f"weights.{k}": v for k, v in ipc.share_module(model).items()}
    experts = model.experts
    if isinstance(experts, ResidentExperts):
        for layer, w in experts.weights.items():
            w.gate_up, w.down = _shareable(w.gate_up), _shareable(w.down)
            tensors[f"experts.{layer}.gate_up"] = ipc.export_tensor(w.gate_up)
            tensors[f"experts.{layer}.down"] = ipc.export_tensor(w.down)
    else:
        raise NotImplementedError("serving offloaded experts across processes is not wired yet")
    for key, t in core.pool.named_tensors().items():
        tensors[f"state.{key}"] = ipc.export_tensor(t)
    return Exports(
        epoch=os.getpid(), tensors=tensors, page_size=core.pool.page_size, max_context=core.runner.max_context
    )


def prefill_model(cfg: WorkerConfig, exports: Exports) -> tuple[nn.Module, dict[str, torch.Tensor], tuple]:
    """Build the model on decode's exported weights: (model, state pool tensors by key, eos token ids)."""
    arch, mcfg = load_architecture(cfg.model_dir)
    imported = ipc.import_tensors(exports.tensors)
    experts = ResidentExperts({}, activation(mcfg.hidden_act))
    with torch.device("meta"):
        model = arch.build(mcfg, experts)
    model = model.to(DTYPES[cfg.dtype])
    ipc.attach_module(model, {k[8:]: v for k, v in imported.items() if k.startswith("weights.")})
    for layer in mcfg.moe_layers:
        experts.weights[layer] = ExpertWeights(
            imported[f"experts.{layer}.gate_up"], imported[f"experts.{layer}.down"]
        )
    if cfg.replay_routing:
        layers = sorted(mcfg.moe_layers)
        install_routing_hook(model, replayer_for(cfg.replay_routing, layers, mcfg.num_experts, mcfg.top_k))
    pools = {k[6:]: v for k, v in imported.items() if k.startswith("state.")}
    return model.eval(), pools, tuple(mcfg.eos_token_ids)

"""The sparse MoE block: router, top-k choice, routed experts through a provider, optional shared expert."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from common.config import ModelConfig
from common.kernels.config import KERNELS, KernelConfig
from common.model.fused_linear import FusedLinears, Linear, fuse_linears, plain_linear, project
from common.model.layers import GatedMLP
from common.model.provider import ExpertProvider

if TYPE_CHECKING:
    from common.experts.routing import RoutingHook


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (fp32) over experts, top-k, optional renormalisation → (weights [T, k] fp32, ids [T, k])."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_grouped(
    logits: torch.Tensor, bias: torch.Tensor, cfg: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ModelConfig.router` "sigmoid-grouped" → (weights [T, k] fp32, ids [T, k]): groups ranked by the sum
    of their two best biased scores, experts chosen among the top `topk_group` groups by biased score,
    weighted by their unbiased sigmoid (renormalised if `norm_topk_prob`) times `routed_scaling_factor`."""
    scores = torch.sigmoid(logits.float())  # [T, E]
    biased = scores + bias.float()
    t, e = biased.shape
    groups = biased.view(t, cfg.n_group, e // cfg.n_group)  # [T, G, E/G]
    best = groups.topk(min(2, e // cfg.n_group), dim=-1).values.sum(-1)  # [T, G]
    kept = torch.zeros_like(best).scatter_(1, best.topk(cfg.topk_group, dim=-1).indices, 1.0)
    allowed = kept.bool()[:, :, None].expand_as(groups).reshape(t, e)
    ids = biased.masked_fill(~allowed, float("-inf")).topk(cfg.top_k, dim=-1).indices  # [T, k]
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


class SparseMoeBlock(nn.Module):
    """Routed experts (through `experts`) plus, for Qwen2-MoE, a sigmoid-gated shared expert."""

    fused_decode = False
    """Route with one Triton kernel (common/kernels/routing.py; a few rows' with the routing replay and the
    shared expert's down beside it: moe_dispatch.py). Set by `use_fused_kernels`."""

    fused_in: FusedLinears | None = None
    """The router and the shared expert's gate, up and gate logit as one GEMM (`fuse_projections`)."""

    ahead: SparseMoeBlock | None = None
    """The next MoE block, whose experts this block's input predicts (`install_lookahead`); None: no guess."""
    ahead_experts = 0
    """Experts a token the guess names (the next layer's router's top-n on this block's input)."""

    kernels: KernelConfig = KERNELS
    """The kernel forms and launch options (set where the worker builds the model: `configure_kernels`)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, experts: ExpertProvider) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.top_k, self.normalize = cfg.top_k, cfg.norm_topk_prob
        self.weights_fp32 = cfg.router_weights_fp32
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.grouped = cfg if cfg.router == "sigmoid-grouped" else None
        """The sigmoid-grouped router's settings (torch only: the fused routing kernels are softmax's)."""
        if self.grouped is not None:
            self.score_bias = nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)
        self.experts = experts
        self.routing_hook: RoutingHook | None = None
        """Records or replays the router's choices (common/experts/routing.py)."""
        self.shared_expert = None
        self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size > 0:
            self.shared_expert = GatedMLP(
                cfg.hidden_size, cfg.shared_expert_intermediate_size, cfg.hidden_act
            )
            if cfg.shared_expert_gated:
                self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def _inputs(self) -> tuple[nn.Linear, ...]:
        """The Linears that read the block's input: the router, then the shared expert's."""
        mlp, gate = self.shared_expert, self.shared_expert_gate
        shared = () if mlp is None else (mlp.gate_proj, mlp.up_proj)
        return (self.gate, *shared, *(() if gate is None else (gate,)))

    def fuse_projections(self, copy: bool = True) -> bool:
        """Run the router and the shared expert's input projections as one GEMM from now on (see
        common/model/fused_linear.py): the shared expert's part of it is done before the experts' copies
        are launched, its down projection still while they run."""
        if self.shared_expert is None:
            return False
        self.fused_in = fuse_linears(self._inputs(), copy)
        return self.fused_in is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_in is not None:
            logits, *shared_in = self.fused_in(x)
        else:
            logits, shared_in = self.gate(x), None
        dtype = torch.float32 if self.weights_fp32 else x.dtype  # fused kernels round in the kernel
        with self.experts.turn(self.layer_idx):  # a grouped pass's groups replay and resolve in turn
            dispatched = self._dispatch(logits, shared_in, dtype)  # the shared expert too, maybe
            weights, ids, shared = dispatched or (*self._route(logits, dtype), None)
            prepared = self.experts.prepare(self.layer_idx, ids)  # launches the misses' copies
        if not self.weights_fp32:
            weights = weights.to(x.dtype)
        if self.ahead is not None and self.kernels.lookahead:  # the next layer's guess: copies queue behind
            self.experts.lookahead(self.ahead.layer_idx, x, self._predict_next)
        shared, shared_gate = self._shared(x, shared_in, shared)  # (if not dispatched) while the copies run
        settled = dispatched is None and shared is not None  # its kernels came after the routing's
        return self.experts.compute(self.layer_idx, prepared, x, ids, weights, shared, shared_gate, settled)

    def _route(self, logits: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts' (weights, ids) [T, k]: the router's choice, then the routing hook's."""
        if self.grouped is not None:
            weights, ids = route_grouped(logits, self.score_bias, self.grouped)
        elif self.fused_decode:
            from common.kernels.routing import route_fused  # Triton

            top = (logits, self.top_k, self.normalize, dtype)
            weights, ids = route_fused(*top, kernels=self.kernels)  # [T, k] each
        else:
            weights, ids = route(logits, self.top_k, self.normalize)
        if self.routing_hook is not None:
            ids, weights = self.routing_hook(self.layer_idx, ids, weights)
        return weights, ids

    def _dispatch(
        self, logits: torch.Tensor, shared_in: list[torch.Tensor] | None, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """(weights, ids, the shared expert or None) from one kernel (common/kernels/moe_dispatch.py): a few
        rows with the fused kernels, and a replay on the device or a shared expert to run beside the router's
        choice. None: not this pass (`_route` and `_shared` then)."""
        if not self.fused_decode or self.grouped is not None:  # before the imports: they import Triton
            return None
        from common.kernels import moe_dispatch
        from common.kernels.gated_mlp import DOWN_ROWS

        if not self.kernels.moe_dispatch or logits.shape[0] > DOWN_ROWS:
            return None
        hook = self.routing_hook
        replay = None if hook is None else hook.device_rows(self.layer_idx, logits.device)
        if hook is not None and replay is None:  # a hook to call (a recorder)
            return None
        shared = None
        if self._shared_fits(shared_in):
            assert shared_in is not None and self.shared_expert is not None  # as _shared_fits checked
            shared = (shared_in[0], shared_in[1], self.shared_expert.down_proj.weight)
        elif replay is None:  # the router's choice alone: route_fused's kernel
            return None
        args = (logits, self.top_k, self.normalize, dtype, replay, shared)
        return moe_dispatch.moe_dispatch(*args, kernels=self.kernels)

    def _predict_next(self, x: torch.Tensor) -> torch.Tensor:
        """The next MoE block's router applied to this block's input: its top `ahead_experts` ids [T, n]."""
        assert self.ahead is not None  # only a block that guesses predicts
        return torch.topk(self.ahead.gate(x), self.ahead_experts, dim=-1, sorted=False).indices

    def _shared(
        self, x: torch.Tensor, projected: list[torch.Tensor] | None, done: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The shared expert of x (`done`: computed already, by the dispatch) and its gate's logit [T, 1]
        (None: no shared expert, no gate), given its input projections when they were fused with the
        router's. The provider adds σ(logit) · shared."""
        if self.shared_expert is None:
            return None, None
        gate, up, *gate_logit = projected if projected is not None else project(x, self._inputs()[1:], None)
        shared = done if done is not None else self._finish_shared(gate, up)
        return shared, gate_logit[0] if gate_logit else None

    def _finish_shared(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The shared expert from its gate and up outputs: for a few rows with the fused kernels, SiLU, the
        product and the down GEMV in one Triton kernel (torch: three launches a layer)."""
        mlp = self.shared_expert
        assert mlp is not None  # `_shared` calls this only for a block with a shared expert
        if self._shared_fits([gate, up]):
            from common.kernels.gated_mlp import swiglu_down  # Triton

            return swiglu_down(gate, up, mlp.down_proj.weight, kernels=self.kernels)
        return mlp.finish(gate, up)

    def _shared_fits(self, shared_in: list[torch.Tensor] | None) -> bool:
        """Whether the shared expert's second half runs as one Triton kernel (swiglu_down's, alone or in the
        dispatch): a few rows with the fused kernels, SiLU, a plain down projection."""
        mlp = self.shared_expert
        if mlp is None or not shared_in or not (self.fused_decode and self.kernels.shared_kernel):
            return False
        from common.kernels.gated_mlp import DOWN_ROWS  # Triton: only past the check above

        gate = shared_in[0]
        return gate.shape[0] <= DOWN_ROWS and mlp.act is F.silu and plain_linear(mlp.down_proj)


def install_lookahead(model: nn.Module, experts: int, num_layers: int) -> int:
    """Make each of the first `num_layers` layers' MoE blocks guess the next one's `experts` experts a token
    from its own input (docs/ARCHITECTURE.md, Experts; 0: no guesses) → the blocks that guess. MTP's blocks
    neither guess nor are guessed."""
    if not 0 <= experts <= cast(ModelConfig, model.config).num_experts:
        raise ValueError(f"lookahead guesses 0 to num_experts experts a token, not {experts}")
    blocks = sorted(
        (m for m in model.modules() if isinstance(m, SparseMoeBlock) and m.layer_idx < num_layers),
        key=lambda m: m.layer_idx,
    )
    for block, after in zip(blocks, [*blocks[1:], None], strict=True):
        # a plain reference: nn.Module's setattr would make the next block a child (twice in the state dict)
        object.__setattr__(block, "ahead", after if experts > 0 else None)
        block.ahead_experts = experts
    return sum(b.ahead is not None for b in blocks)


def install_provider(model, provider: ExpertProvider) -> None:
    """Make `provider` serve every MoE block of `model` (blocks hold it as `experts`; the model as well)."""
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            module.experts = provider
    model.experts = provider

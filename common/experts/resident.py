"""ResidentExperts: every routed expert in (device or host) memory; the reference provider."""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.experts.provider import ExpertProvider, ExpertWeights


def grouped_expert_mlp(
    x: torch.Tensor,
    weights_of: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Reference SwiGLU expert MLP: tokens grouped by expert, one GEMM pair per expert used, experts in
    ascending id order (so the result depends only on the weights, not on where they were read from).

    x [T, H]; weights_of(e) → (gate_up [2I, H], down [H, I]); topk_ids/topk_weights [T, k] → [T, H].
    The per-expert loop and its host sync make this a reference, not the GPU decode path (Triton kernels
    over cache slots replace it there).
    """
    k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)  # [T*k]
    order = torch.argsort(flat_ids, stable=True)
    token_of = order // k  # [T*k] token of each sorted (token, choice) pair
    weight_of = topk_weights.reshape(-1)[order]
    counts = torch.bincount(flat_ids).tolist()
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = token_of[start : start + count]
        gate_up, down = weights_of(expert)
        gate, up = torch.nn.functional.linear(x[rows], gate_up).chunk(2, dim=-1)  # [n, I] each
        y = torch.nn.functional.linear(act(gate) * up, down)  # [n, H]
        y = y * weight_of[start : start + count, None]
        out.index_add_(0, rows, y.to(out.dtype))
        start += count
    return out


class ResidentExperts(ExpertProvider):
    """All experts of all MoE layers held as stacked tensors on one device."""

    def __init__(
        self, weights: dict[int, ExpertWeights], act: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        self.weights = weights
        self.act = act

    def forward(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        w = self.weights[layer]
        return grouped_expert_mlp(x, lambda e: (w.gate_up[e], w.down[e]), topk_ids, topk_weights, self.act)

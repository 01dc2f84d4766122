"""ResidentExperts: every routed expert in (device or host) memory; the reference provider."""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.model.provider import ExpertProvider, ExpertWeights


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


def batched_expert_mlp(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Decode-time SwiGLU expert MLP over per-(token, choice) weights: batched GEMMs, no loop over experts.

    x [T, H]; gate_up [T, k, 2I, H] and down [T, k, H, I] are the weights of expert topk_ids[t, j] (gathered
    by the caller); topk_ids/topk_weights [T, k] → [T, H]. Fixed shapes and no host sync, so a decode step can
    be captured. Each (token, choice) is a 1-row product of its own (the GEMMs' rounding can differ from the
    grouped form's n-row products, hence one function for every provider's decode). The weighted terms are
    rounded to x's dtype and added in ascending expert id, one at a time from zero, as `grouped_expert_mlp`
    adds them. The gathered weights cost T·k experts of memory: meant for decode's small T (prefill uses the
    grouped form).
    """
    t, k = topk_ids.shape
    h = torch.matmul(x[:, None, None, :], gate_up.transpose(-1, -2))  # [T, k, 1, 2I]
    gate, up = h.chunk(2, dim=-1)  # [T, k, 1, I] each
    y = torch.matmul(act(gate) * up, down.transpose(-1, -2))[:, :, 0]  # [T, k, H]
    y = (y * topk_weights[..., None]).to(x.dtype)  # [T, k, H]
    order = torch.argsort(topk_ids, dim=1, stable=True)  # [T, k] choices by expert id
    y = torch.gather(y, 1, order[..., None].expand(t, k, y.shape[-1]))  # [T, k, H]
    out = torch.zeros_like(x)  # [T, H]
    for j in range(k):  # k choices (not experts): the same additions, in the same order, as the grouped form
        out = out + y[:, j]
    return out


class ResidentExperts(ExpertProvider):
    """All experts of all MoE layers held as stacked tensors on one device."""

    def __init__(
        self, weights: dict[int, ExpertWeights], act: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        self.weights = weights
        self.act = act
        self.decode = False
        self.published: tuple[str, dict[int, dict[str, torch.Tensor]]] | None = None
        """A checkpoint's experts in its published format's bits (format name, MoE layer -> components
        [E, ...]: common/model/published_experts.py), which a host store takes as they are; None if the
        checkpoint has none."""

    def begin_pass(self, is_decode: bool, prompt: bool = False) -> None:
        """Decode passes compute as the offloaded provider's decode passes do (`batched_expert_mlp`), so
        that serving experts from host memory changes no bit of the output; other passes use the grouped
        form, as the offloaded provider's prefill arena does."""
        self.decode = is_decode

    def forward(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        w = self.weights[layer]
        if self.decode:
            gate_up, down = w.gate_up[topk_ids], w.down[topk_ids]  # [T, k, 2I, H], [T, k, H, I]
            return batched_expert_mlp(x, gate_up, down, topk_ids, topk_weights, self.act)
        return grouped_expert_mlp(x, lambda e: (w.gate_up[e], w.down[e]), topk_ids, topk_weights, self.act)

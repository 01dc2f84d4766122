"""Layer-major passes: one sequence's consecutive chunks through every layer, a layer at a time.

`ModelRunner.prefill_layer_major` runs a long prompt as chunks so that attention's and the token mixers'
buffers stay a chunk's size, but takes them layer by layer so that an offloaded model streams each layer's
experts once for all the chunks. The channel mixer (the MoE) is token-wise, so it runs once over the
chunks together: its grouped expert GEMMs see every token routed to an expert at once (larger tiles run
nearer the tensor cores' rate: bench/LOG.md, Grouped int4 prefill kernels) and the arena is read once a
layer.

A layer takes part through four members (`run_layer_major`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, cast

import torch
from torch import nn

from common.model.context import ForwardContext


class LayerMajorLayer(Protocol):
    """A layer's four members that a layer-major pass takes (the module docstring says what each does)."""

    mlp: nn.Module

    def mix_tokens(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor: ...

    def ffn_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def ffn_output(self, x: torch.Tensor, out: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor: ...


def run_layer_major(
    layers: Iterable[nn.Module], xs: list[torch.Tensor], contexts: Sequence[ForwardContext]
) -> list[torch.Tensor]:
    """xs[c] [T_c, ...] (chunk c's hidden states, in the sequence's order) through every layer: each chunk's
    token mixer in order, then one channel-mixer call over all the chunks' tokens → the new xs.

    A layer takes part through four members, which its `forward(x, ctx)` composes as
    `ffn_output(y, mlp(h), aux)` with `y = mix_tokens(x, ctx)` and `(h, aux) = ffn_input(y)`:
    - `mix_tokens(x, ctx)`: x after the layer's token mixer (attention, Gated DeltaNet; PLE), one chunk;
    - `ffn_input(x) → (h, aux)`: the channel mixer's input [T, H] and what `ffn_output` needs besides;
    - `mlp(h)`: the channel mixer, token-wise;
    - `ffn_output(x, out, aux)`: x with the channel mixer's output out [T, H] added back."""
    for module in layers:
        layer = cast(LayerMajorLayer, module)
        inputs, aux = [], []
        for c, ctx in enumerate(contexts):
            xs[c] = layer.mix_tokens(xs[c], ctx)
            h, a = layer.ffn_input(xs[c])
            inputs.append(h)
            aux.append(a)
        sizes = [h.shape[0] for h in inputs]
        joined = torch.cat(inputs) if len(inputs) > 1 else inputs[0]  # [T, H]
        del inputs
        outs = layer.mlp(joined).split(sizes)
        del joined
        xs = [layer.ffn_output(x, out, a) for x, out, a in zip(xs, outs, aux, strict=True)]
    return xs

"""The expert-provider interface: how a MoE layer gets its routed experts computed.

The model's MoE block routes (router logits → top-k ids and weights) and hands the rest to a provider, one
call per layer. Providers differ in where expert weights live: all resident in memory (this module's
`ResidentExperts`), a VRAM cache over a host store (decode), a batched arena (prefill).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class ExpertWeights:
    """All routed experts of one layer, stacked (the layout HF transformers 5 also uses)."""

    gate_up: torch.Tensor
    """[E, 2I, H]: gate rows first, then up rows."""
    down: torch.Tensor
    """[E, H, I]."""


class ExpertProvider(ABC):
    """Computes the weighted sum of the chosen routed experts for the tokens of one MoE layer."""

    max_groups = 1
    """Groups of lanes a recorded decode pass may be split into (common/model/groups.py); 1: no split."""

    group = 0
    """In a grouped pass (`grouped`), the group whose layers are being issued."""

    @contextmanager
    def grouped(self, groups: int) -> Iterator[None]:
        """A decode pass whose lanes run as `groups` groups, layer by layer in group order, each group's
        work on a stream of its own (common/model/groups.py sets `group` before each group's layer)."""
        if not 1 <= groups <= self.max_groups:
            raise ValueError(f"{type(self).__name__} splits a pass into at most {self.max_groups} groups")
        yield

    def regroup(self, groups: int) -> None:  # noqa: B027  (a hook)
        """Between steps: the next decode pass runs in `groups` groups (1: not grouped). Default: nothing."""

    @contextmanager
    def turn(self, layer: int) -> Iterator[None]:
        """Where a MoE block routes (its replay hook) and calls `prepare`: in a grouped pass, one group after
        the other at each layer. Default: no order needed."""
        yield

    def begin_pass(self, is_decode: bool, prompt: bool = False) -> None:  # noqa: B027  (a hook)
        """Called before every forward pass (providers that serve decode and prefill differently use it);
        `prompt`: the pass runs prompt tokens (not a speculative verification, a draft or a probe)."""

    @abstractmethod
    def forward(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """out[t] = sum_j topk_weights[t, j] · expert_{topk_ids[t, j]}(x[t]) for layer `layer`.

        x [T, H]; topk_ids [T, k] int64; topk_weights [T, k] (fp32 or x's dtype); returns [T, H] in x's dtype.
        `layer` is the model's layer index.
        """

    def prepare(self, layer: int, topk_ids: torch.Tensor) -> object:
        """Start what `layer`'s chosen experts need before they can be computed (say, their host → device
        copies, on a side stream) and return a handle for `compute`. A caller that runs other work between
        the two (the shared expert) overlaps it with that preparation. Default: nothing to prepare."""
        return None

    def lookahead(  # noqa: B027  (a hook)
        self, layer: int, x: torch.Tensor, predict: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """A guess at `layer`'s experts (`predict(x)` → ids [T, n], called only if wanted), made while earlier
        layers compute: a provider that copies experts in may start on them. Default: ignored."""

    def compute(
        self,
        layer: int,
        prepared: object,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        shared: torch.Tensor | None = None,
        shared_gate: torch.Tensor | None = None,
        settled: bool = False,
    ) -> torch.Tensor:
        """`forward`'s result, given `prepare(layer, topk_ids)`'s handle (same topk_ids), plus `shared`
        [T, H] (a shared expert's output) gated by σ(shared_gate [T, 1]) when given: a provider whose kernel
        sums the choices adds it there. `settled`: neither topk_ids nor what `prepare` wrote come from the
        kernel launched just before this call (the caller's shared expert ran in between), so this call's
        first kernel may read them before its programmatic wait (common/kernels/pdl.py)."""
        return add_shared(self.forward(layer, x, topk_ids, topk_weights), shared, shared_gate)


def add_shared(out: torch.Tensor, shared: torch.Tensor | None, gate: torch.Tensor | None) -> torch.Tensor:
    """out + σ(gate) · shared (σ(gate): 1 without a gate; out as it is without `shared`)."""
    if shared is None:
        return out
    return out + (torch.sigmoid(gate) * shared if gate is not None else shared)

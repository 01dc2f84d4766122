"""Routing record and replay: capture the router's choices, or force them from a trace.

A `RoutingHook` sits between a MoE block's router and its expert provider. The recorder keeps every layer's
(top-k ids, weights) in the order tokens are processed; the replayer hands out the trace's rows in that order
(cycling when the trace is shorter than the run), which is how benchmarks give a random-weight model a
realistic expert skew. Layers are the model's MoE layers in order (trace layer i = i-th MoE layer).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict

import torch

from common.experts.trace import RoutingTrace, parse_trace


class RoutingHook(ABC):
    """Called as hook(model layer index, ids [T, k], weights [T, k]) → (ids, weights) the experts will use."""

    @abstractmethod
    def __call__(
        self, layer: int, ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The choices to use for these tokens."""

    def device_rows(
        self, layer: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
        """For a hook that hands out rows already on the device: (ids [rows, layers, k], weights [rows,
        layers, k] fp32, cursors [layers] int64, the trace layer of model layer `layer`), which a kernel
        gathers itself in place of the call (common/kernels/moe_dispatch.py), advancing the cursor as the
        call would. None (the default): call the hook."""
        return None


class RoutingRecorder(RoutingHook):
    """Keeps every layer's choices; `trace()` stacks them into a RoutingTrace."""

    def __init__(self, moe_layers: list[int], num_experts: int) -> None:
        self.index = {layer: i for i, layer in enumerate(moe_layers)}
        self.num_experts = num_experts
        self.ids: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.weights: dict[int, list[torch.Tensor]] = defaultdict(list)

    def __call__(self, layer, ids, weights):
        i = self.index[layer]
        self.ids[i].append(ids.detach().to("cpu", torch.int32))
        self.weights[i].append(weights.detach().to("cpu", torch.float32))
        return ids, weights

    def trace(self) -> RoutingTrace:
        layers = range(len(self.index))
        ids = torch.stack([torch.cat(self.ids[i]) for i in layers], dim=1)  # [tokens, layers, k]
        weights = torch.stack([torch.cat(self.weights[i]) for i in layers], dim=1)
        return RoutingTrace(ids=ids, weights=weights, num_experts=self.num_experts)


class RoutingReplayer(RoutingHook):
    """Replaces the router's choices with a trace's rows, token by token, per layer."""

    def __init__(self, trace: RoutingTrace, moe_layers: list[int], num_experts: int, top_k: int) -> None:
        _, layers, k = trace.ids.shape
        if layers != len(moe_layers) or k != top_k or trace.num_experts != num_experts:
            raise ValueError(
                f"trace has {layers} layers × top-{k} of {trace.num_experts} experts; the model routes "
                f"{len(moe_layers)} MoE layers × top-{top_k} of {num_experts}"
            )
        self.trace, self.index = trace, {layer: i for i, layer in enumerate(moe_layers)}
        # (ids, weights, per-layer cursor) per device; the cursor advances on the device, so that a
        # recorded decode step replays the next rows each time
        self._device: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.fused = False
        """Gather the rows with one Triton kernel (opt-in: `use_fused_kernels`,
        common/model/fused_kernels.py)."""

    def __call__(self, layer, ids, weights):
        i, n = self.index[layer], ids.shape[0]
        ids_all, weights_all, cursor = self._on(ids.device)
        if self.fused:
            from common.kernels.routing import replay_rows  # Triton

            return replay_rows(ids_all, weights_all, cursor, i, n, weights.dtype)  # advances cursor[i]
        rows = (torch.arange(n, device=ids.device) + cursor[i]) % ids_all.shape[0]
        cursor[i].add_(n)
        return ids_all[rows, i].long(), weights_all[rows, i].to(weights.dtype)

    def device_rows(
        self, layer: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
        if not self.fused:  # the torch gather of __call__
            return None
        return (*self._on(device), self.index[layer])

    def rewind(self) -> None:
        """Replay from the trace's first row again (in place: recorded steps keep reading the cursors)."""
        with torch.inference_mode():  # the cursors were made inside the runner's inference mode
            for _, _, cursor in self._device.values():
                cursor.zero_()

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if device not in self._device:
            cursor = torch.zeros(self.trace.ids.shape[1], dtype=torch.int64, device=device)
            ids, weights = (
                self.trace.ids.to(device).contiguous(),
                self.trace.weights.to(device, torch.float32),
            )
            self._device[device] = (ids, weights.contiguous(), cursor)
        return self._device[device]


def replayer_for(spec: str, moe_layers: list[int], num_experts: int, top_k: int) -> RoutingReplayer:
    """A replayer from a trace file or `synthetic-zipf:...` (layers/experts/top_k default to the model's)."""
    if spec.startswith("synthetic-zipf"):
        given = spec.partition(":")[2]
        defaults = f"layers={len(moe_layers)},experts={num_experts},top_k={top_k}"
        spec = f"synthetic-zipf:{defaults}" + (f",{given}" if given else "")
    return RoutingReplayer(parse_trace(spec), moe_layers, num_experts, top_k)


def install_routing_hook(model: torch.nn.Module, hook: RoutingHook | None) -> None:
    """Set `hook` on every MoE block of `model` (None removes it). A replay takes the blocks' fused-kernel
    switch, as `use_fused_kernels` sets it on a hook already installed: the order of the two calls does not
    matter (the decode benchmarks once installed theirs after the switch and replayed in ~8 torch ops a
    layer instead of one kernel)."""
    from common.model.moe import SparseMoeBlock

    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            module.routing_hook = hook
            if hook is not None and hasattr(hook, "fused"):
                hook.fused = module.fused_decode

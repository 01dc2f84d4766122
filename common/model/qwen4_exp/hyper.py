"""Hyper-connections: `hc_count` residual streams, mixed into each sublayer's input, re-injected after it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from common.kernels.config import KERNELS, KernelConfig
from common.model.fused_linear import FusedLinears, fuse_linears, plain_linear, project
from common.model.qwen4_exp.config import Qwen4ExpConfig
from common.model.qwen4_exp.norms import OffsetRMSNorm


@dataclass(frozen=True)
class DeferredInject:
    """streams + out injected with `logits` (`HyperConnection.inject`), not yet applied: the next
    hyper-connection's projection kernel applies it as it reads the streams (`hc_project`'s `inject`), one
    launch fewer a sublayer in decode steps. Anything else that reads the streams takes `applied(...)`."""

    streams: torch.Tensor
    """[T, hc·H], before the injection."""
    out: torch.Tensor
    """The sublayer's output [T, H]."""
    logits: torch.Tensor
    """The inject logits [T, hc], or hc_project's partial products [P, T, hc]."""
    kernels: KernelConfig = KERNELS
    """The launch options of the kernel that applies it."""


Streams = torch.Tensor | DeferredInject


def rows_of(streams: Streams) -> int:
    """The tokens a pass's streams hold (a deferred injection not applied)."""
    return (streams.streams if isinstance(streams, DeferredInject) else streams).shape[0]


def applied(streams: Streams) -> torch.Tensor:
    """The streams [T, hc·H], a deferred injection applied (hc_inject)."""
    if isinstance(streams, torch.Tensor):
        return streams
    from common.kernels.hyper import hc_inject  # Triton (deferred only with the fused kernels)

    return hc_inject(streams.streams, streams.out, streams.logits, kernels=streams.kernels)


class HyperConnection(nn.Module):
    """Gated low-rank mix of the normalised streams → the sublayer input; per-stream injection weights.

    The streams are one tensor [T, hc · H], stream s at columns [s·H, (s+1)·H).
    """

    fused_decode = False
    """Run the elementwise work as three Triton kernels (common/kernels/hyper.py) instead of ~30 torch ops.
    Set by `use_fused_kernels`."""

    def __init__(self, cfg: Qwen4ExpConfig, inject: bool = True) -> None:
        super().__init__()
        self.hc, self.hidden = cfg.hc_count, cfg.hidden_size
        self.hc_norm = OffsetRMSNorm(cfg.hc_hidden, cfg.rms_norm_eps, group=cfg.hidden_size)
        self.input_mix_weight_down = nn.Linear(cfg.hc_hidden, cfg.hc_lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(cfg.hc_lowrank, cfg.hc_hidden, bias=False)
        self.block_inject_weight = nn.Linear(cfg.hc_hidden, cfg.hc_count, bias=False) if inject else None

    kernels: KernelConfig = KERNELS
    """The kernel forms and launch options (set where the worker builds the model: `configure_kernels`)."""

    fused_in: FusedLinears | None = None
    """The mix-down and inject weights (both read the normalised streams) as one GEMM."""

    def _inputs(self) -> tuple[nn.Linear, ...]:
        inject = () if self.block_inject_weight is None else (self.block_inject_weight,)
        return (self.input_mix_weight_down, *inject)

    def fuse_projections(self, copy: bool = True) -> bool:
        """Run mix-down and inject as one GEMM from now on (see common/model/fused_linear.py)."""
        if self.block_inject_weight is None:
            return False
        self.fused_in = fuse_linears(self._inputs(), copy)
        return self.fused_in is not None

    def mix(self, streams: Streams) -> torch.Tensor:
        """streams [T, hc·H] → the sublayer input [T, H]."""
        return self._mix(streams)[0]

    def _mix(
        self, streams: Streams, hold_next: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """mix(streams), the inject logits [T, hc] when there is an inject weight (after hc_project: its
        partial products [hc, T, hc], which hc_inject sums), and the streams (a deferred injection applied).
        `hold_next`: the mix-up kernel lets the sublayer's first kernel launch only at its exit (pdl.launch).
        """
        if isinstance(streams, DeferredInject):
            deferred, rows = streams, streams.streams
        else:
            deferred, rows = None, streams
        if self.fused_decode and self._project_fits(rows):  # norm, projection and mix in two kernels
            from common.kernels.hyper import hc_mix_up, hc_project  # Triton

            norm, fused = self.hc_norm, self.fused_in
            assert fused is not None  # _project_fits: a plain FusedLinears
            inject = (deferred.out, deferred.logits) if deferred is not None else None
            product, scales, streams = hc_project(
                rows, norm.weight, norm.eps, fused.weight, self.hc, inject=inject, kernels=self.kernels
            )
            down, logits = fused.split(product)
            up = self.input_mix_weight_up.weight
            mixed = hc_mix_up(
                down, up, streams, self.hc, scales=scales, norm_weight=norm.weight, hold_next=hold_next,
                kernels=self.kernels,
            )  # fmt: skip
            return mixed, logits, streams
        streams = applied(streams)
        return (*self._mix_normed(streams), streams)

    def _mix_normed(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """_mix's sublayer input and logits through hc_norm's normalised streams."""
        normed = self.hc_norm.fused(streams) if self.fused_decode else self.hc_norm(streams)
        down, *inject = project(normed, self._inputs(), self.fused_in)
        logits = inject[0] if inject else None
        if self.fused_decode and self._mix_up_fits(down):
            from common.kernels.hyper import hc_mix_up  # Triton

            up = self.input_mix_weight_up.weight
            return hc_mix_up(down, up, normed, self.hc, kernels=self.kernels), logits
        up = self.input_mix_weight_up(F.silu(down / self.hc))  # [T, hc·H]
        if self.fused_decode:
            from common.kernels.hyper import hc_mix  # Triton

            return hc_mix(up, normed, self.hc), logits
        gate = torch.sigmoid(up).unflatten(-1, (self.hc, self.hidden))  # [T, hc, H]
        return (gate * normed.unflatten(-1, (self.hc, self.hidden))).mean(dim=-2), logits

    def _mix_up_fits(self, down: torch.Tensor) -> bool:
        """Whether a pass's mix-up runs inside the mix kernel: up to MIX_UP_ROWS rows (decode) and a plain
        bf16/fp32 Linear (an fp8 one keeps its own GEMV)."""
        from common.kernels.hyper import MIX_UP_ROWS

        fits = down.shape[0] <= MIX_UP_ROWS and self.hc & (self.hc - 1) == 0  # the streams: one tile's rows
        return self.kernels.mix_up_kernel and fits and plain_linear(self.input_mix_weight_up)

    def _project_fits(self, streams: torch.Tensor) -> bool:
        """Whether a pass runs `hc_project` (norm and input projection in one kernel) before the mix-up
        kernel: as `_mix_up_fits`, with the mix-down and inject weights fused in one plain weight, and
        streams no wider than a program's tile (PROJECT_TILE)."""
        from common.kernels.hyper import PROJECT_TILE

        narrow = streams.shape[-1] // self.hc <= PROJECT_TILE
        fits = narrow and plain_linear(self.fused_in) and self._mix_up_fits(streams)
        return self.kernels.project_kernel and fits

    def forward(self, streams: Streams, sublayer, defer: bool = False, hold_next: bool = False) -> Streams:
        """streams + sublayer(mix(streams)) injected into every stream with its learned weight; with `defer`,
        the injection may be left to the next hyper-connection (a DeferredInject); `hold_next` as `_mix`'s."""
        mixed, logits, streams = self._mix(streams, hold_next)
        assert logits is not None  # an inject weight: hyper-connections without one only `mix`
        return self.inject(streams, sublayer(mixed), logits, defer)

    def mix_input(self, streams: Streams) -> tuple[torch.Tensor, torch.Tensor]:
        """streams [T, hc·H] → (the sublayer's input [T, H], the inject logits [T, hc])."""
        mixed, logits, _ = self._mix(applied(streams))
        assert logits is not None  # an inject weight
        return mixed, logits

    def inject(
        self, streams: torch.Tensor, out: torch.Tensor, logits: torch.Tensor, defer: bool = False
    ) -> Streams:
        """streams + the sublayer's output out [T, H] in every stream, weighted by 2·sigmoid(logits / hc).
        With `defer`, in passes whose next hyper-connection projects in its kernel (`_project_fits`: decode
        rows), a DeferredInject that it applies."""
        if defer and self.kernels.defer_inject and self.fused_decode and self._project_fits(streams):
            return DeferredInject(streams, out, logits, self.kernels)
        if self.fused_decode:
            from common.kernels.hyper import hc_inject  # Triton

            return hc_inject(streams, out, logits, kernels=self.kernels)
        weight = 2 * torch.sigmoid(logits / self.hc)  # [T, hc]
        return streams + (out[:, None, :] * weight[:, :, None]).flatten(-2)

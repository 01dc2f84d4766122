"""What an offloaded provider's passes share: the handle `prepare` returns, the kernel switches, the path
interface (`ExpertPath`: where a layer's expert rows come from and what computes them) and the simplest path,
every expert resident in its slot."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from common.experts.cache_tables import CacheTables
from common.experts.copies import Copies
from common.experts.formats import ExpertFormat
from common.kernels.config import KERNELS, KernelConfig


@dataclass
class Prepared:
    """`OffloadedExperts.prepare`'s handle: where each expert's weights are, and the copies to wait for."""

    rows: torch.Tensor
    """[E] pool row of each expert of the layer (meaningful for the requested ones)."""
    done: Copies
    cached: torch.Tensor | None = None
    """Prefill: [E] bool, the expert's row is a slot of the cache (else of this provider's arena); None:
    every row is the arena's."""


@dataclass
class KernelSwitches:
    """Which kernels an offloaded provider's paths run; set before the first pass (the provider's attributes
    of the same names read and write these; `use_fused_kernels`, common/model/fused_kernels.py, among
    others)."""

    int4_kernels: bool
    """int4 experts, SiLU, a pool of the provider's own: the int4 Triton kernels can read its rows."""
    fused_int4: bool
    """`int4_kernels` on CUDA: decode passes run the int4 decode kernels (kernels/moe_int4.py)."""
    dense_kernels: bool
    """Experts of a format the dense decode kernels read (`ExpertFormat.dense_decode`), SiLU, a pool of the
    provider's own, on CUDA: decode passes run them (kernels/moe_dense.py) where `KernelConfig.moe_dense`
    says so."""
    fused_int4_prefill: bool = False
    """Prefill passes through the grouped int4 kernels (kernels/moe_int4_grouped.py)."""
    fused_dense_prefill: bool = False
    """Prefill passes through the grouped dense kernels (kernels/moe_dense_grouped.py): `dense_kernels`
    with `KernelConfig.moe_dense`."""
    fused_resolve: bool = False
    """Decode steps resolved by one Triton program per layer (kernels/resolve.py: the same decisions as
    `CacheTables.resolve`) instead of torch ops."""
    kernels: KernelConfig = KERNELS
    """The kernel forms and launch options the paths' kernels read (`OffloadedExperts.kernels`)."""

    @classmethod
    def for_pool(
        cls,
        fmt: ExpertFormat,
        act: Callable[[torch.Tensor], torch.Tensor],
        own_pool: bool,
        device: torch.device,
    ) -> KernelSwitches:
        """The switches a provider starts with: which kernels can read its rows at all."""
        int4 = fmt.name == "int4" and act is F.silu and own_pool
        dense = fmt.dense_decode and act is F.silu and own_pool
        cuda = device.type == "cuda"
        return cls(int4_kernels=int4, fused_int4=int4 and cuda, dense_kernels=dense and cuda)


class PassCompute(Protocol):
    """The routed experts' weighted sum of one layer from the rows `prepare` gave (plus the shared expert)."""

    def compute(
        self,
        prepared: Prepared,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        shared: torch.Tensor | None,
        shared_gate: torch.Tensor | None,
        settled: bool,
    ) -> torch.Tensor: ...


class ExpertPath(ABC):
    """How one kind of pass gets a layer's experts: `prepare` finds (or copies in) their pool rows, `compute`
    runs them. Layers are MoE layer indices (0 … L−1)."""

    max_groups = 1
    """Groups of lanes a decode pass on this path may be split into (common/model/groups.py)."""

    def __init__(self, kernels: PassCompute) -> None:
        self.kernels = kernels

    def begin(self, prompt: bool) -> None:  # noqa: B027  (a hook)
        """Before each pass on this path; `prompt`: a prefill pass of prompt tokens. Default: nothing."""

    @abstractmethod
    def prepare(self, i: int, topk_ids: torch.Tensor, group: int, groups: int) -> Prepared:
        """MoE layer i's rows for `topk_ids` [T, k], in decode group `group` of `groups`."""

    def compute(
        self,
        prepared: Prepared,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        shared: torch.Tensor | None,
        shared_gate: torch.Tensor | None,
        settled: bool,
    ) -> torch.Tensor:
        return self.kernels.compute(prepared, x, topk_ids, topk_weights, shared, shared_gate, settled)

    def lookahead(  # noqa: B027  (a hook)
        self, i: int, x: torch.Tensor, predict: Callable[[torch.Tensor], torch.Tensor], groups: int
    ) -> None:
        """A guess at MoE layer i's experts (`ExpertProvider.lookahead`). Default: ignored."""


class ResidentPath(ExpertPath):
    """Every expert holds a slot for good (`OffloadedExperts.load_all`): rows are the slots; nothing is
    resolved, counted or copied."""

    def __init__(self, tables: CacheTables, num_experts: int, kernels: PassCompute) -> None:
        super().__init__(kernels)
        self.tables, self.num_experts = tables, num_experts

    def prepare(self, i: int, topk_ids: torch.Tensor, group: int, groups: int) -> Prepared:
        return Prepared(rows=self.tables.slot_of[i, : self.num_experts], done=None)


def chosen(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] bool: the layer's experts among `ids` (t[i] = True would synchronise: a fill instead)."""
    mask = torch.zeros(num_experts, dtype=torch.bool, device=ids.device)
    return mask.index_fill_(0, ids.reshape(-1), True)


def check_group(topk_ids: torch.Tensor, num_experts: int, groups: int) -> None:
    """A group's choices must fit its share of the staging rows (E // groups)."""
    if groups > 1 and topk_ids.numel() > num_experts // groups:
        raise ValueError(
            f"a group of {topk_ids.shape[0]} lanes has more choices than its {num_experts} "
            f"// {groups} staging rows"
        )

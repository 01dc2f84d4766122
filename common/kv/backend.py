"""Attention backends over the paged KV layout.

Contract: `plan(batch)` runs once per forward pass and returns whatever the backend precomputes (index
tensors, a flashinfer wrapper's plan); then each attention layer calls `forward`, which writes the batch's
new keys and values into that layer's pages and returns the attention output of the batch's queries.
The model never sees the layout, so flashinfer/Triton backends and pools shared over CUDA IPC plug in here.
Backends store and load K/V through `write_kv`/`read_kv`, which (de)quantize fp8 pages with the layer's
scales (common/kv/fp8.py), so every attention layer type gets an fp8 KV cache without knowing of it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from common.ipc.hostmem import host_list_to
from common.kernels.config import KERNELS, KernelConfig
from common.kv.batch import ForwardBatch
from common.kv.fp8 import dequantize, is_fp8, quantize
from common.kv.state import LayerState, PagedSpec


def kv_specs(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> dict[str, PagedSpec]:
    """The paged state of one attention layer: keys and values, [num_kv_heads, head_dim] per token."""
    spec = PagedSpec((num_kv_heads, head_dim), dtype, kv=True)
    return {"k": spec, "v": spec}


def write_kv(state: LayerState, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store k, v [T, Hkv, D] at the flat KV slots [T]; fp8 pages are quantized with the layer's scales."""
    for i, (name, x) in enumerate((("k", k), ("v", v))):
        flat = state.paged[name].flatten(0, 1)  # [slots, Hkv, D]
        if is_fp8(flat):
            assert state.kv_scale is not None  # fp8 pages come with their scales
            flat[slot_mapping] = quantize(x, state.kv_scale[i])
        else:
            flat[slot_mapping] = x.to(flat.dtype)


def kv_store(
    state: LayerState, slot_mapping: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """What a kernel that makes the keys needs to store k and v as `write_kv` would (norm_rope's `store`):
    (flat k pages [slots, Hkv, D], v [T, Hkv, D], flat v pages, slot_mapping [T]); None where only
    `write_kv` can: fp8 pages (quantized with the layer's scales) or pages not laid out flat."""
    k_pages, v_pages = state.paged["k"], state.paged["v"]
    if is_fp8(k_pages) or not (k_pages.is_contiguous() and v_pages.is_contiguous()):
        return None
    return k_pages.flatten(0, 1), v, v_pages.flatten(0, 1), slot_mapping


def read_kv(state: LayerState, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [*slots.shape, Hkv, D] at the flat KV `slots`, in `dtype` (fp8 pages dequantized)."""
    out = []
    for i, name in enumerate(("k", "v")):
        x = state.paged[name].flatten(0, 1)[slots]
        if is_fp8(x):
            assert state.kv_scale is not None  # fp8 pages come with their scales
            out.append(dequantize(x, state.kv_scale[i], dtype))
        else:
            out.append(x.to(dtype))
    return out[0], out[1]


class AttentionBackend(ABC):
    """Causal attention of a flat batch against the paged KV cache."""

    @abstractmethod
    def plan(self, batch: ForwardBatch) -> Any:
        """Precompute what every layer of this pass shares."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        state: LayerState,
        plan: Any,
        scale: float,
        window: int | None = None,
        selected: torch.Tensor | None = None,
        gate: torch.Tensor | None = None,
        stored: bool = False,
    ) -> torch.Tensor:
        """Store k, v [T, Hkv, D] in `state`'s pages; return attention of q [T, Hq, D] as [T, Hq, D].

        `window`: a query at position p sees keys at positions (p - window, p]; None = all earlier keys.
        `selected`: [T, S] key positions each query may see (−1 = unused), for sparse attention; None = all.
        `gate`: [T, Hq, D]: the attention times σ(gate) is returned (an output gate, as QSA's).
        `stored`: k and v are in the pages already (the kernel that made k stored both: norm_rope's `store`).
        """


@dataclass
class TorchPlan:
    """Index tensors of the torch backend: queries and keys padded to [B, Qmax] and [B, Kmax].

    The padded layouts are built on first use and kept for the pass's other layers: a pass that the fused
    kernels serve (decode) reads only the page table and the lengths, and a recorded step would otherwise
    replay their ~10 small kernels for nothing."""

    slot_mapping: torch.Tensor  # [T] flat KV slot of each new token
    page_table: torch.Tensor  # [B, W] the batch's page table
    k_lens: torch.Tensor  # [B] keys of each sequence, this pass's included
    seq_index: torch.Tensor  # [T] each token's sequence (its page-table row)
    positions: torch.Tensor  # [T] each token's position
    page_size: int
    q_max: int  # queries of the longest sequence in this pass
    k_max: int  # keys of the longest sequence (a recorded decode: the context bound)
    q_lens: torch.Tensor | None  # [B] queries of each sequence; None: one each, lengths on the device

    @cached_property
    def _queries(self) -> tuple[torch.Tensor, torch.Tensor]:
        device, b = self.k_lens.device, self.k_lens.shape[0]
        if self.q_lens is None:  # one query a sequence
            index = torch.arange(b, device=device)[:, None]  # [B, 1]
            return index, torch.ones_like(index, dtype=torch.bool)
        starts = self.q_lens.cumsum(0) - self.q_lens
        rows = torch.arange(self.q_max, device=device)
        q_valid = rows[None, :] < self.q_lens[:, None]
        return torch.where(q_valid, starts[:, None] + rows[None, :], 0), q_valid

    @property
    def q_index(self) -> torch.Tensor:
        """[B, Qmax] token index of each padded query."""
        return self._queries[0]

    @property
    def q_valid(self) -> torch.Tensor:
        """[B, Qmax]"""
        return self._queries[1]

    @cached_property
    def q_pos(self) -> torch.Tensor:
        """[B, Qmax] position of each padded query."""
        return self.positions[self.q_index]

    @cached_property
    def _keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        page, table = self.page_size, self.page_table
        keys = torch.arange(self.k_max, device=table.device)
        k_valid = keys[None, :] < self.k_lens[:, None]
        k_pages = table.gather(1, (keys // page).clamp(max=table.shape[1] - 1).expand(table.shape[0], -1))
        return torch.where(k_valid, k_pages * page + keys % page, 0), k_valid

    @property
    def k_slots(self) -> torch.Tensor:
        """[B, Kmax] flat KV slot of each key."""
        return self._keys[0]

    @property
    def k_valid(self) -> torch.Tensor:
        """[B, Kmax]"""
        return self._keys[1]


class TorchPagedBackend(AttentionBackend):
    """Reference backend in plain torch: gathers each sequence's keys and runs masked softmax attention.

    Scores take O(B · heads · Kmax) per query, so a long prefill attends in slices of its queries
    (`score_bytes`); meant for CPU, tests and as the reference. With `fused_decode` (set by
    `use_fused_kernels`, common/model/fused_kernels.py, on by default on CUDA), passes of one query per
    sequence, and sparse passes (each query its own selection of keys: QSA's prefill), run a Triton kernel
    over the pages instead (common/kernels/decode_attention.py): a sparse query reads only its selected keys,
    where this path scores every key and masks all but those.
    """

    fused_decode = False
    kernels: KernelConfig = KERNELS
    """The kernel launch options (set where the worker builds the model: `configure_kernels`)."""

    def plan(self, batch: ForwardBatch) -> TorchPlan:
        if batch.static_kv is not None:  # recorded decode: one query per sequence, lengths on the device
            q_max, k_max, q_lens, k_lens = 1, batch.static_kv, None, batch.positions + 1
        else:
            q_max, k_max = max(batch.query_lens), max(batch.kv_lens)
            q_lens = host_list_to(batch.query_lens, batch.input_ids.device)
            k_lens = host_list_to(batch.kv_lens, batch.input_ids.device)
        return TorchPlan(
            batch.slot_mapping, batch.page_table, k_lens, batch.seq_index, batch.positions, batch.page_size,
            q_max, k_max, q_lens,
        )  # fmt: skip

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        state: LayerState,
        plan: TorchPlan,
        scale: float,
        window: int | None = None,
        selected: torch.Tensor | None = None,
        gate: torch.Tensor | None = None,
        stored: bool = False,
    ) -> torch.Tensor:
        if not stored:
            write_kv(state, plan.slot_mapping, k, v)
        decode = plan.q_max == 1
        if self.fused_decode and (decode or selected is not None):
            from common.kernels.decode_attention import paged_decode_attention  # Triton

            fp8, scales = is_fp8(state.paged["k"]), state.kv_scale
            k_lens, rows = (plan.k_lens, None) if decode else (plan.positions + 1, plan.seq_index)
            return paged_decode_attention(  # the gate: applied in the merge kernel
                q, state.paged["k"], state.paged["v"], plan.page_table, k_lens, scale,
                plan.k_max, selected, scales if fp8 else None, window, table_rows=rows, gate=gate,
                kernels=self.kernels,
            )  # fmt: skip
        kb, vb = read_kv(state, plan.k_slots, q.dtype)  # [B, Kmax, Hkv, D] each
        kb, vb = kb.transpose(1, 2), vb.transpose(1, 2)  # [B, Hkv, Kmax, D]
        q_max, step = plan.q_max, self._query_rows(q, kb)
        parts = [
            self._attend(q, kb, vb, plan, rows, scale, window, selected)
            for rows in (slice(a, min(a + step, q_max)) for a in range(0, q_max, step))
        ]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [B, Qmax, Hq, D]
        # [T, Hq, D], tokens laid out sequence by sequence; one query a sequence (decode): no mask, no sync
        out = out[:, 0] if out.shape[1] == 1 else out[plan.q_valid]
        return out if gate is None else out * torch.sigmoid(gate)

    score_bytes = 512 << 20
    """Most bytes of attention scores at once: a long prefill attends in slices of its queries."""

    def _query_rows(self, q: torch.Tensor, kb: torch.Tensor) -> int:
        """Queries per slice: the fp32 softmax and the scores of B × Hq × rows × Kmax within score_bytes."""
        per_row = kb.shape[0] * q.shape[1] * kb.shape[2] * (4 + q.element_size())
        return max(1, self.score_bytes // per_row)

    @staticmethod
    def _attend(q, kb, vb, plan: TorchPlan, rows: slice, scale: float, window, selected) -> torch.Tensor:
        """Attention of the padded queries `rows` → [B, n, Hq, D]. Grouped heads share their key head by
        reshaping the queries (no repeated copy of K/V)."""
        index, q_pos, q_valid = plan.q_index[:, rows], plan.q_pos[:, rows], plan.q_valid[:, rows]
        qb = q[index]  # [B, n, Hq, D]
        b, n, heads, dim = qb.shape
        kv_heads = kb.shape[1]
        group = heads // kv_heads
        qb = qb.view(b, n, kv_heads, group, dim).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, group * n, dim)
        k_pos = torch.arange(kb.shape[2], device=q.device)
        allowed = plan.k_valid[:, None, :] & (k_pos[None, None, :] <= q_pos[:, :, None])  # [B, n, Kmax]
        if window is not None:
            allowed &= k_pos[None, None, :] > q_pos[:, :, None] - window
        if selected is not None:
            allowed &= _selection_mask(selected[index], kb.shape[2]) | ~q_valid[:, :, None]
        scores = torch.matmul(qb, kb.transpose(2, 3)) * scale  # [B, Hkv, group·n, Kmax]
        scores = scores.view(b, kv_heads, group, n, -1).masked_fill(~allowed[:, None, None], float("-inf"))
        probs = (
            torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype).view(b, kv_heads, group * n, -1)
        )
        out = torch.matmul(probs, vb)  # [B, Hkv, group·n, D]
        return out.view(b, kv_heads, group, n, dim).permute(0, 3, 1, 2, 4).reshape(b, n, heads, dim)


def _selection_mask(selected: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[..., S] key positions (−1 = none) → [..., num_keys] boolean mask."""
    mask = torch.zeros((*selected.shape[:-1], num_keys + 1), dtype=torch.bool, device=selected.device)
    mask.scatter_(-1, torch.where(selected >= 0, selected, num_keys), True)
    return mask[..., :num_keys]

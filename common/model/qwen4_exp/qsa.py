"""QSA: gated GQA attention whose keys are chosen per query by a token indexer over compressed blocks.

The indexer keeps, per sequence, each token's raw indexer key (`index_k`) and, at the first slot of every
complete block of `ratio` tokens, the block's compressed key (`index_block`: mean of the raw keys, normed,
rotated at the block's start). A query at position p scores the complete blocks it sees, keeps the
`budget / ratio` best, and attends to their tokens plus the tail of its own incomplete block. Up to
budget + ratio − 1 tokens it is exactly dense attention, and no selection is computed.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from common.kernels.config import KERNELS, KernelConfig
from common.kv.backend import kv_specs, kv_store
from common.kv.batch import ForwardBatch
from common.kv.state import PagedSpec, StateSpec
from common.model.context import ForwardContext
from common.model.fused_linear import FusedLinears, Linear, fuse_linears, project
from common.model.qwen4_exp.config import Qwen4ExpConfig
from common.model.qwen4_exp.norms import OffsetRMSNorm
from common.model.rope import apply_rotary

if TYPE_CHECKING:
    from common.kernels.qsa_indexer import KeyBlocks
    from common.kernels.qsa_prologue import HeadNorm


def _norm_rotate(
    norm: OffsetRMSNorm,
    x: torch.Tensor,
    ctx: ForwardContext,
    fused: bool,
    store: tuple | None = None,
    kernels: KernelConfig = KERNELS,
) -> torch.Tensor:
    """RoPE(norm(x)) for x [T, heads, D]: one Triton kernel when `fused` (common/kernels/norm_rope.py),
    which also stores the key and value in their pages given `store` (norm_rope's)."""
    if fused:
        from common.kernels.norm_rope import norm_rope  # Triton

        return norm_rope(x, norm.weight, norm.eps, ctx.batch.rope_positions, ctx.rotary, store, kernels)
    return apply_rotary(norm(x), ctx.cos, ctx.sin)


def _rotates_fused(fused: bool, ctx: ForwardContext) -> bool:
    """Whether a pass's norms and rotations may run as norm_rope kernels: they rotate each token at one
    position; a prompt's image tokens have three (`ForwardBatch.mrope`)."""
    return fused and ctx.batch.mrope is None


def _block_ends(batch: ForwardBatch, r: int, device: torch.device) -> torch.Tensor | None:
    """[M] indices of the batch's tokens that end a block of r positions (position % r == r − 1), from the
    host's lengths (a `nonzero` over the positions would wait for the GPU); None when there are none. Once
    per pass: every QSA layer asks."""
    return batch.per_pass(f"block_ends_{r}", lambda: _find_block_ends(batch, r, device))


def _find_block_ends(batch: ForwardBatch, r: int, device: torch.device) -> torch.Tensor | None:
    ends, at = [], 0
    for cached, n in zip(batch.cache_lens, batch.query_lens, strict=True):
        first = cached + (r - 1 - cached % r) % r  # the first block end at or after the pass's start
        if first < cached + n:
            ends.append(torch.arange(first - cached + at, at + n, r, device=device))
        at += n
    return torch.cat(ends) if ends else None


class QSAIndexer(nn.Module):
    """Scores compressed key blocks for each query and returns the key positions it may attend to."""

    fused_decode = False
    """Norm and rotate the queries in one Triton kernel, and score the blocks with Triton kernels (decode and
    prefill). Set by `use_fused_kernels`."""

    kernels: KernelConfig = KERNELS
    """The kernel forms and launch options (set where the worker builds the model: `configure_kernels`)."""

    score_bytes = 256 << 20
    """Most bytes of per-head block scores at once (fp32 [queries, Hi, NB]): a long prefill scores its queries
    in slices (25.6K queries over 6.4K blocks would otherwise hold 2.6 GB)."""

    def __init__(self, cfg: Qwen4ExpConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.dim = cfg.indexer_n_heads, cfg.indexer_head_dim
        self.ratio = cfg.indexer_compress_ratio
        self.block_topk = cfg.indexer_budget // self.ratio
        self.index_qk_proj = nn.Linear(cfg.hidden_size, (self.heads + 1) * self.dim, bias=False)
        self.q_layernorm = OffsetRMSNorm(self.dim, cfg.rms_norm_eps)
        self.k_layernorm = OffsetRMSNorm(self.dim, cfg.rms_norm_eps)

    def state_specs(self, dtype: torch.dtype) -> dict[str, StateSpec]:
        spec = PagedSpec((self.dim,), dtype)
        return {"index_k": spec, "index_block": spec}

    def forward(self, qk: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        """Given `index_qk_proj`'s output qk [T, (Hi + 1)·Di] (the attention projects it with its own
        inputs), store the indexer keys of this pass; return key positions [T, S] per query (−1: none), or
        None."""
        batch = ctx.batch
        q, raw_k = self._split(qk)
        raw_store, blocks = self._pages(ctx)
        if self.fused_decode and batch.is_decode:  # the raw keys stored by the kernel
            from common.kernels.qsa_indexer import compress_step  # Triton

            key_blocks = self._key_blocks(raw_k, ctx)
            compress_step(key_blocks, batch.positions, batch.rope_positions, ctx.rotary, self.kernels)
        else:
            raw_store[batch.slot_mapping] = raw_k.to(raw_store.dtype)
            self._compress_completed_blocks(batch, raw_store, blocks, ctx)
        if not batch.is_decode and max(batch.kv_lens) <= self.block_topk * self.ratio + self.ratio - 1:
            return None  # every query sees at most the budget: dense (decode selects: the same keys)
        fused = _rotates_fused(self.fused_decode, ctx)
        q = _norm_rotate(self.q_layernorm, q, ctx, fused, kernels=self.kernels)
        return self._select(q, batch, blocks)

    def prologue_parts(self, qk: torch.Tensor, ctx: ForwardContext) -> tuple[KeyBlocks, HeadNorm]:
        """What a decode step's `forward` hands its kernels before the block scores (the key compression's
        arguments, the queries to normalise and rotate), for qsa_prologue to run beside the attention's."""
        from common.kernels.qsa_prologue import HeadNorm  # Triton

        q, raw_k = self._split(qk)
        norm = self.q_layernorm
        return self._key_blocks(raw_k, ctx), HeadNorm(q, norm.weight, norm.eps)

    def select_after_prologue(self, q: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """A decode step's key positions [T, S] from its normalised, rotated queries q [T, Hi, Di], the
        block keys written (qsa_prologue ran `prologue_parts`)."""
        return self._select(q, ctx.batch, self._pages(ctx)[1])

    def _split(self, qk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """qk [T, (Hi + 1)·Di] → (the queries [T, Hi, Di], the raw key [T, Di]), views."""
        q, raw_k = torch.split(qk, [self.heads * self.dim, self.dim], dim=-1)
        return q.view(-1, self.heads, self.dim), raw_k

    def _pages(self, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's raw keys and block keys, flat [slots, Di] each."""
        paged = ctx.pool.layer(self.layer_idx).paged
        return paged["index_k"].flatten(0, 1), paged["index_block"].flatten(0, 1)

    def _key_blocks(self, raw_k: torch.Tensor, ctx: ForwardContext) -> KeyBlocks:
        """compress_step's keys for a decode pass's raw keys raw_k [T, Di]."""
        from common.kernels.qsa_indexer import KeyBlocks  # Triton

        batch, norm = ctx.batch, self.k_layernorm
        raw, blocks = self._pages(ctx)
        return KeyBlocks(
            raw, raw_k, blocks, batch.page_table, batch.page_size, norm.weight, norm.eps, self.ratio
        )

    def _compress_completed_blocks(
        self, batch: ForwardBatch, raw: torch.Tensor, blocks: torch.Tensor, ctx
    ) -> None:
        """Compressed keys of the blocks whose last token arrived in this pass, stored at their first slot.

        Decode (one token per sequence) writes every token's own block, complete or not, so that nothing
        depends on a host-side count: an incomplete block's key is never read (no query sees the block) and
        is overwritten when its last token arrives. Its members beyond the token are clamped to the token.
        """
        r = self.ratio
        if batch.is_decode:
            seq, pos = batch.seq_index, batch.positions
            starts = pos - pos % r  # [T]
            members = torch.minimum(starts[:, None] + torch.arange(r, device=pos.device), pos[:, None])
            rope_starts = batch.rope_positions - pos % r  # [T]
        else:
            ends = _block_ends(batch, r, batch.positions.device)  # [M] token indices
            if ends is None:
                return
            seq = batch.seq_index[ends]
            starts = batch.positions[ends] - (r - 1)  # [M]
            members = starts[:, None] + torch.arange(r, device=starts.device)  # [M, r]
            rope_starts = batch.rope_at(starts, ends)  # [M] or [3, M]
        keys = raw[batch.slots_of(seq[:, None], members)]  # [M, r, Di]
        pooled = self.k_layernorm(keys.float().mean(dim=1).to(keys.dtype))
        cos, sin = ctx.rotary.cos_sin(rope_starts, pooled.dtype)
        blocks[batch.slots_of(seq, starts)] = apply_rotary(pooled[:, None], cos, sin)[:, 0].to(blocks.dtype)

    def _scores(self, q: torch.Tensor, keys: torch.Tensor, out: torch.Tensor, rows: int) -> None:
        """out [T, NB] = Σ_heads relu(q_h · key) / √D of q [T, Hi, D] against keys [NB, D] (fp32), `rows`
        queries at a time (their per-head scores [rows, Hi, NB] are the big buffer)."""
        for a in range(0, q.shape[0], rows):
            s = torch.einsum("thd,nd->thn", q[a : a + rows].float(), keys).relu_().sum(1)
            out[a : a + rows] = s / math.sqrt(self.dim)

    def _select(self, q: torch.Tensor, batch: ForwardBatch, blocks: torch.Tensor) -> torch.Tensor:
        device, r = q.device, self.ratio
        bound = batch.static_kv if batch.static_kv is not None else max(batch.kv_lens)
        max_blocks = bound // r
        fused = batch.is_decode and self.fused_decode
        if fused:
            from common.kernels.qsa_indexer import SELECT_MAX_BLOCKS, block_scores, select_blocks  # Triton

            scores = block_scores(  # masks unseen blocks itself
                q, blocks, batch.page_table, batch.positions, batch.page_size, r, max_blocks,
                kernels=self.kernels,
            )  # fmt: skip
            one_kernel = self.kernels.select_kernel and 0 < max_blocks <= SELECT_MAX_BLOCKS
            if one_kernel:  # top-k and keys in one kernel
                return select_blocks(scores, batch.positions, self.block_topk, r, self.kernels)
        # (after the kernels' return: four small kernels a layer that their decode steps do not need)
        visible = (batch.positions + 1) // r  # [T] complete blocks each query sees
        block_pos = torch.arange(max_blocks, device=device) * r  # [NB] start position of each block
        if batch.is_decode and not fused:  # one query a sequence: each against its own blocks at once
            keys = blocks[batch.slots_of(batch.seq_index[:, None], block_pos[None, :])].float()  # [T, NB, Di]
            scores = torch.relu(torch.einsum("thd,tnd->thn", q.float(), keys)).sum(1) / math.sqrt(self.dim)
        elif not batch.is_decode:  # every row is written below; allocated at the prompt's bound (kv_bound)
            width = max(max_blocks, (batch.kv_bound or 0) // r)
            scores = torch.empty((q.shape[0], width), device=device)[:, :max_blocks]
            start, rows = 0, max(1, self.score_bytes // (4 * self.heads * max(max_blocks, 1)))
            for b, n in enumerate(batch.query_lens):  # per sequence: its queries against its own blocks
                keys = blocks[batch.slots_of(b, block_pos)]  # [NB, Di]
                if self.fused_decode:
                    from common.kernels.qsa_indexer import prefill_block_scores  # Triton

                    prefill_block_scores(q[start : start + n], keys, scores[start : start + n])
                else:
                    self._scores(q[start : start + n], keys.float(), scores[start : start + n], rows)
                start += n
        scores.masked_fill_(block_pos[None, :] >= visible[:, None] * r, float("-inf"))
        k = min(self.block_topk, max_blocks)
        # torch's decode: ties (ReLU'd scores at 0) to the lower block, as select_blocks breaks them; the
        # fused path past that kernel's reach keeps top-k (a sort of every block costs more)
        if batch.is_decode and not self.fused_decode:
            top_scores, top_blocks = (x[:, :k] for x in scores.sort(dim=-1, descending=True, stable=True))
        else:
            top_scores, top_blocks = scores.topk(k, dim=-1)  # [T, k]
        offsets = torch.arange(r, device=device)
        chosen = torch.where(top_scores[..., None] > float("-inf"), top_blocks[..., None] * r + offsets, -1)
        tail = visible[:, None] * r + offsets[: r - 1]  # [T, r-1] the query's incomplete block
        tail = torch.where(tail <= batch.positions[:, None], tail, -1)
        return torch.cat([chosen.flatten(1), tail], dim=1)


class QSAttention(nn.Module):
    """Gated attention (output × sigmoid(gate)) with q/k norm, partial RoPE and indexer-selected keys (or,
    without an indexer, every key)."""

    fp8_output = "o_proj"
    """The output projection, which `--resident-dtype fp8` turns to fp8 with the inputs (fp8_linear.py)."""

    fused_decode = False
    """Norm and rotate q and k in one Triton kernel each. Set by `use_fused_kernels`."""

    kernels: KernelConfig = KERNELS
    """The kernel forms and launch options (set where the worker builds the model: `configure_kernels`)."""

    fused_in: FusedLinears | None = None
    """q, k, v and the indexer's qk projections as one GEMM (`fuse_projections`)."""

    def __init__(self, cfg: Qwen4ExpConfig, layer_idx: int, indexed: bool = True) -> None:
        """`indexed`: keys chosen by a QSA indexer (`indexed_attention`); else every key (`full_attention`,
        qwen3_next's gated attention)."""
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        hidden = cfg.hidden_size
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim * 2, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.heads * self.head_dim, hidden, bias=cfg.o_bias)
        self.q_norm = OffsetRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.indexer = QSAIndexer(cfg, layer_idx) if indexed else None

    def state_specs(self, dtype: torch.dtype) -> dict[str, StateSpec]:
        index = {} if self.indexer is None else self.indexer.state_specs(dtype)
        return {**kv_specs(self.kv_heads, self.head_dim, dtype), **index}

    def _inputs(self) -> tuple[nn.Linear, ...]:
        index = () if self.indexer is None else (self.indexer.index_qk_proj,)
        return self.q_proj, self.k_proj, self.v_proj, *index

    def fuse_projections(self, copy: bool = True) -> bool:
        """Run q, k, v and the indexer's qk as one GEMM from now on (see common/model/fused_linear.py)."""
        self.fused_in = fuse_linears(self._inputs(), copy)
        return self.fused_in is not None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q, k, v, *index_qk = project(x, self._inputs(), self.fused_in)
        q, gate = q.view(t, self.heads, 2 * self.head_dim).chunk(2, dim=-1)  # [T, H, D] each
        k, v = (y.view(t, self.kv_heads, self.head_dim) for y in (k, v))
        state = ctx.pool.layer(self.layer_idx)
        fused = _rotates_fused(self.fused_decode, ctx)
        store = kv_store(state, ctx.batch.slot_mapping, v) if fused else None
        selected: torch.Tensor | None  # key positions per query; None: every key
        if self._prologue_fits(ctx, store):
            assert store is not None and index_qk  # _prologue_fits
            selected, q, k = self._prologue(index_qk[0], q, k, store, ctx)
        else:
            selected = self.indexer(index_qk[0], ctx) if self.indexer is not None else None
            q = _norm_rotate(self.q_norm, q, ctx, fused, kernels=self.kernels)
            k = _norm_rotate(self.k_norm, k, ctx, fused, store, self.kernels)
        plan, scale = ctx.attn_plan, self.head_dim**-0.5
        out = ctx.backend.forward(
            q, k, v, state, plan, scale, selected=selected, gate=gate, stored=store is not None
        )
        return self.o_proj(out.reshape(t, -1))  # gated by the backend (in its merge kernel: decode)

    def _prologue_fits(self, ctx: ForwardContext, store: tuple | None) -> bool:
        """Whether a pass runs its indexer's key compression and the three norms and rotations as one
        kernel (qsa_prologue): decode with the fused kernels, keys stored by the kernel (`store`)."""
        if self.indexer is None:
            return False
        fused = self.fused_decode and self.indexer.fused_decode and ctx.batch.is_decode
        return self.kernels.prologue_kernel and fused and store is not None

    def _prologue(
        self, index_qk: torch.Tensor, q: torch.Tensor, k: torch.Tensor, store: tuple, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The indexer's key positions, q and k normalised and rotated (k and v stored), through
        qsa_prologue."""
        from common.kernels.qsa_prologue import HeadNorm, qsa_prologue  # Triton

        assert self.indexer is not None  # _prologue_fits
        blocks, index_norm = self.indexer.prologue_parts(index_qk, ctx)
        q_norm = HeadNorm(q, self.q_norm.weight, self.q_norm.eps)
        k_norm = HeadNorm(k, self.k_norm.weight, self.k_norm.eps)
        batch = ctx.batch
        index_q, q, k = qsa_prologue(
            blocks, index_norm, q_norm, k_norm, store, batch.positions, batch.rope_positions, ctx.rotary,
            kernels=self.kernels,
        )  # fmt: skip
        return self.indexer.select_after_prologue(index_q, ctx), q, k

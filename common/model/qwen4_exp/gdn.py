"""Gated DeltaNet: the linear-attention token mixer of qwen4_exp (3 of every 4 layers)."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from common.kernels.config import KERNELS, KernelConfig
from common.kv.batch import ForwardBatch
from common.kv.state import SlotSpec, StateSpec
from common.model.context import ForwardContext
from common.model.fused_linear import FusedLinears, Linear, fuse_linears, project, takes_conv
from common.model.qwen4_exp import delta_rule
from common.model.qwen4_exp.config import Qwen4ExpConfig
from common.model.qwen4_exp.norms import GatedRMSNorm
from common.model.qwen4_exp.varlen import Padding, causal_conv

try:  # fla-core's Triton kernels (GPU); the torch recurrence is used everywhere else
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
except ImportError:  # pragma: no cover - depends on the machine
    chunk_gated_delta_rule = fused_recurrent_gated_delta_rule = None


FLA_CHUNK = 64
"""Tokens per chunk of fla's chunked gated delta rule (its default `chunk_size`)."""


def _fla_varlen(batch: ForwardBatch, device: torch.device) -> dict[str, torch.Tensor]:
    """The chunked kernel's varlen arguments from the host's lengths, once per pass: `cu_seqlens_cpu`, and
    `chunk_indices` [chunks, 2] (sequence, chunk within it) made on the device from Python ints. Given
    neither, fla reads the lengths back from the device; given only the first, it builds the chunk list on
    the host and copies it over with a blocking copy — a host sync in every GDN layer either way."""
    return batch.per_pass("fla_varlen", lambda: _build_fla_varlen(batch.query_lens, device))


def _build_fla_varlen(lens: list[int], device: torch.device) -> dict[str, torch.Tensor]:
    pieces = []
    for b, n in enumerate(lens):
        chunk = torch.arange(-(-n // FLA_CHUNK), device=device)
        pieces.append(torch.stack([torch.full_like(chunk, b), chunk], dim=1))
    return {
        "cu_seqlens_cpu": torch.tensor([0, *itertools.accumulate(lens)]),
        "chunk_indices": torch.cat(pieces),
    }


class GatedDeltaNet(nn.Module):
    """qkv/z/b/a projections, depthwise causal conv, gated delta rule, gated RMSNorm, out projection.

    Per-sequence state: `conv` (the last K-1 qkv inputs) and `recurrent` ([Hv, Dk, Dv] fp32).
    """

    fused_decode = False
    """Run a decode step's conv, recurrence with its gates, and output norm as three Triton kernels
    (common/kernels: causal_conv, gated_delta, gated_norm) instead of ~60 torch ops. Set by
    `use_fused_kernels`."""

    fused_in: FusedLinears | None = None
    """The four input projections as one GEMM (`fuse_projections`)."""

    kernels: KernelConfig = KERNELS
    """The kernel forms and launch options (set where the worker builds the model: `configure_kernels`)."""

    fp8_output = "out_proj"
    """The output projection, which `--resident-dtype fp8` turns to fp8 with the inputs (fp8_linear.py)."""

    def __init__(self, cfg: Qwen4ExpConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        hidden = cfg.hidden_size
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.hv, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.hv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps, cfg.output_gate_act)
        self.out_proj = Linear(self.value_dim, hidden, bias=False)

    def state_specs(self, dtype: torch.dtype) -> dict[str, StateSpec]:
        return {
            "conv": SlotSpec((self.conv_dim, self.kernel - 1), dtype),
            "recurrent": SlotSpec((self.hv, self.dk, self.dv), torch.float32),
        }

    def _inputs(self) -> tuple[nn.Linear, ...]:
        return self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a

    def fuse_projections(self, copy: bool = True) -> bool:
        """Run qkv, z, b and a as one GEMM from now on (see common/model/fused_linear.py)."""
        self.fused_in = fuse_linears(self._inputs(), copy)
        return self.fused_in is not None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        state = ctx.pool.layer(self.layer_idx).slots
        slots = ctx.batch.slot_ids
        if self.fused_decode and max(ctx.batch.query_lens) == 1:  # one token a sequence: no padding
            return self._fused_step(x, state, slots)
        qkv, z, b, a = project(x, self._inputs(), self.fused_in)  # [T, conv_dim], [T, Hv·Dv], [T, Hv] × 2
        t, split = x.shape[0], [self.key_dim, self.key_dim, self.value_dim]
        pad = Padding.of(ctx.batch)
        if self.fused_decode:  # q, k, v each contiguous, as fla wants them; qkv read in place
            from common.kernels.causal_conv import conv_prefill  # Triton

            weight = self.conv1d.weight[:, 0]
            q, k, v = conv_prefill(
                qkv, state["conv"], slots, weight, pad.seq, pad.offset, pad.lens, 1, True, split
            )
        else:
            qkv = F.silu(causal_conv(qkv, state["conv"], slots, self.conv1d.weight[:, 0], pad))
            q, k, v = torch.split(qkv, split, dim=-1)
        q, k = q.view(t, self.hk, self.dk), k.view(t, self.hk, self.dk)  # [T, Hk, Dk]
        v = v.view(t, self.hv, self.dv)
        beta = torch.sigmoid(b)  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [T, Hv]
        core = self._delta_rule(q, k, v, g, beta, state["recurrent"], slots, pad, ctx)  # [T, Hv, Dv]
        return self._out(core, z, x.dtype)

    def _fused_step(
        self, x: torch.Tensor, state: dict[str, torch.Tensor], slots: torch.Tensor
    ) -> torch.Tensor:
        """A decode step in Triton kernels (projections with conv + SiLU, recurrence + gates, gated norm);
        states updated in place in their slots."""
        from common.kernels.gated_delta import gated_delta_step

        epilogue = takes_conv(x, self.fused_in, self.kernels)
        qkv, z, b, a = self._project_step(x, state["conv"], slots, epilogue)
        recurrent = state["recurrent"]
        # with the epilogue the kernel just before wrote the gates: read after the programmatic wait
        core = gated_delta_step(
            qkv, a, b, self.A_log, self.dt_bias, recurrent, slots, self.hk, gates_settled=not epilogue,
            kernels=self.kernels,
        )  # fmt: skip
        return self._out(core, z, x.dtype)

    def _project_step(
        self, x: torch.Tensor, history: torch.Tensor, slots: torch.Tensor, epilogue: bool
    ) -> tuple[torch.Tensor, ...]:
        """One token a sequence: the input projections, qkv convolved and SiLU'd (its history shifted). With
        `epilogue` (takes_conv) the conv is the projection GEMV's epilogue (gemv.ConvStep), else its own
        kernel after the projections."""
        from common.kernels import gemv  # Triton
        from common.kernels.causal_conv import conv_step

        weight = self.conv1d.weight[:, 0]  # [conv_dim, K]
        if epilogue:
            fused = self.fused_in
            assert fused is not None  # takes_conv: a FusedLinears
            step = gemv.ConvStep(history, slots, weight)
            out = gemv.gemv(x, fused.weight, conv=step, kernels=self.kernels)
            return fused.split(out)
        qkv, z, b, a = project(x, self._inputs(), self.fused_in)
        return conv_step(qkv, history, slots, weight, silu=True, kernels=self.kernels), z, b, a

    def _out(self, core: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Gated norm (gate z [T, Hv·Dv]) and out projection of the recurrence's output core [T, Hv, Dv]
        (fp32, or fla's output dtype) → [T, H]. With the fused kernels, the norm is one Triton kernel
        (rounding once; torch rounds the normalised values to `dtype` before the weight): in torch a
        prefill chunk's norm is ~10 passes over [T, Hv, Dv] in fp32, ~4 GB at 8,192 tokens."""
        t, norm = core.shape[0], self.norm
        if self.fused_decode:
            from common.kernels.gated_norm import ACTIVATIONS, gated_rms_norm  # Triton

            if norm.act_name in ACTIVATIONS:
                normed = gated_rms_norm(core, z, norm.weight, norm.eps, dtype, kernels=self.kernels)
                return self.out_proj(normed)
        out = norm(core.to(dtype), z.reshape(t, self.hv, self.dv))
        return self.out_proj(out.reshape(t, self.value_dim))

    def _delta_rule(
        self, q, k, v, g, beta, recurrent, slots, pad: Padding, ctx: ForwardContext
    ) -> torch.Tensor:
        """q, k [T, Hk, Dk], v [T, Hv, Dv] → the recurrence's output [T, Hv, Dv]."""
        if q.is_cuda and chunk_gated_delta_rule is not None:  # fla maps value head h to key head h // (Hv/Hk)
            return self._fla(q, k, v, g, beta, recurrent, slots, pad, ctx)
        if self.hv != self.hk:  # each key head serves hv / hk consecutive value heads
            q = q.repeat_interleave(self.hv // self.hk, dim=1)
            k = k.repeat_interleave(self.hv // self.hk, dim=1)
        if pad.max_len == 1:
            out, new = delta_rule.recurrent_step(q, k, v, g, beta, recurrent[slots])
            recurrent[slots] = new
            return out
        out, new = delta_rule.chunked(
            pad.pad(q), pad.pad(k), pad.pad(v), pad.pad(g), pad.pad(beta), recurrent[slots]
        )
        recurrent[slots] = new
        return pad.unpad(out)

    def _fla(self, q, k, v, g, beta, recurrent, slots, pad: Padding, ctx: ForwardContext) -> torch.Tensor:
        """fla-core over the flat batch: varlen through cu_seqlens, states read from and written to slots."""
        cu = F.pad(pad.lens.cumsum(0), (1, 0))  # int64, as fla expects
        kernel = fused_recurrent_gated_delta_rule
        host = {}
        if not ctx.batch.is_decode:  # the chunked kernel's chunk lists from the host's lengths: no sync
            kernel = chunk_gated_delta_rule
            host = _fla_varlen(ctx.batch, q.device)
        out, new = kernel(  # by keyword: the recurrent kernel takes gk, gv before beta
            q=q[None],
            k=k[None],
            v=v[None],
            g=g[None],
            beta=beta[None],
            initial_state=recurrent[slots],
            output_final_state=True,
            cu_seqlens=cu,
            use_qk_l2norm_in_kernel=True,
            **host,
        )
        recurrent[slots] = new.float()
        return out[0]  # in q's dtype: the norm reads it as it is

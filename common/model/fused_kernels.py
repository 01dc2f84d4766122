"""Handing a built model its kernel configuration, and switching it onto the fused kernels (common/kernels/)
or back to torch ops."""

from __future__ import annotations

from typing import Any

from torch import nn

from common.kernels.config import KERNELS, KernelConfig
from common.model.fp8_linear import Fp8Linear
from common.model.fused_linear import FusedLinears, Linear, fuse_projections
from common.model.moe import SparseMoeBlock
from common.model.qwen4_exp.gdn import GatedDeltaNet
from common.model.qwen4_exp.hyper import HyperConnection
from common.model.qwen4_exp.model import Qwen4DecoderLayer
from common.model.qwen4_exp.ple import PLE
from common.model.qwen4_exp.qsa import QSAIndexer, QSAttention

KERNEL_READERS = (
    Linear,
    Fp8Linear,
    SparseMoeBlock,
    HyperConnection,
    GatedDeltaNet,
    PLE,
    QSAIndexer,
    QSAttention,
    Qwen4DecoderLayer,
)
"""The module classes whose passes read the kernel configuration (their `kernels`)."""


def configure_kernels(model: nn.Module, kernels: KernelConfig, backend: object | None = None) -> None:
    """Hand `kernels` to every module of `model` that reads it (and keep it as `model.kernels`): once, where
    the worker builds the model, before a pass is recorded (a recorded pass keeps the kernels it was recorded
    with)."""
    model.kernels = kernels  # type: ignore[assignment]  # torch types Module attributes as Tensor | Module only
    for module in model.modules():
        if isinstance(module, KERNEL_READERS):
            module.kernels = kernels
        fused = getattr(module, "fused_in", None)
        if isinstance(fused, FusedLinears):
            fused.kernels = kernels
    for owner in (getattr(model, "experts", None), backend):  # an offloaded provider, the attention backend
        if hasattr(owner, "kernels"):
            owner.kernels = kernels


def use_fused_kernels(
    model: nn.Module, on: bool = True, backend: object | None = None, fuse_copy: bool = True
) -> None:
    """Switch the fused Triton kernels on or off for `model` (on by default on CUDA: Engine, WorkerConfig):
    cache resolution and merged expert copies of an offloaded provider, grouped int4 prefill GEMMs, the
    Gated DeltaNet step, causal convs, PLE's n-gram hashing and gate, hyper-connections, QSA's norm + RoPE and
    indexer, the router (with a few rows' replay and shared expert: moe_dispatch.py) and, given the runner's
    attention `backend`, paged decode attention (each module's `fused_decode` and common/kernels). They need
    CUDA, or Triton's interpreter (tests). Switching on also fuses each module's same-input projections into
    one GEMM (fused_linear.py; `fuse_copy` False: only those whose weights already lie back to back);
    switching off leaves them fused (the same products). Switch before the first decode pass: a recorded pass
    (common/engine/graphs.py) keeps the path it was recorded with."""
    if on:
        fuse_projections(model, fuse_copy)
        configure_kernels(model, getattr(model, "kernels", KERNELS), backend)  # the new fused projections too
    fused = (GatedDeltaNet, HyperConnection, PLE, QSAIndexer, QSAttention, SparseMoeBlock)
    for module in model.modules():
        if isinstance(module, fused):
            module.fused_decode = on
        hook: Any = getattr(module, "routing_hook", None)
        if hasattr(hook, "fused"):  # a routing replay (benchmarks)
            hook.fused = on
    if hasattr(backend, "fused_decode"):
        backend.fused_decode = on
    experts: Any = model.experts  # an offloaded provider has kernel switches
    if hasattr(experts, "fused_resolve"):
        experts.fused_resolve = experts.copies.merged = on
        experts.fused_int4_prefill = on and experts.int4_kernels
        experts.fused_dense_prefill = on and experts.dense_kernels and experts.kernels.moe_dense

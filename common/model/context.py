"""ForwardContext: what every layer of one forward pass shares."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from common.kv.backend import AttentionBackend
from common.kv.batch import ForwardBatch
from common.kv.state import StatePool


@dataclass
class ForwardContext:
    """The batch, its state pools, the attention backend with its plan, and the rotary embedding."""

    batch: ForwardBatch
    pool: StatePool
    backend: AttentionBackend
    attn_plan: Any
    rotary: Any = None
    """The model's RotaryEmbedding (set by the model at the start of its forward), for the batch's cos/sin
    and for layers that rotate at other positions or compute their own (the fused kernels)."""
    rotary_dtype: torch.dtype | None = None
    """The dtype of `cos` and `sin` (the activations')."""

    @property
    def cos(self) -> torch.Tensor:
        """[T, rot_dim] at the batch's rotary positions, computed on first use (a recorded decode step whose
        kernels compute their own never launches the ~9 small kernels)."""
        return self._rotation[0]

    @property
    def sin(self) -> torch.Tensor:
        """[T, rot_dim], as `cos`."""
        return self._rotation[1]

    @cached_property
    def _rotation(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch
        positions = batch.mrope if batch.mrope is not None else batch.rope_positions
        return self.rotary.cos_sin(positions, self.rotary_dtype)

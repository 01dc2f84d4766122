"""ForwardContext: what every layer of one forward pass shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from common.kv.backend import AttentionBackend
from common.kv.batch import ForwardBatch
from common.kv.state import StatePool


@dataclass
class ForwardContext:
    """The batch, its state pools, the attention backend with its plan, and the rotary cos/sin."""

    batch: ForwardBatch
    pool: StatePool
    backend: AttentionBackend
    attn_plan: Any
    cos: torch.Tensor | None = None  # [T, rot_dim], set by the model at the start of its forward
    sin: torch.Tensor | None = None
    rotary: Any = None  # the model's RotaryEmbedding, for layers that rotate at other positions

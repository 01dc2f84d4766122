"""The model as the engine runs it: the members of common/model's causal LMs that the runner, the recorded
decode passes and the speculator call. Typing only: `load_model` gives an `nn.Module`, whose attributes
type-check as tensors or modules; the runner takes it as a `CausalLM`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, cast

import torch
from torch import nn

from common.config import ModelConfig
from common.kv.state import StateSpec
from common.model.context import ForwardContext
from common.model.provider import ExpertProvider


class CausalLM(Protocol):
    """A decoder-only model over a flat batch whose per-sequence state lives in a StatePool."""

    config: ModelConfig
    experts: ExpertProvider

    def __call__(self, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states [T, H] after the final norm for every token of the batch."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def modules(self) -> Iterator[nn.Module]: ...

    def state_specs(self, dtype: torch.dtype) -> list[dict[str, StateSpec]]:
        """Per layer, the per-sequence state its token mixer keeps."""
        ...

    def forward_chunks(self, contexts: list[ForwardContext]) -> torch.Tensor:
        """One sequence's consecutive chunks layer by layer → the last chunk's hidden states [T, H]."""
        ...

    def forward_groups(self, contexts: list[ForwardContext]) -> torch.Tensor:
        """A decode pass's lanes in groups → hidden states [T, H], the groups' lanes in order."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] → [N, V] logits in fp32."""
        ...


class MTPCausalLM(CausalLM, Protocol):
    """A causal LM loaded with its multi-token-prediction head (`with_mtp`)."""

    def forward_streams(self, ctx: ForwardContext) -> torch.Tensor:
        """Every token's pre-mixer streams [T, hc·H]."""
        ...

    def draft(self, streams: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP rows: (draft logits [T, V], MTP streams [T, hc·H])."""
        ...

    def mix(self, streams: torch.Tensor) -> torch.Tensor:
        """Streams [T, hc·H] → hidden states [T, H] after the final norm."""
        ...


def as_causal_lm(model: nn.Module | CausalLM) -> CausalLM:
    """`model` (one of common/model's causal LMs) typed as what the engine calls of it."""
    return cast(CausalLM, model)


def as_mtp(model: CausalLM | nn.Module) -> MTPCausalLM:
    """`model`, loaded with its MTP head, typed as what speculative decoding calls of it."""
    return cast(MTPCausalLM, model)

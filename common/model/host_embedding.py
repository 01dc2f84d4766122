"""Token embeddings in host memory (`--embeddings-on-host`): each pass gathers only its tokens' rows.

Flash-Next's embedding is 248,320 × 2560 in bf16, 1.27 GB of VRAM that a pass reads a few rows of; on the
host it frees ~490 int4 expert slots at the same budget (the first source moved 1.18 GiB this way). The rows
are read by the GPU through the mapping (common/model/host_rows.py), inside recorded decode steps too.

A HostEmbedding is a host-table owner, as PLE is (`attach_table`, `table_shape`, `table_parts`): the memory
plan counts no device bytes for it, decode exports its rows and prefill attaches them like the n-gram table.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
from torch import nn

from common.model.host_rows import HostRows


class HostTableOwner(Protocol):
    """A module whose table lives in host memory, attached after construction (HostEmbedding, PLE)."""

    table: HostRows | None
    """The attached table; None before `attach_table`."""
    table_parts: int
    """How many shards the table comes in (`ngram_shard_rows`)."""

    def table_shape(self) -> tuple[int, int]: ...

    def attach_table(self, table: HostRows) -> None: ...


def host_table_owners(model: nn.Module) -> dict[str, HostTableOwner]:
    """The modules of `model` that own a host table, by module name."""
    return {name: cast(HostTableOwner, m) for name, m in model.named_modules() if hasattr(m, "attach_table")}


class HostEmbedding(nn.Module):
    """nn.Embedding's forward over a HostRows table (attached after construction)."""

    table_parts = 1
    """The table is one block (the n-gram table comes in checkpoint shards)."""

    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.dim, self.dtype = num_embeddings, dim, dtype
        self.table: HostRows | None = None

    def table_shape(self) -> tuple[int, int]:
        return self.num_embeddings, self.dim

    def attach_table(self, table: HostRows) -> None:
        self.table = table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] → rows [..., dim] in the model dtype, on ids' device."""
        assert self.table is not None, "no table attached"
        return self.table.lookup(ids, self.dtype)


def embeddings_to_host(model: nn.Module) -> None:
    """Replace `model.model.embed_tokens` by a HostEmbedding holding its rows (a host copy; on the meta
    device, an empty one: the memory plan's model). Tied embeddings stay: the head reads every row."""
    inner = model.get_submodule("model")
    if getattr(model.config, "tie_word_embeddings", False):
        raise ValueError(
            "--embeddings-on-host: this model ties its embeddings to the head, which needs them on the device"
        )
    weight = inner.get_submodule("embed_tokens").get_parameter("weight").detach()
    host = HostEmbedding(weight.shape[0], weight.shape[1], weight.dtype)
    if weight.device.type != "meta":
        host.attach_table(HostRows(weight.to("cpu", copy=True)))
    inner.embed_tokens = host

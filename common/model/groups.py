"""Grouped decode passes: a pass's lanes in groups, each running the layer stack on a stream of its own.

An offloaded decode step at eight lanes is its miss copies plus the compute that waits for them, layer after
layer: a layer's experts cannot be computed before their copies are in, and the next layer's copies cannot
start before this layer's output is routed. With the lanes in two groups, one group's layer computes while
the other's misses copy, so the copy stream runs with few gaps. The price is compute: the resident weights
(attention, shared experts, routers) are read once a group (bench/LOG.md, Lane groups).

Every token's computation is its own, so a grouped pass computes what the whole pass does (up to the
GEMMs' choice of kernels for fewer rows).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import nullcontext

import torch
from torch import nn

from common.config import ModelConfig
from common.model.context import ForwardContext
from common.model.provider import ExpertProvider

DECODE_GROUPS = 2
"""Most groups a decode pass's lanes are split into (the expert cache's `CacheTables.resolve` takes a
`group`)."""


def lane_groups(lanes: int, groups: int) -> list[tuple[int, int]]:
    """[start, stop) of each of `groups` groups of consecutive lanes (the first ones one larger if uneven)."""
    size, extra = divmod(lanes, groups)
    bounds, start = [], 0
    for g in range(groups):
        stop = start + size + (g < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def pass_groups(model: nn.Module, lanes: int, split_lanes: int) -> int:
    """Groups a recorded decode pass of `lanes` lanes runs as: DECODE_GROUPS from `split_lanes` lanes on
    (0: never), where the model runs grouped passes (`forward_groups`) and its expert provider takes them,
    and a group's expert choices fit its share of the staging rows (`CacheTables.resolve`); else one."""
    if not split_lanes or lanes < max(2, split_lanes) or not hasattr(model, "forward_groups"):
        return 1
    experts, cfg = model.experts, model.config
    assert isinstance(experts, ExpertProvider) and isinstance(cfg, ModelConfig)
    groups = min(experts.max_groups, DECODE_GROUPS)
    return groups if -(-lanes // groups) * cfg.top_k <= cfg.num_experts // groups else 1


def run_groups(
    layers: Iterable[nn.Module],
    xs: list[torch.Tensor],
    contexts: Sequence[ForwardContext],
    experts: ExpertProvider,
) -> list[torch.Tensor]:
    """xs[g] [T_g, ...] (group g's hidden states, its lanes in `contexts[g]`) through every layer, layer by
    layer in group order, each group's work on its own CUDA stream (forked from the current stream and
    joined back at the end; on the CPU in order) → the new xs.

    Layers take part unchanged, as `layer(x, ctx)` with a context of the group's lanes. The expert provider
    makes the groups resolve each layer in turn (`ExpertProvider.turn`: the tables and a routing replay's
    cursor are updated in place) and gives each group its own request history and staging rows
    (`ExpertProvider.grouped`)."""
    device = xs[0].device
    main = torch.cuda.current_stream(device) if device.type == "cuda" else None
    # high priority: the groups' kernels go ahead of a copy launch's programs waiting for SMs; and from
    # torch's pool of high-priority streams, not the pool the copy streams come from (a stream shared with
    # the copies would queue a group's compute behind them)
    streams = [torch.cuda.Stream(device, priority=-1) if main is not None else None for _ in contexts]
    for stream, x in zip(streams, xs, strict=True):
        if stream is not None and main is not None:  # (both or neither: streams are CUDA's)
            stream.wait_stream(main)
            x.record_stream(stream)  # made on the current stream, read and dropped on the group's
    with experts.grouped(len(contexts)):
        for layer in layers:
            for g, (stream, ctx) in enumerate(zip(streams, contexts, strict=True)):
                experts.group = g
                with torch.cuda.stream(stream) if stream is not None else nullcontext():
                    xs[g] = layer(xs[g], ctx)
    for stream, x in zip(streams, xs, strict=True):
        if stream is not None and main is not None:
            main.wait_stream(stream)
            x.record_stream(main)
    return xs

"""Per-sequence state: what each layer keeps between forward passes, and the pools that hold it.

A layer declares its state as named specs. Two kinds cover every architecture Spillway runs:
- `PagedSpec`: grows with the sequence, stored in fixed-size pages (attention K/V, indexer block keys);
- `SlotSpec`: fixed size per sequence, one slot per running sequence (recurrent and conv states of linear
  attention, n-gram history).
`StatePool` allocates one tensor per (layer, name) up front, so the pools can be exported once (CUDA IPC)
and written in place by another process. A sequence owns a list of pages and one slot index.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from common.ipc.hostmem import host_list_to


@dataclass(frozen=True)
class PagedSpec:
    """State that grows by one `token_shape` entry per token, stored in pages."""

    token_shape: tuple[int, ...]
    dtype: torch.dtype
    kv: bool = False
    """Attention keys or values: stored in the KV dtype (fp8 with a per-layer scale, see common/kv/fp8.py)
    when one is asked for; other paged state stays in the model dtype."""


@dataclass(frozen=True)
class SlotSpec:
    """Fixed-size state of one sequence, `shape` per slot; set to `fill` when a sequence takes the slot."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: float = 0


StateSpec = PagedSpec | SlotSpec


@runtime_checkable
class StatefulMixer(Protocol):
    """A token mixer that keeps per-sequence state: the specs of its state tensors, by name."""

    def state_specs(self, dtype: torch.dtype) -> dict[str, StateSpec]: ...


Allocator = Callable[[tuple[int, ...], torch.dtype, torch.device | str], torch.Tensor]


class PoolExhausted(RuntimeError):
    """The pool has no free pages or slots left for the request."""


COPY_PAGES = 256
"""Pages a state copy (`StatePool.copy`) gathers at once into a temporary (bounded, whatever the prompt's
length: a 128K-token prompt has thousands of pages)."""


class IndexAllocator:
    """Free list of the integers [0, size): the lowest free ones first, so the indices in use stay packed
    at the bottom (KV lending lends the top, common/experts/kv_lending.py). O(log size) an index.

    `limit`: indices at or above it are not handed out; an alloc that would need them calls
    `on_short(end)` first (which may raise the limit to `end` or more), and every free calls `on_free()`."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[int] = list(range(size))  # a heap
        self._used = bytearray(size)
        self.limit = size
        self.on_short: Callable[[int], None] | None = None
        self.on_free: Callable[[], None] | None = None

    @property
    def num_free(self) -> int:
        """Free indices, those past the limit included (an alloc can raise it)."""
        return len(self._free)

    def high_water(self) -> int:
        """One past the highest index in use (0 when none is)."""
        return self._used.rfind(1) + 1

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(f"asked for {n} of {self.size}, {len(self._free)} free")
        out = [heapq.heappop(self._free) for _ in range(n)]
        end = out[-1] + 1 if out else 0
        if end > self.limit and self.on_short is not None:
            self.on_short(end)
        if end > self.limit:
            for i in out:
                heapq.heappush(self._free, i)
            raise PoolExhausted(
                f"asked for {n} of {self.size}: {end - self.limit} past the limit {self.limit}"
            )
        for i in out:
            self._used[i] = 1
        return out

    def free(self, indices: list[int]) -> None:
        for i in indices:
            self._used[i] = 0
            heapq.heappush(self._free, i)
        if indices and self.on_free is not None:
            self.on_free()


@dataclass
class SequenceState:
    """What one sequence owns in a StatePool."""

    slot: int
    """Index into every SlotSpec tensor."""
    pages: list[int] = field(default_factory=list)
    """Pages of every PagedSpec tensor, in token order."""
    num_cached: int = 0
    """Tokens whose state is already written."""
    rope_delta: int = 0
    """What the rotary position of a token after the prompt's last image adds to its position (≤ 0: an
    image's tokens take fewer positions than tokens; common/model/qwen4_exp/positions.py)."""
    images: PromptImages | None = None
    """The prompt's images, while the prompt is prefilled (decode needs only `rope_delta`)."""


@dataclass
class PromptImages:
    """What a prompt's images change in its forward passes: its image tokens' embeddings (the vision
    encoder's, taken instead of the token's) and every prompt token's multimodal rotary position."""

    token_index: torch.Tensor
    """[N] int64 (host) prompt position of each image token, ascending."""
    embeds: torch.Tensor
    """[N, H] their embeddings, in that order."""
    mrope: torch.Tensor
    """[3, P] int64 (temporal, height, width) rotary position of each prompt token."""


@dataclass
class LayerState:
    """One layer's view of the pools: its paged tensors [pages, page_size, *token_shape] and slot tensors."""

    paged: dict[str, torch.Tensor]
    slots: dict[str, torch.Tensor]
    fills: dict[str, float] = field(default_factory=dict)
    kv_scale: torch.Tensor | None = None
    """[2] float32 (K, V): what the layer's fp8 K/V pages are multiplied by when read; None = not fp8."""


def _checked(given: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A paged tensor made for the pool elsewhere (KV lending's), if it has the spec's shape and dtype."""
    if given.shape != shape or given.dtype != dtype:
        raise ValueError(
            f"a given paged tensor is {given.dtype}{list(given.shape)}, not {dtype}{list(shape)}"
        )
    return given


class StatePool:
    """Every layer's per-sequence state for up to `max_seqs` sequences and `num_pages` pages of tokens."""

    def __init__(
        self,
        layer_specs: list[dict[str, StateSpec]],
        num_pages: int,
        page_size: int,
        max_seqs: int,
        device: torch.device | str,
        allocate: Allocator | None = None,
        paged: list[dict[str, torch.Tensor]] | None = None,
    ) -> None:
        """`allocate(shape, dtype, device)` makes each pool tensor (default torch.zeros; the decode worker
        passes one whose memory another process can map); `paged`, each layer's paged tensors made already
        (KV lending's, common/experts/kv_lending.py), is used instead for those."""
        alloc = allocate or (lambda shape, dtype, dev: torch.zeros(shape, dtype=dtype, device=dev))
        self.page_size, self.num_pages, self.max_seqs = page_size, num_pages, max_seqs
        self.layers: list[LayerState] = []
        for specs in layer_specs:
            made = paged[len(self.layers)] if paged is not None else {}
            tensors = {}
            for name, s in specs.items():
                if isinstance(s, PagedSpec):
                    shape = (num_pages, page_size, *s.token_shape)
                    given = made.get(name)
                    tensors[name] = (
                        _checked(given, shape, s.dtype)
                        if given is not None
                        else alloc(shape, s.dtype, device)
                    )
            slots = {
                name: alloc((max_seqs, *s.shape), s.dtype, device)
                for name, s in specs.items()
                if isinstance(s, SlotSpec)
            }
            fills = {name: s.fill for name, s in specs.items() if isinstance(s, SlotSpec)}
            self.layers.append(LayerState(tensors, slots, fills))
        self.kv_scales = self._alloc_kv_scales(alloc, device)
        self.pages = IndexAllocator(num_pages)
        self.slots = IndexAllocator(max_seqs)

    def _alloc_kv_scales(self, alloc: Allocator, device: torch.device | str) -> torch.Tensor | None:
        """One [layers, 2] float32 tensor of K/V scales when any layer stores K/V in fp8 (one tensor, not one
        per layer: each exported tensor costs an IPC handle); 1 until the runner calibrates them."""
        if not any(t.dtype == torch.float8_e4m3fn for layer in self.layers for t in layer.paged.values()):
            return None
        scales = alloc((len(self.layers), 2), torch.float32, device)
        scales.fill_(1.0)
        self._bind_kv_scales(scales)
        return scales

    def _bind_kv_scales(self, scales: torch.Tensor) -> None:
        for i, layer in enumerate(self.layers):
            if any(t.dtype == torch.float8_e4m3fn for t in layer.paged.values()):
                layer.kv_scale = scales[i]  # a view: attach() rebinds it to the exporter's tensor

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Every pool tensor as `{layer}.{name}`, plus `kv_scales` with fp8 K/V (what decode exports: the
        prefill process reads decode's scales, so both quantize alike)."""
        out = {}
        for i, layer in enumerate(self.layers):
            for name, t in (layer.paged | layer.slots).items():
                out[f"{i}.{name}"] = t
        if self.kv_scales is not None:
            out["kv_scales"] = self.kv_scales
        return out

    def attach(self, tensors: dict[str, torch.Tensor]) -> None:
        """Use another process's pool tensors (named as by named_tensors) in place of this pool's own."""
        for key, mine in self.named_tensors().items():
            if key not in tensors or tensors[key].shape != mine.shape or tensors[key].dtype != mine.dtype:
                raise ValueError(f"state pool tensor {key}: expected {tuple(mine.shape)} {mine.dtype}")
            if key == "kv_scales":
                self.kv_scales = tensors[key]
                self._bind_kv_scales(self.kv_scales)
                continue
            i, name = key.split(".", 1)
            layer = self.layers[int(i)]
            (layer.paged if name in layer.paged else layer.slots)[name] = tensors[key]

    def layer(self, index: int) -> LayerState:
        return self.layers[index]

    def new_sequence(self) -> SequenceState:
        """Take a slot (resetting its fixed-size state to each spec's fill value) for a new sequence."""
        (slot,) = self.slots.alloc(1)
        for layer in self.layers:
            for name, tensor in layer.slots.items():
                tensor[slot].fill_(layer.fills.get(name, 0))
        return SequenceState(slot=slot)

    def reserve(self, seq: SequenceState, num_tokens: int) -> None:
        """Make sure `seq` has pages for `num_tokens` tokens in all."""
        needed = -(-num_tokens // self.page_size) - len(seq.pages)
        if needed > 0:
            seq.pages.extend(self.pages.alloc(needed))

    def snapshot(self, seq: SequenceState) -> list[dict[str, torch.Tensor]]:
        """A copy of every fixed-size state of `seq` (paged state rolls back by its length alone)."""
        return [{name: t[seq.slot].clone() for name, t in layer.slots.items()} for layer in self.layers]

    def restore(self, seq: SequenceState, snap: list[dict[str, torch.Tensor]], num_cached: int) -> None:
        """Put back a snapshot and the length it was taken at."""
        for layer, saved in zip(self.layers, snap, strict=True):
            for name, value in saved.items():
                layer.slots[name][seq.slot].copy_(value)
        seq.num_cached = num_cached

    def fork(self, seq: SequenceState) -> SequenceState:
        """A new sequence holding a copy of `seq`'s state: its own pages (the cached tokens' entries copied)
        and slot (the fixed-size state copied). For many requests that share a prompt (benchmarks)."""
        twin = SequenceState(slot=self.slots.alloc(1)[0])
        self.reserve(twin, seq.num_cached)
        self.copy(seq, twin)
        return twin

    def copy(self, src: SequenceState, dst: SequenceState) -> None:
        """Make `dst` (its own slot, pages reserved for `src`'s tokens) a copy of `src`: the cached tokens'
        pages, COPY_PAGES at a time (a gather's temporary stays small, whatever the prompt), the fixed-size
        state and the length. Queued on the device, no host wait."""
        used = -(-src.num_cached // self.page_size)
        assert len(dst.pages) >= used, "the copy's pages are not reserved"
        for at in range(0, used, COPY_PAGES):
            pages = (src.pages[at : at + COPY_PAGES], dst.pages[at : at + COPY_PAGES])
            index: dict[torch.device, list[torch.Tensor]] = {}  # (src, dst) pages on each device
            for tensor in (t for layer in self.layers for t in layer.paged.values()):
                if tensor.device not in index:
                    index[tensor.device] = [host_list_to(p, tensor.device) for p in pages]
                src_pages, dst_pages = index[tensor.device]
                tensor[dst_pages] = tensor[src_pages]
        for tensor in (t for layer in self.layers for t in layer.slots.values()):
            tensor[dst.slot].copy_(tensor[src.slot])
        dst.num_cached, dst.rope_delta = src.num_cached, src.rope_delta

    def release(self, seq: SequenceState) -> None:
        """Return a finished sequence's pages and slot."""
        self.pages.free(seq.pages)
        self.slots.free([seq.slot])
        seq.pages = []
        seq.num_cached = 0

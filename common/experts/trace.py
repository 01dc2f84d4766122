"""Routing traces: the experts each token chose in each MoE layer, recorded or synthetic.

A trace drives the cache simulator (and benchmark replay) instead of a router whose random weights carry no
realistic skew. `synthetic_zipf` is the benchmarks' standard trace (bench/README.md, Measures): per layer a
Zipf popularity over a seeded permutation of the experts, exponents spread over [s_min, s_max] in a shuffled
layer order, and temporal reuse of the previous token's experts. Traces are stored as safetensors (tensors +
JSON metadata), never pickled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

TRACE_FORMAT = "spillway-routing-trace"
TRACE_VERSION = 1
SYNTHETIC_PREFIX = "synthetic-zipf"
# Parameters of `synthetic_zipf` that a spec may set, with the type each value is parsed as.
SYNTHETIC_KEYS: dict[str, type] = {
    "layers": int,
    "experts": int,
    "top_k": int,
    "tokens": int,
    "s_min": float,
    "s_max": float,
    "reuse": float,
    "seed": int,
}


class TraceError(ValueError):
    """A malformed trace file or spec (a ValueError, so the CLI reports it as a usage error)."""


@dataclass
class RoutingTrace:
    """Expert choices of `tokens` tokens over `layers` MoE layers, `top_k` distinct experts each."""

    ids: torch.Tensor
    """int32 [tokens, layers, top_k]: expert ids, distinct within a (token, layer)."""
    weights: torch.Tensor
    """float32 [tokens, layers, top_k]: gate weights of those experts."""
    num_experts: int

    def __post_init__(self) -> None:
        if self.ids.dim() != 3 or self.ids.shape != self.weights.shape:
            raise TraceError(f"ids {tuple(self.ids.shape)} and weights {tuple(self.weights.shape)} differ")
        if self.ids.numel() and not 0 <= int(self.ids.min()) <= int(self.ids.max()) < self.num_experts:
            raise TraceError(f"expert ids outside [0, {self.num_experts})")

    @property
    def num_tokens(self) -> int:
        return self.ids.shape[0]

    @property
    def num_layers(self) -> int:
        return self.ids.shape[1]

    @property
    def top_k(self) -> int:
        return self.ids.shape[2]

    def masks(self, token: int) -> torch.Tensor:
        """The experts `token` requested in each layer, as a [layers, num_experts] bool mask."""
        mask = torch.zeros(self.num_layers, self.num_experts, dtype=torch.bool)
        return mask.scatter_(1, self.ids[token].long(), True)

    def save(self, path: str | Path) -> None:
        """Write the trace as a safetensors file."""
        from safetensors.torch import save_file

        meta = {"format": TRACE_FORMAT, "version": TRACE_VERSION, "num_experts": self.num_experts}
        tensors = {"ids": self.ids.to(torch.int32).contiguous(), "weights": self.weights.float().contiguous()}
        save_file(tensors, str(path), metadata={"spillway": json.dumps(meta)})

    @classmethod
    def load(cls, path: str | Path) -> RoutingTrace:
        """Read a trace written by `save`; raise TraceError naming the file (and key) if it is malformed."""
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"routing trace {path} does not exist")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta, keys = f.metadata() or {}, set(f.keys())
                tensors = {k: f.get_tensor(k) for k in ("ids", "weights") if k in keys}
        except Exception as exc:  # safetensors raises several types for a corrupt header
            raise TraceError(f"routing trace {path}: not a safetensors file ({exc})") from exc
        info = _metadata(path, meta)
        for key, dtype in (("ids", torch.int32), ("weights", torch.float32)):
            if key not in tensors:
                raise TraceError(f"routing trace {path}: tensor {key!r} is missing")
            if tensors[key].dtype != dtype:
                raise TraceError(f"routing trace {path}: tensor {key!r} is {tensors[key].dtype}, not {dtype}")
        try:
            return cls(tensors["ids"], tensors["weights"], int(info["num_experts"]))
        except TraceError as exc:
            raise TraceError(f"routing trace {path}: {exc}") from exc


def _metadata(path: Path, meta: dict[str, str]) -> dict:
    """The trace's JSON metadata, checked for format and the `num_experts` key."""
    try:
        info = json.loads(meta["spillway"])
    except KeyError:
        raise TraceError(f"routing trace {path}: metadata key 'spillway' is missing") from None
    except json.JSONDecodeError as exc:
        raise TraceError(f"routing trace {path}: metadata key 'spillway' is not JSON ({exc})") from exc
    if not isinstance(info, dict) or info.get("format") != TRACE_FORMAT:
        raise TraceError(f"routing trace {path}: metadata 'spillway' is not a {TRACE_FORMAT}")
    if not isinstance(info.get("num_experts"), int) or info["num_experts"] <= 0:
        raise TraceError(f"routing trace {path}: metadata key 'num_experts' is not a positive integer")
    return info


def layer_exponents(layers: int, s_min: float, s_max: float, seed: int) -> torch.Tensor:
    """The Zipf exponent s_l of each layer: evenly spread over [s_min, s_max], in a seeded shuffled order."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.linspace(s_min, s_max, layers, dtype=torch.float64)
    return spread[torch.randperm(layers, generator=g)]


def layer_popularity(experts: int, exponents: torch.Tensor, seed: int) -> torch.Tensor:
    """[layers, experts] probabilities: Zipf(s_l) over ranks, ranks assigned by a seeded permutation."""
    g = torch.Generator().manual_seed(seed + 1)
    ranks = torch.arange(1, experts + 1, dtype=torch.float64)
    zipf = ranks[None, :] ** -exponents[:, None]  # [L, E], by rank
    zipf /= zipf.sum(1, keepdim=True)
    perm = torch.stack([torch.randperm(experts, generator=g) for _ in range(exponents.numel())])
    return torch.empty_like(zipf).scatter_(1, perm, zipf)  # expert perm[l, r] has rank r


def synthetic_zipf(
    layers: int = 48,
    experts: int = 512,
    top_k: int = 10,
    tokens: int = 4096,
    s_min: float = 0.6,
    s_max: float = 1.2,
    reuse: float = 0.3,
    seed: int = 0,
) -> RoutingTrace:
    """The benchmarks' `synthetic-zipf` trace (deterministic for a seed).

    Each token keeps each of the previous token's experts (per layer) with probability `reuse` and draws the
    rest without replacement from the layer's popularity, excluding the kept ones. Sampling without
    replacement is Gumbel-top-k over log-popularity: kept experts get key +inf so they come first, and the top
    remaining keys are then a draw without replacement from the popularity restricted to the others.
    """
    _check_params(layers, experts, top_k, tokens, s_min, s_max, reuse)
    logp = layer_popularity(experts, layer_exponents(layers, s_min, s_max, seed), seed).log().float()
    g = torch.Generator().manual_seed(seed + 2)
    ids = torch.empty(tokens, layers, top_k, dtype=torch.int64)
    prev: torch.Tensor | None = None
    for t in range(tokens):
        u = torch.rand(layers, experts, generator=g).clamp_(min=1e-12)
        keys = logp - torch.log(-torch.log(u))  # log p + Gumbel noise
        if prev is not None:
            keep = torch.rand(layers, top_k, generator=g) < reuse
            keys.scatter_(1, prev, torch.where(keep, float("inf"), keys.gather(1, prev)))
        prev = torch.topk(keys, top_k, dim=1).indices  # [L, K]
        ids[t] = prev
    logits = torch.randn(tokens, layers, top_k, generator=g)
    return RoutingTrace(ids.to(torch.int32), torch.softmax(logits, dim=-1), experts)


def _check_params(
    layers: int, experts: int, top_k: int, tokens: int, s_min: float, s_max: float, reuse: float
) -> None:
    if min(layers, experts, top_k, tokens) < 1:
        raise ValueError("synthetic-zipf: layers, experts, top_k and tokens must be positive")
    if top_k > experts:
        raise ValueError(f"synthetic-zipf: top_k={top_k} exceeds experts={experts}")
    if not 0.0 <= reuse <= 1.0:
        raise ValueError(f"synthetic-zipf: reuse={reuse} is not a probability")
    if not 0.0 <= s_min <= s_max:
        raise ValueError(f"synthetic-zipf: need 0 <= s_min <= s_max, got {s_min}, {s_max}")


def parse_trace(spec: str) -> RoutingTrace:
    """A trace from a file path or `synthetic-zipf[:KEY=VAL,...]` (keys: those of `synthetic_zipf`)."""
    if spec != SYNTHETIC_PREFIX and not spec.startswith(SYNTHETIC_PREFIX + ":"):
        return RoutingTrace.load(spec)
    params: dict[str, int | float] = {}
    body = spec[len(SYNTHETIC_PREFIX) + 1 :]
    for item in filter(None, (part.strip() for part in body.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"trace spec {spec!r}: {item!r} is not KEY=VALUE")
        if key not in SYNTHETIC_KEYS:
            raise ValueError(
                f"trace spec {spec!r}: unknown key {key!r} (allowed: {', '.join(SYNTHETIC_KEYS)})"
            )
        try:
            params[key] = SYNTHETIC_KEYS[key](value.strip())
        except ValueError:
            kind = SYNTHETIC_KEYS[key].__name__
            raise ValueError(f"trace spec {spec!r}: {key}={value!r} is not a valid {kind}") from None
    return synthetic_zipf(**params)  # type: ignore[arg-type]

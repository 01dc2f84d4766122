"""Routing traces: the synthetic-zipf generator's statistics, the safetensors file format, spec parsing."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from common.experts.trace import (
    SYNTHETIC_KEYS,
    RoutingTrace,
    TraceError,
    layer_exponents,
    layer_popularity,
    parse_trace,
    synthetic_zipf,
)

SMALL = dict(layers=3, experts=32, top_k=4, tokens=64)


def _kept_share(trace: RoutingTrace) -> float:
    """Share of each token's experts (per layer) that the previous token also chose."""
    ids = trace.ids.long()
    again = (ids[1:, :, :, None] == ids[:-1, :, None, :]).any(-1)
    return again.float().mean().item()


def test_deterministic_for_a_seed() -> None:
    a, b = synthetic_zipf(**SMALL, seed=7), synthetic_zipf(**SMALL, seed=7)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.weights, b.weights)
    c = synthetic_zipf(**SMALL, seed=8)
    assert not torch.equal(a.ids, c.ids)


def test_shapes_dtypes_and_ranges() -> None:
    trace = synthetic_zipf(**SMALL)
    assert trace.ids.shape == trace.weights.shape == (64, 3, 4)
    assert trace.ids.dtype == torch.int32 and trace.weights.dtype == torch.float32
    assert (trace.num_tokens, trace.num_layers, trace.top_k, trace.num_experts) == (64, 3, 4, 32)
    assert int(trace.ids.min()) >= 0 and int(trace.ids.max()) < 32
    # distinct experts within a (token, layer)
    assert (trace.ids.sort(-1).values.diff(dim=-1) > 0).all()
    assert torch.allclose(trace.weights.sum(-1), torch.ones(64, 3)) and (trace.weights > 0).all()
    masks = trace.masks(5)
    assert masks.shape == (3, 32) and masks.sum().item() == 12
    assert masks.gather(1, trace.ids[5].long()).all()


def test_default_size() -> None:
    """The benchmarks' trace at its default size (how long it takes is a benchmark's business, not a
    test's: a 20 s bound here failed on a loaded 2-core machine)."""
    trace = synthetic_zipf()
    assert trace.ids.shape == (4096, 48, 10)


@pytest.mark.parametrize("reuse", [0.0, 0.3, 0.8, 1.0])
def test_reuse_rate(reuse: float) -> None:
    # Uniform popularity over many experts: a fresh draw almost never repeats the previous token's experts
    # (≈ top_k / experts), so the kept share is `reuse` up to binomial noise (σ ≈ 0.003 for 24,000 trials).
    trace = synthetic_zipf(layers=2, experts=2000, top_k=4, tokens=3001, s_min=0.0, s_max=0.0, reuse=reuse)
    assert _kept_share(trace) == pytest.approx(reuse + (1 - reuse) * 4 / 2000, abs=0.015)


def test_full_reuse_repeats_the_first_token() -> None:
    trace = synthetic_zipf(**SMALL, reuse=1.0)
    assert torch.equal(trace.ids.sort(-1).values, trace.ids[:1].sort(-1).values.expand_as(trace.ids))


def test_layer_exponents_spread_evenly_in_shuffled_order() -> None:
    s = layer_exponents(8, 0.6, 1.2, seed=0)
    assert torch.allclose(s.sort().values, torch.linspace(0.6, 1.2, 8, dtype=torch.float64))
    assert not torch.equal(s, s.sort().values)  # shuffled (for this seed)
    assert torch.equal(s, layer_exponents(8, 0.6, 1.2, seed=0))


def test_popularity_is_zipf_over_a_permutation() -> None:
    s = torch.tensor([0.6, 1.2], dtype=torch.float64)
    p = layer_popularity(64, s, seed=0)
    assert torch.allclose(p.sum(1), torch.ones(2, dtype=torch.float64))
    ranked = p.sort(1, descending=True).values
    ranks = torch.arange(1, 65, dtype=torch.float64)
    assert torch.allclose(ranked[1] / ranked[1, 0], ranks**-1.2)
    assert not torch.equal(p[0].argsort(), p[1].argsort())  # each layer its own permutation


def test_popularity_skew_follows_layer_exponent() -> None:
    # Share of the accesses that go to each layer's 8 most popular experts (of 128) grows with s_l.
    trace = synthetic_zipf(layers=6, experts=128, top_k=4, tokens=3000, reuse=0.0, seed=3)
    counts = torch.zeros(6, 128)
    counts.scatter_add_(1, trace.ids.long().permute(1, 0, 2).reshape(6, -1), torch.ones(6, 3000 * 4))
    head_share = counts.sort(1, descending=True).values[:, :8].sum(1) / counts.sum(1)
    s = layer_exponents(6, 0.6, 1.2, seed=3)
    assert torch.equal(head_share.argsort(), s.argsort())
    # and the most used expert of each layer is the one the popularity ranks first
    p = layer_popularity(128, s, seed=3)
    assert torch.equal(counts.argmax(1), p.argmax(1))


def test_save_load_round_trip(tmp_path) -> None:
    trace = synthetic_zipf(**SMALL)
    path = tmp_path / "t.safetensors"
    trace.save(path)
    back = RoutingTrace.load(path)
    assert torch.equal(back.ids, trace.ids) and torch.equal(back.weights, trace.weights)
    assert back.num_experts == 32
    assert torch.equal(parse_trace(str(path)).ids, trace.ids)


def _write(path, tensors: dict, meta: dict | None) -> None:
    save_file(tensors, str(path), metadata=meta)


GOOD_META = {"spillway": json.dumps({"format": "spillway-routing-trace", "version": 1, "num_experts": 8})}
IDS = torch.zeros(2, 1, 2, dtype=torch.int32) + torch.tensor([0, 1], dtype=torch.int32)
WEIGHTS = torch.full((2, 1, 2), 0.5)


@pytest.mark.parametrize(
    ("tensors", "meta", "named"),
    [
        ({"ids": IDS, "weights": WEIGHTS}, None, "'spillway'"),
        ({"ids": IDS, "weights": WEIGHTS}, {"spillway": "{not json"}, "'spillway'"),
        (
            {"ids": IDS, "weights": WEIGHTS},
            {"spillway": json.dumps({"format": "x"})},
            "spillway-routing-trace",
        ),
        (
            {"ids": IDS, "weights": WEIGHTS},
            {"spillway": json.dumps({"format": "spillway-routing-trace"})},
            "'num_experts'",
        ),
        ({"ids": IDS}, GOOD_META, "'weights'"),
        ({"weights": WEIGHTS}, GOOD_META, "'ids'"),
        ({"ids": IDS.long(), "weights": WEIGHTS}, GOOD_META, "'ids'"),
        ({"ids": IDS + 8, "weights": WEIGHTS}, GOOD_META, "outside"),
        ({"ids": IDS, "weights": WEIGHTS[:1]}, GOOD_META, "differ"),
    ],
)
def test_malformed_files_name_file_and_key(tmp_path, tensors, meta, named) -> None:
    path = tmp_path / "bad.safetensors"
    _write(path, tensors, meta)
    with pytest.raises(TraceError) as err:
        RoutingTrace.load(path)
    assert str(path) in str(err.value) and named in str(err.value)


def test_not_a_safetensors_file(tmp_path) -> None:
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"\x00garbage")
    with pytest.raises(TraceError, match=r"junk\.safetensors"):
        RoutingTrace.load(path)
    with pytest.raises(FileNotFoundError, match=r"missing\.safetensors"):
        parse_trace(str(tmp_path / "missing.safetensors"))


def test_parse_synthetic_spec() -> None:
    trace = parse_trace(
        "synthetic-zipf:layers=2, experts=16,top_k=3,tokens=20,s_min=0.5,s_max=1,reuse=0.1,seed=4"
    )
    ref = synthetic_zipf(layers=2, experts=16, top_k=3, tokens=20, s_min=0.5, s_max=1.0, reuse=0.1, seed=4)
    assert torch.equal(trace.ids, ref.ids) and torch.equal(trace.weights, ref.weights)
    # a later key overrides an earlier one (callers prepend defaults)
    assert parse_trace("synthetic-zipf:layers=5,tokens=3,layers=2,experts=16").ids.shape == (3, 2, 10)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("synthetic-zipf:layer=2", "unknown key 'layer'.*" + ", ".join(SYNTHETIC_KEYS)),
        ("synthetic-zipf:layers=two", "layers='two'"),
        ("synthetic-zipf:tokens", "not KEY=VALUE"),
        ("synthetic-zipf:top_k=40,experts=32", "top_k=40 exceeds"),
        ("synthetic-zipf:reuse=1.5", "reuse=1.5"),
        ("synthetic-zipf:s_min=1.3", "s_min <= s_max"),
        ("synthetic-zipf:tokens=0", "positive"),
    ],
)
def test_parse_errors(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_trace(spec)


def test_replayer_rewinds_to_the_first_row() -> None:
    from common.experts.routing import replayer_for

    replayer = replayer_for("synthetic-zipf:tokens=64,seed=3", [0, 2], 16, 4)
    dummy = torch.zeros(5, 4, dtype=torch.long), torch.zeros(5, 4)
    with torch.inference_mode():  # as the runner's passes are; the rewind comes from outside
        first = [replayer(layer, *dummy)[0] for layer in (0, 2)]
        later = [replayer(layer, *dummy)[0] for layer in (0, 2)]
    replayer.rewind()
    with torch.inference_mode():
        again = [replayer(layer, *dummy)[0] for layer in (0, 2)]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, later, strict=True))
    assert torch.equal(first[0], replayer.trace.ids[:5, 0].long())

"""Trellis-coded experts as an expert format (common/experts/formats.py `TrellisFormat`): names, layout and
bytes, the round trip's error, and an engine whose experts are offloaded in a trellis code generating what
the same code generates with every expert resident."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.experts.formats import TrellisFormat, get_format, quantization_error
from common.model.synthetic.checkpoint import make_model
from common.protocol import SamplingParams

WIDE = {"hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 256, "num_experts": 4}


@pytest.mark.parametrize(("name", "bits"), [("trellis2", 2), ("trellis2.5", 2.5), ("trellis4-l12", 4)])
def test_names_and_bytes(name: str, bits: float) -> None:
    fmt = get_format(name)
    assert isinstance(fmt, TrellisFormat) and fmt.name == name
    weights = 3 * 512 * 256
    assert fmt.expert_nbytes(512, 256) == weights * bits / 8 + (2 * 256 + 512) * 2  # codes + fp16 row scales


def test_unknown_and_misfit_are_refused() -> None:
    with pytest.raises(ValueError, match=r"trellis2\.5"):
        get_format("trellis5")
    with pytest.raises(ValueError, match="multiples of 128"):
        get_format("trellis3").components(2048, 200)


@pytest.mark.parametrize("rate", ["2", "3", "4"])
def test_round_trip_error_within_its_bound(rate: str) -> None:
    fmt = get_format(f"trellis{rate}-l10")
    g = torch.Generator().manual_seed(1)
    gate_up, down = torch.randn(512, 256, generator=g) * 0.02, torch.randn(256, 256, generator=g) * 0.02
    err = quantization_error(fmt, gate_up, down)
    assert max(err.values()) <= fmt.error_bound()


def test_offloaded_trellis_experts_generate_as_resident(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m", preset="tiny", arch="qwen3_moe", overrides=WIDE)
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runs = [
        Engine(
            WorkerConfig(str(model), max_running=2, expert_cache=cache, expert_format="trellis3-l10")
        ).generate(prompts, params)
        for cache in ("all", "0.5")
    ]
    assert [r.token_ids for r in runs[0]] == [r.token_ids for r in runs[1]]

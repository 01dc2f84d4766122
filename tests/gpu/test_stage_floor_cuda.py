"""bench.stage_floor's kernels on the GPU: every way of chaining the stages (a launch a stage, serial or in
programmatic launch with the weights copied before or after the wait; one persistent launch with grid
barriers, 0 to 4 stages' weights ahead) gives serial's outputs bit for bit, and serial's are torch's."""

from __future__ import annotations

import pytest
import torch

from bench import stage_floor


@pytest.mark.parametrize("rows", [0, 3, 12])
def test_every_variant_matches_serial_and_torch(rows: int) -> None:
    blocks = torch.cuda.get_device_properties(0).multi_processor_count
    chain = stage_floor.Chain(stages=9, rows=rows, k=512, blocks=blocks)
    row = stage_floor.measure(chain, hbm_gbps=1000.0)
    assert row["wrong"] == {}
    persistent = {f"persistent-{a}" for a in (0, 1, 2, 4)} | {"persistent-cg-0", "persistent-cg-2"}
    assert set(row["us_a_stage"]) == {"serial", "pdl-late", "pdl"} | persistent
    assert row["bytes_a_stage"] == blocks * rows * 512 * 2
    assert torch.isfinite(chain.outs).all() and chain.outs[-1].abs().sum() > 0

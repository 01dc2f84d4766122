"""bench.stage_floor without a GPU: its ctypes signatures against stage_floor.cu's extern "C" declarations,
and the persistent variants it runs for a stage's shared memory (the kernels run in
tests/gpu/test_stage_floor_cuda.py)."""

from __future__ import annotations

import re
from types import SimpleNamespace

from bench import stage_floor


def test_each_signature_has_the_declared_arguments() -> None:
    source = (stage_floor.SOURCES / "stage_floor.cu").read_text()
    signatures = {
        "setup": stage_floor._SETUP,
        "chain": stage_floor._CHAIN,
        "persistent": stage_floor._PERSISTENT,
    }
    for name, signature in signatures.items():
        declared = re.search(rf'extern "C" int spillway_stage_floor_{name}\((.*?)\)', source, re.S).group(1)
        assert declared.count(",") + 1 == len(signature), name


def test_persistent_variants_are_those_whose_slots_fit() -> None:
    def names(rows: int) -> list[str]:
        return [n for n in stage_floor.variants(SimpleNamespace(rows=rows, k=2048)) if "persistent" in n]

    assert names(12) == [  # 4 x 48 KiB
        *("persistent-0", "persistent-1", "persistent-2", "persistent-4"),
        *("persistent-cg-0", "persistent-cg-2"),
    ]
    assert names(24) == ["persistent-0", "persistent-1", "persistent-2", "persistent-cg-0", "persistent-cg-2"]
    assert stage_floor.smem_bytes(24, 2048, 2) <= stage_floor.SMEM_LIMIT < stage_floor.smem_bytes(24, 2048, 4)

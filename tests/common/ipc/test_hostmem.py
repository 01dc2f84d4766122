"""common/ipc/hostmem.py's helpers that need no GPU (the mapped stores are tested in tests/gpu)."""

from __future__ import annotations

import torch

from common.ipc.hostmem import host_list_to


def test_host_list_to_keeps_values_and_dtype_on_the_cpu() -> None:
    got = host_list_to([7, 0, 2**40], "cpu")
    assert got.dtype == torch.int64 and got.tolist() == [7, 0, 2**40]
    assert host_list_to([0.5, 2.0], torch.device("cpu"), torch.float32).tolist() == [0.5, 2.0]

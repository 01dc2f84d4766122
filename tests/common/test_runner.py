"""ModelRunner's worker warm-up: only on CUDA, and a failure is logged rather than raised."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from common.runner import warm_up_on_cuda


def test_warm_up_on_cuda_logs_a_failure_and_skips_other_devices(caplog) -> None:
    calls = []

    def fails() -> None:
        calls.append(1)
        raise RuntimeError("out of memory")

    warm_up_on_cuda(SimpleNamespace(device=torch.device("cpu"), warm_up=fails))
    assert not calls  # nothing to compile on the CPU
    with caplog.at_level(logging.WARNING, logger="common.runner"):
        warm_up_on_cuda(SimpleNamespace(device=torch.device("cuda"), warm_up=fails))
    assert calls and "warm-up failed" in caplog.text

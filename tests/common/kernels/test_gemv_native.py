"""The CUDA C one-row GEMV (common/kernels/gemv_native.py) without a GPU: which calls it takes, its entry
point's arguments, and what gemv_row.cu compiles to for sm_90 where nvcc is here: every weight load of a lane
above the programmatic wait (ACQBULK), x's below it."""

from __future__ import annotations

import functools
import re
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bench.sass_census import _dump
from common.kernels import gemv_native, native
from common.kernels.config import KERNELS
from tests.conftest import class_patched


def test_only_one_bf16_row_of_a_mid_sized_weight_is_taken(monkeypatch) -> None:
    x, w = torch.zeros(1, 6144, dtype=torch.bfloat16), torch.zeros(2560, 6144, dtype=torch.bfloat16)
    assert not gemv_native.takes(x, w)  # not CUDA
    monkeypatch.setattr(gemv_native, "hopper_or_later", lambda index: True)
    monkeypatch.setattr(gemv_native, "_entry", lambda device: object())
    with class_patched(torch.Tensor, is_cuda=property(lambda self: True)):
        assert gemv_native.takes(x, w)
        assert not gemv_native.takes(torch.zeros(2, 6144, dtype=torch.bfloat16), w)  # two rows
        assert not gemv_native.takes(x.float(), w.float())
        assert not gemv_native.takes(x[:, :6000], w[:, :6000].contiguous())  # K not whole 256s
        assert not gemv_native.takes(torch.zeros(1, 256 * 33, dtype=torch.bfloat16), torch.zeros(8, 256 * 33))
        big = torch.zeros(gemv_native.CUBLAS_ROWS, 256, dtype=torch.bfloat16)  # the Triton one-chunk launch's
        assert not gemv_native.takes(x[:, :256], big)
        assert not gemv_native.takes(x, w.t().contiguous().t())  # not contiguous
        assert gemv_native.takes(x, w, torch.zeros(2560, dtype=torch.bfloat16))
        assert not gemv_native.takes(x, w, torch.zeros(2560))  # an fp32 bias
        monkeypatch.setattr(gemv_native, "hopper_or_later", lambda index: False)
        assert not gemv_native.takes(x, w)
        monkeypatch.setattr(gemv_native, "hopper_or_later", lambda index: True)
        assert not gemv_native.takes(x, w, kernels=replace(KERNELS, gemv_native=False))


def test_the_entry_point_gets_its_declared_arguments() -> None:
    source = (native.SOURCES / "gemv_row.cu").read_text()
    declared = re.search(r'extern "C" int spillway_gemv_row\((.*?)\)', source, re.S).group(1)
    assert declared.count(",") + 1 == len(gemv_native._SIGNATURE)


@functools.cache
def _sass() -> tuple[str, str]:
    """gemv_row.cu built by nvcc for sm_90: its SASS and resource usage (built once for the tests below)."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "gemv_row.cubin"
        source = native.SOURCES / "gemv_row.cu"
        subprocess.run([native.nvcc(), "-O3", "-cubin", "-arch=sm_90", "-o", cubin, source], check=True)
        return _dump(cubin.read_bytes())


@pytest.mark.parametrize(("chunks", "rows"), [(24, 1), (10, 2), (16, 2), (32, 1)])
def test_every_weight_load_is_above_the_wait(chunks: int, rows: int) -> None:
    if native.nvcc() is None:
        pytest.skip("needs nvcc")
    sass, usage = _sass()
    name = f"gemv_row_kernelILi{chunks}ELi{rows}E"
    body = re.search(rf"Function : \S*{name}\S*\n(.*?)(?=\n\s*Function :|\Z)", sass, re.S).group(1)
    ops = re.findall(r"\s(LDG\S*|ACQBULK)\s", body)
    wait = ops.index("ACQBULK")
    weights = [i for i, op in enumerate(ops) if ".128" in op and "STRONG" not in op]
    assert len(weights) == chunks * rows and max(weights) < wait, ops
    assert any("STRONG" in op for op in ops[wait:]), ops  # x, after the wait (launch.cuh's load_after_wait)
    assert re.search(rf"Function \S*{name}\S*:\n.*LOCAL:0 ", usage), "registers spilled"

"""The int4 decode kernels compiled for sm_90 without a GPU (`python -m bench.sass_census --json`, in a
process of its own: the kernel tests' interpreter setting would make them uncompilable here): the words
form converts no code from int to float and converts layouts once, where the byte form does both."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest


def _census(*flags: str) -> dict:
    """`python -m bench.sass_census FLAGS --json` in its own process, outside the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [sys.executable, "-m", "bench.sass_census", *flags, "--json"]
    return json.loads(subprocess.run(args, capture_output=True, text=True, env=env, check=True).stdout)


def test_census_tells_the_words_form_from_the_byte_form() -> None:
    report = _census()
    byte_form, words = report["DECODE_CONFIGS[1]"], report["RESIDENT_CONFIGS[1]"]
    for name in ("gate_up", "down"):
        b, w = byte_form[name], words[name]
        conversions = [c["opcodes"].get("I2F", 0) + c["opcodes"].get("I2FP", 0) for c in (b, w)]
        assert conversions[1] < 8 < 16 <= conversions[0], (name, conversions)  # words: index math only
        assert w["conversions"] == 1 < b["conversions"], name
        assert b["loop"] > 0 and b["total"] > b["loop"] and b["issue_us"] > 0 and w["issue_us"] > 0
    assert words["down"]["issue_us"] < byte_form["down"]["issue_us"]  # one group a step: no idle lanes


def test_census_of_the_hyper_connection_kernels() -> None:
    """`--hc`: the projection and mix-up kernels at flashnext's shape compile, each with an issue estimate;
    the mix-up with its rank in two tiles (MIX_UP_SPLIT_RANK) issues fewer instructions than in one."""
    report = _census("--hc")
    kernels = report["hyper-connections"]
    assert set(kernels) == {"hc_project", "hc_mix_up", "hc_mix_up split"}
    assert kernels["hc_mix_up split"]["total"] < kernels["hc_mix_up"]["total"]
    assert all(k["total"] > 0 and k["issue_us"] > 0 for k in kernels.values())
    assert all(k["local"] == 0 for k in kernels.values())  # no register spilled


def test_census_of_the_steps_other_kernels() -> None:
    """`--step`: the GEMV (as `choose` launches one row, and its CUDA-core form; on an fp8 weight at one and
    two scale blocks a step; with GDN's conv in its epilogue) and its chunks' sum, the router, the shared
    expert's down and the Gated DeltaNet step compile for sm_90 at flashnext's shapes, none spilling a
    register."""
    report = _census("--step")
    kernels = report["step"]
    gemvs = {"gemv", "gemv cuda cores", "gemv fp8", "gemv fp8 one block", "gemv conv"}
    assert set(kernels) == gemvs | {"gemv sum", "route", "swiglu_down", "gated_delta"}
    assert all(k["total"] > 0 and k["registers"] > 0 and k["local"] == 0 for k in kernels.values())
    assert (
        kernels["gemv"]["opcodes"].get("HMMA", 0) > 0 == kernels["gemv cuda cores"]["opcodes"].get("HMMA", 0)
    )
    assert kernels["gemv"]["total"] < kernels["gemv cuda cores"]["total"]  # the MMA reduces, not shuffles


def test_census_of_the_cuda_c_kernels() -> None:
    """`--native`: the CUDA C int4 kernels built by nvcc for sm_90 at RESIDENT_CONFIGS' launch, no local
    memory; a code becomes a number through a LOP3 (the mantissa of 2²³, or a bf16 pair for the tensor
    cores), so the only int-to-float conversions are the zero points' (one a row and chunk or group: 12 in
    gate_up's 4 rows × 3 chunks, 8 in down's unrolled groups, 20 in the tensor-core gate_up's 4 rows × 5
    groups) and an index's."""
    from common.kernels import native

    if native.nvcc() is None:
        pytest.skip("needs nvcc")
    kernels = _census("--native")["native"]
    assert set(kernels) == {"gate_up", "down", "gate_up mma", "down mma"}
    assert kernels["gate_up mma"]["opcodes"]["HMMA"] > 0 and kernels["down mma"]["opcodes"]["HMMA"] > 0
    for name, k in kernels.items():
        assert k["total"] > 0 and k["issue_us"] > 0 and k["registers"] > 0 and k["local"] == 0, name
        conversions = k["opcodes"].get("I2F", 0) + k["opcodes"].get("I2FP", 0)
        # a LOP3 a code (a pair on the tensor cores): ≥ 160 a lane in each kernel's rows × inputs
        assert conversions <= 24 and k["opcodes"]["LOP3"] >= 160, (name, conversions)


def test_the_cuda_c_kernels_read_what_the_kernel_before_wrote_after_the_wait() -> None:
    """x (gate/up) and the activations (down) are the kernel before's outputs: each kernel loads them through
    ld.global.ca (SASS LDG...STRONG.SM) after griddepcontrol.wait (ACQBULK), never before it. Through a
    const __restrict__ pointer nvcc emits ld.global.nc, treats it as invariant and may hoist it above the
    wait: the tensor-core down's graph replays once read the activations before gate/up wrote them."""
    from bench.sass_census import native_sass
    from common.kernels import native

    if native.nvcc() is None:
        pytest.skip("needs nvcc")
    sass_by, _ = native_sass()
    for symbol, sass in sass_by.items():
        before, wait, after = sass.partition("ACQBULK")
        assert wait, symbol
        assert "STRONG.SM" not in before, symbol
        assert len(re.findall(r"LDG\.E\.128\.STRONG\.SM", after)) >= 4, symbol


def test_the_tensor_core_down_loads_all_its_codes_before_the_wait() -> None:
    """down_mma_kernel's rows are settled: its lane's two rows' codes, G 16-byte chunks each, are loaded as
    weak loads (launch.cuh's load_settled, SASS LDG.E.NA.128) before griddepcontrol.wait (ACQBULK). As __ldg
    (ld.global.nc) ptxas sank 8 of the 10 below it at flashnext's G = 5."""
    from bench.sass_census import native_sass
    from common.kernels import native

    if native.nvcc() is None:
        pytest.skip("needs nvcc")
    sass_by, _ = native_sass()
    for groups in (2, 5, 8):
        symbol = next(s for s in sass_by if f"down_mma_kernelILi{groups}E" in s)
        before, wait, _ = sass_by[symbol].partition("ACQBULK")
        assert wait and len(re.findall(r"LDG\.E\.NA\.128", before)) == 2 * groups, (
            groups,
            before.count("LDG"),
        )

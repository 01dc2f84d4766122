"""Programmatic dependent launch's switches (common/kernels/pdl.py): what a launch asks for, and what a
taking-part kernel compiles to for sm_90 (in a process of its own, outside this directory's interpreter):
wait and trigger, wait only (KernelConfig.pdl_early_trigger off), trigger then wait (a `trigger_first`
launch with pdl_start_trigger), or neither."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from common.kernels import pdl
from common.kernels.config import KERNELS

_PTX = """
import json
from bench.sass_census import compile_sm90
from common.kernels import pdl, routing
signature = {"logits_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i64", "experts": "i32"}
shape = {"K": 10, "KB": 16, "BLOCK": 512, "NORMALIZE": True, "BF16": False}
found = {}
for gdc in (True, pdl.WAIT_ONLY, pdl.TRIGGER_FIRST, False):
    ptx = compile_sm90(routing._route_kernel, signature, shape | {"GDC": gdc}, 1, ()).asm["ptx"]
    wait, trigger = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    found[str(gdc)] = [wait >= 0, trigger >= 0, 0 <= trigger < wait]
print(json.dumps(found))
"""


def test_a_launch_asks_for_the_trigger_it_is_set_to(monkeypatch) -> None:
    monkeypatch.setattr(pdl, "hopper_or_later", lambda index: True)
    gpu = torch.device("cuda", 0)
    assert pdl.launch(gpu) == {"GDC": True, "launch_pdl": True}
    assert pdl.launch(gpu, hold_next=True) == {"GDC": pdl.WAIT_ONLY, "launch_pdl": True}
    assert pdl.launch(gpu, trigger_first=True) == {"GDC": pdl.TRIGGER_FIRST, "launch_pdl": True}
    assert pdl.launch(gpu, trigger_first=True, hold_next=True) == {"GDC": pdl.WAIT_ONLY, "launch_pdl": True}
    assert pdl.launch(gpu) == {"GDC": True, "launch_pdl": True}
    no_start = replace(KERNELS, pdl_start_trigger=False)
    assert pdl.launch(gpu, trigger_first=True, kernels=no_start) == {"GDC": True, "launch_pdl": True}
    at_exit = replace(no_start, pdl_early_trigger=False)
    assert pdl.launch(gpu, kernels=at_exit) == {"GDC": pdl.WAIT_ONLY, "launch_pdl": True}
    assert pdl.launch(gpu, take_part=False, kernels=at_exit) == {"GDC": False}
    assert pdl.launch(gpu, kernels=replace(at_exit, pdl=False)) == {"GDC": False}
    assert pdl.launch(torch.device("cpu")) == {"GDC": False}


def test_wait_only_compiles_without_the_trigger() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _PTX], capture_output=True, text=True, env=env, check=True)
    found = json.loads(run.stdout)
    assert found == {
        "True": [True, True, False],
        str(pdl.WAIT_ONLY): [True, False, False],
        str(pdl.TRIGGER_FIRST): [True, True, True],
        "False": [False, False, False],
    }


def test_a_cuda_c_kernel_gets_the_mode_of_its_launch(monkeypatch) -> None:
    """launch.cuh's gdc_wait modes: 0 none, 1 wait then trigger, 2 wait only; no CUDA C kernel triggers
    first."""
    monkeypatch.setattr(pdl, "hopper_or_later", lambda index: True)
    gpu = torch.device("cuda", 0)
    assert pdl.native_mode(pdl.launch(gpu)) == 1
    assert pdl.native_mode(pdl.launch(gpu, hold_next=True)) == 2
    assert pdl.native_mode(pdl.launch(gpu, take_part=False)) == 0
    with pytest.raises(AssertionError, match="Triton kernels only"):
        pdl.native_mode(pdl.launch(gpu, trigger_first=True))

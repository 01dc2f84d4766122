"""L2 prefetches (common/kernels/l2_prefetch.py) without a GPU: which passes prefetch, how a weight is cut
into programs, which tensor a projection streams, and what the kernel compiles to for sm_90 (in a process of
its own, outside the tests' interpreter): the prefetches after the programmatic wait."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from common.kernels import l2_prefetch
from common.model.fp8_linear import Fp8Linear

_SASS = """
import json
from bench.sass_census import _INSTRUCTION, _dump, compile_sm90
from common.kernels import l2_prefetch
signature = {"a_ptr": "*u8", "a_bytes": "i32", "a_programs": "i32", "b_ptr": "*u8", "b_bytes": "i32"}
found = {}
for bulk in (True, False):
    shape = {"CHUNK": l2_prefetch.CHUNK, "LANES": l2_prefetch.LANES, "BULK": bulk, "GDC": True}
    sass = _dump(compile_sm90(l2_prefetch._prefetch_kernel, signature, shape, 1, ()).asm["cubin"])[0]
    found[str(bulk)] = [m.group(3).split(".")[0] for m in map(_INSTRUCTION.match, sass.splitlines()) if m]
print(json.dumps(found))
"""


def test_only_decode_passes_on_hopper_prefetch_at_their_sites(monkeypatch) -> None:
    x = torch.empty(1, 8)
    assert not l2_prefetch.wants("out", x)  # off by default
    monkeypatch.setattr(l2_prefetch, "SITES", frozenset({"out"}))
    assert not l2_prefetch.wants("out", x)  # not CUDA
    with pytest.raises(AssertionError):
        l2_prefetch.wants("elsewhere", x)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(l2_prefetch, "hopper_or_later", lambda index: True)
    assert l2_prefetch.wants("out", x)
    assert not l2_prefetch.wants("hc", x)
    assert not l2_prefetch.wants("out", torch.empty(l2_prefetch.MAX_ROWS + 1, 8))  # a prefill chunk
    monkeypatch.setattr(l2_prefetch, "hopper_or_later", lambda index: False)
    assert not l2_prefetch.wants("out", x)


def test_a_weight_is_cut_into_whole_programs() -> None:
    per_program = l2_prefetch.CHUNK * l2_prefetch.LANES
    assert l2_prefetch.programs(16) == 1
    assert l2_prefetch.programs(per_program) == 1
    assert l2_prefetch.programs(per_program + 16) == 2
    assert l2_prefetch.programs(2560 * 6144 * 2) == 120  # flashnext's output projection


def test_a_projection_streams_its_weight_or_its_fp8_codes() -> None:
    plain = nn.Linear(32, 16, bias=False)
    assert l2_prefetch.streamed(plain) is plain.weight
    fp8 = Fp8Linear(torch.zeros(16, 128, dtype=torch.float8_e4m3fn), torch.ones(16, 1), None)
    assert l2_prefetch.streamed(fp8) is fp8.qweight


def test_the_prefetches_are_issued_after_the_wait() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _SASS], capture_output=True, text=True, env=env, check=True)
    found = json.loads(run.stdout)
    for form, prefetch in (("True", "UBLKPF"), ("False", "CCTL")):
        ops = found[form]
        assert prefetch in ops and "ACQBULK" in ops, (form, sorted(set(ops)))
        assert ops.index("ACQBULK") < ops.index(prefetch), form

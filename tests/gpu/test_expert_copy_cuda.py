"""The Triton expert copy against torch indexing: from the real pinned, mapped host store (and plain pinned
tensors of awkward row sizes) into device rows, only for valid pairs, for every format's components."""

from __future__ import annotations

import pytest
import torch

from common.experts.copies import copy_experts
from common.experts.formats import FORMATS
from common.experts.store import HostExpertStore

EXPERTS, ROWS, PAIRS = 16, 24, 7


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1).view(torch.uint8)


def _random_like_rows(
    shape: tuple[int, ...], dtype: torch.dtype, rows: int, g: torch.Generator
) -> torch.Tensor:
    """[rows, *shape] of `dtype` with random bytes (on the CPU)."""
    row_bytes = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, generator=g)
    return raw.view(dtype).view(rows, *shape)


def _pairs(case: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(src ids, distinct dst rows, valid) on the GPU for a copy-list case."""
    src = torch.randint(0, EXPERTS, (PAIRS,), generator=g)
    dst = torch.randperm(ROWS, generator=g)[:PAIRS]
    valid = {
        "all-invalid": torch.zeros(PAIRS, dtype=torch.bool),
        "all-valid": torch.ones(PAIRS, dtype=torch.bool),
        "random": torch.rand(PAIRS, generator=g) < 0.5,
    }[case]
    return src.cuda(), dst.cuda(), valid.cuda()


def _check(host: torch.Tensor, out: torch.Tensor, before: torch.Tensor, src, dst, valid) -> None:
    """out = before with rows dst[valid] replaced by host rows src[valid], byte for byte."""
    expect = _bytes(before).clone()
    expect[dst[valid]] = _bytes(host).cuda()[src[valid]]
    assert torch.equal(_bytes(out), expect)


@pytest.fixture(scope="module")
def stores() -> dict[str, HostExpertStore]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, fmt in FORMATS.items():
        store = HostExpertStore(2, EXPERTS, fmt.components(256, 128))
        store.buffer.copy_(torch.randint(0, 256, (store.nbytes,), dtype=torch.uint8, generator=g))
        out[name] = store
    return out


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("case", ["all-invalid", "all-valid", "random"])
def test_copy_rows_matches_torch_indexing(stores, fmt: str, case: str) -> None:
    from common.kernels.expert_copy import copy_rows

    store = stores[fmt]
    assert store.mapped
    g = torch.Generator().manual_seed(list(FORMATS).index(fmt) * 10 + len(case))
    for block in store.parts[1].values():
        pool = _random_like_rows(tuple(block.shape[1:]), block.dtype, ROWS, g).cuda()
        before = pool.clone()
        src, dst, valid = _pairs(case, g)
        copy_rows(block, pool, src, dst, valid)
        torch.cuda.synchronize()
        _check(block, pool, before, src, dst, valid)


@pytest.mark.parametrize("shape", [(3, 5), (3, 2), (7,), (2, 2), (5000, 3), (3000, 4)])
def test_copy_rows_any_row_size(shape: tuple[int, ...]) -> None:
    """Row sizes that are odd, 2 mod 4, tiny, or span several programs' chunks (plus a remainder)."""
    from common.kernels.expert_copy import copy_rows

    g = torch.Generator().manual_seed(1)
    for dtype in (torch.uint8, torch.float8_e4m3fn, torch.bfloat16):
        host = _random_like_rows(shape, dtype, EXPERTS, g).pin_memory()  # pinned: mapped under UVA
        pool = _random_like_rows(shape, dtype, ROWS, g).cuda()
        before = pool.clone()
        src, dst, valid = _pairs("random", g)
        copy_rows(host, pool, src, dst, valid)
        torch.cuda.synchronize()
        _check(host, pool, before, src, dst, valid)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_kernel_and_torch_paths_agree_on_valid_rows(stores, fmt: str) -> None:
    store, spare = stores[fmt], ROWS - 1
    g = torch.Generator().manual_seed(2)
    src, _, valid = _pairs("random", g)
    dst = torch.randperm(spare, generator=g)[:PAIRS].cuda()  # the spare row stays out of the copy list
    pools = []
    for kernel in (True, False):
        pool = {
            n: torch.zeros((ROWS, *b.shape[1:]), dtype=b.dtype, device="cuda")
            for n, b in store.parts[0].items()
        }
        copy_experts(store.parts[0], src, dst, valid, pool, spare, kernel=kernel)
        pools.append(pool)
    torch.cuda.synchronize()
    for name in pools[0]:
        kernel_rows, torch_rows = _bytes(pools[0][name]), _bytes(pools[1][name])
        assert torch.equal(kernel_rows[:spare], torch_rows[:spare]), name
        assert not kernel_rows[spare].any(), name  # the kernel writes nothing for invalid pairs

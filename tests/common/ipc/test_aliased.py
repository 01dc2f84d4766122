"""AliasedMemory on the host (memfd + mmap): the shared pieces of two tensors are the same bytes, the rest
of each is its own."""

from __future__ import annotations

import pytest

from common.ipc.aliased import AliasedMemory


def test_shared_pieces_are_the_same_bytes_and_the_rest_is_private() -> None:
    memory = AliasedMemory(3 * AliasedMemory.granularity("cpu"), "cpu")
    c = memory.chunk
    a = memory.tensor(5 * c, [(c, 2 * c, 0)])  # a's chunks 1-2 are shared chunks 0-1
    b = memory.tensor(3 * c + 100, [(0, c, 2 * c), (2 * c, c, 0)])  # b's chunk 0: shared 2; b's 2: shared 0
    a.fill_(1)
    b.fill_(2)
    assert a.view(5, c)[:, 0].tolist() == [1, 2, 1, 1, 1]  # only shared chunk 0 is in both
    a[c : c + 10] = 7
    assert b[2 * c : 2 * c + 10].tolist() == [7] * 10
    assert b.numel() == 3 * c + 100 and memory.total_bytes == 3 * c + (5 - 2) * c + (4 - 2) * c
    del memory  # the tensors keep their mappings
    assert int(a.sum()) == 10 * 7 + (c - 10) * 2 + 4 * c  # chunk 1 as b left it, the rest 1


def test_pieces_must_be_whole_chunks_inside_and_apart() -> None:
    memory = AliasedMemory(2 * AliasedMemory.granularity("cpu"), "cpu")
    c = memory.chunk
    with pytest.raises(ValueError, match="whole chunks"):
        memory.tensor(4 * c, [(c // 2, c, 0)])
    with pytest.raises(ValueError, match="whole chunks"):
        memory.tensor(4 * c, [(0, c, 2 * c)])  # past the shared buffer
    with pytest.raises(ValueError, match="overlap"):
        memory.tensor(4 * c, [(0, 2 * c, 0), (c, c, 0)])


def write_in_another_process(wire: bytes) -> None:
    """A child process imports the SharedTensor `wire` (msgspec JSON) and fills it with 0, 1, 2, ..."""
    import subprocess
    import sys

    child = (
        "import sys, msgspec, torch\n"
        "from common.ipc import tensors as ipc\n"
        "from common.protocol import SharedTensor\n"
        "t = ipc.import_tensor(msgspec.json.decode(sys.stdin.buffer.read(), type=SharedTensor))\n"
        "t.copy_(torch.arange(t.numel(), dtype=torch.int32, device=t.device).view(t.shape))\n"
        "torch.cuda.synchronize() if t.is_cuda else None\n"
    )
    subprocess.run([sys.executable, "-c", child], input=wire, check=True, timeout=120)


def test_an_exported_view_maps_the_same_bytes_in_another_process() -> None:
    """Through common.ipc.tensors, as the decode worker exports its pools: the importer (a separate process)
    gets
    the range's memfds from the exporter's fd server and maps the pieces; its writes land in the exporter's
    tensor, in the shared chunk too, and its view keeps the exported offset, shape and stride."""
    import msgspec
    import torch

    from common.ipc import tensors as ipc

    memory = AliasedMemory(2 * AliasedMemory.granularity("cpu"), "cpu")
    c = memory.chunk
    raw = memory.tensor(4 * c, [(2 * c, 2 * c, 0)])
    view = raw.view(torch.int32)[c // 4 :].view(-1, 16)[:, :8]  # an offset, a stride
    assert ipc.is_exportable(view)
    wire = msgspec.json.encode(ipc.export_tensor(view))
    write_in_another_process(wire)
    assert torch.equal(view, torch.arange(view.numel(), dtype=torch.int32).view(view.shape))
    other = memory.tensor(2 * c, [(0, 2 * c, 0)])  # the same shared chunks: the child's writes there show
    assert torch.equal(other.view(torch.int32), raw.view(torch.int32)[c // 2 :])


def test_an_import_from_a_bad_peer_is_refused() -> None:
    import torch

    from common.ipc.aliased import import_view
    from common.protocol import SharedTensor

    bad = SharedTensor("aliased", b"/nonexistent", 0, 4096, "uint8", [16], [1], -1, pieces=[[0, 100, 0, 0]])
    with pytest.raises(ValueError, match="malformed aliased piece"):
        import_view(bad, torch.uint8)


def test_imported_allocations_are_released_with_the_last_view_of_them() -> None:
    """An importer maps each allocation once however many views it imports, and lets it go with the last
    (a restarted exporter's memory must not stay alive in its peer)."""
    import gc

    import torch

    from common.ipc import aliased
    from common.ipc import tensors as ipc

    memory = AliasedMemory(AliasedMemory.granularity("cpu"), "cpu")
    c = memory.chunk
    first, second = memory.tensor(2 * c, [(c, c, 0)]), memory.tensor(c, [(0, c, 0)])
    before = len(aliased._imported)
    a = ipc.import_tensor(ipc.export_tensor(first))
    b = ipc.import_tensor(ipc.export_tensor(second))
    assert len(aliased._imported) == before + 2  # first's own chunk, and the shared buffer once
    b.fill_(3)
    assert int(a[c:].sum()) == 3 * c and int(first[c:].sum()) == 3 * c
    del a
    gc.collect()
    assert len(aliased._imported) == before + 1
    del b
    gc.collect()
    assert len(aliased._imported) == before
    assert torch.equal(second, torch.full_like(second, 3))

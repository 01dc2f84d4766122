"""common.ipc.tensors on CUDA: IPC handles cross a real process boundary as msgpack bytes and map the same
memory."""

from __future__ import annotations

import json

import msgspec
import pytest
import torch

from common.ipc import tensors as ipc
from tests.common.ipc.test_tensors import DTYPES, TINY_SRC, _run_child, _tiny_class, _views

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cuda_round_trip_in_another_process_shares_memory() -> None:
    # Small tensors share caching-allocator segments, so most storages start past their allocation's start.
    bases, views = {}, {}
    for dtype in DTYPES:
        name = ipc.dtype_name(dtype)
        bases[name] = ipc.shared_empty((6, 8), dtype, "cuda")
        bases[name].copy_((torch.arange(48, device="cuda").reshape(6, 8) % 5 + 1).to(dtype))
        views.update({f"{name}/{view}": t for view, t in _views(bases[name]).items()})
    views["empty"] = torch.empty(0, 4, device="cuda")
    exports = ipc.export_tensors(views)  # synchronises: the fills above are visible to the child
    assert {s.kind for s in exports.values()} == {"cuda"}
    assert {s.device for s in exports.values()} == {torch.cuda.current_device()}
    for name, s in exports.items():
        t = views[name]
        assert s.offset + t.untyped_storage().nbytes() - t.storage_offset() * t.element_size() <= s.nbytes
    before = {name: base.clone() for name, base in bases.items()}

    child = """
    shared = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=dict[str, SharedTensor])
    tensors = ipc.import_tensors(shared)
    assert all(t.is_cuda for t in tensors.values())
    assert tensors.pop("empty").shape == (0, 4)
    print(json.dumps({name: t.to(torch.float64).tolist() for name, t in tensors.items()}))
    for name, t in tensors.items():
        if name.endswith("/strided"):
            t.fill_(0)
    torch.cuda.synchronize()
    """
    result = _run_child(child, msgspec.msgpack.encode(exports))

    seen = json.loads(result.stdout)
    for name in views:
        if name != "empty":
            dtype, view = name.split("/")
            assert seen[name] == _views(before[dtype])[view].to(torch.float64).tolist(), name
    for name, base in bases.items():
        expected = before[name].clone()
        expected[1::2, ::3] = 0
        assert torch.equal(base.view(torch.uint8), expected.view(torch.uint8)), name


def test_cuda_share_module_and_attach_in_another_process() -> None:
    torch.manual_seed(0)
    model = _tiny_class()().cuda().eval()
    exports = ipc.share_module(model)
    assert {s.kind for s in exports.values()} == {"cuda"}
    assert exports["head.weight"] is exports["embed.weight"]
    ids = torch.randint(0, 16, (2, 5), device="cuda")
    out = torch.zeros(2, 5, 16, device="cuda")
    payload = {"weights": exports, "io": ipc.export_tensors({"ids": ids, "out": out})}

    child = (
        TINY_SRC
        + """
shared = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=dict[str, dict[str, SharedTensor]])
with torch.device("meta"):
    model = Tiny()
ipc.attach_module(model, shared["weights"])
assert model.head.weight is model.embed.weight and model.embed.weight.is_cuda
io = ipc.import_tensors(shared["io"])
with torch.no_grad():
    io["out"].copy_(model.eval()(io["ids"]))
model.steps.fill_(7)  # lands in the parent's buffer: no copy anywhere
torch.cuda.synchronize()
"""
    )
    _run_child(child, msgspec.msgpack.encode(payload))

    assert model.steps.tolist() == [7, 7, 7]
    model.steps.zero_()
    with torch.no_grad():
        torch.testing.assert_close(out, model(ids), rtol=1e-5, atol=1e-6)

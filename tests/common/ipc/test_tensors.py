"""common.ipc.tensors on the CPU: exports cross a real process boundary as msgpack bytes and map the same
memory."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest
import torch
from torch import nn

from common.ipc import tensors as ipc
from common.protocol import SharedTensor

ROOT = Path(__file__).resolve().parents[3]

CHILD_PREAMBLE = """
import json, sys
import msgspec, torch
from torch import nn
from common.ipc import tensors as ipc
from common.protocol import SharedTensor
torch.set_num_threads(1)
"""

TINY_SRC = """
class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(0.5))
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64), persistent=False)

    def forward(self, ids):
        h = self.norm(self.proj(self.embed(ids))) * self.scale
        return self.head(h) + self.steps.sum()
"""


def _tiny_class() -> type[nn.Module]:
    namespace: dict = {"nn": nn, "torch": torch}
    exec(TINY_SRC, namespace)
    return namespace["Tiny"]


def _run_child(body: str, payload: bytes) -> subprocess.CompletedProcess:
    """Run `body` in a fresh interpreter with `payload` (msgpack bytes, nothing else) on its stdin."""
    code = CHILD_PREAMBLE + textwrap.dedent(body)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(
        [sys.executable, "-c", code], input=payload, capture_output=True, cwd=ROOT, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr.decode()
    return result


def _segments(pid: int) -> list[str]:
    return sorted(glob.glob(f"{ipc.SHM_DIR}/spillway-{pid}-*"))


@pytest.fixture(autouse=True)
def _release():
    yield
    ipc.release_all()


DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float8_e4m3fn, torch.bool]


def _views(base: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "full": base,
        "offset": base[2:],
        "transposed": base.t(),
        "strided": base[1::2, ::3],
        "row": base[3, 1:],
    }


def test_round_trip_in_another_process_shares_memory() -> None:
    bases, views = {}, {}
    for dtype in DTYPES:
        name = ipc.dtype_name(dtype)
        bases[name] = ipc.shared_empty((6, 8), dtype)
        bases[name].copy_((torch.arange(48).reshape(6, 8) % 5 + 1).to(dtype))
        views.update({f"{name}/{view}": t for view, t in _views(bases[name]).items()})
    exports = ipc.export_tensors(views)
    assert {s.kind for s in exports.values()} == {"shm"}
    assert exports["float32/offset"].offset == 2 * 8 * 4
    assert exports["int64/transposed"].stride == [1, 8]
    before = {name: base.clone() for name, base in bases.items()}

    child = """
    shared = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=dict[str, SharedTensor])
    tensors = ipc.import_tensors(shared)
    print(json.dumps({name: t.to(torch.float64).tolist() for name, t in tensors.items()}))
    for name, t in tensors.items():
        if name.endswith("/strided"):
            t.fill_(0)
    ipc.release_all()  # an importer never unlinks: the parent's segments must survive this
    """
    result = _run_child(child, msgspec.msgpack.encode(exports))

    seen = json.loads(result.stdout)
    for name in views:
        dtype, view = name.split("/")
        assert seen[name] == _views(before[dtype])[view].to(torch.float64).tolist(), name
    for name, base in bases.items():
        expected = before[name].clone()
        expected[1::2, ::3] = 0
        assert torch.equal(base.view(torch.uint8), expected.view(torch.uint8)), name
    assert len(_segments(os.getpid())) == len(DTYPES)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the child, so both compute bit-identical outputs
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
def test_share_module_and_attach_in_another_process() -> None:
    torch.manual_seed(0)
    model = _tiny_class()().eval()
    exports = ipc.share_module(model)
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    assert set(exports) == names | {"scale", "steps"}
    assert exports["head.weight"] is exports["embed.weight"]
    assert model.head.weight is model.embed.weight
    assert all(ipc.is_exportable(t) for t in [*model.parameters(), *model.buffers()])
    ids = ipc.shared_empty((2, 5), torch.int64)
    ids.copy_(torch.randint(0, 16, (2, 5)))
    out = ipc.shared_empty((2, 5, 16))
    out.zero_()
    payload = {"weights": exports, "io": ipc.export_tensors({"ids": ids, "out": out})}

    child = (
        TINY_SRC
        + """
shared = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=dict[str, dict[str, SharedTensor]])
with torch.device("meta"):
    model = Tiny()
ipc.attach_module(model, shared["weights"])
assert model.head.weight is model.embed.weight
assert not any(p.requires_grad for p in model.parameters())
assert "steps" not in model.state_dict() and "scale" in model.state_dict()
io = ipc.import_tensors(shared["io"])
with torch.no_grad():
    io["out"].copy_(model.eval()(io["ids"]))
model.steps.fill_(7)  # lands in the parent's non-persistent buffer: no copy anywhere
"""
    )
    _run_child(child, msgspec.msgpack.encode(payload))

    assert model.steps.tolist() == [7, 7, 7]
    model.steps.zero_()
    with torch.no_grad():
        assert torch.equal(out, model(ids))


def test_attach_module_names_missing_and_misshapen() -> None:
    tiny = _tiny_class()
    source = tiny()
    exports = ipc.share_module(source)
    del exports["proj.bias"]
    exports["norm.weight"] = ipc.export_tensor(ipc.shared_empty((9,)))
    with torch.device("meta"):
        target = tiny()
    with pytest.raises(ValueError, match=r"proj\.bias is missing.*norm\.weight is float32\[9\]"):
        ipc.attach_module(target, exports)
    assert target.proj.weight.is_meta  # nothing attached


def test_exporting_memory_that_is_not_shared_raises() -> None:
    with pytest.raises(ValueError, match="not in shared memory"):
        ipc.export_tensor(torch.zeros(3))
    with pytest.raises(ValueError, match="not in shared memory"):
        ipc.export_tensor(ipc.shared_empty((3,)).clone())
    with pytest.raises(ValueError):
        ipc.export_tensor(torch.zeros(3, device="meta"))


def test_bad_dtype_names_raise() -> None:
    t = ipc.shared_empty((4,), torch.int64)
    s = ipc.export_tensor(t)
    for bad in ("float33", "torch.float32", "float", ""):
        with pytest.raises(ValueError, match="unknown dtype"):
            ipc.import_tensor(msgspec.structs.replace(s, dtype=bad))
    with pytest.raises(ValueError, match="cannot be shared"):
        ipc.dtype_name(torch.qint8)
    assert ipc.dtype_from_name("float8_e4m3fn") is torch.float8_e4m3fn


def test_malformed_exports_raise() -> None:
    t = ipc.shared_empty((4, 4))
    s = ipc.export_tensor(t)
    with pytest.raises(ValueError, match="past its allocation"):
        ipc.import_tensor(msgspec.structs.replace(s, shape=[5, 4]))
    with pytest.raises(ValueError, match="past its allocation"):
        ipc.import_tensor(msgspec.structs.replace(s, offset=4))
    with pytest.raises(ValueError, match="malformed"):
        ipc.import_tensor(msgspec.structs.replace(s, stride=[-4, 1]))
    with pytest.raises(ValueError, match="not a spillway"):
        ipc.import_tensor(msgspec.structs.replace(s, handle=b"../../etc/passwd"))
    with pytest.raises(ValueError, match="bytes, the export says"):
        ipc.import_tensor(msgspec.structs.replace(s, nbytes=s.nbytes * 2, shape=[1], stride=[1]))
    with pytest.raises(ValueError, match="unknown SharedTensor kind"):
        ipc.import_tensor(msgspec.structs.replace(s, kind="tpu"))


def test_views_and_reimport_alias_the_same_memory() -> None:
    base = ipc.shared_empty((3, 5), torch.float16)
    base.zero_()
    back = ipc.import_tensor(
        msgspec.msgpack.decode(msgspec.msgpack.encode(ipc.export_tensor(base[1])), type=SharedTensor)
    )
    back.fill_(2)
    assert base.sum().item() == 10
    assert ipc.import_tensor(ipc.export_tensor(base.view(torch.int16)[2, 1:])).shape == (4,)
    empty = ipc.shared_empty((0, 4), torch.int32)
    assert ipc.import_tensor(ipc.export_tensor(empty)).shape == (0, 4)


def test_release_all_unlinks_every_segment() -> None:
    keep = ipc.shared_empty((8,))
    keep.fill_(3)
    others = [ipc.shared_empty((n, 2), torch.bfloat16) for n in (1, 2, 3)]
    export = ipc.export_tensor(keep)
    assert len(_segments(os.getpid())) == 4
    ipc.release_all()
    assert _segments(os.getpid()) == []
    assert keep.sum().item() == 24 and len(others) == 3  # still mapped while alive
    with pytest.raises(ValueError, match="not in shared memory"):
        ipc.export_tensor(keep)
    with pytest.raises(FileNotFoundError):
        ipc.import_tensor(export)


def test_segments_of_a_dead_process() -> None:
    child = """
    kept = ipc.shared_empty((16,))
    print(__import__("os").getpid(), flush=True)
    {exit}
    """
    clean = _run_child(child.format(exit="ipc.shared_empty((4,), torch.int8)"), b"")
    assert _segments(int(clean.stdout)) == []  # a normal exit unlinks (atexit)

    killed = _run_child(child.format(exit="__import__('os')._exit(0)"), b"")
    pid = int(killed.stdout)
    left = _segments(pid)
    assert len(left) == 1
    assert ipc.unlink_stale(pid) == [os.path.basename(left[0])]
    assert _segments(pid) == []
    with pytest.raises(ValueError):
        ipc.unlink_stale(os.getpid())


def test_the_sweep_removes_a_predecessor_under_this_pid_and_keeps_this_process_own() -> None:
    """In a container every start of decode has the same pid: the segments it finds under that pid at its
    start are its crashed predecessor's."""
    mine = ipc.shared_empty((8,))
    stray = os.path.join(ipc.SHM_DIR, f"{ipc.SEGMENT_PREFIX}{os.getpid()}-{10**9}")
    os.close(os.open(stray, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    try:
        removed = ipc.unlink_stale()
        assert os.path.basename(stray) in removed and not os.path.exists(stray)
        assert len(_segments(os.getpid())) >= 1, "this process's own segment stays"
        mine.fill_(1.0)
        assert ipc.import_tensor(ipc.export_tensor(mine)).sum().item() == 8
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stray)

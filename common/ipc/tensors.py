"""Tensors another process maps instead of copying: one interface over CUDA IPC and POSIX shared memory.

One process (decode) owns the big buffers and exports them; others (prefill) map them and use them in place
(docs/ARCHITECTURE.md, Memory). An export is a `common.protocol.SharedTensor` of plain fields,
and `import_tensor` is the one function that rebuilds a tensor from it. Nothing is pickled, here or in torch.

- "cuda": any CUDA tensor not itself imported, named by its block's cudaIpcMemHandle (`_export_cuda`).
- "shm": a view of a POSIX shared-memory segment made by `shared_empty` (`_create_segment`).
- "aliased": memory `common.ipc.aliased.AliasedMemory` made, sent as its range's pieces; the importer
  fetches the allocations as file descriptors (common/ipc/fdpass.py).

Lifetime: a mapping lives as long as any tensor on it. Only the owner unlinks a segment (`release_all`, at
exit); `unlink_stale` removes a dead process's. Importer and exporter must number CUDA devices alike.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import itertools
import math
import mmap
import os
import re
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from common.ipc import aliased
from common.protocol import SharedTensor

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "spillway-"
_NAME_RE = re.compile(r"spillway-([0-9]+)-([0-9]+)")

_DTYPE_NAMES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
)
_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _DTYPE_NAMES if isinstance(getattr(torch, name, None), torch.dtype)
}
_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of `dtype` ("bfloat16", "float8_e4m3fn", ...); ValueError for one that cannot travel."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be shared") from None


def dtype_from_name(name: str) -> torch.dtype:
    """The inverse of dtype_name: canonical names only (no aliases such as "float" or "torch.float32")."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} in a SharedTensor") from None


# ---------------------------------------------------------------------------------------------------------
# Shared-memory segments: one registry for those this process created (owner) and those it mapped.


@dataclass(frozen=True)
class _Segment:
    name: str
    size: int
    owner_pid: int | None
    """The creating process; None for a segment this process imported."""


_lock = threading.RLock()
_segments: dict[int, _Segment] = {}
"""Base address of every live mapping → its segment."""
_mappings: dict[str, tuple[int, weakref.ref[mmap.mmap]]] = {}
"""Segment name → (address, mapping) of its live mapping here (so a segment is mapped once per process)."""
_finalizers: dict[int, weakref.finalize] = {}
_counter = itertools.count()
_atexit_registered = False


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def _storage_of(mm: mmap.mmap) -> torch.UntypedStorage:
    # Through a memoryview: the storage then holds a buffer export, so the mmap cannot be closed under it.
    return torch.frombuffer(memoryview(mm), dtype=torch.uint8).untyped_storage()


def _address(mm: mmap.mmap) -> int:
    return _storage_of(mm).data_ptr()


def _forget(address: int, name: str, owner_pid: int | None) -> None:
    """Drop a mapping from the registry; the owner (and only the owner) unlinks the segment."""
    with _lock:
        _segments.pop(address, None)
        _finalizers.pop(address, None)
        if name in _mappings and _mappings[name][0] == address:
            del _mappings[name]
    if owner_pid is not None and owner_pid == os.getpid():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_path(name))


def _register(mm: mmap.mmap, name: str, owner_pid: int | None) -> None:
    global _atexit_registered
    address = _address(mm)
    with _lock:
        _segments[address] = _Segment(name, len(mm), owner_pid)
        _mappings[name] = (address, weakref.ref(mm))
        _finalizers[address] = weakref.finalize(mm, _forget, address, name, owner_pid)
        if owner_pid is not None and not _atexit_registered:
            atexit.register(release_all)
            _atexit_registered = True


def _reserve(fd: int, size: int, name: str) -> None:
    """Give the segment its size, with the pages reserved now where the filesystem allows it."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise OSError(
                errno.ENOSPC,
                f"{SHM_DIR} has no room for {size} bytes ({name}); enlarge it (docker: --shm-size)",
            ) from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)


def _create_segment(size: int) -> mmap.mmap:
    """A new segment of `size` bytes (at least 1), owned by this process: `/dev/shm/spillway-<pid>-<n>`,
    created exclusively with mode 0600, its space reserved now (a full /dev/shm is an error here, not a
    SIGBUS later), mmap'd and registered by base address so that any view of it can be exported. Importers
    map it by name with os.open + mmap (multiprocessing.shared_memory's resource tracker would unlink it
    when the importer exits)."""
    if not os.path.isdir(SHM_DIR):
        raise OSError(f"{SHM_DIR} does not exist: CPU tensor sharing needs POSIX shared memory (Linux)")
    size = max(size, 1)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    while True:
        name = f"{SEGMENT_PREFIX}{os.getpid()}-{next(_counter)}"
        try:
            fd = os.open(_path(name), flags, 0o600)
            break
        except FileExistsError:  # left by a dead process that had our pid
            continue
    try:
        _reserve(fd, size, name)
        mm = mmap.mmap(fd, size)
    except BaseException:
        os.unlink(_path(name))
        raise
    finally:
        os.close(fd)
    _register(mm, name, os.getpid())
    return mm


def _map_segment(name: str, nbytes: int) -> mmap.mmap:
    """The mapping of segment `name` in this process (reused when it is already mapped)."""
    if not _NAME_RE.fullmatch(name):
        raise ValueError(f"{name!r} is not a spillway shared-memory segment name")
    with _lock:
        entry = _mappings.get(name)
        mm = entry[1]() if entry is not None else None
        if mm is not None and not mm.closed:
            if len(mm) != nbytes:
                raise ValueError(f"segment {name} has {len(mm)} bytes, the export says {nbytes}")
            return mm
    try:
        fd = os.open(_path(name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"shared-memory segment {name} is gone (its owner released it or died)"
        ) from None
    try:
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise ValueError(f"segment {name} has {size} bytes, the export says {nbytes}")
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    _register(mm, name, None)
    return mm


def release_all() -> None:
    """Unlink every segment this process created and forget every mapping (owner and importer alike);
    registered with atexit. Importers never unlink.

    Tensors still alive keep their memory mapped (each storage holds its mmap through a memoryview) and usable
    until they die, in this process and in importers; they can no longer be exported.
    """
    with _lock:
        refs = [ref for _, ref in _mappings.values()]
        finalizers = list(_finalizers.values())
    for ref in refs:
        mm = ref()
        if mm is not None:
            with contextlib.suppress(BufferError):  # a live tensor still uses it: it goes when they do
                mm.close()
    for finalizer in finalizers:
        finalizer()


def unlink_stale(pid: int | None = None) -> list[str]:
    """Unlink the segments of dead process `pid` (of every process that is not alive, when None).

    Returns the names removed. Call it once the process is known dead (the launcher, when a worker exits):
    with an explicit pid, liveness is not checked, so a zombie's segments are removed too. The sweep (None)
    judges liveness in this pid namespace: do not use it where another namespace shares /dev/shm. It also
    removes the segments named with this process's own pid that it did not create: a predecessor's (a
    container whose worker is PID 1 of its own namespace starts it under the same pid every time).
    """
    if pid == os.getpid():
        raise ValueError("unlink_stale is for other, dead processes; this one uses release_all")
    own = {seg.name for seg in _segments.values()}
    removed = []
    for entry in os.scandir(SHM_DIR):
        match = _NAME_RE.fullmatch(entry.name)
        if match is None:
            continue
        owner = int(match.group(1))
        if _kept(entry.name, owner, pid, own):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.path)
            removed.append(entry.name)
    return removed


def _kept(name: str, owner: int, pid: int | None, own: set[str]) -> bool:
    """Whether unlink_stale(pid) leaves segment `name` of process `owner` (`own`: this process's names)."""
    if pid is not None:
        return owner != pid
    return name in own if owner == os.getpid() else process_alive(owner)


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists (another user's counts: its pid is taken)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------------------------------------------------
# Allocation, export, import.


def _contiguous_stride(shape: Sequence[int]) -> list[int]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return stride[::-1]


def shared_empty(
    shape: Sequence[int] | int, dtype: torch.dtype = torch.float32, device: torch.device | str | int = "cpu"
) -> torch.Tensor:
    """An uninitialised tensor that export_tensor accepts: a shared-memory segment on the CPU, an ordinary
    caching-allocator block on CUDA."""
    shape = [shape] if isinstance(shape, int) else [int(size) for size in shape]
    device = torch.device(device)
    if device.type == "cuda":
        return torch.empty(shape, dtype=dtype, device=device)
    if device.type != "cpu":
        raise ValueError(f"cannot share memory on device {device}")
    dtype_name(dtype)
    mm = _create_segment(math.prod(shape) * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(_storage_of(mm), 0, shape, _contiguous_stride(shape))


def is_exportable(t: torch.Tensor) -> bool:
    """Whether export_tensor accepts `t`: a CUDA tensor (not itself imported), or a view of a segment."""
    if aliased.owns(t) or t.device.type == "cuda":
        return True
    return t.device.type == "cpu" and t.untyped_storage().data_ptr() in _segments


def export_tensor(t: torch.Tensor) -> SharedTensor:
    """The wire form of `t`, which must stay alive (in this process) while importers may still map it."""
    dtype = dtype_name(t.dtype)
    if aliased.owns(t):
        return aliased.export_view(t, dtype)
    if t.device.type == "cuda":
        return _export_cuda(t, dtype)
    if t.device.type != "cpu":
        raise ValueError(f"cannot export a tensor on {t.device}")
    storage = t.untyped_storage()
    segment = _segments.get(storage.data_ptr())
    if segment is None:
        raise ValueError(
            "this CPU tensor is not in shared memory: allocate it with ipc.shared_empty (or share_module)"
        )
    return SharedTensor(
        kind="shm",
        handle=segment.name.encode(),
        offset=int(t.storage_offset()) * t.element_size(),
        nbytes=segment.size,
        dtype=dtype,
        shape=list(t.shape),
        stride=list(t.stride()),
        device=-1,
    )


_cuda_exports: dict[tuple[int, int], tuple[int, bytes, int]] = {}
"""(storage address, storage bytes) → (device, IPC handle, storage offset in its allocation). Safe to cache:
an exported block is never recycled (see the module docstring)."""


def _export_cuda(t: torch.Tensor, dtype: str) -> SharedTensor:
    """`t`'s caching-allocator block by its cudaIpcMemHandle (`UntypedStorage._share_cuda_`), which the
    importer opens with `_new_shared_cuda` (once per allocation: torch caches opened handles) and views at the
    tensor's byte offset, shape and stride. `nbytes` is the end of the storage within the allocation.

    Export synchronises the device: writes queued before it are visible to the importer; later ones need
    their own synchronisation. torch's per-export reference count and IPC event are not carried, so an
    exported block is never recycled by the exporter's allocator: export long-lived buffers only. An
    imported CUDA tensor cannot be exported again (torch refuses)."""
    storage = t.untyped_storage()
    offset_in_storage = int(t.storage_offset()) * t.element_size()
    if storage.nbytes() == 0:
        device, handle, base = t.device.index or 0, b"", 0
    else:
        torch.cuda.synchronize(t.device)
        key = (storage.data_ptr(), storage.nbytes())
        with _lock:
            if key not in _cuda_exports:
                device, handle, _size, base, *_refcount_and_event = storage._share_cuda_()
                _cuda_exports[key] = (int(device), bytes(handle), int(base))
            device, handle, base = _cuda_exports[key]
    return SharedTensor(
        kind="cuda",
        handle=handle,
        offset=base + offset_in_storage,
        nbytes=base + storage.nbytes(),
        dtype=dtype,
        shape=list(t.shape),
        stride=list(t.stride()),
        device=device,
    )


def import_tensor(s: SharedTensor) -> torch.Tensor:
    """The tensor `s` names, mapped (not copied) into this process."""
    dtype = dtype_from_name(s.dtype)
    _check_view(s, dtype)
    if s.kind == "shm":
        storage = _storage_of(_map_segment(s.handle.decode(), s.nbytes))
    elif s.kind == "cuda":
        storage = _open_cuda(s)
    elif s.kind == "aliased":
        return aliased.import_view(s, dtype)
    else:
        raise ValueError(f"unknown SharedTensor kind {s.kind!r}")
    return torch.empty(0, dtype=dtype, device=storage.device).set_(
        storage, s.offset // dtype.itemsize, s.shape, s.stride
    )


def _check_view(s: SharedTensor, dtype: torch.dtype) -> None:
    """Refuse a view that does not fit its allocation (a bad peer must not read or write out of bounds)."""
    if len(s.shape) != len(s.stride) or min([*s.shape, *s.stride, s.offset, s.nbytes], default=0) < 0:
        raise ValueError(
            f"malformed SharedTensor view: shape {s.shape}, stride {s.stride}, offset {s.offset}"
        )
    if s.offset % dtype.itemsize:
        raise ValueError(f"offset {s.offset} is not a multiple of the {s.dtype} element size")
    if math.prod(s.shape) == 0:
        return
    last = sum((size - 1) * step for size, step in zip(s.shape, s.stride, strict=True))
    end = s.offset + (last + 1) * dtype.itemsize
    if end > s.nbytes:
        raise ValueError(f"SharedTensor view ends at byte {end}, past its allocation of {s.nbytes} bytes")


def _open_cuda(s: SharedTensor) -> torch.UntypedStorage:
    if s.device < 0:
        raise ValueError(f"a CUDA SharedTensor names device {s.device}")
    if s.nbytes == 0:
        return torch.UntypedStorage(0, device=torch.device("cuda", s.device))
    torch.cuda.init()
    # No reference counter and no event: b"" makes torch's release of the counter a no-op (it is best effort),
    # and the exporter synchronised before exporting.
    return torch.UntypedStorage._new_shared_cuda(s.device, s.handle, s.nbytes, 0, b"", 0, b"", False)


def export_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, SharedTensor]:
    return {name: export_tensor(t) for name, t in tensors.items()}


def import_tensors(shared: Mapping[str, SharedTensor]) -> dict[str, torch.Tensor]:
    return {name: import_tensor(s) for name, s in shared.items()}


# ---------------------------------------------------------------------------------------------------------
# Modules.


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    """("param" | "buffer", name, tensor) for every parameter and buffer, non-persistent and tied included."""
    for name, param in module.named_parameters(remove_duplicate=False):
        yield "param", name, param
    for name, buffer in module.named_buffers(remove_duplicate=False):
        yield "buffer", name, buffer


def share_module(module: nn.Module) -> dict[str, SharedTensor]:
    """Move `module`'s parameters and buffers into exportable memory in place and export them by name.

    CPU tensors are copied into segments and rebound (`.data`), so the module keeps its Parameter objects;
    CUDA tensors are exportable as they are. A tensor registered under several names (tied weights) is shared
    once and exported under each. Views between distinct tensors are not preserved on the CPU.
    """
    exports: dict[str, SharedTensor] = {}
    done: dict[int, SharedTensor] = {}
    for _kind, name, tensor in _named_tensors(module):
        if id(tensor) not in done:
            _make_exportable(tensor, name)
            done[id(tensor)] = export_tensor(tensor)
        exports[name] = done[id(tensor)]
    return exports


def _make_exportable(tensor: torch.Tensor, name: str) -> None:
    if tensor.device.type == "cuda" or is_exportable(tensor):
        return
    if tensor.device.type != "cpu":
        raise ValueError(f"{name} is on {tensor.device}; only CPU and CUDA tensors can be shared")
    shared = shared_empty(tensor.shape, tensor.dtype)
    with torch.no_grad():
        shared.copy_(tensor)
    tensor.data = shared


def attach_module(module: nn.Module, tensors: Mapping[str, SharedTensor | torch.Tensor]) -> None:
    """Make `module` (same structure as the exporter's, possibly on the meta device) use the shared tensors.

    Each parameter becomes an nn.Parameter(requires_grad=False) over the imported memory, each buffer the
    imported tensor; names exported once for tied weights give one Parameter again. Entries of `tensors` that
    the module does not have are ignored. Raises ValueError naming every missing or mismatched tensor, before
    changing anything.
    """
    slots = list(_named_tensors(module))
    problems = [p for kind, name, current in slots if (p := _mismatch(name, current, tensors.get(name)))]
    if problems:
        raise ValueError("cannot attach shared tensors: " + "; ".join(problems))
    made: dict[tuple[str, object], torch.Tensor] = {}
    for kind, name, _current in slots:
        source = tensors[name]
        key = (kind, id(source) if isinstance(source, torch.Tensor) else _identity(source))
        if key not in made:
            tensor = source if isinstance(source, torch.Tensor) else import_tensor(source)
            made[key] = nn.Parameter(tensor, requires_grad=False) if kind == "param" else tensor
        owner_name, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(owner_name), leaf, made[key])


def _identity(s: SharedTensor) -> tuple:
    return (s.kind, s.handle, s.offset, s.nbytes, s.dtype, tuple(s.shape), tuple(s.stride), s.device)


def _mismatch(name: str, current: torch.Tensor, source: SharedTensor | torch.Tensor | None) -> str:
    if source is None:
        return f"{name} is missing"
    if isinstance(source, torch.Tensor):
        shape, dtype = list(source.shape), dtype_name(source.dtype)
    else:
        shape, dtype = list(source.shape), source.dtype
    if shape != list(current.shape) or dtype != dtype_name(current.dtype):
        return (
            f"{name} is {dtype}{shape}, the module expects {dtype_name(current.dtype)}{list(current.shape)}"
        )
    return ""

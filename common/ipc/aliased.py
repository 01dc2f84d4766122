"""Tensors whose chosen byte ranges share memory: one physical buffer mapped at two virtual places.

KV lending (common/experts/kv_lending.py) makes the KV pool's idle pages expert-cache slots without moving
either pool: both keep fixed addresses (recorded CUDA graphs bake them in), and the pages' memory is mapped a
second time inside the expert pool's rows. Who uses a byte is decided by protocol, never by copying.

`AliasedMemory(shared_bytes, device)` owns the shared buffer; `tensor(nbytes, shared)` reserves a virtual
range, maps the given chunk-aligned pieces onto the shared buffer and the rest onto memory of its own, and
returns a uint8 tensor over it. Backends: the CUDA driver's virtual memory API (`_CudaBackend`) and memfds on
the host (`_HostBackend`). This memory is not the caching allocator's (not in
`torch.cuda.memory_reserved()`, not exportable by cudaIpcGetMemHandle): `export_view` / `import_view` share
it, the pieces as numbers and the allocations as file descriptors.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from common.ipc.fdpass import FdServer, fetch_fds
from common.protocol import SharedTensor

Piece = tuple[int, int, int]
"""(offset in the tensor, length, offset in the shared buffer), all multiples of the chunk size."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_PINNED, _POSIX_FD, _LOCATION_DEVICE, _READ_WRITE = 1, 1, 1, 3
_u64, _size, _ptr = ctypes.c_ulonglong, ctypes.c_size_t, ctypes.c_void_p
_DRIVER_ARGS = {
    "cuMemGetAllocationGranularity": [_ptr, _ptr, ctypes.c_int],
    "cuMemCreate": [_ptr, _size, _ptr, _u64],
    "cuMemAddressReserve": [_ptr, _size, _size, _u64, _u64],
    "cuMemMap": [_u64, _size, _size, _u64, _u64],
    "cuMemSetAccess": [_u64, _size, _ptr, _size],
    "cuMemUnmap": [_u64, _size],
    "cuMemAddressFree": [_u64, _size],
    "cuMemRelease": [_u64],
    "cuMemExportToShareableHandle": [_ptr, _u64, ctypes.c_int, _u64],
    "cuMemImportFromShareableHandle": [_ptr, _ptr, ctypes.c_int],
}
"""The signatures of the driver calls made here (CUdeviceptr and handles are 64-bit)."""


class _CudaBackend:
    """The driver's virtual memory API on one device (cuMemAddressReserve / cuMemCreate / cuMemMap /
    cuMemSetAccess, through ctypes); the chunk is the allocation granularity (2 MiB on Hopper)."""

    maps_whole = True
    """cuMemMap maps an allocation only whole and from offset 0 (a part of one: CUDA_ERROR_NOT_SUPPORTED)."""

    def __init__(self, device: torch.device) -> None:
        torch.cuda.init()  # the primary context the driver calls use
        self.index = torch.cuda.current_device() if device.index is None else device.index
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.prop = _AllocationProp(
            type=_PINNED, requestedHandleTypes=_POSIX_FD, location=_Location(_LOCATION_DEVICE, self.index)
        )  # exportable as a file descriptor (common/ipc/fdpass.py)
        for name, args in _DRIVER_ARGS.items():  # 64-bit flags and handles must not travel as C ints
            getattr(self.lib, name).argtypes = args
        size = ctypes.c_size_t()
        self._check("cuMemGetAllocationGranularity", ctypes.byref(size), ctypes.byref(self.prop), 0)
        self.chunk = size.value

    def _check(self, name: str, *args) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise RuntimeError(f"{name} failed with CUresult {rc}")

    def physical(self, nbytes: int) -> int:
        handle = ctypes.c_ulonglong()
        self._check("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(nbytes), ctypes.byref(self.prop), 0)
        return handle.value

    def reserve(self, nbytes: int) -> int:
        ptr = ctypes.c_ulonglong()
        size, align = ctypes.c_size_t(nbytes), ctypes.c_size_t(self.chunk)
        self._check("cuMemAddressReserve", ctypes.byref(ptr), size, align, ctypes.c_ulonglong(0), 0)
        return ptr.value

    def map(self, addr: int, nbytes: int, handle: int, offset: int) -> None:
        self._check("cuMemMap", addr, nbytes, offset, handle, 0)

    def grant(self, addr: int, nbytes: int) -> None:
        """Let this device read and write a mapped piece."""
        access = _AccessDesc(location=_Location(_LOCATION_DEVICE, self.index), flags=_READ_WRITE)
        self._check("cuMemSetAccess", addr, nbytes, ctypes.byref(access), 1)

    def unmap(self, addr: int, nbytes: int, pieces: Sequence[tuple[int, int]]) -> None:
        torch.cuda.synchronize(self.index)  # the driver does not wait for kernels still reading the range
        for at, length in pieces:  # each mapping whole, as it was made
            self._check("cuMemUnmap", ctypes.c_ulonglong(addr + at), ctypes.c_size_t(length))
        self._check("cuMemAddressFree", ctypes.c_ulonglong(addr), ctypes.c_size_t(nbytes))

    def release(self, handle: int) -> None:
        self._check("cuMemRelease", ctypes.c_ulonglong(handle))

    def export_fd(self, handle: int) -> int:
        fd = ctypes.c_int()
        self._check(
            "cuMemExportToShareableHandle", ctypes.byref(fd), ctypes.c_ulonglong(handle), _POSIX_FD, 0
        )
        return fd.value

    def import_fd(self, fd: int) -> int:
        """The allocation `fd` names, as a handle of this process (`fd` stays the caller's to close)."""
        handle = ctypes.c_ulonglong()
        self._check("cuMemImportFromShareableHandle", ctypes.byref(handle), ctypes.c_void_p(fd), _POSIX_FD)
        return handle.value

    def as_tensor(self, addr: int, nbytes: int, keep: object) -> torch.Tensor:
        return torch.as_tensor(_DeviceSpan(addr, nbytes, keep), device=f"cuda:{self.index}")


class _DeviceSpan:
    """A device byte range as `__cuda_array_interface__` (what torch.as_tensor wraps without copying); the
    tensor holds this object, and this object holds the mapping."""

    def __init__(self, addr: int, nbytes: int, keep: object) -> None:
        self.keep = keep
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 3, "strides": None,
        }  # fmt: skip


class _HostBackend:
    """memfd + mmap(MAP_FIXED) in host memory: the CPU form of the same aliasing, so the lending protocol is
    tested without a GPU. Memfds mapped MAP_SHARED | MAP_FIXED into a PROT_NONE reservation (libc mmap
    through ctypes), one for the shared buffer and one for each run of a tensor's own memory; the chunk is the
    page size."""

    maps_whole = False
    """mmap maps any page-aligned part of a memfd."""
    PROT_NONE, PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
    MAP_FIXED = 0x10

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(None, use_errno=True)
        self.lib.mmap.restype = ctypes.c_void_p
        self.lib.mmap.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long,
        ]  # fmt: skip
        self.lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.chunk = mmap.PAGESIZE

    def _mmap(self, addr: int | None, nbytes: int, prot: int, flags: int, fd: int, offset: int) -> int:
        out = self.lib.mmap(addr, nbytes, prot, flags, fd, offset)
        if out in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {nbytes} bytes: {os.strerror(ctypes.get_errno())}")
        return out

    def physical(self, nbytes: int) -> int:
        fd = os.memfd_create("spillway-aliased", os.MFD_CLOEXEC)
        try:  # the pages reserved now: no memory is an error here, not a SIGBUS later
            os.posix_fallocate(fd, 0, nbytes)
        except OSError:
            os.close(fd)
            raise
        return fd

    def reserve(self, nbytes: int) -> int:
        return self._mmap(None, nbytes, self.PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)

    def map(self, addr: int, nbytes: int, handle: int, offset: int) -> None:
        self._mmap(addr, nbytes, self.PROT_RW, mmap.MAP_SHARED | self.MAP_FIXED, handle, offset)

    def grant(self, addr: int, nbytes: int) -> None:
        """Nothing to do: a host mapping is readable and writable as made."""

    def unmap(self, addr: int, nbytes: int, pieces: Sequence[tuple[int, int]]) -> None:
        self.lib.munmap(addr, nbytes)

    def release(self, handle: int) -> None:
        os.close(handle)

    def export_fd(self, handle: int) -> int:
        return os.dup(handle)

    def import_fd(self, fd: int) -> int:
        return os.dup(fd)

    def as_tensor(self, addr: int, nbytes: int, keep: object) -> torch.Tensor:
        span = (ctypes.c_uint8 * nbytes).from_address(addr)
        # frombuffer holds the array, the array holds the mapping (ctypes arrays take attributes; the stubs
        # declare none)
        span.keep = keep  # type: ignore[attr-defined]
        return torch.frombuffer(span, dtype=torch.uint8)


_Backend = _CudaBackend | _HostBackend


def _backend(device: torch.device) -> _Backend:
    return _CudaBackend(device) if device.type == "cuda" else _HostBackend()


_lock = threading.RLock()  # reentrant: a mapping's __del__ may run in a collection while it is held
_sources: dict[int, tuple[_Backend, int]] = {}
"""Every physical allocation this process made (source id → backend, handle): what an importer asks for."""
_source_ids = itertools.count()
_ranges: dict[int, weakref.ref[_Mapping]] = {}
"""Address of each live range made here → its mapping (export_view finds a tensor's range by address)."""
_server: FdServer | None = None
_import_lock = threading.RLock()
_imported: dict[tuple[str, int], list[int]] = {}
"""(exporter's fd server, source id) → [handle imported here, ranges mapping it]: an allocation is imported
once, and released when no range maps it (a restarted exporter's memory is not kept alive here)."""


def _new_source(backend: _Backend, nbytes: int) -> int:
    with _lock:
        sid = next(_source_ids)
        _sources[sid] = (backend, backend.physical(nbytes))
    return sid


def _release_source(sid: int) -> None:
    with _lock:
        backend, handle = _sources.pop(sid)
    backend.release(handle)


@dataclass
class _Mapping:
    """One reserved range and its pieces; unmapped (and its own memory released) when the last holder goes."""

    backend: _Backend
    addr: int
    nbytes: int
    pieces: list[tuple[int, int, int, int]] = field(default_factory=list)
    """(offset, length, source id, offset in the source) of each mapping made in the range."""
    owned: list[int] = field(default_factory=list)
    """Source ids this range releases when it goes (its own memory)."""
    borrowed: list[tuple[str, int]] = field(default_factory=list)
    """`_imported` keys of the allocations it maps (an importer's range)."""
    keep: object = None
    """What must outlive the range (the shared buffer)."""

    def map(self, at: int, length: int, sid: int, offset: int, handle: int) -> None:
        self.backend.map(self.addr + at, length, handle, offset)
        self.pieces.append((at, length, sid, offset))  # unmapped with the range, even if the grant fails
        self.backend.grant(self.addr + at, length)

    def __del__(self) -> None:
        with _lock:
            _ranges.pop(self.addr, None)
        self.backend.unmap(self.addr, self.nbytes, [(at, n) for at, n, _, _ in self.pieces])
        for sid in self.owned:
            _release_source(sid)
        for key in self.borrowed:
            with _import_lock:
                entry = _imported[key]
                entry[1] -= 1
                if entry[1] == 0:
                    del _imported[key]
                    self.backend.release(entry[0])


class _Shared:
    """The shared buffer: one physical allocation a chunk where the backend maps allocations only whole
    (CUDA), else one for all of it."""

    def __init__(self, backend: _Backend, nbytes: int) -> None:
        self.backend, self.chunk = backend, backend.chunk
        sizes = [self.chunk] * (nbytes // self.chunk) if backend.maps_whole else [nbytes]
        self.sources = [_new_source(backend, n) for n in sizes]

    def locate(self, offset: int) -> tuple[int, int, int]:
        """(source id, offset in it, bytes from there one map may take) of the buffer's byte `offset`."""
        if self.backend.maps_whole:
            return self.sources[offset // self.chunk], 0, self.chunk
        return self.sources[0], offset, 1 << 62

    def __del__(self) -> None:
        for sid in self.sources:
            _release_source(sid)


class AliasedMemory:
    """A shared buffer of `shared_bytes` (rounded up to whole chunks) and the tensors mapped onto it. Mappings
    live until the AliasedMemory and every tensor made from it are gone."""

    def __init__(self, shared_bytes: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.backend = _backend(self.device)
        self.chunk = self.backend.chunk
        self.shared_bytes = self.round_up(max(shared_bytes, 1))
        self._shared = _Shared(self.backend, self.shared_bytes)
        self.total_bytes = self.shared_bytes
        """Physical bytes made here: the shared buffer and every tensor's own memory."""

    @staticmethod
    def granularity(device: torch.device | str) -> int:
        """The chunk size pieces are made of on `device`."""
        return _backend(torch.device(device)).chunk

    def round_up(self, nbytes: int) -> int:
        return -(-nbytes // self.chunk) * self.chunk

    def tensor(self, nbytes: int, shared: Sequence[Piece] = ()) -> torch.Tensor:
        """[nbytes] uint8 whose `shared` pieces are the shared buffer's bytes; the rest is its own memory,
        uninitialised like torch.empty's."""
        size = self.round_up(nbytes)
        pieces = sorted(shared)
        for at, length, src in pieces:
            if (at | length | src) % self.chunk or at + length > size or src + length > self.shared_bytes:
                raise ValueError(f"piece {(at, length, src)} not in whole chunks of {self.chunk} inside")
        own_ranges, cursor = [], 0
        for at, length, _ in pieces:
            if at < cursor:
                raise ValueError(f"shared pieces overlap at byte {at}")
            if at > cursor:
                own_ranges.append((cursor, at - cursor))
            cursor = at + length
        if cursor < size:
            own_ranges.append((cursor, size - cursor))
        b = self.backend
        mapping = _Mapping(b, b.reserve(size), size, keep=self._shared)  # unmaps even if a map below fails
        for at, length in own_ranges:
            sid = _new_source(b, length)
            mapping.owned.append(sid)
            mapping.map(at, length, sid, 0, _sources[sid][1])
            self.total_bytes += length
        for at, length, src in pieces:
            done = 0
            while done < length:
                sid, offset, most = self._shared.locate(src + done)
                n = min(most, length - done)
                mapping.map(at + done, n, sid, offset, _sources[sid][1])
                done += n
        with _lock:
            _ranges[mapping.addr] = weakref.ref(mapping)
        return b.as_tensor(mapping.addr, size, mapping)[:nbytes]


# ---------------------------------------------------------------------------------------------------------
# Sharing with another process: a range's pieces travel as plain numbers, its allocations as descriptors.


def _range_of(t: torch.Tensor) -> _Mapping | None:
    ptr = t.untyped_storage().data_ptr()
    with _lock:
        for addr, ref in _ranges.items():
            m = ref()
            if m is not None and addr <= ptr < addr + m.nbytes:
                return m
    return None


def owns(t: torch.Tensor) -> bool:
    """Whether `t` lies in a range AliasedMemory made in this process (export_view accepts it)."""
    return _range_of(t) is not None


def _open_fd(sid: int) -> int:
    with _lock:
        backend, handle = _sources[sid]
    return backend.export_fd(handle)


def export_view(t: torch.Tensor, dtype: str) -> SharedTensor:
    """The wire form of `t` (in a range made here): the range's pieces, and the fd server that hands out
    their allocations. Writes queued on the device before it are visible to the importer (it synchronises)."""
    global _server
    m = _range_of(t)
    if m is None:
        raise ValueError("this tensor is not in memory AliasedMemory made")
    with _lock:
        if _server is None:
            _server = FdServer(_open_fd)
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)
    return SharedTensor(
        kind="aliased", handle=_server.path.encode(), offset=t.data_ptr() - m.addr, nbytes=m.nbytes,
        dtype=dtype, shape=list(t.shape), stride=list(t.stride()),
        device=t.device.index if t.device.type == "cuda" else -1, pieces=[list(p) for p in m.pieces],
    )  # fmt: skip


def import_view(s: SharedTensor, dtype: torch.dtype) -> torch.Tensor:
    """The tensor an `export_view` names, its range mapped here (not copied)."""
    backend = _backend(torch.device("cuda", s.device) if s.device >= 0 else torch.device("cpu"))
    _check_pieces(s, backend.chunk)
    path = s.handle.decode()
    sources = sorted({p[2] for p in s.pieces})
    mapping = _Mapping(backend, backend.reserve(s.nbytes), s.nbytes)
    with _import_lock:  # imports are rare (a worker's start): one at a time, so each allocation comes once
        _import_sources(backend, path, [sid for sid in sources if (path, sid) not in _imported])
        for sid in sources:
            _imported[(path, sid)][1] += 1
            mapping.borrowed.append((path, sid))
    for at, length, sid, offset in s.pieces:
        mapping.map(at, length, sid, offset, _imported[(path, sid)][0])
    raw = backend.as_tensor(mapping.addr, s.nbytes, mapping).view(dtype)
    return raw.as_strided(s.shape, s.stride, s.offset // dtype.itemsize)


def _check_pieces(s: SharedTensor, chunk: int) -> None:
    """Refuse pieces that do not tile the range in whole chunks (a bad peer must not leave holes to fault
    on, or map past the range)."""
    cursor = 0
    for piece in sorted(s.pieces):
        at, length, _, offset = piece if len(piece) == 4 else (-1, -1, -1, -1)
        if at != cursor or length <= 0 or offset < 0 or (length | offset) % chunk:
            raise ValueError(f"malformed aliased piece {piece} of a {s.nbytes}-byte range")
        cursor += length
    if cursor != s.nbytes:
        raise ValueError(f"aliased pieces cover {cursor} of a {s.nbytes}-byte range")


def _import_sources(backend: _Backend, path: str, wanted: list[int]) -> None:
    """Import `wanted` from the fd server at `path` into `_imported` (count 0), a batch of descriptors at a
    time (a range of thousands of chunks stays under the open-file limit); on any failure none of them."""
    done: list[tuple[str, int]] = []
    asked = set(wanted)
    try:
        for batch in fetch_fds(path, wanted) if wanted else ():
            try:
                for sid, fd in batch.items():
                    if sid not in asked or (path, sid) in _imported:
                        raise OSError(f"fd server {path} sent source {sid}, which was not asked for")
                    _imported[(path, sid)] = [backend.import_fd(fd), 0]
                    done.append((path, sid))
            finally:
                for fd in batch.values():
                    os.close(fd)
    except BaseException:
        for key in done:
            backend.release(_imported.pop(key)[0])
        raise

"""CUDA C kernels (common/kernels/cuda/*.cu) for launch shapes Triton cannot express: built with nvcc for the
GPU at hand on first use, cached per source and architecture, and called through ctypes with raw pointers
and the current stream (so CUDA graphs record them like any other launch).

The build needs nvcc (`$CUDA_HOME/bin` or PATH), as flashinfer's JIT does. Where it cannot be built,
`library` returns None and the callers keep their Triton kernels: the native kernels are a faster form of a
kernel that exists, never the only one.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

SOURCES = Path(__file__).parent / "cuda"
log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where built libraries live: $SPILLWAY_CACHE/native, else ~/.cache/spillway/native."""
    root = os.environ.get("SPILLWAY_CACHE") or Path.home() / ".cache" / "spillway"
    return Path(root) / "native"


def nvcc() -> str | None:
    """The nvcc to build with: $CUDA_HOME/bin/nvcc, else the one on PATH."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").is_file():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def build(name: str, arch: str, sources: Path | None = None) -> Path:
    """{sources}/{name}.cu (common/kernels/cuda by default; the benchmarks keep theirs in bench/cuda, and
    include these headers) compiled for `arch` (e.g. "sm_90") into a shared library in `cache_dir()`, named
    by the hash of the source and the headers it may include: built once, then found. Raises with nvcc's
    message."""
    sources = sources or SOURCES
    source = sources / f"{name}.cu"
    digest = hashlib.sha256()
    for part in (source, *sorted({*SOURCES.glob("*.cuh"), *sources.glob("*.cuh")})):
        digest.update(part.read_bytes())
    key = digest.hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}-{arch}.so"
    if target.is_file():
        return target
    compiler = nvcc()
    if compiler is None:
        raise FileNotFoundError("nvcc not found ($CUDA_HOME/bin or PATH)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built apart, then renamed: atomic
        built = Path(tmp) / target.name
        cmd = [
            compiler,
            "-O3",
            "-shared",
            "-Xcompiler",
            "-fPIC",
            f"-arch={arch}",
            f"-I{SOURCES}",
            "-o",
            str(built),
            str(source),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"nvcc failed on {source}:\n{done.stderr.strip()}")
        os.replace(built, target)
    return target


@functools.cache
def library(name: str, arch: str, sources: Path | None = None) -> ctypes.CDLL | None:
    """The built kernel library `name` for `arch`, loaded; None (logged once) where it cannot be built."""
    try:
        return ctypes.CDLL(str(build(name, arch, sources)))
    except (OSError, RuntimeError) as err:
        log.warning("native kernels %s unavailable, Triton's instead: %s", name, err)
        return None


def arch_of(index: int) -> str:
    """The nvcc architecture of CUDA device `index`, e.g. "sm_90"."""
    import torch

    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


def entry(device, library_name: str, name: str, argtypes: tuple) -> Callable[..., int] | None:
    """Entry point `name` of library `library_name` built for CUDA `device` (a torch.device), typed with
    `argtypes` and an int status; None where the library cannot be built."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    return _typed_entry(index, library_name, name, argtypes)


@functools.cache
def _typed_entry(index: int, library_name: str, name: str, argtypes: tuple) -> Callable[..., int] | None:
    lib = library(library_name, arch_of(index))
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


def check(status: int, name: str) -> None:
    """Raise if entry point `name` returned a CUDA error (its launch failed)."""
    if status != 0:
        raise RuntimeError(f"{name}: the CUDA kernel's launch failed with cudaError {status}")


def prebuild(archs: list[str]) -> list[Path]:
    """Every library of common/kernels/cuda built for each of `archs` (e.g. "sm_90") into `cache_dir()`, as
    an image's build stage does: where the runtime then finds them, it needs no nvcc."""
    return [build(source.stem, arch) for arch in archs for source in sorted(SOURCES.glob("*.cu"))]


if __name__ == "__main__":  # python -m common.kernels.native sm_80 sm_90 ...
    import sys

    for path in prebuild(sys.argv[1:]):
        print(path)

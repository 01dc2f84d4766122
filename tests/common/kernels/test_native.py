"""Building the CUDA C kernels (common/kernels/native.py): nvcc's library cached by source and architecture,
and no library, with a warning, where nvcc is missing. Builds for sm_90 without a GPU where nvcc is here."""

from __future__ import annotations

import ctypes
import logging

import pytest

from common.kernels import native


def test_a_build_is_cached_by_source_and_arch(tmp_path, monkeypatch) -> None:
    if native.nvcc() is None:
        pytest.skip("needs nvcc")
    monkeypatch.setenv("SPILLWAY_CACHE", str(tmp_path))
    built = native.build("int4_decode", "sm_90")
    assert built.parent == tmp_path / "native" and built.name.endswith("-sm_90.so")
    assert hasattr(ctypes.CDLL(str(built)), "spillway_int4_gate_up")
    stamp = built.stat().st_mtime_ns
    assert native.build("int4_decode", "sm_90") == built and built.stat().st_mtime_ns == stamp
    assert list((tmp_path / "native").iterdir()) == [built]  # the temporary build folder is gone


def test_no_nvcc_means_no_library_and_a_warning(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("SPILLWAY_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "nvcc", lambda: None)
    native.library.cache_clear()
    with caplog.at_level(logging.WARNING, logger="common.kernels.native"):
        assert native.library("int4_decode", "sm_90") is None
    native.library.cache_clear()
    assert "nvcc not found" in caplog.text


def test_prebuilt_libraries_load_without_nvcc(tmp_path, monkeypatch) -> None:
    """An image's build stage (`python -m common.kernels.native ARCH ...`) builds every kernel library for
    each architecture; the runtime, with no nvcc, loads them from the cache."""
    if native.nvcc() is None:
        pytest.skip("needs nvcc")
    monkeypatch.setenv("SPILLWAY_CACHE", str(tmp_path))
    built = native.prebuild(["sm_80", "sm_90"])
    sources = sorted(native.SOURCES.glob("*.cu"))
    assert len(built) == 2 * len(sources) and all(p.is_file() for p in built)
    monkeypatch.setattr(native, "nvcc", lambda: None)
    native.library.cache_clear()
    assert native.library(sources[0].stem, "sm_80") is not None
    native.library.cache_clear()


def test_a_compile_error_names_the_source(tmp_path, monkeypatch) -> None:
    if native.nvcc() is None:
        pytest.skip("needs nvcc")
    monkeypatch.setenv("SPILLWAY_CACHE", str(tmp_path))
    (tmp_path / "broken.cu").write_text("this is not CUDA\n")
    with pytest.raises(RuntimeError, match=r"broken\.cu"):
        native.build("broken", "sm_90", sources=tmp_path)


def test_a_source_elsewhere_builds_with_the_kernels_headers(tmp_path, monkeypatch) -> None:
    """The benchmarks' kernels (bench/cuda) include common/kernels/cuda's headers."""
    if native.nvcc() is None:
        pytest.skip("needs nvcc")
    monkeypatch.setenv("SPILLWAY_CACHE", str(tmp_path))
    bench = native.SOURCES.parents[2] / "bench" / "cuda"
    built = native.build("stage_floor", "sm_90", sources=bench)
    assert hasattr(ctypes.CDLL(str(built)), "spillway_stage_floor_persistent")


def test_the_int4_entry_points_get_their_declared_arguments(monkeypatch) -> None:
    """Each of moe_int4_native's calls passes as many arguments as its ctypes signature declares, and each
    signature has as many as the extern "C" declaration in int4_decode.cu (no GPU: the calls are recorded)."""
    import re

    import torch

    from common.kernels import moe_int4_native as m

    source = (native.SOURCES / "int4_decode.cu").read_text()
    for name, signature in m._SIGNATURES.items():
        declared = re.search(rf'extern "C" int {name}\((.*?)\)', source, re.S).group(1)
        assert declared.count(",") + 1 == len(signature), name
    calls = []
    monkeypatch.setattr(m, "_function", lambda device, name: lambda *a: calls.append((name, len(a))) or 0)
    monkeypatch.setattr(m.torch.cuda, "current_stream", lambda device: type("S", (), {"cuda_stream": 0})())
    pool = {f"{n}_{p}": torch.zeros(2) for n in ("gate_up", "down") for p in ("qweight", "scales", "zeros")}
    x, rows, act = (
        torch.zeros(1, 256, dtype=torch.bfloat16),
        torch.zeros(4, dtype=torch.int64),
        torch.zeros(4, 128),
    )
    pdl = {"GDC": True, "launch_pdl": True}
    m.gate_up(x, rows, None, pool, act, 4, 2, 2, 1, pdl, False)
    m.gate_up(x, rows, rows, pool, act, 4, 2, 2, 1, pdl, True, mma=True)
    m.down(act, rows, None, torch.zeros(4), pool, torch.zeros(4, 256), x, 4, 4, rows, None, None, pdl)
    m.down(act, rows, rows, torch.zeros(4), pool, torch.zeros(4, 256), x, 4, 4, None, x, x, pdl, mma=True)
    names = ["spillway_int4_gate_up", "spillway_int4_gate_up_mma", "spillway_int4_down"]
    names.append("spillway_int4_down_mma")
    assert calls == [(name, len(m._SIGNATURES[name])) for name in names]

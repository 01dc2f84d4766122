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


def test_a_compile_error_names_the_source(tmp_path, monkeypatch) -> None:
    if native.nvcc() is None:
        pytest.skip("needs nvcc")
    monkeypatch.setenv("SPILLWAY_CACHE", str(tmp_path))
    (tmp_path / "broken.cu").write_text("this is not CUDA\n")
    monkeypatch.setattr(native, "SOURCES", tmp_path)
    with pytest.raises(RuntimeError, match=r"broken\.cu"):
        native.build("broken", "sm_90")

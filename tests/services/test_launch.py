"""The launcher's placement of prefill/decode pairs: a GPU each on CUDA, none on the CPU."""

from __future__ import annotations

import pytest

from services.launch import pair_gpus


def test_pairs_on_the_cpu_need_no_gpu() -> None:
    assert pair_gpus(1, "cuda:1") == [None], "one pair runs where its flags say"
    assert pair_gpus(3, "cpu") == [None, None, None]


def test_each_pair_takes_the_next_visible_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    assert pair_gpus(2, "cuda") == ["3", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ValueError, match="needs a GPU a pair; this machine shows 1"):
        pair_gpus(2, "cuda")


def test_one_gpu_named_for_every_pair_is_refused() -> None:
    with pytest.raises(ValueError, match="use --device cuda, not cuda:1"):
        pair_gpus(2, "cuda:1")
    with pytest.raises(ValueError, match="at least 1"):
        pair_gpus(0, "cpu")

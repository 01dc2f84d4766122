"""The launcher starts both workers from `config_argv(cfg)`: those flags must give `cfg` back."""

from __future__ import annotations

import argparse

import pytest
import torch

from common.config import WorkerConfig
from services.worker_args import add_config_args, config_argv, device_arg, worker_config


def _roundtrip(cfg: WorkerConfig) -> WorkerConfig:
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    return worker_config(parser.parse_args(config_argv(cfg)))


def test_config_argv_gives_the_config_back(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # --device cuda is checked as parsed
    assert _roundtrip(WorkerConfig(model_dir="/m")) == WorkerConfig(model_dir="/m")
    cfg = WorkerConfig(
        model_dir="/m",
        device="cuda",
        dtype="bfloat16",
        max_running=2,
        max_context=1024,
        expert_cache="0.25",
        cache_policy="lru",
        expert_format="int4",
        prefill_chunk=512,
        layer_major_tokens=2048,
        replay_routing="synthetic-zipf:seed=3",
        vram_budget=32 << 30,
        kv_dtype="fp8_e4m3",
        resident_dtype="fp8",
        grammar_max_bytes=64 << 10,
        grammar_timeout_s=2.5,
    )
    assert _roundtrip(cfg) == cfg


def test_device_must_exist_here() -> None:
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    for bad in ("gpu", "cuda:x", "mps"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--model", "/m", "--device", bad])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            parser.parse_args(["--model", "/m", "--device", "cuda"])
    assert parser.parse_args(["--model", "/m", "--device", "cpu"]).device == "cpu"


def test_device_auto_is_the_gpu_where_there_is_one_else_the_cpu() -> None:
    assert device_arg("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert device_arg("cpu") == "cpu"

"""Checks shared by the tests of checkpoints whose experts are published quantized (test_loader_fp4.py,
test_loader_int4_published.py, test_loader_ct.py): their tensors read and edited shard by shard, and greedy
generation compared with transformers on the dequantised weights."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.protocol import SamplingParams

INDEX = "model.safetensors.index.json"
EXPERT_FORMAT = {
    "nvfp4": "nvfp4",
    "mxfp4": "mxfp4",
    "gptq": "gptq-g32",
    "gptq-desc-act": "gptq-g32",
    "awq": "awq-g32",
    "w4a16": "ct-w4a16-g32",
    "w4a16-asym": "ct-w4a16-asym-g32",
    "nvfp4a16": "ct-nvfp4a16",
}
"""`make-model --quantize` variant -> its experts' format in the host store (the tiny preset's int4 groups
are 32: its dims do not fit 128; fp8's experts are dequantised at load)."""
PROMPTS = [[5, 17, 99, 3, 42], [7, 8, 9, 10, 11, 12, 13, 14, 200, 31, 4]]
TOKENS = 12


def tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint by key."""
    return {k: t for f in sorted(model_dir.glob("*.safetensors")) for k, t in load_file(f).items()}


def copy_unquantized_config(model_dir: Path, out: Path) -> None:
    """`model_dir`'s JSON files into `out` but its index and quantization files, config.json without its
    quantization_config: the config of a plain checkpoint of the same model."""
    for f in model_dir.iterdir():
        if f.suffix == ".json" and f.name not in (INDEX, "hf_quant_config.json", "quantize_config.json"):
            shutil.copy(f, out / f.name)
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))


def shard_of(model_dir: Path, key: str) -> Path:
    """The safetensors file holding `key` (the only one where there is no index)."""
    index = model_dir / INDEX
    if not index.is_file():
        return model_dir / "model.safetensors"
    return model_dir / json.loads(index.read_text())["weight_map"][key]


def edit_shard(model_dir: Path, key: str, change: Callable[[dict[str, torch.Tensor]], object]) -> Path:
    """Apply `change(tensors)` to the shard holding `key`; return that shard."""
    shard = shard_of(model_dir, key)
    loaded = load_file(shard)
    change(loaded)
    save_file(loaded, shard, metadata={"format": "pt"})
    return shard


@torch.inference_mode()
def assert_greedy_matches_transformers(
    model_dir: Path, dequantized_dir: Path, expert_cache: str | None
) -> None:
    """Spillway on `model_dir` (experts resident, or from the host store of published bits through
    `expert_cache`) generates, greedily, what transformers generates on `dequantized_dir`."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        dequantized_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    hf.generation_config.eos_token_id = None
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    cfg = WorkerConfig(
        str(model_dir), max_running=2, max_context=64, dtype="float32", expert_cache=expert_cache
    )
    ours = Engine(cfg).generate(PROMPTS, params)
    for prompt, result in zip(PROMPTS, ours, strict=True):
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=TOKENS, pad_token_id=0)
        assert result.token_ids == ref[0, len(prompt) :].tolist()

"""qwen4_exp checkpoints: text-only and multimodal layouts, the n-gram table in bf16 or fp8, bad shards."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.engine.runner import ModelRunner
from common.model.errors import CheckpointError
from common.model.loader import load_model
from common.model.synthetic.checkpoint import make_model

TABLE = re.compile(r"ngram_embedding\.shard_(\d+)\.weight$")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("q4"), preset="tiny", arch="qwen4_exp")


@pytest.fixture
def ckpt(pristine: Path, tmp_path: Path) -> Path:
    shutil.copytree(pristine, tmp_path / "m")
    return tmp_path / "m"


def _rewrite(model_dir: Path, edit) -> None:
    """Apply edit(tensors) to every shard (keys may be added, removed or renamed within a shard)."""
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    new_map = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors = load_file(model_dir / name)
        edit(tensors)
        save_file(tensors, model_dir / name, metadata={"format": "pt"})
        new_map.update(dict.fromkeys(tensors, name))
    index["weight_map"] = new_map
    index_path.write_text(json.dumps(index))


def _logits(model_dir: Path) -> torch.Tensor:
    model = load_model(model_dir, dtype=torch.float32)
    runner = ModelRunner(model, max_running=1, max_context=64)
    prompt = torch.randint(3, 1000, (25,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        return runner.forward([runner.new_sequence()], [prompt], all_logits=True)


def test_text_only_layout_equals_multimodal(ckpt: Path, pristine: Path) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    text = {**config["text_config"], "model_type": "qwen4_exp_text", "architectures": ["Qwen4ExpForCausalLM"]}
    (ckpt / "config.json").write_text(json.dumps(text))

    def strip(tensors: dict) -> None:
        for key in list(tensors):
            tensors[key.replace("model.language_model.", "model.")] = tensors.pop(key)

    _rewrite(ckpt, strip)
    assert torch.equal(_logits(ckpt), _logits(pristine))


def test_fp8_table_with_shard_scales(ckpt: Path, pristine: Path) -> None:
    def to_fp8(tensors: dict) -> None:
        for key in [k for k in tensors if TABLE.search(k)]:
            weight = tensors[key].float()
            scale = weight.abs().max() / 448.0
            tensors[key] = (weight / scale).to(torch.float8_e4m3fn)
            tensors[key + "_scale_inv"] = scale.reshape(1)

    _rewrite(ckpt, to_fp8)
    model = load_model(ckpt, dtype=torch.float32)
    table = model.model.layers[1].ple.table
    assert table.rows.dtype == torch.float8_e4m3fn and table.shard_scales is not None
    reference = load_model(pristine, dtype=torch.float32).model.layers[1].ple.table
    ids = torch.randint(0, table.rows.shape[0], (200,))
    fp8_rows, bf16_rows = table.lookup(ids, torch.float32), reference.lookup(ids, torch.float32)
    assert ((fp8_rows - bf16_rows).norm() / bf16_rows.norm()).item() < 0.05
    fp8_logits, bf16_logits = _logits(ckpt), _logits(pristine)
    assert torch.isfinite(fp8_logits).all()
    assert ((fp8_logits - bf16_logits).norm() / bf16_logits.norm()).item() < 0.05


def test_fp8_table_without_scale_is_an_error(ckpt: Path) -> None:
    def to_fp8(tensors: dict) -> None:
        for key in [k for k in tensors if TABLE.search(k)]:
            tensors[key] = tensors[key].to(torch.float8_e4m3fn)

    _rewrite(ckpt, to_fp8)
    with pytest.raises(CheckpointError, match="fp8 table without"):
        load_model(ckpt)


def test_missing_table_shard(ckpt: Path) -> None:
    def drop(tensors: dict) -> None:
        for key in [k for k in tensors if k.endswith("ngram_embedding.shard_2.weight")]:
            del tensors[key]

    _rewrite(ckpt, drop)
    with pytest.raises(CheckpointError, match="missing tensor") as err:
        load_model(ckpt)
    assert err.value.key.endswith("ple.ple_embedding.ngram_embedding.shard_2.weight")


def test_misshapen_table_shard(ckpt: Path) -> None:
    def shrink(tensors: dict) -> None:
        for key in [k for k in tensors if k.endswith("shard_0.weight")]:
            tensors[key] = tensors[key][:, :-1].clone()

    _rewrite(ckpt, shrink)
    with pytest.raises(CheckpointError, match="shape") as err:
        load_model(ckpt)
    assert err.value.key.endswith("ngram_embedding.shard_0.weight")

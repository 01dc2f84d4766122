"""`check_checkpoint` (what `spillway serve` runs before it starts a process) refuses every checkpoint that
`load_model` refuses, naming the same key, and reads no tensor: the same corruptions, both ways."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.model.errors import CheckpointError
from common.model.loader import check_checkpoint, load_model
from common.model.synthetic.checkpoint import make_model

ATTENTION = "model.layers.0.self_attn.q_proj.weight"
EXPERT = "model.layers.3.mlp.experts.5.up_proj.weight"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("pristine"), preset="tiny", arch="qwen3_moe")


def _shard_of(model_dir: Path, key: str) -> Path:
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    return model_dir / index["weight_map"][key]


def _rewrite(model_dir: Path, key: str, edit: Callable[[dict], object]) -> None:
    shard = _shard_of(model_dir, key)
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})


def _truncate(model_dir: Path) -> None:
    shard = _shard_of(model_dir, "model.embed_tokens.weight")
    shard.write_bytes(shard.read_bytes()[:-1000])  # the header intact: its last tensors' bytes past the end


def _garble_header(model_dir: Path) -> None:
    shard = _shard_of(model_dir, ATTENTION)
    data = bytearray(shard.read_bytes())
    data[8:20] = b"not a header"
    shard.write_bytes(bytes(data))


def _config(field: str, value: object) -> Callable[[Path], None]:
    def edit(model_dir: Path) -> None:
        cfg = json.loads((model_dir / "config.json").read_text())
        cfg[field] = value
        (model_dir / "config.json").write_text(json.dumps(cfg))

    return edit


CORRUPTIONS: dict[str, Callable[[Path], object]] = {
    "truncated shard": _truncate,
    "garbled header": _garble_header,
    "missing shard": lambda d: _shard_of(d, "model.norm.weight").unlink(),
    "missing tensor": lambda d: _rewrite(d, EXPERT, lambda t: t.pop(EXPERT)),
    "misshapen tensor": lambda d: _rewrite(
        d, ATTENTION, lambda t: t.__setitem__(ATTENTION, t[ATTENTION][:-1])
    ),
    "integer weight": lambda d: _rewrite(
        d, ATTENTION, lambda t: t.__setitem__(ATTENTION, t[ATTENTION].int())
    ),
    "more layers than tensors": _config("num_hidden_layers", 5),
    "bad config value": _config("hidden_size", -64),
}


def test_a_sound_checkpoint_passes(pristine: Path, tmp_path: Path) -> None:
    check_checkpoint(pristine)
    check_checkpoint(make_model(tmp_path / "q4", preset="tiny", arch="qwen4_exp"))  # host tables too


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_what_the_loader_refuses_the_check_refuses(pristine: Path, tmp_path: Path, corruption: str) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(pristine, model_dir)
    CORRUPTIONS[corruption](model_dir)
    with pytest.raises(CheckpointError) as loading:
        load_model(model_dir, dtype=torch.float32)
    with pytest.raises(CheckpointError) as checking:
        check_checkpoint(model_dir)
    assert checking.value.key == loading.value.key and checking.value.path is not None
    if loading.value.path is not None and loading.value.path.suffix == ".safetensors":
        assert checking.value.path == loading.value.path  # the same file named

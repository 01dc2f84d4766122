"""Bad checkpoints fail with a CheckpointError that names the file and the key, never a deep torch trace."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.model.errors import CheckpointError
from common.model.loader import load_model
from common.model.synthetic.checkpoint import make_model


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("pristine"), preset="tiny", arch="qwen3_moe")


@pytest.fixture
def ckpt(pristine: Path, tmp_path: Path) -> Path:
    out = tmp_path / "model"
    shutil.copytree(pristine, out)
    return out


def _shard_of(model_dir: Path, key: str) -> Path:
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    return model_dir / index["weight_map"][key]


def _rewrite(shard: Path, edit) -> None:
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})


def test_pristine_loads(pristine: Path) -> None:
    model = load_model(pristine, dtype=torch.float32)
    assert model.config.model_type == "qwen3_moe"


def test_unknown_model_type(ckpt: Path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "llama9_moe"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="llama9_moe") as err:
        load_model(ckpt)
    assert err.value.path == ckpt / "config.json" and err.value.key == "model_type"
    assert "qwen3_moe" in str(err.value)  # lists what is supported


def test_missing_config(ckpt: Path) -> None:
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="not found") as err:
        load_model(ckpt)
    assert err.value.path == ckpt / "config.json"


def test_malformed_config(ckpt: Path) -> None:
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="JSON"):
        load_model(ckpt)


def test_config_missing_required_field(ckpt: Path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["hidden_size"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as err:
        load_model(ckpt)
    assert err.value.key == "hidden_size"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hidden_size", "64"),
        ("hidden_size", -64),
        ("num_hidden_layers", "4"),
        ("vocab_size", None),
        ("num_experts_per_tok", 16),
        ("rms_norm_eps", "x"),
        ("mlp_only_layers", "1"),
        ("model_type", ["qwen3_moe"]),
    ],
)
def test_config_field_of_the_wrong_type_or_value(ckpt: Path, field: str, value: object) -> None:
    """Named by file and key before torch meets it as a shape (a traceback, or garbage routing)."""
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg[field] = value
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as err:
        load_model(ckpt)
    assert err.value.path == ckpt / "config.json" and err.value.key == field, str(err.value)


def test_missing_shard(ckpt: Path) -> None:
    shard = _shard_of(ckpt, "model.norm.weight")
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing shard") as err:
        load_model(ckpt)
    assert err.value.path == shard and err.value.key is not None


def test_missing_tensor(ckpt: Path) -> None:
    key = "model.layers.2.self_attn.k_norm.weight"
    _rewrite(_shard_of(ckpt, key), lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing tensor") as err:
        load_model(ckpt)
    assert err.value.key == key


def test_missing_expert_tensor(ckpt: Path) -> None:
    key = "model.layers.3.mlp.experts.5.up_proj.weight"
    _rewrite(_shard_of(ckpt, key), lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing tensor") as err:
        load_model(ckpt)
    assert err.value.key == key


@pytest.mark.parametrize(
    "key", ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.1.down_proj.weight"]
)
def test_misshapen_tensor(ckpt: Path, key: str) -> None:
    shard = _shard_of(ckpt, key)

    def shrink(tensors: dict) -> None:
        tensors[key] = tensors[key][:-1].clone()

    _rewrite(shard, shrink)
    with pytest.raises(CheckpointError, match="shape") as err:
        load_model(ckpt)
    assert err.value.path == shard and err.value.key == key


@pytest.mark.parametrize(
    "key", ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.1.down_proj.weight"]
)
def test_integer_weights_are_refused(ckpt: Path, key: str) -> None:
    shard = _shard_of(ckpt, key)
    _rewrite(shard, lambda t: t.__setitem__(key, (t[key] * 1000).to(torch.int32)))
    with pytest.raises(CheckpointError, match="dtype int32") as err:
        load_model(ckpt)
    assert err.value.path == shard and err.value.key == key


@pytest.mark.parametrize(
    "key", ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.1.down_proj.weight"]
)
def test_a_tensor_in_two_shards_is_refused(ckpt: Path, key: str) -> None:
    """The index assigns a key to one shard; a second copy elsewhere would win or lose by file order."""
    home = _shard_of(ckpt, key)
    other = next(p for p in sorted(ckpt.glob("*.safetensors")) if p != home)
    value = load_file(home)[key]
    _rewrite(other, lambda t: t.__setitem__(key, torch.zeros_like(value)))
    with pytest.raises(CheckpointError, match="twice") as err:
        load_model(ckpt)
    first = home if err.value.path == other else other  # read in file order: either copy may come first
    assert err.value.key == key and err.value.path in (home, other) and first.name in str(err.value)


def test_truncated_shard(ckpt: Path) -> None:
    shard = _shard_of(ckpt, "model.embed_tokens.weight")
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError) as err:
        load_model(ckpt)
    assert err.value.path == shard


def test_single_file_checkpoint(ckpt: Path) -> None:
    """Without an index, one model.safetensors holds everything."""
    _merge_into_single_file(ckpt)
    model = load_model(ckpt, dtype=torch.float32)
    assert model.model.embed_tokens.weight.shape[0] == model.config.vocab_size


def _merge_into_single_file(model_dir: Path, edit=None) -> None:
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    merged = {}
    for name in sorted(set(index["weight_map"].values())):
        merged.update(load_file(model_dir / name))
        (model_dir / name).unlink()
    (model_dir / "model.safetensors.index.json").unlink()
    if edit is not None:
        edit(merged)
    save_file(merged, model_dir / "model.safetensors", metadata={"format": "pt"})


def test_fused_expert_keys(ckpt: Path, pristine: Path) -> None:
    """transformers 5 writes fused experts: gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
    layer, num = 0, 8
    prefix = f"model.layers.{layer}.mlp.experts."

    def fuse(tensors: dict) -> None:
        part = {k: tensors.pop(k) for k in list(tensors) if k.startswith(prefix)}
        gate_up = [
            torch.cat([part[f"{prefix}{e}.gate_proj.weight"], part[f"{prefix}{e}.up_proj.weight"]])
            for e in range(num)
        ]
        tensors[prefix + "gate_up_proj"] = torch.stack(gate_up)
        tensors[prefix + "down_proj"] = torch.stack(
            [part[f"{prefix}{e}.down_proj.weight"] for e in range(num)]
        )

    _merge_into_single_file(ckpt, fuse)
    fused = load_model(ckpt, dtype=torch.float32)
    reference = load_model(pristine, dtype=torch.float32)
    a = fused.model.layers[layer].mlp.experts.weights[layer]
    b = reference.model.layers[layer].mlp.experts.weights[layer]
    assert torch.equal(a.gate_up, b.gate_up) and torch.equal(a.down, b.down)

"""Synthetic checkpoints: HF on-disk layout, loadability in transformers, determinism, presets."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from common.model.synthetic import checkpoint as synthetic
from common.model.synthetic.checkpoint import make_model, synthetic_tensors
from common.model.synthetic.config import model_config, parse_overrides
from common.model.synthetic.plan import plan_shards, plan_tensors
from common.model.synthetic.presets import EOS_TOKEN_ID, FLAT_ARCHS, PAD_TOKEN_ID, PRESETS

transformers = pytest.importorskip("transformers")


def _load_hf(path: Path) -> tuple[torch.nn.Module, dict]:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    return model.eval(), info


def _assert_clean_load(info: dict) -> None:
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["unexpected_keys"], info["unexpected_keys"]
    assert not info["mismatched_keys"], info["mismatched_keys"]
    assert not info["error_msgs"], info["error_msgs"]


def _checkpoint_tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """key -> (file, shape) over every safetensors file in ``path``."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            assert sf.metadata() == {"format": "pt"}
            for k in sf.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                out[k] = (f.name, tuple(sf.get_slice(k).get_shape()))
    return out


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(3, 40).reshape(1, -1)
    with torch.no_grad():
        return model(input_ids=ids).logits[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny checkpoint per flat arch (qwen4_exp: test_synthetic_qwen4.py), written once for the module."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_model(root / arch, "tiny", arch) for arch in FLAT_ARCHS}


# --- layout -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", FLAT_ARCHS)
def test_tiny_files_and_index(tiny: dict[str, Path], arch: str) -> None:
    path = tiny[arch]
    for name in ("config.json", "generation_config.json", "tokenizer.json", "model.safetensors.index.json"):
        assert (path / name).is_file(), name
    shards = sorted(path.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 2
    assert [s.name for s in shards] == [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
    ]

    index = json.loads((path / "model.safetensors.index.json").read_text())
    tensors = _checkpoint_tensors(path)
    assert index["weight_map"] == {k: f for k, (f, _) in tensors.items()}
    itemsize = torch.bfloat16.itemsize
    assert index["metadata"]["total_size"] == sum(math.prod(s) * itemsize for _, s in tensors.values())

    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == arch
    assert cfg["torch_dtype"] == "bfloat16"
    if arch == "glm4_moe":  # transformers 5's spelling, as GLM-4.5's config.json
        assert cfg["rope_parameters"]["partial_rotary_factor"] == 0.5 and "rope_theta" not in cfg
    else:
        assert "rope_theta" in cfg and cfg["rope_scaling"] is None
    assert cfg["eos_token_id"] == 2 and cfg["bos_token_id"] is None
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen == {"eos_token_id": [2, 0], "pad_token_id": 0, "bos_token_id": None}


def test_token_ids_match_tokenizer() -> None:
    from common.model.synthetic import tokenizer as tok

    assert EOS_TOKEN_ID == tok.IM_END_ID
    assert PAD_TOKEN_ID == tok.ENDOFTEXT_ID


@pytest.mark.parametrize("arch", FLAT_ARCHS)
def test_tiny_keys_are_hf_names(tiny: dict[str, Path], arch: str) -> None:
    tensors = _checkpoint_tensors(tiny[arch])
    hd, h = 32, 64
    assert tensors["model.embed_tokens.weight"][1] == (1024, h)
    assert tensors["lm_head.weight"][1] == (1024, h)
    assert tensors["model.layers.0.self_attn.q_proj.weight"][1] == (4 * hd, h)
    assert tensors["model.layers.0.self_attn.k_proj.weight"][1] == (2 * hd, h)
    assert tensors["model.layers.0.self_attn.o_proj.weight"][1] == (h, 4 * hd)
    if arch == "mixtral":
        moe = "model.layers.0.block_sparse_moe"
        assert tensors[f"{moe}.gate.weight"][1] == (8, h)
        assert tensors[f"{moe}.experts.7.w1.weight"][1] == (32, h)
        assert tensors[f"{moe}.experts.7.w3.weight"][1] == (32, h)
        assert tensors[f"{moe}.experts.7.w2.weight"][1] == (h, 32)
        return
    if arch == "glm4_moe":  # layer 0 dense (first_k_dense_replace), then routed and shared experts
        assert tensors["model.layers.0.mlp.up_proj.weight"][1] == (96, h)
        assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"][1] == (8,)
        assert tensors["model.layers.1.mlp.shared_experts.down_proj.weight"][1] == (h, 32)
        assert tensors["model.layers.1.self_attn.q_proj.bias"][1] == (4 * hd,)
        assert "model.layers.1.self_attn.o_proj.bias" not in tensors
        return
    assert tensors["model.layers.0.mlp.gate.weight"][1] == (8, h)
    assert tensors["model.layers.0.mlp.experts.7.down_proj.weight"][1] == (h, 32)
    # Layer 1 is in mlp_only_layers: a dense MLP with intermediate_size.
    assert tensors["model.layers.1.mlp.up_proj.weight"][1] == (96, h)
    assert not any(k.startswith("model.layers.1.mlp.experts") for k in tensors)
    if arch == "qwen3_moe":
        assert tensors["model.layers.0.self_attn.q_norm.weight"][1] == (hd,)
        assert not any(k.endswith("_proj.bias") for k in tensors)
    else:
        assert tensors["model.layers.0.self_attn.q_proj.bias"][1] == (4 * hd,)
        assert "model.layers.0.self_attn.o_proj.bias" not in tensors
        assert tensors["model.layers.0.mlp.shared_expert.gate_proj.weight"][1] == (48, h)
        assert tensors["model.layers.0.mlp.shared_expert_gate.weight"][1] == (1, h)


# --- transformers loads it ------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", FLAT_ARCHS)
def test_tiny_loads_in_transformers(tiny: dict[str, Path], arch: str) -> None:
    model, info = _load_hf(tiny[arch])
    _assert_clean_load(info)
    logits = _logits(model)
    assert logits.shape == (37, 1024)
    assert torch.isfinite(logits).all()
    # Informative, not near-uniform: wide per-position spread and a clear top-1 at most positions.
    assert logits.std(dim=-1).min() > 0.5
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 0.05
    _assert_experts_fused_as_named(tiny[arch], model, arch)


def _assert_experts_fused_as_named(path: Path, model: torch.nn.Module, arch: str) -> None:
    """transformers fuses each expert's (gate, up) into gate_up_proj: check our names mean what it expects."""
    layer, expert = 2, 3
    moe = "block_sparse_moe" if arch == "mixtral" else "mlp"
    names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    on_disk = []
    for name in names:
        key = f"model.layers.{layer}.{moe}.experts.{expert}.{name}.weight"
        with safe_open(path / weight_map[key], "pt") as sf:
            on_disk.append(sf.get_tensor(key).float())
    gate, up, down = on_disk
    fused = model.model.layers[layer].mlp.experts
    assert torch.equal(fused.gate_up_proj[expert], torch.cat([gate, up]))
    assert torch.equal(fused.down_proj[expert], down)


@pytest.mark.parametrize(
    ("arch", "items"),
    [
        (
            "qwen3_moe",
            [
                "num_experts=6",
                "norm_topk_prob=false",
                "mlp_only_layers=[0]",
                "tie_word_embeddings=true",
                "head_dim=24",
            ],
        ),
        (
            "qwen2_moe",
            [
                "num_experts=6",
                "norm_topk_prob=false",
                "mlp_only_layers=[0]",
                "tie_word_embeddings=true",
                "head_dim=24",
            ],
        ),
        ("mixtral", ["num_local_experts=5", "tie_word_embeddings=true", "head_dim=24"]),
    ],
)
def test_overrides_change_shapes_and_still_load(tmp_path: Path, arch: str, items: list[str]) -> None:
    path = make_model(tmp_path, "tiny", arch, parse_overrides(items))
    tensors = _checkpoint_tensors(path)
    assert "lm_head.weight" not in tensors
    assert tensors["model.layers.2.self_attn.q_proj.weight"][1] == (4 * 24, 64)
    if arch == "mixtral":
        experts = {k.split(".")[5] for k in tensors if ".experts." in k}
        assert experts == {str(e) for e in range(5)}
    else:
        assert "model.layers.0.mlp.gate_proj.weight" in tensors  # now dense
        assert tensors["model.layers.1.mlp.gate.weight"][1] == (6, 64)  # now sparse
        assert "model.layers.1.mlp.experts.5.gate_proj.weight" in tensors
        assert "model.layers.1.mlp.experts.6.gate_proj.weight" not in tensors
    model, info = _load_hf(path)
    _assert_clean_load(info)
    assert model.config.tie_word_embeddings
    assert torch.isfinite(_logits(model)).all()


def test_float32_override(tmp_path: Path) -> None:
    path = make_model(tmp_path, "tiny", "mixtral", {"torch_dtype": "float32"})
    with safe_open(
        path / "model-00001-of-{:05d}.safetensors".format(len(list(path.glob("model-*")))), "pt"
    ) as sf:
        assert sf.get_tensor("model.embed_tokens.weight").dtype == torch.float32


# --- determinism ----------------------------------------------------------------------------------------


def _shard_bytes(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.glob("*.safetensors"))}


def test_same_seed_is_byte_identical(tiny: dict[str, Path], tmp_path: Path) -> None:
    again = make_model(tmp_path, "tiny", "qwen3_moe")
    assert _shard_bytes(again) == _shard_bytes(tiny["qwen3_moe"])
    index = "model.safetensors.index.json"
    assert (again / index).read_bytes() == (tiny["qwen3_moe"] / index).read_bytes()


def test_different_seed_differs(tiny: dict[str, Path], tmp_path: Path) -> None:
    other = _shard_bytes(make_model(tmp_path, "tiny", "qwen3_moe", seed=1))
    base = _shard_bytes(tiny["qwen3_moe"])
    assert other.keys() == base.keys()
    assert all(other[name] != base[name] for name in base)


def test_shard_size_does_not_change_values(tiny: dict[str, Path], tmp_path: Path) -> None:
    # Each tensor comes from its own generator, so how the tensors are grouped into files is irrelevant.
    path = make_model(tmp_path, "tiny", "qwen3_moe", shard_bytes=10**9)
    assert [f.name for f in path.glob("*.safetensors")] == ["model.safetensors"]
    assert not (path / "model.safetensors.index.json").exists()
    key = "model.layers.3.mlp.experts.5.up_proj.weight"
    index = json.loads((tiny["qwen3_moe"] / "model.safetensors.index.json").read_text())
    with (
        safe_open(path / "model.safetensors", "pt") as single,
        safe_open(tiny["qwen3_moe"] / index["weight_map"][key], "pt") as sharded,
    ):
        assert torch.equal(single.get_tensor(key), sharded.get_tensor(key))


def _read_all(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            out.update({k: sf.get_tensor(k) for k in sf.keys()})  # noqa: SIM118
    return out


@pytest.mark.parametrize("arch", FLAT_ARCHS)
def test_synthetic_tensors_equal_the_written_checkpoint(tiny: dict[str, Path], arch: str) -> None:
    written = _read_all(tiny[arch])
    cfg = json.loads((tiny[arch] / "config.json").read_text())
    keys = []
    for key, tensor in synthetic_tensors(cfg, seed=0):
        keys.append(key)
        assert tensor.dtype == written[key].dtype and torch.equal(tensor, written[key]), key
    assert keys == [t.key for t in plan_tensors(cfg)]
    assert set(keys) == set(written)


def test_large_tensors_are_drawn_in_chunks_independent_of_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    # Tensors above one chunk are drawn chunk by chunk, each chunk from its own generator; the values do
    # not depend on how many threads draw them, and the chunks are not copies of each other.
    monkeypatch.setattr(synthetic, "_CHUNK", 1000)
    cfg = model_config("tiny", "qwen3_moe", {"num_hidden_layers": 1, "num_experts": 2})
    serial = dict(synthetic_tensors(cfg, seed=3, workers=1))
    parallel = dict(synthetic_tensors(cfg, seed=3, workers=3))
    assert serial.keys() == parallel.keys()
    assert all(torch.equal(serial[k], parallel[k]) for k in serial)
    embed = serial["model.embed_tokens.weight"].flatten().float()  # 65536 values: 66 chunks
    assert not torch.equal(embed[:1000], embed[1000:2000])
    assert abs(embed.std().item() - 1.0) < 0.02
    # A tensor of at most one chunk is drawn from the key's generator alone.
    seeds = synthetic.generator_seeds(plan_shards(cfg, 10**9), seed=3)
    norm = "model.layers.0.input_layernorm.weight"
    g = torch.Generator().manual_seed(seeds[norm])
    expected = torch.randn(64, generator=g).mul_(0.1).add_(1.0).to(torch.bfloat16)
    assert torch.equal(serial[norm], expected)


def test_synthetic_tensors_can_stop_early() -> None:
    cfg = model_config("tiny", "mixtral", None)
    stream = synthetic_tensors(cfg, seed=0, workers=2)
    key, tensor = next(stream)
    assert key == "model.embed_tokens.weight" and tensor.shape == (1024, 64)
    stream.close()  # cancels the draws queued ahead


def test_rewrite_removes_stale_shards(tmp_path: Path) -> None:
    make_model(tmp_path, "tiny", "mixtral")
    make_model(tmp_path, "tiny", "mixtral", shard_bytes=10**9)
    assert [f.name for f in tmp_path.glob("*.safetensors")] == ["model.safetensors"]


# --- config and arguments -------------------------------------------------------------------------------


def test_parse_overrides() -> None:
    assert parse_overrides(
        ["a=6", "b=false", "c=[0]", "d=null", "e=bfloat16", "f=1e-5", "g=x=y", 'h="6"']
    ) == {
        "a": 6,
        "b": False,
        "c": [0],
        "d": None,
        "e": "bfloat16",
        "f": 1e-5,
        "g": "x=y",
        "h": "6",
    }
    assert parse_overrides([]) == {}
    with pytest.raises(ValueError, match="num_experts"):
        parse_overrides(["num_experts"])
    with pytest.raises(ValueError, match="=3"):
        parse_overrides(["=3"])


def test_bad_preset_and_arch() -> None:
    with pytest.raises(ValueError, match="qwen3-30b"):
        model_config("huge", None, None)
    with pytest.raises(ValueError, match="mixtral"):
        model_config("tiny", "llama", None)
    with pytest.raises(ValueError, match="qwen3_moe"):
        model_config("qwen3-30b", "mixtral", None)
    with pytest.raises(ValueError, match="torch_dtype"):
        model_config("tiny", None, {"torch_dtype": "int8"})
    with pytest.raises(ValueError, match="model_type"):
        model_config("tiny", "qwen3_moe", {"model_type": "mixtral"})


def test_overrides_apply_to_config() -> None:
    cfg = model_config("tiny", "qwen2_moe", {"num_experts": 6, "rope_theta": 5e5, "new_field": "x"})
    assert cfg["num_experts"] == 6 and cfg["rope_theta"] == 5e5 and cfg["new_field"] == "x"
    assert model_config("tiny", None, None)["model_type"] == "qwen3_moe"
    # The result is a fresh copy each time.
    model_config("tiny", None, None)["mlp_only_layers"].append(3)
    assert model_config("tiny", None, None)["mlp_only_layers"] == [1]


# --- qwen3-30b (planned, never written) -----------------------------------------------------------------

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_qwen3_30b_config() -> None:
    cfg = model_config("qwen3-30b", None, None)
    assert {k: cfg[k] for k in QWEN3_30B_A3B} == QWEN3_30B_A3B
    # transformers accepts it as a Qwen3MoeConfig.
    hf = transformers.Qwen3MoeConfig(**cfg)
    assert hf.rope_parameters["rope_theta"] == 1000000.0 and hf.head_dim == 128


def test_qwen3_30b_shard_plan() -> None:
    cfg = model_config("qwen3-30b", None, None)
    limit = PRESETS["qwen3-30b"].shard_bytes
    shards = plan_shards(cfg, limit)
    params = sum(t.numel for s in shards for t in s.tensors)
    assert 30.3e9 < params < 30.7e9  # "30.5B"
    assert 15 <= len(shards) <= 17  # the published checkpoint has 16 ~4 GB shards
    assert all(0 < s.nbytes <= limit for s in shards)
    assert sum(s.nbytes for s in shards) == 2 * params
    assert shards[0].filename == f"model-00001-of-{len(shards):05d}.safetensors"
    keys = [t.key for s in shards for t in s.tensors]
    assert len(keys) == len(set(keys))
    assert "model.layers.47.mlp.experts.127.down_proj.weight" in keys
    assert keys[0] == "model.embed_tokens.weight" and keys[-1] == "lm_head.weight"
    # Every tensor gets its own generator seed, even where 32-bit hashes of the keys collide.
    seeds = synthetic.generator_seeds(shards, seed=0)
    assert len(set(seeds.values())) == len(keys)


def test_make_model_inside_inference_mode(tmp_path: Path) -> None:
    """Tensors drawn by worker threads must not be inference tensors of the calling thread."""
    with torch.inference_mode():
        make_model(tmp_path / "m", preset="tiny", arch="qwen3_moe")
    assert (tmp_path / "m" / "config.json").is_file()

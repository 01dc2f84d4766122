"""Synthetic qwen4_exp (Qwen3.8-Flash-Next) checkpoints: release layout, transformers loads them, presets."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from common.model.ngram import NGramSpec, ngram_shard_rows
from common.model.synthetic import checkpoint as synthetic
from common.model.synthetic.checkpoint import make_model, synthetic_tensors
from common.model.synthetic.config import model_config
from common.model.synthetic.plan import plan_shards, plan_tensors
from common.model.synthetic.presets import PRESETS

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen4_exp")

LM = "model.language_model"
PLE = f"{LM}.layers.1.ple"
TOP_LEVEL = {
    "architectures",
    "model_type",
    "text_config",
    "vision_config",
    "tie_word_embeddings",
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "torch_dtype",
}


def _read(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            assert sf.metadata() == {"format": "pt"}
            out.update({k: sf.get_tensor(k) for k in sf.keys()})  # noqa: SIM118 (safe_open is not a Mapping)
    return out


def _load_hf(path: Path) -> tuple[torch.nn.Module, dict]:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == "Qwen4ExpForCausalLM"
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[kind], (kind, info[kind])
    return model.eval(), info


def _ids(length: int = 40, batch: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(3, 1000, (batch, length), generator=g)


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny4"), "tiny", "qwen4_exp")


@pytest.fixture(scope="module")
def hf_model(tiny: Path) -> torch.nn.Module:
    return _load_hf(tiny)[0]


# --- layout -------------------------------------------------------------------------------------------


def test_config_is_the_release_layout(tiny: Path) -> None:
    cfg = json.loads((tiny / "config.json").read_text())
    assert set(cfg) == TOP_LEVEL
    assert cfg["architectures"] == ["Qwen4ExpForConditionalGeneration"] and cfg["model_type"] == "qwen4_exp"
    assert cfg["torch_dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is False
    text, vision = cfg["text_config"], cfg["vision_config"]
    assert text["model_type"] == "qwen4_exp_text" and vision["model_type"] == "qwen4_exp_vision"
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert text["rope_parameters"] == {
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],  # sums to rotary_dim / 2 = 32 * 0.25 / 2
        "mrope_interleaved": True,
    }
    assert text["ple_layer_ids"] == [2] and text["eos_token_id"] == 2 and text["tie_word_embeddings"] is False
    assert vision["depth"] == 1 and vision["out_hidden_size"] == text["hidden_size"] == 64
    assert max(cfg[k] for k in TOP_LEVEL if k.endswith("token_id")) < text["vocab_size"] == 1024
    gen = json.loads((tiny / "generation_config.json").read_text())
    assert gen == {"eos_token_id": [2, 0], "pad_token_id": 0, "bos_token_id": None}
    assert (tiny / "tokenizer.json").is_file()


def test_tiny_is_small_and_sharded(tiny: Path) -> None:
    index = json.loads((tiny / "model.safetensors.index.json").read_text())
    shards = sorted(tiny.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 2 and set(index["weight_map"].values()) == {s.name for s in shards}
    tensors = _read(tiny)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values()) < 4 * 2**20
    assert set(index["weight_map"]) == set(tensors)


def test_keys_and_shapes(tiny: Path) -> None:
    t = _read(tiny)
    assert all(k.startswith((f"{LM}.", "mtp.", "model.visual.")) or k == "lm_head.weight" for k in t)
    assert t["model.visual.merger.linear_fc2.weight"].shape == (64, 4 * 32), "merged patches → text width"
    shapes = {k: tuple(v.shape) for k, v in t.items()}
    h, hc = 64, 256
    # The MTP head (one layer, as the release stores it: fused experts, its own stream mixer).
    assert shapes["mtp.fc_hidden.weight"] == (h, h) and shapes["mtp.pre_fc_norm_hidden.weight"] == (hc,)
    assert shapes["mtp.layers.0.mlp.experts.gate_up_proj"] == (8, 2 * 32, h)
    assert shapes["mtp.layers.0.mlp.experts.down_proj"] == (8, h, 32)
    assert "mtp.hyper_connection_mixer.input_mix_weight_up.weight" in shapes
    assert shapes[f"{LM}.embed_tokens.weight"] == (1024, h) and shapes["lm_head.weight"] == (1024, h)
    gdn = f"{LM}.layers.0.linear_attn"
    assert shapes[f"{gdn}.in_proj_qkv.weight"] == (2 * 2 * 16 + 4 * 16, h)
    assert shapes[f"{gdn}.in_proj_z.weight"] == (64, h) and shapes[f"{gdn}.in_proj_a.weight"] == (4, h)
    assert shapes[f"{gdn}.conv1d.weight"] == (128, 1, 4) and shapes[f"{gdn}.norm.weight"] == (16,)
    assert shapes[f"{gdn}.A_log"] == (4,) and shapes[f"{gdn}.out_proj.weight"] == (h, 64)
    attn = f"{LM}.layers.3.self_attn"
    assert shapes[f"{attn}.q_proj.weight"] == (2 * 4 * 32, h)  # query and output gate
    assert shapes[f"{attn}.o_proj.weight"] == (h, 4 * 32)
    assert shapes[f"{attn}.indexer.index_qk_proj.weight"] == ((2 + 1) * 32, h)
    assert shapes[f"{attn}.indexer.k_layernorm.weight"] == (32,)
    assert not any(k.startswith(f"{LM}.layers.3.linear_attn") for k in t)
    assert not any(k.startswith(f"{LM}.layers.0.self_attn") for k in t)
    mlp = f"{LM}.layers.2.mlp"
    assert shapes[f"{mlp}.gate.weight"] == (8, h)
    assert {k.split(".")[6] for k in t if k.startswith(f"{mlp}.experts.")} == {str(e) for e in range(8)}
    assert shapes[f"{mlp}.experts.7.down_proj.weight"] == (h, 32)
    assert shapes[f"{mlp}.shared_expert_gate.weight"] == (1, h)
    hyper = f"{LM}.layers.2.attn_hyper_connection"
    assert shapes[f"{hyper}.input_mix_weight_down.weight"] == (16, hc)
    assert shapes[f"{hyper}.block_inject_weight.weight"] == (4, hc)
    assert f"{LM}.hyper_connection_mixer.block_inject_weight.weight" not in t
    # PLE on layer id 2 only (layer index 1): 16 heads x 4 dims, 16896 rows in 4 shards of 4224.
    assert sorted(k for k in t if ".ple." in k) == sorted(
        [f"{PLE}.ple_embedding.ngram_embedding.shard_{j}.weight" for j in range(4)]
        + [
            f"{PLE}.ple_embedding.{b}"
            for b in ("layer_multipliers", "ngram_heads_offsets", "ngram_heads_vocab_sizes")
        ]
        + [
            f"{PLE}.{n}.weight"
            for n in ("key_proj", "value_proj", "norm_key", "norm_query", "norm_conv", "conv1d")
        ]
    )
    assert all(shapes[f"{PLE}.ple_embedding.ngram_embedding.shard_{j}.weight"] == (4224, 4) for j in range(4))
    assert shapes[f"{PLE}.conv1d.weight"] == (hc, 1, 4) and shapes[f"{PLE}.key_proj.weight"] == (hc, 64)
    assert t[f"{PLE}.ple_embedding.ngram_heads_offsets"].dtype == torch.int64
    assert t[f"{LM}.embed_tokens.weight"].dtype == torch.bfloat16


def test_weight_statistics(tiny: Path) -> None:
    t = {k: v.float() for k, v in _read(tiny).items() if v.is_floating_point()}
    gdn = f"{LM}.layers.0.linear_attn"
    a = t[f"{gdn}.A_log"].exp()
    assert ((a >= 0.49) & (a <= 4.01)).all()
    assert abs(t[f"{gdn}.norm.weight"].mean().item() - 1.0) < 0.1  # gated norm: used as w
    assert abs(t[f"{LM}.layers.0.attn_hyper_connection.hc_norm.weight"].mean().item()) < 0.05  # used as 1 + w
    assert abs(t[f"{LM}.layers.3.self_attn.q_norm.weight"].std().item() - 0.1) < 0.05
    assert abs(t[f"{PLE}.ple_embedding.ngram_embedding.shard_2.weight"].std().item() - 1.0) < 0.05
    assert abs(t[f"{PLE}.conv1d.weight"].std().item() - 0.5) < 0.1  # 1 / sqrt(kernel 4)
    assert abs(t[f"{gdn}.in_proj_qkv.weight"].std().item() - 64**-0.5) < 0.02


# --- transformers loads it ------------------------------------------------------------------------------


def test_loads_in_transformers_and_is_informative(hf_model: torch.nn.Module) -> None:
    assert hf_model.config.layer_types == ["linear_attention"] * 3 + ["indexed_attention"]
    logits = _logits(hf_model, _ids())
    assert logits.shape == (2, 40, 1024) and torch.isfinite(logits).all()
    assert logits.std(dim=-1).min() > 0.5
    top2 = logits.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).median() > 0.05


def test_ngram_buffers_and_table_match_transformers(tiny: Path, hf_model: torch.nn.Module) -> None:
    module = hf_model.model.layers[1].ple.ple_embedding
    ours = _read(tiny)
    spec = NGramSpec.build(1024, 3, 8, 1000, 128, 1234, 0, 2)
    for name, expected in (
        ("layer_multipliers", spec.multipliers),
        ("ngram_heads_vocab_sizes", spec.head_vocab_sizes),
        ("ngram_heads_offsets", spec.head_offsets),
    ):
        buffer = getattr(module, name)
        assert buffer.tolist() == list(expected), name
        assert torch.equal(ours[f"{PLE}.ple_embedding.{name}"], buffer), name
    table = torch.cat([ours[f"{PLE}.ple_embedding.ngram_embedding.shard_{j}.weight"] for j in range(4)])
    assert module.ngram_embedding.weight.shape == (spec.table_rows, 4) == (16896, 4)
    assert torch.equal(module.ngram_embedding.weight, table.float())


def test_save_pretrained_writes_the_same_keys_and_values(tiny: Path, tmp_path: Path) -> None:
    # The strongest check of the layout: transformers, saving what it loaded, writes our checkpoint back.
    path = make_model(
        tmp_path / "src", "tiny", "qwen4_exp", {"torch_dtype": "float32", "split_ngram_parts": 5}
    )
    model, _ = _load_hf(path)
    model.save_pretrained(tmp_path / "resaved")
    ours, theirs = _read(path), _read(tmp_path / "resaved")
    # The text model ignores the MTP head and the vision tower (tests/common/model/test_qwen4_vision.py)
    ours = {k: v for k, v in ours.items() if not k.startswith(("mtp.", "model.visual."))}
    assert theirs.keys() == ours.keys()
    assert all(torch.equal(theirs[k], ours[k]) for k in ours)
    # 16896 rows in 5: torch.chunk's split, 4 x 3380 + 3376.
    shards = [k for k in ours if ".ngram_embedding.shard_" in k]
    assert sorted(ours[k].shape[0] for k in shards) == [3376, 3380, 3380, 3380, 3380]


def test_ngram_shard_rows_follow_torch_chunk() -> None:
    for rows, parts in ((16896, 4), (16896, 5), (16896, 1000), (32002176, 512), (7, 7), (5, 8)):
        expected = [len(c) for c in torch.chunk(torch.empty(rows, 0), parts)]
        assert ngram_shard_rows(rows, parts) == expected, (rows, parts)


def test_every_part_matters(hf_model: torch.nn.Module) -> None:
    # Perturbing any one part of the GDN, QSA, PLE or hyper-connections moves the logits, on a prompt long
    # enough for the indexer's selection to be sparse.
    ids = _ids(48)
    base = _logits(hf_model, ids)
    names = [
        "model.layers.1.ple.ple_embedding.ngram_embedding.weight",
        "model.layers.1.ple.conv1d.weight",
        "model.layers.1.ple.norm_key.weight",
        "model.layers.0.linear_attn.A_log",
        "model.layers.0.linear_attn.dt_bias",
        "model.layers.0.linear_attn.conv1d.weight",
        "model.layers.2.linear_attn.norm.weight",
        "model.layers.3.self_attn.indexer.index_qk_proj.weight",
        "model.layers.3.self_attn.indexer.k_layernorm.weight",
        "model.layers.3.self_attn.k_norm.weight",
        "model.layers.2.mlp_hyper_connection.block_inject_weight.weight",
        "model.hyper_connection_mixer.input_mix_weight_up.weight",
        "model.layers.2.mlp.shared_expert_gate.weight",
    ]
    params = dict(hf_model.named_parameters())
    g = torch.Generator().manual_seed(0)
    for name in names:
        p = params[name]
        saved = p.detach().clone()
        with torch.no_grad():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
            moved = (_logits(hf_model, ids) - base).abs().max().item()
            p.copy_(saved)
        assert moved > 1e-2, name


def test_indexer_selection_is_sparse_past_budget(hf_model: torch.nn.Module, tmp_path: Path) -> None:
    # Same weights (indexer_budget changes no shape), a budget that keeps every token: the logits agree
    # where a query sees at most budget + compress_ratio - 1 = 19 tokens, and differ beyond.
    dense, _ = _load_hf(make_model(tmp_path, "tiny", "qwen4_exp", {"indexer_budget": 64}))
    ids = _ids(40)
    sparse_logits, dense_logits = _logits(hf_model, ids), _logits(dense, ids)
    torch.testing.assert_close(sparse_logits[:, :19], dense_logits[:, :19])
    assert (sparse_logits[:, 19:] - dense_logits[:, 19:]).abs().amax() > 1e-2


# --- overrides ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {"num_experts": 6},
        {"ple_layer_ids": []},
        {"num_hidden_layers": 8},
        {"tie_word_embeddings": True},
        {"ple_layer_ids": [1, 3], "head_dim": 16, "attention_bias": True},
    ],
    ids=["experts", "no-ple", "8-layers", "tied", "2-ple-bias"],
)
def test_overrides_change_shapes_and_still_load(tmp_path: Path, overrides: dict) -> None:
    path = make_model(tmp_path, "tiny", "qwen4_exp", overrides)
    cfg = json.loads((path / "config.json").read_text())
    text = cfg["text_config"]
    assert set(cfg) == TOP_LEVEL
    keys = set(_read(path))
    if "num_experts" in overrides:
        assert text["num_experts"] == 6 and "num_experts" not in cfg
        experts = {k.split(".")[6] for k in keys if k.startswith(f"{LM}.layers.0.mlp.experts.")}
        assert experts == {str(e) for e in range(6)}
    if overrides.get("ple_layer_ids") == []:
        assert not any(".ple." in k for k in keys)
    if "num_hidden_layers" in overrides:
        assert text["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2
        assert f"{LM}.layers.7.self_attn.indexer.index_qk_proj.weight" in keys
    if "tie_word_embeddings" in overrides:
        assert cfg["tie_word_embeddings"] is True and text["tie_word_embeddings"] is True
        assert "lm_head.weight" not in keys
    if overrides.get("ple_layer_ids") == [1, 3]:
        assert f"{LM}.layers.0.ple.conv1d.weight" in keys and f"{LM}.layers.2.ple.conv1d.weight" in keys
        assert text["rope_parameters"]["mrope_section"] == [1, 1, 0]  # rotary dim 16 * 0.25 = 4
        assert f"{LM}.layers.3.self_attn.o_proj.bias" in keys
    model, _ = _load_hf(path)
    logits = _logits(model, _ids(24))
    assert torch.isfinite(logits).all() and logits.std(dim=-1).min() > 0.3
    if overrides.get("ple_layer_ids") == [1, 3]:  # the second PLE layer hashes with its own parameters
        second = model.model.layers[2].ple.ple_embedding
        spec = NGramSpec.build(1024, 3, 8, 1000, 128, 1234, 1, 2)
        assert second.ngram_heads_vocab_sizes.tolist() == list(spec.head_vocab_sizes)
        assert second.layer_multipliers.tolist() == list(spec.multipliers)


def test_override_routing() -> None:
    cfg = model_config(
        "tiny",
        "qwen4_exp",
        {
            "num_experts": 6,
            "rope_theta": 5e6,
            "image_token_id": 7,
            "torch_dtype": "float32",
            "vision_config.depth": 2,
            "text_config.hc_count": 2,
            "new_field": "x",
        },
    )
    text = cfg["text_config"]
    assert text["num_experts"] == 6 and text["hc_count"] == 2 and text["new_field"] == "x"
    assert text["rope_parameters"]["rope_theta"] == 5e6 and "rope_theta" not in text
    assert (
        cfg["image_token_id"] == 7 and cfg["torch_dtype"] == "float32" and cfg["vision_config"]["depth"] == 2
    )
    assert not {"num_experts", "hc_count", "new_field", "rope_theta"} & set(cfg)
    # Explicit layer_types / mrope_section are kept, not re-derived.
    cfg = model_config(
        "tiny", "qwen4_exp", {"layer_types": ["linear_attention"] * 4, "mrope_section": [4, 0, 0]}
    )
    assert cfg["text_config"]["layer_types"] == ["linear_attention"] * 4
    assert cfg["text_config"]["rope_parameters"]["mrope_section"] == [4, 0, 0]
    # A fresh copy each time.
    model_config("tiny", "qwen4_exp", None)["text_config"]["ple_layer_ids"].append(3)
    assert model_config("tiny", "qwen4_exp", None)["text_config"]["ple_layer_ids"] == [2]


def test_bad_overrides() -> None:
    for frozen in ("model_type", "architectures", "text_config.model_type", "vision_config.model_type"):
        with pytest.raises(ValueError, match="cannot override"):
            model_config("tiny", "qwen4_exp", {frozen: "x"})
    with pytest.raises(ValueError, match="ple_layer_ids"):  # layer id 2 does not exist in a 1-layer model
        model_config("flashnext", None, {"num_hidden_layers": 1})
    with pytest.raises(ValueError, match="ple_layer_ids"):  # layer id 4 is an attention layer
        model_config("tiny", "qwen4_exp", {"ple_layer_ids": [4]})
    with pytest.raises(ValueError, match="ple_embed_dim"):
        model_config("tiny", "qwen4_exp", {"ple_embed_dim": 40})
    with pytest.raises(ValueError, match="torch_dtype"):
        model_config("tiny", "qwen4_exp", {"torch_dtype": "int8"})
    with pytest.raises(ValueError, match="qwen4_exp"):
        model_config("flashnext", "qwen3_moe", None)


# --- determinism and the in-memory generator -----------------------------------------------------------


def test_same_seed_is_byte_identical(tiny: Path, tmp_path: Path) -> None:
    again = make_model(tmp_path, "tiny", "qwen4_exp")
    names = ["config.json", "model.safetensors.index.json", *(f.name for f in tiny.glob("*.safetensors"))]
    for name in names:
        assert (again / name).read_bytes() == (tiny / name).read_bytes(), name


def test_different_seed_differs(tiny: Path) -> None:
    cfg = json.loads((tiny / "config.json").read_text())
    base, other = _read(tiny), dict(synthetic_tensors(cfg, seed=1))
    assert other.keys() == base.keys()
    assert all(
        not torch.equal(other[k], base[k])
        for k in base
        if base[k].is_floating_point() and base[k].numel() > 1
    )
    # The hash buffers derive from the config alone.
    assert torch.equal(
        other[f"{PLE}.ple_embedding.layer_multipliers"], base[f"{PLE}.ple_embedding.layer_multipliers"]
    )


def test_synthetic_tensors_equal_the_written_checkpoint(tiny: Path) -> None:
    cfg = json.loads((tiny / "config.json").read_text())
    written = _read(tiny)
    for workers in (1, 3):
        keys = []
        for key, tensor in synthetic_tensors(cfg, seed=0, workers=workers):
            keys.append(key)
            assert tensor.dtype == written[key].dtype and torch.equal(tensor, written[key]), key
        assert keys == [t.key for t in plan_tensors(cfg)] and set(keys) == set(written)


# --- flashnext (planned, never written) -----------------------------------------------------------------

FLASHNEXT_TEXT = {
    "num_hidden_layers": 48,
    "hidden_size": 2560,
    "num_attention_heads": 24,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 640,
    "shared_expert_intermediate_size": 640,
    "hc_count": 4,
    "hc_lowrank": 320,
    "ple_layer_ids": [2],
    "ple_embed_dim": 2560,
    "ngram_size": 3,
    "heads_per_ngram": 8,
    "ngram_vocab_size_base": 20_000_000,
    "split_ngram_parts": 512,
    "indexer_budget": 2048,
    "indexer_compress_ratio": 4,
    "indexer_n_heads": 4,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 128,
    "vocab_size": 248320,
    "max_position_embeddings": 262144,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
}


def test_flashnext_config() -> None:
    cfg = model_config("flashnext", None, None)
    assert set(cfg) == TOP_LEVEL and cfg["torch_dtype"] == "bfloat16"
    text = cfg["text_config"]
    assert {k: text[k] for k in FLASHNEXT_TEXT} == FLASHNEXT_TEXT
    assert text["rope_parameters"] == {
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    }
    assert text["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 12
    assert cfg["vision_config"]["out_hidden_size"] == 2560 and cfg["vision_config"]["depth"] == 27
    # transformers accepts it, as the text and vision sub-configs it expects.
    hf = transformers.Qwen4ExpConfig(**cfg)
    assert hf.text_config.layer_types[3] == "indexed_attention" and hf.text_config.num_experts == 512
    assert hf.text_config.rope_parameters["mrope_section"] == [11, 11, 10]
    assert hf.vision_config.out_hidden_size == 2560 and hf.vision_config.depth == 27
    assert hf.image_token_id == 248056 and hf.vision_start_token_id == 248053


def test_flashnext_plan() -> None:
    cfg = model_config("flashnext", None, None)
    limit = PRESETS["flashnext"].shard_bytes
    shards = plan_shards(cfg, limit)
    specs = [t for s in shards for t in s.tensors]
    table = [t for t in specs if ".ngram_embedding.shard_" in t.key]
    mtp = sum(t.numel for t in specs if t.key.startswith("mtp."))
    vision = sum(t.numel for t in specs if t.key.startswith("model.visual."))
    trunk = sum(t.numel for t in specs) - sum(t.numel for t in table) - mtp - vision
    assert 125.0e9 < trunk < 126.0e9  # ~125.7B, 120.8B of them routed experts
    assert 0.4e9 < vision < 0.5e9  # 27 blocks of 1152
    assert 2.5e9 < mtp < 3.0e9  # one QSA layer with its own 512 experts
    assert sum(t.numel for t in table) == 320_001_536 * 160  # 51.2B
    assert len(table) == 512 and {t.shape for t in table} == {(625_003, 160)}
    assert 85 <= len(shards) <= 95 and all(0 < s.nbytes <= limit for s in shards)  # 354 GB
    assert sum(s.nbytes for s in shards) == sum(t.numel * (8 if t.dtype == "int64" else 2) for t in specs)
    keys = [t.key for t in specs]
    assert len(keys) == len(set(keys)) and keys[-1] == "lm_head.weight"
    assert f"{LM}.layers.47.mlp.experts.511.down_proj.weight" in keys
    assert f"{LM}.layers.1.ple.ple_embedding.ngram_embedding.shard_511.weight" in keys
    assert not any(".ple." in k for k in keys if not k.startswith(f"{LM}.layers.1."))
    seeds = synthetic.generator_seeds(shards, seed=0)
    assert len(set(seeds.values())) == len(keys)


def test_flashnext_benchmark_table() -> None:
    # What benchmarks write: a tenfold smaller table, still 512 shards (the last shorter).
    cfg = model_config("flashnext", None, {"ngram_vocab_size_base": 2_000_000, "num_hidden_layers": 4})
    table = [t for t in plan_tensors(cfg) if ".ngram_embedding.shard_" in t.key]
    assert len(table) == 512 and sum(t.numel for t in table) == 32_002_176 * 160
    assert table[0].shape == (62_505, 160) and table[-1].shape == (62_121, 160)
    assert math.isclose(sum(t.numel for t in table) * 2 / 1e9, 10.24, rel_tol=1e-3)

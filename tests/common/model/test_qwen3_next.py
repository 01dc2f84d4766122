"""qwen3_next beyond test_transformers_saved's parity: the release's config.json spellings, the settings the
runtime refuses, the Gated DeltaNet projections' split, and prompts past a delta-rule chunk prefilled in
chunks, against transformers in float32."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.model.errors import CheckpointError
from common.model.hf_config import parse_architecture
from common.model.qwen3_next import split_gdn_projections
from common.model.qwen4_exp.config import Qwen4ExpConfig
from common.model.synthetic.config import model_config
from common.model.synthetic.tokenizer import write_tokenizer

transformers = pytest.importorskip("transformers")

RELEASE = model_config("qwen3-next-80b", None, {})  # the release's config.json, legacy spellings
PATH = Path("config.json")


def _parse(hf: dict) -> Qwen4ExpConfig:
    cfg = parse_architecture(hf, PATH)[1]
    assert isinstance(cfg, Qwen4ExpConfig)
    return cfg


def test_the_release_config_and_transformers_own_spelling_parse_alike() -> None:
    """Top-level rope_theta / partial_rotary_factor / full_attention_interval, and what transformers 5
    writes for the same model (rope_parameters, layer_types, dtype), give one config."""
    cfg = _parse(RELEASE)
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",) + cfg.layer_types[4:]
    assert cfg.layer_types.count("full_attention") == 12 and cfg.mlp_types == ("moe",) * 48
    assert (cfg.rope.theta, cfg.rope.partial_rotary_factor, cfg.rope.mrope_section) == (1e7, 0.25, ())
    assert (cfg.num_experts, cfg.top_k, cfg.shared_expert_intermediate_size) == (512, 10, 512)
    assert not cfg.hyper_connections and cfg.hc_count == 1 and not cfg.ple_layer_ids
    assert cfg.moe_layers == tuple(range(48)) and cfg.checkpoint_mtp_layers == 0
    fields = {k: v for k, v in RELEASE.items() if k not in ("architectures", "model_type", "torch_dtype")}
    saved = transformers.Qwen3NextConfig(**fields).to_dict()
    assert "rope_parameters" in saved and "rope_theta" not in saved
    assert _parse({**saved, "eos_token_id": RELEASE["eos_token_id"]}) == cfg


def test_dense_layers_follow_mlp_only_layers_and_the_sparse_step() -> None:
    cfg = _parse({**RELEASE, "num_hidden_layers": 8, "mlp_only_layers": [0], "decoder_sparse_step": 2})
    assert cfg.mlp_types == ("dense", "moe", "dense", "moe", "dense", "moe", "dense", "moe")
    assert cfg.moe_layers == (1, 3, 5, 7)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"layer_types": ["sliding_attention"] * 48}, "sliding_attention"),
        ({"layer_types": ["linear_attention"] * 3}, "3 entries"),
        ({"linear_num_value_heads": 24, "linear_num_key_heads": 16}, "not a multiple"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
    ],
)
def test_what_the_runtime_cannot_run_is_named(override: dict, named: str) -> None:
    with pytest.raises(CheckpointError, match=named):
        parse_architecture({**RELEASE, **override}, PATH)


def test_split_gdn_projections_regroups_rows_and_passes_the_rest() -> None:
    """Key head g's rows (q, k, its value heads' v then z; b then a) go to the runtime's tensors in order;
    a tensor already split passes as it is; a misshapen one is named."""
    cfg = dataclasses.replace(
        _parse(RELEASE), hidden_size=2, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=1, linear_value_head_dim=1,
    )  # fmt: skip
    qkvz = torch.arange(12.0)[:, None].expand(12, 2)  # key head 0: q k v v z z, then key head 1's
    ba = torch.arange(8.0)[:, None].expand(8, 2)  # b b a a, b b a a
    p = "model.layers.0.linear_attn"
    source = [
        (PATH, f"{p}.in_proj_qkvz.weight", lambda: qkvz),
        (PATH, f"{p}.in_proj_ba.weight", lambda: ba),
        (PATH, f"{p}.out_proj.weight", lambda: torch.full((2, 4), -1.0)),
    ]
    got = [(key, read()[:, 0].tolist()) for _, key, read in split_gdn_projections(source, cfg)]
    assert got == [
        (f"{p}.in_proj_qkv.weight", [0, 6, 1, 7, 2, 3, 8, 9]),
        (f"{p}.in_proj_z.weight", [4, 5, 10, 11]),
        (f"{p}.in_proj_b.weight", [0, 1, 4, 5]),
        (f"{p}.in_proj_a.weight", [2, 3, 6, 7]),
        (f"{p}.out_proj.weight", [-1, -1]),
    ]
    bad = [(PATH, f"{p}.in_proj_ba.weight", functools.partial(torch.zeros, 6, 2))]
    with pytest.raises(CheckpointError, match=r"expected \[8, 2\].*in_proj_ba"):
        next(iter(split_gdn_projections(bad, cfg)))[2]()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """4 layers in the release's pattern (3 linear, 1 full), written by transformers' save_pretrained."""
    torch.manual_seed(1)
    config = transformers.Qwen3NextConfig(
        vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, max_position_embeddings=256,
    )  # fmt: skip
    config._attn_implementation = "eager"
    hf = transformers.Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p).mul_(0.1 if p.dim() > 1 else 1.0).bfloat16())
    out = tmp_path_factory.mktemp("qwen3_next")
    hf.save_pretrained(out)
    write_tokenizer(out, vocab_size=256, vision=False)
    return out, hf


@torch.inference_mode()
def test_chunked_prefill_past_a_delta_rule_chunk(saved, matches_transformers) -> None:
    """Prompts of 70 and 5 tokens prefilled 24 tokens a pass (the delta rule's state carried across passes
    and past its 64-token chunk), then decode: transformers' logits."""
    model_dir, hf = saved
    runner = Engine(WorkerConfig(str(model_dir), max_running=2, max_context=128, dtype="float32")).runner
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (70, 5)]
    seqs = [runner.new_sequence() for _ in prompts]
    per_seq: list[list[torch.Tensor]] = [[] for _ in prompts]
    for start in range(0, 70, 24):
        live = [b for b, p in enumerate(prompts) if start < len(p)]
        out = runner.forward([seqs[b] for b in live], [prompts[b][start : start + 24] for b in live], True)
        for b, part in zip(live, out.split([len(prompts[b][start : start + 24]) for b in live]), strict=True):
            per_seq[b].append(part)
    ours = torch.cat([torch.cat(p) for p in per_seq])
    matches_transformers(runner, hf, seqs, prompts, ours, 4, 1e-4)

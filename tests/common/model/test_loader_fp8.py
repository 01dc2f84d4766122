"""Hugging Face FP8 checkpoints (a linear's `weight` in float8_e4m3fn plus a `weight_scale_inv` per 128×128
block): Spillway loads them dequantized, exactly fp8 · scale_inv in float32, wherever the scale is stored,
matches transformers' own loading of the same checkpoint, generates with experts resident or offloaded, and
names the file and key of a weight without its scale, a scale without its weight, or a misfit scale.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.model.errors import CheckpointError
from common.model.fp8_blocks import FP8_BLOCK
from common.model.hf_config import load_architecture
from common.model.loader import dequantized_fp8_source, load_model
from common.model.registry import ExpertKey
from common.model.resident import ResidentExperts
from common.model.synthetic.checkpoint import make_model
from common.protocol import SamplingParams

INDEX = "model.safetensors.index.json"
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
REL_TOL = 1e-4
# Ragged dims (> 128, not multiples of it): the dense MLP's and experts' scale grids end in partial blocks.
RAGGED = {"intermediate_size": 200, "moe_intermediate_size": 160}
CASES = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe-ragged": ("qwen3_moe", RAGGED),
    "qwen2_moe": ("qwen2_moe", {}),  # shared expert, router gates left unquantized
    "mixtral": ("mixtral", {}),  # experts named w1/w2/w3
}


def _make(root: Path, arch: str = "qwen3_moe", overrides: dict | None = None) -> Path:
    return make_model(root, preset="tiny", arch=arch, overrides=overrides, seed=3, quantize="fp8")


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory) -> Path:
    return _make(tmp_path_factory.mktemp("fp8"))


@pytest.fixture(scope="module", params=list(CASES))
def any_fp8_dir(request, tmp_path_factory) -> Path:
    arch, overrides = CASES[request.param]
    return _make(tmp_path_factory.mktemp(request.param), arch, overrides)


@pytest.fixture
def ckpt(fp8_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "model"
    shutil.copytree(fp8_dir, out)
    return out


def _tensors(model_dir: Path) -> dict[str, tuple[Path, torch.Tensor]]:
    """Every tensor of the checkpoint with its file."""
    return {k: (f, t) for f in sorted(model_dir.glob("*.safetensors")) for k, t in load_file(f).items()}


def _reference(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """fp8 · scale_inv of its 128×128 block (edge blocks partial) in float32, written independently of the
    loader's helper."""
    out, inp = weight.shape
    scale = scale_inv.repeat_interleave(FP8_BLOCK, 0)[:out].repeat_interleave(FP8_BLOCK, 1)[:, :inp]
    return weight.float() * scale


def _dequantized(model_dir: Path) -> dict[str, torch.Tensor]:
    """The checkpoint as the loader should see it: each fp8 weight dequantized, the scales gone."""
    tensors = {k: t for k, (_, t) in _tensors(model_dir).items()}
    out = {}
    for key, tensor in tensors.items():
        if key.endswith("_scale_inv"):
            continue
        scale = tensors.get(f"{key}_scale_inv")
        out[key] = tensor if scale is None else _reference(tensor, scale)
    return out


def _loaded(model: torch.nn.Module, model_dir: Path, key: str) -> torch.Tensor:
    """What `model` holds for checkpoint key `key` (a parameter, or one expert's gate, up or down)."""
    arch, cfg = load_architecture(model_dir)
    target = arch.map_key(key, cfg)
    if not isinstance(target, ExpertKey):
        return dict(model.named_parameters())[target]
    assert isinstance(model.experts, ResidentExperts)
    weights = model.experts.weights[target.layer]
    if target.part == "down":
        return weights.down[target.expert]
    gate, up = weights.gate_up[target.expert].chunk(2)
    return gate if target.part == "gate" else up


def _assert_loads_reference(model_dir: Path, dtype: torch.dtype = torch.float32) -> None:
    model = load_model(model_dir, dtype=dtype)
    for key, ref in _dequantized(model_dir).items():
        assert torch.equal(_loaded(model, model_dir, key), ref.to(dtype)), key


def _shard_of(model_dir: Path, key: str) -> Path:
    return model_dir / json.loads((model_dir / INDEX).read_text())["weight_map"][key]


def _rewrite(shard: Path, edit) -> None:
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})


# --- the synthetic FP8 checkpoint --------------------------------------------------------------------------


def test_synthetic_fp8_layout(fp8_dir: Path) -> None:
    """Linear weights in fp8 with fp32 block scales; embedding, head, routers and norms as before."""
    config = json.loads((fp8_dir / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["quant_method"] == "fp8" and quant["weight_block_size"] == [128, 128]
    unconverted = set(quant["modules_to_not_convert"])
    assert {"lm_head", "model.embed_tokens", "model.layers.0.mlp.gate"} <= unconverted
    tensors = {k: t for k, (_, t) in _tensors(fp8_dir).items()}
    weight_map = json.loads((fp8_dir / INDEX).read_text())["weight_map"]
    assert set(weight_map) == set(tensors)
    for key in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.3.down_proj.weight"):
        assert tensors[key].dtype == torch.float8_e4m3fn
        assert tensors[f"{key}_scale_inv"].dtype == torch.float32
    for key in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.0.mlp.gate.weight"):
        assert tensors[key].dtype == torch.bfloat16 and f"{key}_scale_inv" not in tensors


def test_ragged_scale_grid(tmp_path: Path) -> None:
    """Dims that are not multiples of 128 get ceil(dim/128) blocks, the last one partial."""
    tensors = {k: t for k, (_, t) in _tensors(_make(tmp_path, overrides=RAGGED)).items()}
    assert tensors["model.layers.1.mlp.down_proj.weight_scale_inv"].shape == (1, 2)  # [64, 200]
    assert tensors["model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv"].shape == (2, 1)  # [160, 64]


def test_an_unknown_quantization_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="quantize='int3'"):
        make_model(tmp_path, preset="tiny", arch="qwen4_exp", quantize="int3")


# --- loading -----------------------------------------------------------------------------------------------


def test_weights_equal_dequantized_reference(any_fp8_dir: Path) -> None:
    _assert_loads_reference(any_fp8_dir)


def test_bfloat16_rounds_the_float32_product_once(fp8_dir: Path) -> None:
    _assert_loads_reference(fp8_dir, torch.bfloat16)


def test_readers_are_gathered_not_read() -> None:
    """The wrapper reads nothing itself; a pair is read when its reader is called, the scale dropped."""
    reads: list[str] = []
    weight, scale_inv = torch.randn(4, 3).to(torch.float8_e4m3fn), torch.tensor([[0.5]])
    stored = {"a.weight": weight, "b.weight": torch.ones(2), "a.weight_scale_inv": scale_inv}

    def reader(key: str):
        return lambda: reads.append(key) or stored[key]

    source = [(Path(f"{k}.safetensors"), k, reader(k)) for k in stored]
    entries = list(dequantized_fp8_source(source))
    assert reads == [] and [key for _, key, _ in entries] == ["a.weight", "b.weight"]
    assert torch.equal(entries[0][2](), weight.float() * 0.5)
    assert sorted(reads) == ["a.weight", "a.weight_scale_inv"]


@pytest.mark.parametrize("scales_first", [True, False])
def test_scales_in_another_shard(ckpt: Path, scales_first: bool) -> None:
    """Every scale moved to a shard of its own, read before or after the weights' shards."""
    index = json.loads((ckpt / INDEX).read_text())
    scales = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors = load_file(ckpt / name)
        scales.update({k: tensors.pop(k) for k in list(tensors) if k.endswith("_scale_inv")})
        save_file(tensors, ckpt / name, metadata={"format": "pt"})
    save_file(scales, ckpt / "model-scales.safetensors", metadata={"format": "pt"})
    weights = {k: v for k, v in index["weight_map"].items() if k not in scales}
    moved = dict.fromkeys(scales, "model-scales.safetensors")
    index["weight_map"] = {**moved, **weights} if scales_first else {**weights, **moved}
    (ckpt / INDEX).write_text(json.dumps(index))  # insertion order: the order the loader opens the files
    _assert_loads_reference(ckpt)


def test_weight_scale_naming(ckpt: Path) -> None:
    """`weight_scale` (the non-inverse name some exporters use for the same multiplier) loads the same."""
    reference = _dequantized(ckpt)

    def rename(tensors: dict) -> None:
        tensors.update({k.removesuffix("_inv"): tensors.pop(k) for k in list(tensors) if k.endswith("_inv")})

    for shard in ckpt.glob("*.safetensors"):
        _rewrite(shard, rename)
    model = load_model(ckpt, dtype=torch.float32)
    for key in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.3.down_proj.weight"):
        assert torch.equal(_loaded(model, ckpt, key), reference[key])


# --- against transformers, and generation ------------------------------------------------------------------


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 17, 11)]


@torch.inference_mode()
def _assert_matches(transformers, hf_dir: Path, fp8_dir: Path, matches_transformers, **hf_kwargs) -> None:
    """transformers on `hf_dir` against Spillway on `fp8_dir` (float32): prefill, then 8 decode steps."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager", **hf_kwargs
    ).eval()
    engine = Engine(WorkerConfig(str(fp8_dir), max_running=3, max_context=64))
    prompts = _prompts(engine.config.vocab_size)
    seqs = [engine.runner.new_sequence() for _ in prompts]
    prefill = engine.runner.forward(seqs, prompts, all_logits=True)  # [T, V], sequence by sequence
    matches_transformers(engine.runner, hf, seqs, prompts, prefill, 8, REL_TOL)


def test_logits_match_transformers_fp8_loading(fp8_dir: Path, matches_transformers) -> None:
    """transformers dequantizes the FP8 checkpoint as it loads it (FineGrainedFP8, dequantize=True, asked for:
    it chooses so by itself only where no GPU is seen; with one it would want its `kernels` package's fp8
    GEMM); its loading needs accelerate."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers loads FP8 checkpoints only with accelerate")
    block = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]["weight_block_size"]
    quant = transformers.FineGrainedFP8Config(weight_block_size=tuple(block), dequantize=True)
    _assert_matches(transformers, fp8_dir, fp8_dir, matches_transformers, quantization_config=quant)


@pytest.fixture(scope="module")
def dequantized_dir(fp8_dir: Path, tmp_path_factory) -> Path:
    """The FP8 checkpoint's reference weights as a plain float32 checkpoint (no scales, no quantization)."""
    out = tmp_path_factory.mktemp("dequantized")
    for f in fp8_dir.iterdir():
        if f.suffix != ".safetensors" and f.name != INDEX:
            shutil.copy(f, out / f.name)
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    save_file(_dequantized(fp8_dir), out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_logits_match_transformers_on_the_reference(
    fp8_dir: Path, dequantized_dir: Path, matches_transformers
) -> None:
    """Without accelerate: transformers on the plain reference checkpoint against Spillway on the FP8 one."""
    transformers = pytest.importorskip("transformers")
    _assert_matches(transformers, dequantized_dir, fp8_dir, matches_transformers)


@pytest.mark.parametrize("expert_cache", [None, "0.5"])
def test_greedy_generation(fp8_dir: Path, dequantized_dir: Path, expert_cache: str | None) -> None:
    """End to end through the Engine, experts resident or served from host memory through a cache of half
    of them: the same tokens as the plain reference checkpoint."""
    prompts = _prompts(1000)
    ours = Engine(WorkerConfig(str(fp8_dir), max_running=2, expert_cache=expert_cache)).generate(
        prompts, GREEDY
    )
    ref = Engine(WorkerConfig(str(dequantized_dir), max_running=2)).generate(prompts, GREEDY)
    assert [r.token_ids for r in ours] == [r.token_ids for r in ref]
    assert all(len(r.token_ids) == GREEDY.max_tokens for r in ours)


# --- errors name the file and the key ----------------------------------------------------------------------

DENSE, EXPERT = "model.layers.0.self_attn.q_proj.weight", "model.layers.2.mlp.experts.5.up_proj.weight"


@pytest.mark.parametrize("key", [DENSE, EXPERT])
def test_fp8_weight_without_scale(ckpt: Path, key: str) -> None:
    shard = _shard_of(ckpt, key)
    _rewrite(shard, lambda t: t.pop(f"{key}_scale_inv"))
    with pytest.raises(CheckpointError, match="without its weight_scale_inv") as err:
        load_model(ckpt)
    assert err.value.path == shard and err.value.key == key


@pytest.mark.parametrize("key", [DENSE, EXPERT])
def test_scale_without_weight(ckpt: Path, key: str) -> None:
    shard = _shard_of(ckpt, key)
    _rewrite(shard, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="block scale without its weight") as err:
        load_model(ckpt)
    assert err.value.path == shard and err.value.key == f"{key}_scale_inv"


@pytest.mark.parametrize("key", [DENSE, EXPERT])
def test_scale_of_the_wrong_shape(ckpt: Path, key: str) -> None:
    shard = _shard_of(ckpt, key)
    _rewrite(shard, lambda t: t.update({f"{key}_scale_inv": torch.ones(2, 2)}))
    with pytest.raises(CheckpointError, match="does not fit") as err:
        load_model(ckpt)
    assert err.value.path == shard and err.value.key == f"{key}_scale_inv"


def test_non_square_block_size(ckpt: Path) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [128, 64]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="weight_block_size") as err:
        load_model(ckpt)
    assert err.value.path == ckpt / "config.json"


def test_files_stay_readable_while_gathered(fp8_dir: Path) -> None:
    """safetensors_source's readers outlive the file they came from being passed (needed for pairing)."""
    from common.model.loader import safetensors_source

    entries = list(safetensors_source(fp8_dir))
    path, key, read = entries[0]
    with safe_open(str(path), framework="pt", device="cpu") as f:
        assert torch.equal(read(), f.get_tensor(key))


def test_convert_reads_an_fp8_checkpoint_through_its_scales(tmp_path):
    """`spillway convert` of an FP8 checkpoint packs the dequantized experts (not the raw fp8 codes)."""
    from common.experts.artifact import convert

    src = make_model(tmp_path / "fp8", preset="tiny", arch="qwen3_moe", quantize="fp8")
    meta = convert(src, tmp_path / "art", "bf16", log=lambda _: None)
    assert 0 < meta["quantization_error"]["gate_up"] < 0.01
    prompts = [[5, 6, 7, 8], [40, 41]]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ref = [r.token_ids for r in Engine(WorkerConfig(str(src))).generate(prompts, greedy)]
    out = [r.token_ids for r in Engine(WorkerConfig(str(tmp_path / "art"))).generate(prompts, greedy)]
    assert out == ref

"""`spillway convert`: resident weights plus packed experts, loaded by mapping instead of re-quantising."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.experts.artifact import EXPERTS_FILE, META_FILE, convert
from common.experts.formats import get_format
from common.model.errors import CheckpointError
from common.model.synthetic.checkpoint import make_model
from common.protocol import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
WIDE = {"hidden_size": 128, "moe_intermediate_size": 128, "intermediate_size": 128}  # int4 groups of 128


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("src"), preset="tiny", arch="qwen3_moe", overrides=WIDE)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (6, 21)]


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int4"])
def test_artifact_equals_in_process_quantisation(source, prompts, fmt, tmp_path):
    meta = convert(source, tmp_path / fmt, fmt, log=lambda _: None)
    assert meta["quantization_error"]["gate_up"] <= get_format(fmt).error_bound()
    assert (tmp_path / fmt / EXPERTS_FILE).stat().st_size == meta["nbytes"]
    index = json.loads((tmp_path / fmt / "model.safetensors.index.json").read_text())
    assert not any(".experts." in key for key in index["weight_map"])  # experts live only in experts.bin
    mapped = Engine(WorkerConfig(str(tmp_path / fmt), expert_cache="0.25")).generate(prompts, GREEDY)
    packed_now = Engine(WorkerConfig(str(source), expert_cache="all", expert_format=fmt)).generate(
        prompts, GREEDY
    )
    assert [r.token_ids for r in mapped] == [r.token_ids for r in packed_now]
    if fmt == "bf16":  # lossless: the same tokens as the original checkpoint
        original = Engine(WorkerConfig(str(source))).generate(prompts, GREEDY)
        assert [r.token_ids for r in mapped] == [r.token_ids for r in original]


def test_truncated_expert_file_is_an_error(source, tmp_path):
    convert(source, tmp_path / "a", "bf16", log=lambda _: None)
    path = tmp_path / "a" / EXPERTS_FILE
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises((CheckpointError, ValueError), match="bytes"):
        Engine(WorkerConfig(str(tmp_path / "a")))


def test_convert_qwen4_exp(tmp_path):
    """A qwen4_exp checkpoint (hybrid layers, PLE table kept among the resident tensors) converts."""
    src = make_model(
        tmp_path / "q4",
        preset="tiny",
        arch="qwen4_exp",
        overrides={"indexer_n_heads": 16, "mtp_num_hidden_layers": 0},
    )
    meta = convert(src, tmp_path / "out", "bf16", log=lambda _: None)
    assert meta["moe_layers"] == [0, 1, 2, 3]
    assert json.loads((tmp_path / "out" / META_FILE).read_text())["format"] == "bf16"


def _shard_of(model_dir: Path, key: str) -> Path:
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    return model_dir / index["weight_map"][key]


def test_convert_never_overwrites(source, tmp_path):
    victim = make_model(tmp_path / "victim", preset="tiny", arch="qwen3_moe", overrides=WIDE)
    before = {p.name: p.read_bytes() for p in victim.iterdir()}
    with pytest.raises(ValueError, match="not empty"):
        convert(source, victim, "bf16", log=lambda _: None)
    with pytest.raises(ValueError, match="is the source"):
        convert(source, source, "bf16", log=lambda _: None)
    assert {p.name: p.read_bytes() for p in victim.iterdir()} == before
    (tmp_path / "empty").mkdir()
    convert(source, tmp_path / "empty", "bf16", log=lambda _: None)  # an empty directory is taken
    assert (tmp_path / "empty" / META_FILE).is_file()


@pytest.mark.parametrize(
    "key", ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.3.up_proj.weight"]
)
def test_a_bad_tensor_fails_the_conversion_and_leaves_nothing(source, tmp_path, key):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    src.mkdir()
    for f in source.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    shard = _shard_of(src, key)
    tensors = load_file(shard)
    tensors[key] = tensors[key][:-1].clone()
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="shape") as err:
        convert(src, tmp_path / "out", "bf16", log=lambda _: None)
    assert err.value.path == shard and err.value.key == key  # the source's file and key
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no artifact, no partial one


def test_a_format_the_sizes_cannot_take_is_refused_before_writing(tmp_path):
    narrow = make_model(tmp_path / "narrow", preset="tiny", arch="qwen3_moe")  # 64 wide: int4 needs 128
    with pytest.raises(ValueError, match="128"):
        convert(narrow, tmp_path / "out", "int4", log=lambda _: None)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda meta: meta.pop("components"), "components"),
        (lambda meta: meta["components"]["gate_up"].__setitem__(1, "float64"), "components"),
    ],
)
def test_a_malformed_artifact_names_its_metadata(source, tmp_path, edit, message):
    convert(source, tmp_path / "a", "bf16", log=lambda _: None)
    path = tmp_path / "a" / META_FILE
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=message) as err:
        Engine(WorkerConfig(str(tmp_path / "a")))
    assert err.value.path == path


def test_a_missing_expert_file_is_named(source, tmp_path):
    convert(source, tmp_path / "a", "bf16", log=lambda _: None)
    (tmp_path / "a" / EXPERTS_FILE).unlink()
    with pytest.raises(CheckpointError, match="not found") as err:
        Engine(WorkerConfig(str(tmp_path / "a")))
    assert err.value.path == tmp_path / "a" / EXPERTS_FILE


@pytest.mark.parametrize(
    ("quantize", "fmt"), [("nvfp4", "nvfp4"), ("gptq", "gptq-g32"), ("w4a16", "ct-w4a16-g32")]
)
def test_a_published_format_repacked_into_itself_keeps_its_bits(quantize, fmt, prompts, tmp_path):
    """No error added; the artifact's expert bytes are the checkpoint's; the same greedy tokens."""
    src = make_model(tmp_path / "src", preset="tiny", seed=3, quantize=quantize)
    meta = convert(src, tmp_path / "a", fmt, log=lambda _: None)
    assert meta["format"] == fmt and meta["quantization_error"] == {"gate_up": 0.0, "down": 0.0}
    assert (tmp_path / "a" / EXPERTS_FILE).stat().st_size == meta["nbytes"]
    from_artifact = Engine(WorkerConfig(str(tmp_path / "a"), expert_cache="0.5")).generate(prompts, GREEDY)
    from_checkpoint = Engine(WorkerConfig(str(src))).generate(prompts, GREEDY)
    assert [r.token_ids for r in from_artifact] == [r.token_ids for r in from_checkpoint]


@pytest.mark.parametrize(("quantize", "fmt"), [("gptq", "mxfp4"), ("awq", "bf16"), (None, "nvfp4")])
def test_converting_between_formats_prints_the_error_it_adds(quantize, fmt, prompts, tmp_path):
    """The experts dequantised from the source's format, packed in another; the relative error printed is
    the packing's against that source (bf16 holds int4 codes times fp16 scales nearly exactly)."""
    src = make_model(tmp_path / "src", preset="tiny", seed=3, quantize=quantize)
    lines: list[str] = []
    meta = convert(src, tmp_path / "a", fmt, log=lines.append)
    err = meta["quantization_error"]
    assert 0.0 < err["gate_up"] <= get_format(fmt).error_bound() and err["down"] > 0.0
    assert f"gate_up {err['gate_up']:.3%}" in lines[-1]
    mapped = Engine(WorkerConfig(str(tmp_path / "a"), expert_cache="0.5")).generate(prompts, GREEDY)
    resident = Engine(WorkerConfig(str(tmp_path / "a"))).generate(prompts, GREEDY)
    assert [r.token_ids for r in mapped] == [r.token_ids for r in resident]

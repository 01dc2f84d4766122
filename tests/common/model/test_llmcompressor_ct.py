"""Checkpoints llm-compressor itself writes (`oneshot` with a QuantizationModifier, round to nearest, on a
tiny qwen3_moe whose dims fit group 128): `make-model --quantize w4a16` writes the same config and the same
bytes from the same weights, and each scheme loads with its experts and linears dequantised bit for bit
as compressed-tensors dequantises them, generating greedily what transformers generates on those weights.

llm-compressor pins its own transformers, so it is no test dependency: these run where it is installed
(e.g. a virtual environment with the system's packages beside it).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.model.ct_blocks import ct_nvfp4_global_scale, quantize_ct_nvfp4
from common.model.loader import check_checkpoint, load_model
from common.model.synthetic.checkpoint import make_model
from common.protocol import SamplingParams
from tests.common.model.test_ct_blocks import nvfp4_reference, w4a16_reference

pytestmark = pytest.mark.slow
llmcompressor = pytest.importorskip("llmcompressor")
transformers = pytest.importorskip("transformers")
from compressed_tensors.compressors import FloatQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402

DIMS = {"hidden_size": 128, "moe_intermediate_size": 128, "intermediate_size": 128}  # every input dim 128
SCHEMES = {
    "W4A16": "w4a16",
    "W4A16_ASYM": "w4a16-asym",
    "NVFP4A16": "nvfp4a16",
    "NVFP4": None,
    "FP8_BLOCK": None,
}
EXPERT_FORMATS = {"W4A16": "ct-w4a16", "W4A16_ASYM": "ct-w4a16-asym", "NVFP4A16": "ct-nvfp4a16"}
EXPERT_FORMATS["NVFP4"] = "ct-nvfp4"
PROMPTS = [[5, 17, 99, 3, 42], [7, 8, 9, 10, 11, 12, 13, 14, 200, 31, 4]]


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    return {k: t for f in sorted(model_dir.glob("*.safetensors")) for k, t in load_file(f).items()}


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("bf16"), preset="tiny", seed=3, overrides=DIMS)


@pytest.fixture(scope="module", params=list(SCHEMES))
def llmc(request, bf16_dir: Path, tmp_path_factory) -> tuple[str, Path]:
    """`bf16_dir` quantized by llm-compressor's oneshot (NVFP4's activation scales from a few random token
    sequences), with the synthetic tokenizer beside it."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    out = tmp_path_factory.mktemp(request.param.lower()) / "model"
    model = transformers.AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16)
    recipe = QuantizationModifier(
        targets="Linear", scheme=request.param, ignore=["lm_head", "re:.*mlp.gate$"]
    )
    data = {}
    if request.param == "NVFP4":
        ids = torch.randint(0, 1000, (8, 16), generator=torch.Generator().manual_seed(1)).tolist()
        dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * 16] * 8})
        data = {"dataset": dataset, "num_calibration_samples": 8, "max_seq_length": 16}
    oneshot(model=model, recipe=recipe, output_dir=str(out), **data)
    for f in bf16_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return request.param, out


def _ref_linear(t: dict[str, torch.Tensor], module: str) -> torch.Tensor | None:
    """compressed-tensors' dequantisation (fp32) of a quantized linear, else None."""
    m = f"{module}.weight"
    if m + "_global_scale" in t:
        return nvfp4_reference(t[m + "_packed"], t[m + "_scale"], t[m + "_global_scale"])
    if m + "_packed" in t:
        shape = tuple(t[m + "_shape"].tolist())
        return w4a16_reference(t[m + "_packed"], t[m + "_scale"].float(), t.get(m + "_zero_point"), shape)
    if m + "_scale" in t:
        args = QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=[128, 128])
        state = {"weight": t[m], "weight_scale": t[m + "_scale"].float()}
        return FloatQuantizationCompressor.decompress(
            state, QuantizationScheme(targets=["Linear"], weights=args)
        )["weight"]
    return None


def test_loads_bit_for_bit(llmc: tuple[str, Path]) -> None:
    scheme, llmc_dir = llmc
    check_checkpoint(llmc_dir)
    model = load_model(llmc_dir, dtype=torch.float32)
    cfg = model.config
    t = _tensors(llmc_dir)
    for layer in cfg.moe_layers:
        prefix = f"model.layers.{layer}.mlp.experts"
        gate_up = torch.stack(
            [
                torch.cat(
                    [_ref_linear(t, f"{prefix}.{e}.gate_proj"), _ref_linear(t, f"{prefix}.{e}.up_proj")]
                )
                for e in range(cfg.num_experts)
            ]
        )
        down = torch.stack([_ref_linear(t, f"{prefix}.{e}.down_proj") for e in range(cfg.num_experts)])
        assert torch.equal(model.experts.weights[layer].gate_up, gate_up)
        assert torch.equal(model.experts.weights[layer].down, down)
    published = model.experts.published
    assert (published[0] if published else None) == EXPERT_FORMATS.get(scheme)
    params = dict(model.named_parameters())
    q_proj = next(v for k, v in params.items() if k.endswith("layers.0.self_attn.q_proj.weight"))
    assert torch.equal(q_proj.detach(), _ref_linear(t, "model.layers.0.self_attn.q_proj"))


@torch.inference_mode()
def test_greedy_matches_transformers(llmc: tuple[str, Path], tmp_path: Path) -> None:
    llmc_dir = llmc[1]
    t = _tensors(llmc_dir)
    plain = {}
    for key, tensor in t.items():
        module, _, name = key.rpartition(".")
        w = _ref_linear(t, module) if name in ("weight", "weight_packed") else None
        if w is not None:
            plain[f"{module}.weight"] = w
        elif name == "weight":
            plain[key] = tensor.float()
    save_file(plain, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((llmc_dir / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    hf.generation_config.eos_token_id = None
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ours = Engine(WorkerConfig(str(llmc_dir), max_running=2, max_context=64, dtype="float32")).generate(
        PROMPTS, params
    )
    for prompt, result in zip(PROMPTS, ours, strict=True):
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, pad_token_id=0)
        assert result.token_ids == ref[0, len(prompt) :].tolist()


def test_make_model_writes_what_llm_compressor_writes(llmc: tuple[str, Path], tmp_path: Path) -> None:
    """The same weights give the same quantization_config (but its version) and the same tensors (NVFP4
    with activation scales, which needs calibration: the same weight tensors)."""
    scheme, llmc_dir = llmc
    theirs = _tensors(llmc_dir)
    if SCHEMES[scheme] is None:  # no writer: the NVFP4 math against llm-compressor's bytes
        if scheme != "NVFP4":
            pytest.skip("no FP8 block writer")
        plain = _tensors(make_model(tmp_path, preset="tiny", seed=3, overrides=DIMS))
        for key in [k for k in theirs if k.endswith(".weight_packed")]:
            module = key.removesuffix(".weight_packed")
            parent, name = module.rsplit(".", 1)
            fused = {"gate_proj": "gate_proj up_proj", "up_proj": "gate_proj up_proj"}.get(name, name)
            fused = {"q_proj": "q_proj k_proj v_proj", "k_proj": "q_proj k_proj v_proj"}.get(name, fused)
            fused = {"v_proj": "q_proj k_proj v_proj"}.get(name, fused)
            amax = torch.stack([plain[f"{parent}.{n}.weight"].abs().amax() for n in fused.split()]).amax()
            packed, scale, glob = quantize_ct_nvfp4(plain[f"{module}.weight"], ct_nvfp4_global_scale(amax))
            assert torch.equal(packed, theirs[key]) and torch.equal(
                glob, theirs[f"{module}.weight_global_scale"]
            )
            assert torch.equal(scale.view(torch.uint8), theirs[f"{module}.weight_scale"].view(torch.uint8))
        return
    ours_dir = make_model(tmp_path, preset="tiny", seed=3, overrides=DIMS, quantize=SCHEMES[scheme])
    ours = _tensors(ours_dir)
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), [
        k for k in ours if not torch.equal(ours[k], theirs[k])
    ]
    q_ours = json.loads((ours_dir / "config.json").read_text())["quantization_config"]
    q_theirs = json.loads((llmc_dir / "config.json").read_text())["quantization_config"]
    assert {**q_ours, "version": None} == {**q_theirs, "version": None}

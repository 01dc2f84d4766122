"""qwen4_exp's vision tower against transformers' Qwen4ExpVisionModel: the same weights, the same tokens."""

from __future__ import annotations

import pytest
import torch

from common.model.errors import CheckpointError
from common.model.qwen4_exp.vision import VisionConfig, VisionTower, load_vision_tower
from common.model.synthetic.checkpoint import make_model

transformers_qwen4 = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpVisionConfig  # noqa: E402

SHAPE = {
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_heads": 4,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 48,
    "num_position_embeddings": 36,
}


def _pair(**overrides) -> tuple[torch.nn.Module, VisionTower]:
    torch.manual_seed(0)
    hf_config = Qwen4ExpVisionConfig(**{**SHAPE, **overrides})
    hf = transformers_qwen4.Qwen4ExpVisionModel(hf_config).eval()
    with torch.no_grad():  # the HF init leaves some tensors at exact constants: make every one count
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ours = VisionTower(VisionConfig.from_hf(hf_config.to_dict())).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours


@pytest.mark.parametrize(
    "grids",
    [
        [(1, 4, 6)],  # one image, a grid wider than tall, larger than the 6 x 6 position table
        [(1, 2, 2), (1, 8, 4), (2, 2, 4)],  # several images, and a two-frame clip
    ],
)
def test_tokens_match_transformers(grids: list[tuple[int, int, int]]) -> None:
    hf, ours = _pair()
    patches = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 4 * 4)
    with torch.no_grad():
        want = hf(patches, grid_thw=torch.tensor(grids)).pooler_output
        got = ours(patches, grids)
    assert got.shape == (sum(t * h * w for t, h, w in grids) // 4, 48)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_the_config_reads_config_json() -> None:
    cfg = VisionConfig.from_hf({**SHAPE, "rope_parameters": {"rope_type": "axial", "rope_theta": 500.0}})
    assert (cfg.depth, cfg.head_dim, cfg.rope_theta) == (2, 16, 500.0)


def test_a_grid_that_does_not_merge_is_refused() -> None:
    _, ours = _pair()
    with pytest.raises(ValueError, match="3 x 4 is not a multiple of the merge size 2"):
        ours(torch.randn(12, 96), [(1, 3, 4)])


def test_a_synthetic_checkpoints_tower_loads_as_transformers_loads_it(tmp_path) -> None:
    """make_model writes the tower under model.visual.; transformers and load_vision_tower read the same."""
    path = make_model(tmp_path / "q4", "tiny", "qwen4_exp", {"torch_dtype": "float32"})
    hf = transformers_qwen4.Qwen4ExpForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    ours = load_vision_tower(path)
    grids = [(1, 4, 6), (1, 2, 2)]
    patches = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 16 * 16)
    with torch.no_grad():
        want = hf.model.visual(patches, grid_thw=torch.tensor(grids)).pooler_output
        got = ours(patches, grids)
    assert got.shape == (7, 64)  # the text model's width
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_bad_tower_tensor_is_named(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    path = make_model(tmp_path / "q4", "tiny", "qwen4_exp", {"torch_dtype": "float32"})
    key = "model.visual.blocks.0.attn.qkv.weight"
    (shard,) = [f for f in sorted(path.glob("*.safetensors")) if key in load_file(f)]
    tensors = load_file(shard)
    tensors[key] = tensors[key][:-1]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"shape \[95, 32\].*{shard.name}.*{key}"):
        load_vision_tower(path)
    del tensors[key]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"missing.*{key}"):
        load_vision_tower(path)

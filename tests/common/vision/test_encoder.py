"""The encoder's core against transformers: its processor's patches into Qwen4ExpForConditionalGeneration's
get_image_features, and ours from the same images."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.model.synthetic.checkpoint import make_model
from common.vision.encoder import ImageEncoder

Image = pytest.importorskip("PIL.Image")
modeling = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
hf_pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")


def test_embeddings_match_transformers(tmp_path) -> None:
    model = make_model(tmp_path / "q4", "tiny", "qwen4_exp", {"torch_dtype": "float32"})
    rng = np.random.default_rng(3)
    images = [
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((50, 90), (64, 64))
    ]
    encoder = ImageEncoder(model)
    got = encoder.encode(images)

    proc = encoder.processing
    theirs = hf_pil.Qwen2VLImageProcessorPil(
        patch_size=proc.patch_size, merge_size=proc.merge_size, temporal_patch_size=proc.temporal_patch_size,
        min_pixels=proc.min_pixels, max_pixels=proc.max_pixels,
    )  # fmt: skip
    batch = theirs(images=images, return_tensors="pt")
    hf = modeling.Qwen4ExpForConditionalGeneration.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output
    assert [e.grid for e in got] == [tuple(g) for g in batch["image_grid_thw"].tolist()]
    for mine, ref in zip(got, want, strict=True):
        assert mine.embeddings.shape == ref.shape == (encoder.tokens(mine.grid), 64)
        torch.testing.assert_close(mine.embeddings, ref, rtol=1e-4, atol=1e-5)
    assert encoder.encode([]) == []

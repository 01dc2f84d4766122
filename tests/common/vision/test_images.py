"""common/vision/images.py against transformers' Qwen2-VL image processor (PIL): the same patches and
grids."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch

from common.vision.images import ImageProcessing, decode_data_url, image_patches, smart_resize

Image = pytest.importorskip("PIL.Image")
hf_pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")


def _image(h: int, w: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


@pytest.mark.parametrize(("h", "w"), [(64, 96), (37, 211), (300, 40), (20, 20)])
def test_patches_match_transformers(h: int, w: int) -> None:
    proc = ImageProcessing(patch_size=8, merge_size=2, min_pixels=32 * 32, max_pixels=96 * 96)
    theirs = hf_pil.Qwen2VLImageProcessorPil(
        patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32, max_pixels=96 * 96
    )
    image = _image(h, w)
    want = theirs(images=[image], return_tensors="pt")
    got, grid = image_patches(image, proc)
    assert [list(grid)] == want["image_grid_thw"].tolist()
    torch.testing.assert_close(got, want["pixel_values"].float(), rtol=1e-5, atol=1e-5)


def test_smart_resize_keeps_the_area_within_bounds() -> None:
    assert smart_resize(1000, 2000, 32, 64 * 64, 512 * 512) == (352, 704)
    assert smart_resize(10, 10, 32, 64 * 64, 512 * 512) == (64, 64)
    with pytest.raises(ValueError, match="200-fold"):
        smart_resize(10, 2010, 32, 64, 512 * 512)


def test_data_urls_decode_and_bad_ones_say_why() -> None:
    buf = io.BytesIO()
    _image(9, 7).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    assert decode_data_url(url).size == (7, 9)
    for bad, why in [
        ("https://example.com/cat.png", "data URL"),
        ("data:image/png;base64,***", "base64"),
        ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "cannot be read"),
    ]:
        with pytest.raises(ValueError, match=why):
            decode_data_url(bad)


def test_the_processing_comes_from_the_model_directory(tmp_path) -> None:
    from common.model.synthetic.checkpoint import make_model

    model = make_model(tmp_path / "q4", "tiny", "qwen4_exp")
    assert ImageProcessing.from_model_dir(model) == ImageProcessing(patch_size=16, merge_size=2)
    pre = {
        "size": {"shortest_edge": 4096, "longest_edge": 65536},
        "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3,
    }
    (model / "preprocessor_config.json").write_text(json.dumps(pre))
    proc = ImageProcessing.from_model_dir(model)
    assert (proc.min_pixels, proc.max_pixels, proc.image_mean) == (4096, 65536, (0.5, 0.5, 0.5))

"""The vision encoder's core: images → the embeddings their image tokens take in the prompt.

Library code for the encoder service (docs/ARCHITECTURE.md, Processes: on a device of its own): the model's
image processing (common/vision/images.py) and vision tower (common/model/qwen4_exp/vision.py), one pass for a
request's images. Equal to transformers' `get_image_features` of `Qwen4ExpForConditionalGeneration` on the
patches its Qwen2-VL processor makes (tests/common/vision/test_encoder.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from common.model.qwen4_exp.vision import load_vision_tower
from common.vision.images import ImageProcessing, image_patches


@dataclass(frozen=True)
class EncodedImage:
    """One image's embeddings and the grid its tokens stand for (for the prompt's MRoPE positions)."""

    embeddings: torch.Tensor
    """[tokens, text hidden]: one row per image token, in the order the tokens stand in the prompt."""
    grid: tuple[int, int, int]
    """Its patch grid (1, h, w); tokens = h · w / merge²."""


class ImageEncoder:
    """A model's vision tower and image processing, loaded once; `encode` runs a request's images."""

    def __init__(
        self, model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
    ) -> None:
        self.processing = ImageProcessing.from_model_dir(model_dir)
        self.tower = load_vision_tower(model_dir, dtype, device)
        self.device, self.dtype = torch.device(device), dtype

    def tokens(self, grid: tuple[int, int, int]) -> int:
        """The image tokens an image of patch grid `grid` takes in the prompt."""
        return self.processing.tokens(grid)

    @torch.inference_mode()
    def encode(self, images: list) -> list[EncodedImage]:
        """RGB PIL images → their embeddings, in one pass of the tower (attention stays within each image)."""
        if not images:
            return []
        cut = [image_patches(image, self.processing) for image in images]
        patches = torch.cat([p for p, _ in cut]).to(self.device, self.dtype)
        grids = [g for _, g in cut]
        out = self.tower(patches, grids)  # [Σ tokens, hidden]
        pieces = out.split([self.tokens(g) for g in grids])
        return [EncodedImage(e, g) for e, g in zip(pieces, grids, strict=True)]

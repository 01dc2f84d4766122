"""Images into vision-tower patches, as the Qwen2-VL image processor makes them (qwen4_exp's processor).

`decode_data_url` reads an OpenAI `image_url` part's `data:` URL (PNG, JPEG, WebP, GIF: its first frame)
into an RGB image (`decode_image`: the same from the file's bytes, as the encoder gets them);
`image_patches` resizes it so that each side is a multiple of patch × merge and its area within
[min_pixels, max_pixels] (the aspect ratio kept as closely as that allows: `smart_resize`), scales and
normalizes its values, and cuts it into the rows the tower takes (common/model/qwen4_exp/vision.py).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT = 200
"""The widest side over the narrowest that an image may have."""


@dataclass(frozen=True)
class ImageProcessing:
    """How images become patches (a model directory's preprocessor_config.json)."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    """The least area an image is resized to."""
    max_pixels: int = 28 * 28 * 1280
    """The most area an image is resized to: a bound on its tokens (max_pixels / (patch · merge)²)."""
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ImageProcessing:
        """From preprocessor_config.json where there is one, else the vision_config's patch and merge sizes
        with the Qwen2-VL processor's defaults."""
        root = Path(model_dir)
        vision = vision_config(root) or {}
        fields = {
            "patch_size": vision.get("patch_size", cls.patch_size),
            "temporal_patch_size": vision.get("temporal_patch_size", cls.temporal_patch_size),
            "merge_size": vision.get("spatial_merge_size", cls.merge_size),
        }
        path = root / "preprocessor_config.json"
        if path.exists():
            pre = json.loads(path.read_text())
            size = pre.get("size") or {}
            fields |= {k: pre[k] for k in ("patch_size", "temporal_patch_size", "merge_size") if k in pre}
            fields["min_pixels"] = pre.get("min_pixels", size.get("shortest_edge", cls.min_pixels))
            fields["max_pixels"] = pre.get("max_pixels", size.get("longest_edge", cls.max_pixels))
            fields |= {k: tuple(pre[k]) for k in ("image_mean", "image_std") if k in pre}
        return cls(**fields)

    def tokens(self, grid: tuple[int, int, int]) -> int:
        """The prompt tokens an image of patch grid `grid` (t, h, w) takes: one a merged block."""
        t, h, w = grid
        return t * h * w // self.merge_size**2


def vision_config(model_dir: str | Path) -> dict | None:
    """The `vision_config` of a model directory's config.json; None for a text-only model (no images)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return config.get("vision_config") or None


def decode_data_url(url: str):
    """The RGB image of a `data:image/...;base64,...` URL; ValueError saying what is wrong with it."""
    return decode_image(data_url_bytes(url))


def data_url_bytes(url: str) -> bytes:
    """The file a `data:...;base64,...` URL holds; ValueError where it is not one."""
    head, sep, payload = url.partition(",")
    if not url.startswith("data:") or not sep or not head.endswith(";base64"):
        raise ValueError("an image must be a data URL: data:image/png;base64,...")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"the image's base64 does not decode: {exc}") from None


def decode_image(raw: bytes, max_pixels: int | None = None):
    """The RGB image of an image file's bytes (PNG, JPEG, WebP, GIF: its first frame); ValueError saying
    why it cannot be read, or (`max_pixels` given) that it has more pixels than that: checked from the
    file's header, before any of it is decoded. The one decoder of the router's data URLs and the encoder's
    bytes."""
    from PIL import Image

    with _readable():
        image = Image.open(io.BytesIO(raw))
        check_pixels(image.size, max_pixels)
        image.load()
        return image.convert("RGB")


def image_size(raw: bytes) -> tuple[int, int]:
    """(width, height) of an image file's bytes, from its header alone (nothing decoded); ValueError where
    it is no image Pillow reads."""
    from PIL import Image

    with _readable():
        return Image.open(io.BytesIO(raw)).size


def check_pixels(size: tuple[int, int], max_pixels: int | None, spent: int = 0) -> None:
    """ValueError where an image of `size` (width, height) has more than `max_pixels` pixels (None: any),
    `spent` more counted with it (a request's earlier images)."""
    width, height = size
    if max_pixels is not None and spent + width * height > max_pixels:
        what = "a request's images together" if spent else "an image"
        raise ValueError(
            f"{what} may have at most {max_pixels:,} pixels; {width} x {height} makes "
            f"{spent + width * height:,}"
        )


@contextlib.contextmanager
def _readable() -> Iterator[None]:
    """Pillow's errors for a file it cannot read, as ValueError saying so."""
    from PIL import Image, UnidentifiedImageError

    try:
        yield
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError) as exc:
        raise ValueError(f"the image cannot be read (PNG, JPEG, WebP or GIF): {exc}") from None


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The size closest to (height, width) whose sides are multiples of `factor` and whose area is within
    [min_pixels, max_pixels]; ValueError for an image whose sides differ more than MAX_ASPECT-fold."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ValueError(f"an image's sides may differ at most {MAX_ASPECT}-fold, not {height} x {width}")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def image_grid(image, proc: ImageProcessing) -> tuple[int, int, int]:
    """The patch grid (1, gh, gw) `image_patches` cuts an RGB PIL image into, without cutting it: the rows a
    request's embeddings take are known before the tower runs. ValueError as `smart_resize` raises it."""
    p = proc.patch_size
    h, w = smart_resize(image.height, image.width, p * proc.merge_size, proc.min_pixels, proc.max_pixels)
    return 1, h // p, w // p


def image_patches(image, proc: ImageProcessing) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """An RGB PIL image → its patches [gh·gw, 3·T·P²] in merge-block order, and its grid (1, gh, gw)."""
    from PIL import Image

    p, m, t = proc.patch_size, proc.merge_size, proc.temporal_patch_size
    _, gh, gw = image_grid(image, proc)
    h, w = gh * p, gw * p
    pixels = np.asarray(image.resize((w, h), Image.Resampling.BICUBIC), dtype=np.float32) / 255.0  # [h, w, 3]
    normalized = (pixels - np.asarray(proc.image_mean, np.float32)) / np.asarray(proc.image_std, np.float32)
    blocks = normalized.transpose(2, 0, 1).reshape(3, gh // m, m, p, gw // m, m, p)
    blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, 3, p, p]: merge-block order
    frames = np.broadcast_to(
        blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p)
    )  # an image fills T frames
    return torch.from_numpy(frames.reshape(gh * gw, 3 * t * p * p).copy()), (1, gh, gw)

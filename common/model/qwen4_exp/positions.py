"""Multimodal rotary positions (MRoPE) of a qwen4_exp prompt: each token's (temporal, height, width) position.

Text tokens take their running index on all three axes. The tokens of an image (a run of `image_token_id`,
one token per merged m × m block of patches: t · (h/m) · (w/m) of them for a patch grid (t, h, w)) take the
index where the image starts plus their frame, row and column in the merged grid; the text after it resumes at
that start plus the larger of the grid's merged sides. So a prompt with images ends at a smaller position
than its length, and decode's token i (counted from 0 over the whole sequence) has position i + delta on all
three axes. transformers' `Qwen4ExpModel.get_rope_index` is the reference.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from common.kv.state import PromptImages


def mrope_positions(
    token_ids: Sequence[int], image_token_id: int, grids: Sequence[tuple[int, int, int]], merge: int
) -> tuple[torch.Tensor, int]:
    """The positions [3, T] (temporal, height, width) of a prompt whose runs of `image_token_id` stand for the
    images of patch grids `grids`, in order; and the delta of the tokens after it. ValueError where the runs
    do not match the grids (a run's length, or the number of images)."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    if not len(ids):
        return torch.zeros(3, 0, dtype=torch.long), 0
    is_image = ids == image_token_id
    # Runs of equal kind: [start, end) each, text or image.
    edges = [0, *(torch.nonzero(is_image[1:] != is_image[:-1]).flatten() + 1).tolist(), len(ids)]
    out, pos, images = [], 0, iter(grids)
    for start, end in itertools.pairwise(edges):
        if not is_image[start]:
            out.append(torch.arange(pos, pos + end - start).expand(3, -1))
            pos += end - start
            continue
        grid = next(images, None)
        if grid is None:
            raise ValueError(f"more runs of image tokens in the prompt than the {len(grids)} images given")
        t, h, w = grid
        gh, gw = h // merge, w // merge
        if t * gh * gw != end - start:
            raise ValueError(
                f"a run of {end - start} image tokens does not match the image's grid {t} x {h} x {w}"
            )
        frame, row, col = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        out.append(torch.stack([frame, row, col]).reshape(3, -1) + pos)
        pos += max(gh, gw)
    if next(images, None) is not None:
        raise ValueError(f"{len(grids)} images given, fewer runs of image tokens in the prompt")
    return torch.cat(out, dim=1), pos - len(ids)


def prompt_images(
    token_ids: Sequence[int],
    image_token_id: int,
    embeds: torch.Tensor,
    grids: Sequence[tuple[int, int, int]],
    merge: int,
    block: int,
) -> tuple[PromptImages, int]:
    """What a prompt's images change in its passes (`SequenceState.images`): its image tokens' embeddings
    `embeds` [N, H] (the images' in order), every token's MRoPE position; and the rotary delta of the tokens
    after it (`SequenceState.rope_delta`). ValueError where the image tokens do not match the grids or the
    embeddings, or where fewer than `block` − 1 tokens follow the last image: decode rotates a block of
    `block` indexer keys at its first token's position plus the delta, so that token must come after every
    image (a chat template's end of turn and generation prompt always do)."""
    mrope, delta = mrope_positions(token_ids, image_token_id, grids, merge)
    index = torch.nonzero(torch.as_tensor(list(token_ids)) == image_token_id).flatten()  # [N]
    if len(index) != embeds.shape[0]:
        raise ValueError(f"{len(index)} image tokens in the prompt, {embeds.shape[0]} image embeddings")
    if len(index) and int(index[-1]) > len(token_ids) - block:
        raise ValueError(f"an image must be followed by at least {block - 1} tokens of text")
    return PromptImages(index, embeds, mrope), delta


@dataclass(frozen=True)
class ImageTokens:
    """How a qwen4_exp checkpoint's prompts carry images (its config.json)."""

    image_token_id: int
    """The token each image token of a prompt is (a run of it per image)."""
    merge: int
    """Patches along a side of the block the vision tower merges into one token."""
    block: int
    """Indexer keys a compressed block holds (`prompt_images`' tail check)."""

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ImageTokens | None:
        """None for a checkpoint without a vision tower."""
        hf = json.loads((Path(model_dir) / "config.json").read_text())
        vision = hf.get("vision_config")
        if not vision or hf.get("image_token_id") is None:
            return None
        text = hf.get("text_config") or hf
        ratio = text.get("indexer_compress_ratio") or 4
        return cls(int(hf["image_token_id"]), int(vision.get("spatial_merge_size", 2)), int(ratio))

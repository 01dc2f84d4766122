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
from collections.abc import Sequence

import torch


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

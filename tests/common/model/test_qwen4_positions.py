"""MRoPE positions of prompts with images, against transformers' Qwen4ExpModel.get_rope_index."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from common.model.qwen4_exp.positions import mrope_positions

modeling = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
IMAGE, START, END = 90, 88, 89


def _theirs(ids: list[int], grids: list[tuple[int, int, int]], merge: int) -> tuple[torch.Tensor, int]:
    model = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=merge)))
    model.get_vision_position_ids = functools.partial(modeling.Qwen4ExpModel.get_vision_position_ids, model)
    input_ids = torch.tensor([ids])
    types = (input_ids == IMAGE).int()
    grid = torch.tensor(grids) if grids else None
    positions, delta = modeling.Qwen4ExpModel.get_rope_index(model, input_ids, types, image_grid_thw=grid)
    return positions[:, 0], int(delta)


def _prompt(
    *parts: int | tuple[int, int, int], merge: int = 2
) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Text tokens as ints, an image as its grid: <start> its tokens <end>."""
    ids, grids = [], []
    for part in parts:
        if isinstance(part, tuple):
            t, h, w = part
            ids += [START, *[IMAGE] * (t * (h // merge) * (w // merge)), END]
            grids.append(part)
        else:
            ids += list(range(1, part + 1))
    return ids, grids


@pytest.mark.parametrize(
    "parts",
    [
        (5,),  # text alone: positions 0..4, delta 0
        (3, (1, 4, 6), 4),  # an image wider than tall between text
        (2, (1, 8, 2), (1, 2, 2), 6),  # two images, one tall, back to back but for their markers
        ((1, 6, 6),),  # a prompt that is an image
    ],
)
def test_positions_match_transformers(parts) -> None:
    ids, grids = _prompt(*parts)
    want, want_delta = _theirs(ids, grids, 2)
    got, delta = mrope_positions(ids, IMAGE, grids, 2)
    assert torch.equal(got, want) and delta == want_delta


def test_an_empty_prompt_has_no_positions() -> None:
    positions, delta = mrope_positions([], IMAGE, [], 2)
    assert positions.shape == (3, 0) and delta == 0


def test_runs_that_do_not_match_the_images_are_refused() -> None:
    ids, grids = _prompt(2, (1, 4, 4), 1)
    with pytest.raises(ValueError, match="a run of 4 image tokens does not match the image's grid 1 x 4 x 6"):
        mrope_positions(ids, IMAGE, [(1, 4, 6)], 2)
    with pytest.raises(ValueError, match="2 images given"):
        mrope_positions(ids, IMAGE, [*grids, (1, 2, 2)], 2)
    with pytest.raises(ValueError, match="more runs of image tokens in the prompt than the 0 images"):
        mrope_positions(ids, IMAGE, [], 2)

"""A qwen4_exp prompt with images against transformers' Qwen4ExpForConditionalGeneration, float32 on CPU.

The vision encoder's embeddings placed at the image tokens, every prompt token rotated at its MRoPE position
(prefilled in chunks that cut through the images and the indexer's blocks), then greedy decoding at
position + delta: the prompt's logits and the generated tokens as transformers' `generate` makes them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.model.qwen4_exp.positions import ImageTokens, prompt_images
from common.model.synthetic.checkpoint import make_model
from common.vision.encoder import ImageEncoder

Image = pytest.importorskip("PIL.Image")
modeling = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
hf_pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")

# 16 indexer heads (ties among ReLU'd block scores are rare) and a dense range of 19 keys: the prompt's
# later queries select blocks.
OVERRIDES = {
    "torch_dtype": "float32",
    "indexer_n_heads": 16,
    "indexer_budget": 16,
    "indexer_compress_ratio": 4,
}
SIZES = ((64, 96), (96, 64))  # (height, width): 2 × 3 and 3 × 2 merged tokens
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("q4v"), "tiny", "qwen4_exp", OVERRIDES, seed=5)


def _images() -> list:
    rng = np.random.default_rng(7)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]


def _prompt(tokens: ImageTokens, counts: list[int], vision: tuple[int, int]) -> list[int]:
    """Text, an image, text, an image, text: every text token below the vision ids."""
    g = torch.Generator().manual_seed(11)

    def text(n: int) -> list[int]:
        return torch.randint(3, 1000, (n,), generator=g).tolist()

    start, end = vision
    out = text(9)
    for n in counts:
        out += [start, *[tokens.image_token_id] * n, end, *text(13)]
    return out


def _reference(model_dir, prompt: list[int], images: list):
    """transformers' prompt logits [P, V], its greedy continuation and the logits of each step [N, V]."""
    hf = modeling.Qwen4ExpForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    cfg = hf.config
    proc = hf_pil.Qwen2VLImageProcessorPil(
        patch_size=cfg.vision_config.patch_size, merge_size=cfg.vision_config.spatial_merge_size,
        temporal_patch_size=cfg.vision_config.temporal_patch_size, min_pixels=56 * 56,
        max_pixels=28 * 28 * 1280,
    )  # fmt: skip
    pixels = proc(images=images, return_tensors="pt")
    ids = torch.tensor([prompt])
    inputs = {
        "input_ids": ids,
        "pixel_values": pixels["pixel_values"],
        "image_grid_thw": pixels["image_grid_thw"],
        "mm_token_type_ids": (ids == cfg.image_token_id).int(),
    }
    with torch.no_grad():
        logits = hf(**inputs).logits[0]
        hf.model.rope_deltas = None  # generate computes them again from its prompt
        out = hf.generate(
            **inputs,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return logits, out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits)


@torch.inference_mode()
def test_prompt_with_images_matches_transformers(model_dir) -> None:
    images = _images()
    encoder = ImageEncoder(model_dir)
    encoded = encoder.encode(images)
    tokens = ImageTokens.from_model_dir(model_dir)
    engine = Engine(WorkerConfig(str(model_dir), max_running=2, max_context=128))
    hf_cfg = modeling.Qwen4ExpForConditionalGeneration.config_class.from_pretrained(model_dir)
    prompt = _prompt(
        tokens,
        [encoder.tokens(e.grid) for e in encoded],
        (hf_cfg.vision_start_token_id, hf_cfg.vision_end_token_id),
    )
    embeds = torch.cat([e.embeddings for e in encoded])
    attached, delta = prompt_images(
        prompt, tokens.image_token_id, embeds, [e.grid for e in encoded], tokens.merge, tokens.block
    )
    assert delta < 0  # each image takes fewer positions than tokens

    runner = engine.runner
    seq = runner.new_sequence()
    seq.images, seq.rope_delta = attached, delta
    ours = torch.cat(
        [runner.forward([seq], [prompt[a : a + 7]], all_logits=True) for a in range(0, len(prompt), 7)]
    )
    layer_major = runner.new_sequence()  # the chunks layer by layer (long prompts): the same last logits
    layer_major.images, layer_major.rope_delta = attached, delta
    torch.testing.assert_close(
        runner.prefill_layer_major(layer_major, prompt, 6)[0], ours[-1], rtol=1e-4, atol=1e-4
    )
    runner.release(layer_major)
    seq.images = None  # decode knows the delta only
    steps = [ours[-1]]
    while len(steps) < NEW_TOKENS:
        steps.append(runner.forward([seq], [[int(steps[-1].argmax())]])[0])
    generated = [int(s.argmax()) for s in steps]

    want_logits, want_tokens, want_steps = _reference(model_dir, prompt, images)
    torch.testing.assert_close(ours, want_logits, rtol=1e-4, atol=1e-4)
    assert generated == want_tokens
    torch.testing.assert_close(torch.stack(steps), want_steps, rtol=1e-4, atol=1e-4)


def test_prompt_images_refuses_what_does_not_match() -> None:
    embeds = torch.zeros(6, 4)
    ids = [5, 9, *[7] * 6, 9, 5, 5, 5]
    attached, delta = prompt_images(ids, 7, embeds, [(1, 4, 6)], 2, 4)
    assert attached.token_index.tolist() == list(range(2, 8)) and delta == 3 - 6
    with pytest.raises(ValueError, match="5 image embeddings"):
        prompt_images(ids, 7, embeds[:5], [(1, 4, 6)], 2, 4)
    with pytest.raises(ValueError, match="at least 3 tokens"):
        prompt_images(ids[:-2], 7, embeds, [(1, 4, 6)], 2, 4)
    with pytest.raises(ValueError, match="does not match"):
        prompt_images(ids, 7, embeds, [(1, 4, 4)], 2, 4)


@torch.inference_mode()
def test_a_one_token_pass_after_an_image_rotates_its_block_from_the_prompt(model_dir) -> None:
    """A prompt whose last pass is one token (chunks of 15 + 1) that completes an indexer block starting on
    an image token: the block is rotated at that token's three-axis position, as in one pass."""
    tokens = ImageTokens.from_model_dir(model_dir)
    encoded = ImageEncoder(model_dir).encode(_images()[:1])  # 6 image tokens
    g = torch.Generator().manual_seed(3)
    prompt = [*torch.randint(3, 1000, (6,), generator=g).tolist(), 1019, *[tokens.image_token_id] * 6, 1020]
    prompt += torch.randint(3, 1000, (2,), generator=g).tolist()  # 16 tokens: the last image token at 16 − 4
    attached, delta = prompt_images(
        prompt, tokens.image_token_id, encoded[0].embeddings, [encoded[0].grid], tokens.merge, tokens.block
    )
    runner = Engine(WorkerConfig(str(model_dir), max_running=2, max_context=64)).runner

    def blocks_and_steps(chunks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The QSA layers' compressed block keys of the prompt, and the logits of its first decode steps."""
        seq = runner.new_sequence()
        seq.images, seq.rope_delta = attached, delta
        at, out = 0, []
        for n in chunks:
            out = runner.forward([seq], [prompt[at : at + n]])
            at += n
        page_size = runner.pool.page_size
        slots = torch.tensor([seq.pages[p // page_size] * page_size + p % page_size for p in range(0, 16, 4)])
        layers = [i for i, layer in enumerate(runner.model.model.layers) if hasattr(layer, "self_attn")]
        blocks = torch.stack([runner.pool.layer(i).paged["index_block"].flatten(0, 1)[slots] for i in layers])
        seq.images, logits = None, [out[-1]]
        for _ in range(6):
            logits.append(runner.forward([seq], [[int(logits[-1].argmax())]])[0])
        runner.release(seq)
        return blocks, torch.stack(logits)

    for got, want in zip(blocks_and_steps([15, 1]), blocks_and_steps([16]), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

"""The vision tokens of a synthetic tokenizer (`write_tokenizer(vision=True)`, what `make_model` writes for
qwen4_exp): ids, config files and chat template, checked against transformers' AutoTokenizer."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from common.model.synthetic.checkpoint import make_model
from common.model.synthetic.presets import TOKENIZER_VOCAB
from common.model.synthetic.tokenizer import (
    CHAT_TEMPLATE,
    IMAGE_TOKEN,
    SPECIAL_TOKENS,
    VIDEO_TOKEN,
    VISION_CHAT_TEMPLATE,
    VISION_END_TOKEN,
    VISION_PAD_TOKEN,
    VISION_START_TOKEN,
    VISION_TOKENS,
    check_vision_token_ids,
    tokenizer_vocab_size,
    write_tokenizer,
)
from common.text.tokenizer import Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

V = TOKENIZER_VOCAB
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"

CONVERSATIONS = {
    "image": [
        {"role": "system", "content": "You describe pictures."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in "},
                {"type": "image", "url": "https://example.invalid/cat.png"},
                {"type": "text", "text": " and in this one?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            ],
        },
    ],
    "image_first_then_answer": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "café?"}]},
        {"role": "assistant", "content": "A café at night."},
        {"role": "user", "content": [{"type": "text", "text": "Thanks."}]},
    ],
    "text_only": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": [{"type": "text", "text": "Still there?"}]},
    ],
}


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen4_exp checkpoint: its config has a vision_config, so its tokenizer has the vision tokens."""
    return make_model(tmp_path_factory.mktemp("vision") / "q4", "tiny", "qwen4_exp")


@pytest.fixture(scope="module")
def hf_tokenizer(vision_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(vision_dir)


@pytest.fixture(scope="module")
def tokenizer(vision_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(vision_dir)


def test_vision_tokens_take_the_top_five_ids(vision_dir: Path) -> None:
    assert tokenizer_vocab_size(vision_dir) == V
    added = {entry["id"]: entry for entry in _read_json(vision_dir / "tokenizer.json")["added_tokens"]}
    expected = {
        V - 5: VISION_START_TOKEN,
        V - 4: VISION_END_TOKEN,
        V - 3: VISION_PAD_TOKEN,
        V - 2: IMAGE_TOKEN,
        V - 1: VIDEO_TOKEN,
    }
    assert {token_id: added[token_id]["content"] for token_id in expected} == expected
    assert sorted(added) == [0, 1, 2, *expected]
    assert all(entry["special"] and not entry["normalized"] for entry in added.values())
    assert (VISION_START_TOKEN, VISION_END_TOKEN, VISION_PAD_TOKEN, IMAGE_TOKEN, VIDEO_TOKEN) == VISION_TOKENS
    assert (VISION_START_TOKEN, IMAGE_TOKEN, VIDEO_TOKEN) == (
        "<|vision_start|>",
        "<|image_pad|>",
        "<|video_pad|>",
    )


def test_config_ids_match_the_tokenizer(vision_dir: Path, tokenizer: Tokenizer) -> None:
    cfg = _read_json(vision_dir / "config.json")
    assert "vision_config" in cfg
    assert (cfg["vision_start_token_id"], cfg["vision_end_token_id"]) == (V - 5, V - 4)
    assert (cfg["image_token_id"], cfg["video_token_id"]) == (V - 2, V - 1)
    assert tokenizer.token_to_id(VISION_START_TOKEN) == cfg["vision_start_token_id"]
    assert tokenizer.token_to_id(VISION_END_TOKEN) == cfg["vision_end_token_id"]
    assert tokenizer.token_to_id(IMAGE_TOKEN) == cfg["image_token_id"]
    assert tokenizer.token_to_id(VIDEO_TOKEN) == cfg["video_token_id"]
    check_vision_token_ids(vision_dir, cfg)


def test_tokenizer_config_lists_the_vision_tokens(vision_dir: Path) -> None:
    config = _read_json(vision_dir / "tokenizer_config.json")
    decoder = config["added_tokens_decoder"]
    assert list(decoder) == ["0", "1", "2", *(str(V - 5 + i) for i in range(5))]
    for token_id, token in zip(range(V - 5, V), VISION_TOKENS, strict=True):
        assert decoder[str(token_id)] == {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    assert config["additional_special_tokens"] == [*SPECIAL_TOKENS[1:], *VISION_TOKENS]
    assert config["image_token"] == "<|image_pad|>" and config["video_token"] == "<|video_pad|>"
    assert config["vision_start_token"] == "<|vision_start|>"
    assert config["vision_end_token"] == "<|vision_end|>"
    assert config["chat_template"] == VISION_CHAT_TEMPLATE
    assert list(config) == sorted(config)
    special_map = _read_json(vision_dir / "special_tokens_map.json")
    assert special_map["additional_special_tokens"] == config["additional_special_tokens"]


def test_transformers_and_ours_encode_vision_tokens(hf_tokenizer: Any, tokenizer: Tokenizer) -> None:
    text = "<|vision_start|><|image_pad|><|image_pad|><|vision_end|>"
    assert hf_tokenizer.encode(text, add_special_tokens=False) == [V - 5, V - 2, V - 2, V - 4]
    assert tokenizer.encode(text) == [V - 5, V - 2, V - 2, V - 4]
    assert len(hf_tokenizer) == tokenizer.vocab_size == V
    assert (hf_tokenizer.image_token, hf_tokenizer.image_token_id) == (IMAGE_TOKEN, V - 2)
    assert (hf_tokenizer.video_token, hf_tokenizer.vision_start_token) == (VIDEO_TOKEN, VISION_START_TOKEN)
    assert tokenizer.special_tokens["image_token"] == IMAGE_TOKEN
    ids = tokenizer.encode(f"look{text}here")
    assert ids == hf_tokenizer.encode(f"look{text}here", add_special_tokens=False)
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True) == "lookhere"
    assert tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids) == f"look{text}here"


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    hf_tokenizer: Any, tokenizer: Tokenizer, name: str, add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[name]
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    hf_ids = hf_tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    assert ids == (hf_ids if isinstance(hf_ids, list) else list(hf_ids["input_ids"]))
    images = sum(
        part.get("type") in ("image", "image_url")
        for m in messages
        if isinstance(m["content"], list)
        for part in m["content"]
    )
    assert ours.count(IMAGE) == images == ids.count(V - 2)


def test_image_parts_render_in_place(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.apply_chat_template(CONVERSATIONS["image"])
    assert prompt == (
        "<|im_start|>system\nYou describe pictures.<|im_end|>\n"
        f"<|im_start|>user\nWhat is in {IMAGE} and in this one?{IMAGE}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_text_only_conversations_render_as_with_the_text_template(tokenizer: Tokenizer) -> None:
    messages = CONVERSATIONS["text_only"]
    assert tokenizer.apply_chat_template(messages) == tokenizer.apply_chat_template(
        messages, chat_template=CHAT_TEMPLATE
    )


def test_text_only_tokenizer_is_unchanged(tmp_path: Path) -> None:
    """A flat arch's tokenizer has no vision tokens: the files of `write_tokenizer` without `vision`."""
    model = make_model(tmp_path / "qwen3", "tiny", "qwen3_moe")
    write_tokenizer(tmp_path / "plain")
    write_tokenizer(tmp_path / "explicit", vision=False)
    for name in FILES:
        plain = (tmp_path / "plain" / name).read_bytes()
        assert (model / name).read_bytes() == plain == (tmp_path / "explicit" / name).read_bytes()
    config = _read_json(model / "tokenizer_config.json")
    assert config["chat_template"] == CHAT_TEMPLATE and "image_token" not in config
    assert config["additional_special_tokens"] == list(SPECIAL_TOKENS[1:])
    assert Tokenizer.from_dir(model).token_to_id(IMAGE_TOKEN) is None
    # The vision tokenizer shares the text-only one's pre-tokenization, byte alphabet and special tokens.
    vision = tmp_path / "vision"
    write_tokenizer(vision, vision=True)
    ours, plain_tokenizer = Tokenizer.from_dir(vision), Tokenizer.from_dir(model)
    for token_id in range(259):
        assert ours.backend.id_to_token(token_id) == plain_tokenizer.backend.id_to_token(token_id)


@pytest.mark.parametrize("vocab_size", [264, 512, 1500])
def test_vision_vocab_size_is_exact(tmp_path: Path, vocab_size: int) -> None:
    write_tokenizer(tmp_path, vocab_size, vision=True)
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer_vocab_size(tmp_path) == tokenizer.vocab_size == vocab_size
    assert [tokenizer.token_to_id(token) for token in VISION_TOKENS] == list(
        range(vocab_size - 5, vocab_size)
    )


def test_vision_vocab_too_small_raises(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="vision token"):
        write_tokenizer(tmp_path, 263, vision=True)


def test_vision_training_is_deterministic(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    write_tokenizer(first, vision=True)
    write_tokenizer(second, vision=True)
    for name in FILES:
        assert (first / name).read_bytes() == (second / name).read_bytes()


def test_make_model_refuses_ids_that_disagree_with_the_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"image_token_id is 7, but the tokenizer has <\|image_pad\|> at id"):
        make_model(tmp_path / "a", "tiny", "qwen4_exp", {"image_token_id": 7})
    # A smaller vocabulary moves the tokenizer's vision tokens, not the config's ids.
    with pytest.raises(ValueError, match=r"vision_start_token_id is 1019, but .* at id 507"):
        make_model(tmp_path / "b", "tiny", "qwen4_exp", {"vocab_size": 512})


def test_check_vision_token_ids(vision_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = _read_json(vision_dir / "config.json")
    release = {**cfg, "vision_start_token_id": 248053, "image_token_id": 248056}
    with pytest.raises(ValueError, match=r"vision_start_token_id is 248053.*image_token_id is 248056"):
        check_vision_token_ids(vision_dir, release)
    with caplog.at_level(logging.WARNING):
        check_vision_token_ids(vision_dir, release, strict=False)
    assert "image_token_id is 248056" in caplog.text
    with pytest.raises(ValueError, match="video_token_id is None"):
        check_vision_token_ids(vision_dir, {k: v for k, v in cfg.items() if k != "video_token_id"})

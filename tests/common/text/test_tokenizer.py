"""`common.text.tokenizer.Tokenizer` on a synthetic checkpoint, checked against transformers'
AutoTokenizer."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import jinja2
import pytest

from common.model.synthetic.tokenizer import (
    CHAT_TEMPLATE,
    ENDOFTEXT_ID,
    IM_END_ID,
    IM_START_ID,
    SPECIAL_TOKENS,
    tokenizer_vocab_size,
    write_tokenizer,
)
from common.text.tokenizer import Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Prices: $12.99, 3.14159, 2^10 = 1024; it's 08:30 on 2025-03-03.",
    "café, naïve, façade, Привет, 日本語 and 中文",
    "emoji 🙂😀🎉 🚀 ❤️ 👍🏽 and a family 👨‍👩‍👧",
    "  leading spaces,\ttabs\n\nblank lines \r\n and trailing spaces   ",
    'def f(x):\n    return {"key": [x, None]}  # comment\n',
    "unseen words: zyxwvut qqqq ŋ ʃ ǂ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "",
]

CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "What is the capital of France?"}],
    "multi_turn": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hi! Can you count to three?"},
        {"role": "assistant", "content": "One, two, three."},
        {"role": "user", "content": "Now in French, s'il te plaît 🙂"},
    ],
    "text_parts": [
        {"role": "system", "content": [{"type": "text", "text": "Answer briefly."}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Describe this: "},
                {"type": "image", "url": "https://example.invalid/cat.png"},
                {"type": "text", "text": "a café at night."},
            ],
        },
    ],
    "assistant_without_content": [
        {"role": "user", "content": "Say nothing."},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "Thanks."},
    ],
}

# A template exercising the transformers environment: tojson (non-ASCII, no HTML escaping, indent,
# sort_keys, separators), raise_exception, namespace, dict, loop controls, the generation tag, special
# and model-specific tokens, reasoning aliases, None-valued keys dropped, tools and a custom kwarg.
CUSTOM_TEMPLATE = """\
{%- set ns = namespace(count=0) %}
{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('Invalid role: ' ~ message.role) }}
    {%- endif %}
    {%- set ns.count = ns.count + 1 %}
{{ message.role }}: {{ message.content | tojson if message.content is defined else 'no content' }}
    {%- if message.reasoning_content is defined %} [{{ message.reasoning_content }}|{{ message.thinking }}]
    {%- endif %}

{% endfor %}
{%- if tools %}
tools: {{ tools | tojson(indent=2) }}
{% endif %}
meta: {{ dict(b=[1, 2], a='x') | tojson(sort_keys=True, separators=(',', ':')) }}
count={{ ns.count }} greeting={{ greeting }} eos={{ eos_token }} pad={{ pad_token }} bos={{ bos_token }}
image={{ image_token | default('none') }} documents={{ documents }}
{% for i in range(9) %}{% if i == 4 %}{% break %}{% endif %}
{%- if i == 1 %}{% continue %}{% endif %}{{ i }}{% endfor %}

{% generation %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}{% endgeneration %}
"""

CUSTOM_MESSAGES = [
    {"role": "system", "content": 'Use <b>bold</b> & "quotes"; café 🙂'},
    {"role": "user", "content": [{"type": "text", "text": "ünïcode"}]},
    {"role": "assistant", "content": "Done.", "reasoning": "it was easy"},
    {"role": "assistant", "content": None, "tool_calls": None},
]

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"city": {"type": "string"}}}}
]


def _hf_tokenizer(model_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def _hf_ids(output: Any) -> list[int]:
    """Token ids from `apply_chat_template(tokenize=True)`: a BatchEncoding in transformers 5."""
    if isinstance(output, list):
        return output
    return list(output["input_ids"])


def _edit_config(model_dir: Path, **changes: Any) -> None:
    config_file = model_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    config_file.write_text(json.dumps(config), encoding="utf-8")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("synthetic-tokenizer")
    write_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir: Path) -> Any:
    return _hf_tokenizer(model_dir)


@pytest.fixture
def fresh_dir(tmp_path: Path, model_dir: Path) -> Path:
    """A private copy of the synthetic checkpoint that a test may edit."""
    directory = tmp_path / "model"
    shutil.copytree(model_dir, directory)
    return directory


def test_synthetic_checkpoint_loads_in_transformers(model_dir: Path, hf_tokenizer: Any) -> None:
    assert type(hf_tokenizer).__name__ == "Qwen2Tokenizer"
    assert hf_tokenizer.is_fast
    assert hf_tokenizer.special_tokens_map == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    assert (hf_tokenizer.eos_token_id, hf_tokenizer.pad_token_id, hf_tokenizer.bos_token) == (
        IM_END_ID,
        0,
        None,
    )
    assert hf_tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [ENDOFTEXT_ID, IM_START_ID, IM_END_ID]
    assert sorted(hf_tokenizer.all_special_ids) == [ENDOFTEXT_ID, IM_START_ID, IM_END_ID]
    assert tokenizer_vocab_size(model_dir) == len(hf_tokenizer) == 1024


def test_properties(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 1024
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        None,
        "<|im_end|>",
        "<|endoftext|>",
    )
    assert tokenizer.eos_token_ids == [IM_END_ID]
    assert tokenizer.chat_template == CHAT_TEMPLATE


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip_matches_transformers(
    tokenizer: Tokenizer, hf_tokenizer: Any, text: str
) -> None:
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.encode(text, add_special_tokens=True) == hf_tokenizer.encode(text)
    assert tokenizer.decode(ids) == text == hf_tokenizer.decode(ids)


def test_transformers_class_pipeline_matches_tokenizer_json(model_dir: Path, hf_tokenizer: Any) -> None:
    """Qwen2Tokenizer rebuilds its own pre-tokenizer; loading tokenizer.json verbatim must agree with it."""
    verbatim = transformers.PreTrainedTokenizerFast.from_pretrained(model_dir)
    for text in TEXTS:
        assert verbatim.encode(text) == hf_tokenizer.encode(text)


def test_special_tokens_are_single_ids_and_skipped_by_decode(tokenizer: Tokenizer) -> None:
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.encode(token) == [token_id]
        assert tokenizer.token_to_id(token) == token_id
    text = "<|im_start|>user\nhi there<|im_end|>\n<|endoftext|>"
    ids = tokenizer.encode(text)
    assert ids[0] == IM_START_ID
    assert ids.count(IM_END_ID) == 1 and ids[-1] == ENDOFTEXT_ID
    assert tokenizer.decode(ids) == "user\nhi there\n"
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_chat_template_matches_transformers(
    tokenizer: Tokenizer, hf_tokenizer: Any, name: str, add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[name]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert text == expected
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    hf_output = hf_tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    assert ids == _hf_ids(hf_output) == tokenizer.encode(text)
    assert ids[0] == IM_START_ID


def test_chat_template_format(tokenizer: Tokenizer) -> None:
    text = tokenizer.apply_chat_template(CONVERSATIONS["text_parts"])
    assert text == (
        "<|im_start|>system\nAnswer briefly.<|im_end|>\n"
        "<|im_start|>user\nDescribe this: a café at night.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_synthetic_template_rejects_unknown_roles(tokenizer: Tokenizer) -> None:
    with pytest.raises(jinja2.TemplateError, match="Unsupported role 'function'"):
        tokenizer.apply_chat_template([{"role": "function", "content": "42"}])


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_custom_template_matches_transformers(
    fresh_dir: Path, add_generation_prompt: bool, tools: list[dict] | None
) -> None:
    (fresh_dir / "chat_template.jinja").write_text(CUSTOM_TEMPLATE, encoding="utf-8")
    _edit_config(fresh_dir, image_token="<|im_start|>")
    ours, hf = Tokenizer.from_dir(fresh_dir), _hf_tokenizer(fresh_dir)
    kwargs = {"add_generation_prompt": add_generation_prompt, "tools": tools, "greeting": "hallo wêreld"}
    text = ours.apply_chat_template(CUSTOM_MESSAGES, **kwargs)
    assert text == hf.apply_chat_template(CUSTOM_MESSAGES, tokenize=False, **kwargs)
    assert 'system: "Use <b>bold</b> & \\"quotes\\"; café 🙂"' in text
    assert 'user: [{"type": "text", "text": "ünïcode"}]' in text
    assert 'assistant: "Done." [it was easy|it was easy]\nassistant: no content\n' in text
    assert ('tools: [\n  {\n    "type": "function"' in text) == (tools is not None)
    assert 'meta: {"a":"x","b":[1,2]}\n' in text
    assert "count=4 greeting=hallo wêreld eos=<|im_end|> pad=<|endoftext|> bos=\n" in text
    assert "image=<|im_start|> documents=None\n023\n" in text
    ids = ours.apply_chat_template(CUSTOM_MESSAGES, tokenize=True, **kwargs)
    assert ids == _hf_ids(hf.apply_chat_template(CUSTOM_MESSAGES, tokenize=True, **kwargs))


def test_custom_template_raise_exception(fresh_dir: Path) -> None:
    (fresh_dir / "chat_template.jinja").write_text(CUSTOM_TEMPLATE, encoding="utf-8")
    ours, hf = Tokenizer.from_dir(fresh_dir), _hf_tokenizer(fresh_dir)
    messages = [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "abracadabra"}]
    with pytest.raises(jinja2.TemplateError, match="Invalid role: wizard"):
        ours.apply_chat_template(messages)
    with pytest.raises(jinja2.TemplateError, match="Invalid role: wizard"):
        hf.apply_chat_template(messages, tokenize=False)


def test_template_namespace_refuses_private_attributes(tokenizer: Tokenizer) -> None:
    template = "{% set ns = namespace(_secret=1) %}{{ ns._secret }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}], chat_template=template)


def test_strftime_now(tokenizer: Tokenizer) -> None:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], chat_template="{{ strftime_now('%Y') }}"
    )
    assert text.isdigit() and len(text) == 4


def test_chat_template_file_wins_over_config(fresh_dir: Path) -> None:
    (fresh_dir / "chat_template.jinja").write_text(
        "from the file: {{ messages[0].content }}", encoding="utf-8"
    )
    messages = [{"role": "user", "content": "hi"}]
    text = Tokenizer.from_dir(fresh_dir).apply_chat_template(messages)
    assert text == "from the file: hi"
    assert text == _hf_tokenizer(fresh_dir).apply_chat_template(messages, tokenize=False)


def test_named_templates_are_chosen_like_transformers(fresh_dir: Path) -> None:
    templates = [
        {"name": "default", "template": "default: {{ messages[0].content }}"},
        {"name": "tool_use", "template": "tools: {{ tools | length }}"},
        {"name": "terse", "template": "terse"},
    ]
    _edit_config(fresh_dir, chat_template=templates)
    ours, hf = Tokenizer.from_dir(fresh_dir), _hf_tokenizer(fresh_dir)
    messages = [{"role": "user", "content": "hi"}]
    for kwargs in ({}, {"tools": TOOLS}, {"chat_template": "terse"}, {"chat_template": "inline {{ 1 + 1 }}"}):
        text = ours.apply_chat_template(messages, add_generation_prompt=False, **kwargs)
        assert text == hf.apply_chat_template(messages, tokenize=False, **kwargs)
    assert ours.apply_chat_template(messages, tools=TOOLS) == "tools: 1"


def test_no_chat_template_is_a_clear_error(fresh_dir: Path) -> None:
    _edit_config(fresh_dir, chat_template=None)
    tokenizer = Tokenizer.from_dir(fresh_dir)
    assert tokenizer.chat_template is None
    assert tokenizer.encode("still tokenizes") != []
    with pytest.raises(ValueError, match="has no chat template") as error:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert str(fresh_dir) in str(error.value)


def test_empty_conversation_is_an_error(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="empty conversation"):
        tokenizer.apply_chat_template([])


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json") as error:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(error.value)


def _corrupt(directory: Path, name: str, content: bytes) -> Path:
    (directory / name).write_bytes(content)
    return directory / name


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("tokenizer.json", b'{"model": 5}', "not a readable tokenizer"),
        ("tokenizer.json", b"{not json", "not a readable tokenizer"),
        ("tokenizer_config.json", b"{not json", "not valid JSON"),
        ("chat_template.jinja", b"\xff\xfe{{", "not UTF-8"),
        ("chat_template.jinja", b"line one\n{% for m in messages %}{{ m }", "line 2"),
    ],
)
def test_unreadable_tokenizer_files_are_named(
    fresh_dir: Path, name: str, content: bytes, message: str
) -> None:
    path = _corrupt(fresh_dir, name, content)
    with pytest.raises(ValueError, match=message) as error:
        Tokenizer.from_dir(fresh_dir)
    assert str(path) in str(error.value)


@pytest.mark.parametrize(
    "template", [5, [{"nm": "default", "template": "x"}], [{"name": "default", "template": 5}]]
)
def test_a_malformed_config_template_names_the_config(fresh_dir: Path, template: Any) -> None:
    _edit_config(fresh_dir, chat_template=template)
    with pytest.raises(ValueError, match=r"chat_template|chat template") as error:
        Tokenizer.from_dir(fresh_dir)
    assert "tokenizer_config.json" in str(error.value)


@pytest.mark.parametrize(
    ("generation_config", "expected"),
    [
        ({"eos_token_id": [IM_END_ID, ENDOFTEXT_ID, IM_END_ID]}, [IM_END_ID, ENDOFTEXT_ID]),
        ({"eos_token_id": ENDOFTEXT_ID}, [ENDOFTEXT_ID]),
        ({"bos_token_id": ENDOFTEXT_ID}, [IM_END_ID]),
        (None, [IM_END_ID]),
    ],
)
def test_eos_token_ids(fresh_dir: Path, generation_config: dict | None, expected: list[int]) -> None:
    if generation_config is not None:
        (fresh_dir / "generation_config.json").write_text(json.dumps(generation_config), encoding="utf-8")
    assert Tokenizer.from_dir(fresh_dir).eos_token_ids == expected


def test_special_tokens_added_by_tokenizer_json_post_processor(fresh_dir: Path) -> None:
    """tokenizer.json's post-processor decides; transformers 5 ignores the config's add_bos_token."""
    _edit_config(fresh_dir, bos_token="<|endoftext|>", add_bos_token=True)
    ours, hf = Tokenizer.from_dir(fresh_dir), _hf_tokenizer(fresh_dir)
    assert ours.bos_token == hf.bos_token == "<|endoftext|>"
    assert ours.encode("hi", add_special_tokens=True) == hf.encode("hi") == ours.encode("hi")

    tokenizer_file = fresh_dir / "tokenizer.json"
    data = json.loads(tokenizer_file.read_text(encoding="utf-8"))
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            "<|endoftext|>": {"id": "<|endoftext|>", "ids": [ENDOFTEXT_ID], "tokens": ["<|endoftext|>"]}
        },
    }
    tokenizer_file.write_text(json.dumps(data), encoding="utf-8")
    ours, hf = Tokenizer.from_dir(fresh_dir), _hf_tokenizer(fresh_dir)
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=True)
        assert ids == hf.encode(text) == [ENDOFTEXT_ID, *ours.encode(text)]
        assert ours.decode(ids) == text


def test_training_is_deterministic(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    write_tokenizer(first)
    write_tokenizer(second)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes()


@pytest.mark.parametrize("vocab_size", [259, 512, 1500])
def test_vocab_size_is_exact(tmp_path: Path, vocab_size: int) -> None:
    write_tokenizer(tmp_path, vocab_size)
    assert tokenizer_vocab_size(tmp_path) == Tokenizer.from_dir(tmp_path).vocab_size == vocab_size


def test_token_bytes_spell_the_text_a_token_at_a_time(tokenizer: Tokenizer) -> None:
    """Byte-level BPE: a token's own bytes, a piece of a multi-byte character included."""
    for text in TEXTS:
        assert b"".join(tokenizer.token_bytes(i) for i in tokenizer.encode(text)) == text.encode()
    assert tokenizer.token_bytes(IM_END_ID) == b"<|im_end|>"
    assert tokenizer.token_bytes(10**9) == b""


def test_token_bytes_of_sentencepiece_pieces_and_byte_fallbacks() -> None:
    """▁ is a space even where decoding a lone token would strip it; `<0xE2>` is that byte."""
    import tokenizers
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": b + 1 for b in range(256)}, "▁the": 257, "a": 258}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok = Tokenizer(backend)
    assert tok.decode([257]) == "the"
    assert [tok.token_bytes(i) for i in (257, 258, 0xE2 + 1)] == [b" the", b"a", b"\xe2"]


TOOL_CHAT = [
    {"role": "system", "content": "Be useful."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "P"}'},
            },
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "CET"}}},
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "18 C, clear"},
]


def test_synthetic_template_with_tools_matches_transformers(tokenizer: Tokenizer, hf_tokenizer: Any) -> None:
    """The tools listed in a system turn, an assistant's calls as <tool_call> blocks (arguments given as
    JSON text or as an object), a tool's answer as a user turn."""
    text = tokenizer.apply_chat_template(TOOL_CHAT, tools=TOOLS)
    hf = hf_tokenizer.apply_chat_template(TOOL_CHAT, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text == hf
    assert text == (
        "<|im_start|>system\nBe useful.\n\n"
        "You can call these functions (JSON schemas, one a line):\n<tools>\n"
        + json.dumps(TOOLS[0])
        + '\n</tools>\nTo call one, answer with a block <tool_call>\n{"name": ..., "arguments": {...}}\n'
        "</tool_call> for each call.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "P"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n18 C, clear\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )

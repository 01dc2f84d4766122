"""A small byte-level BPE tokenizer for synthetic checkpoints, laid out like a Qwen2/Qwen3 checkpoint.

`write_tokenizer` trains a tokenizer on the built-in `CORPUS` and writes the files a real Qwen-style
Hugging Face checkpoint ships: `tokenizer.json`, `tokenizer_config.json` (with a ChatML `chat_template`)
and `special_tokens_map.json`. `transformers.AutoTokenizer.from_pretrained` loads the directory offline.

The pipeline in `tokenizer.json` (NFC normalizer, Qwen's pre-tokenization regex, then byte-level mapping)
is the one `transformers`' `Qwen2Tokenizer` rebuilds for itself: in transformers 5 that class takes only
the vocabulary and merges from `tokenizer.json` and sets its own normalizer and pre-tokenizer, so the
file has to agree with it for the `tokenizers` library and transformers to produce the same ids.

`write_tokenizer(..., vision=True)` adds the vision special tokens (see there); text-only tokenizers
(the default) do not change.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer

ENDOFTEXT_ID = 0
IM_START_ID = 1
IM_END_ID = 2
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# The vision special tokens of a vision tokenizer, which take its top five ids in this order (as in the
# Qwen2-VL/Qwen3-VL release: start, end, pad, image, video).
VISION_START_TOKEN = "<|vision_start|>"
VISION_END_TOKEN = "<|vision_end|>"
VISION_PAD_TOKEN = "<|vision_pad|>"
IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
VISION_TOKENS = (VISION_START_TOKEN, VISION_END_TOKEN, VISION_PAD_TOKEN, IMAGE_TOKEN, VIDEO_TOKEN)
# config.json's token id fields of a Qwen VL model and the tokens they name.
VISION_TOKEN_ID_KEYS = {
    "vision_start_token_id": VISION_START_TOKEN,
    "vision_end_token_id": VISION_END_TOKEN,
    "image_token_id": IMAGE_TOKEN,
    "video_token_id": VIDEO_TOKEN,
}

log = logging.getLogger(__name__)

DEFAULT_VOCAB_SIZE = 1024
DEFAULT_MODEL_MAX_LENGTH = 32768

# Qwen2's pre-tokenization regex: contractions, letter runs (with one leading non-letter), single digits,
# punctuation runs, newlines and other whitespace.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML, as Qwen-style checkpoints use it. Content may be a string or a list of {"type": "text"} parts;
# parts of other types are skipped. Roles other than system/user/assistant/tool are rejected. With `tools`,
# a system turn lists their schemas and asks for each call as a <tool_call> block holding a JSON object (the
# Hermes/Qwen convention); an assistant's `tool_calls` are rendered so, a tool's answer as a user turn.
CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' and messages[0]['content'] is string %}
        {{- messages[0]['content'] + '\\n\\n' }}
    {%- endif %}
    {{- 'You can call these functions (JSON schemas, one a line):\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\nTo call one, answer with a block <tool_call>\\n' }}
    {{- '{\\"name\\": ..., \\"arguments\\": {...}}\\n' }}
    {{- '</tool_call> for each call.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}
        {{- raise_exception("Unsupported role '" ~ message['role']
                            ~ "': use system, user, assistant or tool") }}
    {%- endif %}
    {%- if tools and loop.first and message['role'] == 'system' and message['content'] is string %}
    {%- elif message['role'] == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] }}
        {{- '\\n</tool_response><|im_end|>\\n' }}
    {%- else %}
    {{- '<|im_start|>' + message['role'] + '\\n' }}
    {%- if message['content'] is string %}
        {{- message['content'] }}
    {%- elif message['content'] is defined and message['content'] is not none %}
        {%- for part in message['content'] %}
            {%- if part['type'] == 'text' %}
                {{- part['text'] }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {%- for call in message['tool_calls'] or [] %}
        {%- set function = call['function'] if call['function'] is defined else call %}
        {%- set arguments = function['arguments'] %}
        {%- set arguments = arguments if arguments is string else arguments | tojson %}
        {{- '\\n<tool_call>\\n{\\"name\\": \\"' + function['name'] + '\\", \\"arguments\\": ' }}
        {{- arguments + '}\\n</tool_call>' }}
    {%- endfor %}
    {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
TOOL_CALL_TAGS = ("<tool_call>", "</tool_call>")
"""How the synthetic template asks a model to call a function (Hermes' and Qwen's convention)."""

# The same for vision tokenizers, except that an `image` or `image_url` content part is rendered as
# `<|vision_start|><|image_pad|><|vision_end|>` in its place, as in Qwen2-VL/Qwen3-VL's templates.
_TEXT_PART = """\
            {%- if part['type'] == 'text' %}
                {{- part['text'] }}
"""
VISION_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    _TEXT_PART,
    _TEXT_PART
    + """\
            {%- elif part['type'] in ['image', 'image_url'] %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
""",
)
assert VISION_CHAT_TEMPLATE != CHAT_TEMPLATE

# Our own training text: prose, dialogue, lists, numbers, code, JSON and a little non-ASCII. It is big enough
# for the trainer to reach 1024 tokens.
CORPUS = """\
The lighthouse keeper climbed the spiral stairs every evening at half past six. There were one hundred and
twelve steps, and she had counted them so often that her feet knew the number before her head did. From the
lamp room she could see the whole bay: the fishing boats coming home, the gulls circling the harbour wall,
and the long grey line where the sea met the sky. On clear nights the beam reached almost twenty miles.

Most people imagine that a lighthouse is a lonely place, but the keeper never thought so. The radio crackled
with weather reports, the supply boat arrived every second Tuesday, and the village children rowed out in
summer to ask questions. "Does the light ever go out?" they wanted to know. "Only when I forget to wind the
clock," she would answer, and then she would laugh, because she had never forgotten, not even once.

Baking bread at home is easier than it looks. Mix five hundred grams of flour with ten grams of salt, seven
grams of dried yeast and about three hundred and fifty millilitres of warm water. Knead the dough for ten
minutes until it feels smooth and springy, then cover the bowl and leave it somewhere warm for an hour. When
it has doubled in size, shape it into a loaf, let it rise again, and bake it at 220 degrees for thirty-five
minutes. Tap the bottom: a hollow sound means it's done. Don't slice it until it has cooled a little!

Rivers shape the land slowly. Water carries sand and gravel downstream, cutting valleys into hills and
building wide plains where it spreads out and slows down. Over thousands of years a small stream can carve a
canyon, and a great river can push its delta far into the ocean. Scientists measure these changes with
satellites, tide gauges and careful surveys, comparing old maps with new ones to see how coastlines move.

A short conversation at the train station:
"Excuse me, which platform does the 9:45 to Northfield leave from?"
"Platform four, but it's running about twelve minutes late today."
"Thank you. Is there somewhere I could get a coffee while I wait?"
"There's a kiosk by the main entrance. They also sell sandwiches, fruit and newspapers."
"Perfect. I'll be back before it arrives."

Computers store numbers in binary, using only the digits zero and one. A single byte holds eight bits, which
gives 256 possible values, from 0 to 255. Two bytes give 65,536 values, and four bytes give 4,294,967,296.
Floating-point numbers trade exactness for range: 0.1 + 0.2 is not exactly 0.3, which surprises almost every
programmer the first time they notice it. Prices, therefore, are often stored as whole cents: $12.99 becomes
1299, and €7.50 becomes 750.

Here is a checklist for a weekend hike:
1. Check the forecast on Friday evening and again on Saturday morning.
2. Pack water (at least two litres), snacks, a map, a compass and a warm layer.
3. Tell a friend where you're going and when you expect to return.
4. Wear boots you've already broken in; new boots cause blisters.
5. Leave nothing behind except footprints, and take nothing except photographs.

def moving_average(values: list[float], window: int = 3) -> list[float]:
    \"\"\"Return the average of each run of `window` consecutive values.\"\"\"
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    for start in range(len(values) - window + 1):
        chunk = values[start : start + window]
        averages.append(sum(chunk) / window)
    return averages


class Counter:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, word: str) -> None:
        self.counts[word] = self.counts.get(word, 0) + 1

for i in range(10):
    print(f"step {i}: value={i * i}")

{"name": "river-survey", "version": "1.4.2", "enabled": true, "threshold": 0.75, "tags": ["water", "maps"]}
SELECT city, COUNT(*) AS visits FROM trips WHERE year >= 2021 GROUP BY city ORDER BY visits DESC;

The museum opened a new exhibition about early flight. Visitors can walk beneath a full-size model of a
wooden glider, read the notebooks of the engineers who built it, and try a simple wind tunnel that shows how
air flows over a curved wing. One display explains why birds fold their wings when they dive, and another
compares the weight of a modern jet engine with the weight of the first motors, which were barely stronger
than a lawnmower. School groups visit on weekday mornings; families tend to come on Sundays.

Good writing is mostly rewriting. Write the first draft quickly, without worrying about every word. Then read
it aloud, cut what is unnecessary, and replace vague phrases with concrete ones. Ask yourself what the reader
needs to know first, and put it there. Short sentences are clear. Longer sentences, used carefully, can carry
a rhythm that keeps the reader moving forward through a complicated idea.

Questions people often ask about the garden: When should tomatoes be planted? After the last frost, usually
in late spring. How often should they be watered? Deeply, about twice a week, rather than a little every day.
Why are the leaves turning yellow? Perhaps too much water, perhaps too little sunlight, or perhaps the soil
needs feeding. What about the snails? Patience, a torch after dark, and a bucket.

Some words travel between languages: a café on the corner, a naïve plan, a façade of polished stone, the
jalapeño in the salsa, a résumé sent by email, déjà vu on a quiet afternoon. Greetings from around the world:
こんにちは, 你好, 안녕하세요, Привет, Γειά σου, مرحبا, שלום, and नमस्ते. 日本語 and 中文 are written with
thousands of characters. Temperatures: 21°C is about 70°F. Math: π ≈ 3.14159, √2 ≈ 1.41421, and a ≤ b ≠ c.
Emoji: 🙂 😀 🎉 🚀 🌍 ❤️ 👍 — they are stored as several bytes each.

Punctuation matters: commas, semicolons; colons: dashes - and em dashes — parentheses (like these), brackets
[like these], braces {like these}, quotes "double" and 'single', question marks? exclamation marks! Also the
ellipsis... the slash / the backslash \\ the pipe | the ampersand & the at sign @ the hash # the percent %
the caret ^ the asterisk * the plus + the equals = the tilde ~ and the backtick `.

Dates and times: Monday 3 March 2025 at 08:30; Friday 14 November 1997 at 23:59; the year 1066; the 1990s;
phone 555-0134; order #48213; version 2.0.1; 3.5 kg; 12 km/h; 100%; 1/2; 3/4; 7×8 = 56; 2^10 = 1024.

Every autumn the swallows gather on the telephone wires, chattering and rearranging themselves, until one
morning they are simply gone. Nobody sees them leave. Somewhere far to the south they will spend the winter
in warm reed beds, and in April, without a map or a calendar, they will find their way back to the very same
barn, the very same beam, and sometimes the very same nest.
"""


def _build_tokenizer() -> Tokenizer:
    """An untrained BPE tokenizer with the Qwen2 normalizer, pre-tokenizer, decoder and post-processor."""
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    return tokenizer


def _with_qwen_decoder_settings(tokenizer: Tokenizer) -> Tokenizer:
    """Copy of `tokenizer` whose ByteLevel decoder carries Qwen's (inert) settings.

    `decoders.ByteLevel()` takes no arguments and serializes the defaults (`add_prefix_space: true`, ...);
    the decoder ignores them, but Qwen checkpoints ship `false`, so set them through the JSON form.
    """
    data = json.loads(tokenizer.to_str())
    data["decoder"] = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    return Tokenizer.from_str(json.dumps(data))


def train_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE, *, vision: bool = False) -> Tokenizer:
    """Train the byte-level BPE tokenizer on `CORPUS`; the special tokens get ids 0, 1 and 2.

    With `vision`, the BPE is trained to `vocab_size - 5` and the `VISION_TOKENS` are added after it as
    special tokens, so that they take ids `vocab_size - 5` .. `vocab_size - 1`.
    """
    tokenizer = _build_tokenizer()
    trainer = BpeTrainer(
        vocab_size=vocab_size - len(VISION_TOKENS) if vision else vocab_size,
        min_frequency=0,
        show_progress=False,
        special_tokens=[AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    for token_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != token_id:
            raise RuntimeError(
                f"special token {token!r} got id {tokenizer.token_to_id(token)}, not {token_id}"
            )
    if vision:
        tokenizer.add_special_tokens(
            [AddedToken(token, special=True, normalized=False) for token in VISION_TOKENS]
        )
        for token_id, token in _vision_token_ids(vocab_size).items():
            if tokenizer.token_to_id(token) != token_id:
                raise RuntimeError(
                    f"vision token {token!r} got id {tokenizer.token_to_id(token)}, not {token_id} (the "
                    f"BPE has {tokenizer.get_vocab_size(with_added_tokens=False)} tokens, not "
                    f"{vocab_size - len(VISION_TOKENS) - len(SPECIAL_TOKENS)})"
                )
    return _with_qwen_decoder_settings(tokenizer)


def _vision_token_ids(vocab_size: int) -> dict[int, str]:
    """The ids of the vision tokens in a vision tokenizer of `vocab_size` tokens: the top five."""
    return {vocab_size - len(VISION_TOKENS) + i: token for i, token in enumerate(VISION_TOKENS)}


def _added_token_entry(token: str) -> dict[str, Any]:
    """How Hugging Face checkpoints describe a special token in `added_tokens_decoder`."""
    return {
        "content": token,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }


def _additional_special_tokens(vision: bool) -> list[str]:
    return [*SPECIAL_TOKENS[1:], *(VISION_TOKENS if vision else ())]


def tokenizer_config(
    model_max_length: int = DEFAULT_MODEL_MAX_LENGTH, *, vocab_size: int | None = None, vision: bool = False
) -> dict[str, Any]:
    """The `tokenizer_config.json` contents, as a Qwen2.5/Qwen3 (with `vision`: Qwen3-VL) checkpoint ships it.

    A vision config (which needs the tokenizer's `vocab_size`) also lists the vision tokens, names them
    (`image_token`, `video_token`, `vision_start_token`, `vision_end_token`) and has the vision chat
    template.
    """
    added_tokens = dict(enumerate(SPECIAL_TOKENS))
    if vision:
        if vocab_size is None:
            raise ValueError("a vision tokenizer config needs the tokenizer's vocab_size")
        added_tokens.update(_vision_token_ids(vocab_size))
    config: dict[str, Any] = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(token_id): _added_token_entry(token) for token_id, token in added_tokens.items()
        },
        "additional_special_tokens": _additional_special_tokens(vision),
        "bos_token": None,
        "chat_template": VISION_CHAT_TEMPLATE if vision else CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": SPECIAL_TOKENS[IM_END_ID],
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": SPECIAL_TOKENS[ENDOFTEXT_ID],
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    if vision:
        config.update(
            image_token=IMAGE_TOKEN,
            video_token=VIDEO_TOKEN,
            vision_end_token=VISION_END_TOKEN,
            vision_start_token=VISION_START_TOKEN,
        )
    return dict(sorted(config.items()))


def special_tokens_map(*, vision: bool = False) -> dict[str, Any]:
    """The `special_tokens_map.json` contents."""

    def entry(token: str) -> dict[str, Any]:
        return {key: value for key, value in _added_token_entry(token).items() if key != "special"}

    return {
        "additional_special_tokens": _additional_special_tokens(vision),
        "eos_token": entry(SPECIAL_TOKENS[IM_END_ID]),
        "pad_token": entry(SPECIAL_TOKENS[ENDOFTEXT_ID]),
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer(
    out_dir: Path,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    *,
    model_max_length: int = DEFAULT_MODEL_MAX_LENGTH,
    vision: bool = False,
) -> None:
    """Train the tokenizer and write `tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json`.

    Deterministic: the same arguments give byte-identical files. The vocabulary has exactly `vocab_size`
    entries for any size from 259 (3 special tokens + 256 bytes; 264 with `vision`) up to what `CORPUS`
    allows (well above 1024); use `tokenizer_vocab_size` to read the true size back. With `vision` the
    top five ids are the `VISION_TOKENS` (see `train_tokenizer`).

    `vision` (what `make_model` writes for a model with a `vision_config`): the five vision special tokens at
    the top five ids, in the Qwen2-VL/Qwen3-VL release's order (`<|vision_start|>`, `<|vision_end|>`,
    `<|vision_pad|>`, `<|image_pad|>`, `<|video_pad|>`), named in `tokenizer_config.json` (`image_token`,
    `video_token`, `vision_start_token`, `vision_end_token`), and a chat template that renders an image part
    as `<|vision_start|><|image_pad|><|vision_end|>`.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_tokenizer(vocab_size, vision=vision).save(str(out_dir / "tokenizer.json"), pretty=True)
    config = tokenizer_config(model_max_length, vocab_size=vocab_size, vision=vision)
    _write_json(out_dir / "tokenizer_config.json", config)
    _write_json(out_dir / "special_tokens_map.json", special_tokens_map(vision=vision))


def tokenizer_vocab_size(out_dir: Path) -> int:
    """Number of token ids in `out_dir/tokenizer.json`, added tokens included (ids are 0..size-1)."""
    return Tokenizer.from_file(str(Path(out_dir) / "tokenizer.json")).get_vocab_size(with_added_tokens=True)


def vision_token_mismatches(out_dir: Path, config: Mapping[str, Any]) -> list[str]:
    """How a model config's vision token ids (`VISION_TOKEN_ID_KEYS`) disagree with `out_dir/tokenizer.json`.

    One line per disagreeing (or missing) id; empty when the config and the tokenizer agree.
    """
    tokenizer = Tokenizer.from_file(str(Path(out_dir) / "tokenizer.json"))
    mismatches = []
    for key, token in VISION_TOKEN_ID_KEYS.items():
        expected = tokenizer.token_to_id(token)
        if expected is None:
            mismatches.append(f"{key} is {config.get(key)}, but the tokenizer has no {token}")
        elif config.get(key) != expected:
            mismatches.append(f"{key} is {config.get(key)}, but the tokenizer has {token} at id {expected}")
    return mismatches


def check_vision_token_ids(out_dir: Path, config: Mapping[str, Any], *, strict: bool = True) -> None:
    """Raise ValueError unless the config's vision token ids are those of the tokenizer in `out_dir`.

    Without `strict` a disagreement is only logged: for a model whose vocabulary is larger than the
    synthetic tokenizer's, which may keep a release's ids that the tokenizer cannot hold.
    """
    mismatches = vision_token_mismatches(out_dir, config)
    if not mismatches:
        return
    message = f"config vision token ids do not match the tokenizer in {out_dir}: {'; '.join(mismatches)}"
    if strict:
        raise ValueError(message)
    log.warning("%s", message)

"""Tokenizer and chat template of a local Hugging Face model directory, without `transformers`.

`Tokenizer.from_dir` reads `tokenizer.json` with the `tokenizers` library and the special tokens and chat
template from `tokenizer_config.json` (or `chat_template.jinja`). Chat templates are rendered the way
`transformers` renders them (same Jinja environment, variables and message normalization), so prompts and
token ids match `AutoTokenizer.apply_chat_template`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cache, cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"

# The named special tokens of a transformers tokenizer; any other `*_token` key of the config is a
# model-specific special token (e.g. `image_token`) and is passed to chat templates as well.
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Names a message's reasoning may be given under; templates read `reasoning_content` (or `thinking`).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

ChatTemplate = str | dict[str, str]


def _byte_level_table() -> dict[str, int]:
    """GPT-2 byte-level BPE's character for each byte, inverted: printable bytes stand for themselves, the
    others for the characters from U+0100 up, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return {c: b for b, c in chars.items()}


_UNICODE_TO_BYTE = _byte_level_table()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Tokenizer:
    """Tokenizer and chat template of a local HF model directory (tokenizer.json + tokenizer_config.json)."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        chat_template: ChatTemplate | None = None,
        eos_token_ids: Sequence[int] = (),
        source: str = "<in-memory tokenizer>",
    ) -> None:
        """Wrap a `tokenizers.Tokenizer`; most callers want `Tokenizer.from_dir` instead.

        `special_tokens` maps attribute names (`eos_token`, `image_token`, ...) to token strings and is passed
        to the chat template; `source` names the model in error messages.
        """
        self._backend = backend
        self._special_tokens = dict(special_tokens or {})
        self._chat_template = chat_template
        self._eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self._source = source

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer of the model directory `path`.

        Raises `FileNotFoundError` when `path/tokenizer.json` does not exist, and `ValueError` naming the
        file for one that cannot be read (a corrupt tokenizer or JSON file, a chat template that does not
        compile). `tokenizer_config.json`, `chat_template.jinja`, `special_tokens_map.json` and
        `generation_config.json` are optional.
        """
        model_dir = Path(path)
        tokenizer_file = model_dir / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"No {TOKENIZER_FILE} in model directory {model_dir}: {tokenizer_file} not found"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the tokenizers library raises its own untyped errors
            raise ValueError(f"{tokenizer_file}: not a readable tokenizer: {exc}") from None
        config = _read_json(model_dir / TOKENIZER_CONFIG_FILE)
        special_tokens = _special_tokens(config, model_dir / SPECIAL_TOKENS_MAP_FILE)
        _register_special_tokens(backend, [*special_tokens.values(), *_extra_special_tokens(config)])
        _configure_backend(backend, config)
        return cls(
            backend,
            special_tokens=special_tokens,
            chat_template=_load_chat_template(model_dir, config),
            eos_token_ids=_eos_token_ids(model_dir, backend, special_tokens.get("eos_token")),
            source=str(model_dir),
        )

    # Token ids.

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the tokenizer's post-processor (e.g. a BOS).
        Without offsets, and with the GIL released while it runs (other threads, an event loop, go on)."""
        return self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`, leaving out special tokens unless `skip_special_tokens` is false.

        No `clean_up_tokenization_spaces` post-processing is applied (transformers skips it for BPE too).
        """
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The token string of `token_id`, or None if the vocabulary has no such id."""
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """Id of the token string `token`, or None if it is not in the vocabulary."""
        return self._backend.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes `token_id` stands for on its own (empty for an id outside the vocabulary). Exact for
        byte-level BPE, where a token may hold part of a multi-byte character (its own bytes, where its
        decoded text would be U+FFFD), and for SentencePiece's pieces and byte fallbacks (`▁the`, `<0xE2>`);
        an added token's is its content, and any other's its decoded text."""
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        form = self._piece_form
        if token_id not in self._added_ids and form == "byte_level":
            if all(c in _UNICODE_TO_BYTE for c in piece):
                return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        elif token_id not in self._added_ids and form == "sentencepiece":
            fallback = _BYTE_FALLBACK.fullmatch(piece)
            return bytes([int(fallback[1], 16)]) if fallback else piece.replace("\u2581", " ").encode()
        return self.decode([token_id], skip_special_tokens=False).encode()

    @cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self._backend.get_added_tokens_decoder())

    @cached_property
    def _piece_form(self) -> str:
        """How the vocabulary's pieces spell bytes: "byte_level" (GPT-2's byte-to-character table),
        "sentencepiece" (▁ for a space, `<0x..>` byte fallbacks) or "text" (pieces decode to themselves)."""
        decoder = self._backend.decoder
        state = decoder.__getstate__().decode() if decoder is not None else ""
        if '"ByteLevel"' in state:
            return "byte_level"
        return "sentencepiece" if '"ByteFallback"' in state or '"Metaspace"' in state else "text"

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer` (e.g. for `tokenizers.decoders.DecodeStream`)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of tokens, added tokens included (`len()` of the transformers tokenizer)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    # Special tokens.

    @property
    def special_tokens(self) -> dict[str, str]:
        """The special tokens by attribute name (`eos_token`, ...), as passed to the chat template."""
        return dict(self._special_tokens)

    @property
    def bos_token(self) -> str | None:
        """The beginning-of-sequence token, if the model has one."""
        return self._special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        """The end-of-sequence token of the tokenizer config, if any."""
        return self._special_tokens.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        """The padding token, if any."""
        return self._special_tokens.get("pad_token")

    @property
    def eos_token_ids(self) -> list[int]:
        """Ids that end generation: generation_config.json's `eos_token_id`, else the config's eos token."""
        return list(self._eos_token_ids)

    # Chat template.

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The chat template source, or a dict of named templates, or None if the model has none."""
        return self._chat_template

    def chat_template_mentions(self, text: str) -> bool:
        """Whether any of the model's chat templates holds `text` (a tag it asks the model to write)."""
        templates = self._chat_template
        sources = templates.values() if isinstance(templates, dict) else [templates or ""]
        return any(text in source for source in sources)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        *,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` with the chat template; return the prompt text, or its ids if `tokenize`.

        `template_kwargs` (e.g. `tools`, `documents`, `enable_thinking`) are passed to the template, as
        are the special tokens. `chat_template` overrides the model's template: either the name of one of
        its named templates or a template source. The ids are those of the text encoded without added
        special tokens. Raises `ValueError` when there is no template or no message, and
        `jinja2.TemplateError` for errors the template raises itself (`raise_exception`).
        """
        if not messages:
            raise ValueError("Cannot apply the chat template to an empty conversation")
        source = self._select_template(chat_template, template_kwargs.get("tools"))
        variables = {**self._special_tokens, **template_kwargs}
        variables.update(
            messages=_normalize_messages(messages),
            tools=variables.get("tools"),
            documents=variables.get("documents"),
            add_generation_prompt=add_generation_prompt,
        )
        rendered = _compile_template(source).render(**variables)
        return self.encode(rendered, add_special_tokens=False) if tokenize else rendered

    def _select_template(self, chat_template: str | None, tools: Any) -> str:
        """The template source to render, chosen as transformers chooses it."""
        templates = self._chat_template
        if isinstance(templates, dict):
            if chat_template is not None:
                return templates.get(chat_template, chat_template)
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError(
                f"Model {self._source} has several chat templates and no default; "
                f"pass chat_template= one of {sorted(templates)}"
            )
        if chat_template is not None:
            return chat_template
        if templates is None:
            raise ValueError(
                f"Model {self._source} has no chat template (neither {CHAT_TEMPLATE_FILE} nor a "
                f"chat_template entry in {TOKENIZER_CONFIG_FILE})"
            )
        return templates


# Loading.


def _read_json(path: Path) -> dict[str, Any]:
    """Contents of the JSON object file `path`, or an empty dict if there is no such file."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not contain a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """The token string of a config value: a string, or a serialized AddedToken dict, or None."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _special_tokens(config: Mapping[str, Any], special_tokens_map_file: Path) -> dict[str, str]:
    """Named and model-specific special tokens, by attribute name, as transformers 5 collects them.

    Every `*_token` entry of the config with a token value counts, plus the entries of an
    `extra_special_tokens` dict. `special_tokens_map.json` is only read for legacy configs without
    `added_tokens_decoder`, whose special tokens it overrides.
    """
    entries = dict(config)
    if "added_tokens_decoder" not in config:
        entries.update(_read_json(special_tokens_map_file))
    extra = entries.get("extra_special_tokens")
    if isinstance(extra, dict):
        entries = {**entries, **extra}
    tokens: dict[str, str] = {}
    for key, value in entries.items():
        content = _token_content(value)
        if content is not None and key.endswith("_token"):
            tokens[key] = content
    return tokens


def _extra_special_tokens(config: Mapping[str, Any]) -> list[str]:
    """The config's list of extra special tokens (`extra_special_tokens` or `additional_special_tokens`)."""
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    if not isinstance(extra, list):
        return []
    return [content for content in map(_token_content, extra) if content is not None]


def _register_special_tokens(backend: tokenizers.Tokenizer, tokens: Sequence[str]) -> None:
    """Register the special tokens that tokenizer.json lacks as special added tokens, as transformers does."""
    known = {added.content for added in backend.get_added_tokens_decoder().values()}
    missing = [token for token in dict.fromkeys(tokens) if token not in known]
    if missing:
        backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in missing])


def _configure_backend(backend: tokenizers.Tokenizer, config: Mapping[str, Any]) -> None:
    """Apply the config's `split_special_tokens` (special tokens in text encoded as plain text).

    Like transformers 5, ignore the config's `add_bos_token`/`add_eos_token`: with a tokenizer.json, its
    post-processor alone decides what `add_special_tokens=True` adds.
    """
    backend.encode_special_tokens = bool(config.get("split_special_tokens", False))


def _load_chat_template(model_dir: Path, config: Mapping[str, Any]) -> ChatTemplate | None:
    """The model's chat template(s): template files win over the config's `chat_template` entry.

    `chat_template.jinja` is the default template and `additional_chat_templates/NAME.jinja` are named
    ones; a config may hold one template or a list of `{"name", "template"}` entries.
    """
    templates: dict[str, str] = {}
    default_file = model_dir / CHAT_TEMPLATE_FILE
    if default_file.is_file():
        templates["default"] = _checked_template(_read_text(default_file), default_file)
    template_dir = model_dir / CHAT_TEMPLATE_DIR
    if template_dir.is_dir():
        for template_file in sorted(template_dir.glob("*.jinja")):
            name = template_file.name.removesuffix(".jinja")
            templates[name] = _checked_template(_read_text(template_file), template_file)
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    template = config.get("chat_template")
    where = model_dir / TOKENIZER_CONFIG_FILE
    if isinstance(template, list):
        if not all(isinstance(e, dict) and isinstance(e.get("name"), str) for e in template):
            raise ValueError(f"{where}: chat_template must be a string or a list of {{name, template}}")
        return {e["name"]: _checked_template(e.get("template"), where) for e in template}
    return None if template is None else _checked_template(template, where)


def _checked_template(source: Any, where: Path) -> str:
    """`source` if it is a chat template that compiles; else ValueError naming `where` (and the line)."""
    if not isinstance(source, str):
        raise ValueError(f"{where}: a chat template must be a string, got {type(source).__name__}")
    try:
        _compile_template(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"{where}: chat template line {exc.lineno}: {exc.message}") from None
    return source


def _read_text(path: Path) -> str:
    """A text file's contents; ValueError naming it if it is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text: {exc}") from None


def _eos_token_ids(model_dir: Path, backend: tokenizers.Tokenizer, eos_token: str | None) -> list[int]:
    """generation_config.json's `eos_token_id` (int or list), else the id of `eos_token`; deduplicated."""
    configured = _read_json(model_dir / GENERATION_CONFIG_FILE).get("eos_token_id")
    if isinstance(configured, int):
        ids = [configured]
    elif isinstance(configured, list):
        ids = [int(token_id) for token_id in configured]
    else:
        eos_id = backend.token_to_id(eos_token) if eos_token is not None else None
        ids = [] if eos_id is None else [eos_id]
    return list(dict.fromkeys(ids))


# Chat template rendering.


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as transformers hands them to templates: None-valued keys dropped, reasoning aliased.

    A message's reasoning, under any name in `REASONING_FIELDS`, is also made available as `thinking`
    and `reasoning_content`.
    """
    normalized = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TypeError(f"Chat messages must be dicts, got {message!r}")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalized.append(message)
    return normalized


def _raise_exception(message: str) -> None:
    """Template global: fail rendering with `message`."""
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:
    """Template global: the current local time formatted with `format`."""
    return datetime.now().strftime(format)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Template filter: `json.dumps` without HTML escaping, keeping non-ASCII text, as in transformers."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _TemplateDict:
    """Template global `dict`: builds dicts but exposes no other attribute of the `dict` type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _check_namespace_name(name: object) -> None:
    """Refuse underscore-prefixed namespace attributes, which could reach Python internals."""
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"Chat templates cannot set the namespace attribute {name!r}")


class _TemplateNamespace(jinja2.utils.Namespace):
    """Template global `namespace`, refusing underscore-prefixed attribute names."""

    # No explicit `self`, like jinja's Namespace, so that `namespace(self=...)` works in templates.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        super().__setitem__(name, value)


class _GenerationTag(jinja2.ext.Extension):
    """The `{% generation %}...{% endgeneration %}` tag of training templates; renders its body unchanged."""

    tags = frozenset({"generation"})  # type: ignore[assignment]  # jinja2 annotates a set; it only reads it

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


@cache
def _environment() -> ImmutableSandboxedEnvironment:
    """The Jinja environment transformers renders chat templates in."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_TemplateDict(),
        namespace=_TemplateNamespace,
    )
    return environment


@lru_cache(maxsize=32)
def _compile_template(source: str) -> jinja2.Template:
    """Compile (and cache) the chat template `source`."""
    return _environment().from_string(source)

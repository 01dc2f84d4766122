"""Function calls in generated text: each call a `<tool_call>` block, the rest of the text the message's
content. A block holds the call in one of two forms, both read wherever the template asks for the tags:

- Hermes/Qwen's JSON object, `{"name": ..., "arguments": {...}}`;
- Qwen3-Coder's XML (Qwen3.5's templates), `<function=NAME>` then `<parameter=P>` VALUE `</parameter>` for
  each argument, `</function>`. A value is bare text: it becomes the JSON type the function's schema gives
  the parameter (an integer, a boolean, an object ...) where it reads as one, and stays a string otherwise
  (a string parameter, one the schema does not type, or text that is not of its type).

`ToolCallStream` reads the text as it streams: content comes out as soon as it cannot be the start of a
block, a call once its block is closed. A block in neither form stays in the content as written (the model
did not make a call), and so does one still open when the text ends. The whitespace between a call and the
next block, or the end, is no one's content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from common.detokenize import partial_suffix
from common.tokenizer import Tokenizer

HERMES_TAGS = ("<tool_call>", "</tool_call>")


@dataclass(frozen=True)
class ToolCall:
    """One function call: OpenAI's `tool_calls` entry."""

    name: str
    arguments: str
    """The arguments as JSON text (OpenAI's form, whatever form the model wrote them in)."""
    id: str

    def as_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class CallForm:
    """How one request's calls are read: the tags around a call, and for the XML form each function's
    parameters' JSON types (`call_form`)."""

    tags: tuple[str, str] = HERMES_TAGS
    types: Mapping[str, Mapping[str, tuple[str, ...]]] = field(default_factory=dict)
    """function name → parameter → the JSON types its schema allows (empty: untyped, read as a string)."""


def call_form(tags: tuple[str, str], tools: list[Any]) -> CallForm:
    """The form of calls to `tools` (OpenAI's tool objects, as the API checked them) inside `tags`."""
    types: dict[str, dict[str, tuple[str, ...]]] = {}
    for tool in tools:
        function = tool["function"]
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        properties = properties if isinstance(properties, dict) else {}
        types[function["name"]] = {name: _schema_types(schema) for name, schema in properties.items()}
    return CallForm(tags, types)


def _schema_types(schema: Any) -> tuple[str, ...]:
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
    return tuple(k for k in kinds if isinstance(k, str))


def tool_call_tags(tokenizer: Tokenizer) -> tuple[str, str] | None:
    """The tags a model's chat template asks it to wrap calls in, None when it asks for none this module
    reads (its template never mentions `<tool_call>`)."""
    templates = tokenizer.chat_template
    sources = templates.values() if isinstance(templates, dict) else [templates or ""]
    return HERMES_TAGS if any(HERMES_TAGS[0] in source for source in sources) else None


class ToolCallStream:
    """Splits streamed text into content and calls (`push` each piece, `flush` at the end)."""

    def __init__(self, form: CallForm | None = None) -> None:
        self.form = form or CallForm()
        self.start, self.end = self.form.tags
        self._held = ""
        """Text not yet returned: a possible start tag's beginning, or an open block."""
        self._open = False
        self._after_call = False
        """A call just closed: whitespace is held until text that is not a block follows."""
        self.calls = 0
        """Calls returned so far."""

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        """Add `text`; the content and the calls that became final."""
        buffer, content, calls = self._held + text, "", []
        while True:
            if self._open:
                at = buffer.find(self.end)
                if at < 0:
                    self._held = buffer
                    return content, calls
                block, buffer = buffer[:at], buffer[at + len(self.end) :]
                call = self._parse(block)
                if call is None:
                    content += self.start + block + self.end
                else:
                    calls.append(call)
                self._open, self._after_call = False, call is not None
                continue
            if self._after_call:
                rest = buffer.lstrip()
                if not rest or self.start.startswith(rest):  # only whitespace yet, or a tag's beginning
                    self._held = buffer
                    return content, calls
                self._after_call = False
                if rest.startswith(self.start):
                    buffer = rest
            at = buffer.find(self.start)
            if at < 0:
                keep = partial_suffix(buffer, [self.start])
                self._held = buffer[len(buffer) - keep :]
                return content + buffer[: len(buffer) - keep], calls
            content += buffer[:at]
            buffer = buffer[at + len(self.start) :]
            self._open = True

    def flush(self) -> str:
        """At the end of the text: what is still held, as content (an unclosed block as written)."""
        held, self._held = self._held, ""
        if self._open:
            self._open = False
            return self.start + held
        return held.lstrip() if self._after_call else held

    def _parse(self, block: str) -> ToolCall | None:
        read = _json_call(block) or _xml_call(block, self.form.types)
        if read is None:
            return None
        self.calls += 1
        name, arguments = read
        return ToolCall(name, arguments, f"call_{uuid.uuid4().hex[:24]}")


def split_tool_calls(text: str, form: CallForm | None = None) -> tuple[str, list[ToolCall]]:
    """A whole text's content and calls."""
    stream = ToolCallStream(form)
    content, calls = stream.push(text)
    return content + stream.flush(), calls


def _json_call(block: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a block in the JSON form; None for any other block."""
    try:
        value = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return value["name"], text


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _xml_call(block: str, types: Mapping[str, Mapping[str, tuple[str, ...]]]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a block in the XML form, each value typed by the function's schema;
    None for any other block (text outside the parameters but whitespace included)."""
    function = _FUNCTION.fullmatch(block)
    if function is None:
        return None
    name, body = function.group(1).strip(), function.group(2)
    params = list(_PARAMETER.finditer(body))
    outside = _PARAMETER.sub("", body)
    if not name or outside.strip():
        return None
    kinds = types.get(name, {})
    arguments = {}
    for param in params:
        key = param.group(1).strip()
        arguments[key] = _typed(_bare(param.group(2)), kinds.get(key, ()))
    return name, json.dumps(arguments, ensure_ascii=False)


def _bare(value: str) -> str:
    """A parameter's text without the line breaks that open and close it in the template's layout."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
    "object": (dict,),
    "array": (list,),
}


def _typed(text: str, kinds: tuple[str, ...]) -> Any:
    """`text` as the first of `kinds` (JSON types) it reads as; else the string itself."""
    for kind in kinds:
        if kind == "string":
            return text
        if kind == "boolean" and text.strip() in ("True", "False"):  # Python's spelling
            return text.strip() == "True"
        if kind not in _JSON_TYPES:
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            continue
        # bool is an int in Python: an integer or number parameter does not take true/false
        if isinstance(value, _JSON_TYPES[kind]) and not (isinstance(value, bool) and kind != "boolean"):
            return value
    return text

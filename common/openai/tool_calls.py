"""Function calls in generated text: each call a `<tool_call>` block, the rest of the text the message's
content. A block holds the call in one of two forms, both read wherever the template asks for the tags:

- Hermes/Qwen's JSON object, `{"name": ..., "arguments": {...}}`;
- Qwen3-Coder's XML (Qwen3.5's templates), `<function=NAME>` then `<parameter=P>` VALUE `</parameter>` for
  each argument, `</function>`. A value is bare text: it becomes the JSON type the function's schema gives
  the parameter (an integer, a boolean, an object ...) where it reads as one, and stays a string otherwise
  (a string parameter, one the schema does not type, or text that is not of its type).

`ToolCallStream` reads the text as it streams; `split_tool_calls` reads a whole text.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from common.text.detokenize import partial_suffix
from common.text.tokenizer import Tokenizer

HERMES_TAGS = ("<tool_call>", "</tool_call>")
XML_FUNCTION = "<function="
"""What a chat template that asks for the XML form writes before a call's name."""


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
    """function name → parameter → the JSON types its schema allows (empty: untyped, read as a string);
    the types of those it does not list under OTHERS."""


OTHERS = ">"
"""The key of a function's types under which the types of parameters its schema does not list are kept
(its `additionalProperties`); no parameter's name holds it."""


def call_form(tags: tuple[str, str], tools: list[Any]) -> CallForm:
    """The form of calls to `tools` (OpenAI's tool objects, as the API checked them) inside `tags`."""
    types: dict[str, dict[str, tuple[str, ...]]] = {}
    for tool in tools:
        function = tool["function"]
        parameters = function.get("parameters")
        types[function["name"]] = _parameter_types(parameters) if isinstance(parameters, dict) else {}
    return CallForm(tags, types)


def _parameter_types(parameters: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    """Each parameter's JSON types, from a function's parameters schema: its properties, those of the
    members of an anyOf / oneOf / allOf at its root, and its additionalProperties (under OTHERS), `$ref`s
    into the schema's own definitions followed (pydantic's nested models)."""
    types: dict[str, tuple[str, ...]] = {}

    def add(schema: Any, depth: int) -> None:
        schema = _resolved(schema, parameters)
        if not isinstance(schema, dict) or depth > _MAX_DEPTH:
            return
        properties = schema.get("properties")
        for name, prop in properties.items() if isinstance(properties, dict) else ():
            types[name] = tuple(dict.fromkeys(types.get(name, ()) + _schema_types(prop, parameters)))
        if isinstance(schema.get("additionalProperties"), dict):
            types[OTHERS] = _schema_types(schema["additionalProperties"], parameters)
        for key in ("anyOf", "oneOf", "allOf"):
            members = schema.get(key)
            for member in members if isinstance(members, list) else []:
                add(member, depth + 1)

    add(parameters, 0)
    return types


_MAX_DEPTH = 16
"""`$ref`s and nested members followed at most (a schema may refer to itself)."""


def _resolved(schema: Any, root: dict[str, Any], depth: int = 0) -> Any:
    """`schema`, or what its local `$ref` ("#/$defs/Name") names in `root` (None where nothing is there)."""
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    if not isinstance(ref, str) or not ref.startswith("#") or depth > _MAX_DEPTH:
        return schema
    target: Any = root
    for part in ref[1:].split("/")[1:]:
        target = target.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(target, dict) else None
    return _resolved(target, root, depth + 1)


def _schema_types(schema: Any, root: dict[str, Any] | None = None, depth: int = 0) -> tuple[str, ...]:
    """The JSON types a parameter's schema allows: its `type` (a name or a list), its `anyOf` / `oneOf` /
    `allOf` members' (pydantic's Optional[int] is anyOf integer, null), or its `enum` / `const` values';
    a `$ref` into `root` (the function's parameters) followed."""
    schema = _resolved(schema, root or {})
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return ()
    kind = schema.get("type")
    kinds = [kind] if isinstance(kind, str) else _strings(kind)
    for key in ("anyOf", "oneOf", "allOf"):
        members = schema.get(key)
        for member in members if isinstance(members, list) else []:
            kinds += _schema_types(member, root, depth + 1)
    values = schema.get("enum")
    values = list(values) if isinstance(values, list) else []
    if "const" in schema:
        values.append(schema["const"])
    kinds += [_json_type(v) for v in values]
    return tuple(dict.fromkeys(kinds))


def _strings(items: Any) -> list[str]:
    return [k for k in items if isinstance(k, str)] if isinstance(items, list) else []


def _json_type(value: Any) -> str:
    """The JSON type of a value from a schema (an enum's, a const's)."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", type(None): "null", list: "array", dict: "object"}.get(type(value), "string")


def xml_call_template(tokenizer: Tokenizer) -> bool:
    """Whether the model's chat template asks for calls in the XML form (Qwen3-Coder's <function=NAME>):
    a forced call is then held to that form (structured.call_structure)."""
    return tokenizer.chat_template_mentions(XML_FUNCTION)


def tool_call_tags(tokenizer: Tokenizer) -> tuple[str, str] | None:
    """The tags a model's chat template asks it to wrap calls in, None when it asks for none this module
    reads (its template never mentions `<tool_call>`)."""
    return HERMES_TAGS if tokenizer.chat_template_mentions(HERMES_TAGS[0]) else None


@dataclass(frozen=True)
class CallDelta:
    """A piece of a streamed call, as OpenAI's `tool_calls` delta entry: the first names the call (`id`,
    `name`), the rest carry more of its arguments' text."""

    index: int
    """The call's number in its choice."""
    arguments: str
    id: str | None = None
    name: str | None = None

    def as_openai(self) -> dict:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


class ToolCallStream:
    """Splits streamed text into content and calls (`push` each piece, `flush` at the end).

    A call streams as it is written where its form allows: its name as soon as a block opens with it (the
    JSON form's `{"name": ..., "arguments": {` or the XML form's `<function=NAME>`), then its arguments'
    text (the JSON form's as written, up to the object's end; the XML form's a parameter at a time). Such a
    call is a call even if the rest of its block turns out malformed (what was sent cannot be taken back;
    its arguments are what was written); any other block is read whole once it closes.

    Content comes out as soon as it cannot be the start of a block. A block that never names a call stays
    in the content as written; one still open at the end (cut by `max_tokens`) is a call once it names one
    (the JSON form's whole `"name"`), its arguments as written. The whitespace between a call and the next
    block, or the end, is no one's content."""

    def __init__(self, form: CallForm | None = None) -> None:
        self.form = form or CallForm()
        self.start, self.end = self.form.tags
        self._held = ""
        """Text not yet returned: a possible start tag's beginning, or an open block."""
        self._open = False
        self._after_call = False
        """A call just closed: whitespace is held until text that is not a block follows."""
        self._live: _LiveCall | None = None
        """The open block's call, once its name is known."""
        self._tried = False
        """The open block's beginning was read and names no call to stream: it is read whole at its end."""
        self.calls: list[ToolCall] = []
        """The calls so far."""

    def push(self, text: str) -> tuple[str, list[CallDelta]]:
        """Add `text`; the content and the pieces of calls now known."""
        buffer, content, deltas = self._held + text, "", []
        while True:
            if self._open:
                at = buffer.find(self.end)
                if at < 0:
                    self._held = buffer
                    deltas += self._stream(buffer[: len(buffer) - partial_suffix(buffer, [self.end])])
                    return content, deltas
                block, buffer = buffer[:at], buffer[at + len(self.end) :]
                deltas += self._stream(block)
                made = self._close(block, deltas)
                if not made:
                    content += self.start + block + self.end
                self._open, self._after_call = False, made
                continue
            if self._after_call:
                rest = buffer.lstrip()
                if not rest or self.start.startswith(rest):  # only whitespace yet, or a tag's beginning
                    self._held = buffer
                    return content, deltas
                self._after_call = False
                if rest.startswith(self.start):
                    buffer = rest
            at = buffer.find(self.start)
            if at < 0:
                keep = partial_suffix(buffer, [self.start])
                self._held = buffer[len(buffer) - keep :]
                return content + buffer[: len(buffer) - keep], deltas
            content += buffer[:at]
            buffer = buffer[at + len(self.start) :]
            self._open, self._tried = True, False

    def flush(self) -> tuple[str, list[CallDelta]]:
        """At the end of the text: what is still held, as content (an unclosed block as written, unless its
        call was streamed: that call ends there), and the last pieces of calls."""
        held, self._held = self._held, ""
        if not self._open:
            return (held.lstrip() if self._after_call else held), []
        self._open, deltas = False, self._stream(held)
        if self._live is not None:
            self._close(held, deltas)
            return "", deltas
        cut = _cut_call(held)
        if cut is None:
            return self.start + held, []
        call = ToolCall(*cut, _call_id())
        self.calls.append(call)
        return "", [CallDelta(len(self.calls) - 1, call.arguments, call.id, call.name)]

    def _stream(self, block: str) -> list[CallDelta]:
        """The pieces the open block's text so far (`block`, a prefix of the whole) adds to its call."""
        deltas = []
        if self._live is None and not self._tried:
            self._live, self._tried = _LiveCall.start(block, len(self.calls), self.form.types)
            if self._live is not None:
                live = self._live
                deltas.append(CallDelta(live.index, "", live.id, live.name))
        if self._live is not None:
            more = self._live.read(block)
            if more:
                deltas.append(CallDelta(self._live.index, more))
        return deltas

    def _close(self, block: str, deltas: list[CallDelta]) -> bool:
        """End the open block (its whole text `block`): its call, if it makes one, with the pieces that
        complete it added to `deltas`."""
        live, self._live = self._live, None
        if live is not None:
            rest = live.ending()
            if rest:
                deltas.append(CallDelta(live.index, rest))
            self.calls.append(ToolCall(live.name, live.sent, live.id))
            return True
        read = _json_call(block)
        if read is None:
            return False
        call = ToolCall(*read, _call_id())
        deltas.append(CallDelta(len(self.calls), call.arguments, call.id, call.name))
        self.calls.append(call)
        return True


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_JSON_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_XML_HEAD = re.compile(r"\s*<function=([^>\n]+)>")


@dataclass
class _LiveCall:
    """A call streamed as its block is written: its arguments' text read from each longer prefix of the
    block (`read`), what has been sent of it (`sent`)."""

    index: int
    id: str
    name: str
    begin: int
    """Where the arguments start in the block."""
    xml: bool
    types: Mapping[str, tuple[str, ...]]
    sent: str = ""
    at: int = 0
    """JSON: how far the object's scan has read; its depth, and whether inside a string or an escape."""
    depth: int = 0
    quoted: bool = False
    escaped: bool = False
    closed: bool = False
    """JSON: the object ended; XML: the function's closing tag came."""
    params: list[str] = field(default_factory=list)
    """XML: the parameters read, as `"key": value` JSON text."""
    seen: int = 0
    """XML: how much of the block the last read searched."""

    @staticmethod
    def start(block: str, index: int, types: Mapping) -> tuple[_LiveCall | None, bool]:
        """The call a block's beginning names, if it streams (None: not yet, or never), and whether that is
        settled (a beginning that cannot grow into a call's head never will)."""
        head = _XML_HEAD.match(block)
        if head is not None and head.group(1).strip():
            name = head.group(1).strip()
            return _LiveCall(
                index, _call_id(), name, head.end(), True, types.get(name, {}), at=head.end()
            ), True
        head = _JSON_HEAD.match(block)
        if head is None or len(block) == head.end():  # no head yet, or its arguments' first character
            return None, not (_json_head_possible(block) or _xml_head_possible(block))
        if block[head.end()] != "{":  # arguments as a JSON string (or not an object): read whole at the end
            return None, True
        name = json.loads(f'"{head.group(1)}"')
        return _LiveCall(index, _call_id(), name, head.end(), False, {}, at=head.end()), True

    def read(self, block: str) -> str:
        """More of the arguments' text, from the block's text so far (nothing once they are closed)."""
        if self.closed:
            return ""
        text = self._xml_text(block) if self.xml else self._json_text(block)
        more, self.sent = text[len(self.sent) :], text
        return more

    def ending(self) -> str:
        """The text that completes the arguments at the block's end (an XML object's closing brace)."""
        if not self.xml or self.closed:
            return ""
        more = "}" if self.sent else "{}"
        self.sent += more
        return more

    def _json_text(self, block: str) -> str:
        for i in range(self.at, len(block)):
            if self.closed:
                break
            c = block[i]
            if self.escaped:
                self.escaped = False
            elif self.quoted:
                self.escaped, self.quoted = c == "\\", c != '"'
            elif c == '"':
                self.quoted = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                self.closed = self.depth == 0
            self.at = i + 1
        return block[self.begin : self.at]

    def _param(self, found: re.Match[str] | None) -> None:
        """Add a parameter read from the block (its name, then its value's text)."""
        if found is not None:
            key = found.group(1).strip()
            kinds = self.types.get(key, self.types.get(OTHERS, ()))
            value = json.dumps(_typed(_bare(found.group(2)), kinds), ensure_ascii=False)
            self.params.append(f"{json.dumps(key, ensure_ascii=False)}: {value}")

    def _xml_text(self, block: str) -> str:
        # From where the last parameter ended, and past what earlier reads searched (a tag may straddle).
        while not self.closed:
            start = max(self.at, self.seen - len(_PARAM_END))
            end, function_end = block.find(_PARAM_END, start), block.find("</function>", start)
            if function_end >= 0 and (end < 0 or function_end < end):
                self._param(_OPEN_PARAMETER.search(block, self.at, function_end))  # one left open: ends here
                self.closed = True
            elif end >= 0:
                self._param(_PARAMETER.search(block, self.at, end + len(_PARAM_END)))
                self.at = end + len(_PARAM_END)
                continue
            break
        self.seen = len(block)
        text = "{" + ", ".join(self.params) if self.params else ""
        if self.closed:
            text = text + "}" if self.params else "{}"
        return text


def _json_head_possible(block: str) -> bool:
    """Whether more text could still make `block` open as `{"name": "...", "arguments": `."""
    rest = block.lstrip()
    for part in ("{", '"name"', ":"):
        if len(rest) < len(part):
            return part.startswith(rest)
        if not rest.startswith(part):
            return False
        rest = rest[len(part) :].lstrip()
    name = re.match(r'"(?:[^"\\]|\\.)*("?)', rest)
    if name is None:
        return not rest
    if not name.group(1):  # the name still open
        return True
    rest = rest[name.end() :].lstrip()
    if not rest or not rest.startswith(","):
        return not rest
    rest = rest[1:].lstrip()
    for key in ('"arguments"', '"parameters"'):
        if len(rest) < len(key) and key.startswith(rest):
            return True
        if rest.startswith(key):
            after = rest[len(key) :].lstrip()
            return not after or after.startswith(":")
    return False


def _xml_head_possible(block: str) -> bool:
    """Whether more text could still make `block` open as `<function=NAME>`."""
    rest = block.lstrip()
    tag = XML_FUNCTION
    if len(rest) <= len(tag):
        return tag.startswith(rest)
    return rest.startswith(tag) and ">" not in rest and "\n" not in rest


def split_tool_calls(text: str, form: CallForm | None = None) -> tuple[str, list[ToolCall]]:
    """A whole text's content and calls."""
    stream = ToolCallStream(form)
    content, _ = stream.push(text)
    rest, _ = stream.flush()
    return content + rest, stream.calls


def _json_call(block: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a block in the JSON form; None for any other block."""
    value = _json_value(block)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return value["name"], text


_NAMED = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*(.*)', re.DOTALL)


def _cut_call(block: str) -> tuple[str, str] | None:
    """(name, the arguments' text as written) of a JSON-form block cut off after its call's whole name;
    None when its beginning names none."""
    named = _NAMED.match(block)
    if named is None:
        return None
    name = _json_value(f'"{named.group(1)}"')
    if not isinstance(name, str) or not name:
        return None
    arguments = _ARGUMENTS.match(block, named.end())
    return name, arguments.group(1) if arguments is not None else ""


_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_PARAM_END = "</parameter>"
_OPEN_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*)", re.DOTALL)  # one the model left open


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
    """`text` as a value of one of `kinds` (JSON types), the others before a string's (order-free: a text
    that reads as one of them is one); else the string itself."""
    value = _json_value(text)
    for kind in kinds:
        if kind == "boolean" and text.strip() in ("True", "False"):  # Python's spelling
            return text.strip() == "True"
        if kind == "integer" and isinstance(value, float) and value.is_integer():  # 3.0, 1e3
            return int(value)
        # bool is an int in Python: an integer or number parameter does not take true/false
        fits = isinstance(value, _JSON_TYPES.get(kind, ())) and not (
            isinstance(value, bool) and kind != "boolean"
        )
        if fits:
            return value
    return text


_NOT_JSON = object()


def _json_value(text: str) -> Any:
    """`text` as JSON, _NOT_JSON where it is not (or holds NaN or an infinity, which JSON has not, or is
    too large or deep to read)."""

    def refuse(constant: str) -> Any:
        raise ValueError(constant)

    try:
        value = json.loads(text, parse_constant=refuse)
    except (ValueError, RecursionError):
        return _NOT_JSON
    return value if not isinstance(value, float) or math.isfinite(value) else _NOT_JSON

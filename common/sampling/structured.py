"""Structured output: a request's `response_format` (a JSON object, or one that follows a JSON schema) as a
grammar that masks, step by step, the tokens that cannot continue it (xgrammar).

A request carries its form as JSON text (`SamplingParams.structure`): `{"schema": S}`, and for a forced
function call (`call_structure`) the call's tags around it, `{"schema": S, "before": ..., "after": ...}`, or,
where the chat template asks for calls in Qwen3-Coder's XML form, `{"xml_calls": [{"name": ..., "parameters":
P}, ...], "tags": [open, close]}`.
Each worker that samples for it compiles that once for its vocabulary (`Grammars`, cached), on a thread
beside its loop, and keeps a matcher per request, which reads every token the request generates, on the
host. The JSON has no free
whitespace: a model may otherwise pad it without end.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from common.config import GRAMMAR_MAX_BYTES
from common.sampling.grammar_threads import GrammarThreads
from common.text.tokenizer import Tokenizer

FORMS = 64
"""Compiled forms a worker keeps (each new one compiles once, on the grammars' thread)."""


class Unavailable(RuntimeError):
    """xgrammar is not installed."""


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise Unavailable(
            "structured output needs xgrammar, one of Spillway's dependencies: reinstall Spillway from its "
            "repository (pip install -e .)"
        ) from None
    return xgrammar


def preload() -> bool:
    """Import xgrammar now, where it is installed (whether it is): its import takes seconds (it imports
    transformers), which a server pays at its start rather than on its event loop at the first structured
    request."""
    try:
        _xgrammar()
    except Unavailable:
        return False
    return True


def structure_of(response_format: dict[str, Any] | None, max_bytes: int = GRAMMAR_MAX_BYTES) -> str:
    """The form an OpenAI `response_format` asks for, as `SamplingParams.structure` carries it: "" for
    text, else its JSON schema's form. Raises ValueError (the message for a 400) for a format that is not
    one of OpenAI's, a form over `max_bytes` or a schema that is not valid, Unavailable without xgrammar."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return ""
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema") if response_format else None
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("response_format json_schema needs json_schema.schema, a JSON schema object.")
    else:
        raise ValueError(f"response_format type {kind!r} is not one of text, json_object, json_schema.")
    return _checked({"schema": schema}, max_bytes)


XML_WHITESPACE = 1
"""Whitespace characters an XML call may hold between its tags (its values' text is free): one, the line
break of the template's layout, which the reader takes away (tool_calls._bare). Another whitespace
character there is allowed too (xgrammar's set), and stays in a string value."""
XML_EXCLUDES = ["</parameter>", "</function>", "</tool_call>"]
"""Text no string of an XML call's values may hold, a bare one or one inside a JSON value: where the reader
would see the value or the call end."""
_STRING_LIMITS = ("pattern", "format", "minLength", "maxLength")
"""A string schema's constraints that xgrammar's XML form holds with free text, past the excludes: left out
of a forced XML call's grammar (its strings are then only kept inside their parameter)."""


def call_structure(
    tools: list[dict[str, Any]],
    name: str | None,
    tags: tuple[str, str],
    xml: bool = False,
    max_bytes: int = GRAMMAR_MAX_BYTES,
) -> str:
    """A forced function call (tool_choice "required", or the function `name`) as a form: one call block
    in `tags` holding {"name": ..., "arguments": ...}, the arguments of the named function's (or any
    listed function's) parameter schema; with `xml`, the block in the XML form instead (<function=NAME>,
    then each argument as <parameter=KEY>VALUE</parameter>, in the schema's order). ValueError for a name
    that no tool has, or a form over `max_bytes`."""
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not functions:
        raise ValueError(f"tool_choice names {name!r}, which is not among the tools.")
    schemas = [(f["name"], _object_schema(f)) for f in functions]
    if xml:
        calls = [{"name": n, "parameters": parameters} for n, parameters in schemas]
        return _checked({"xml_calls": calls, "tags": list(tags)}, max_bytes)
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": n}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for n, parameters in schemas
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return _checked({"schema": schema, "before": tags[0] + "\n", "after": "\n" + tags[1]}, max_bytes)


def _object_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters schema (any object where it has none); ValueError where it is not an
    object's."""
    parameters = function.get("parameters")
    if parameters is None:
        return {"type": "object"}
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise ValueError(f"Function {function['name']!r}'s parameters are not a JSON schema of an object.")
    return parameters or {"type": "object"}


def size_refusal(structure: str, max_bytes: int) -> str | None:
    """Why a form (`SamplingParams.structure`) is not compiled: its JSON text is over `max_bytes`; None
    where it is not."""
    if len(structure) <= max_bytes:  # (json.dumps writes ASCII: a character a byte)
        return None
    return (
        f"The structured output's grammar is {len(structure):,} bytes of JSON, over the {max_bytes:,} this "
        "server compiles (--grammar-max-bytes)."
    )


def _checked(form: dict[str, Any], max_bytes: int) -> str:
    """`form` as `SamplingParams.structure` carries it, once it is known to be within `max_bytes` and its
    grammar to build (ValueError where not)."""
    text = json.dumps(form)  # in order: a schema's properties are written in the order it lists them
    refusal = size_refusal(text, max_bytes)
    if refusal is not None:
        raise ValueError(refusal)
    try:
        _grammar(text)
    except Unavailable:
        raise
    except Exception as exc:  # xgrammar's own error types, whatever the schema trips
        reason = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(exc).strip())  # less its log prefix
        raise ValueError(f"The JSON schema cannot be followed: {reason}") from None
    return text


def _grammar(structure: str) -> Any:
    """The grammar (xgrammar.Grammar) of a form: its schema's JSON, between its literal tags if any, or one
    of its XML calls."""
    xgr = _xgrammar()
    form = json.loads(structure)
    if "xml_calls" in form:
        return xgr.Grammar.from_structural_tag(json.dumps(_xml_calls_tag(form["xml_calls"], form["tags"])))
    body = xgr.Grammar.from_json_schema(json.dumps(form["schema"]), any_whitespace=False)
    if "before" not in form:
        return body
    literal = [xgr.Grammar.from_ebnf(f"root ::= {json.dumps(form[k])}") for k in ("before", "after")]
    return xgr.Grammar.concat(literal[0], body, literal[1])


def _xml_calls_tag(calls: list[dict[str, Any]], tags: list[str]) -> dict[str, Any]:
    """xgrammar's structural tag of one call block in the XML form, of any of `calls`: the block as
    Qwen3-Coder's chat template writes it, each argument's value held to its schema (xgrammar's qwen_xml
    style: a string's text bare, up to its </parameter>)."""
    blocks = [
        {
            "type": "tag",
            "begin": f"{tags[0]}\n<function={call['name']}>\n",
            "content": {
                "type": "json_schema",
                "json_schema": _free_strings(call["parameters"]),
                "style": "qwen_xml",
                "max_whitespace_cnt": XML_WHITESPACE,
                "excludes": XML_EXCLUDES,
            },
            "end": f"\n</function>\n{tags[1]}",
        }
        for call in calls
    ]
    return {"type": "structural_tag", "format": {"type": "or", "elements": blocks}}


def _free_strings(schema: Any) -> Any:
    """`schema` without its strings' _STRING_LIMITS, at every depth."""
    if isinstance(schema, list):
        return [_free_strings(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    kind = schema.get("type")
    string = kind == "string" or (isinstance(kind, list) and "string" in kind)
    return {k: _free_strings(v) for k, v in schema.items() if not (string and k in _STRING_LIMITS)}


class Grammars:
    """One vocabulary's compiled forms and the matchers made from them. The vocabulary's table and every
    compile are made on a thread of their own (GrammarThreads; xgrammar's compiler releases the GIL), so
    that a worker's loop goes on stepping its other requests while a form compiles: `prepare` starts a
    form's compile, its future says when it is done, and `matcher` waits for it."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, end_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self._thread = GrammarThreads("grammars")
        self._compiler = self._thread.submit(_compiler, tokenizer, vocab_size, tuple(end_ids))
        self._forms: OrderedDict[str, Future] = OrderedDict()
        """The latest forms' compiles (xgrammar.CompiledGrammar), by their text, the most recent last."""

    def prepare(self, structure: str) -> Future:
        """The compile of `structure`: started now unless it is among the latest FORMS."""
        form = self._forms.pop(structure, None)
        if form is None:
            form = self._thread.submit(lambda: self._compiler.result().compile_grammar(_grammar(structure)))
        self._forms[structure] = form
        while len(self._forms) > FORMS:
            self._forms.popitem(last=False)
        return form

    def give_up(self, form: Future) -> None:
        """Nobody waits for the compile `form` any more (past the time budget): the next compiles do not
        queue behind it (GrammarThreads.give_up). It runs on, and stays among the latest forms."""
        self._thread.give_up(form)

    def matcher(self, structure: str, form: Future | None = None) -> Any:
        """A fresh matcher of `structure` (xgrammar.GrammarMatcher), at the start of the text, from its
        compile `form` (`prepare`'s; default: looked up); waits for it, and raises what it raised."""
        return _xgrammar().GrammarMatcher((form or self.prepare(structure)).result())

    def bitmask(self, rows: int) -> Any:
        """[rows, ceil(V / 32)] int32 on the host: allowed-token bits, all set."""
        return _xgrammar().allocate_token_bitmask(rows, self.vocab_size)

    @staticmethod
    def apply(logits: Any, bitmask: Any, rows: list[int]) -> None:
        """Mask `logits`' rows `rows` in place (-inf where the bit is clear); `bitmask` on logits' device."""
        _xgrammar().apply_token_bitmask_inplace(logits, bitmask, indices=rows)


def _compiler(tokenizer: Tokenizer, vocab_size: int, end_ids: tuple[int, ...]) -> Any:
    """xgrammar's compiler for a vocabulary: every token's bytes (~0.4 s for 248K tokens, in Python)."""
    xgr = _xgrammar()
    vocab = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=list(end_ids))
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # Grammars keeps the latest

"""Reading function calls out of generated text: <tool_call> blocks (a JSON object, or Qwen3-Coder's XML
with its values typed by the function's schema) become calls, everything else stays content (but the
whitespace between a call and the next block), and streaming the text a character at a time reads what the
whole text reads."""

from __future__ import annotations

import json

import pytest

from common.openai.tool_calls import (
    HERMES_TAGS,
    CallForm,
    ToolCall,
    ToolCallStream,
    call_form,
    split_tool_calls,
    tool_call_tags,
)
from common.text.tokenizer import Tokenizer

TEXT = (
    "Checking.\n<tool_call>\n"
    '{"name": "weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
    '<tool_call>{"name": "clock", "arguments": "{\\"zone\\": \\"CET\\"}"}</tool_call>'
    '<tool_call>{"name": "nameless" </tool_call>'
    '<tool_call>["not", "an", "object"]</tool_call> and <tool_'
)
CONTENT = (
    "Checking.\n"
    '<tool_call>{"name": "nameless" </tool_call><tool_call>["not", "an", "object"]</tool_call> and <tool_'
)


def test_blocks_become_calls_and_the_rest_stays() -> None:
    content, calls = split_tool_calls(TEXT)
    assert content == CONTENT
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("weather", {"city": "Zürich"}),
        ("clock", {"zone": "CET"}),
    ]
    assert "Zürich" in calls[0].arguments  # as written, not \\u-escaped
    assert len({c.id for c in calls}) == 2


def _stream(text: str, piece: int, form: CallForm | None = None) -> tuple[str, list[ToolCall], list]:
    """`text` pushed `piece` characters at a time: the content, the calls its pieces assemble (checked
    equal to the stream's own), and each piece with how much of the text had been pushed when it came."""
    stream, content, pieces = ToolCallStream(form), "", []
    for at in range(0, len(text), piece):
        part, new = stream.push(text[at : at + piece])
        content += part
        pieces += [(at + piece, p) for p in new]
    rest, last = stream.flush()
    pieces += [(len(text), p) for p in last]
    assembled: dict[int, list[str]] = {}
    for _, p in pieces:
        if p.id is not None:
            assert p.index == len(assembled)  # numbered in order, each named once
            assembled[p.index] = [p.name, "", p.id]
        assembled[p.index][1] += p.arguments
    calls = [ToolCall(name, arguments, id) for name, arguments, id in assembled.values()]
    assert calls == stream.calls
    return content + rest, calls, pieces


@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streamed_a_piece_at_a_time_reads_the_same(piece: int) -> None:
    content, calls, _ = _stream(TEXT, piece)
    whole, want = split_tool_calls(TEXT)
    assert content == whole == CONTENT
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want]
    assert [c.name for c in calls] == ["weather", "clock"]


def test_a_call_streams_its_name_then_its_arguments_as_written() -> None:
    """The name as soon as the block's head is written; the arguments a piece at a time, as written; a
    call whose arguments are a JSON string comes whole at its block's end."""
    _, calls, pieces = _stream(TEXT, 1)
    end = TEXT.index("</tool_call>") + len("</tool_call>")
    weather = [(pushed, p) for pushed, p in pieces if p.index == 0]
    assert weather[0][1].name == "weather" and weather[0][0] == TEXT.index('{"city"') + 1
    assert len(weather) > 10 and all(pushed < end for pushed, _ in weather)
    assert calls[0].arguments == '{"city": "Zürich"}'
    clock = [p for _, p in pieces if p.index == 1]
    assert len(clock) == 1 and json.loads(clock[0].arguments) == {"zone": "CET"}


def test_an_unclosed_block_is_content_until_it_names_a_call() -> None:
    """Content waits only for a possible tag; a block cut before its call's whole name is content as
    written, one cut after it a call (max_tokens: OpenAI's partial call, finish reason "length")."""
    stream = ToolCallStream()
    assert stream.push("Hi <tool") == ("Hi ", [])
    assert stream.push('_call>{"name": "Get') == ("", [])
    assert stream.flush() == ('<tool_call>{"name": "Get', [])
    assert ToolCallStream().push("a < b") == ("a < b", [])
    stream = ToolCallStream()
    assert stream.push('Hi <tool_call>\n{"name": "GetWeather", "argum') == ("Hi ", [])
    content, deltas = stream.flush()
    assert content == "" and [(d.index, d.name, d.arguments) for d in deltas] == [(0, "GetWeather", "")]
    assert [(c.name, c.arguments) for c in stream.calls] == [("GetWeather", "")]
    content, calls = split_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a')
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("f", '"{\\"a')]


def test_a_streamed_call_stays_a_call_however_its_block_ends() -> None:
    """What was sent cannot be taken back: a call whose head was written is a call, its arguments what was
    written of them, whether its block is cut short or ends malformed."""
    cut = '<tool_call>{"name": "f", "arguments": {"a": [1, "}"'
    assert split_tool_calls(cut)[0] == "" and split_tool_calls(cut)[1][0].arguments == '{"a": [1, "}"'
    malformed = '<tool_call>{"name": "f", "arguments": {"a": 1}, oops</tool_call> after'
    content, calls = split_tool_calls(malformed)
    assert content == " after" and [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}')]


def test_the_tags_come_from_the_template(tmp_path) -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    backend = Backend(models.WordLevel({"a": 0}, unk_token="a"))
    assert tool_call_tags(Tokenizer(backend, chat_template="{{ messages }}")) is None
    with_tools = Tokenizer(backend, chat_template={"default": "x", "tool_use": "<tool_call>{{ tools }}"})
    assert tool_call_tags(with_tools) == HERMES_TAGS


def test_whitespace_after_a_call_goes_unless_text_follows() -> None:
    call = '<tool_call>{"name": "a"}</tool_call>'
    assert split_tool_calls(call + "\n\n")[0] == ""
    assert split_tool_calls(call + "\n" + call)[0] == ""
    assert split_tool_calls(call + "\nDone.")[0] == "\nDone."
    assert [c.arguments for c in split_tool_calls(call)[1]] == ["{}"]


BOOK = {
    "type": "function",
    "function": {
        "name": "book",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "nights": {"type": "integer"},
                "budget": {"type": "number"},
                "pets": {"type": "boolean"},
                "extras": {"type": "array"},
                "contact": {"type": ["object", "null"]},
                "zip": {"type": "string"},
                "rooms": {"type": "integer"},
                "late": {"type": "boolean"},
            },
        },
    },
}


def _xml(name: str, **params: str) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


XML_TEXT = "Booking.\n" + _xml(
    "book", city="Zürich", nights="3", budget="120.5", pets="True", extras='["breakfast", "late"]',
    contact="null", zip="8001", rooms="two", late="1", note="two lines\nof text", spare=" 42 ",
)  # fmt: skip
XML_ARGUMENTS = {
    "city": "Zürich",
    "nights": 3,
    "budget": 120.5,
    "pets": True,
    "extras": ["breakfast", "late"],
    "contact": None,
    "zip": "8001",  # a string parameter keeps its digits as written
    "rooms": "two",  # not an integer: the text as written
    "late": "1",  # a boolean takes true/false (or True/False), not 1
    "note": "two lines\nof text",  # not in the schema: a string, its inner line break kept
    "spare": " 42 ",
}


@pytest.mark.parametrize("piece", [1, 5, len(XML_TEXT)])
def test_an_xml_call_reads_its_values_as_the_schema_types_them(piece: int) -> None:
    form = call_form(HERMES_TAGS, [BOOK])
    content, calls, pieces = _stream(XML_TEXT, piece, form)
    assert content == "Booking.\n" and [c.name for c in calls] == ["book"]
    assert (
        json.loads(calls[0].arguments) == XML_ARGUMENTS
        and calls[0].arguments == split_tool_calls(XML_TEXT, form)[1][0].arguments
    )
    assert "Zürich" in calls[0].arguments
    if piece == 1:  # the name, then a piece a parameter, then the closing brace
        assert len(pieces) == 2 + len(XML_ARGUMENTS) and pieces[-1][1].arguments == "}"


def test_xml_values_take_their_types_through_refs_members_and_additional_properties() -> None:
    """A parameter typed through a `$ref` into the schema's `$defs` (pydantic's nested models), an `allOf`,
    a member of an anyOf at the schema's root, or its additionalProperties, reads as that type."""
    inner = {"type": "object", "properties": {"x": {"type": "integer"}}}
    refs = {
        "type": "object",
        "$defs": {
            "Inner": inner,
            "Count": {"allOf": [{"$ref": "#/$defs/Small"}]},
            "Small": {"type": "integer"},
        },
        "properties": {
            "inner": {"$ref": "#/$defs/Inner"},
            "n": {"$ref": "#/$defs/Count"},
            "s": {"type": "string"},
        },
        "anyOf": [{"properties": {"flag": {"type": "boolean"}}}],
        "additionalProperties": {"type": "number"},
    }
    loop = {
        "type": "object",
        "$defs": {"A": {"$ref": "#/$defs/A"}},
        "properties": {"a": {"$ref": "#/$defs/A"}},
    }
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": refs}},
        {"type": "function", "function": {"name": "g", "parameters": loop}},
    ]
    form = call_form(HERMES_TAGS, tools)
    text = _xml("f", inner='{"x": 1}', n="2", s="3", flag="true", extra="1.5") + _xml("g", a="4")
    _, (f, g) = split_tool_calls(text, form)
    assert json.loads(f.arguments) == {"inner": {"x": 1}, "n": 2, "s": "3", "flag": True, "extra": 1.5}
    assert json.loads(g.arguments) == {"a": "4"}  # a $ref to itself types nothing


def test_xml_calls_of_unknown_functions_keep_strings_and_a_block_without_a_name_stays_content() -> None:
    form = call_form(HERMES_TAGS, [BOOK])
    content, calls = split_tool_calls(_xml("clock", zone="CET", hours="3") + _xml("book"), form)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("clock", {"zone": "CET", "hours": "3"}),
        ("book", {}),
    ]
    nameless = "<tool_call>\n<function=>\n</function>\n</tool_call>"
    assert split_tool_calls(nameless, form) == (nameless, [])
    # A call once its name is written (streamed from there): its complete parameters, whatever follows.
    for block in [
        "<tool_call>\n<function=book>\nstray<parameter=city>\nBern\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=book>\n<parameter=city>\nBern\n</parameter>\n</tool_call>",
        "<tool_call>\n<function=book>\n<parameter=city>\nBern\n</function>\n</tool_call>",  # left open
        "<tool_call>\n<function=book>\n<parameter=city>\nBern\n</parameter>\n</function>\n<parameter=x>\n</tool_call>",
    ]:
        content, calls = split_tool_calls(block, form)
        assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("book", {"city": "Bern"})
        ]

"""Reading function calls out of generated text: <tool_call> blocks (a JSON object, or Qwen3-Coder's XML
with its values typed by the function's schema) become calls, everything else stays content (but the
whitespace between a call and the next block), and streaming the text a character at a time reads what the
whole text reads."""

from __future__ import annotations

import json

import pytest

from common.tokenizer import Tokenizer
from common.tool_calls import HERMES_TAGS, ToolCallStream, call_form, split_tool_calls, tool_call_tags

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


@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streamed_a_piece_at_a_time_reads_the_same(piece: int) -> None:
    stream, content, calls = ToolCallStream(), "", []
    for at in range(0, len(TEXT), piece):
        text, new = stream.push(TEXT[at : at + piece])
        content += text
        calls += new
    content += stream.flush()
    assert content == CONTENT and [c.name for c in calls] == ["weather", "clock"] and stream.calls == 2


def test_an_unclosed_block_is_content_and_content_waits_only_for_a_possible_tag() -> None:
    stream = ToolCallStream()
    assert stream.push("Hi <tool") == ("Hi ", [])
    assert stream.push('_call>{"name": "f", "argum') == ("", [])
    assert stream.flush() == '<tool_call>{"name": "f", "argum'
    assert ToolCallStream().push("a < b") == ("a < b", [])


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
    stream, content, calls = ToolCallStream(call_form(HERMES_TAGS, [BOOK])), "", []
    for at in range(0, len(XML_TEXT), piece):
        text, new = stream.push(XML_TEXT[at : at + piece])
        content += text
        calls += new
    content += stream.flush()
    assert content == "Booking.\n" and [c.name for c in calls] == ["book"]
    assert json.loads(calls[0].arguments) == XML_ARGUMENTS
    assert "Zürich" in calls[0].arguments


def test_xml_calls_of_unknown_functions_keep_strings_and_malformed_blocks_stay_content() -> None:
    form = call_form(HERMES_TAGS, [BOOK])
    content, calls = split_tool_calls(_xml("clock", zone="CET", hours="3") + _xml("book"), form)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("clock", {"zone": "CET", "hours": "3"}),
        ("book", {}),
    ]
    malformed = [
        "<tool_call>\n<function=book>\nstray<parameter=city>\nBern\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
        "<tool_call>\n<function=book>\n<parameter=city>\nBern\n</parameter>\n</tool_call>",
        "<tool_call>\n<function=book>\n</function>\ntrailing</tool_call>",
    ]
    for block in malformed:
        assert split_tool_calls(block, form) == (block, [])

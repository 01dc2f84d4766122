"""Structured output: OpenAI's response formats as JSON schemas, checked before any worker sees them, and
the grammar's mask, which holds every generated text (greedy or sampled) to the schema."""

from __future__ import annotations

import json

import pytest
import torch

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.kv.state import SequenceState
from common.model.defaults import default_model_dir
from common.protocol import SamplingParams
from common.sampling.logit_processors import LogitProcessors
from common.sampling.requests import Request
from common.sampling.structured import structure_of
from common.text.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"size": {"enum": ["S", "M", "L"]}, "ok": {"type": "boolean"}},
    "required": ["size", "ok"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA}}


def test_formats_become_schemas_and_bad_ones_are_named() -> None:
    assert structure_of(None) == structure_of({"type": "text"}) == ""
    assert json.loads(structure_of({"type": "json_object"})) == {"schema": {"type": "object"}}
    assert json.loads(structure_of(FORMAT)) == {"schema": SCHEMA}
    for bad, words in [
        ({"type": "yaml"}, "not one of"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}, 'Unsupported type "nope"'),
    ]:
        with pytest.raises(ValueError, match=words):
            structure_of(bad)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_text_follows_the_schema(temperature: float) -> None:
    """The tiny model's random weights would write anything: under the grammar it writes the object, then
    its end-of-sequence token."""
    engine = Engine(WorkerConfig(str(default_model_dir()), max_running=4))
    params = [
        SamplingParams(temperature=temperature, seed=s, max_tokens=40, structure=structure_of(FORMAT))
        for s in range(4)
    ]
    for result in engine.generate([[5, 6, 7], [40, 41], [9] * 7, [300]], params):
        value = json.loads(engine.tokenizer.decode(result.token_ids))
        assert result.finish_reason == "stop" and set(value) == {"size", "ok"}
        assert value["size"] in ("S", "M", "L") and isinstance(value["ok"], bool)


def test_the_mask_leaves_only_what_the_grammar_takes() -> None:
    tok = Tokenizer.from_dir(default_model_dir())
    procs = LogitProcessors(2, 1024, torch.device("cpu"), tok.eos_token_ids, tok)
    req = Request([1], SamplingParams(structure=structure_of(FORMAT)), 0, SequenceState(1))
    procs.admit(req)
    out = procs.apply(torch.zeros(1, 1024), [req], [0])
    allowed = torch.isfinite(out[0]).nonzero().flatten().tolist()
    assert allowed and all(tok.token_bytes(t).startswith(b"{") for t in allowed)
    procs.accept(req, allowed[0])
    with pytest.raises(RuntimeError, match="breaks the grammar"):
        procs.accept(req, tok.encode("zzz")[0])


def test_a_forced_call_is_one_call_block_of_a_listed_function() -> None:
    """call_structure: the answer is one <tool_call> block naming a listed function with arguments of its
    schema (any of them for "required", the named one otherwise), then the end of the sequence."""
    from common.openai.tool_calls import HERMES_TAGS, split_tool_calls
    from common.sampling.structured import call_structure

    pick = {"type": "object", "properties": {"size": {"enum": ["S", "M"]}}, "required": ["size"]}
    pick["additionalProperties"] = False
    tools = [
        {"type": "function", "function": {"name": "pick", "parameters": pick}},
        {
            "type": "function",
            "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}},
        },
    ]
    engine = Engine(WorkerConfig(str(default_model_dir()), max_running=4))
    params = [
        SamplingParams(
            temperature=1.0, seed=s, max_tokens=60, structure=call_structure(tools, name, HERMES_TAGS)
        )
        for s, name in enumerate([None, None, "pick", "noop"])
    ]
    names = []
    for result in engine.generate([[5, 6, 7]] * 4, params):
        content, (call,) = split_tool_calls(engine.tokenizer.decode(result.token_ids))
        assert content == "" and result.finish_reason == "stop"
        arguments = json.loads(call.arguments)
        assert (
            arguments in ({"size": "S"}, {"size": "M"})
            if call.name == "pick"
            else isinstance(arguments, dict)
        )
        names.append(call.name)
    assert names[2:] == ["pick", "noop"] and set(names[:2]) <= {"pick", "noop"}
    with pytest.raises(ValueError, match="not among the tools"):
        call_structure(tools, "other", HERMES_TAGS)


def test_a_grammar_that_starts_after_a_token_leaves_what_comes_before_free() -> None:
    """`structure_after`: no mask until the request samples that token (the end of its reasoning); then the
    grammar's, from its start. In a generation: a token forced first (a +100 bias), then the object."""
    tok = Tokenizer.from_dir(default_model_dir())
    gate, other = tok.encode("zzz")[0], tok.encode("q")[0]
    params = SamplingParams(structure=structure_of(FORMAT), structure_after=gate)
    procs = LogitProcessors(2, 1024, torch.device("cpu"), tok.eos_token_ids, tok)
    req = Request([1], params, 0, SequenceState(1))
    procs.admit(req)
    assert torch.isfinite(procs.apply(torch.zeros(1, 1024), [req], [0])).all()
    procs.accept(req, other)  # not the grammar's: before it starts, anything goes
    procs.accept(req, gate)
    allowed = torch.isfinite(procs.apply(torch.zeros(1, 1024), [req], [0])[0]).nonzero().flatten().tolist()
    assert allowed and all(tok.token_bytes(t).startswith(b"{") for t in allowed)
    later = Request([1], params, 0, SequenceState(1))
    later.token_ids = [other, gate, allowed[0]]  # admitted with tokens: the same state
    procs.admit(later)
    with pytest.raises(RuntimeError, match="breaks the grammar"):
        procs.accept(later, other)

    engine = Engine(WorkerConfig(str(default_model_dir()), max_running=2))
    forced = SamplingParams(
        max_tokens=40, structure=structure_of(FORMAT), structure_after=gate, logit_bias=((gate, 100.0),)
    )
    (result,) = engine.generate([[5, 6, 7]], [forced])
    assert result.token_ids[0] == gate and result.finish_reason == "stop"
    value = json.loads(engine.tokenizer.decode(result.token_ids[1:]))
    assert set(value) == {"size", "ok"}


def test_a_forced_call_in_the_xml_form_is_one_block_of_typed_arguments() -> None:
    """call_structure with `xml`: the answer is one <tool_call> block in the XML form, naming a listed
    function, each argument's value of its schema's type; read back with the tools' types, the arguments are
    JSON of those types."""
    from common.openai.tool_calls import HERMES_TAGS, call_form, split_tool_calls
    from common.sampling.structured import call_structure

    pick = {
        "type": "object",
        "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 99}, "all": {"type": "boolean"}},
        "required": ["count", "all"],
        "additionalProperties": False,
    }
    tools = [
        {"type": "function", "function": {"name": "pick", "parameters": pick}},
        {
            "type": "function",
            "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}},
        },
    ]
    form = call_form(HERMES_TAGS, tools)
    engine = Engine(WorkerConfig(str(default_model_dir()), max_running=4))
    structure = call_structure(tools, "pick", HERMES_TAGS, xml=True)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=150, structure=structure) for s in range(2)]
    noop = call_structure(tools, "noop", HERMES_TAGS, xml=True)
    params.append(SamplingParams(temperature=1.0, max_tokens=150, structure=noop))
    calls = []
    for result in engine.generate([[5, 6, 7]] * 3, params):
        text = engine.tokenizer.decode(result.token_ids)
        assert result.finish_reason == "stop", text
        content, (call,) = split_tool_calls(text, form)
        assert content == ""
        calls.append((call.name, json.loads(call.arguments)))
    assert [name for name, _ in calls] == ["pick", "pick", "noop"] and calls[2][1] == {}
    for _, arguments in calls[:2]:
        assert arguments["count"] in range(100) and arguments["all"] in (True, False)
    with pytest.raises(ValueError, match="not among the tools"):
        call_structure(tools, "other", HERMES_TAGS, xml=True)


def test_an_xml_call_keeps_every_string_inside_its_parameter() -> None:
    """The XML form's grammar: a string value (one with a pattern or a length too, which xgrammar would
    hold with free text) never holds </parameter>, </function> or </tool_call>, where the reader would see
    the call end, nor does a string inside a JSON value; parameters that are not an object's schema are a
    ValueError (a 400)."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from common.openai.tool_calls import HERMES_TAGS
    from common.sampling.structured import _grammar, call_structure

    limited = {"type": "string", "minLength": 1, "maxLength": 99, "pattern": ".*"}
    parameters = {
        "type": "object",
        "properties": {"s": limited, "o": {"type": "object", "properties": {"t": {"type": "string"}}}},
        "required": ["s"],
    }
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    grammar = _grammar(call_structure(tools, None, HERMES_TAGS, xml=True))

    def block(body: str) -> str:
        return f"<tool_call>\n<function=f>\n{body}\n</function>\n</tool_call>"

    assert accepts(grammar, block("<parameter=s>\na < b\n</parameter>"))
    assert accepts(grammar, block('<parameter=s>\nx\n</parameter>\n<parameter=o>\n{"t": "u"}\n</parameter>'))
    for cut in ("</parameter>", "</function>", "</tool_call>"):
        assert not accepts(grammar, block(f"<parameter=s>\na{cut}b\n</parameter>")), cut
        json_value = f'<parameter=s>\nx\n</parameter>\n<parameter=o>\n{{"t": "{cut}"}}\n</parameter>'
        assert not accepts(grammar, block(json_value)), cut
    for bad in ({"type": "string"}, ["x"]):
        tool = {"type": "function", "function": {"name": "f", "parameters": bad}}
        with pytest.raises(ValueError, match="not a JSON schema of an object"):
            call_structure([tool], None, HERMES_TAGS, xml=True)

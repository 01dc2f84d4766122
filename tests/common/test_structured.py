"""Structured output: OpenAI's response formats as JSON schemas, checked before any worker sees them, and
the grammar's mask, which holds every generated text (greedy or sampled) to the schema."""

from __future__ import annotations

import json

import pytest
import torch

from common.engine import Engine
from common.kv.state import SequenceState
from common.logit_processors import LogitProcessors
from common.model.defaults import default_model_dir
from common.requests import Request
from common.sampling import SamplingParams
from common.structured import structure_of
from common.tokenizer import Tokenizer

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {"size": {"enum": ["S", "M", "L"]}, "ok": {"type": "boolean"}},
    "required": ["size", "ok"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA}}


def test_formats_become_schemas_and_bad_ones_are_named() -> None:
    assert structure_of(None) == structure_of({"type": "text"}) == ""
    assert json.loads(structure_of({"type": "json_object"})) == {"type": "object"}
    assert json.loads(structure_of(FORMAT)) == SCHEMA
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
    engine = Engine(default_model_dir(), dtype=torch.float32, max_seqs=4)
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

"""A reasoning model's thinking through the router: where the chat template has a <think> block, the
answer's reasoning comes back as `reasoning_content` (streamed as deltas of it), apart from the content and
any function calls; with `enable_thinking` false the template closes the block in the prompt and the text is
all content."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from common.model.defaults import default_model_dir
from common.model.synthetic.tokenizer import CHAT_TEMPLATE
from tests.services.router.conftest import THINK_REPLY, serve_router, streamed_calls

GENERATION_PROMPT = "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
# Qwen3's way: the generation prompt opens the block, or with enable_thinking false holds it empty.
THINKING = (
    "{%- if enable_thinking is defined and enable_thinking is false %}\n"
    "    {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<think>\\n' }}\n"
    "{%- endif %}\n"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def _thinking_model(root: Path, tags_as_tokens: bool) -> Path:
    """The tiny model with a template that has a reasoning block (and, `tags_as_tokens`, <think> and
    </think> as tokens of their own, as Qwen3's vocabulary has them)."""
    assert GENERATION_PROMPT in CHAT_TEMPLATE
    model = root / ("thinking-tokens" if tags_as_tokens else "thinking")
    model.mkdir()
    for file in default_model_dir().iterdir():
        if file.name not in ("tokenizer_config.json", "tokenizer.json"):
            (model / file.name).symlink_to(file)
    config = json.loads((default_model_dir() / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE.replace(GENERATION_PROMPT, GENERATION_PROMPT + THINKING)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    vocabulary = json.loads((default_model_dir() / "tokenizer.json").read_text())
    if tags_as_tokens:
        first = len(vocabulary["model"]["vocab"])
        for i, tag in enumerate(("<think>", "</think>")):
            added = {"id": first + i, "content": tag, "single_word": False, "lstrip": False, "rstrip": False}
            vocabulary["added_tokens"].append({**added, "normalized": False, "special": False})
    (model / "tokenizer.json").write_text(json.dumps(vocabulary))
    return model


@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A router serving the tiny model with a template that has a reasoning block."""
    root = tmp_path_factory.mktemp("models")
    with serve_router(model_dir=_thinking_model(root, tags_as_tokens=False)) as served:
        yield served
    shutil.rmtree(root, ignore_errors=True)


def _client(served: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=10)


def _ask(mark: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{mark} What is 2 + 2?"}]


def test_the_reasoning_comes_apart_from_the_answer(thinking: Any) -> None:
    out = _client(thinking).chat.completions.create(model="tiny", messages=_ask("[think]"))
    message = out.choices[0].message
    assert message.content == "It is 4." and out.choices[0].finish_reason == "stop"
    assert message.model_extra["reasoning_content"] == "Two and two make four.\n"


def test_streamed_reasoning_comes_as_its_own_deltas(thinking: Any) -> None:
    chunks = list(
        _client(thinking).chat.completions.create(model="tiny", messages=_ask("[think]"), stream=True)
    )
    deltas = [c.choices[0].delta for c in chunks]
    assert (
        "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
        == "Two and two make four.\n"
    )
    assert "".join(d.content or "" for d in deltas) == "It is 4."
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_without_thinking_the_text_is_the_content(thinking: Any) -> None:
    out = _client(thinking).chat.completions.create(
        model="tiny",
        messages=_ask("[think]"),
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert out.choices[0].message.content == THINK_REPLY
    assert "reasoning_content" not in (out.choices[0].message.model_extra or {})


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_after_the_reasoning_is_a_call(thinking: Any, stream: bool) -> None:
    made = _client(thinking).chat.completions.create(
        model="tiny", messages=_ask("[think-tool]"), tools=TOOLS, stream=stream
    )
    if stream:
        chunks = list(made)
        deltas = [c.choices[0].delta for c in chunks]
        reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
        calls = streamed_calls(chunks)
        content = "".join(d.content or "" for d in deltas) or None
    else:
        message = made.choices[0].message
        reasoning, calls, content = (
            message.model_extra["reasoning_content"],
            message.tool_calls,
            message.content,
        )
        calls = [c.function for c in calls]
    assert reasoning == "A call, then." and content is None
    assert [(f.name, json.loads(f.arguments)) for f in calls] == [("get_weather", {"city": "Oslo"})]


def test_a_structured_answer_is_all_content(thinking: Any) -> None:
    """Where </think> is no token of its own, a grammar holds the answer (here a forced call's) from its
    first token: no reasoning is read."""
    out = _client(thinking).chat.completions.create(
        model="tiny", messages=_ask("[think]"), tools=TOOLS, tool_choice="required"
    )
    assert out.choices[0].message.content == THINK_REPLY
    assert "reasoning_content" not in (out.choices[0].message.model_extra or {})


def test_a_structured_answer_holds_to_its_grammar_after_the_reasoning(tmp_path: Path) -> None:
    """Where </think> is a token, the grammar starts after it (`structure_after`): the model thinks first,
    and the reasoning comes back apart from the structured content."""
    model = _thinking_model(tmp_path, tags_as_tokens=True)
    with serve_router(model_dir=model) as served:
        out = _client(served).chat.completions.create(
            model="tiny", messages=_ask("[think]"), response_format={"type": "json_object"}
        )
        (gen,) = served.peer.generates()
    end = json.loads((model / "tokenizer.json").read_text())["added_tokens"][-1]
    assert end["content"] == "</think>" and gen.sampling.structure_after == end["id"]
    assert gen.sampling.structure
    assert out.choices[0].message.model_extra["reasoning_content"] == "Two and two make four.\n"
    assert out.choices[0].message.content == "It is 4."  # (the protocol peer writes no JSON)

"""Reading a reasoning model's thinking apart from its answer: the block between <think> and </think>,
opened by the answer or already by the prompt, is the reasoning; streamed a piece at a time it reads the
same; a block never closed is all reasoning, and an answer that opens none has none."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models

from common.openai.reasoning import (
    ReasoningForm,
    ReasoningStream,
    reasoning_form,
    reasoning_tags,
    split_reasoning,
)
from common.text.tokenizer import Tokenizer

INSIDE = ReasoningForm(inside=True)
CASES = [
    # (form, answer, reasoning, content)
    (INSIDE, "Two and two.\nFour.</think>\n\nIt is 4.", "Two and two.\nFour.", "It is 4."),
    (ReasoningForm(), "\n<think>\nhmm\n</think>\n\nHi <think> there", "\nhmm\n", "Hi <think> there"),
    (ReasoningForm(), "Hello <think> x </think> y", None, "Hello <think> x </think> y"),
    (INSIDE, "thinking on and on <", "thinking on and on <", ""),  # cut at max_tokens: all reasoning
    (INSIDE, "done</think>\n\n", "done", ""),
    (ReasoningForm(), "  \n", None, "  \n"),
    (ReasoningForm(), "<thin", None, "<thin"),
]


@pytest.mark.parametrize(("form", "answer", "reasoning", "content"), CASES)
@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_reasoning_and_content_streamed_or_whole(form, answer, reasoning, content, piece) -> None:
    assert split_reasoning(answer, form) == (reasoning, content)
    stream, got = ReasoningStream(form), ["", ""]
    for at in range(0, len(answer), piece):
        for i, part in enumerate(stream.push(answer[at : at + piece])):
            got[i] += part
    for i, part in enumerate(stream.flush()):
        got[i] += part
    assert got == [reasoning or "", content] and stream.opened == (reasoning is not None)


def _tokenizer(template: str) -> Tokenizer:
    backend = Backend(models.WordLevel({"x": 0}, unk_token="x"))
    return Tokenizer(backend, chat_template=template)


OPENING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% elif think_open is not defined or think_open %}<think>\n{% endif %}{% endif %}"
)


@pytest.mark.parametrize(
    ("kwargs", "text", "inside"),
    [
        ({}, "What is 2 + 2?", True),  # the generation prompt opens the block
        ({"enable_thinking": False}, "What is 2 + 2?", False),  # ... or holds it empty
        ({"think_open": False}, "Reply with the literal text <think>", False),  # a tag in the messages
    ],
)
def test_only_the_generation_prompt_says_the_answer_starts_inside(kwargs, text, inside) -> None:
    from common.openai.api import parse_chat_request
    from common.openai.prompts import chat_prompt_ids

    tok = _tokenizer(OPENING)
    tags = reasoning_tags(tok)
    assert tags == ("<think>", "</think>") and reasoning_tags(_tokenizer("{{ messages }}")) is None
    body = {"messages": [{"role": "user", "content": text}], "chat_template_kwargs": kwargs}
    opening = chat_prompt_ids(parse_chat_request(json.dumps(body).encode()), tok, opening=True).opening
    assert opening.startswith("<|im_start|>assistant\n")
    assert reasoning_form(tags, opening).inside == inside

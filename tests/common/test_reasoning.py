"""Reading a reasoning model's thinking apart from its answer: the block between <think> and </think>,
opened by the answer or already by the prompt, is the reasoning; streamed a piece at a time it reads the
same; a block never closed is all reasoning, and an answer that opens none has none."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models

from common.reasoning import ReasoningForm, ReasoningStream, reasoning_form, reasoning_tags, split_reasoning
from common.tokenizer import Tokenizer

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
    vocab = {w: i for i, w in enumerate(["x", "<think>", "</think>", "\n"])}
    backend = Backend(models.WordLevel(vocab, unk_token="x"))
    return Tokenizer(backend, chat_template=template)


def test_the_tags_come_from_the_template_and_the_prompt_says_where_the_answer_starts() -> None:
    assert reasoning_tags(_tokenizer("{{ messages }}")) is None
    tok = _tokenizer("{{ messages }}{% if enable_thinking is false %}<think></think>{% endif %}")
    tags = reasoning_tags(tok)
    assert tags == ("<think>", "</think>")
    opened, closed, plain = [1, 3], [1, 3, 3, 2, 3, 3], [0, 0]  # "<think>\n", "<think>\n\n</think>\n\n", "xx"
    assert reasoning_form(tags, tok, opened).inside
    assert not reasoning_form(tags, tok, closed).inside
    assert not reasoning_form(tags, tok, plain).inside

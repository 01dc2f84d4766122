"""A reasoning model's thinking, read apart from its answer: the text between `<think>` and `</think>`
(Qwen3's and DeepSeek-R1's convention) is OpenAI-compatible servers' `reasoning_content`, the rest the
message's content.

The split is on where the chat template asks for it (its text mentions `</think>`). A template may open the
block itself, its generation prompt ending in `<think>` (Qwen3.5 and QwQ do; with `enable_thinking` false
Qwen3's closes it there too): then the answer starts inside the reasoning. Only the generation prompt's text
says so: a tag in the messages is the conversation's. Otherwise reasoning is only a
block that opens the answer. A block never closed (the answer cut at max_tokens) is all reasoning; the
whitespace between `</think>` and the content is no one's.

`ReasoningStream` reads the text as it streams: reasoning and content come out as soon as they cannot be
part of a tag.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.text.detokenize import partial_suffix
from common.text.tokenizer import Tokenizer

THINK_TAGS = ("<think>", "</think>")


@dataclass(frozen=True)
class ReasoningForm:
    """How one request's reasoning is read: its tags, and whether the answer starts inside the block (the
    prompt opened it)."""

    tags: tuple[str, str] = THINK_TAGS
    inside: bool = False


def reasoning_tags(tokenizer: Tokenizer) -> tuple[str, str] | None:
    """The tags of a model's reasoning, None where its chat template has none (never mentions `</think>`)."""
    return THINK_TAGS if tokenizer.chat_template_mentions(THINK_TAGS[1]) else None


def reasoning_form(tags: tuple[str, str], generation_prompt: str) -> ReasoningForm:
    """The form for a request whose chat template's generation prompt is `generation_prompt`
    (openai_prompts.generation_prompt): inside the block where that text's last tag is the opening one."""
    return ReasoningForm(tags, generation_prompt.rfind(tags[0]) > generation_prompt.rfind(tags[1]))


class ReasoningStream:
    """Splits streamed text into reasoning and content (`push` each piece, `flush` at the end)."""

    def __init__(self, form: ReasoningForm | None = None) -> None:
        self.form = form or ReasoningForm()
        self.start, self.end = self.form.tags
        self.opened = self.form.inside
        """Whether the answer has reasoning (its block opened, here or in the prompt)."""
        self._state = "inside" if self.form.inside else "before"
        """before (the answer may open a block), inside (reasoning), after (whitespace held), content."""
        self._held = ""

    def push(self, text: str) -> tuple[str, str]:
        """Add `text`; the reasoning and the content now known."""
        buffer, reasoning = self._held + text, ""
        self._held = ""
        if self._state == "before":
            opening = buffer.lstrip()
            if self.start.startswith(opening):  # only whitespace yet, or the tag's beginning
                self._held = buffer
                return "", ""
            if opening.startswith(self.start):
                self._state, self.opened, buffer = "inside", True, opening[len(self.start) :]
            else:
                self._state = "content"
        if self._state == "inside":
            at = buffer.find(self.end)
            if at < 0:
                keep = partial_suffix(buffer, [self.end])
                self._held = buffer[len(buffer) - keep :]
                return buffer[: len(buffer) - keep], ""
            reasoning, buffer, self._state = buffer[:at], buffer[at + len(self.end) :], "after"
        if self._state == "after":
            buffer = buffer.lstrip()
            if not buffer:
                return reasoning, ""
            self._state = "content"
        return reasoning, buffer

    def flush(self) -> tuple[str, str]:
        """At the end of the text: what is still held (an unclosed block's tail is reasoning)."""
        held, self._held = self._held, ""
        if self._state == "inside":
            return held, ""
        return "", ("" if self._state == "after" else held)


def split_reasoning(text: str, form: ReasoningForm | None = None) -> tuple[str | None, str]:
    """A whole answer's reasoning (None: it has none) and content."""
    stream = ReasoningStream(form)
    reasoning, content = stream.push(text)
    more, rest = stream.flush()
    return (reasoning + more if stream.opened else None), content + rest

"""Function calls in generated text: the Hermes/Qwen convention, each call a `<tool_call>` block holding a
JSON object `{"name": ..., "arguments": {...}}`, the rest of the text the message's content.

`ToolCallStream` reads the text as it streams: content comes out as soon as it cannot be the start of a
block, a call once its block is closed. A block that is not a JSON object with a string `name` stays in the
content as written (the model did not make a call), and so does one still open when the text ends. The
whitespace between a call and the next block, or the end, is no one's content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from common.detokenize import partial_suffix
from common.tokenizer import Tokenizer

HERMES_TAGS = ("<tool_call>", "</tool_call>")


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


def tool_call_tags(tokenizer: Tokenizer) -> tuple[str, str] | None:
    """The tags a model's chat template asks it to wrap calls in, None when it asks for none this module
    reads (its template never mentions `<tool_call>`)."""
    templates = tokenizer.chat_template
    sources = templates.values() if isinstance(templates, dict) else [templates or ""]
    return HERMES_TAGS if any(HERMES_TAGS[0] in source for source in sources) else None


class ToolCallStream:
    """Splits streamed text into content and calls (`push` each piece, `flush` at the end)."""

    def __init__(self, tags: tuple[str, str] = HERMES_TAGS) -> None:
        self.start, self.end = tags
        self._held = ""
        """Text not yet returned: a possible start tag's beginning, or an open block."""
        self._open = False
        self._after_call = False
        """A call just closed: whitespace is held until text that is not a block follows."""
        self.calls = 0
        """Calls returned so far."""

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        """Add `text`; the content and the calls that became final."""
        buffer, content, calls = self._held + text, "", []
        while True:
            if self._open:
                at = buffer.find(self.end)
                if at < 0:
                    self._held = buffer
                    return content, calls
                block, buffer = buffer[:at], buffer[at + len(self.end) :]
                call = self._parse(block)
                if call is None:
                    content += self.start + block + self.end
                else:
                    calls.append(call)
                self._open, self._after_call = False, call is not None
                continue
            if self._after_call:
                rest = buffer.lstrip()
                if not rest or self.start.startswith(rest):  # only whitespace yet, or a tag's beginning
                    self._held = buffer
                    return content, calls
                self._after_call = False
                if rest.startswith(self.start):
                    buffer = rest
            at = buffer.find(self.start)
            if at < 0:
                keep = partial_suffix(buffer, [self.start])
                self._held = buffer[len(buffer) - keep :]
                return content + buffer[: len(buffer) - keep], calls
            content += buffer[:at]
            buffer = buffer[at + len(self.start) :]
            self._open = True

    def flush(self) -> str:
        """At the end of the text: what is still held, as content (an unclosed block as written)."""
        held, self._held = self._held, ""
        if self._open:
            self._open = False
            return self.start + held
        return held.lstrip() if self._after_call else held

    def _parse(self, block: str) -> ToolCall | None:
        try:
            value = json.loads(block)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        self.calls += 1
        return ToolCall(value["name"], text, f"call_{uuid.uuid4().hex[:24]}")


def split_tool_calls(text: str, tags: tuple[str, str] = HERMES_TAGS) -> tuple[str, list[ToolCall]]:
    """A whole text's content and calls."""
    stream = ToolCallStream(tags)
    content, calls = stream.push(text)
    return content + stream.flush(), calls

"""What an OpenAI request's prompt is in tokens: a chat's messages (and tools) through the model's chat
template, their images' tokens in place; a text completion's prompt or batch of prompts, encoded or checked.
Every problem is a 400 naming the part at fault."""

from __future__ import annotations

from typing import Any, NamedTuple

import jinja2
from pydantic import JsonValue

from common.config import GRAMMAR_MAX_BYTES
from common.openai.api import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ContentPart,
    bad_request,
    check_grammar_ends,
    given_prompts,
)
from common.openai.chat_images import ChatImage, ImagePrompting
from common.sampling.structured import Unavailable, call_structure
from common.text.tokenizer import Tokenizer

# Template variables a client may not set: the conversation itself, and the template source (a client must
# not run a template of its own on the server).
# `self` is the renderer's own first parameter.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "add_generation_prompt", "tokenize", "chat_template", "self"}
)
ROLES = ("system", "developer", "user", "assistant", "tool")
"""Chat roles a message may have (OpenAI's, without the deprecated `function`)."""
MAX_PROMPTS = 64
"""The most prompts one text completion may batch (each with its `n` choices)."""


def chat_tools(request: ChatCompletionRequest, tags: tuple[str, str] | None) -> list[JsonValue] | None:
    """The tools the chat template lists for the model (None: none, or `tool_choice` "none"); `tags`: how
    the model's calls are read from its text (common/openai/tool_calls.py), None where its template has no
    form for them. A forced call ("required", or a named function) is `forced_call`'s."""
    choice = request.tool_choice
    named = isinstance(choice, dict) and choice.get("type") == "function"
    if choice not in (None, "auto", "none", "required") and not named:
        raise bad_request(
            'tool_choice is "auto", "none", "required" or {"type": "function", "function": {"name": ...}}.',
            "tool_choice",
        )
    if not request.tools or choice == "none":
        if choice == "required" or named:
            raise bad_request("tool_choice forces a call, but no tools are given.", "tool_choice")
        return None
    if tags is None:
        raise bad_request(
            "This model's chat template has no form of function call that Spillway reads (<tool_call> "
            "blocks); tool definitions can still reach it through chat_template_kwargs.",
            "tools",
            "unsupported",
        )
    for i, tool in enumerate(request.tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        named = isinstance(function, dict) and isinstance(function.get("name"), str)
        if not (named and isinstance(tool, dict) and tool.get("type") == "function"):
            raise bad_request(
                'A tool is {"type": "function", "function": {"name": ..., ...}}.', f"tools[{i}]"
            )
    return list(request.tools)


def forced_call(
    request: ChatCompletionRequest,
    tools: list[JsonValue] | None,
    tags: tuple[str, str],
    xml: bool = False,
    max_bytes: int = GRAMMAR_MAX_BYTES,
) -> str:
    """The form (`SamplingParams.structure`, common/sampling/structured.py) that holds the answer to one call
    block
    where `tool_choice` forces a call ("required": of any tool; named: of that one), in the XML form with
    `xml` (the template's); "" where it does not. A 400 for a name no tool has, a form over `max_bytes`, or
    without xgrammar."""
    choice = request.tool_choice
    if tools is None or choice in (None, "auto"):
        return ""
    name = None
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise bad_request(
                'A named tool_choice is {"type": "function", "function": {"name": ...}}.', "tool_choice"
            )
    if request.response_format not in (None, {"type": "text"}):
        raise bad_request("A forced call and a response_format cannot both hold the answer.", "tool_choice")
    check_grammar_ends(request, "a forced call")
    try:
        return call_structure(tools, name, tags, xml, max_bytes)  # type: ignore[arg-type]
    except Unavailable as exc:
        raise bad_request(str(exc), "tool_choice", "unsupported") from None
    except ValueError as exc:
        raise bad_request(str(exc), "tool_choice") from None


class ChatPrompt(NamedTuple):
    """A chat's prompt: its ids, its images and (asked for) the text its generation prompt adds."""

    ids: list[int]
    images: list[ChatImage]
    opening: str = ""


def chat_prompt_ids(
    request: ChatCompletionRequest,
    tokenizer: Tokenizer,
    prompting: ImagePrompting | None = None,
    tools: list[JsonValue] | None = None,
    opening: bool = False,
    max_bytes: int | None = None,
) -> ChatPrompt:
    """The chat template applied to the messages (and `tools`, from `chat_tools`), tokenized (with a
    generation prompt), and the images of their `image_url` parts, each image's tokens in the prompt
    (`prompting`: how the model takes images; None: a 400 for any image). With `opening`, also the text the
    template's generation prompt adds after the messages (e.g. Qwen3's `<|im_start|>assistant\n<think>\n`):
    the prompt less the messages rendered without it ("" where the one does not start with the other).
    Only that text says how the answer starts: a tag in the messages is the conversation's. A prompt over
    `max_bytes` of text is a 400 before it is rendered (its messages' text) or tokenized (the template's)."""
    check_prompt_bytes(sum(map(_text_length, request.messages)), max_bytes, "messages")
    images: list[ChatImage] = []
    text = _render(request, tokenizer, prompting, tools, images, generation_prompt=True)
    check_prompt_bytes(text, max_bytes, "messages")
    ids = tokenizer.encode(text, add_special_tokens=False)  # as apply_chat_template(tokenize=True)
    added = ""
    if opening:
        bare = _render(request, tokenizer, prompting, tools, [], generation_prompt=False)
        added = text[len(bare) :] if text.startswith(bare) else ""
    if not images:
        return ChatPrompt(ids, images, added)
    assert prompting is not None  # an image part without `prompting` is a 400 in `_render`
    try:
        return ChatPrompt(prompting.expand(ids, images), images, added)
    except ValueError as exc:
        raise bad_request(f"The images do not fit the prompt: {exc}", param="messages") from None


def check_prompt_bytes(text: str | int, max_bytes: int | None, param: str) -> None:
    """A 400 (context_length_exceeded) where a prompt's `text` (or its length in characters, each at least
    a byte) is over `max_bytes` bytes of UTF-8 (None: any): checked before it is tokenized."""
    if max_bytes is None:
        return
    size = text if isinstance(text, int) else len(text)
    if size > max_bytes or (isinstance(text, str) and len(text.encode()) > max_bytes):
        raise bad_request(
            f"The prompt is over {max_bytes:,} bytes: more text than this model's context holds.",
            param,
            "context_length_exceeded",
        )


def _text_length(message: ChatMessage) -> int:
    """The characters of a message's text (its content's string or text parts)."""
    if isinstance(message.content, str):
        return len(message.content)
    return sum(len(part.text or "") for part in message.content or ())


def _render(
    request: ChatCompletionRequest,
    tokenizer: Tokenizer,
    prompting: ImagePrompting | None,
    tools: list[JsonValue] | None,
    images: list[ChatImage],
    generation_prompt: bool,
) -> str:
    """The chat template applied to the request's messages, as text (its images' parts collected in
    `images`); a 400 for what the template cannot render."""
    messages = [_template_message(i, m, prompting, images) for i, m in enumerate(request.messages)]
    kwargs: dict[str, Any] = dict(request.chat_template_kwargs or {})  # checked below: none is reserved
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}.", "chat_template_kwargs")
    if tools is not None:
        kwargs["tools"] = tools
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, **kwargs)
    except jinja2.TemplateError as exc:
        raise bad_request(f"The chat template rejected the messages: {exc}", param="messages") from None
    except ValueError as exc:  # no chat template
        raise bad_request(str(exc), param="messages") from None
    # Any other error is the template tripping over what the client sent (a list where it wants a string).
    except Exception as exc:
        message = f"The chat template could not render the messages: {type(exc).__name__}: {exc}"
        raise bad_request(message, param="messages") from None
    assert isinstance(text, str)
    return text


def _template_message(
    index: int, message: ChatMessage, prompting: ImagePrompting | None, images: list[ChatImage]
) -> dict[str, Any]:
    if message.role not in ROLES:
        roles = ", ".join(ROLES)
        raise bad_request(
            f"Unknown role '{message.role}': expected one of {roles}.", f"messages[{index}].role"
        )
    if message.role != "assistant" and message.content in (None, []):
        raise bad_request(  # (an assistant's may be null: its calls say it all)
            f"A {message.role} message needs content (a string or a non-empty list of parts).",
            f"messages[{index}].content",
        )
    out = message.model_dump(exclude_none=True)
    # Chat templates predate OpenAI's `developer` role; it means what `system` means to them.
    if out["role"] == "developer":
        out["role"] = "system"
    if isinstance(message.content, list):
        # Parts as one string, as Qwen's templates join them: a template that expects a string would
        # otherwise render the list as nothing (or fail). An image is its placeholder text there.
        texts = []
        for j, part in enumerate(message.content):
            param = f"messages[{index}].content[{j}]"
            if part.type == "image_url":
                texts.append(_image_part(part, prompting, images, param))
            elif part.type == "text" and part.text is not None:
                texts.append(part.text)
            else:
                raise bad_request(f"Unsupported content part of type '{part.type}'.", param, "unsupported")
        out["content"] = "".join(texts)
    return out


def _image_part(
    part: ContentPart, prompting: ImagePrompting | None, images: list[ChatImage], param: str
) -> str:
    """An `image_url` part read into `images` → the text it becomes in the message."""
    if prompting is None:
        raise bad_request("This server takes no images (no vision encoder runs).", param, "unsupported")
    if part.image_url is None:
        raise bad_request("An image_url part needs its 'image_url': {'url': 'data:...'}.", param)
    try:
        images.append(prompting.read(part.image_url.url, images))
    except ValueError as exc:
        raise bad_request(f"Invalid image: {exc}", f"{param}.image_url.url") from None
    return prompting.placeholder


def completion_prompts(
    request: CompletionRequest, tokenizer: Tokenizer, max_bytes: int | None = None
) -> list[list[int]]:
    """Each prompt's ids (a batch: a list of strings or of id lists, at most MAX_PROMPTS): a string is
    encoded (with the tokenizer's special tokens; a 400 where it is over `max_bytes`), ids are checked."""
    given = given_prompts(request)
    if len(given) > MAX_PROMPTS:
        raise bad_request(f"At most {MAX_PROMPTS} prompts a request, got {len(given)}.", "prompt")
    if given is request.prompt:  # a batch
        return [_prompt_ids(p, tokenizer, f"prompt[{i}]", max_bytes) for i, p in enumerate(given)]
    return [_prompt_ids(given[0], tokenizer, "prompt", max_bytes)]


def _prompt_ids(prompt: JsonValue, tokenizer: Tokenizer, param: str, max_bytes: int | None) -> list[int]:
    if isinstance(prompt, str):
        check_prompt_bytes(prompt, max_bytes, param)
        ids = tokenizer.encode(prompt, add_special_tokens=True)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)  # type: ignore[arg-type]
        vocab = tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"Token id {bad} is outside the vocabulary [0, {vocab}).", param)
    else:
        raise bad_request("'prompt' must be a string or a list of token ids, or a list of either.", param)
    if not ids:
        raise bad_request("The prompt is empty.", param)
    return ids

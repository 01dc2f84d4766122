"""OpenAI-compatible request schemas, their validation, and their internal form (`GenerationSpec`).

Requests are parsed from the raw body with pydantic in strict JSON mode, so `"temperature": "1"` is an
error as it is for OpenAI, and every problem — malformed JSON included — becomes an `ApiError` with the
OpenAI error object (`{"error": {"message", "type", "param", "code"}}`). Unknown fields are ignored, as
OpenAI ignores them; known fields whose feature Spillway lacks (best_of, suffix) are refused when set to
anything but their neutral value (ignoring them would change what the client gets).

Length rule (vLLM's): a prompt that leaves no room for one generated token is refused (400, naming both
numbers), and so is a `max_tokens` (`max_completion_tokens`) above what the context leaves after the prompt.
A chat without `max_tokens` runs until the context is full; a text completion without it stops at
COMPLETION_MAX_TOKENS, OpenAI's default for that endpoint, or where the context ends.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError

from common.config import GRAMMAR_MAX_BYTES
from common.openai.reasoning import ReasoningForm
from common.openai.tool_calls import CallForm
from common.protocol import MAX_TOP_LOGPROBS, SamplingParams
from common.sampling.structured import Unavailable, structure_of
from common.text.tokenizer import Tokenizer

MAX_STOP_STRINGS = 4
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_CHOICES = 16
"""The most choices (`n`) one request may ask for: each takes a slot of its own."""
COMPLETION_MAX_TOKENS = 16
"""A text completion's `max_tokens` where the request gives none (OpenAI's and vLLM's default there)."""
MAX_LOGIT_BIAS = 1024
"""The most tokens one request may bias (each costs a little in every step)."""


class ApiError(Exception):
    """An error the API reports to the client: HTTP status plus the OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body: `{"error": {...}}`."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


# Schemas.


class Schema(BaseModel):
    """A request body's schema: strict types, unknown fields ignored (as OpenAI ignores them)."""

    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(Schema):
    include_usage: bool | None = False


class _GenerationRequest(Schema):
    """Fields shared by chat and text completions (OpenAI's, plus vLLM-style extensions)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    """0 keeps only the most likely token (the sampler always keeps it)."""
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    """Extension; 0 or -1 keeps every token (as does any k past the vocabulary)."""
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: JsonValue = None
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    """Choices to generate (each a request of its own to the workers: services/router/choices.py)."""
    stream: bool | None = False
    """null is false, as OpenAI reads it (so for every flag here)."""
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    """Extension: keep generating past end-of-sequence tokens."""
    stop_token_ids: list[int] | None = None
    """Extension: extra token ids that end generation (each in the vocabulary)."""
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100.0)
    """Extension (HF transformers', vLLM's): 1 is off."""
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    """Extension (vLLM's)."""
    min_tokens: int | None = Field(None, ge=0)
    """Extension (vLLM's): no end-of-sequence or stop token before this many tokens."""
    logit_bias: dict[str, float] | None = None
    """Token id (as a string) → bias in [-100, 100], at most MAX_LOGIT_BIAS of them."""
    response_format: dict[str, JsonValue] | None = None
    """{"type": "text" | "json_object" | "json_schema", ...}: OpenAI's structured output."""
    return_tokens_as_token_ids: bool | None = None
    """vLLM's extension: log-probabilities name tokens `token_id:N` (exact where text is ambiguous)."""


class ImageUrl(Schema):
    url: str
    detail: str | None = None


class ContentPart(Schema):
    type: str
    text: str | None = None
    image_url: ImageUrl | None = None


class ChatMessage(BaseModel):
    """One message; extra fields (tool_calls, name, reasoning_content, ...) are kept for the template."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    chat_template_kwargs: dict[str, JsonValue] | None = None
    """Extension: extra variables for the chat template (e.g. `enable_thinking`, `tools`)."""
    tools: list[JsonValue] | None = None
    tool_choice: JsonValue = None
    parallel_tool_calls: bool | None = None
    """False: at most one call (the text ends with the first call block, app.Router._chat_spec)."""
    functions: list[JsonValue] | None = None
    function_call: JsonValue = None


class CompletionRequest(_GenerationRequest):
    prompt: JsonValue
    max_tokens: int | None = Field(None, ge=0)
    """0 only with `echo`: the prompt scored (its tokens' log-probabilities), nothing generated."""
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """The sampled token's logprob and this many alternatives' (OpenAI allows 5; as vLLM, up to 20)."""


def parse_chat_request(body: bytes) -> ChatCompletionRequest:
    """Validate a `/v1/chat/completions` body; raises ApiError (400)."""
    return parse_body(ChatCompletionRequest, body)


def parse_completion_request(body: bytes) -> CompletionRequest:
    """Validate a `/v1/completions` body; raises ApiError (400)."""
    return parse_body(CompletionRequest, body)


_UNION_BRANCH = re.compile(r"^(str|int|float|bool|none|dict|list)$|[\[\-]")


_S = TypeVar("_S", bound=Schema)


def parse_body(schema: type[_S], body: bytes) -> _S:
    """`body` validated as `schema` (strict JSON); raises ApiError (400) naming the first problem."""
    try:
        return schema.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> ApiError:
    """The first problem pydantic found, as a 400 naming the parameter (`messages[0].content`)."""
    error = exc.errors(include_url=False)[0]
    if error["type"] == "json_invalid":
        return bad_request(f"The request body is not valid JSON: {error['msg']}", code="invalid_json")
    if error["type"] == "model_type" and not error["loc"]:
        return bad_request("The request body must be a JSON object.", code="invalid_json")
    return bad_request(_message(error), param=_param(error["loc"]) or None)


def _param(loc: Sequence[int | str]) -> str:
    """`('messages', 0, 'content', 'str')` → `messages[0].content` (pydantic's union branch tags dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _UNION_BRANCH.search(part):
            out += f".{part}" if out else part
    return out


def _message(error: Any) -> str:
    param = _param(error["loc"])
    if error["type"] == "missing":
        return f"'{param}' is a required property"
    return f"Invalid value for '{param}': {error['msg']}"


# Internal form.


@dataclass(frozen=True)
class GenerationSpec:
    """A validated request, ready for admission: prompt ids, sampling, and what the router does itself."""

    prompt_ids: list[int]
    sampling: SamplingParams
    stop: tuple[str, ...]
    """Stop strings (the router matches them on the detokenized text)."""
    stream: bool
    include_usage: bool
    """Streaming only: send a usage chunk before [DONE]."""
    kept_stop: tuple[str, ...] = ()
    """Stop strings that end the text with themselves in it (a call block's end tag, where
    parallel_tool_calls false allows one call)."""
    images: tuple[bytes, ...] = ()
    """The prompt's images (their files), in its order: the encoder's."""
    tokens_as_ids: bool = False
    """Log-probabilities name tokens `token_id:N` instead of by their text (vLLM's extension)."""
    tool_form: CallForm | None = None
    """How the function calls are read out of a chat's text (common/openai/tool_calls.py); None: none are."""
    reasoning: ReasoningForm | None = None
    """How a chat's reasoning is read apart from its content (common/openai/reasoning.py); None: it is not."""
    n: int = 1
    """Choices to generate."""
    echo: str | None = None
    """Text completions' echo: the prompt's text, which the response puts before each completion."""
    max_tokens: int | None = None
    """The router's own limit where it is below the workers' (`sampling.max_tokens`, at least 1): 0 for a
    completion that only scores its prompt (echo, max_tokens 0)."""


def check_model(requested: str | None, served: str) -> None:
    """404 unless the request names the served model (or none, which means it)."""
    if requested is not None and requested != served:
        raise ApiError(
            404,
            f"The model '{requested}' does not exist; this server serves '{served}'.",
            param="model",
            code="model_not_found",
        )


def given_prompts(request: CompletionRequest) -> list[JsonValue]:
    """The prompts as the request gives them: a batch (a list of strings or id lists), or one."""
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        return prompt
    return [prompt]


def chat_spec(
    request: ChatCompletionRequest,
    prompt_ids: list[int],
    max_context: int,
    vocab: int,
    grammar_max_bytes: int = GRAMMAR_MAX_BYTES,
) -> GenerationSpec:
    """Check a chat request's parameters and build its internal form (`vocab`: the tokenizer's size;
    `grammar_max_bytes`: the largest structured output's form served)."""
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")
    if request.functions:
        raise bad_request("functions is deprecated: give tools.", "functions", "unsupported")
    if request.function_call not in (None, "none"):
        raise bad_request("function_call is deprecated: give tool_choice.", "function_call", "unsupported")
    asked = ("max_completion_tokens", request.max_completion_tokens)
    if request.max_completion_tokens is None:
        asked = ("max_tokens", request.max_tokens)
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    return _spec(request, prompt_ids, max_context, vocab, asked, logprobs, grammar_max_bytes)


def completion_specs(
    request: CompletionRequest,
    prompts: list[list[int]],
    max_context: int,
    tokenizer: Tokenizer,
    grammar_max_bytes: int = GRAMMAR_MAX_BYTES,
) -> list[GenerationSpec]:
    """Check a completion request's parameters and build the internal form of each of its prompts; with
    `echo`, the prompt's text (as given, or decoded from its ids) and, with `logprobs`, its tokens' too
    (`grammar_max_bytes`: the largest structured output's form served)."""
    if request.best_of not in (None, 1):
        raise bad_request("best_of must be 1.", "best_of", "unsupported")
    if request.suffix:
        raise bad_request("suffix is not supported.", "suffix", "unsupported")
    if request.max_tokens == 0 and not request.echo:
        raise bad_request("max_tokens 0 generates nothing: it needs echo (the prompt scored).", "max_tokens")
    scores = request.max_tokens == 0  # the workers still sample one token: the router returns none
    specs = []
    for ids, text in zip(prompts, given_prompts(request), strict=True):
        asked = ("max_tokens", None if request.max_tokens is None else max(request.max_tokens, 1))
        spec = _spec(
            request,
            ids,
            max_context,
            tokenizer.vocab_size,
            asked,
            request.logprobs,
            grammar_max_bytes,
            COMPLETION_MAX_TOKENS,
        )
        if scores:
            spec = dataclasses.replace(spec, max_tokens=0)
        if request.echo:
            sampling = msgspec.structs.replace(spec.sampling, prompt_logprobs=request.logprobs)
            echo = text if isinstance(text, str) else tokenizer.decode(ids)
            spec = dataclasses.replace(spec, echo=echo, sampling=sampling)
        specs.append(spec)
    return specs


def _spec(
    request: _GenerationRequest,
    prompt_ids: list[int],
    max_context: int,
    vocab: int,
    asked: tuple[str, int | None],
    logprobs: int | None,
    grammar_max_bytes: int,
    default_max_tokens: int | None = None,
) -> GenerationSpec:
    """The internal form of a request whose prompt is `prompt_ids`; `asked`: the parameter that sets its
    length and its value, a 400 where it is more than the context leaves (None: `default_max_tokens`, or
    the context's end, whichever comes first); `grammar_max_bytes`: the largest structured output's form."""
    structure = _structure(request, grammar_max_bytes)
    bad = next((t for t in request.stop_token_ids or () if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"Stop token id {bad} is outside the vocabulary [0, {vocab}).", "stop_token_ids")
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed when stream is true.", "stream_options")
    room = max_context - len(prompt_ids)
    if room < 1:
        raise bad_request(
            f"The prompt has {len(prompt_ids)} tokens, but this model's maximum context is {max_context} "
            "tokens, which must also hold at least one generated token.",
            "messages" if isinstance(request, ChatCompletionRequest) else "prompt",
            "context_length_exceeded",
        )
    param, max_tokens = asked
    if max_tokens is not None and max_tokens > room:
        raise bad_request(
            f"{param} is {max_tokens}, but the prompt has {len(prompt_ids)} tokens and this model's maximum "
            f"context is {max_context} tokens: at most {room} may be generated.",
            param,
            "context_length_exceeded",
        )
    max_tokens = max_tokens or min(default_max_tokens or room, room)
    if (request.min_tokens or 0) > max_tokens:
        raise bad_request(
            f"min_tokens ({request.min_tokens}) is more than the {max_tokens} tokens this request may "
            "generate.",
            "min_tokens",
        )
    sampling = SamplingParams(
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=max(request.top_k or 0, 0),
        seed=request.seed,
        max_tokens=max_tokens,
        ignore_eos=bool(request.ignore_eos),
        stop_token_ids=tuple(request.stop_token_ids or ()),
        logprobs=logprobs,
        min_p=request.min_p or 0.0,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
        min_tokens=request.min_tokens or 0,
        logit_bias=_logit_bias(request.logit_bias, vocab),
        structure=structure,
    )
    return GenerationSpec(
        prompt_ids=prompt_ids,
        sampling=sampling,
        stop=parse_stop(request.stop),
        stream=bool(request.stream),
        include_usage=bool(
            request.stream and request.stream_options and request.stream_options.include_usage
        ),
        tokens_as_ids=bool(request.return_tokens_as_token_ids),
        n=request.n or 1,
    )


def _structure(request: _GenerationRequest, max_bytes: int) -> str:
    """`response_format` as `SamplingParams.structure` (common/sampling/structured.py), checked: a 400 for a
    format or schema that cannot be followed, a form over `max_bytes`, or where xgrammar is not installed."""
    try:
        structure = structure_of(request.response_format, max_bytes)
    except Unavailable as exc:
        raise bad_request(str(exc), "response_format", "unsupported") from None
    except ValueError as exc:
        raise bad_request(str(exc), "response_format") from None
    if structure:
        check_grammar_ends(request, "a structured output")
    return structure


def check_grammar_ends(request: _GenerationRequest, what: str) -> None:
    """A 400 where `what` (an answer a grammar holds, which ends with its end-of-sequence token) would be
    held past its end: ignore_eos, min_tokens."""
    for name in ("ignore_eos", "min_tokens"):
        if getattr(request, name):
            raise bad_request(f"{name} cannot hold {what} past its end.", name)


def _logit_bias(bias: dict[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as (token id, bias) pairs, each id in the vocabulary and each bias in [-100, 100]."""
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(
            f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}.", "logit_bias"
        )
    pairs = []
    for key, value in bias.items():
        if not re.fullmatch(r"0|[1-9]\d*", key) or int(key) >= vocab:  # one spelling a token
            raise bad_request(f"logit_bias key {key!r} is not a token id in [0, {vocab}).", "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise bad_request(f"logit_bias of token {key} is {value}, outside [-100, 100].", "logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def parse_stop(stop: JsonValue) -> tuple[str, ...]:
    """`stop` as a tuple of non-empty strings (a string or a list of at most four; empty ones dropped)."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOP_STRINGS:
            raise bad_request(f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}.", "stop")
        stops = list(stop)  # type: ignore[arg-type]
    else:
        raise bad_request("'stop' must be a string or a list of strings.", "stop")
    return tuple(s for s in dict.fromkeys(stops) if s)

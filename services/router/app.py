"""The router's HTTP face: an OpenAI-compatible FastAPI app around `RouterCore` (docs/ARCHITECTURE.md, API
and metrics).

`create_app(config)` loads the tokenizer, builds the core and the metrics, and returns the app; its lifespan
binds and closes the sockets. Every error, malformed JSON and unknown routes included, is answered with
OpenAI's error object. A request whose client goes away — while it waits for a slot, while it generates,
or mid-stream — is aborted at the workers at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from common.api_key import authorized
from common.metrics import RouterMetrics, new_registry, render, serve
from common.openai import api
from common.openai import prompts as openai_prompts
from common.openai.api import ApiError, ChatCompletionRequest, GenerationSpec
from common.openai.chat_images import ImagePrompting
from common.openai.reasoning import ReasoningForm, reasoning_form, reasoning_tags
from common.openai.responses import (
    ResponsesRequest,
    as_chat,
    chat_param_error,
    parse_responses_request,
    wants_logprobs,
)
from common.openai.tool_calls import call_form, tool_call_tags, xml_call_template
from common.protocol import SamplingParams
from common.sampling import structured
from common.text.tokenizer import Tokenizer
from services.router.choices import Choices
from services.router.config import BODY_ALLOWANCE_BYTES, RouterConfig, model_max_context
from services.router.core import RouterCore
from services.router.middleware import REQUEST_ID, TOKENS, AccessLog, RequestIds
from services.router.responses import ResponseBuilder
from services.router.responses_api import ResponseBody, ResponseStream
from services.router.streams import ChatEvents, ResponseEvents, StreamEvents

log = logging.getLogger(__name__)

T = TypeVar("T")
CLIENT_CLOSED = 499
"""Status logged for requests whose client went away (nginx's convention; the client never sees it)."""
_REASONS = {400: "bad_request", 401: "unauthorized", 404: "not_found", 429: "queue_full", 503: "not_ready"}


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


class _Stream(StreamingResponse):
    """A streaming response that always runs `on_close` (even if the client left before it started)."""

    def __init__(self, content: AsyncGenerator[bytes, None], on_close: Callable[[], None]) -> None:
        # No caching, and no buffering by a reverse proxy (nginx honours X-Accel-Buffering): tokens must flow.
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._content = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._content.aclose()
            self._on_close()


class Router:
    """The endpoints' logic, with the state they share."""

    def __init__(self, config: RouterConfig, tokenizer: Tokenizer, max_context: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.configured_context = max_context
        self.registry = new_registry()
        self.metrics = RouterMetrics.create(self.registry)
        self.core = RouterCore(config, self.metrics)
        self.created = int(time.time())
        encoder = self.core.encoder is not None
        self.prompting = (
            ImagePrompting.from_model_dir(
                config.model_dir, tokenizer, config.max_image_pixels, config.max_request_pixels
            )
            if encoder
            else None
        )
        """How chats' images become prompt tokens (None: no encoder runs; an image is a 400)."""
        self.tool_tags = tool_call_tags(tokenizer)
        """How the model's function calls are read from its text (None: its template asks for none)."""
        self.xml_calls = xml_call_template(tokenizer)
        """Whether its template asks for calls in the XML form (a forced call is held to it)."""
        self.reasoning_tags = reasoning_tags(tokenizer)
        """How the model's reasoning is read apart from its answer (None: its template has none)."""

    @property
    def max_context(self) -> int:
        """The configured context, or the workers' where they hold less (what a request may use)."""
        return self.core.context_limit(self.configured_context)

    @property
    def max_prompt_bytes(self) -> int:
        """The most bytes of text a prompt may hold (`RouterConfig.prompt_bytes_per_token`)."""
        return self.max_context * self.config.prompt_bytes_per_token

    def authorize(self, request: Request) -> None:
        """401 unless the request carries the configured Bearer key (when one is configured)."""
        if not authorized(request.headers.get("authorization"), self.config.api_key):
            raise ApiError(401, "Invalid or missing API key.", code="invalid_api_key")

    def count_error(self, error: ApiError) -> None:
        reason = error.code or _REASONS.get(error.status, str(error.status))
        self.metrics.request_errors.labels(reason=reason).inc()

    async def _body(self, request: Request) -> bytes:
        """The request's body, refused (by its Content-Length, or as it streams in without one) with a 413
        once it is over `max_request_bytes`, or with a 400 once it is over what a prompt of the context
        can take where no encoder runs (no images: the body is little more than its prompt's text and a
        response format within `grammar_max_bytes`)."""
        limit = self.config.max_request_bytes
        text_limit = self.max_prompt_bytes + self.config.grammar_max_bytes + BODY_ALLOWANCE_BYTES
        prompt_limit = text_limit if self.prompting is None else limit
        declared = request.headers.get("content-length", "")
        if declared.isdigit():
            _check_body_size(int(declared), limit, prompt_limit)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            _check_body_size(len(body), limit, prompt_limit)
        return bytes(body)

    async def chat(self, request: Request) -> Response:
        received = time.monotonic()
        self.authorize(request)
        body = await asyncio.to_thread(api.parse_chat_request, await self._body(request))
        api.check_model(body.model, self.config.model_name)
        spec = await self._chat_spec(body)
        return await self._serve(request, [spec], chat=True, received=received)

    async def responses(self, request: Request) -> Response:
        """`POST /v1/responses`: the Responses API, served as the chat it maps to (its errors name the
        Responses request's parameters)."""
        received = time.monotonic()
        self.authorize(request)
        body = await asyncio.to_thread(parse_responses_request, await self._body(request))
        api.check_model(body.model, self.config.model_name)
        try:
            spec = await self._chat_spec(as_chat(body))
        except ApiError as exc:
            raise chat_param_error(exc) from None
        return await self._unless_gone(self._respond(request, body, spec, received))

    async def _respond(
        self, request: Request, body: ResponsesRequest, spec: GenerationSpec, received: float
    ) -> Response:
        """A Responses request's answer: its events as they come, or the whole response."""
        rid = _request_id(request)
        if spec.stream:
            choices = await self._started(request, [spec], True, received)
            response = ResponseBody(body, rid, self.config.model_name, int(choices.arrival))
            events = ResponseEvents(ResponseStream(response, wants_logprobs(body)), self._token_count)
            return _Stream(self._events(choices, events, rid), choices.close)
        choices = await self._finished(request, [spec], True, received)
        (result,) = choices.results()
        response = ResponseBody(body, rid, self.config.model_name, int(choices.arrival))
        reasoning = self._token_count(result.reasoning or "")
        return JSONResponse(
            response.full(result, choices.prompt_tokens, choices.completion_tokens, reasoning)
        )

    def _token_count(self, text: str) -> int:
        """Tokens of `text` encoded again (the reasoning's share of a completion's tokens, for its usage)."""
        return len(self.tokenizer.encode(text, add_special_tokens=False)) if text else 0

    async def _chat_spec(self, body: ChatCompletionRequest) -> GenerationSpec:
        """A chat request's generation: its prompt through the template (tools, images), its sampling, how
        its calls and reasoning are read, and a forced call's grammar."""
        tools = openai_prompts.chat_tools(body, self.tool_tags)
        thinks = self.reasoning_tags is not None
        prompt_ids, images, opening = await asyncio.to_thread(
            openai_prompts.chat_prompt_ids,
            body,
            self.tokenizer,
            self.prompting,
            tools,
            thinks,
            self.max_prompt_bytes,
        )
        limit = self.config.grammar_max_bytes  # (the grammars checked on a thread: not on the event loop)
        vocab = self.tokenizer.vocab_size
        spec = await asyncio.to_thread(api.chat_spec, body, prompt_ids, self.max_context, vocab, limit)
        self.core.check_images(sum(image.tokens for image in images))
        tags = None if tools is None else self.tool_tags
        forced = (
            ""
            if tags is None
            else await asyncio.to_thread(openai_prompts.forced_call, body, tools, tags, self.xml_calls, limit)
        )
        sampling = msgspec.structs.replace(spec.sampling, structure=forced) if forced else spec.sampling
        raw = tuple(image.raw for image in images)
        form = None if tags is None else call_form(tags, tools)  # type: ignore[arg-type]
        reasoning, sampling = self._reasoning(opening, sampling)
        # parallel_tool_calls false: the text ends with the first call block (a forced call's grammar holds
        # one already)
        once = (tags[1],) if tags is not None and body.parallel_tool_calls is False and not forced else ()
        return dataclasses.replace(
            spec, images=raw, tool_form=form, sampling=sampling, reasoning=reasoning, kept_stop=once
        )

    def _reasoning(
        self, opening: str, sampling: SamplingParams
    ) -> tuple[ReasoningForm | None, SamplingParams]:
        """How a chat's reasoning is read (None: it has none), and its sampling, from the text its generation
        prompt adds (`opening`): a structured answer whose generation prompt opens the reasoning block holds
        to its grammar from the block's end token on (the model thinks first); one that does not is held from
        its first token, and is all content."""
        if self.reasoning_tags is None:
            return None, sampling
        form = reasoning_form(self.reasoning_tags, opening)
        if not sampling.structure:
            return form, sampling
        end = self.tokenizer.token_to_id(self.reasoning_tags[1])
        if not form.inside or end is None:
            return None, sampling
        return form, msgspec.structs.replace(sampling, structure_after=end)

    async def completions(self, request: Request) -> Response:
        received = time.monotonic()
        self.authorize(request)
        body = await asyncio.to_thread(api.parse_completion_request, await self._body(request))
        api.check_model(body.model, self.config.model_name)
        prompts = await asyncio.to_thread(
            openai_prompts.completion_prompts, body, self.tokenizer, self.max_prompt_bytes
        )
        limit = self.config.grammar_max_bytes  # (a grammar checked on a thread: not on the event loop)
        specs = await asyncio.to_thread(
            api.completion_specs, body, prompts, self.max_context, self.tokenizer, limit
        )
        return await self._serve(request, specs, chat=False, received=received)

    def models(self, request: Request) -> dict[str, Any]:
        self.authorize(request)
        return {"object": "list", "data": [self._model()]}

    def model(self, request: Request, model: str) -> dict[str, Any]:
        """`GET /v1/models/{model}`: the served model, or 404."""
        self.authorize(request)
        api.check_model(model, self.config.model_name)
        return self._model()

    def _model(self) -> dict[str, Any]:
        return {
            "id": self.config.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "spillway",
            "max_model_len": self.max_context,
        }

    async def _serve(
        self, request: Request, specs: list[GenerationSpec], chat: bool, received: float
    ) -> Response:
        """Generate every spec's choices (a batched completion has a spec a prompt; they stream alike)."""
        if specs[0].stream:
            return await self._unless_gone(self._stream(request, specs, chat, received))
        return await self._unless_gone(self._complete(request, specs, chat, received))

    async def _unless_gone(self, answer: Coroutine[Any, Any, Response]) -> Response:
        """`answer`, or (counted) the status of a client that left before it was ready."""
        try:
            return await answer
        except ClientGone:
            self.metrics.request_errors.labels(reason="client_disconnect").inc()
            return Response(status_code=CLIENT_CLOSED)

    async def _complete(
        self, request: Request, specs: list[GenerationSpec], chat: bool, received: float
    ) -> Response:
        choices = await self._finished(request, specs, chat, received)
        builder = ResponseBuilder(chat, _request_id(request), self.config.model_name, int(choices.arrival))
        body = builder.full(choices.results(), choices.prompt_tokens, choices.completion_tokens)
        return JSONResponse(body)

    async def _finished(
        self, request: Request, specs: list[GenerationSpec], chat: bool, received: float
    ) -> Choices:
        """Every choice generated to its end (ClientGone if the client leaves first)."""
        rid = _request_id(request)

        async def run() -> Choices:
            choices = _choices(request, Choices(self.core, self.tokenizer, specs, chat))
            await choices.start(rid, received)
            try:
                await choices.finish()
            finally:
                choices.close()
            return choices

        return await unless_disconnected(request, run())

    async def _started(
        self, request: Request, specs: list[GenerationSpec], chat: bool, received: float
    ) -> Choices:
        """Every choice admitted and its first delta in (so that early errors still get their status)."""
        choices = _choices(request, Choices(self.core, self.tokenizer, specs, chat))
        await unless_disconnected(request, choices.start(_request_id(request), received))
        return choices

    async def _stream(
        self, request: Request, specs: list[GenerationSpec], chat: bool, received: float
    ) -> Response:
        choices = await self._started(request, specs, chat, received)
        rid = _request_id(request)
        created = int(choices.arrival)
        builder = ResponseBuilder(chat, rid, self.config.model_name, created, specs[0].include_usage)
        return _Stream(self._events(choices, ChatEvents(builder), rid), choices.close)

    async def _events(self, choices: Choices, events: StreamEvents, rid: str) -> AsyncGenerator[bytes, None]:
        """A stream's bytes in `events`' form; a failure after the 200 went out is the form's error event."""
        finished = failed = False
        try:
            for chunk in events.opening(choices):
                yield chunk
            async for choice, delta in choices.deltas():
                for chunk in events.delta(choice, delta):
                    yield chunk
            finished = True
            for chunk in events.closing(choices):
                yield chunk
        except ApiError as exc:
            failed = True
            self.count_error(exc)
            for chunk in events.failure(exc):
                yield chunk
        except Exception:  # a bug, after the 200 went out: the client still gets an error event, not a cut
            failed = True
            log.exception("streaming %s failed", rid)
            self.metrics.request_errors.labels(reason="internal").inc()
            for chunk in events.failure(
                ApiError(500, "Internal server error.", type="server_error", code="internal_error")
            ):
                yield chunk
        finally:
            if not finished and not failed:
                self.metrics.request_errors.labels(reason="client_disconnect").inc()
            choices.close()


def _choices(request: Request, choices: Choices) -> Choices:
    """`choices`, their token counts given to the request's access line."""
    request.scope[TOKENS] = lambda: (choices.prompt_tokens, choices.completion_tokens)
    return choices


def _request_id(request: Request) -> str:
    """The request's id (RequestIds'), or a new one where the middleware did not run."""
    return request.scope.get(REQUEST_ID) or uuid.uuid4().hex


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Run `work` unless the client disconnects first; then cancel it (its cleanup aborts the request)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        raise ClientGone
    return task.result()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def create_app(config: RouterConfig) -> FastAPI:
    """The router app for `config` (the tokenizer is loaded now; sockets open in the app's lifespan)."""
    tokenizer = Tokenizer.from_dir(config.model_dir)
    max_context = config.max_context or model_max_context(config.model_dir)
    router = Router(config, tokenizer, max_context)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # xgrammar's import takes seconds: on a thread beside the start (not at the first structured
        # request, on the event loop), off the path to the first answer
        threading.Thread(target=structured.preload, name="preload", daemon=True).start()
        await router.core.start()
        stop_metrics = (
            serve(router.registry, config.metrics_port, config.host, config.api_key)
            if config.metrics_port
            else None
        )
        try:
            yield
        finally:
            await router.core.close()
            if stop_metrics is not None:
                stop_metrics()

    app = FastAPI(title="Spillway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router
    app.add_middleware(AccessLog)
    app.add_middleware(RequestIds)  # outside AccessLog: the id is set before the line is written
    _add_error_handlers(app, router)

    app.add_api_route("/v1/chat/completions", router.chat, methods=["POST"])
    app.add_api_route("/v1/completions", router.completions, methods=["POST"])
    app.add_api_route("/v1/responses", router.responses, methods=["POST"])
    app.add_api_route("/v1/models", router.models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", router.model, methods=["GET"])

    @app.get("/health")
    def health(request: Request) -> JSONResponse:
        report = router.core.health()
        if not authorized(request.headers.get("authorization"), config.api_key):
            report = {"status": report["status"]}  # the pids, loads and metrics URLs are the key holder's
        # Degraded (some pair down) still serves: 200, so that a load balancer keeps sending.
        return JSONResponse(report, status_code=503 if report["status"] == "unavailable" else 200)

    @app.get("/metrics/targets")
    def metrics_targets(request: Request) -> JSONResponse:
        """Prometheus `http_sd_configs`: the workers' metrics addresses, as they are now."""
        router.authorize(request)
        return JSONResponse(router.core.supervisor.metrics_targets())

    @app.get("/metrics")
    def metrics(request: Request) -> Response:
        router.authorize(request)
        router.core.sync_dropped_frames()
        data, content_type = render(router.registry)
        return Response(data, media_type=content_type)

    return app


def _check_body_size(size: int, limit: int, prompt_limit: int) -> None:
    """A 413 for a body of `size` bytes over `limit`, a 400 for one over `prompt_limit` (a prompt's)."""
    if size > limit:
        raise ApiError(413, f"The request body is over {limit:,} bytes.", code="request_too_large")
    if size > prompt_limit:
        raise api.bad_request(
            f"The request body is over {prompt_limit:,} bytes: more text than this model's context holds"
            " beside a response format within --grammar-max-bytes.",
            code="context_length_exceeded",
        )


def _add_error_handlers(app: FastAPI, router: Router) -> None:
    """OpenAI's error object for every failure, including FastAPI's own 422s and routing errors."""

    def reply(error: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        router.count_error(exc)
        return reply(exc)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first["loc"] if p != "body") or None
        return await on_api_error(request, api.bad_request(f"Invalid request: {first['msg']}", param))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return reply(ApiError(exc.status_code, str(exc.detail), type=kind))

    async def on_crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        router.metrics.request_errors.labels(reason="internal").inc()
        return reply(ApiError(500, "Internal server error.", type="server_error", code="internal_error"))

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_crash)

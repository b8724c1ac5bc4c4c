"""The Litestar application: OpenAI-compatible endpoints over one :class:`~llminfer.engine.InferenceEngine`.

``create_app(EngineConfig())`` returns an ASGI app; its lifespan loads the engine (if needed) and runs the
engine pipeline in the server's own event loop (``async with engine.running():``). Run it with uvicorn
(``llminfer serve``) or any ASGI server.
"""

from __future__ import annotations

import contextlib
import hmac
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import attrs
import structlog
from anyio.abc import TaskGroup
from litestar import Litestar, Request, Response, Router, get, post
from litestar.connection import ASGIConnection
from litestar.datastructures import MutableScopeHeaders
from litestar.handlers.base import BaseRouteHandler
from litestar.openapi import OpenAPIConfig, ResponseSpec
from litestar.openapi.spec import Components, SecurityScheme
from litestar.params import FromPath, SkipValidation
from litestar.response import Stream
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from llminfer import __version__
from llminfer.api import protocol as s
from llminfer.api.errors import (
    EXCEPTION_HANDLERS,
    SERVER_ERROR,
    APIError,
    ErrorResponse,
    bad_request,
    from_engine_error,
)
from llminfer.api.metrics import CONTENT_TYPE, ServerMetrics
from llminfer.api.serving import (
    DONE_FRAME,
    Job,
    JobOutcome,
    PromptBuilder,
    Ticket,
    TokenText,
    chat_events,
    chat_response,
    check_context,
    completion_events,
    completion_response,
    error_frame,
    max_new_tokens,
    new_job,
    run_job,
    sampling_kwargs,
)
from llminfer.config import EngineConfig
from llminfer.engine import InferenceEngine
from llminfer.errors import LLMInferError

log = structlog.get_logger("llminfer.api")

BUILTIN_MODEL_ID = "llminfer/tiny-qwen2"
DEFAULT_MAX_QUEUE_SIZE = 1024
_STATE_KEY = "llminfer"
_REQUEST_ID_RE = re.compile(r"[\x21-\x7e]{1,128}")


@attrs.define
class ServerState:
    """Everything the handlers share: the engine, settings, metrics, and the live counters.

    Attributes:
        served_model_name: the model id clients see (``/v1/models``, ``model`` in responses).
        accepted_model_names: ``model`` values requests may use (the served name and the model id).
        max_queue_size: engine requests allowed beyond the running batch (``max_batch_size``); more get 429.
        in_flight: engine requests submitted and not yet finished (one per choice).
    """

    engine: InferenceEngine
    served_model_name: str
    accepted_model_names: frozenset[str]
    api_key: str | None
    max_queue_size: int | None
    metrics: ServerMetrics
    created: int = attrs.field(factory=lambda: int(time.time()))
    task_group: TaskGroup | None = None
    ready: bool = False
    in_flight: int = 0
    prompts: PromptBuilder | None = None
    token_text: TokenText | None = None

    def engine_started(self) -> None:
        """Set up what needs the loaded tokenizer and model (called from the lifespan)."""
        engine = self.engine
        vocab_size = None
        model_cfg = getattr(getattr(engine, "model", None), "config", None)
        if model_cfg is not None:  # backends without a transformers model leave the check to the engine
            text_cfg = model_cfg.get_text_config() if hasattr(model_cfg, "get_text_config") else model_cfg
            vocab_size = getattr(text_cfg, "vocab_size", None)
        self.prompts = PromptBuilder(engine.tokenizer, vocab_size)
        self.token_text = TokenText(engine.tokenizer)

    @property
    def serving(self) -> bool:
        """The lifespan has started and the engine pipeline is running."""
        return self.ready and bool(getattr(self.engine, "is_running", False))

    def resolve_model(self, requested: str | None) -> str:
        """The served name for a request's ``model`` (absent means the served model).

        Raises:
            APIError: 404 ``model_not_found``.
        """
        if requested is None or requested in self.accepted_model_names:
            return self.served_model_name
        raise APIError(404, f"The model `{requested}` does not exist. This server serves "
                            f"`{self.served_model_name}`.", param="model", code="model_not_found")

    def admit(self, count: int) -> Ticket:
        """Reserve room for ``count`` engine requests.

        Raises:
            APIError: 429 with ``Retry-After`` when the running batch and the queue are full.
        """
        if self.max_queue_size is not None and self.in_flight > 0:
            limit = self.engine.cfg.max_batch_size + self.max_queue_size
            if self.in_flight + count > limit:
                raise APIError(429, f"The server is at capacity ({self.in_flight} requests in flight, queue size "
                                    f"{self.max_queue_size}); retry shortly.", type="rate_limit_error",
                               code="rate_limit_exceeded", headers={"Retry-After": "1"})
        self.in_flight += count
        return Ticket(self._release, count)

    def _release(self, count: int) -> None:
        self.in_flight -= count


def _state(request: ASGIConnection) -> ServerState:
    return request.app.state[_STATE_KEY]


def _info(scope: Scope) -> dict[str, Any]:
    return scope.setdefault("state", {}).setdefault("llminfer", {})  # type: ignore[return-value]


def request_id_of(scope: Scope) -> str:
    """The request's id: the client's ``x-request-id`` when it is a sane token, else a new one."""
    state = scope.setdefault("state", {})
    rid = state.get("request_id")
    if rid is None:
        for name, value in scope.get("headers", ()):
            if name == b"x-request-id":
                candidate = value.decode("latin-1").strip()
                if _REQUEST_ID_RE.fullmatch(candidate):
                    rid = candidate
                break
        rid = rid or f"req-{uuid.uuid4().hex}"
        state["request_id"] = rid
    return rid


# ---------------------------------------------------------------------------- middleware and hooks
def request_log_middleware(app: ASGIApp) -> ASGIApp:
    """One structlog line per HTTP request (id, method, path, status, tokens, latency in ms), and the
    request's cleanup (closing an SSE stream) once the response is over."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        rid = request_id_of(scope)
        t0 = time.perf_counter()
        status = 0

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await app(scope, receive, send_wrapper)
        finally:
            info = _info(scope)
            cleanup = info.pop("cleanup", None)
            if cleanup is not None:
                with anyio.CancelScope(shield=True):
                    await cleanup()
            path = scope.get("path", "")
            fields: dict[str, Any] = {}
            outcome = info.get("outcome")
            if outcome is not None:
                fields.update(prompt_tokens=info.get("prompt_tokens"), completion_tokens=outcome.completion_tokens,
                              choices=info.get("choices"),
                              finish_reason=",".join(sorted(set(outcome.finish_reasons.values()))) or None)
            for key in ("disconnected", "error", "error_code"):
                if info.get(key):
                    fields[key] = info[key]
            level = log.info if path.startswith("/v1/") else log.debug
            level("request", request_id=rid, method=scope.get("method"), path=path,
                  status=info.get("status_override", status),
                  latency_ms=round((time.perf_counter() - t0) * 1e3, 1), **fields)

    return middleware


async def _echo_request_id(message: Message, scope: Scope) -> None:
    if message["type"] == "http.response.start":
        headers = MutableScopeHeaders.from_message(message)
        headers["x-request-id"] = request_id_of(scope)


def _api_key_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    key = _state(connection).api_key
    if key is None:
        return
    scheme, _, token = connection.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                       code="invalid_api_key")


# ---------------------------------------------------------------------------- request helpers
class EventStream(Stream):
    """A ``text/event-stream`` response (Litestar would otherwise apply the handler's JSON media type)."""

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["media_type"] = "text/event-stream"
        return super().to_asgi_response(*args, **kwargs)


async def _watch_disconnect(receive: Receive, work: Callable[[], Awaitable[Any]]) -> tuple[Any, bool]:
    """Run ``work`` and cancel it if the client disconnects. Returns (result, disconnected)."""
    result: Any = None
    error: Exception | None = None
    disconnected = False
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            nonlocal disconnected
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    disconnected = True
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(watch)
        try:
            result = await work()
        except Exception as exc:  # noqa: BLE001 - re-raised below, outside the task group
            error = exc
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return result, disconnected


def _check_common(body: s.ChatCompletionRequest | s.CompletionRequest, num_prompts: int) -> None:
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if body.logit_bias:
        raise bad_request("logit_bias is not supported by this server", "logit_bias", "unsupported_parameter")
    if num_prompts * (body.n or 1) > s.MAX_CHOICES:
        raise bad_request(f"at most {s.MAX_CHOICES} choices per request (prompts x n)", "n", "invalid_value")


async def _execute(request: Request, state: ServerState, job: Job, stream: bool, prompt_param: str) -> Response:
    """Admit, run and render one call (streamed or not), cancelling it if the client goes away."""
    ticket = state.admit(len(job.requests))
    outcome = JobOutcome()
    info = _info(request.scope)
    info["prompt_tokens"] = sum(len(p) for p in job.prompt_ids)
    info["choices"] = len(job.requests)
    info["outcome"] = outcome
    chunks = run_job(job, state.engine, state.task_group, ticket, state.metrics, outcome)

    async def collect_all() -> list:
        return [item async for item in chunks]

    async def preroll() -> list:
        # Until every choice has produced a chunk: a request that fails at once (prompt too long, cannot fit
        # in the KV cache) becomes a plain error response instead of a broken stream.
        items: list = []
        seen: set[int] = set()
        while len(seen) < len(job.requests):
            try:
                item = await chunks.__anext__()
            except StopAsyncIteration:
                break
            items.append(item)
            seen.add(item[0])
        return items

    try:
        items, disconnected = await _watch_disconnect(request.receive, preroll if stream else collect_all)
    except LLMInferError as exc:
        await chunks.aclose()
        raise from_engine_error(exc, prompt_param=prompt_param) from None
    except BaseException:
        await chunks.aclose()
        ticket.release()
        raise
    if disconnected:
        await chunks.aclose()
        ticket.release()
        info["status_override"] = 499
        info["disconnected"] = True
        return Response(b"", status_code=499)
    token_text = state.token_text
    assert token_text is not None
    if not stream:
        await chunks.aclose()
        render = chat_response if job.kind == "chat" else completion_response
        return Response(render(job, items, outcome, token_text), status_code=200)
    events_fn = chat_events if job.kind == "chat" else completion_events
    frames = _sse(events_fn(job, items, chunks, outcome, token_text), chunks, info)

    async def cleanup() -> None:
        # Run by the request middleware once the response is over, however it ended: a stream cancelled
        # while parked at a ``yield`` (or never started) is closed here, so its requests are cancelled now
        # rather than whenever the generator is garbage-collected.
        await frames.aclose()
        await chunks.aclose()

    info["cleanup"] = cleanup
    return EventStream(frames, media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _sse(events: AsyncIterator[bytes], chunks: AsyncIterator[Any], info: dict[str, Any]) -> AsyncIterator[bytes]:
    """Frames of ``events``; a failure after the stream started becomes an error event, then ``[DONE]``."""
    finished = False
    try:
        async with contextlib.aclosing(events) as frames:  # type: ignore[type-var]
            async for frame in frames:
                yield frame
        finished = True
    except LLMInferError as exc:
        error = from_engine_error(exc)
        log.error("stream failed", error=repr(exc))
        info["error"] = error.message
        yield error_frame(error)
        yield DONE_FRAME
        finished = True
    except Exception as exc:
        log.exception("stream failed", error=repr(exc))
        error = APIError(500, f"internal server error ({type(exc).__name__})", type=SERVER_ERROR)
        info["error"] = error.message
        yield error_frame(error)
        yield DONE_FRAME
        finished = True
    finally:
        if not finished:
            info["disconnected"] = True
        await chunks.aclose()  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------- endpoints
_ERRORS = {
    400: ResponseSpec(ErrorResponse, description="Invalid request (the `param` names the field)."),
    401: ResponseSpec(ErrorResponse, description="Missing or wrong API key."),
    404: ResponseSpec(ErrorResponse, description="Unknown model."),
    429: ResponseSpec(ErrorResponse, description="Queue full; retry after `Retry-After` seconds."),
    500: ResponseSpec(ErrorResponse, description="Internal error."),
}


@post("/chat/completions", status_code=200, responses=_ERRORS, summary="Create a chat completion",
      description="OpenAI-compatible. With `stream: true` the response is `text/event-stream` of "
                  "`chat.completion.chunk` objects ending with `data: [DONE]`.")
async def chat_completions(request: Request, data: SkipValidation[s.ChatCompletionRequest]) -> s.ChatCompletion:
    """Chat completion: the messages through the model's chat template, then generation (JSON or SSE).

    Raises:
        APIError: 400 bad input (incl. ``context_length_exceeded``), 404 unknown model, 429 queue full.
    """
    data = s.parse_body(data, s.ChatCompletionRequest)
    state = _state(request)
    model = state.resolve_model(data.model)
    _check_common(data, 1)
    if data.tools:
        raise bad_request("tools are not supported by this server", "tools", "unsupported_parameter")
    if data.response_format and data.response_format.get("type", "text") != "text":
        raise bad_request("only response_format type 'text' is supported", "response_format",
                          "unsupported_parameter")
    if data.top_logprobs is not None and not data.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    logprobs = (data.top_logprobs or 0) if data.logprobs else None
    assert state.prompts is not None
    # Tokenized in the event loop, as the engine's own tokenize stage does: the HF tokenizer is shared
    # with the pipeline and a fast tokenizer must not be used from two threads at once.
    ids = state.prompts.chat(data.messages)
    max_new, _ = max_new_tokens(data, None)
    check_context(len(ids), max_new, state.engine.max_model_len, param="messages")
    job = new_job("chat", model, [ids], data.n or 1, state.engine.make_request,
                  sampling_kwargs(data, max_new, logprobs), logprobs=logprobs)
    job.include_usage = bool(data.stream and data.stream_options and data.stream_options.include_usage)
    return await _execute(request, state, job, bool(data.stream), "messages")  # type: ignore[return-value]


@post("/completions", status_code=200, responses=_ERRORS, summary="Create a completion",
      description="OpenAI-compatible (legacy completions). `prompt` may be a string, a list of strings, a list "
                  "of token ids or a list of token-id lists.")
async def completions(request: Request, data: SkipValidation[s.CompletionRequest]) -> s.Completion:
    """Legacy completion of one or several prompts (text or token ids), JSON or SSE.

    Raises:
        APIError: 400 bad input (incl. ``context_length_exceeded``), 404 unknown model, 429 queue full.
    """
    data = s.parse_body(data, s.CompletionRequest)
    state = _state(request)
    model = state.resolve_model(data.model)
    if data.suffix:
        raise bad_request("suffix is not supported by this server", "suffix", "unsupported_parameter")
    if data.best_of is not None and data.best_of != (data.n or 1):
        raise bad_request("best_of is not supported (it must equal n)", "best_of", "unsupported_parameter")
    if data.echo and data.logprobs is not None:
        raise bad_request("echo together with logprobs is not supported (no prompt logprobs)", "echo",
                          "unsupported_parameter")
    num_prompts = len(data.prompt) if isinstance(data.prompt, list) and data.prompt and not isinstance(
        data.prompt[0], int) else 1
    _check_common(data, num_prompts)
    assert state.prompts is not None
    prompt_ids = state.prompts.completion(data.prompt)
    max_new, _ = max_new_tokens(data, 16)
    for i, ids in enumerate(prompt_ids):
        check_context(len(ids), max_new, state.engine.max_model_len,
                      param="prompt" if len(prompt_ids) == 1 else f"prompt[{i}]")
    job = new_job("completion", model, prompt_ids, data.n or 1, state.engine.make_request,
                  sampling_kwargs(data, max_new, data.logprobs), logprobs=data.logprobs)
    job.include_usage = bool(data.stream and data.stream_options and data.stream_options.include_usage)
    if data.echo:
        if isinstance(data.prompt, str):
            job.echo_texts = [data.prompt]
        elif all(isinstance(p, str) for p in data.prompt):
            job.echo_texts = list(data.prompt)  # type: ignore[arg-type]
        else:
            job.echo_texts = [state.engine.tokenizer.decode(ids) for ids in prompt_ids]
    return await _execute(request, state, job, bool(data.stream), "prompt")  # type: ignore[return-value]


@get("/models", responses=_ERRORS, summary="List the served model")
async def list_models(request: Request) -> s.ModelList:
    """The one served model."""
    state = _state(request)
    return s.ModelList([_card(state)])


@get("/models/{model_id:path}", responses=_ERRORS, summary="Describe the served model")
async def get_model(request: Request, model_id: FromPath[str]) -> s.ModelCard:
    """The served model's card (404 ``model_not_found`` for any other id)."""
    state = _state(request)
    state.resolve_model(model_id.lstrip("/"))
    return _card(state)


def _card(state: ServerState) -> s.ModelCard:
    max_len = state.engine.max_model_len if state.engine.loaded else None
    return s.ModelCard(state.served_model_name, state.created, max_model_len=max_len)


@get("/healthz", summary="Liveness and readiness", responses={503: ResponseSpec(s.Health, description="Not ready")})
async def healthz(request: Request) -> Response[s.Health]:
    """200 ``{"status": "ok"}`` while the engine pipeline runs, 503 otherwise."""
    state = _state(request)
    if state.serving:
        return Response(s.Health("ok"), status_code=200)
    return Response(s.Health("unavailable"), status_code=503)


@get("/metrics", summary="Prometheus metrics", media_type=CONTENT_TYPE)
async def metrics(request: Request) -> Response[bytes]:
    """Prometheus text exposition of this server's registry."""
    state = _state(request)
    return Response(state.metrics.render(state.engine, state.in_flight), media_type=CONTENT_TYPE)


# ---------------------------------------------------------------------------- factory
def _openapi_config(with_auth: bool) -> OpenAPIConfig:
    if not with_auth:
        return OpenAPIConfig(title="llminfer OpenAI-compatible API", version=__version__)
    return OpenAPIConfig(title="llminfer OpenAI-compatible API", version=__version__,
                         components=Components(security_schemes={"bearer": SecurityScheme(type="http",
                                                                                          scheme="bearer")}),
                         security=[{"bearer": []}])


def create_app(engine_or_config: InferenceEngine | EngineConfig | None = None, *,
               served_model_name: str | None = None, api_key: str | None = None,
               max_queue_size: int | None = DEFAULT_MAX_QUEUE_SIZE, debug: bool = False) -> Litestar:
    """Build the OpenAI-compatible Litestar app around an engine.

    Args:
        engine_or_config: an :class:`InferenceEngine` (loaded or not, not started) or an :class:`EngineConfig`
            (``None``: the built-in tiny model). The app's lifespan loads it if needed and runs its pipeline.
        served_model_name: the model id clients see; default ``cfg.served_model_name``, else the model id.
        api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <api_key>`` (401 otherwise).
        max_queue_size: engine requests (one per choice) accepted beyond ``max_batch_size``; more get 429
            with ``Retry-After``. ``None``: unbounded.
        debug: Litestar debug mode.

    Raises:
        ConfigError: a bad configuration (when a config is given).
    """
    if isinstance(engine_or_config, InferenceEngine):
        engine = engine_or_config
    else:
        engine = InferenceEngine(engine_or_config or EngineConfig())
    model_id = engine.cfg.model_name or BUILTIN_MODEL_ID
    name = served_model_name or engine.cfg.served_model_name or model_id
    if max_queue_size is not None and max_queue_size < 0:
        raise ValueError("max_queue_size must be >= 0 or None")
    state = ServerState(engine=engine, served_model_name=name, accepted_model_names=frozenset({name, model_id}),
                        api_key=api_key or None, max_queue_size=max_queue_size, metrics=ServerMetrics(name))

    @contextlib.asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        async with engine.running():
            state.engine_started()
            async with anyio.create_task_group() as tg:
                state.task_group = tg
                state.ready = True
                log.info("serving", model=name, max_model_len=engine.max_model_len,
                         max_batch_size=engine.cfg.max_batch_size, max_queue_size=max_queue_size)
                try:
                    yield
                finally:
                    state.ready = False
                    state.task_group = None
                    tg.cancel_scope.cancel()

    v1 = Router("/v1", route_handlers=[chat_completions, completions, list_models, get_model],
                guards=[_api_key_guard])
    app = Litestar(
        route_handlers=[v1, healthz, metrics],
        lifespan=[lifespan],
        exception_handlers=EXCEPTION_HANDLERS,
        middleware=[request_log_middleware],
        before_send=[_echo_request_id],
        openapi_config=_openapi_config(api_key is not None),
        logging_config=None,
        debug=debug,
    )
    app.state[_STATE_KEY] = state
    app.state["llminfer_metrics"] = state.metrics
    return app

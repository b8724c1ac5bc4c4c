"""The Litestar application: :func:`create_app`, its lifespan, the router, the OpenAPI settings, the small
routes (models, health, metrics), and :class:`ServerState` (what the handlers share).

``create_app(EngineConfig())`` returns an ASGI app; its lifespan loads the engine (if needed) and runs the
engine pipeline in the server's own event loop (``async with engine.running():``). Run it with uvicorn
(``llminfer serve``) or any ASGI server. The endpoints live in :mod:`llminfer.api.chat` and
:mod:`llminfer.api.completions`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

import anyio
import structlog
from litestar import Litestar, Request, Response, Router, route
from litestar.openapi import OpenAPIConfig, ResponseSpec
from litestar.openapi.spec import Components, SecurityScheme
from litestar.params import FromPath

from llminfer import __version__
from llminfer.api import protocol as s
from llminfer.api.chat import chat_completions
from llminfer.api.completions import completions
from llminfer.api.errors import EXCEPTION_HANDLERS, OPENAPI_ERRORS
from llminfer.api.keepalive import DEFAULT_SSE_KEEPALIVE_S
from llminfer.api.metrics import CONTENT_TYPE, ServerMetrics
from llminfer.api.middleware import (
    STATE_KEY,
    api_key_guard,
    echo_request_id,
    request_log_middleware,
    server_state,
)
from llminfer.api.openapi import refine_openapi
from llminfer.api.responses import create_response
from llminfer.api.state import ServerState
from llminfer.api.tokenize import tokenizer_router
from llminfer.config import EngineConfig
from llminfer.engine import InferenceEngine

log = structlog.get_logger("llminfer.api")

BUILTIN_MODEL_ID = "llminfer/tiny-qwen2"
DEFAULT_MAX_QUEUE_SIZE = 1024
T = TypeVar("T")


# ---------------------------------------------------------------------------- small routes
GET_HEAD = ["GET", "HEAD"]  #: every GET route answers HEAD too (same status and headers, no body)


@route("/models", http_method=GET_HEAD, responses=OPENAPI_ERRORS, summary="List the served model")
async def list_models(request: Request) -> s.ModelList:
    """The one served model."""
    return s.ModelList([server_state(request).card()])


@route("/models/{model_id:path}", http_method=GET_HEAD, responses=OPENAPI_ERRORS, summary="Describe the served model")
async def get_model(request: Request, model_id: FromPath[str]) -> s.ModelCard:
    """The served model's card.

    Raises:
        APIError: 404 ``model_not_found`` for any other id.
    """
    state = server_state(request)
    # Litestar's path parameter keeps the "/" before the id and merges "//": "/v1/models/org/m" gives "/org/m",
    # and a local-folder id, "/v1/models//srv/m" (or "/v1/models/srv/m"), gives "/srv/m". Either may be meant.
    wanted = model_id[1:] if model_id.startswith("/") else model_id
    state.resolve_model(model_id if model_id in state.accepted_model_names else wanted)
    return state.card()


@route("/health", http_method=GET_HEAD, summary="Health (vLLM's route: empty body)",
       responses={503: ResponseSpec(None, description="Not ready")})
async def health(request: Request) -> Response[bytes]:
    """200 with an empty body while the engine pipeline runs, 503 otherwise (what vLLM's ``/health``
    answers, and what guidellm probes by default)."""
    return Response(b"", status_code=200 if server_state(request).serving else 503)


@route("/healthz", http_method=GET_HEAD, summary="Liveness and readiness", responses={503: ResponseSpec(s.Health, description="Not ready")})
async def healthz(request: Request) -> Response[s.Health]:
    """200 ``{"status": "ok"}`` while the engine pipeline runs, 503 otherwise."""
    if server_state(request).serving:
        return Response(s.Health("ok"), status_code=200)
    return Response(s.Health("unavailable"), status_code=503)


@route("/version", http_method=GET_HEAD, summary="Server version (vLLM's route)")
async def version() -> dict[str, str]:
    """``{"version": "<llminfer version>"}``, what vLLM's ``/version`` answers: ``llminfer bench-serve``
    records it in its artifact."""
    return {"version": __version__}


@route("/metrics", http_method=GET_HEAD, summary="Prometheus metrics", media_type=CONTENT_TYPE)
async def metrics(request: Request) -> Response[bytes]:
    """Prometheus text exposition of this server's registry."""
    state = server_state(request)
    return Response(state.metrics.render(state.engine, state.in_flight), media_type=CONTENT_TYPE)


# ---------------------------------------------------------------------------- factory
def _openapi_config(with_auth: bool) -> OpenAPIConfig:
    if not with_auth:
        return OpenAPIConfig(title="llminfer OpenAI-compatible API", version=__version__)
    return OpenAPIConfig(title="llminfer OpenAI-compatible API", version=__version__,
                         components=Components(security_schemes={"bearer": SecurityScheme(type="http",
                                                                                          scheme="bearer")}),
                         security=[{"bearer": []}])


def check_api_key(api_key: str | None) -> None:
    """Refuse an API key that cannot be what was meant.

    Raises:
        ValueError: an empty key (it would switch authentication off) or a blank one, or one with
            whitespace at either end (clients send ``Bearer <key>``, so it could never match).
    """
    if api_key is None:
        return
    if not api_key.strip():
        raise ValueError("the API key is empty or blank; give a real key, or none to serve without one")
    if api_key != api_key.strip():
        raise ValueError("the API key starts or ends with whitespace; no client could send it")


def create_app(engine_or_config: InferenceEngine | EngineConfig | None = None, *,
               served_model_name: str | None = None, api_key: str | None = None,
               max_queue_size: int | None = DEFAULT_MAX_QUEUE_SIZE, max_prompt_chars: int | None = None,
               debug: bool = False, reject_unknown_fields: bool = False,
               sse_keepalive_s: float | None = DEFAULT_SSE_KEEPALIVE_S) -> Litestar:
    """Build the OpenAI-compatible Litestar app around an engine.

    Args:
        engine_or_config: an :class:`InferenceEngine` (loaded or not, not started) or an :class:`EngineConfig`
            (``None``: the built-in tiny model). The app's lifespan loads it if needed and runs its pipeline.
        served_model_name: the model id clients see; default ``cfg.served_model_name``, else the model id.
        api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <api_key>`` (401 otherwise); an empty or
            blank key is refused (it would switch authentication off, or reject every request).
        max_queue_size: engine requests (one per choice) accepted beyond ``max_batch_size``; more get 429
            with ``Retry-After``. ``None``: unbounded.
        max_prompt_chars: prompt text longer than this (characters) is refused before tokenizing.
            Default: the context length x the longest vocabulary entry (no prompt that fits is refused).
        debug: Litestar debug mode.
        reject_unknown_fields: answer a request body with a top-level field the endpoint does not define
            with a 400 naming it. Default: accept it, ignore the field and log a warning naming it (vLLM's
            behaviour, so clients that send newer fields keep working).

        sse_keepalive_s: a stream quiet for this many seconds (waiting in the queue, a long prefill) gets an
            SSE comment (``: keep-alive``), so idle-timeout proxies keep it; its headers go out by then at the
            latest. ``None``: no keep-alives.

    Raises:
        ConfigError: a bad configuration (when a config is given).
        ValueError: a negative ``max_queue_size`` or ``max_prompt_chars``, an empty or blank ``api_key``, or an
            ``sse_keepalive_s`` that is not > 0.
    """
    if isinstance(engine_or_config, InferenceEngine):
        engine = engine_or_config
    else:
        engine = InferenceEngine(engine_or_config or EngineConfig())
    model_id = engine.cfg.model_name or BUILTIN_MODEL_ID
    name = served_model_name or engine.cfg.served_model_name or model_id
    if max_queue_size is not None and max_queue_size < 0:
        raise ValueError("max_queue_size must be >= 0 or None")
    if max_prompt_chars is not None and max_prompt_chars < 1:
        raise ValueError("max_prompt_chars must be >= 1 or None")
    check_api_key(api_key)
    if sse_keepalive_s is not None and not sse_keepalive_s > 0:
        raise ValueError("sse_keepalive_s must be > 0 or None")
    state = ServerState(engine=engine, served_model_name=name, accepted_model_names=frozenset({name, model_id}),
                        api_key=api_key, max_queue_size=max_queue_size, metrics=ServerMetrics(name, engine),
                        max_prompt_chars=max_prompt_chars, reject_unknown_fields=reject_unknown_fields,
                        sse_keepalive_s=sse_keepalive_s)

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

    v1 = Router("/v1", route_handlers=[chat_completions, completions, create_response, list_models, get_model],
                guards=[api_key_guard])
    app = Litestar(
        route_handlers=[v1, tokenizer_router([api_key_guard]), health, healthz, version, metrics],
        lifespan=[lifespan],
        exception_handlers=EXCEPTION_HANDLERS,
        middleware=[request_log_middleware],
        before_send=[echo_request_id],
        openapi_config=_openapi_config(api_key is not None),
        logging_config=None,
        debug=debug,
    )
    app.state[STATE_KEY] = state
    app.state["llminfer_metrics"] = state.metrics
    refine_openapi(app)
    return app

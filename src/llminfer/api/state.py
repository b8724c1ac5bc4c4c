"""What the HTTP handlers share: :class:`ServerState` (the engine, settings, metrics, live counters) and
the :class:`Ticket` that reserves room for a call's engine requests."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import anyio
import attrs
import structlog
from anyio.abc import TaskGroup

from llminfer.api import protocol as s
from llminfer.api.errors import SERVER_ERROR, APIError
from llminfer.api.keepalive import DEFAULT_SSE_KEEPALIVE_S
from llminfer.api.logprobs import TokenText
from llminfer.api.metrics import ServerMetrics
from llminfer.api.translate import PromptBuilder
from llminfer.engine import InferenceEngine

log = structlog.get_logger("llminfer.api")

T = TypeVar("T")


class Ticket:
    """A slot reservation for ``count`` engine requests; :meth:`release` (idempotent) gives it back."""

    def __init__(self, release: Callable[[int], None], count: int) -> None:
        self._release = release
        self.count = count
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._release(self.count)



@attrs.define
class ServerState:
    """Everything the handlers share: the engine, settings, metrics, and the live counters.

    Attributes:
        served_model_name: the model id clients see (``/v1/models``, ``model`` in responses).
        accepted_model_names: ``model`` values requests may use (the served name and the model id).
        max_queue_size: engine requests allowed beyond the running batch (``max_batch_size``); more get 429.
        in_flight: engine requests submitted and not yet finished (one per choice).
        max_prompt_chars: longest prompt text (characters, all messages together) tokenized; longer is a 400.
        draining: the server is shutting down (new calls get 503, ``/healthz`` 503).
        stoppers: one callback per running call, ending it (see :meth:`end_streams`).
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
    max_prompt_chars: int | None = None
    prompt_chars_from_context: bool = False  #: max_prompt_chars was derived from the context length, not set
    draining: bool = False
    stoppers: set[Callable[[], None]] = attrs.field(factory=set)
    tokenize_limiter: anyio.CapacityLimiter | None = None
    tokenizer_routes_limiter: anyio.CapacityLimiter | None = None
    reject_unknown_fields: bool = False  #: unknown top-level request fields: 400 instead of a warning
    sse_keepalive_s: float | None = DEFAULT_SSE_KEEPALIVE_S  #: quiet seconds before an SSE keep-alive comment

    def engine_started(self) -> None:
        """Set up what needs the loaded tokenizer (called from the lifespan)."""
        engine = self.engine
        self.prompts = PromptBuilder(engine.tokenizer, inputs=engine.inputs)
        self.token_text = TokenText(engine.tokenizer)
        self.tokenize_limiter = anyio.CapacityLimiter(1)
        self.tokenizer_routes_limiter = anyio.CapacityLimiter(1)
        if self.max_prompt_chars is None:
            longest = _longest_token_chars(engine.tokenizer)
            if longest:
                self.max_prompt_chars = engine.max_model_len * longest
                self.prompt_chars_from_context = True
        compiler = getattr(getattr(engine, "runtime", None), "grammar_compiler", None)
        if compiler is not None:
            compiler.prepare()  # in the background: the first constrained request need not build it

    @property
    def serving(self) -> bool:
        """The lifespan has started and the engine pipeline is running."""
        return self.ready and not self.draining and bool(getattr(self.engine, "is_running", False))

    async def tokenize(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` (chat template rendering, tokenizing) in a worker thread, one call at a time, so a
        long prompt does not stall every stream. Sharing the tokenizer with the engine's loop is safe: its
        encode and decode only read it (truncation and padding settings, the calls that change it, are
        never touched on this path)."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.tokenize_limiter)

    async def tokenize_only(self, fn: Callable[..., T], *args: Any) -> T:
        """:meth:`tokenize` for ``/tokenize`` and ``/detokenize``, in a queue of their own: a flood of them
        waits behind itself, not in front of the generation requests' prompts."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.tokenizer_routes_limiter)

    def check_prompt_chars(self, texts: Iterable[tuple[str, str | None]]) -> None:
        """Refuse, before tokenizing, text that cannot fit in the context whatever it tokenizes to:
        ``texts`` are ``(param, text)`` pairs counted together; the error names the field where the
        running total passed ``max_prompt_chars`` (default: the context length in tokens x the longest
        token of the vocabulary in characters, so no prompt that fits is refused).

        Raises:
            APIError: 400 ``context_length_exceeded``.
        """
        limit = self.max_prompt_chars
        if limit is None:
            return
        total = 0
        for param, text in texts:
            total += len(text or "")
            if total > limit:
                why = ("more than the model's context can hold" if self.prompt_chars_from_context
                       else "this server's limit (max_prompt_chars)")
                raise APIError(400, f"the prompt is longer than {limit} characters, {why}; shorten it", param=param,
                               code="context_length_exceeded")

    def begin_shutdown(self, grace_s: float) -> None:
        """Stop admitting (503) and report unready; called once by the server when SIGTERM/SIGINT arrives."""
        if not self.draining:
            self.draining = True
            log.info("shutting down", in_flight=self.in_flight, grace_s=grace_s)

    def end_streams(self) -> None:
        """End every call still running (the grace period is over): streams get an error event and
        ``[DONE]``, calls not yet answered a 503."""
        if self.stoppers:
            log.warning("grace period over: ending requests", requests=len(self.stoppers))
        for stop in list(self.stoppers):
            stop()

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
            APIError: 429 with ``Retry-After`` when the running batch and the queue are full; 503 while
                the server shuts down.
        """
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another replica or later",
                           type=SERVER_ERROR, code="server_shutting_down", headers={"Retry-After": "1"})
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

    def card(self) -> s.ModelCard:
        """The served model's card."""
        max_len = self.engine.max_model_len if self.engine.loaded else None
        return s.ModelCard(self.served_model_name, self.created, max_model_len=max_len)


def _longest_token_chars(tokenizer: Any) -> int | None:
    """The longest vocabulary entry in characters: no token covers more characters of a text (byte-level
    entries have one character per byte). ``None`` when the tokenizer has no vocabulary to read."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - then the prompt is only bounded by the body size
        return None
    return max(map(len, vocab), default=0) or None

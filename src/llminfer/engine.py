"""InferenceEngine: the facade. It keeps the lifecycle and the request API, and nothing else.

Loading lives in :mod:`llminfer.runtime`, KV sizing in :mod:`llminfer.kv.sizing`, construction of the
backend, the core and the stages in :mod:`llminfer.assembly`, the adapter lifecycle in
:mod:`llminfer.adapters`, and the submit → fold → cancel-on-early-exit of one request in
:class:`llminfer.frontend.output.RequestHandle`. The loop itself is :mod:`llminfer.core.engine_core`.

Synchronous methods (``run``, ``run_batch``, ``run_batch_continuous``, ``stream``) drive the pipeline in a
background event loop (an anyio blocking portal). The async API (``generate``) runs inside the caller's
loop once it is entered with ``async with engine.running():`` (the HTTP server does this in its lifespan).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import threading
import weakref
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import attrs

from llminfer import assembly
from llminfer.chat import ChatResult, chat_turn
from llminfer.config import Backend, EngineConfig
from llminfer.core.model_thread import ModelThreadLease, model_thread_enabled, shared_model_thread
from llminfer.core.threads import ThreadGovernor
from llminfer.errors import EngineClosedError, EngineError, InvalidRequestError
from llminfer.frontend.input import InputProcessor, build_request
from llminfer.frontend.output import RequestHandle, collect_all
from llminfer.pipeline import Pipeline
from llminfer.protocols import EngineCore, Stage
from llminfer.protocols.messages import Control, GenerationRequest
from llminfer.results import GenerationResult, StreamChunk
from llminfer.runtime import Runtime, describe_runtime, load_runtime, resolve_quant
from llminfer.stats import StatLogger
from llminfer.trace import Tracer

# Engines whose background event loop is running. At interpreter exit the loop's daemon thread stops
# before garbage collection would close the portal, which then waits for it forever: a script that
# forgets close() (or dies of an exception) would hang instead of exiting. Closing them at exit avoids it.
_STARTED_ENGINES: weakref.WeakSet[InferenceEngine] = weakref.WeakSet()
_CLOSED = "the engine was closed (close() has run); it takes no more requests: make a new InferenceEngine"


@atexit.register
def _close_started_engines() -> None:
    for engine in list(_STARTED_ENGINES):
        with contextlib.suppress(Exception):
            engine.close()


_RUNTIME_NAMES = frozenset([*attrs.fields_dict(Runtime), "vocab_size", "lm_head_prepacked"])


class InferenceEngine:
    """Load a model once, then serve requests through the stage pipeline.

    Example::

        with InferenceEngine(EngineConfig()).load() as engine:
            print(engine.run("Hello", max_new_tokens=16).generated_text)

    After :meth:`load`, the loaded pieces are attributes: ``tokenizer``, ``model``, ``model_config``,
    ``model_path``, ``device``, ``dtype``, ``max_model_len``, ``eos_token_ids``, ``kv_cache``,
    ``kv_manager``, ``draft_model``, ``load_time_s`` (see :class:`~llminfer.runtime.Runtime`), plus
    ``backend`` and ``core`` (the running :class:`~llminfer.protocols.EngineCore`). ``stat_loggers``: append a
    :class:`~llminfer.stats.StatLogger` to get every engine step's statistics (the server's ``/metrics`` does).

    Raises:
        ConfigError: inconsistent configuration; ModelLoadError: the model or tokenizer cannot be loaded;
        BackendUnavailableError: the backend cannot run here.
    """

    def __init__(self, cfg: EngineConfig | None = None) -> None:
        self.cfg = (cfg or EngineConfig()).validate()
        self.tracer = Tracer(enabled=self.cfg.enable_tracing)
        self.stat_loggers: list[StatLogger] = []  # fed by the core every step (see llminfer.stats)
        self.runtime: Runtime | None = None
        self.backend: Any = None
        self.core: EngineCore | None = None
        self.adapter_manager: Any = None
        self._pipeline: Pipeline | None = None
        self._portal_cm = self._portal = self._pipeline_cm = None  # the background loop (sync API)
        self._loop_token: Any = None  # the caller's event loop, inside ``running()``
        self._closed = False
        # Loading and every step run on one thread, shared by every engine of the process, so torch's
        # OpenMP keeps one thread team (see llminfer.core.model_thread); None with LLMINFER_MODEL_THREAD=0,
        # and for vLLM, whose engine is created where the caller is (it may install signal handlers, which
        # only the main thread can).
        use_thread = model_thread_enabled() and self.cfg.backend is not Backend.VLLM
        # torch's thread count for the steps (llminfer.core.threads); vLLM sets its own threads
        self.threads = ThreadGovernor(self.cfg.num_threads) if self.cfg.backend is not Backend.VLLM else None
        self.model_thread: ModelThreadLease | None = shared_model_thread(self.threads) if use_thread else None
        # start() and close() from many threads at once: one portal per engine, never two half-started
        # ones, and none started after close().
        self._lifecycle = threading.RLock()
        # Admission against adapter changes: a request's adapter stamp is checked and it is counted in
        # flight under this lock, and an adapter change checks that nothing is in flight and makes the
        # change under it too, so no request admitted for one adapter runs under another.
        self._admission = threading.Lock()
        self._admitted = 0  # requests admitted and not finished (run_requests, stream, generate_request)

    def __getattr__(self, name: str) -> Any:
        # The loaded pieces (tokenizer, model, max_model_len, ...) are the runtime's.
        runtime = self.__dict__.get("runtime")
        if runtime is not None and name in _RUNTIME_NAMES:
            return getattr(runtime, name)
        raise AttributeError(f"InferenceEngine has no attribute {name!r}{'' if runtime else ' (call load() first)'}")

    loaded = property(lambda self: self.runtime is not None, doc="True once :meth:`load` has run.")

    def load(self) -> InferenceEngine:
        """Load tokenizer and model, size and allocate the KV pool once, build the backend. Returns self.

        Raises:
            EngineClosedError: the engine was closed (a closed engine loads nothing more).
        """
        if self._closed and self.runtime is None:
            raise EngineClosedError(_CLOSED)
        if self.runtime is None:
            self._on_model_thread(self._load_now)
        return self

    def _load_now(self) -> None:
        if self.runtime is None:  # a second load() queued behind the first finds it done
            self.cfg = resolve_quant(self.cfg)  # from-gguf: the weight-only mode of the file's type
            runtime = load_runtime(self.cfg)
            self.backend = assembly.build_backend(runtime, self.cfg)
            self.core = assembly.build_core(runtime, self.cfg, self.backend, self.tracer, self.stat_loggers,
                                            self.model_thread)
            self.runtime = runtime

    def _on_model_thread(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the model thread (in this thread with ``LLMINFER_MODEL_THREAD=0``)."""
        if self.model_thread is not None:
            return self.model_thread.call(fn, *args)
        return self.threads.wrap(fn)(*args) if self.threads is not None else fn(*args)

    # ------------------------------------------------------------------ assembly and lifecycle
    def default_stages(self) -> dict[str, Stage]:
        """Fresh built-in stages around a fresh core, by name in order (:func:`assembly.default_stages`)."""
        if self.runtime is None or self.is_running:
            raise EngineError("call load() first" if self.runtime is None else "the engine's own pipeline runs "
                              "on this KV cache: close() the engine before building another pipeline")
        core = assembly.build_core(self.runtime, self.cfg, self.backend, self.tracer,
                                    self.stat_loggers, self.model_thread)
        return assembly.default_stages(self.runtime, core, self.tracer)

    def build_pipeline(self, after_detokenize: Sequence[Stage] = (), sink: Stage | None = None) -> Pipeline:
        """The default pipeline, with user stages between detokenize and the sink and, optionally, a
        different sink. The engine's own methods use the pipeline it starts itself."""
        stages = self.default_stages()
        last = stages.pop("sink")
        return Pipeline([*stages.values(), *after_detokenize, sink or last])

    def _own_pipeline(self) -> Pipeline:
        stages = self.default_stages()
        self.core = stages["core"]  # the core that engine.cache_stats() and friends read
        return Pipeline(list(stages.values()))

    def start(self) -> InferenceEngine:
        """Start the pipeline in a background event loop (done on first use by the sync methods); safe to
        call from several threads at once (one of them starts it, the others wait for it).

        Raises:
            EngineClosedError: :meth:`close` has run; an engine is not restarted (make a new one).
        """
        self._portal_or_start()
        return self

    def _portal_or_start(self) -> Any:
        """The running background loop's portal, started if need be (under the lifecycle lock, so a
        thread never sees a half-started engine and never starts one that another thread closes)."""
        portal = self._portal
        if portal is not None:
            return portal
        with self._lifecycle:
            if self._closed:
                raise EngineClosedError(_CLOSED)
            self.load()
            if self._portal is None:
                if self._pipeline is not None:
                    raise EngineError("the engine is running in another event loop (inside running())")
                pipeline = self._own_pipeline()
                portal_cm = anyio.from_thread.start_blocking_portal()
                portal = portal_cm.__enter__()
                try:
                    pipeline_cm = portal.wrap_async_context_manager(pipeline)
                    pipeline_cm.__enter__()
                except BaseException:
                    portal_cm.__exit__(None, None, None)
                    raise
                self._pipeline, self._portal_cm, self._pipeline_cm = pipeline, portal_cm, pipeline_cm
                self._portal = portal  # last: other threads read it without the lock, so only once it runs
                _STARTED_ENGINES.add(self)
            return self._portal

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[InferenceEngine]:
        """Run the pipeline inside the current event loop (for servers): ``async with engine.running():``.

        Raises:
            EngineError: it already runs; EngineClosedError: :meth:`close` has run.
        """
        if self._closed:
            raise EngineClosedError(_CLOSED)
        if self.runtime is None:
            if self.model_thread is not None:
                await self.model_thread.run(self.load)
            else:
                await anyio.to_thread.run_sync(self.load)
        with self._lifecycle:  # never blocks for long: start() holds it only while a portal starts
            if self._closed:
                raise EngineClosedError(_CLOSED)
            if self._portal is not None or self._pipeline is not None:
                raise EngineError("the engine is already running")
            self._pipeline = self._own_pipeline()
        self._loop_token = anyio.lowlevel.current_token()
        try:
            async with self._pipeline:
                yield self
        finally:
            self._pipeline = self._loop_token = None
            if self._closed and self.model_thread is not None:
                # close() from another thread let this pipeline's requests finish; their steps took a
                # share of the model thread again after close() gave it back
                self.model_thread.close()

    def close(self) -> None:
        """Stop the pipeline (in-flight requests finish first, up to 30 s) and refuse everything after:
        later calls that need the pipeline (``run``, ``stream``, ``start``, ``running``, ...) raise
        :class:`~llminfer.errors.EngineClosedError`, and so does a stream still being read. The loaded
        model stays usable for :meth:`build_pipeline` (except vLLM's, which is shut down). Idempotent and
        safe from any thread; a close that another thread has under way is waited for."""
        self._closed = True  # first, without the lock: submitting threads stop at once
        with self._lifecycle:
            self._stop_background()
            if self.model_thread is not None:
                self.model_thread.close()  # gives its share back; the last one ends the thread and its team
            compiler = getattr(self.runtime, "grammar_compiler", None)
            if compiler is not None:
                compiler.stop_workers()  # the compile server process; a rebuilt pipeline starts another
            close_backend = getattr(self.backend, "close", None)
            if close_backend is not None:  # vLLM's engine: its worker processes exit now, not at teardown
                close_backend()

    def warmup(self) -> int:
        """Compile the compiled backend's graph for every step shape now, on the model thread (where the
        steps run), instead of at the first request of each shape. Call it before serving, while no step
        runs. Other backends do nothing.

        Returns:
            Graphs compiled by this call (0 for other backends).

        Raises:
            Exception: compilation failed and ``compile_fallback_to_eager`` is off.
        """
        self.load()
        warm = getattr(self.backend, "warmup", None)
        return int(self._on_model_thread(warm)) if warm is not None else 0

    def stop(self) -> None:
        """Stop the background event loop that the sync methods started (in-flight requests finish first,
        up to 30 s) without closing the engine: the next sync call starts it again, and the engine can be
        handed to another event loop, ``async with engine.running():`` or ``create_app(engine)`` (a server).
        Does nothing when no background loop runs; safe from any thread."""
        with self._lifecycle:
            self._stop_background()

    def _stop_background(self) -> None:
        """Stop the background loop's pipeline and portal (the caller holds the lifecycle lock)."""
        _STARTED_ENGINES.discard(self)
        if self._pipeline_cm is not None:
            cm, self._pipeline_cm = self._pipeline_cm, None
            with contextlib.suppress(Exception):  # the pipeline logs its own failures
                cm.__exit__(None, None, None)
        if self._portal_cm is not None:
            pcm, self._portal_cm, self._portal = self._portal_cm, None, None
            pcm.__exit__(None, None, None)
            self._pipeline = None

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has been called."""
        return self._closed

    def __enter__(self) -> InferenceEngine:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def is_running(self) -> bool:
        """True while the pipeline runs (in the background loop or the caller's) and accepts requests."""
        return self._pipeline is not None and self._pipeline.running

    def is_idle(self) -> bool:
        """True when no request is in flight: none admitted and unfinished, no open handle, none in the core."""
        if self._admitted:
            return False
        if self._pipeline is None or self.core is None:
            return True
        return not getattr(self._pipeline.sink, "streams", None) and not any(self.core.scheduler_stats().values())

    @contextlib.contextmanager
    def _admitted_requests(self, requests: Sequence[GenerationRequest]) -> Iterator[None]:
        """Check the requests' adapter stamps and count them in flight until the block ends (sync callers)."""
        with self._admission:
            for request in requests:
                self._check_adapter(request)
            self._admitted += len(requests)
        try:
            yield
        finally:
            self._release_admitted(len(requests))

    async def _admit_async(self, request: GenerationRequest) -> None:
        """:meth:`_admitted_requests`'s entry for one request on an event loop: the lock is taken in a worker
        thread when an adapter change holds it (a load can take seconds), so the loop never blocks on it."""
        if not self._admission.acquire(blocking=False):
            acquired: list[bool] = []
            try:
                await anyio.to_thread.run_sync(lambda: acquired.append(self._admission.acquire()))
            except BaseException:
                if acquired:  # the worker got the lock, then the caller was cancelled
                    self._admission.release()
                raise
        try:
            self._check_adapter(request)
            self._admitted += 1
        finally:
            self._admission.release()

    def _release_admitted(self, count: int) -> None:
        with self._admission:
            self._admitted -= count

    def _require_portal(self) -> Any:
        return self._portal_or_start()

    def _running_pipeline(self) -> Pipeline:
        pipeline = self._pipeline
        if pipeline is None or self._closed:
            raise EngineClosedError(_CLOSED) if self._closed else EngineError("the engine is not running")
        return pipeline

    def _call(self, portal: Any, fn: Any, *args: Any) -> Any:
        """``portal.call(fn, *args)``; a portal that close() stopped meanwhile is an EngineClosedError.

        The wait polls (every 0.1 s) instead of blocking: a Ctrl-C that the kernel hands to another thread
        of the process does not wake a blocked wait, so Python would run its KeyboardInterrupt only when
        ``fn`` ended (for ``run``, at the end of the whole generation)."""
        try:
            future = portal.start_task_soon(fn, *args)
            while True:
                try:
                    return future.result(timeout=0.1)
                except concurrent.futures.TimeoutError:
                    continue
        except RuntimeError as exc:
            if self._closed or self._portal is not portal:
                raise EngineClosedError(_CLOSED) from exc
            raise

    # ------------------------------------------------------------------ requests
    @property
    def inputs(self) -> InputProcessor:
        """The validator every prompt goes through (the tokenize stage and the HTTP layer share it)."""
        return InputProcessor(self.tokenizer, self.max_model_len, self.vocab_size,
                              self.runtime.grammar_compiler if self.runtime is not None else None)

    def make_request(self, prompt: str | Sequence[int], *, adapter_name: str | None = None,
                     **kwargs: Any) -> GenerationRequest:
        """Validate arguments and build a :class:`GenerationRequest` (see
        :func:`llminfer.frontend.input.build_request` for the arguments: ``max_new_tokens``,
        ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop_sequences``, ``ignore_eos``, ``priority``,
        ``cache_salt`` and every other :class:`~llminfer.sampling.params.SamplingParams` field).

        The request is stamped with the active LoRA adapter (it partitions the prefix cache); passing
        ``adapter_name`` only checks that it is the active one (switch with :meth:`set_adapter`).

        Raises:
            InvalidRequestError: with ``param`` naming the field at fault.
        """
        if adapter_name is not None and adapter_name != self.active_adapter:
            raise InvalidRequestError(f"adapter {adapter_name!r} is not the active adapter "
                                      f"({self.active_adapter!r}); call set_adapter() first", param="adapter_name")
        return build_request(prompt, adapter_name=self.active_adapter, **kwargs)

    def make_requests(self, prompt: str | Sequence[int], *, n: int = 1, seed: int | None = None,
                      **kwargs: Any) -> list[GenerationRequest]:
        """``n`` samples of one prompt as ``n`` requests (seeds ``seed``, ``seed + 1``, ... when seeded),
        which share the prompt's KV blocks when submitted together. Raises InvalidRequestError."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidRequestError(f"n must be an integer >= 1, got {n!r}", param="n")
        return [self.make_request(prompt, seed=None if seed is None else seed + i, **kwargs) for i in range(n)]

    def run(self, prompt: str | Sequence[int], **kwargs: Any) -> GenerationResult:
        """Generate for one prompt and wait for the result (keyword arguments: :meth:`make_request`).

        Raises:
            InvalidRequestError: bad input; CapacityError: it can never fit in the KV cache;
            EngineError: the backend failed; EngineClosedError: :meth:`close` has run.
        """
        return self.run_requests([self.make_request(prompt, **kwargs)])[0]

    def run_n(self, prompt: str | Sequence[int], n: int, **kwargs: Any) -> list[GenerationResult]:
        """``n`` samples of one prompt (see :meth:`make_requests`); results in sample order."""
        return self.run_requests(self.make_requests(prompt, n=n, **kwargs))

    def run_batch_continuous(self, prompts: Sequence[str | Sequence[int]], **kwargs: Any) -> list[GenerationResult]:
        """Submit every prompt at once to the continuous-batching scheduler; results in prompt order.
        Raises the first error any request raised (the others still finish)."""
        return self.run_requests([self.make_request(p, **kwargs) for p in prompts])

    def run_batch(self, prompts: Sequence[str | Sequence[int]], **kwargs: Any) -> list[GenerationResult]:
        """Static batching: groups of ``max_batch_size`` prompts, each group finishing before the next
        starts (the classic ``generate()`` batch, to compare with :meth:`run_batch_continuous`)."""
        size = self.cfg.max_batch_size
        return [r for start in range(0, len(prompts), size)
                for r in self.run_batch_continuous(prompts[start : start + size], **kwargs)]

    def run_requests(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Submit prepared requests (each with its own settings) at once; results in order.

        Raises:
            The first error any request raised (the others still finish or are cancelled).
        """
        with self._admitted_requests(requests):
            portal = self._require_portal()
            pipeline = self._running_pipeline()
            try:
                results = self._call(portal, collect_all, pipeline, list(requests))
            except (KeyboardInterrupt, SystemExit):
                self._abort_interrupted(portal, pipeline, requests)
                raise
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    def stream(self, prompt: str | Sequence[int], **kwargs: Any) -> Iterator[StreamChunk]:
        """Yield :class:`StreamChunk` as tokens arrive. All text is on the non-final chunks (their joined
        ``token`` equals ``run()``'s ``generated_text``); the last chunk has ``is_final=True``, empty text,
        ``finish_reason`` and ``stats``. Closing the iterator early cancels the request and frees its KV
        blocks.

        Raises:
            as :meth:`run`; EngineClosedError: the engine was closed (before or while reading)."""
        request = self.make_request(prompt, **kwargs)
        with self._admitted_requests([request]):
            portal = self._require_portal()
            pipeline = self._running_pipeline()
            chunks = RequestHandle(pipeline, request).chunks()
            try:
                while True:
                    try:
                        yield self._call(portal, chunks.__anext__)
                    except StopAsyncIteration:
                        return
            except (KeyboardInterrupt, SystemExit):
                self._abort_interrupted(portal, pipeline, [request])
                raise
            finally:
                # Cancels the request when the caller stops early; nothing to do once the loop has stopped.
                with contextlib.suppress(EngineClosedError, RuntimeError):
                    self._call(portal, chunks.aclose)

    def _abort_interrupted(self, portal: Any, pipeline: Pipeline, requests: Sequence[GenerationRequest]) -> None:
        """Cancel ``requests`` after Ctrl-C (or SystemExit) reached this thread while it waited on the event
        loop: the coroutine it waited for still runs there, so without an abort the requests would generate
        to their end (and close() would wait for them). Each stops within the step under way."""
        for request in requests:
            with contextlib.suppress(Exception):
                portal.call(pipeline.abort, request.request_id, "interrupted")

    def chat(self, messages: Sequence[dict[str, Any]], *, tools: Sequence[Any] | None = None,
             tool_choice: str | dict[str, Any] | None = "auto", parallel_tool_calls: bool = True,
             chat_template: str | None = None, **kwargs: Any) -> ChatResult:
        """One chat turn with tools: :func:`llminfer.chat.chat_turn` on this engine (same arguments)."""
        return chat_turn(self, messages, tools=tools, tool_choice=tool_choice,
                         parallel_tool_calls=parallel_tool_calls, chat_template=chat_template, **kwargs)

    async def generate(self, prompt: str | Sequence[int], **kwargs: Any) -> AsyncIterator[StreamChunk]:
        """Async iterator of :class:`StreamChunk` inside ``async with engine.running():`` (else EngineError);
        the chunks are those of :meth:`stream` (text on non-final chunks, an empty final one with the stats)."""
        if self._closed:
            raise EngineClosedError(_CLOSED)
        if self._pipeline is None or self._portal is not None:
            raise EngineError("use `async with engine.running():` before generate()")
        async for chunk in self.generate_request(self.make_request(prompt, **kwargs)):
            yield chunk

    async def generate_request(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        """Like :meth:`generate` for a prepared :class:`GenerationRequest` (the HTTP layer uses it)."""
        await self._admit_async(request)
        try:
            async with contextlib.aclosing(RequestHandle(self._running_pipeline(), request).chunks()) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self._release_admitted(1)

    # ------------------------------------------------------------------ engine-wide control
    async def _control(self, action: str) -> None:
        done = anyio.Event()
        if self._running_pipeline().send_nowait(Control(action, done)):
            await done.wait()

    async def drained(self) -> None:
        """Return once every request submitted before this call has finished or been cancelled and its
        KV blocks are free (an ordered marker through the core's inbox; inside the engine's loop)."""
        await self._control("drain")

    def wait_drained(self) -> None:
        """:meth:`drained` from synchronous code in another thread than the engine's loop (the background
        loop, or the server's loop inside ``running()``); returns at once when nothing runs.

        Raises:
            EngineError: called on the engine's own event loop (use ``await engine.drained()`` there).
        """
        if self._loop_token is not None:
            with contextlib.suppress(RuntimeError):  # raised when no event loop runs in this thread
                if anyio.lowlevel.current_token() == self._loop_token:
                    raise EngineError("wait_drained() would block the engine's own loop: await engine.drained()")
            anyio.from_thread.run(self.drained, token=self._loop_token)
        elif (portal := self._portal) is not None and not self._closed:
            with contextlib.suppress(EngineClosedError):  # closed meanwhile: nothing runs any more
                self._call(portal, self.drained)

    def reset_prefix_cache(self) -> None:
        """Forget every cached free KV block (a cold cache), ordered after the requests already submitted.
        From the engine's own event loop the reset is queued; from any other thread it has happened when
        this returns."""
        if self._portal is None and self._pipeline is not None:
            self._pipeline.send_nowait(Control("reset_prefix_cache"))
        else:
            self._call(self._require_portal(), self._control, "reset_prefix_cache")

    # ------------------------------------------------------------------ LoRA adapters
    @property
    def active_adapter(self) -> str | None:
        return self.adapter_manager.active if self.adapter_manager is not None else None

    def list_adapters(self) -> dict[str, str]:
        """Loaded LoRA adapters: name → the path or hub id they came from."""
        return dict(self.adapter_manager.adapters) if self.adapter_manager is not None else {}

    def _check_adapter(self, request: GenerationRequest) -> None:
        if request.adapter_name != self.active_adapter:
            raise InvalidRequestError(
                f"the request was made for adapter {request.adapter_name!r} but the active adapter is "
                f"{self.active_adapter!r}; make it again (make_request stamps the active adapter)",
                param="adapter_name")

    def _adapters_for(self, what: str) -> Any:
        from llminfer.adapters import AdapterManager

        self.adapter_manager = AdapterManager.checked(self, what)
        return self.adapter_manager

    def load_adapter(self, path_or_id: str, adapter_name: str | None = None, *, activate: bool = True) -> str:
        """Load a PEFT LoRA adapter (see :meth:`llminfer.adapters.AdapterManager.load`). Returns its name.

        Raises:
            BackendUnavailableError: PEFT is not installed, or a backend without a transformers model.
            ConfigError: a bad or already used name. ModelLoadError: it cannot be loaded.
            EngineError: requests are in flight.
        """
        with self._admission:  # no request is admitted until the adapter is in (see _admitted_requests)
            manager = self._adapters_for("load an adapter")
            return self._on_model_thread(lambda: manager.load(path_or_id, adapter_name, activate=activate))

    def set_adapter(self, adapter_name: str | None) -> None:
        """Make ``adapter_name`` the active adapter (None: the base model) for every later request;
        refused while requests are in flight (call it when :meth:`is_idle` is True).

        Raises:
            ConfigError: no adapter of that name. EngineError: requests are in flight.
        """
        with self._admission:
            manager = self._adapters_for("switch adapters")
            self._on_model_thread(manager.set, adapter_name)

    def unload_adapter(self, adapter_name: str) -> None:
        """Remove an adapter's weights and reset the prefix cache (a later adapter of the same name must
        never hit KV computed under this one); if it was active, the base model becomes active.

        Raises:
            ConfigError: no adapter of that name. EngineError: requests are in flight.
        """
        with self._admission:
            manager = self._adapters_for("unload an adapter")
            self._on_model_thread(manager.unload, adapter_name)
            self.reset_prefix_cache()  # before any later request is admitted

    # ------------------------------------------------------------------ introspection
    def cache_stats(self) -> dict[str, float | int]:
        """Prefix-cache and KV pool statistics: ``hit_rate``, ``queries``, ``hits``, ``cached_tokens``,
        ``blocks_total/used/free/cached``, ``evictions``, ``block_size`` (vLLM: what vLLM reports)."""
        if self.core is None:
            raise EngineError("call load() first")
        return self.core.cache_stats()

    def scheduler_stats(self) -> dict[str, int]:
        """``running`` and ``waiting`` request counts in the engine core (0 before it loads)."""
        return self.core.scheduler_stats() if self.core else {"running": 0, "waiting": 0}

    def info(self) -> dict[str, Any]:
        """Environment, model, weight bytes and KV capacity (what ``llminfer info`` prints; see
        :func:`llminfer.runtime.describe_runtime`), merged with the core's and backend's own facts."""
        self.load()
        facts = {**describe_runtime(self.runtime, self.cfg), **self.core.describe()}  # type: ignore[union-attr, arg-type]
        if self.threads is not None:
            facts.update(self.threads.describe())
        if self.list_adapters():
            facts.update(adapters=list(self.list_adapters()), active_adapter=self.active_adapter)
        return facts

"""InferenceEngine: the facade. It keeps the request API and hands everything else to its own module.

Loading lives in :mod:`llminfer.runtime`; construction of the backend, the core and the stages in
:mod:`llminfer.assembly` (by the backend registry, :mod:`llminfer.backends.registry`); where the pipeline
runs in :mod:`llminfer.lifecycle` (a background event loop for the synchronous ``run``, ``stream``, ...;
the caller's loop inside ``async with engine.running():``, as the server does); admission against adapter
changes in :mod:`llminfer.admission`; one request's submit → fold → cancel in
:class:`llminfer.frontend.output.RequestHandle`. The loop itself is :mod:`llminfer.core.engine_core`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel

from llminfer import assembly
from llminfer.admission import Admission
from llminfer.backends.registry import backend_spec
from llminfer.chat import ChatResult, chat_turn
from llminfer.config import EngineConfig
from llminfer.core.model_thread import ModelThreadLease, model_thread_enabled, shared_model_thread
from llminfer.core.threads import ThreadGovernor
from llminfer.errors import EngineClosedError, EngineError, InvalidRequestError
from llminfer.frontend.input import InputProcessor, build_request
from llminfer.frontend.output import RequestHandle
from llminfer.lifecycle import CLOSED, PipelineLifecycle
from llminfer.pipeline import Pipeline
from llminfer.protocols import EngineCore, Stage
from llminfer.protocols.messages import GenerationRequest, TokenizedRequest
from llminfer.results import GenerationResult, StreamChunk
from llminfer.runtime import Runtime, load_runtime, resolve_quant
from llminfer.runtime_info import describe_runtime
from llminfer.stats import StatLogger
from llminfer.trace import Tracer


def _runtime_attr(name: str, doc: str) -> property:
    """A read-only property for the loaded runtime's ``name`` (EngineError before :meth:`load`)."""

    def get(engine: InferenceEngine) -> Any:
        if engine.runtime is None:
            raise EngineError("call load() first")
        return getattr(engine.runtime, name)

    return property(get, doc=f"{doc} (after load(); EngineError before)")


class InferenceEngine:
    """Load a model once, then serve requests through the stage pipeline.

    Example::

        with InferenceEngine(EngineConfig()).load() as engine:
            print(engine.run("Hello", max_new_tokens=16).generated_text)

    After :meth:`load`, ``runtime`` holds every loaded piece (:class:`~llminfer.runtime.Runtime`); the ones
    callers use most are properties here too: ``tokenizer``, ``model``, ``model_path``, ``max_model_len``,
    ``vocab_size``, ``device``, ``kv_manager``, ``kv_cache``; plus ``backend`` and ``core`` (the running
    :class:`~llminfer.protocols.EngineCore`). ``stat_loggers``: append a
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
        # Loading and every step run on one thread, shared by every engine of the process, so torch's
        # OpenMP keeps one thread team (see llminfer.core.model_thread); None with LLMINFER_MODEL_THREAD=0,
        # and for an external engine (vLLM), which is created where the caller is (it may install signal
        # handlers, which only the main thread can) and steps in its own processes.
        external = backend_spec(self.cfg.backend).external_engine
        use_thread = model_thread_enabled() and not external
        # torch's thread count for the steps (llminfer.core.threads; fixed for compiled graphs, whose
        # parallel regions are sized when they compile); an external engine sets its own
        self.threads = None if external else ThreadGovernor(self.cfg.num_threads, adapt=self.cfg.backend != "compiled")
        self.model_thread: ModelThreadLease | None = shared_model_thread(self.threads) if use_thread else None
        # where the pipeline runs (a background loop, or the caller's inside running()); start() and
        # close() from many threads at once: never two half-started loops, none started after close()
        self._life = PipelineLifecycle(self, self.load, self._own_pipeline, self._after_caller_loop)
        # requests against adapter changes (llminfer.admission): run_requests, stream, generate_request
        self._admission = Admission(lambda: self.active_adapter)

    # ------------------------------------------------------------------ the loaded pieces
    tokenizer = _runtime_attr("tokenizer", "The Hugging Face tokenizer")
    model = _runtime_attr("model", "The causal LM, None for an external engine such as vLLM")
    model_path = _runtime_attr("model_path", "The resolved model folder (or hub id, for vLLM)")
    max_model_len = _runtime_attr("max_model_len", "The context length in tokens")
    vocab_size = _runtime_attr("vocab_size", "The config's vocabulary size, None when it has none")
    device = _runtime_attr("device", "The torch.device the weights live on")
    kv_manager = _runtime_attr("kv_manager", "The KV block bookkeeping, None for an external engine")
    kv_cache = _runtime_attr("kv_cache", "The paged KV tensors, None for an external engine")

    loaded = property(lambda self: self.runtime is not None, doc="True once :meth:`load` has run.")

    def load(self) -> InferenceEngine:
        """Load tokenizer and model, size and allocate the KV pool once, build the backend. Returns self.

        Raises:
            EngineClosedError: the engine was closed (a closed engine loads nothing more).
        """
        if self._life.closed and self.runtime is None:
            raise EngineClosedError(CLOSED)
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
        self._require_portal()
        return self

    def _require_portal(self) -> Any:
        return self._life.portal()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[InferenceEngine]:
        """Run the pipeline inside the current event loop (for servers): ``async with engine.running():``.

        Raises:
            EngineError: it already runs; EngineClosedError: :meth:`close` has run.
        """
        if self._life.closed:
            raise EngineClosedError(CLOSED)
        if self.runtime is None:
            await (self.model_thread.run(self.load) if self.model_thread else anyio.to_thread.run_sync(self.load))
        async with self._life.in_caller_loop():
            yield self

    def _after_caller_loop(self) -> None:
        if self._life.closed and self.model_thread is not None:
            # close() from another thread let this pipeline's requests finish; their steps took a
            # share of the model thread again after close() gave it back
            self.model_thread.close()

    def close(self) -> None:
        """Stop the pipeline (in-flight requests finish first, up to 30 s) and refuse everything after:
        later calls that need the pipeline (``run``, ``stream``, ``start``, ``running``, ...) raise
        :class:`~llminfer.errors.EngineClosedError`, and so does a stream still being read. The loaded
        model stays usable for :meth:`build_pipeline` (except vLLM's, which is shut down). Idempotent and
        safe from any thread; a close that another thread has under way is waited for."""
        self._life.close(self._release)

    def _release(self) -> None:
        """What close() gives back once the pipeline has stopped."""
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
        runs. Returns the graphs compiled (0 for the other backends, which do nothing). Raises what
        compilation raised when ``compile_fallback_to_eager`` is off."""
        self.load()
        warm = getattr(self.backend, "warmup", None)
        return int(self._on_model_thread(warm)) if warm is not None else 0

    def stop(self) -> None:
        """Stop the background event loop that the sync methods started (in-flight requests finish first,
        up to 30 s) without closing the engine: the next sync call starts it again, and the engine can be
        handed to another event loop, ``async with engine.running():`` or ``create_app(engine)`` (a server).
        Does nothing when no background loop runs; safe from any thread."""
        self._life.stop_background()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has been called."""
        return self._life.closed

    @property
    def _pipeline(self) -> Pipeline | None:
        """The running pipeline (in the background loop or the caller's), or None."""
        return self._life.pipeline

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
        if self._admission.in_flight:
            return False
        if self._pipeline is None or self.core is None:
            return True
        return not getattr(self._pipeline.sink, "streams", None) and not any(self.core.scheduler_stats().values())

    def _running_pipeline(self) -> Pipeline:
        return self._life.running_pipeline()

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
        with self._admission.admitted(requests):
            results = self._life.collect(self._require_portal(), requests)
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
        with self._admission.admitted([request]):
            yield from self._life.stream(self._require_portal(), request)

    def chat(self, messages: Sequence[dict[str, Any]], *, tools: Sequence[Any] | None = None,
             tool_choice: str | dict[str, Any] | None = "auto", parallel_tool_calls: bool = True,
             chat_template: str | None = None, **kwargs: Any) -> ChatResult:
        """One chat turn with tools: :func:`llminfer.chat.chat_turn` on this engine (same arguments)."""
        return chat_turn(self, messages, tools=tools, tool_choice=tool_choice,
                         parallel_tool_calls=parallel_tool_calls, chat_template=chat_template, **kwargs)

    async def generate(self, prompt: str | Sequence[int], **kwargs: Any) -> AsyncIterator[StreamChunk]:
        """Async iterator of :class:`StreamChunk` inside ``async with engine.running():`` (else EngineError);
        the chunks are those of :meth:`stream` (text on non-final chunks, an empty final one with the stats)."""
        if self._life.closed:
            raise EngineClosedError(CLOSED)
        if self._pipeline is None or self._life.background is not None:
            raise EngineError("use `async with engine.running():` before generate()")
        async for chunk in self.generate_request(self.make_request(prompt, **kwargs)):
            yield chunk

    async def generate_request(self, request: GenerationRequest | TokenizedRequest) -> AsyncIterator[StreamChunk]:
        """Like :meth:`generate` for a prepared request (the HTTP layer submits it tokenized)."""
        await self._admission.admit(request)
        try:
            async with contextlib.aclosing(RequestHandle(self._running_pipeline(), request).chunks()) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self._admission.release(1)

    # ------------------------------------------------------------------ engine-wide control
    async def drained(self) -> None:
        """Return once every request submitted before this call has finished or been cancelled and its
        KV blocks are free (an ordered marker through the core's inbox; inside the engine's loop)."""
        await self._life.control("drain")

    def wait_drained(self) -> None:
        """:meth:`drained` from synchronous code in another thread than the engine's loop (the background
        loop, or the server's loop inside ``running()``); returns at once when nothing runs.

        Raises:
            EngineError: called on the engine's own event loop (use ``await engine.drained()`` there).
        """
        self._life.wait_from_thread(self.drained)

    def reset_prefix_cache(self) -> None:
        """Forget every cached free KV block (a cold cache), ordered after the requests already submitted.
        From the engine's own event loop the reset is queued; from any other thread it has happened when
        this returns."""
        self._life.control_now("reset_prefix_cache")

    # ------------------------------------------------------------------ LoRA adapters
    @property
    def active_adapter(self) -> str | None:
        """The active LoRA adapter's name (None: the base model)."""
        return self.adapter_manager.active if self.adapter_manager is not None else None

    def list_adapters(self) -> dict[str, str]:
        """Loaded LoRA adapters: name → the path or hub id they came from."""
        return dict(self.adapter_manager.adapters) if self.adapter_manager is not None else {}

    def load_adapter(self, path_or_id: str, adapter_name: str | None = None, *, activate: bool = True) -> str:
        """Load a PEFT LoRA adapter (see :meth:`llminfer.adapters.AdapterManager.load`). Returns its name.

        Raises:
            BackendUnavailableError: PEFT is not installed, or a backend without a transformers model.
            ConfigError: a bad or already used name. ModelLoadError: it cannot be loaded.
            EngineError: requests are in flight.
        """
        return self._admission.change_adapters(self, "load an adapter",
                                               lambda m: m.load(path_or_id, adapter_name, activate=activate))

    def set_adapter(self, adapter_name: str | None) -> None:
        """Make ``adapter_name`` the active adapter (None: the base model) for every later request;
        refused while requests are in flight (call it when :meth:`is_idle` is True).

        Raises:
            ConfigError: no adapter of that name. EngineError: requests are in flight.
        """
        self._admission.change_adapters(self, "switch adapters", lambda m: m.set(adapter_name))

    def unload_adapter(self, adapter_name: str) -> None:
        """Remove an adapter's weights and reset the prefix cache (a later adapter of the same name must
        never hit KV computed under this one, so the reset comes before any later request is admitted); if
        it was active, the base model becomes active.

        Raises:
            ConfigError: no adapter of that name. EngineError: requests are in flight.
        """
        self._admission.change_adapters(self, "unload an adapter", lambda m: m.unload(adapter_name),
                                        then=self.reset_prefix_cache)

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

"""InferenceEngine: the facade over one assembled pipeline.

Synchronous methods (``run``, ``run_batch``, ``run_batch_continuous``, ``stream``) drive the pipeline in a
background event loop (an anyio blocking portal). The async API (``generate``) runs inside the caller's
loop once it is entered with ``async with engine.running():`` (the HTTP server does this in its lifespan).
"""

from __future__ import annotations

import atexit
import contextlib
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import anyio
import anyio.from_thread
import structlog
import torch

from llminfer.backends.hf import HFBackend, kv_geometry
from llminfer.backends.loading import (
    load_config,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_model_path,
)
from llminfer.config import Backend, EngineConfig, QuantMode
from llminfer.errors import BackendUnavailableError, ConfigError, EngineError, LLMInferError
from llminfer.kv.attention import PagedKVCache, register_paged_attention
from llminfer.kv.manager import KVCacheManager, cdiv
from llminfer.pipeline import Pipeline
from llminfer.protocols import Stage
from llminfer.protocols.messages import GenerationRequest, RequestDelta
from llminfer.results import GenerationResult, GenerationStats, StreamChunk
from llminfer.sampling.params import SamplingParams
from llminfer.scheduler import Scheduler, SchedulerLimits
from llminfer.stages.detokenize import DetokenizeStage
from llminfer.stages.prefix_hash import PrefixHashStage
from llminfer.stages.schedule import SchedulerStage, StepStage
from llminfer.stages.sink import StreamSink
from llminfer.stages.tokenize import TokenizeStage
from llminfer.trace import Tracer

log = structlog.get_logger("llminfer.engine")

# Engines whose background event loop is running. At interpreter exit the loop's daemon thread stops
# before garbage collection would close the portal, which then waits for it forever: a script that
# forgets close() (or dies of an exception) would hang instead of exiting. Closing them at exit avoids it.
_STARTED_ENGINES: weakref.WeakSet[InferenceEngine] = weakref.WeakSet()


@atexit.register
def _close_started_engines() -> None:
    for engine in list(_STARTED_ENGINES):
        with contextlib.suppress(Exception):
            engine.close()

_CPU_DEFAULT_KV_BYTES_CAP = 2 * 1024**3


class ResultBuilder:
    """Folds a request's deltas into :class:`StreamChunk` objects and a final :class:`GenerationResult`."""

    def __init__(self, request: GenerationRequest, submit_ns: int) -> None:
        self.request = request
        self.submit_ns = submit_ns
        self.first_ns = 0
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[Any] = []
        self.finish_reason: str | None = None
        self.stats: GenerationStats | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: RequestDelta) -> StreamChunk:
        """Fold one delta in.

        Raises:
            LLMInferError: the request failed (the error the engine reported for it).
        """
        if delta.error is not None:
            self.finish_reason = delta.finish_reason or "error"
            err = delta.error
            raise err if isinstance(err, LLMInferError) else EngineError(f"{type(err).__name__}: {err}")
        if delta.token_ids and not self.first_ns:
            self.first_ns = delta.time_ns
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.finished:
            self.finish_reason = delta.finish_reason
            end = delta.time_ns or time.perf_counter_ns()
            total_ms = max(end - self.submit_ns, 0) / 1e6
            n = len(self.token_ids)
            self.stats = GenerationStats(
                total_latency_ms=total_ms,
                ttft_ms=max(self.first_ns - self.submit_ns, 0) / 1e6 if self.first_ns else 0.0,
                throughput_tokens_per_sec=n / (total_ms / 1e3) if total_ms > 0 else 0.0,
                prompt_tokens=delta.prompt_tokens,
                completion_tokens=n,
                cache_hit=delta.cached_tokens > 0,
                cached_tokens=delta.cached_tokens,
                num_preemptions=delta.num_preemptions,
                queue_time_ms=delta.queue_time_ns / 1e6,
                prefill_time_ms=delta.prefill_time_ns / 1e6,
                spec_proposed_tokens=delta.spec_proposed,
                spec_accepted_tokens=delta.spec_accepted,
            )
        return StreamChunk(delta.text, delta.token_ids, delta.finished, self.finish_reason, self.stats,
                           delta.logprobs)

    def result(self) -> GenerationResult:
        if self.stats is None or self.finish_reason is None:
            raise EngineError(f"request {self.request.request_id} ended without a final token")
        return GenerationResult(
            request_id=self.request.request_id,
            generated_text="".join(self.text),
            token_ids=tuple(self.token_ids),
            finish_reason=self.finish_reason,
            stats=self.stats,
            prefix_key=self.request.prefix_key,
            logprobs=tuple(self.logprobs),
        )


class InferenceEngine:
    """Load a model once, then serve requests through the stage pipeline.

    Example::

        with InferenceEngine(EngineConfig()).load() as engine:
            print(engine.run("Hello", max_new_tokens=16).generated_text)

    Raises:
        ConfigError: inconsistent configuration (at construction or :meth:`load`).
        ModelLoadError: the model or tokenizer cannot be found or loaded.
        BackendUnavailableError: the backend cannot run here.
    """

    def __init__(self, cfg: EngineConfig | None = None) -> None:
        self.cfg = (cfg or EngineConfig()).validate()
        self.tracer = Tracer(enabled=self.cfg.enable_tracing)
        self.loaded = False
        self._pipeline: Pipeline | None = None
        self._portal_cm: Any = None
        self._portal: Any = None
        self._pipeline_cm: Any = None
        self.vllm: Any = None
        self.adapters: dict[str, str] = {}
        self.active_adapter: str | None = None

    # ------------------------------------------------------------------ loading
    def load(self) -> InferenceEngine:
        """Load tokenizer and model, size and allocate the KV pool once. Returns self."""
        if self.loaded:
            return self
        cfg = self.cfg
        self.vllm = None
        self.adapters: dict[str, str] = {}
        self.active_adapter: str | None = None
        if cfg.backend is not Backend.EAGER and cfg.assistant_model_name:
            raise ConfigError("assistant_model_name (speculative decoding) runs on the eager backend only; "
                              "drop --assistant-model or use --backend eager")
        if cfg.backend is Backend.VLLM:
            return self._load_vllm()
        quantization_config = None
        self.device = resolve_device(cfg.device)
        if cfg.quant.mode is not QuantMode.NONE:
            from llminfer.backends.quant import bnb_config

            quantization_config = bnb_config(cfg.quant, self.device)
        self._load_config_and_tokenizer()
        register_paged_attention()
        t0 = time.perf_counter()
        self.model = load_model(self.model_path, cfg, self.dtype, self.device, attn_implementation="llminfer_paged",
                                quantization_config=quantization_config)
        if cfg.cpu_prepack_lm_head and cfg.backend is Backend.EAGER:
            from llminfer.backends.prepack import prepack_lm_head

            prepack_lm_head(self.model)
        self.load_time_s = time.perf_counter() - t0
        self.eos_token_ids = self._eos_ids()
        self.kv_cache, self.kv_manager = self._allocate_kv()
        self.draft_model = self.draft_cache = None
        if cfg.assistant_model_name:
            self._load_draft()
        self.loaded = True
        log.info("engine loaded", model=self.model_path, device=str(self.device), dtype=str(self.dtype),
                 kv_blocks=self.kv_manager.num_blocks, block_size=self.kv_manager.block_size)
        return self

    def _load_config_and_tokenizer(self) -> None:
        """Resolve the model folder, read its config, pick the dtype and context length, load the tokenizer.

        Raises:
            ModelLoadError: the model or tokenizer cannot be found.
            ConfigError: ``max_model_len`` exceeds the model's context.
        """
        cfg = self.cfg
        self.model_path = resolve_model_path(cfg)
        self.model_config = load_config(self.model_path, cfg)
        self.dtype = resolve_dtype(cfg, self.model_config, self.device)
        text_cfg = self.model_config.get_text_config()
        model_max = getattr(text_cfg, "max_position_embeddings", None) or 2048
        if cfg.max_model_len is not None and cfg.max_model_len > model_max:
            raise ConfigError(f"max_model_len {cfg.max_model_len} exceeds the model's context of {model_max} tokens")
        self.max_model_len = cfg.max_model_len or model_max
        self.tokenizer = load_tokenizer(self.model_path, cfg)

    def _load_vllm(self) -> InferenceEngine:
        """The vLLM backend: tokenizer and config here (llminfer tokenizes and validates), model, KV cache
        and scheduling in vLLM.

        Raises:
            BackendUnavailableError: vLLM is not installed (one line saying how to install it) or cannot
                start here.
        """
        from llminfer.backends.vllm import VLLMBackend, require_vllm

        cfg = self.cfg
        require_vllm()  # fail at once, before anything is loaded
        self.device = resolve_device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else cfg.device)
        self._load_config_and_tokenizer()
        t0 = time.perf_counter()
        self.vllm = VLLMBackend.from_config(cfg, self.model_path, self.max_model_len)
        self.load_time_s = time.perf_counter() - t0
        self.model = None
        self.kv_cache = self.kv_manager = None
        self.draft_model = self.draft_cache = None
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids = (eos,) if isinstance(eos, int) else ()
        self.loaded = True
        log.info("engine loaded", model=self.model_path, backend="vllm", tp_size=cfg.tp_size, pp_size=cfg.pp_size)
        return self

    def _load_draft(self) -> None:
        """Load the assistant model for speculative decoding; its KV shares the target's block tables.

        Raises:
            ModelLoadError: the assistant cannot be loaded.
            ConfigError: its vocabulary differs from the target's.
        """
        cfg = self.cfg
        name = cfg.assistant_model_name
        path = resolve_model_path(EngineConfig(model_name=None if name == "builtin" else name))
        load_config(path, cfg)  # a clear error for a missing folder
        self.draft_model = load_model(path, cfg, self.dtype, self.device, attn_implementation="llminfer_paged")
        if cfg.cpu_prepack_lm_head:
            from llminfer.backends.prepack import prepack_lm_head

            prepack_lm_head(self.draft_model)
        target_vocab = self.model.get_output_embeddings().weight.shape[0]
        draft_vocab = self.draft_model.get_output_embeddings().weight.shape[0]
        if target_vocab != draft_vocab:
            raise ConfigError(f"assistant_model_name: the assistant's vocabulary ({draft_vocab}) differs from "
                              f"the target's ({target_vocab}); they must share a tokenizer")
        layers, kv_heads, head_dim = kv_geometry(self.draft_model.config)
        self.draft_cache = PagedKVCache(layers, self.kv_manager.num_blocks, self.kv_manager.block_size, kv_heads,
                                        head_dim, self.dtype, self.device)

    def _eos_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        for source in (eos, self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.append(source)
            elif isinstance(source, (list, tuple)):
                ids.extend(int(x) for x in source)
        return tuple(dict.fromkeys(ids))

    def _allocate_kv(self) -> tuple[PagedKVCache, KVCacheManager]:
        cache_cfg = self.cfg.cache
        num_layers, num_kv_heads, head_dim = kv_geometry(self.model.config)
        block_size = cache_cfg.page_size_tokens if cache_cfg.enable_paged_kv else self.max_model_len
        per_block = PagedKVCache.bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, self.dtype)
        if cache_cfg.num_blocks is not None:
            num_blocks = cache_cfg.num_blocks
        elif cache_cfg.kv_cache_memory_bytes is not None:
            num_blocks = cache_cfg.kv_cache_memory_bytes // per_block
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            num_blocks = int(free * cache_cfg.gpu_memory_utilization) // per_block
        else:
            want_tokens = self.cfg.max_batch_size * self.max_model_len
            budget = min(cdiv(want_tokens, block_size) * per_block, _CPU_DEFAULT_KV_BYTES_CAP)
            num_blocks = budget // per_block
        if num_blocks < 1:
            raise ConfigError(f"cache: the KV budget holds no block (one block needs {per_block} bytes)")
        cache = PagedKVCache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, self.dtype, self.device)
        manager = KVCacheManager(num_blocks, block_size,
                                 enable_prefix_cache=cache_cfg.enable_prefix_cache and cache_cfg.enable_paged_kv)
        return cache, manager

    # ------------------------------------------------------------------ composition
    @property
    def owns_scheduling(self) -> bool:
        """True when the backend schedules, caches KV and detokenizes itself (vLLM): the pipeline is then
        ``tokenize → backend stage → [user stages] → sink``."""
        return bool(getattr(self.vllm, "owns_scheduling", False))

    def default_stages(self) -> dict[str, Stage]:
        """Fresh instances of the built-in stages, by name (``tokenize``, ``prefix_hash``, ``scheduler``,
        ``step``, ``detokenize``, ``sink``), sharing this engine's tokenizer, KV pool and backend.

        With a backend that owns scheduling (vLLM) the names are ``tokenize``, ``scheduler`` (the
        :class:`~llminfer.backends.vllm.VLLMStage`), ``step`` (idle) and ``sink``."""
        if not self.loaded:
            raise EngineError("call load() first")
        if self.owns_scheduling:
            from llminfer.backends.vllm import IdleStepStage, VLLMStage

            vocab = getattr(self.model_config.get_text_config(), "vocab_size", None)
            self.backend = self.vllm
            return {
                "tokenize": TokenizeStage(self.tokenizer, self.max_model_len, vocab, self.tracer),
                "scheduler": VLLMStage(self.vllm, self.tracer),
                "step": IdleStepStage(),
                "sink": StreamSink(self.tracer),
            }
        limits = SchedulerLimits(
            max_batch_size=self.cfg.max_batch_size,
            max_num_batched_tokens=max(self.cfg.scheduler.max_num_batched_tokens, 1),
            max_model_len=self.max_model_len,
            long_prefill_token_threshold=self.cfg.scheduler.long_prefill_token_threshold,
            watermark=self.cfg.scheduler.watermark,
            policy=self.cfg.scheduler.policy,
            num_lookahead_tokens=self.cfg.speculative_num_assistant_tokens if self.draft_model is not None else 0,
        )
        self.scheduler = Scheduler(limits, self.kv_manager, self.eos_token_ids)
        if self.draft_model is not None:
            from llminfer.backends.speculative import SpeculativeBackend

            self.backend: HFBackend = SpeculativeBackend(
                self.model, self.kv_cache, self.draft_model, self.draft_cache, self.eos_token_ids,
                self.cfg.speculative_num_assistant_tokens, self.cfg.speculative_confidence_threshold)
        elif self.cfg.backend is Backend.COMPILED:
            from llminfer.backends.compiled import CompiledBackend

            # One compiled backend per engine: its compiled graphs survive a pipeline restart.
            compiled = getattr(self, "_compiled_backend", None)
            if compiled is None:
                compiled = self._compiled_backend = CompiledBackend(
                    self.model, self.kv_cache, self.eos_token_ids, max_num_tokens=limits.max_num_batched_tokens,
                    max_batch_size=self.cfg.max_batch_size, mode=self.cfg.compile_mode,
                    cudagraphs=self.cfg.compile_cudagraphs, fallback_to_eager=self.cfg.compile_fallback_to_eager)
            compiled.states.clear()
            self.backend = compiled
        else:
            self.backend = HFBackend(self.model, self.kv_cache, self.eos_token_ids)
        vocab = getattr(self.model.config.get_text_config(), "vocab_size", None)
        return {
            "tokenize": TokenizeStage(self.tokenizer, self.max_model_len, vocab, self.tracer),
            "prefix_hash": PrefixHashStage(self.kv_manager.block_size, self.kv_manager.enable_prefix_cache),
            "scheduler": SchedulerStage(self.scheduler, self.cfg.batch_timeout_ms, self.tracer),
            "step": StepStage(self.backend, self.tracer),
            "detokenize": DetokenizeStage(self.tokenizer, self.tracer),
            "sink": StreamSink(self.tracer),
        }

    def build_pipeline(self, after_detokenize: Sequence[Stage] = (), sink: Stage | None = None) -> Pipeline:
        """Assemble the default pipeline, with user stages between detokenize and the sink and,
        optionally, a different sink. The engine's own methods use the pipeline it starts itself."""
        s = self.default_stages()
        names = ("tokenize", "scheduler") if self.owns_scheduling else ("tokenize", "prefix_hash", "scheduler",
                                                                         "detokenize")
        stages = [*(s[n] for n in names), *after_detokenize, sink or s["sink"]]
        return Pipeline(stages, step=s["step"])

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> InferenceEngine:
        """Start the pipeline in a background event loop (done on first use by the sync methods)."""
        if not self.loaded:
            self.load()
        if self._portal is None:
            self._pipeline = self.build_pipeline()
            self._portal_cm = anyio.from_thread.start_blocking_portal()
            self._portal = self._portal_cm.__enter__()
            self._pipeline_cm = self._portal.wrap_async_context_manager(self._pipeline)
            self._pipeline_cm.__enter__()
            _STARTED_ENGINES.add(self)
        return self

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[InferenceEngine]:
        """Run the pipeline inside the current event loop (for servers): ``async with engine.running():``."""
        if not self.loaded:
            await anyio.to_thread.run_sync(self.load)
        if self._portal is not None or self._pipeline is not None and self._pipeline.running:
            raise EngineError("the engine is already running")
        self._pipeline = self.build_pipeline()
        async with self._pipeline:
            yield self
        self._pipeline = None

    @property
    def lm_head_prepacked(self) -> bool:
        """Whether the LM head runs on a oneDNN-prepacked weight (see :mod:`llminfer.backends.prepack`)."""
        from llminfer.backends.prepack import PrepackedLinear

        model = getattr(self, "model", None)
        head = model.get_output_embeddings() if model is not None else None
        return isinstance(head, PrepackedLinear)

    def close(self) -> None:
        """Stop the pipeline (in-flight requests finish first, up to 30 s)."""
        _STARTED_ENGINES.discard(self)
        if self._pipeline_cm is not None:
            cm, self._pipeline_cm = self._pipeline_cm, None
            cm.__exit__(None, None, None)
        if self._portal_cm is not None:
            pcm, self._portal_cm, self._portal = self._portal_cm, None, None
            pcm.__exit__(None, None, None)
        self._pipeline = None

    def __enter__(self) -> InferenceEngine:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ requests
    def make_request(
        self,
        prompt: str | Sequence[int],
        *,
        max_new_tokens: int | None = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_sequences: Sequence[str] | str | None = None,
        ignore_eos: bool = False,
        prefix_key: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        adapter_name: str | None = None,
        **sampling: Any,
    ) -> GenerationRequest:
        """Validate arguments and build a :class:`GenerationRequest`.

        The request is stamped with the active LoRA adapter (``adapter_name``; it partitions the prefix
        cache). Passing ``adapter_name`` only checks that it is the active one: the model runs one adapter
        at a time (switch with :meth:`set_adapter`).

        Raises:
            InvalidRequestError: empty prompt, a bad sampling value (the message names it), or an
                ``adapter_name`` that is not the active adapter.
        """
        from llminfer.errors import InvalidRequestError

        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            p: str | tuple[int, ...] = prompt
        else:
            p = tuple(int(t) for t in prompt)
            if not p:
                raise InvalidRequestError("prompt is empty")
        if sampling.get("n", 1) != 1:
            raise InvalidRequestError("n > 1 makes several requests: use make_requests(..., n=) or run_n()")
        try:
            params = SamplingParams(
                max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                stop_sequences=stop_sequences or (), ignore_eos=ignore_eos, **sampling,
            )
        except TypeError as exc:
            raise InvalidRequestError(f"unknown sampling argument: {exc}") from None
        if adapter_name is not None and adapter_name != self.active_adapter:
            raise InvalidRequestError(f"adapter {adapter_name!r} is not the active adapter "
                                      f"({self.active_adapter!r}); call set_adapter() first")
        return GenerationRequest(uuid.uuid4().hex, p, params, time.perf_counter_ns(), prefix_key=prefix_key,
                                 priority=priority, cache_salt=cache_salt, adapter_name=self.active_adapter)

    def make_requests(self, prompt: str | Sequence[int], *, n: int = 1, seed: int | None = None,
                      **kwargs: Any) -> list[GenerationRequest]:
        """``n`` samples of one prompt as ``n`` requests (seeds ``seed``, ``seed + 1``, ... when seeded).

        Submitted together, they share the prompt's KV blocks: the scheduler computes the prompt once and
        the others reuse its blocks through the prefix cache (reference counts, no copy).

        Raises:
            InvalidRequestError: ``n < 1`` or any other bad value.
        """
        from llminfer.errors import InvalidRequestError

        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidRequestError(f"n must be an integer >= 1, got {n!r}")
        return [self.make_request(prompt, seed=None if seed is None else seed + i, **kwargs) for i in range(n)]

    def run_n(self, prompt: str | Sequence[int], n: int, **kwargs: Any) -> list[GenerationResult]:
        """``n`` samples of one prompt (see :meth:`make_requests`); results in sample order."""
        return self.run_requests(self.make_requests(prompt, n=n, **kwargs))

    def _require_portal(self) -> Any:
        if self._portal is None:
            self.start()
        return self._portal

    async def _collect(self, request: GenerationRequest) -> GenerationResult:
        assert self._pipeline is not None
        self._check_adapter(request)
        builder = ResultBuilder(request, time.perf_counter_ns())
        stream = await self._pipeline.submit(request)
        try:
            async with stream:
                async for delta in stream:
                    builder.add(delta)
        finally:
            if not builder.finished:
                self._cancel(request.request_id)
        return builder.result()

    def _cancel(self, request_id: str) -> None:
        if self._pipeline is not None:
            self._pipeline.sink.close(request_id)
            with contextlib.suppress(Exception):
                self._pipeline.abort_nowait(request_id)

    def run(self, prompt: str | Sequence[int], **kwargs: Any) -> GenerationResult:
        """Generate for one prompt and wait for the result.

        Keyword arguments are those of :meth:`make_request` (``max_new_tokens``, ``temperature``, ``top_p``,
        ``top_k``, ``seed``, ``stop_sequences``, ``ignore_eos``, ``prefix_key``, ...).

        Raises:
            InvalidRequestError: bad input (empty prompt, prompt too long, bad sampling value).
            CapacityError: the request can never fit in the KV cache.
            EngineError: the backend failed.
        """
        request = self.make_request(prompt, **kwargs)
        return self._require_portal().call(self._collect, request)

    def run_batch_continuous(self, prompts: Sequence[str | Sequence[int]], **kwargs: Any) -> list[GenerationResult]:
        """Submit every prompt at once to the continuous-batching scheduler; results in prompt order.

        Raises:
            The first error any request raised (the others still finish or are cancelled).
        """
        return self.run_requests([self.make_request(p, **kwargs) for p in prompts])

    def run_requests(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Submit prepared requests (from :meth:`make_request`, each with its own settings) at once to the
        continuous-batching scheduler; results in order.

        Raises:
            The first error any request raised (the others still finish or are cancelled).
        """

        async def collect_all() -> list[GenerationResult]:
            results: list[Any] = [None] * len(requests)

            async def one(i: int) -> None:
                try:
                    results[i] = await self._collect(requests[i])
                except LLMInferError as exc:
                    results[i] = exc

            async with anyio.create_task_group() as tg:
                for i in range(len(requests)):
                    tg.start_soon(one, i)
            return results

        results = self._require_portal().call(collect_all)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    def run_batch(self, prompts: Sequence[str | Sequence[int]], **kwargs: Any) -> list[GenerationResult]:
        """Static batching: prompts go in groups of ``max_batch_size``; a group runs until all of its
        requests finish before the next group starts (the classic ``generate()`` batch, for comparison
        with :meth:`run_batch_continuous`). Results in prompt order."""
        out: list[GenerationResult] = []
        size = self.cfg.max_batch_size
        for start in range(0, len(prompts), size):
            out.extend(self.run_batch_continuous(prompts[start : start + size], **kwargs))
        return out

    def stream(self, prompt: str | Sequence[int], **kwargs: Any) -> Iterator[StreamChunk]:
        """Yield :class:`StreamChunk` as tokens arrive; joined ``token`` text equals ``generated_text``.
        Closing the iterator early cancels the request and frees its KV blocks."""
        portal = self._require_portal()
        request = self.make_request(prompt, **kwargs)
        builder = ResultBuilder(request, time.perf_counter_ns())
        assert self._pipeline is not None
        stream = portal.call(self._pipeline.submit, request)
        try:
            while not builder.finished:
                try:
                    delta = portal.call(stream.receive)
                except (anyio.EndOfStream, anyio.ClosedResourceError):
                    raise EngineError("the engine stopped before the request finished") from None
                yield builder.add(delta)
        finally:
            if not builder.finished and self._portal is not None:
                portal.call(self._cancel, request.request_id)

    async def generate(self, prompt: str | Sequence[int], **kwargs: Any) -> AsyncIterator[StreamChunk]:
        """Async iterator of :class:`StreamChunk` (inside ``async with engine.running():``).

        Raises:
            EngineError: the engine is not running in this event loop.
        """
        if self._pipeline is None or self._portal is not None:
            raise EngineError("use `async with engine.running():` before generate()")
        request = self.make_request(prompt, **kwargs)
        async for chunk in self.generate_request(request):
            yield chunk

    async def generate_request(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        """Like :meth:`generate` for a prepared :class:`GenerationRequest` (the HTTP layer uses it)."""
        if self._pipeline is None:
            raise EngineError("the engine is not running")
        self._check_adapter(request)
        builder = ResultBuilder(request, time.perf_counter_ns())
        stream = await self._pipeline.submit(request)
        try:
            async with stream:
                async for delta in stream:
                    yield builder.add(delta)
        finally:
            if not builder.finished:
                self._cancel(request.request_id)

    # ------------------------------------------------------------------ LoRA adapters
    def _check_adapter(self, request: GenerationRequest) -> None:
        if request.adapter_name != self.active_adapter:
            from llminfer.errors import InvalidRequestError

            raise InvalidRequestError(
                f"the request was made for adapter {request.adapter_name!r} but the active adapter is "
                f"{self.active_adapter!r}; make it again (make_request stamps the active adapter)")

    def _require_adapters(self, what: str) -> None:
        if not self.loaded:
            raise EngineError("call load() first")
        if self.vllm is not None:
            raise BackendUnavailableError("LoRA adapters are not available with the vLLM backend in this version")
        from llminfer.adapters import require_peft

        require_peft()
        if not self.is_idle():
            raise EngineError(f"cannot {what} while requests are in flight; wait until they finish "
                              "(adapters change the model every request runs on)")

    @property
    def is_running(self) -> bool:
        """True while the engine's pipeline runs (in the background loop or in the caller's loop) and
        accepts requests; False before :meth:`start` / ``running()``, after :meth:`close`, or after a
        stage failed."""
        return self._pipeline is not None and self._pipeline.running

    def is_idle(self) -> bool:
        """True when no request is in flight: none submitted and unfinished (the sink holds no open
        stream) and none in the scheduler."""
        pipeline = self._pipeline
        if pipeline is None:
            return True
        if getattr(pipeline.sink, "streams", None):
            return False
        scheduler = getattr(self, "scheduler", None)
        return not (scheduler is not None and scheduler.has_unfinished())

    def list_adapters(self) -> dict[str, str]:
        """Loaded LoRA adapters: name → the path or hub id they came from (the active one is
        :attr:`active_adapter`, None for the base model)."""
        return dict(self.adapters)

    def load_adapter(self, path_or_id: str, adapter_name: str | None = None, *, activate: bool = True) -> str:
        """Load a PEFT LoRA adapter into the running model (the base model is not reloaded).

        Adapter weights live next to the base weights (PEFT wraps the targeted linear layers; attention
        modules, their ``layer_idx`` and the paged-attention kwargs path are untouched). Hub ids use the
        engine's ``hf_token`` / ``hf_cache_dir`` / ``hf_local_files_only``.

        Refused while requests are in flight (it changes the model they run on); see :meth:`set_adapter`.

        Args:
            path_or_id: a folder saved with ``PeftModel.save_pretrained`` or a hub id.
            adapter_name: its name (letters, digits, ``_`` and ``-``); default: the folder's name.
            activate: make it the active adapter (else the active one stays).

        Returns:
            The adapter's name.

        Raises:
            BackendUnavailableError: PEFT is not installed, or the vLLM backend.
            ConfigError: a bad or already used name.
            ModelLoadError: the adapter cannot be found or does not fit the model.
            EngineError: requests are in flight.
        """
        import re
        from pathlib import Path

        from llminfer import adapters
        from llminfer.errors import ModelLoadError

        self._require_adapters("load an adapter")
        if str(path_or_id).startswith(("/", ".", "~")) and not Path(str(path_or_id)).expanduser().exists():
            raise ModelLoadError(f"adapter folder {path_or_id!r} does not exist")
        name = adapter_name or Path(str(path_or_id).rstrip("/")).name or "default"
        if not re.fullmatch(r"[A-Za-z0-9_\-]{1,64}", name):
            raise ConfigError(f"adapter_name {name!r}: use 1-64 letters, digits, '_' or '-'")
        if name in self.adapters:
            raise ConfigError(f"an adapter named {name!r} is already loaded; unload it or choose another name")
        cfg = self.cfg
        dl = {"token": cfg.hf_token, "cache_dir": cfg.hf_cache_dir,
              "local_files_only": cfg.hf_local_files_only or None}
        previous = self.active_adapter
        try:
            adapters.load(self.model, str(path_or_id), name, {k: v for k, v in dl.items() if v})
        except Exception as exc:  # noqa: BLE001 - PEFT/transformers raise many kinds; one clear line
            text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            if cfg.hf_token:
                text = text.replace(cfg.hf_token, "***")
            raise ModelLoadError(f"cannot load adapter {path_or_id!r}: {text}") from None
        self.adapters[name] = str(path_or_id)
        self._activate(name if activate else previous)
        log.info("adapter loaded", adapter=name, active=self.active_adapter)
        return name

    def set_adapter(self, adapter_name: str | None) -> None:
        """Make ``adapter_name`` the active adapter (None: the base model) for every later request.

        Switching is refused while requests are in flight, never applied under them: the model runs one
        adapter at a time and the adapter name partitions the prefix cache, so a request admitted under
        one adapter must finish under it. Call it when :meth:`is_idle` is True.

        Raises:
            ConfigError: no adapter of that name is loaded.
            EngineError: requests are in flight.
            BackendUnavailableError: PEFT is not installed, or the vLLM backend.
        """
        self._require_adapters("switch adapters")
        if adapter_name is not None and adapter_name not in self.adapters:
            raise ConfigError(f"no adapter named {adapter_name!r} is loaded (loaded: {sorted(self.adapters)})")
        self._activate(adapter_name)

    def unload_adapter(self, adapter_name: str) -> None:
        """Remove an adapter's weights from the model and its KV blocks from the prefix cache; if it was
        active, the base model becomes active (its outputs are exactly the base model's again).

        Raises:
            ConfigError: no adapter of that name is loaded.
            EngineError: requests are in flight.
        """
        self._require_adapters("unload an adapter")
        if adapter_name not in self.adapters:
            raise ConfigError(f"no adapter named {adapter_name!r} is loaded (loaded: {sorted(self.adapters)})")
        from llminfer import adapters

        if self.active_adapter == adapter_name:
            self._activate(None)
        adapters.delete(self.model, adapter_name)
        del self.adapters[adapter_name]
        self._activate(self.active_adapter)  # PEFT may pick another active adapter on deletion
        # A later adapter of the same name must never hit KV computed under this one.
        self.kv_manager.pool.reset_cache()
        log.info("adapter unloaded", adapter=adapter_name)

    def _activate(self, name: str | None) -> None:
        from llminfer import adapters

        adapters.activate(self.model, name)
        self.active_adapter = name

    # ------------------------------------------------------------------ introspection
    @property
    def vocab_size(self) -> int | None:
        """The model's vocabulary size from its config (token ids must be below it), None if unknown."""
        return getattr(self.model_config.get_text_config(), "vocab_size", None)

    @property
    def inputs(self) -> Any:
        """The :class:`~llminfer.frontend.input.InputProcessor` requests are validated with."""
        from llminfer.frontend.input import InputProcessor

        return InputProcessor(self.tokenizer, self.max_model_len, self.vocab_size)

    def scheduler_stats(self) -> dict[str, int]:
        """``running`` and ``waiting`` request counts in the engine core (0 before it starts)."""
        scheduler = getattr(self, "scheduler", None)
        if scheduler is None:
            return {"running": 0, "waiting": 0}
        return {"running": scheduler.num_running, "waiting": scheduler.num_waiting}

    def cache_stats(self) -> dict[str, float | int]:
        """Prefix-cache and KV pool statistics: ``hit_rate``, ``queries``, ``hits``, ``cached_tokens``,
        ``blocks_total/used/free/cached``, ``evictions``, ``block_size``. With the vLLM backend: ``hit_rate``,
        ``queries`` / ``hits`` (prompt tokens / tokens served from vLLM's prefix cache), ``requests``."""
        if not self.loaded:
            raise EngineError("call load() first")
        if self.vllm is not None:
            return self.vllm.cache_stats()
        return self.kv_manager.stats()

    def info(self) -> dict[str, Any]:
        """Environment, model and KV-capacity facts (what ``llminfer info`` prints).

        Weights: ``weight_bytes`` is what the loaded weights occupy (bitsandbytes quantization state
        included), ``weight_bytes_unquantized`` what the same parameters take unquantized in ``dtype``
        (from the config's parameter count), both in bytes; with ``--quant`` also the quantized linear
        layers' bytes against their bfloat16 bytes. ``compile`` holds the compiled backend's compile count
        once its pipeline was built; ``adapters`` the loaded LoRA adapters.
        """
        import platform

        import transformers

        from llminfer.backends.quant import unquantized_weight_bytes, weight_footprint

        facts: dict[str, Any] = {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cuda": torch.version.cuda or "none",
            "device": str(self.device),
            "backend": self.cfg.backend.value,
            "model": self.cfg.model_name or "llminfer/tiny-qwen2 (built-in)",
            "model_path": self.model_path,
        }
        base_params, base_bytes = unquantized_weight_bytes(self.model_config, self.dtype,
                                                           self.cfg.hf_trust_remote_code)
        if self.vllm is not None:
            facts.update({
                "architecture": ",".join(getattr(self.model_config, "architectures", None) or ["?"]),
                "parameters": base_params,
                "dtype": str(self.dtype).replace("torch.", ""),
                "weight_bytes_unquantized": base_bytes,
                "max_model_len": self.max_model_len,
                "tp_size": self.cfg.tp_size,
                "pp_size": self.cfg.pp_size,
                "quant": self.cfg.quant.mode.value,
                "prefix_cache": self.cfg.cache.enable_prefix_cache,
                **self.vllm.info(),
            })
            return facts
        footprint = weight_footprint(self.model)
        facts.update({
            "architecture": ",".join(getattr(self.model.config, "architectures", None) or
                                     [type(self.model).__name__]),
            "parameters": footprint["parameters"],
            "dtype": str(self.dtype).replace("torch.", ""),
            "quant": self.cfg.quant.mode.value,
            "weight_bytes": footprint["weight_bytes"],
            "weight_bytes_unquantized": base_bytes or footprint["weight_bytes"],
        })
        if self.cfg.quant.mode is not QuantMode.NONE:
            facts["quantized_linear_bytes"] = footprint["quantized_linear_bytes"]
            facts["quantized_linear_bf16_bytes"] = footprint["quantized_linear_bf16_bytes"]
        facts.update({
            "max_model_len": self.max_model_len,
            "kv_blocks": self.kv_manager.num_blocks,
            "kv_block_size": self.kv_manager.block_size,
            "kv_tokens": self.kv_manager.capacity_tokens,
            "kv_bytes": self.kv_cache.nbytes,
            "prefix_cache": self.kv_manager.enable_prefix_cache,
        })
        compiled = getattr(self, "_compiled_backend", None)
        if compiled is not None:
            facts["compile"] = compiled.stats()
        if self.adapters:
            facts["adapters"] = list(self.adapters)
            facts["active_adapter"] = self.active_adapter
        return facts

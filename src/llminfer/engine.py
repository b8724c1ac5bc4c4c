"""InferenceEngine: the facade over one assembled pipeline.

Synchronous methods (``run``, ``run_batch``, ``run_batch_continuous``, ``stream``) drive the pipeline in a
background event loop (an anyio blocking portal). The async API (``generate``) runs inside the caller's
loop once it is entered with ``async with engine.running():`` (the HTTP server does this in its lifespan).
"""

from __future__ import annotations

import contextlib
import time
import uuid
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

    # ------------------------------------------------------------------ loading
    def load(self) -> InferenceEngine:
        """Load tokenizer and model, size and allocate the KV pool once. Returns self."""
        if self.loaded:
            return self
        cfg = self.cfg
        if cfg.backend is Backend.VLLM:
            raise BackendUnavailableError(
                "the vLLM backend needs vLLM: pip install 'llminfer[vllm]' (CUDA only)"
            )
        if cfg.backend is Backend.COMPILED:
            raise BackendUnavailableError("the compiled backend is not available in this version; use --backend eager")
        if cfg.quant.mode is not QuantMode.NONE:
            raise BackendUnavailableError("quantization is not available in this version; drop --quant")
        self.device = resolve_device(cfg.device)
        self.model_path = resolve_model_path(cfg)
        self.model_config = load_config(self.model_path, cfg)
        self.dtype = resolve_dtype(cfg, self.model_config, self.device)
        text_cfg = self.model_config.get_text_config()
        model_max = getattr(text_cfg, "max_position_embeddings", None) or 2048
        if cfg.max_model_len is not None and cfg.max_model_len > model_max:
            raise ConfigError(f"max_model_len {cfg.max_model_len} exceeds the model's context of {model_max} tokens")
        self.max_model_len = cfg.max_model_len or model_max
        self.tokenizer = load_tokenizer(self.model_path, cfg)
        register_paged_attention()
        t0 = time.perf_counter()
        self.model = load_model(self.model_path, cfg, self.dtype, self.device, attn_implementation="llminfer_paged")
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
    def default_stages(self) -> dict[str, Stage]:
        """Fresh instances of the built-in stages, by name (``tokenize``, ``prefix_hash``, ``scheduler``,
        ``step``, ``detokenize``, ``sink``), sharing this engine's tokenizer, KV pool and backend."""
        if not self.loaded:
            raise EngineError("call load() first")
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
        stages = [s["tokenize"], s["prefix_hash"], s["scheduler"], s["detokenize"], *after_detokenize,
                  sink or s["sink"]]
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

    def close(self) -> None:
        """Stop the pipeline (in-flight requests finish first, up to 30 s)."""
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
        **sampling: Any,
    ) -> GenerationRequest:
        """Validate arguments and build a :class:`GenerationRequest`.

        Raises:
            InvalidRequestError: empty prompt or a bad sampling value (the message names it).
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
        return GenerationRequest(uuid.uuid4().hex, p, params, time.perf_counter_ns(), prefix_key=prefix_key,
                                 priority=priority, cache_salt=cache_salt)

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
        builder = ResultBuilder(request, time.perf_counter_ns())
        stream = await self._pipeline.submit(request)
        try:
            async with stream:
                async for delta in stream:
                    yield builder.add(delta)
        finally:
            if not builder.finished:
                self._cancel(request.request_id)

    # ------------------------------------------------------------------ introspection
    def cache_stats(self) -> dict[str, float | int]:
        """Prefix-cache and KV pool statistics: ``hit_rate``, ``queries``, ``hits``, ``cached_tokens``,
        ``blocks_total/used/free/cached``, ``evictions``, ``block_size``."""
        if not self.loaded:
            raise EngineError("call load() first")
        return self.kv_manager.stats()

    def info(self) -> dict[str, Any]:
        """Environment, model and KV-capacity facts (what ``llminfer info`` prints)."""
        import platform

        import transformers

        params = sum(p.numel() for p in self.model.parameters())
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cuda": torch.version.cuda or "none",
            "device": str(self.device),
            "model": self.cfg.model_name or "llminfer/tiny-qwen2 (built-in)",
            "model_path": self.model_path,
            "architecture": ",".join(getattr(self.model.config, "architectures", None) or
                                     [type(self.model).__name__]),
            "parameters": params,
            "dtype": str(self.dtype).replace("torch.", ""),
            "weight_bytes": weight_bytes,
            "max_model_len": self.max_model_len,
            "kv_blocks": self.kv_manager.num_blocks,
            "kv_block_size": self.kv_manager.block_size,
            "kv_tokens": self.kv_manager.capacity_tokens,
            "kv_bytes": self.kv_cache.nbytes,
            "prefix_cache": self.kv_manager.enable_prefix_cache,
        }

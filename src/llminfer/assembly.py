"""Assembly: the backend, the engine core and the default stages, built from a loaded :class:`Runtime`.

Pure construction: nothing here mutates the engine facade. The backend is built once per engine (a
compiled backend's graphs survive a pipeline restart); a core and fresh stages are built for each
pipeline. Which backend and which core a configuration gets is read from the backend registry
(:mod:`llminfer.backends.registry`); nothing here branches on the backend.
"""

from __future__ import annotations

from typing import Any

from llminfer.backends.registry import backend_spec
from llminfer.config import EngineConfig
from llminfer.core.engine_core import EngineCore
from llminfer.core.scheduler import Scheduler, SchedulerLimits
from llminfer.frontend.input import InputProcessor
from llminfer.protocols import EngineCore as EngineCoreProtocol
from llminfer.protocols import Stage
from llminfer.runtime import Runtime
from llminfer.stages.detokenize import DetokenizeStage
from llminfer.stages.prefix_hash import PrefixHashStage
from llminfer.stages.sink import StreamSink
from llminfer.stages.tokenize import TokenizeStage
from llminfer.trace import Tracer


def build_backend(rt: Runtime, cfg: EngineConfig) -> Any:
    """The step backend for ``cfg.backend``, by its registered builder (:mod:`llminfer.backends.registry`):
    eager (:class:`~llminfer.backends.hf.HFBackend`, or speculative with an assistant or prompt lookup),
    compiled, or vLLM's handle.

    Raises:
        BackendUnavailableError: the backend cannot run here (vLLM cannot start, say).
    """
    return backend_spec(cfg.backend).build(rt, cfg)


def build_core(rt: Runtime, cfg: EngineConfig, backend: Any, tracer: Tracer,
               stat_loggers: list[Any] | None = None, model_thread: Any = None) -> EngineCoreProtocol:
    """A fresh engine core over ``backend``, by the backend's registered core builder: llminfer's own
    (:func:`scheduled_core`) or :class:`~llminfer.backends.vllm.VLLMEngineCore` for vLLM's handle; both
    feed ``stat_loggers`` (:mod:`llminfer.stats`)."""
    return backend_spec(cfg.backend).build_core(rt, cfg, backend, tracer, stat_loggers, model_thread)


def scheduled_core(rt: Runtime, cfg: EngineConfig, backend: Any, tracer: Tracer,
                   stat_loggers: list[Any] | None = None, model_thread: Any = None) -> EngineCore:
    """llminfer's :class:`EngineCore`: a new scheduler on the runtime's KV pool, stepping ``backend`` on
    ``model_thread`` (a :class:`~llminfer.core.model_thread.ModelThread`, or anyio's workers when None)."""
    assert rt.kv_manager is not None, "llminfer's core schedules on the runtime's KV pool"
    limits = SchedulerLimits(
        max_batch_size=cfg.max_batch_size,
        max_num_batched_tokens=max(cfg.scheduler.max_num_batched_tokens, 1),
        max_model_len=rt.max_model_len,
        long_prefill_token_threshold=cfg.scheduler.long_prefill_token_threshold,
        watermark=cfg.scheduler.watermark,
        policy=cfg.scheduler.policy,
        num_lookahead_tokens=(cfg.speculative_num_assistant_tokens
                              if rt.draft_model is not None or cfg.speculative_method == "ngram" else 0),
    )
    return EngineCore(Scheduler(limits, rt.kv_manager, rt.eos_token_ids), backend, cfg.batch_timeout_ms, tracer,
                      stat_loggers, model_thread)


def default_stages(rt: Runtime, core: EngineCoreProtocol, tracer: Tracer) -> dict[str, Stage]:
    """Fresh built-in stages around ``core``, by name, in pipeline order: ``tokenize``, ``prefix_hash``
    (llminfer's core only: vLLM hashes its own blocks), ``core``, ``detokenize``, ``sink``.

    Raises:
        TypeError: ``core`` does not implement :class:`~llminfer.protocols.EngineCore`.
    """
    if not isinstance(core, EngineCoreProtocol):
        raise TypeError(f"{core!r} is not an EngineCore (a stage with cache_stats, scheduler_stats, describe)")
    stages: dict[str, Stage] = {
        "tokenize": TokenizeStage(InputProcessor(rt.tokenizer, rt.max_model_len, rt.vocab_size,
                                                           rt.grammar_compiler), tracer)}
    if rt.kv_manager is not None:
        stages["prefix_hash"] = PrefixHashStage(rt.kv_manager.block_size, rt.kv_manager.enable_prefix_cache)
    stages["core"] = core
    stages["detokenize"] = DetokenizeStage(rt.tokenizer, tracer)
    stages["sink"] = StreamSink(tracer)
    return stages

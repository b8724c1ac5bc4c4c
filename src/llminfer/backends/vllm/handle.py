"""llminfer's handle on a running vLLM async engine: start it, stream a request, abort, close, and what
vLLM reports (prefix-cache hits, its own metrics, the processes it started)."""

from __future__ import annotations

import atexit
import contextlib
import time
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

from llminfer.backends.vllm.engine_args import build_engine
from llminfer.backends.vllm.install import require_vllm, vllm_build
from llminfer.backends.vllm.mapping import (
    convert_logprobs,
    finish_reason,
    sampling_kwargs,
    structured_outputs_param,
)
from llminfer.config import EngineConfig
from llminfer.errors import EngineError, RequestAbortedError
from llminfer.protocols.messages import RequestDelta, TokenizedRequest
from llminfer.results import GenerationStats

# vLLM engines this process started. Each is shut down explicitly (VLLMBackend.close, called by
# InferenceEngine.close) or, failing that, at interpreter exit: left to garbage collection during teardown,
# vLLM's AsyncLLM.__del__ runs after the modules it calls are gone and prints a traceback.
_OPEN_BACKENDS: weakref.WeakSet[VLLMBackend] = weakref.WeakSet()


@atexit.register
def _close_open_backends() -> None:
    for backend in list(_OPEN_BACKENDS):
        with contextlib.suppress(Exception):
            backend.close()

class VLLMBackend:
    """llminfer's handle on a vLLM async engine.

    Args:
        client: the engine (``vllm.AsyncLLMEngine`` or anything with ``generate(prompt, sampling_params,
            request_id)`` → async iterator of ``RequestOutput`` and ``async abort(request_id)``).
        make_sampling_params: builds vLLM ``SamplingParams`` from :func:`sampling_kwargs` output (the
            backend adds ``output_kind=DELTA``).
        make_prompt: builds vLLM's prompt from a list of token ids (``TokensPrompt``).
        version: the vLLM version string (for ``engine.info()``).
    """

    name = "vllm"

    def __init__(self, client: Any, make_sampling_params: Callable[..., Any], make_prompt: Callable[[list[int]], Any],
                 version: str = "?") -> None:
        self.client = client
        self.make_sampling_params = make_sampling_params
        self.make_prompt = make_prompt
        self.version = version
        self.queries_tokens = 0
        self.hit_tokens = 0
        self.num_requests = 0
        self.num_running = 0
        self.build: dict[str, str] = {"vllm": version}
        #: the processes vLLM started for this engine (where its model and KV cache live); None: unknown
        self.worker_pids: list[int] | None = None

    @classmethod
    def from_runtime(cls, rt: Any, cfg: EngineConfig) -> VLLMBackend:
        """vLLM's engine for the model of a :class:`~llminfer.runtime.Runtime` (registered in
        :data:`llminfer.backends.registry.BACKENDS`; see :meth:`from_config`)."""
        return cls.from_config(cfg, rt.model_path, rt.max_model_len)

    @classmethod
    def from_config(cls, cfg: EngineConfig, model_path: str, max_model_len: int | None) -> VLLMBackend:
        """Start vLLM's async engine for ``cfg`` (see :func:`build_engine`).

        Raises:
            BackendUnavailableError: vLLM is not installed.
            ConfigError: a setting vLLM cannot honour.
        """
        vllm = require_vllm()
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        before = _child_pids()
        client = build_engine(cfg, model_path, max_model_len)
        started = sorted(_child_pids() - before)  # vLLM's engine-core and worker processes

        def make_params(**kw: Any) -> Any:
            fields = kw.pop("structured_outputs", None)
            if fields is not None:
                kw.update(structured_outputs_param(vllm, fields))
            return vllm.SamplingParams(**kw, output_kind=RequestOutputKind.DELTA)

        backend = cls(client, make_params, lambda ids: TokensPrompt(prompt_token_ids=ids),
                      getattr(vllm, "__version__", "?"))
        backend.build = vllm_build(vllm)
        backend.worker_pids = started
        _OPEN_BACKENDS.add(backend)
        return backend

    def close(self) -> None:
        """Shut vLLM's engine down now (its worker processes exit). Idempotent; the engine takes no requests
        after it."""
        _OPEN_BACKENDS.discard(self)
        client, self.client = self.client, None
        shutdown = getattr(client, "shutdown", None)
        if shutdown is not None:
            shutdown()
            # AsyncLLM.__del__ calls shutdown() again; at interpreter teardown (the object may live that long
            # in a reference cycle) the module functions it calls are gone and it prints a traceback
            with contextlib.suppress(Exception):
                client.shutdown = lambda *args, **kwargs: None

    async def generate(self, request: TokenizedRequest) -> AsyncIterator[RequestDelta]:
        """Stream one request's deltas as vLLM produces them.

        Raises:
            InvalidRequestError: a sampling setting vLLM cannot honour.
        """
        params = self.make_sampling_params(**sampling_kwargs(request.params))
        prompt = self.make_prompt(list(request.prompt_token_ids))
        k = request.params.logprobs or 0
        counted = False
        prompt_sent = request.params.prompt_logprobs is None
        self.num_running += 1
        try:
            async for out in self.client.generate(prompt, params, request.request_id):
                comp = out.outputs[0]
                cached = int(getattr(out, "num_cached_tokens", None) or 0)
                if not counted:
                    counted = True
                    self.num_requests += 1
                    self.queries_tokens += len(request.prompt_token_ids)
                    self.hit_tokens += cached
                ids = tuple(int(t) for t in comp.token_ids)
                reason = finish_reason(comp.finish_reason) if out.finished else None
                if out.finished and reason is None:
                    reason = "stop"
                prompt_lps: tuple = ()
                if not prompt_sent and getattr(out, "prompt_logprobs", None):
                    prompt_sent = True  # vLLM's list has None for the first prompt token
                    prompt_lps = convert_logprobs(list(request.prompt_token_ids[1:]), list(out.prompt_logprobs[1:]),
                                                  request.params.prompt_logprobs or 0)
                error = RequestAbortedError("request aborted by vLLM") if reason == "abort" else None
                if reason == "error":
                    error = EngineError(f"vLLM finished the request with {comp.finish_reason!r}")
                yield RequestDelta(
                    request_id=request.request_id, text=comp.text, token_ids=ids, finish_reason=reason, error=error,
                    time_ns=time.perf_counter_ns(),
                    logprobs=convert_logprobs(list(ids), comp.logprobs, k) if request.params.logprobs is not None else (),
                    stats=GenerationStats(0.0, 0.0, 0.0, len(request.prompt_token_ids), 0, cached > 0, cached),
                    prompt_logprobs=prompt_lps,
                )
                if out.finished:
                    return
        finally:
            self.num_running -= 1

    async def abort(self, request_id: str) -> None:
        """Abort a request inside vLLM (a no-op for an unknown or finished one)."""
        await self.client.abort(request_id)

    def cache_stats(self) -> dict[str, Any]:
        """Prefix-cache statistics from vLLM: per request, vLLM reports the prompt tokens it served from its
        prefix cache (``RequestOutput.num_cached_tokens``); ``hit_rate`` = cached / prompt tokens."""
        q = self.queries_tokens
        return {"hit_rate": self.hit_tokens / q if q else 0.0, "queries": q, "hits": self.hit_tokens,
                "cached_tokens": self.hit_tokens, "requests": self.num_requests, "source": "vllm"}

    async def reset_prefix_cache(self) -> None:
        """Ask vLLM to drop its prefix cache (where its engine has ``reset_prefix_cache``)."""
        reset = getattr(self.client, "reset_prefix_cache", None)
        if reset is not None:
            result = reset()
            if hasattr(result, "__await__"):
                await result

    def describe(self) -> dict[str, Any]:
        """Facts vLLM knows after start-up: which vLLM (version, distribution, device: see
        :func:`vllm_build`), its KV blocks when it exposes them, and its own metrics (:func:`vllm_metrics`)."""
        facts: dict[str, Any] = dict(self.build)
        metrics = vllm_metrics()
        if metrics:
            facts["vllm_metrics"] = metrics
        cache_cfg = getattr(getattr(self.client, "vllm_config", None), "cache_config", None)
        if cache_cfg is not None:
            facts["kv_blocks"] = getattr(cache_cfg, "num_gpu_blocks", None)
            facts["kv_block_size"] = getattr(cache_cfg, "block_size", None)
        return facts

def vllm_metrics() -> dict[str, float]:
    """vLLM's own Prometheus metrics of this process (its front end records them: ``vllm:num_requests_running``,
    ``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_hits``, token counters, ...), read through
    ``vllm.v1.metrics.reader.get_metrics_snapshot``: counters and gauges by name (summed over labels),
    histograms as ``<name>_count`` and ``<name>_sum``. Empty where this vLLM has no reader."""
    try:
        from vllm.v1.metrics.reader import Counter, Gauge, Histogram, get_metrics_snapshot

        snapshot = get_metrics_snapshot()
    except Exception:  # noqa: BLE001 - older vLLM, or none
        return {}
    out: dict[str, float] = {}
    for m in snapshot:
        if isinstance(m, (Counter, Gauge)):
            out[m.name] = out.get(m.name, 0.0) + float(m.value)
        elif isinstance(m, Histogram):
            out[m.name + "_count"] = out.get(m.name + "_count", 0.0) + float(m.count)
            out[m.name + "_sum"] = out.get(m.name + "_sum", 0.0) + float(m.sum)
    return out

def _child_pids() -> set[int]:
    """This process's child processes, recursively (empty without psutil)."""
    try:
        import psutil
    except ImportError:
        return set()
    return {p.pid for p in psutil.Process().children(recursive=True)}

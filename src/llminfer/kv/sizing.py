"""How many KV blocks to allocate: from an explicit count, a byte budget, a profiling run on GPU, or on CPU
enough for ``max_batch_size`` full contexts (capped at 2 GiB).

On CUDA the budget follows nano-vllm's recipe (``ModelRunner.allocate_kv_cache``): run the largest step
once on dummy tokens, then give the KV pool ``total × gpu_memory_utilization`` minus what is in use
(weights, the CUDA context, other processes) minus the step's peak activations."""

from __future__ import annotations

from typing import Any

import torch

from llminfer.backends.attention import PagedKVCache
from llminfer.config import EngineConfig
from llminfer.errors import ConfigError
from llminfer.kv.manager import cdiv

CPU_DEFAULT_KV_BYTES_CAP = 2 * 1024**3


def kv_geometry(model_config: Any) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of a transformers config (Llama, Qwen2, GPT-2, ...)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    num_layers = text.num_hidden_layers
    num_heads = text.num_attention_heads
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    return num_layers, num_kv_heads, head_dim


def gpu_kv_budget(total_bytes: int, used_bytes: int, activation_peak_bytes: int, utilization: float) -> int:
    """Bytes the KV pool may take on a GPU: ``total × utilization − used − activation peak`` (at least 0).

    Args:
        total_bytes: the device's memory (``torch.cuda.mem_get_info()[1]``).
        used_bytes: in use before the pool is allocated, by anything (``total − free``): weights, the CUDA
            context, the caching allocator's reserve, other processes.
        activation_peak_bytes: the profiling step's peak allocation above what was allocated before it.
        utilization: ``gpu_memory_utilization`` (fraction of the whole device).
    """
    return max(0, int(total_bytes * utilization) - used_bytes - activation_peak_bytes)


def profile_gpu_memory(run_step: Any, device: torch.device) -> dict[str, int]:
    """Run ``run_step()`` (the largest step, on dummy tokens) and measure memory for :func:`gpu_kv_budget`.

    Args:
        run_step: runs the step and frees what it allocated; returns the bytes of scratch it allocated
            that are not activations (its temporary KV blocks), left out of the peak.

    Returns:
        ``{"total_bytes", "used_bytes", "activation_peak_bytes"}``: total and in-use (``total − free``)
        device memory after the step, and its peak allocation above what was allocated before it.
    """
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    scratch = int(run_step() or 0)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before - scratch
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return {"total_bytes": int(total), "used_bytes": int(total - free), "activation_peak_bytes": int(max(0, peak))}


def plan_num_blocks(cfg: EngineConfig, geometry: tuple[int, int, int], block_size: int, max_model_len: int,
                    dtype: torch.dtype, device: torch.device, gpu_profile: dict[str, int] | None = None) -> int:
    """The number of KV blocks for ``cfg.cache``, in this order: ``num_blocks``; ``kv_cache_memory_bytes``
    (bytes) / bytes per block; on CUDA, :func:`gpu_kv_budget` of ``gpu_profile`` (without one: free memory
    × ``gpu_memory_utilization``); on CPU, ``max_batch_size × max_model_len`` tokens, at most
    :data:`CPU_DEFAULT_KV_BYTES_CAP` bytes.

    Args:
        geometry: ``(num_layers, num_kv_heads, head_dim)``.
        block_size: tokens per block.
        gpu_profile: :func:`profile_gpu_memory`'s measurement (CUDA).

    Raises:
        ConfigError: the budget holds no block.
    """
    cache_cfg = cfg.cache
    num_layers, num_kv_heads, head_dim = geometry
    per_block = PagedKVCache.bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
    if cache_cfg.num_blocks is not None:
        num_blocks = cache_cfg.num_blocks
    elif cache_cfg.kv_cache_memory_bytes is not None:
        num_blocks = cache_cfg.kv_cache_memory_bytes // per_block
    elif device.type == "cuda" and gpu_profile is not None:
        budget = gpu_kv_budget(gpu_profile["total_bytes"], gpu_profile["used_bytes"],
                               gpu_profile["activation_peak_bytes"], cache_cfg.gpu_memory_utilization)
        num_blocks = budget // per_block
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        num_blocks = int(free * cache_cfg.gpu_memory_utilization) // per_block
    else:
        want_tokens = cfg.max_batch_size * max_model_len
        num_blocks = min(cdiv(want_tokens, block_size) * per_block, CPU_DEFAULT_KV_BYTES_CAP) // per_block
    if num_blocks < 1:
        hint = ""
        if gpu_profile is not None and cache_cfg.num_blocks is None and cache_cfg.kv_cache_memory_bytes is None:
            hint = (f"; {gpu_profile['used_bytes']} bytes in use and a {gpu_profile['activation_peak_bytes']}-byte "
                    f"step peak leave nothing of {cache_cfg.gpu_memory_utilization} x "
                    f"{gpu_profile['total_bytes']}: raise gpu_memory_utilization or lower max_num_batched_tokens")
        raise ConfigError(f"cache: the KV budget holds no block (one block needs {per_block} bytes){hint}")
    return num_blocks

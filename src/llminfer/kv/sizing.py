"""How many KV blocks to allocate: from an explicit count, a byte budget, free GPU memory, or on CPU
enough for ``max_batch_size`` full contexts (capped at 2 GiB)."""

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


def plan_num_blocks(cfg: EngineConfig, geometry: tuple[int, int, int], block_size: int, max_model_len: int,
                    dtype: torch.dtype, device: torch.device) -> int:
    """The number of KV blocks for ``cfg.cache``, in this order: ``num_blocks``; ``kv_cache_memory_bytes``
    (bytes) / bytes per block; on CUDA, free memory × ``gpu_memory_utilization``; on CPU,
    ``max_batch_size × max_model_len`` tokens, at most :data:`CPU_DEFAULT_KV_BYTES_CAP` bytes.

    Args:
        geometry: ``(num_layers, num_kv_heads, head_dim)``.
        block_size: tokens per block.

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
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        num_blocks = int(free * cache_cfg.gpu_memory_utilization) // per_block
    else:
        want_tokens = cfg.max_batch_size * max_model_len
        num_blocks = min(cdiv(want_tokens, block_size) * per_block, CPU_DEFAULT_KV_BYTES_CAP) // per_block
    if num_blocks < 1:
        raise ConfigError(f"cache: the KV budget holds no block (one block needs {per_block} bytes)")
    return num_blocks

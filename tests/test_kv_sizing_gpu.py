"""KV sizing on GPU from a profiling run (nano-vllm's recipe), with torch.cuda's memory functions mocked:
the arithmetic, the measurement, and the error when nothing is left."""

from __future__ import annotations

import pytest
import torch

from llminfer import CacheConfig, EngineConfig
from llminfer.backends.attention import PagedKVCache
from llminfer.errors import ConfigError
from llminfer.kv import sizing

GIB = 1 << 30
GEOMETRY = (24, 2, 64)  # Qwen2-0.5B: 24 layers, 2 KV heads of 64


def test_budget_is_total_times_utilization_minus_used_minus_peak():
    assert sizing.gpu_kv_budget(80 * GIB, 3 * GIB, 2 * GIB, 0.9) == int(80 * GIB * 0.9) - 5 * GIB
    assert sizing.gpu_kv_budget(80 * GIB, 70 * GIB, 5 * GIB, 0.5) == 0


def test_plan_num_blocks_from_a_profile():
    cfg = EngineConfig(cache=CacheConfig(gpu_memory_utilization=0.9))
    profile = {"total_bytes": 141 * GIB, "used_bytes": 2 * GIB, "activation_peak_bytes": GIB}
    per_block = PagedKVCache.bytes_per_block(24, 16, 2, 64, torch.bfloat16)
    got = sizing.plan_num_blocks(cfg, GEOMETRY, 16, 4096, torch.bfloat16, torch.device("cuda"), profile)
    assert per_block == 2 * 24 * 16 * 2 * 64 * 2
    assert got == (int(141 * GIB * 0.9) - 3 * GIB) // per_block
    # An explicit budget still wins over the profile.
    cfg = EngineConfig(cache=CacheConfig(kv_cache_memory_bytes=10 * per_block))
    assert sizing.plan_num_blocks(cfg, GEOMETRY, 16, 4096, torch.bfloat16, torch.device("cuda"), profile) == 10
    cfg = EngineConfig(cache=CacheConfig(gpu_memory_utilization=0.1))
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        sizing.plan_num_blocks(cfg, GEOMETRY, 16, 4096, torch.bfloat16, torch.device("cuda"),
                               dict(profile, used_bytes=14 * GIB))


def test_profile_measures_peak_above_the_start_without_scratch(monkeypatch):
    state = {"allocated": 3 * GIB, "peak": 3 * GIB}
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device=None: state.update(peak=state["allocated"]))
    monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: state["peak"])
    monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (140 * GIB - 4 * GIB, 140 * GIB))

    def step():  # 256 MiB scratch KV + 1.5 GiB of activations at the peak, all freed again
        state["peak"] = state["allocated"] + (GIB >> 2) + 3 * GIB // 2
        return GIB >> 2

    got = sizing.profile_gpu_memory(step, torch.device("cuda"))
    assert got == {"total_bytes": 140 * GIB, "used_bytes": 4 * GIB, "activation_peak_bytes": 3 * GIB // 2}

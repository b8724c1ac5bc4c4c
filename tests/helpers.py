"""Test helpers."""

from __future__ import annotations

import time

import torch
from transformers import AutoModelForCausalLM

from llminfer import CacheConfig, EngineConfig, InferenceEngine, SchedulerConfig


def make_engine(model_dir, *, max_batch_size: int = 8, block_size: int = 4, prefix_cache: bool = True,
                max_num_batched_tokens: int = 2048, num_blocks: int | None = None, dtype: str = "float32",
                **kw) -> InferenceEngine:
    cfg = EngineConfig(
        model_name=str(model_dir),
        dtype=dtype,
        device="cpu",
        max_batch_size=max_batch_size,
        batch_timeout_ms=0,
        cache=CacheConfig(page_size_tokens=block_size, enable_prefix_cache=prefix_cache, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens),
        **kw,
    )
    return InferenceEngine(cfg).load()


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference: Hugging Face generate, greedy, fp32, each prompt alone; EOS masked like min_new_tokens."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)
            out.append(gen[0, len(p):].tolist())
    return out


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def wait_until(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()

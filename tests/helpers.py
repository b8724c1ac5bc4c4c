"""Test helpers."""

from __future__ import annotations

import time
from types import SimpleNamespace

import anyio
import torch
from transformers import AutoModelForCausalLM

from llminfer import CacheConfig, EngineConfig, InferenceEngine, SchedulerConfig

# Two tools with bounded parameters (a random-weight model fills unbounded strings and numbers until
# max_tokens), shared by the tool-calling tests.
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Sum two numbers", "parameters": ADD}}]


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


class FakeVLLM:
    """An async engine with vLLM's output shape: one token per output (DELTA mode), a token every 2 ms.

    Records the sampling parameters it was given (``seen``), the requests aborted (``aborted``) or
    cancelled mid-stream (``cancelled``) and how often its prefix cache was reset (``resets``). The
    ``fake_vllm`` fixture (conftest.py) makes ``Backend.VLLM`` engines run on one.
    """

    def __init__(self, cached: int = 0) -> None:
        self.cached = cached
        self.aborted: list[str] = []
        self.cancelled: list[str] = []
        self.seen: list[dict] = []
        self.resets = 0

    async def generate(self, prompt, params, request_id):
        self.seen.append(params)
        n = params["max_tokens"] or 8
        try:
            for i in range(n):
                await anyio.sleep(0.002)
                tok = (sum(prompt["prompt_token_ids"]) + i) % 50 + 100
                last = i == n - 1
                comp = SimpleNamespace(text=f"<{tok}>", token_ids=[tok], finish_reason="length" if last else None,
                                       logprobs=None)
                cached = min(self.cached, len(prompt["prompt_token_ids"]) - 1)
                yield SimpleNamespace(outputs=[comp], finished=last, num_cached_tokens=cached)
        except BaseException:
            self.cancelled.append(request_id)
            raise

    async def abort(self, request_id):
        self.aborted.append(request_id)

    async def reset_prefix_cache(self):
        self.resets += 1

"""Exactness: llminfer's paged, continuously batched greedy decoding equals Hugging Face generate()
token for token (fp32), for Llama, Qwen2 and GPT-2 random-weight models."""

from __future__ import annotations

import pytest

from helpers import hf_greedy, make_engine, random_prompts
from llminfer import CacheConfig, EngineConfig, InferenceEngine

LENGTHS = [1, 3, 7, 16, 33, 64, 120, 200]
NEW_TOKENS = 12
VOCAB = 151_000  # below every test model's vocab


@pytest.fixture(scope="module")
def reference(model_dirs):
    prompts = random_prompts(LENGTHS, VOCAB, seed=7)
    return prompts, {arch: hf_greedy(d, prompts, NEW_TOKENS) for arch, d in model_dirs.items()}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("max_batch_size", [3, 16])
@pytest.mark.parametrize("kernels", ["llminfer", "torch"])
def test_greedy_matches_hf_generate(model_dirs, reference, arch, max_batch_size, kernels):
    """``llminfer``: the defaults, which on an AVX2 CPU put the decode attention and the fp32 linear layers
    on llminfer's CPU kernels; ``torch``: those off (gather + masked attention, torch's GEMMs)."""
    prompts, expected = reference
    # Varied continuations, or the test could pass with broken attention (DESIGN.md).
    assert all(len(set(e)) >= 4 for e in expected[arch])
    kw = {} if kernels == "llminfer" else dict(cpu_kernels=False, attention_backend="torch")
    with make_engine(model_dirs[arch], max_batch_size=max_batch_size, block_size=4, **kw) as engine:
        from llminfer.kernels.build import skinny_linear_available

        want_backend = "cpu" if kernels == "llminfer" and skinny_linear_available() else "torch"
        assert engine.info()["attention_backend"] == want_backend
        kw = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        continuous = engine.run_batch_continuous(prompts, **kw)
        static = engine.run_batch(prompts, **kw)
        for got_c, got_s, want in zip(continuous, static, expected[arch]):
            assert list(got_c.token_ids) == want
            assert list(got_s.token_ids) == want
        assert engine.cache_stats()["blocks_used"] == 0


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_chunked_prefill_matches_hf_generate(model_dirs, reference, arch):
    """A 64-token step budget forces long prompts into chunks that attend to cached earlier chunks."""
    prompts, expected = reference
    with make_engine(model_dirs[arch], max_batch_size=4, block_size=4, max_num_batched_tokens=64) as engine:
        results = engine.run_batch_continuous(prompts, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    for got, want in zip(results, expected[arch]):
        assert list(got.token_ids) == want


def test_contiguous_layout_matches_hf_generate(model_dirs, reference):
    """enable_paged_kv=False (one region of max_model_len per sequence) gives the same tokens."""
    prompts, expected = reference
    cfg = EngineConfig(model_name=str(model_dirs["qwen2"]), dtype="float32", device="cpu", max_batch_size=4,
                       batch_timeout_ms=0, cache=CacheConfig(enable_paged_kv=False))
    with InferenceEngine(cfg).load() as engine:
        assert engine.kv_manager.block_size == engine.max_model_len
        results = engine.run_batch_continuous(prompts, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    for got, want in zip(results, expected["qwen2"]):
        assert list(got.token_ids) == want

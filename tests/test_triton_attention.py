"""The Triton paged-attention kernels, run on CPU tensors in triton's interpreter (``TRITON_INTERPRET=1``,
set in conftest before triton is imported): the KV write is bit-equal to the torch path's; decode
(split-K included) and prefill equal the torch reference within fp32 rounding (the online softmax sums in
another order, so not bit-equal); greedy output with ``attention_backend="triton"`` equals HF generate().
Shapes are tiny: the interpreter runs every program in Python."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import hf_greedy, make_engine, random_prompts
from llminfer import EngineConfig
from llminfer.backends.attention import (
    PagedKVCache,
    build_metadata,
    build_metadata_loop,
    paged_attention_forward,
)
from llminfer.backends.triton_attention import decode_splits, resolve_attention_backend, write_kv
from llminfer.errors import ConfigError

pytest.importorskip("triton")


class _Layer:
    layer_idx = 0


def _step(block_size, heads, kv_heads, head_dim, starts, lengths, seed=0, dtype=torch.float32, num_blocks=48):
    """A cache with random history, a shuffled block table per sequence and new q/k/v in HF's layout."""
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, num_blocks, block_size, kv_heads, head_dim, dtype, "cpu")
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g))
    perm = list(range(num_blocks))
    random.Random(seed).shuffle(perm)
    tables, used = [], 0
    for s, n in zip(starts, lengths):
        need = -(-(s + n) // block_size)
        tables.append(perm[used:used + need])
        used += need
    assert used <= num_blocks
    t = sum(lengths)
    q = torch.randn(1, t, heads, head_dim, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(1, t, kv_heads, head_dim, generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(1, t, kv_heads, head_dim, generator=g).to(dtype).transpose(1, 2)
    return cache, tables, q, k, v


def _both(cache, tables, q, k, v, starts, lengths, split_tokens=None):
    """(torch output, triton output, torch cache K after the step, triton cache K after the step)."""
    k0, v0 = cache.k[0].clone(), cache.v[0].clone()
    scale = q.shape[-1] ** -0.5
    meta, _ = build_metadata(cache, starts, lengths, tables, "cpu")
    ref, _ = paged_attention_forward(_Layer(), q, k, v, None, scaling=scale, llminfer_attn=meta)
    ref_k, ref_v = cache.k[0].clone(), cache.v[0].clone()
    cache.k[0].copy_(k0)
    cache.v[0].copy_(v0)
    meta, _ = build_metadata(cache, starts, lengths, tables, "cpu", attention_backend="triton",
                             decode_split_tokens=split_tokens)
    out, _ = paged_attention_forward(_Layer(), q, k, v, None, scaling=scale, llminfer_attn=meta)
    assert torch.equal(cache.k[0], ref_k) and torch.equal(cache.v[0], ref_v)  # the KV write: same bits
    return ref, out, meta


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [4, 5])
def test_decode_matches_torch(heads, kv_heads, block_size):
    """Contexts of 1, a block boundary either side, and several blocks; 16-position splits (split-K)."""
    starts = [0, block_size - 1, block_size, 2 * block_size, 37]
    starts[0] = 1  # start 0 with one token is a prefill; context 2 still fits the first block
    lengths = [1] * len(starts)
    cache, tables, q, k, v = _step(block_size, heads, kv_heads, 16, starts, lengths)
    ref, out, meta = _both(cache, tables, q, k, v, starts, lengths, split_tokens=16)
    assert meta.triton.num_splits == 3
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_decode_context_of_one_and_one_split():
    starts, lengths = [1, 2], [1, 1]
    cache, tables, q, k, v = _step(4, 4, 2, 8, starts, lengths, seed=3)  # head_dim 8: padded to a 16 tile
    ref, out, meta = _both(cache, tables, q, k, v, starts, lengths)
    assert meta.triton.num_splits == 1
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 1)])
def test_mixed_prefill_chunks_and_decode(heads, kv_heads):
    """One packed row: a fresh prompt, a chunk over a cached prefix ending on a block boundary, a decode
    token, a one-token prompt, and a chunk longer than a query tile over many blocks."""
    starts = [0, 8, 13, 0, 40]
    lengths = [7, 4, 1, 1, 70]
    cache, tables, q, k, v = _step(4, heads, kv_heads, 16, starts, lengths, seed=1)
    ref, out, meta = _both(cache, tables, q, k, v, starts, lengths)
    assert meta.triton.decode_seqs.tolist() == [2]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_bf16_within_tolerance():
    starts, lengths = [0, 21, 6], [9, 1, 3]
    cache, tables, q, k, v = _step(4, 4, 2, 16, starts, lengths, seed=2, dtype=torch.bfloat16)
    ref, out, _ = _both(cache, tables, q, k, v, starts, lengths, split_tokens=16)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_write_kv_bf16_strided_bit_equal():
    """bf16 K/V from a transposed view land bit for bit in their slots; other slots stay untouched.
    (The model's K/V are already in the cache's dtype; the interpreter's fp32->bf16 cast truncates
    instead of rounding to nearest, so casting writes are not compared here.)"""
    cache = PagedKVCache(1, 4, 4, 2, 16, torch.bfloat16, "cpu")
    key = torch.randn(2, 3, 16).to(torch.bfloat16).transpose(0, 1)  # [T, H_kv, D], non-contiguous
    value = torch.randn(3, 2, 16).to(torch.bfloat16)
    slots = torch.tensor([5, 0, 15])
    write_kv(key, value, cache.k[0], cache.v[0], slots)
    flat_k, flat_v = cache.k[0].view(2, -1, 16), cache.v[0].view(2, -1, 16)
    assert torch.equal(flat_k[:, slots], key.transpose(0, 1)) and torch.equal(flat_v[:, slots], value.transpose(0, 1))
    others = torch.ones(16, dtype=torch.bool)
    others[slots] = False
    assert not flat_k[:, others].any() and not flat_v[:, others].any()


def test_vectorised_metadata_equals_the_loop_builder():
    """The tensor-op builder gives the same slots, positions, decode blocks/masks and segments."""
    cache = PagedKVCache(1, 64, 4, 2, 8, torch.float32, "cpu")
    starts, lengths = [9, 0, 130, 4, 0, 2], [1, 6, 1, 5, 1, 1]
    tables = [[3, 7, 1], [9, 2], list(range(21, 54)), [12, 13, 14], [20], [60]]
    old, pos_old = build_metadata_loop(cache, starts, lengths, tables, "cpu")
    new, pos_new = build_metadata(cache, starts, lengths, tables, "cpu")
    assert torch.equal(pos_old, pos_new) and torch.equal(old.slot_mapping, new.slot_mapping)
    for f in ("index", "block_ids", "mask"):
        assert torch.equal(getattr(old.decode, f), getattr(new.decode, f)), f
    assert old.decode.chunk == new.decode.chunk and old.all_decode == new.all_decode
    assert len(old.prefills) == len(new.prefills)
    for a, b in zip(old.prefills, new.prefills):
        assert (a.start, a.length, a.context_start) == (b.start, b.length, b.context_start)
        for f in ("block_ids", "mask"):
            x, y = getattr(a, f), getattr(b, f)
            assert (x is None and y is None) or torch.equal(x, y)
    empty, pos = build_metadata(cache, [], [], [], "cpu", attention_backend="triton")
    assert pos.shape == (1, 0) and empty.slot_mapping.numel() == 0


@settings(max_examples=60, deadline=None)
@given(data=st.data(), backend=st.sampled_from(["cpu", "torch"]))
def test_the_all_decode_builder_gives_the_vectorised_builders_fields(data, backend):
    """A CPU step of decode tokens only takes its own builder: the same positions, slots, decode rows, block ids
    (zero past each context), masks, context lengths and chunk as the general builder."""
    from llminfer.backends import attention_metadata as am

    block = data.draw(st.sampled_from([1, 4, 16]))
    cache = PagedKVCache(1, 512, block, 2, 8, torch.float32, "cpu")
    starts = data.draw(st.lists(st.integers(1, 300), min_size=1, max_size=6))
    tables = [data.draw(st.lists(st.integers(0, 511), min_size=s // block + 1 + extra, max_size=s // block + 1 + extra))
              for s, extra in zip(starts, data.draw(st.lists(st.integers(0, 3), min_size=len(starts),
                                                              max_size=len(starts))))]
    fast, pos_fast = build_metadata(cache, starts, [1] * len(starts), tables, "cpu", backend)
    general, pos = am._build_metadata_vectorised(cache, starts, [1] * len(starts), tables, torch.device("cpu"),
                                                 backend, None)
    assert torch.equal(pos_fast, pos) and torch.equal(fast.slot_mapping, general.slot_mapping)
    assert fast.all_decode and general.all_decode and not fast.prefills and fast.triton is None
    for f in ("index", "block_ids", "mask", "ctx_lens"):
        a, b = getattr(fast.decode, f), getattr(general.decode, f)
        assert (a is None and b is None) or (torch.equal(a, b) and a.dtype == b.dtype), f
    assert fast.decode.chunk == general.decode.chunk


def test_decode_splits_bounds():
    cpu = torch.device("cpu")
    assert decode_splits(1, 1, 2, cpu) == (1, 16)
    assert decode_splits(1000, 1, 2, cpu) == (1, 1008)  # one program per (seq, head) on CPU
    num, length = decode_splits(100, 4, 2, cpu, split_tokens=20)
    assert (num, length) == (4, 32) and num * length >= 100


def test_resolve_attention_backend(monkeypatch):
    from llminfer.backends import triton_attention as ta

    cpu = torch.device("cpu")
    assert resolve_attention_backend("auto", cpu) == "torch"
    assert resolve_attention_backend("triton", cpu) == "triton"
    assert resolve_attention_backend("torch", torch.device("cuda")) == "torch"
    monkeypatch.setattr(ta, "triton_available", lambda: False)
    with pytest.raises(ConfigError, match="llminfer\\[gpu\\]"):
        resolve_attention_backend("triton", cpu)
    with pytest.raises(ConfigError, match="attention_backend"):
        EngineConfig(attention_backend="flash")


LENGTHS = [1, 5, 13]
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def reference(model_dirs):
    prompts = random_prompts(LENGTHS, 151_000, seed=11)
    return prompts, {arch: hf_greedy(model_dirs[arch], prompts, NEW_TOKENS) for arch in ("llama", "qwen2", "gpt2")}


@pytest.mark.parametrize("arch,again", [("llama", True), ("qwen2", False), ("gpt2", False)])
def test_greedy_matches_hf_generate(model_dirs, reference, arch, again):
    """Continuous batching with an 8-token step budget: chunked prompts, decode tokens next to prefill
    chunks in one step; for llama, then the longer prompts again, as prefix-cache hits (block size 4): the
    5-token prompt hits its one full block and computes a single token, which runs as a decode row."""
    prompts, expected = reference
    assert all(len(set(e)) >= 3 for e in expected[arch])
    with make_engine(model_dirs[arch], max_batch_size=4, block_size=4, max_num_batched_tokens=8,
                     attention_backend="triton") as engine:
        assert engine.info()["attention_backend"] == "triton"
        kw = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        first = engine.run_batch_continuous(prompts, **kw)
        hits = engine.cache_stats()["hits"]
        second = engine.run_batch_continuous(prompts[1:], **kw) if again else []
        assert engine.cache_stats()["hits"] == hits + 2 * again
        assert engine.cache_stats()["blocks_used"] == 0
    for got, want in zip(first, expected[arch]):
        assert list(got.token_ids) == want
    for got, want in zip(second, expected[arch][1:]):
        assert list(got.token_ids) == want

"""The decoder loop's fused ops between the products, and the attention's KV write: ``rotary_qk``
(csrc/rotary_embedding.cpp) has the bits of transformers' ``apply_rotary_pos_emb`` and ``add_rms_norm``
(csrc/rms_norm.cpp) those of an add followed by llminfer's ``rms_norm``, for decode rows and for prefill chunks large enough to be split over threads;
``kv_cache_write`` (csrc/paged_decode_attention.cpp) writes what ``index_copy_`` writes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llminfer.kernels import build

pytestmark = pytest.mark.skipif(not build.skinny_linear_available(), reason="llminfer's CPU kernel does not build here")


def _rope_inputs(batch: int, heads: int, kv_heads: int, tokens: int, head_dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    # q and k as the decoder loop makes them: [B, T, H, D] projections viewed as [B, H, T, D]
    q = torch.randn(batch, tokens, heads, head_dim, generator=gen).transpose(1, 2)
    k = torch.randn(batch, tokens, kv_heads, head_dim, generator=gen).transpose(1, 2)
    angles = torch.rand(1, tokens, head_dim // 2, generator=gen) * 300
    angles = torch.cat((angles, angles), dim=-1)
    return q, k, angles.cos(), angles.sin()


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 2), kv_heads=st.integers(1, 4), group=st.integers(1, 4), tokens=st.integers(1, 40),
       half=st.integers(1, 80), seed=st.integers(0, 2**16))
def test_rotary_qk_has_the_bits_of_transformers_rotation(batch, kv_heads, group, tokens, half, seed) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k, cos, sin = _rope_inputs(batch, kv_heads * group, kv_heads, tokens, 2 * half, seed)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = torch.ops.llminfer_cpu.rotary_qk(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert got_q.is_contiguous() and got_k.is_contiguous()


def test_rotary_qk_on_a_prefill_chunk_split_over_threads_and_per_sequence_tables() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k, cos, sin = _rope_inputs(1, 16, 4, 300, 64, seed=5)  # 16 * 300 rows: past one thread's share
    want = apply_rotary_pos_emb(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(torch.ops.llminfer_cpu.rotary_qk(q, k, cos, sin), want))
    q2, k2 = torch.cat((q, q.flip(2))), torch.cat((k, k.flip(2)))  # two sequences, a table each
    cos2, sin2 = torch.cat((cos, cos.flip(1))), torch.cat((sin, sin.flip(1)))
    want = apply_rotary_pos_emb(q2, k2, cos2, sin2)
    assert all(torch.equal(a, b) for a, b in zip(torch.ops.llminfer_cpu.rotary_qk(q2, k2, cos2, sin2), want))


def test_rotary_qk_refuses_what_it_cannot_rotate() -> None:
    q, k, cos, sin = _rope_inputs(1, 2, 1, 3, 8, seed=1)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.llminfer_cpu.rotary_qk(q.bfloat16(), k, cos, sin)
    with pytest.raises(RuntimeError, match="cos/sin shape"):
        torch.ops.llminfer_cpu.rotary_qk(q, k, cos[:, :2], sin[:, :2])
    with pytest.raises(RuntimeError, match="odd"):
        torch.ops.llminfer_cpu.rotary_qk(q[..., :7], k[..., :7], cos[..., :7], sin[..., :7])


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 3000), width=st.sampled_from([1, 7, 64, 576]), seed=st.integers(0, 2**16))
def test_add_rms_norm_has_the_bits_of_an_add_then_the_norm(rows, width, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, delta = torch.randn(1, rows, width, generator=gen), torch.randn(1, rows, width, generator=gen) * 10
    weight = torch.randn(width, generator=gen)
    total, normed = torch.ops.llminfer_cpu.add_rms_norm(x, delta, weight, 1e-6)
    want = x + delta
    assert torch.equal(total, want)
    assert torch.equal(normed, torch.ops.llminfer_cpu.rms_norm(want, weight, 1e-6))


def test_add_rms_norm_refuses_mismatched_inputs() -> None:
    with pytest.raises(RuntimeError, match="differ"):
        torch.ops.llminfer_cpu.add_rms_norm(torch.ones(2, 8), torch.ones(1, 8), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.llminfer_cpu.add_rms_norm(torch.ones(2, 8).double(), torch.ones(2, 8), torch.ones(8), 1e-6)


@settings(max_examples=20, deadline=None)
@given(kv_heads=st.integers(1, 3), blocks=st.integers(1, 6), block_size=st.sampled_from([1, 4, 16]),
       head_dim=st.sampled_from([8, 64]), cache_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       fresh_bf16=st.booleans(), data=st.data())
def test_kv_cache_write_is_index_copy(kv_heads, blocks, block_size, head_dim, cache_dtype, fresh_bf16, data) -> None:
    """The attention's KV write (``kv_cache_write``) puts the same values where two ``index_copy_`` put them,
    a float32 key rounded to a bfloat16 cache as ``Tensor.to`` rounds it."""
    slots = data.draw(st.lists(st.integers(0, blocks * block_size - 1), min_size=1, max_size=blocks * block_size,
                               unique=True))
    gen = torch.Generator().manual_seed(len(slots))
    fresh_dtype = cache_dtype if fresh_bf16 else torch.float32
    key, value = (torch.randn(1, len(slots), kv_heads, head_dim, generator=gen).transpose(1, 2).to(fresh_dtype)
                  for _ in range(2))
    caches = [torch.randn(kv_heads, blocks, block_size, head_dim, generator=gen).to(cache_dtype) for _ in range(2)]
    want = [c.clone() for c in caches]
    mapping = torch.tensor(slots)
    for cache, fresh in zip(want, (key, value)):
        cache.view(kv_heads, -1, head_dim).index_copy_(1, mapping, fresh[0].to(cache_dtype))
    torch.ops.llminfer_cpu.kv_cache_write(caches[0], caches[1], key[0], value[0], mapping)
    assert all(torch.equal(a, b) for a, b in zip(caches, want))


def test_kv_cache_write_refuses_a_slot_outside_the_pool() -> None:
    cache = torch.zeros(1, 2, 4, 8)
    fresh = torch.ones(1, 1, 8)
    with pytest.raises(RuntimeError, match="slot 8 out of range"):
        torch.ops.llminfer_cpu.kv_cache_write(cache, cache.clone(), fresh, fresh, torch.tensor([8]))
    with pytest.raises(RuntimeError, match="must be"):
        torch.ops.llminfer_cpu.kv_cache_write(cache, cache.clone(), fresh, fresh, torch.tensor([1, 2]))
    assert not cache.any()

"""The paged decode attention op (``csrc/paged_decode_attention.cpp``) against torch's path: fp32 and bf16
caches read in place, next to prefill chunks, batch invariance, and its checks of the block tables."""

from __future__ import annotations

import random

import pytest
import torch

from kernels_common import kernel_loaded, pytestmark  # noqa: F401  (the skip and the autouse fixture)
from llminfer.backends.attention import PagedKVCache, build_metadata, paged_attention_forward
from llminfer.kernels import build


def _paged_step(block_size, heads, kv_heads, head_dim, ctx_lens, seed, num_blocks=64):
    """A one-layer cache with random history and shuffled block tables; pure decode at ``ctx_lens``."""
    assert build.skinny_linear_available(), build.unavailable_reason()  # loads the ops
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, num_blocks, block_size, kv_heads, head_dim, torch.float32, "cpu")
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g))
    perm = list(range(num_blocks))
    random.Random(seed).shuffle(perm)
    tables, used = [], 0
    for n in ctx_lens:
        need = -(-n // block_size)
        tables.append(perm[used:used + need])
        used += need
    t = len(ctx_lens)
    q = torch.randn(1, t, heads, head_dim, generator=g).transpose(1, 2)
    k = torch.randn(1, t, kv_heads, head_dim, generator=g).transpose(1, 2)
    v = torch.randn(1, t, kv_heads, head_dim, generator=g).transpose(1, 2)
    return cache, tables, q, k, v


class _Layer:
    layer_idx = 0


@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("head_dim", [16, 24, 64])
def test_paged_decode_attention_matches_torch_path(heads, kv_heads, block_size, head_dim):
    """The kernel (``attention_backend="cpu"``) against the gather + masked-attention path on the same
    step: contexts of 1 token, within a block, on block edges and across many blocks; the KV write is the
    same code on both. A head_dim of 24 ends in half an AVX-512 vector."""
    ctx = [1, 3, block_size, block_size + 1, 77, 200]
    cache, tables, q, k, v = _paged_step(block_size, heads, kv_heads, head_dim, ctx, seed=block_size + heads)
    k0, v0 = cache.k[0].clone(), cache.v[0].clone()
    starts, lengths = [n - 1 for n in ctx], [1] * len(ctx)
    meta, _ = build_metadata(cache, starts, lengths, tables, "cpu", attention_backend="torch")
    ref, _ = paged_attention_forward(_Layer(), q, k, v, None, scaling=0.25, llminfer_attn=meta)
    cache.k[0].copy_(k0)
    cache.v[0].copy_(v0)
    meta, _ = build_metadata(cache, starts, lengths, tables, "cpu", attention_backend="cpu")
    assert meta.decode is not None and meta.decode.ctx_lens is not None
    out, _ = paged_attention_forward(_Layer(), q, k, v, None, scaling=0.25, llminfer_attn=meta)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [16, 24, 64])
def test_paged_decode_attention_reads_a_bf16_cache_in_place(head_dim):
    """A bf16 step (bf16 query, K/V cache in bf16): the kernel widens K/V exactly and computes in float32,
    so against a float64 reference on the same bf16 values its error is the output's one bf16 rounding;
    the torch path (bf16 gather and bf16 attention) is only close to it."""
    ctx = [1, 5, 16, 17, 77]
    cache, tables, q, k, v = _paged_step(16, 8, 2, head_dim, ctx, seed=head_dim)
    cache.k[0] = cache.k[0].bfloat16()
    cache.v[0] = cache.v[0].bfloat16()
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    starts, lengths = [n - 1 for n in ctx], [1] * len(ctx)
    k0, v0 = cache.k[0].clone(), cache.v[0].clone()
    meta, _ = build_metadata(cache, starts, lengths, tables, "cpu", attention_backend="torch")
    torch_path, _ = paged_attention_forward(_Layer(), q, k, v, None, scaling=0.25, llminfer_attn=meta)
    cache.k[0].copy_(k0)
    cache.v[0].copy_(v0)
    meta, _ = build_metadata(cache, starts, lengths, tables, "cpu", attention_backend="cpu")
    out, _ = paged_attention_forward(_Layer(), q, k, v, None, scaling=0.25, llminfer_attn=meta)
    assert out.dtype == torch.bfloat16
    for i, n in enumerate(ctx):  # the reference over the cache as written by the step (new token included)
        slots = [(tables[i][t // 16], t % 16) for t in range(n)]
        for h in range(8):
            keys = torch.stack([cache.k[0][h // 4, blk, off] for blk, off in slots]).double()
            vals = torch.stack([cache.v[0][h // 4, blk, off] for blk, off in slots]).double()
            p = torch.softmax(keys @ q[0, h, i].double() * 0.25, dim=0)
            want = p @ vals
            assert ((out[0, i, h].double() - want).abs() <= 2.0**-8 * want.abs() + 1e-5).all()
    torch.testing.assert_close(out.float(), torch_path.float(), atol=5e-2, rtol=5e-2)


def test_paged_decode_attention_next_to_prefill_chunks():
    """Decode rows and prefill chunks (one from position 0, one over a cached context) in one step: the kernel's
    path against the torch path."""
    bs, heads, kv_heads, d = 4, 8, 2, 16
    starts, lengths = [9, 0, 30, 5], [1, 6, 1, 3]
    cache, tables, q, k, v = _paged_step(bs, heads, kv_heads, d, [s + n for s, n in zip(starts, lengths)], seed=5)
    tables = [t for t in tables]
    k0, v0 = cache.k[0].clone(), cache.v[0].clone()
    q = torch.randn(1, sum(lengths), heads, d).transpose(1, 2)
    k = torch.randn(1, sum(lengths), kv_heads, d).transpose(1, 2)
    v = torch.randn(1, sum(lengths), kv_heads, d).transpose(1, 2)
    outs = []
    for backend in ("torch", "cpu"):
        cache.k[0].copy_(k0)
        cache.v[0].copy_(v0)
        meta, _ = build_metadata(cache, starts, lengths, tables, "cpu", attention_backend=backend)
        outs.append(paged_attention_forward(_Layer(), q, k, v, None, scaling=None, llminfer_attn=meta)[0])
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def test_paged_decode_attention_is_batch_invariant():
    """One sequence's output has the same bits alone and in a batch, whatever its row and the table width."""
    bs, heads, kv_heads, d = 16, 8, 2, 64
    cache, tables, q, _, _ = _paged_step(bs, heads, kv_heads, d, [300, 5, 129, 40, 1], seed=9)
    lens = torch.tensor([300, 5, 129, 40, 1])
    width = max(map(len, tables)) + 3
    table = torch.zeros(5, width, dtype=torch.long)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t)
    qd = q[0].transpose(0, 1)  # [B, H, D], strided like the engine's
    op = torch.ops.llminfer_cpu.paged_decode_attention
    batch = op(qd, cache.k[0], cache.v[0], table, lens, 0.125)
    for i in range(5):
        alone = op(qd[i : i + 1], cache.k[0], cache.v[0], table[i : i + 1, : len(tables[i])].contiguous(),
                   lens[i : i + 1], 0.125)
        assert torch.equal(alone[0], batch[i])


@pytest.mark.parametrize("scale", [0.3, 8.0])  # 8.0: scores hundreds apart, most exponentials underflow to 0
def test_a_prefill_chunks_rows_have_the_bits_of_decode_rows(scale):
    """Rows sharing one block table (stride 0, as a prefill chunk's rows run) get the bits each row gets alone as a
    decode row, and the values of a float64 causal softmax attention. A head_dim of 24 ends in half an AVX-512
    vector; 150 keys end in a partial pass of four and a partial vector."""
    bs, heads, kv_heads, d, n = 16, 6, 2, 24, 150
    cache, tables, _, _, _ = _paged_step(bs, heads, kv_heads, d, [n], seed=3)
    table, lens = torch.tensor(tables[0]), torch.arange(1, n + 1)
    q = torch.randn(n, heads, d, generator=torch.Generator().manual_seed(4))
    op = torch.ops.llminfer_cpu.paged_decode_attention
    rows = op(q, cache.k[0], cache.v[0], table.expand(n, -1), lens, scale)
    for i in (0, 1, 2, 3, 4, 5, 15, 16, 17, 63, 64, 149):
        alone = op(q[i : i + 1], cache.k[0], cache.v[0], table[: -(-(i + 1) // bs)][None], lens[i : i + 1], scale)
        assert torch.equal(alone[0], rows[i])
    k = cache.k[0][:, table].reshape(kv_heads, -1, d)[:, :n].double().repeat_interleave(heads // kv_heads, 0)
    v = cache.v[0][:, table].reshape(kv_heads, -1, d)[:, :n].double().repeat_interleave(heads // kv_heads, 0)
    scores = (q.double().transpose(0, 1) @ k.transpose(1, 2)) * scale  # [H, n, n]
    scores.masked_fill_(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    want = (scores.softmax(-1) @ v).transpose(0, 1)  # [n, H, d]
    torch.testing.assert_close(rows.double(), want, atol=2e-5, rtol=2e-5)


def test_paged_decode_attention_rejects_bad_tables():
    bs, heads, kv_heads, d = 4, 4, 2, 8
    cache, _, q, _, _ = _paged_step(bs, heads, kv_heads, d, [5], seed=1, num_blocks=8)
    op = torch.ops.llminfer_cpu.paged_decode_attention
    qd = q[0].transpose(0, 1)
    with pytest.raises(RuntimeError, match="block id"):
        op(qd, cache.k[0], cache.v[0], torch.tensor([[0, 8]]), torch.tensor([5]), 1.0)
    with pytest.raises(RuntimeError, match="context length"):
        op(qd, cache.k[0], cache.v[0], torch.tensor([[0, 1]]), torch.tensor([9]), 1.0)
    with pytest.raises(RuntimeError, match="context length"):
        op(qd, cache.k[0], cache.v[0], torch.tensor([[0, 1]]), torch.tensor([0]), 1.0)

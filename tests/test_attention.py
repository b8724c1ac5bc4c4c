"""The paged-attention kernels against torch's reference SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llminfer.backends.attention import masked_attention


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (4, 4)])
def test_decode_attention_matches_sdpa(dtype, tol, heads, kv_heads):
    torch.manual_seed(0)
    b, d, length = 6, 16, 41
    q = torch.randn(b, heads, 1, d)
    k = torch.randn(b, kv_heads, length, d)
    v = torch.randn(b, kv_heads, length, d)
    mask = (torch.arange(length)[None] < torch.randint(1, length + 1, (b,))[:, None])[:, None, None, :]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=heads != kv_heads)
    out = masked_attention(q.to(dtype), k.transpose(0, 1).to(dtype), v.transpose(0, 1).to(dtype), mask, None).float()
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_chunk_over_cached_context_matches_sdpa(dtype, tol):
    """A prefill chunk of n queries at positions start..start+n-1 over start+n keys (offset causal mask)."""
    torch.manual_seed(1)
    heads, kv_heads, d, start, n = 8, 2, 16, 23, 9
    q = torch.randn(1, heads, n, d)
    k = torch.randn(1, kv_heads, start + n, d)
    v = torch.randn(1, kv_heads, start + n, d)
    mask = (torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None])[None, None]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out = masked_attention(q.to(dtype), k.transpose(0, 1).to(dtype), v.transpose(0, 1).to(dtype), mask, None).float()
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_decode_attention_matches_sdpa(dtype):
    torch.manual_seed(2)
    b, heads, kv_heads, d, length, chunk = 5, 8, 2, 16, 384, 128
    q = torch.randn(b, heads, 1, d)
    k = torch.randn(b, kv_heads, length, d)
    v = torch.randn(b, kv_heads, length, d)
    mask = (torch.arange(length)[None] < torch.tensor([1, 100, 128, 300, 384])[:, None])[:, None, None, :]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out = masked_attention(q.to(dtype), k.transpose(0, 1).to(dtype), v.transpose(0, 1).to(dtype), mask, None,
                           chunk=chunk).float()
    tol = 1e-5 if dtype is torch.float32 else 3e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_is_batch_invariant(dtype):
    """One sequence's output has the same bits whatever the batch size, its row, and the padded length
    (a multiple of the chunk): what seeded sampling across batch compositions rests on."""
    torch.manual_seed(3)
    heads, kv_heads, d, chunk = 8, 2, 64, 128
    for real in (1, 37, 128, 129, 300, 700):
        q1 = torch.randn(heads, 1, d, dtype=dtype)
        k1 = torch.randn(kv_heads, real, d, dtype=dtype)
        v1 = torch.randn(kv_heads, real, d, dtype=dtype)
        results = []
        for batch, padded in ((1, -(-real // chunk) * chunk), (3, 1024), (32, 1024), (7, 2048)):
            row = batch // 2
            q = torch.randn(batch, heads, 1, d, dtype=dtype)
            k = torch.randn(kv_heads, batch, padded, d, dtype=dtype)
            v = torch.randn(kv_heads, batch, padded, d, dtype=dtype)
            q[row], k[:, row, :real], v[:, row, :real] = q1, k1, v1
            mask = torch.rand(batch, 1, 1, padded) < 0.8
            mask[..., 0] = True
            mask[row] = torch.arange(padded) < real
            results.append(masked_attention(q, k, v, mask, None, chunk=chunk)[row])
        for other in results[1:]:
            assert torch.equal(other, results[0]), f"context {real}: result depends on the batch"


def test_decode_metadata_pads_to_whole_chunks():
    from llminfer.backends.attention_metadata import build_metadata, decode_chunk_blocks
    from llminfer.backends.paged_kv_cache import PagedKVCache

    cache = PagedKVCache(1, 64, 16, 2, 8, torch.float32, "cpu")
    meta, positions = build_metadata(cache, [5, 130, 3], [1, 1, 4], [[7], list(range(9, 18)), [2]], "cpu")
    group = meta.decode
    assert decode_chunk_blocks(16) == 8 and group.chunk == 128
    assert group.block_ids.numel() == 2 * 16  # 131 slots need 9 blocks; padded to 2 chunks of 8
    assert group.index.tolist() == [0, 1] and not meta.all_decode
    assert group.mask.shape == (2, 1, 1, 256) and group.mask[0].sum() == 6 and group.mask[1].sum() == 131
    assert group.block_ids.view(2, 16)[1, :9].tolist() == list(range(9, 18))
    assert [(s.start, s.length, s.context_start) for s in meta.prefills] == [(2, 4, 3)]
    assert meta.prefills[0].block_ids.tolist() == [2] and meta.prefills[0].mask.shape == (1, 1, 4, 7)
    assert positions.tolist() == [[5, 130, 3, 4, 5, 6]]

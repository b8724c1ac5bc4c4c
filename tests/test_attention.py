"""The paged-attention kernels against torch's reference SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llminfer.kv.attention import masked_attention


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

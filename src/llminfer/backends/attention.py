"""Paged attention for stock transformers models, plugged in through ``transformers.AttentionInterface``.

A step runs the model on one packed row: every scheduled token of every sequence, ``[1, T]``, with
``position_ids`` ``[1, T]``. Each attention layer receives the step's :class:`PagedAttentionMetadata`
as an extra keyword argument (transformers passes unknown keyword arguments of ``model(...)`` through to
the attention function), writes the new K/V into the paged cache at ``slot_mapping``, and attends:

* decode sequences (one query token each) in one batched call over their gathered contexts, padded to
  whole 128-slot chunks (see :func:`masked_attention` for why this keeps results batch-invariant);
* each prefill chunk by itself: causal SDPA over its own keys when nothing is cached before it, otherwise
  over the gathered context with an offset causal mask.

When the step's metadata carries Triton arrays (``attention_backend="triton"``), the layer runs
:func:`llminfer.backends.triton_attention.triton_attention` instead, which reads K/V in place. With
``attention_backend="cpu"`` (fp32 or bf16 on CPU where llminfer's kernel is built, see
:mod:`llminfer.kernels.build`) the decode sequences run ``torch.ops.llminfer_cpu.paged_decode_attention``,
which also reads K/V in place from the block pool, and so do the prefill chunks' rows, each over its own
causal context: a prompt row then gets the same bits whether it was prefilled whole, in chunks, or after a
prefix-cache hit (SDPA's and the masked path's row results depend on how many query rows share the call).

The layout follows vLLM's paged attention (Kwon et al. 2023, "Efficient Memory Management for Large
Language Model Serving with PagedAttention"); the gather-then-SDPA kernel is ours, written for CPU and
for any device where no custom kernel is available.

The step's metadata and its builders are :mod:`llminfer.backends.attention_metadata`'s, the KV tensors
:mod:`llminfer.backends.paged_kv_cache`'s; both are re-exported here under their old import path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llminfer.backends.attention_metadata import (
    DECODE_CHUNK_SLOTS,
    DecodeBatch,
    PagedAttentionMetadata,
    PrefillSegment,
    build_metadata,
    build_metadata_loop,
    decode_chunk_blocks,
)
from llminfer.backends.paged_kv_cache import PagedKVCache
from llminfer.kernels.build import kernels_loaded

__all__ = ["ATTN_IMPLEMENTATION", "DECODE_CHUNK_SLOTS", "METADATA_KWARG", "DecodeBatch", "PagedAttentionMetadata",
           "PagedKVCache", "PrefillSegment", "build_metadata", "build_metadata_loop", "cpu_decode_attention",
           "decode_attention",
           "decode_chunk_blocks", "masked_attention", "paged_attention_forward", "register_paged_attention"]

ATTN_IMPLEMENTATION = "llminfer_paged"
METADATA_KWARG = "llminfer_attn"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The attention function registered as ``"llminfer_paged"``.

    Args:
        module: the attention module (``module.layer_idx`` selects the cache layer).
        query: ``[1, H, T, D]``.
        key, value: ``[1, H_kv, T, D]`` for the new tokens only.
        kwargs: must hold ``llminfer_attn``, the step's :class:`PagedAttentionMetadata`.

    Returns:
        ``([1, T, H, D], None)`` like transformers' own attention functions.

    Raises:
        RuntimeError: called without metadata (the model was run outside an llminfer step).
    """
    meta: PagedAttentionMetadata | None = kwargs.get(METADATA_KWARG)
    if meta is None:
        raise RuntimeError("llminfer paged attention called without step metadata")
    layer = module.layer_idx
    if (decoded := cpu_decode_attention(layer, query, key, value, meta, scaling)) is not None:
        return decoded, None
    k_cache = meta.cache.k[layer]
    v_cache = meta.cache.v[layer]
    if meta.triton is not None:
        from llminfer.backends.triton_attention import triton_attention

        return triton_attention(query, key, value, k_cache, v_cache, meta.slot_mapping, meta.triton, scaling), None
    num_kv_heads, num_blocks, block_size, head_dim = k_cache.shape
    if (key.dtype in (torch.float32, k_cache.dtype) and value.dtype == key.dtype and key.is_cpu and kernels_loaded()
            and not torch.compiler.is_compiling()):
        # the same copies in one op (csrc/paged_decode_attention.cpp)
        torch.ops.llminfer_cpu.kv_cache_write(k_cache, v_cache, key[0], value[0], meta.slot_mapping)
    else:
        flat_k = k_cache.view(num_kv_heads, -1, head_dim)  # [H_kv, slots, D]
        flat_v = v_cache.view(num_kv_heads, -1, head_dim)
        flat_k.index_copy_(1, meta.slot_mapping, key[0].to(flat_k.dtype))  # key[0]: [H_kv, T, D]
        flat_v.index_copy_(1, meta.slot_mapping, value[0].to(flat_v.dtype))
    # Whole blocks as rows: index_select copies block_size * head_dim contiguous elements per (head, block),
    # where advanced indexing slot by slot would copy head_dim at a time.
    block_k = k_cache.view(num_kv_heads, num_blocks, block_size * head_dim)
    block_v = v_cache.view(num_kv_heads, num_blocks, block_size * head_dim)

    def gather(block_ids: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (num_kv_heads, rows, -1, head_dim)
        return (block_k.index_select(1, block_ids).view(shape).to(query.dtype),
                block_v.index_select(1, block_ids).view(shape).to(query.dtype))

    q = query[0]  # [H, T, D]
    num_heads, num_tokens = q.shape[0], q.shape[1]
    gqa = num_heads != num_kv_heads
    group = meta.decode
    # an all-decode step's output is the decode attention's own
    out = q.new_empty(num_tokens, num_heads, head_dim) if group is None or not meta.all_decode else q
    kernel_rows = q.dtype in (torch.float32, torch.bfloat16) and k_cache.dtype == q.dtype and head_dim % 8 == 0
    if group is not None and group.ctx_lens is not None and kernel_rows:
        qd = q.transpose(0, 1) if meta.all_decode else q.index_select(1, group.index).transpose(0, 1)  # [b, H, D]
        # float32 math for bf16 too: the kernel widens the bf16 K/V as it reads them
        od = torch.ops.llminfer_cpu.paged_decode_attention(
            qd.float(), k_cache, v_cache, group.block_ids.view(len(group.index), -1), group.ctx_lens,
            scaling if scaling is not None else head_dim**-0.5).to(q.dtype)
        if meta.all_decode:
            out = od
        else:
            out.index_copy_(0, group.index, od)
    elif group is not None:
        qd = q.index_select(1, group.index).transpose(0, 1).unsqueeze(2)  # [b, H, 1, D]
        kd, vd = gather(group.block_ids, len(group.index))  # [H_kv, b, n * block_size, D]
        od = masked_attention(qd, kd, vd, group.mask, scaling, chunk=group.chunk)[:, :, 0, :]  # [b, H, D]
        if meta.all_decode:
            out = od
        else:
            out.index_copy_(0, group.index, od)

    for seg in meta.prefills:
        if seg.ctx_lens is not None and kernel_rows:
            # Each row on the decode kernel over its own causal context: the bits a decode step at that position
            # gets, whatever the chunking or the prefix-cache hit (SDPA's and masked_attention's row results
            # depend on the number of query rows).
            assert seg.block_ids is not None
            qs = q[:, seg.start : seg.start + seg.length].transpose(0, 1)  # [n, H, D]
            out[seg.start : seg.start + seg.length] = torch.ops.llminfer_cpu.paged_decode_attention(
                qs.float(), k_cache, v_cache, seg.block_ids.expand(seg.length, -1), seg.ctx_lens,
                scaling if scaling is not None else head_dim**-0.5).to(q.dtype)
            continue
        qs = q[:, seg.start : seg.start + seg.length].unsqueeze(0)  # [1, H, n, D]
        if seg.context_start == 0:
            ks = key[:, :, seg.start : seg.start + seg.length]
            vs = value[:, :, seg.start : seg.start + seg.length]
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=seg.length > 1, scale=scaling, enable_gqa=gqa)
        else:
            ctx = seg.context_start + seg.length
            ks, vs = gather(seg.block_ids, 1)  # [H_kv, 1, blocks * block_size, D]
            o = masked_attention(qs, ks[:, :, :ctx], vs[:, :, :ctx], seg.mask, scaling)
        out[seg.start : seg.start + seg.length] = o[0].transpose(0, 1)

    return out.unsqueeze(0), None


def cpu_decode_attention(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         meta: PagedAttentionMetadata, scaling: float | None) -> torch.Tensor | None:
    """:func:`paged_attention_forward`'s output for an all-decode float32 CPU step on llminfer's kernels, without
    its general path: the step's K/V written (``kv_cache_write``), then ``paged_decode_attention``. The decoder
    loop calls it directly (tens of microseconds of Python a layer less at batch 1).

    Args:
        layer: the cache layer.
        query: ``[1, H, B, D]`` float32, one token per sequence; key, value: ``[1, H_kv, B, D]``.
        meta: the step's metadata.
        scaling: the softmax scale (None: ``D ** -0.5``).

    Returns:
        ``[1, B, H, D]`` float32, or None where the step is not such a step (the caller takes the general path).
    """
    group = meta.decode
    if (not meta.all_decode or group is None or group.ctx_lens is None or meta.triton is not None
            or query.dtype != torch.float32 or key.dtype != torch.float32 or value.dtype != torch.float32
            or not query.is_cpu or not kernels_loaded() or torch.compiler.is_compiling()):
        return None
    k_cache, v_cache = meta.cache.k[layer], meta.cache.v[layer]
    head_dim = k_cache.shape[-1]
    if k_cache.dtype != torch.float32 or head_dim % 8:
        return None
    torch.ops.llminfer_cpu.kv_cache_write(k_cache, v_cache, key[0], value[0], meta.slot_mapping)
    out = torch.ops.llminfer_cpu.paged_decode_attention(
        query[0].transpose(0, 1), k_cache, v_cache, group.block_ids.view(len(group.index), -1), group.ctx_lens,
        scaling if scaling is not None else head_dim**-0.5)
    return out.unsqueeze(0)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float | None, chunk: int | None = None) -> torch.Tensor:
    """Attention of ``n`` query tokens per sequence over a padded context, with an explicit mask.

    Args:
        q: ``[B, H, n, D]``.
        k, v: head-major ``[H_kv, B, L, D]`` (as gathered from :class:`PagedKVCache`).
        mask: bool, broadcastable to ``[B, 1, n, L]`` (True = attend); every row attends somewhere.
        scale: the softmax scale (default ``D ** -0.5``).
        chunk: if it divides ``L``, the weighted sum over V is taken ``chunk`` slots at a time and the
            partial sums are added in order, in float32.

    Returns:
        ``[B, H, n, D]``.

    On CPU, for short queries (``n <= 128``), grouped matmuls with an fp32 softmax are used: in bf16 they are
    faster than ``scaled_dot_product_attention`` with a mask, whose CPU kernel materialises the masked
    scores per head. Elsewhere (CUDA, long queries) SDPA is used.

    Batch invariance (CPU path with ``chunk``): a row's result has the same bits whatever the number of
    rows ``B`` and whatever the padded length ``L`` (a multiple of ``chunk``) -- a single matmul over ``L``
    would block its reduction differently for different ``L``, and SDPA's CPU kernel differs in the last
    bits with ``B``. Padding adds exact zeros after a row's real partial sums, so the sum is unchanged.
    This is what lets a seeded request sample the same tokens whatever shares its batch
    (``tests/test_attention.py`` checks the bits; ``tests/test_sampling.py`` the tokens).
    """
    batch, num_heads, n, head_dim = q.shape
    num_kv_heads, length = k.shape[0], k.shape[2]
    if q.device.type != "cpu" or n > 128:
        return F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                              scale=scale, enable_gqa=num_heads != num_kv_heads)
    group = num_heads // num_kv_heads
    # [B, H, n, D] -> [H_kv, B, G*n, D]: query heads h = kv * G + g share K/V head kv (HF's repeat_kv order).
    qh = q.reshape(batch, num_kv_heads, group * n, head_dim).transpose(0, 1)
    scores = torch.matmul(qh, k.transpose(-1, -2)).float().view(num_kv_heads, batch, group, n, length)
    scores = scores * (scale if scale is not None else head_dim**-0.5)
    scores.masked_fill_(~mask.reshape(1, mask.shape[0], 1, n, length), float("-inf"))
    probs = scores.softmax(dim=-1).to(q.dtype).view(num_kv_heads, batch, group * n, length)
    if chunk is None or length % chunk or length == chunk:
        out = torch.matmul(probs, v)  # [H_kv, B, G*n, D]
    else:
        num_chunks = length // chunk
        parts = torch.matmul(probs.view(num_kv_heads, batch, group * n, num_chunks, chunk).transpose(2, 3),
                             v.view(num_kv_heads, batch, num_chunks, chunk, head_dim))  # [H_kv, B, C, G*n, D]
        acc = parts[:, :, 0].float()
        for c in range(1, num_chunks):
            acc += parts[:, :, c]
        out = acc.to(q.dtype)
    return out.transpose(0, 1).reshape(batch, num_heads, n, head_dim)


decode_attention = masked_attention


def register_paged_attention() -> str:
    """Register :func:`paged_attention_forward` with transformers (idempotent); return its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION

"""Triton kernels of :mod:`llminfer.backends.triton_attention` (imported only when triton is used).

The KV pool per layer is ``[H_kv, num_blocks, block_size, D]`` (see
:class:`~llminfer.backends.attention.PagedKVCache`): slot ``s`` of KV head ``h`` starts at element
``h * stride_h + s * stride_slot``. Every kernel finds a key's slot through the block table
(``table[pos // block_size] * block_size + pos % block_size``), so any block size works, powers of two or
not, and no context is ever gathered into a new tensor.

The math is FlashAttention's online softmax (Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient
Exact Attention with IO-Awareness"), with the decode split over the context ("flash-decoding": Dao et al.
2023, partial results per split reduced by a second kernel, as in vLLM's paged attention v2). All
accumulation is float32; results are stored in the query's dtype. ``DOT_FP32`` upcasts half-precision tiles
before ``tl.dot``: triton's interpreter computes half-precision dots wrongly (bf16 bits taken as integers, as
of triton 3.9), so CPU runs set it; CUDA runs keep half inputs for the tensor cores.

On CPU tensors the kernels run only in triton's interpreter, which ``TRITON_INTERPRET=1`` selects: triton
reads it when it decorates functions, its own ``triton.language`` helpers included, so it must be set
before triton is first imported (``tests/conftest.py`` does).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def _store_kv(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
              stride_kt, stride_kh, stride_vt, stride_vh, stride_ch, stride_cslot,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program ``(t, h)``: copy token ``t``'s K and V of KV head ``h`` into slot ``slot[t]`` (a negative slot,
    a CUDA-graph padding row, writes nothing)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        k = tl.load(key_ptr + t * stride_kt + h * stride_kh + offs_d, mask=dmask)
        v = tl.load(value_ptr + t * stride_vt + h * stride_vh + offs_d, mask=dmask)
        dst = h.to(tl.int64) * stride_ch + slot * stride_cslot + offs_d
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=dmask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=dmask)


def _decode_split(q_ptr, k_cache_ptr, v_cache_ptr, seq_ptr, q_row_ptr, ctx_len_ptr, table_ptr,
                  acc_ptr, ml_ptr, scale,
                  stride_qt, stride_qh, stride_ch, stride_cslot, stride_table,
                  stride_acc_b, stride_acc_h, stride_acc_s, stride_ml_b, stride_ml_h, stride_ml_s,
                  GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_LEN: tl.constexpr,
                  PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """Program ``(b, kv_head, split)``: the ``GROUP`` query heads sharing ``kv_head`` of decode sequence
    ``b`` over context positions ``[split * SPLIT_LEN, (split + 1) * SPLIT_LEN)``. Writes the unnormalised
    float32 output ``acc`` ``[BLOCK_G, D]``, the running max ``m`` and the sum of exponentials ``l``
    (base 2) of this split; an empty split writes ``m = -inf, l = 0``."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(seq_ptr + b)
    row = tl.load(q_row_ptr + b)
    ctx = tl.load(ctx_len_ptr + seq)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    gmask = offs_g < GROUP
    dmask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    qk_scale = scale * 1.4426950408889634
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    lo = split * SPLIT_LEN
    hi = tl.minimum(lo + SPLIT_LEN, ctx)
    head_base = kvh.to(tl.int64) * stride_ch
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        nmask = pos < hi
        blk = tl.load(table_ptr + seq * stride_table + pos // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
        slot = blk * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_off = head_base + slot[:, None] * stride_cslot + offs_d[None, :]
        kvmask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kvmask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kvmask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * qk_scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        m_i = m_new
    acc_off = b * stride_acc_b + heads[:, None] * stride_acc_h + split * stride_acc_s + offs_d[None, :]
    tl.store(acc_ptr + acc_off, acc, mask=gmask[:, None] & dmask[None, :])
    ml_off = b * stride_ml_b + heads * stride_ml_h + split * stride_ml_s
    tl.store(ml_ptr + ml_off, m_i, mask=gmask)
    tl.store(ml_ptr + ml_off + 1, l_i, mask=gmask)


def _decode_reduce(acc_ptr, ml_ptr, out_ptr, q_row_ptr,
                   stride_acc_b, stride_acc_h, stride_acc_s, stride_ml_b, stride_ml_h, stride_ml_s,
                   stride_ot, stride_oh,
                   NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program ``(b, head)``: combine the splits' partial results (log-sum-exp rescaling) into the output
    row of decode sequence ``b``, in split order."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(q_row_ptr + b)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    ml_base = ml_ptr + b * stride_ml_b + h * stride_ml_h
    m_max = tl.load(ml_base)  # split 0 always holds context position 0
    for s in tl.static_range(1, NUM_SPLITS):
        m_max = tl.maximum(m_max, tl.load(ml_base + s * stride_ml_s))
    total = tl.zeros([BLOCK_D], tl.float32)
    denom = tl.zeros([1], tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        m_s = tl.load(ml_base + s * stride_ml_s)
        l_s = tl.load(ml_base + s * stride_ml_s + 1)
        w = tl.where(l_s > 0, tl.exp2(m_s - m_max), 0.0)
        part = tl.load(acc_ptr + b * stride_acc_b + h * stride_acc_h + s * stride_acc_s + offs_d, mask=dmask,
                       other=0.0)
        total += part * w
        denom += l_s * w
    o = total / denom
    tl.store(out_ptr + row * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=dmask)


def _prefill(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, seq_ptr, q_start_ptr, q_len_ptr, ctx_start_ptr, table_ptr,
             scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_ch, stride_cslot, stride_table,
             GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """Program ``(p, head, m)``: queries ``[m * BLOCK_M, (m + 1) * BLOCK_M)`` of prefill sequence ``p``
    (packed rows from ``q_start``, positions from ``ctx_start``) over the cached prefix and the chunk
    itself (already written to the cache), causal."""
    p = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    seq = tl.load(seq_ptr + p)
    q_len = tl.load(q_len_ptr + seq)
    if mb * BLOCK_M < q_len:
        q_start = tl.load(q_start_ptr + seq)
        ctx_start = tl.load(ctx_start_ptr + seq)
        kvh = h // GROUP
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        mmask = offs_m < q_len
        dmask = offs_d < HEAD_DIM
        q_pos = ctx_start + offs_m
        q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                    mask=mmask[:, None] & dmask[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        qk_scale = scale * 1.4426950408889634
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # Keys up to the last query of this tile (causal), which never exceeds the context.
        hi = ctx_start + tl.minimum((mb + 1) * BLOCK_M, q_len)
        head_base = kvh.to(tl.int64) * stride_ch
        for start in range(0, hi, BLOCK_N):
            pos = start + offs_n
            nmask = pos < hi
            blk = tl.load(table_ptr + seq * stride_table + pos // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
            slot = blk * BLOCK_SIZE + pos % BLOCK_SIZE
            kv_off = head_base + slot[:, None] * stride_cslot + offs_d[None, :]
            kvmask = nmask[:, None] & dmask[None, :]
            k = tl.load(k_cache_ptr + kv_off, mask=kvmask, other=0.0)
            v = tl.load(v_cache_ptr + kv_off, mask=kvmask, other=0.0)
            if DOT_FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * qk_scale  # [BLOCK_M, BLOCK_N]
            allowed = (pos[None, :] <= q_pos[:, None]) & nmask[None, :]
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # Rows past q_len see no key at all: keep them finite (they are never stored).
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_new)
            pr = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(pr, 1)
            acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
            m_i = m_new
        l_i = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_i[:, None]
        tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


_SOURCES = {"store_kv": _store_kv, "decode_split": _decode_split, "decode_reduce": _decode_reduce,
            "prefill": _prefill}
KERNELS = {name: triton.jit(fn) for name, fn in _SOURCES.items()}


def interpreted() -> bool:
    """Whether triton was imported under ``TRITON_INTERPRET=1`` (so the kernels can run on CPU tensors)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)

"""Paged attention with Triton kernels that read K/V in place through the block table.

The torch path (:func:`llminfer.backends.attention.paged_attention_forward`) gathers every sequence's whole
context out of the block pool into a new tensor per layer and runs masked attention on it; these kernels
instead load each key and value once, straight from its block, and never materialise a context:

* :func:`write_kv`: the new tokens' K/V into their slots (one program per token and KV head);
* :func:`paged_decode`: one query token per sequence; a program handles the ``H / H_kv`` query heads that
  share a KV head (GQA: each K/V tile is loaded once for the whole group) over one split of the context;
  a second kernel reduces the splits (split-K, "flash-decoding"), so a long context at a small batch
  still fills the GPU;
* :func:`paged_prefill`: prefill and chunked-prefill queries, variable lengths packed in one row, each
  attending causally to its cached prefix and to itself.

Triton is imported only when these functions are first called (``pip install 'llminfer[gpu]'``). CUDA
tensors run the compiled kernels; CPU tensors run the same kernels in triton's interpreter (with
``TRITON_INTERPRET=1`` set before triton is imported): slow, but it lets CI check the kernels' results on
machines without a GPU.
Source of the algorithms: see :mod:`llminfer.backends._triton_kernels`.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import torch

#: Key/value positions per inner-loop tile, and query rows per prefill program.
BLOCK_N = 64
BLOCK_M = 64
#: A decode split covers at least this many context positions (fewer splits cost less to reduce).
DECODE_SPLIT_MIN_TOKENS = 256
MAX_DECODE_SPLITS = 16


@functools.cache
def triton_available() -> bool:
    """Whether triton imports here (it is the optional ``gpu`` extra)."""
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install counts as absent
        return False
    return True


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """The attention kernels to use: ``"triton"`` or ``"torch"``.

    ``"auto"`` is Triton on CUDA when triton imports, the torch path elsewhere (on CPU Triton would only run
    in its interpreter). ``"triton"`` on CPU runs the kernels in the interpreter (for tests).

    Raises:
        ConfigError: ``"triton"`` asked for but triton does not import, or on CPU without the interpreter.
    """
    from llminfer.errors import ConfigError

    if name == "torch":
        return "torch"
    if name == "triton":
        if not triton_available():
            raise ConfigError("attention_backend='triton' needs triton: pip install 'llminfer[gpu]'")
        if device.type != "cuda":
            from llminfer.backends._triton_kernels import interpreted

            if not interpreted():
                raise ConfigError("attention_backend='triton' on CPU runs in triton's interpreter only: set "
                                  "TRITON_INTERPRET=1 before starting (slow; meant for tests), or use 'torch'")
        return "triton"
    return "triton" if device.type == "cuda" and triton_available() else "torch"


def _kernels(device: torch.device) -> dict[str, Any]:
    """The jitted kernels.

    Raises:
        RuntimeError: CPU tensors, but triton was not imported under ``TRITON_INTERPRET=1``.
    """
    from llminfer.backends._triton_kernels import KERNELS, interpreted

    if device.type != "cuda" and not interpreted():
        raise RuntimeError("the Triton attention kernels run on CPU tensors only in triton's interpreter: set "
                           "TRITON_INTERPRET=1 before triton is imported, or use attention_backend='torch'")
    return KERNELS


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << max(0, (int(n) - 1).bit_length()))


def _precision(dtype: torch.dtype) -> str:
    # fp32 stays fp32 (exactness against HF in float32); half inputs ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_splits(max_context: int, num_decode: int, num_kv_heads: int, device: torch.device,
                  split_tokens: int | None = None) -> tuple[int, int]:
    """``(num_splits, split_len)`` for a decode batch: enough programs to fill the GPU (two per SM) but no
    split shorter than :data:`DECODE_SPLIT_MIN_TOKENS` positions; ``split_len`` is a multiple of 16.

    Args:
        max_context: the longest context in the batch (tokens); with CUDA graphs, the longest possible.
        num_decode: decode sequences in the batch.
        split_tokens: force this split length (rounded up to a multiple of 16; tests).
    """
    max_context = max(1, max_context)
    if split_tokens is None:
        want = 1
        if device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            want = -(-2 * sms // max(1, num_decode * num_kv_heads))
        num = max(1, min(want, MAX_DECODE_SPLITS, -(-max_context // DECODE_SPLIT_MIN_TOKENS)))
        split_tokens = -(-max_context // num)
    split_len = -(-split_tokens // 16) * 16
    return -(-max_context // split_len), split_len


def _decode_tile(split_len: int) -> int:
    """Key positions per decode tile: the largest power of two up to :data:`BLOCK_N` and ``split_len``."""
    return min(BLOCK_N, 1 << (split_len.bit_length() - 1))


@attrs.define
class TritonStepMetadata:
    """Per-sequence step arrays for the kernels (all ``int64`` on the model's device).

    Attributes:
        q_start: ``[S]`` packed-row index of each sequence's first new token.
        q_len: ``[S]`` new tokens per sequence.
        ctx_start: ``[S]`` tokens already cached before the new ones (the first new token's position).
        ctx_len: ``[S]`` ``ctx_start + q_len``.
        block_tables: ``[S, W]`` block ids, padded with 0.
        decode_seqs: ``[b]`` indices of the decode sequences (one new token each); decode_rows: ``[b]``
            their packed-row indices.
        prefill_seqs: ``[p]`` indices of the other sequences.
        max_prefill_len: the longest prefill chunk (host int, sizes the grid).
        num_splits, split_len: the decode split (host ints, see :func:`decode_splits`).
    """

    q_start: torch.Tensor
    q_len: torch.Tensor
    ctx_start: torch.Tensor
    ctx_len: torch.Tensor
    block_tables: torch.Tensor
    decode_seqs: torch.Tensor
    decode_rows: torch.Tensor
    prefill_seqs: torch.Tensor
    max_prefill_len: int
    num_splits: int
    split_len: int


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V into their slots of one layer's cache (in the cache's dtype).

    Args:
        key, value: ``[T, H_kv, D]`` (any strides with a contiguous last dimension).
        k_cache, v_cache: ``[H_kv, num_blocks, block_size, D]`` contiguous.
        slot_mapping: ``[T]`` int64 flat slots (``block_id * block_size + offset``).
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key, value = _last_contiguous(key), _last_contiguous(value)
    _kernels(key.device)["store_kv"][(num_tokens, num_kv_heads)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), k_cache.stride(0), k_cache.stride(2),
        HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim, 1))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                 meta: TritonStepMetadata, scale: float) -> None:
    """Attention of the decode rows of ``q`` over their whole cached contexts, into ``out``.

    Args:
        q: ``[T, H, D]`` queries of the packed row (contiguous last dimension).
        k_cache, v_cache: ``[H_kv, num_blocks, block_size, D]`` with this step's K/V already written.
        out: ``[T, H, D]``; only the rows ``meta.decode_rows`` are written.
        scale: softmax scale.
    """
    num_decode = meta.decode_seqs.numel()
    if num_decode == 0:
        return
    _, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    splits = meta.num_splits
    acc = torch.empty(num_decode, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    ml = torch.empty(num_decode, num_heads, splits, 2, dtype=torch.float32, device=q.device)
    kernels = _kernels(q.device)
    block_d = _pow2(head_dim)
    kernels["decode_split"][(num_decode, num_kv_heads, splits)](
        q, k_cache, v_cache, meta.decode_seqs, meta.decode_rows, meta.ctx_len, meta.block_tables, acc, ml, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(2), meta.block_tables.stride(0),
        acc.stride(0), acc.stride(1), acc.stride(2), ml.stride(0), ml.stride(1), ml.stride(2),
        GROUP=group, BLOCK_G=_pow2(group), HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size,
        BLOCK_N=_decode_tile(meta.split_len), SPLIT_LEN=meta.split_len, PRECISION=_precision(q.dtype),
        DOT_FP32=q.device.type != "cuda")
    kernels["decode_reduce"][(num_decode, num_heads)](
        acc, ml, out, meta.decode_rows,
        acc.stride(0), acc.stride(1), acc.stride(2), ml.stride(0), ml.stride(1), ml.stride(2),
        out.stride(0), out.stride(1),
        NUM_SPLITS=splits, HEAD_DIM=head_dim, BLOCK_D=block_d)


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                  meta: TritonStepMetadata, scale: float) -> None:
    """Causal attention of the prefill chunks of ``q`` over their cached prefixes and themselves.

    Shapes as :func:`paged_decode`; only the rows of ``meta.prefill_seqs`` are written.
    """
    num_prefill = meta.prefill_seqs.numel()
    if num_prefill == 0:
        return
    _, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    grid = (num_prefill, num_heads, -(-meta.max_prefill_len // BLOCK_M))
    _kernels(q.device)["prefill"][grid](
        q, k_cache, v_cache, out, meta.prefill_seqs, meta.q_start, meta.q_len, meta.ctx_start, meta.block_tables,
        scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(2),
        meta.block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim), BLOCK_SIZE=block_size,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, PRECISION=_precision(q.dtype), DOT_FP32=q.device.type != "cuda",
        # fp32 tiles of 64 x 128 in three pipeline stages would need ~224 KiB of shared memory: use two.
        **({"num_stages": 2} if q.is_cuda and q.dtype == torch.float32 else {}))


def triton_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot_mapping: torch.Tensor, meta: TritonStepMetadata,
                     scale: float | None) -> torch.Tensor:
    """One layer's paged attention for a step: write the new K/V, then decode and prefill in place.

    Args:
        query: ``[1, H, T, D]``; key, value: ``[1, H_kv, T, D]`` (transformers' layout).
        scale: softmax scale (None: ``D ** -0.5``).

    Returns:
        ``[1, T, H, D]`` in the query's dtype.
    """
    q = _last_contiguous(query[0].transpose(0, 1))  # [T, H, D]
    write_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), k_cache, v_cache, slot_mapping)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    scale = float(scale) if scale is not None else q.shape[-1] ** -0.5
    paged_decode(q, k_cache, v_cache, out, meta, scale)
    paged_prefill(q, k_cache, v_cache, out, meta, scale)
    return out.unsqueeze(0)


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()

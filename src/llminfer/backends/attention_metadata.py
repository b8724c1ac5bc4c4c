"""The step's paged-attention metadata (:class:`PagedAttentionMetadata`) and its builders.

A step runs every scheduled token of every sequence in one packed row; :func:`build_metadata` turns the
per-sequence positions, lengths and block tables into what the attention layers read: each new token's KV
slot, the decode sequences (one query token each, attended in one batched call over their gathered
contexts, padded to whole :data:`DECODE_CHUNK_SLOTS`-slot chunks) and the prefill segments (each with its
own mask), or the Triton kernels' arrays. :func:`build_metadata_loop` is the per-token Python builder it
replaced, kept as its reference in tests.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np
import torch

if TYPE_CHECKING:
    from llminfer.backends.paged_kv_cache import PagedKVCache
    from llminfer.backends.triton_attention import TritonStepMetadata


@attrs.define
class PrefillSegment:
    """A prefill chunk inside the packed row: queries ``[start, start+length)`` at positions
    ``[context_start, context_start+length)``.

    ``block_ids`` (``[ceil(context_len / block_size)]`` int64) and ``mask`` (``[1, 1, length, context_len]``
    bool) are None when the chunk starts at position 0 and attends only to itself. With
    ``attention_backend="cpu"``, ``ctx_lens`` (``[length]`` int64, ``context_start + 1 ...``) and ``block_ids``
    are set for every chunk: its rows then run on the CPU decode kernel, each over its own causal context,
    so that a row's result does not depend on how the prompt was split into chunks or how much of it a
    prefix-cache hit supplied (see :func:`llminfer.backends.attention.paged_attention_forward`)."""

    start: int
    length: int
    context_start: int
    block_ids: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    ctx_lens: torch.Tensor | None = None


@attrs.define
class DecodeBatch:
    """The step's decode sequences (one query token each), attended in one batched call.

    Their contexts are gathered block by block (one ``index_select`` of whole blocks per layer, K and V)
    and padded to the longest, rounded up to a multiple of ``chunk`` slots; ``mask`` hides the padding.

    Attributes:
        index: ``[b]`` int64, packed-row index of each sequence's token.
        block_ids: ``[b * n]`` int64, each sequence's block ids, padded with block 0 to ``n`` blocks (the
            longest context's, rounded up to whole chunks).
        mask: ``[b, 1, 1, n * block_size]`` bool, True where a slot is real context.
        chunk: slots per attention chunk (divides ``n * block_size``).
        ctx_lens: ``[b]`` int64 context lengths (tokens), set with ``attention_backend="cpu"``: the
            sequences then run on llminfer's CPU kernel, which reads the blocks in place (``block_ids``
            viewed ``[b, n]`` as their block tables) instead of gathering them.
    """

    index: torch.Tensor
    block_ids: torch.Tensor
    mask: torch.Tensor
    chunk: int
    ctx_lens: torch.Tensor | None = None


@attrs.define
class PagedAttentionMetadata:
    """Everything the attention layers need for one step (built once, shared by all layers).

    Attributes:
        cache: the KV tensors.
        slot_mapping: ``[T]`` int64, flat slot (``block_id * block_size + offset``) of each new token.
        decode: the decode sequences (None if the step has none).
        prefills: the prefill segments.
        all_decode: every token of the step is a decode token (the output can be assembled without copies).
        triton: set when the step runs the Triton kernels (then ``decode`` is None and ``prefills`` empty).
    """

    cache: PagedKVCache
    slot_mapping: torch.Tensor
    decode: DecodeBatch | None
    prefills: list[PrefillSegment]
    all_decode: bool = False
    triton: TritonStepMetadata | None = None


#: Decode contexts are padded to a multiple of this many slots (rounded up to whole blocks), and the
#: probability-weighted sum over V is taken chunk by chunk in a fixed order: see :func:`llminfer.backends.attention.masked_attention`.
DECODE_CHUNK_SLOTS = 128


def decode_chunk_blocks(block_size: int) -> int:
    """Blocks per decode attention chunk: the fewest whole blocks covering ``DECODE_CHUNK_SLOTS`` slots."""
    return -(-DECODE_CHUNK_SLOTS // block_size)


def build_metadata_loop(
    cache: PagedKVCache,
    starts: Sequence[int],
    lengths: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    device: torch.device | str,
) -> tuple[PagedAttentionMetadata, torch.Tensor]:
    """The step's metadata built in Python token by token (the builder before :func:`build_metadata`;
    kept as its reference in tests and as the "before" of ``bench/bench_step_metadata.py``).

    Args:
        starts: per sequence, the position of its first new token (tokens already computed).
        lengths: per sequence, how many new tokens it has in the packed row.
        block_tables: per sequence, its KV block ids.

    Returns:
        ``(metadata, position_ids)`` with ``position_ids`` ``[1, T]`` int64.
    """
    bs = cache.block_size
    positions: list[int] = []
    slots: list[int] = []
    decode_rows: list[int] = []
    decode_seqs: list[int] = []
    prefills: list[PrefillSegment] = []
    offset = 0
    for i, (start, length, table) in enumerate(zip(starts, lengths, block_tables)):
        pos = range(start, start + length)
        positions.extend(pos)
        slots.extend(table[p // bs] * bs + p % bs for p in pos)
        if length == 1 and start > 0:
            decode_rows.append(offset)
            decode_seqs.append(i)
        else:
            seg = PrefillSegment(offset, length, start)
            if start > 0:
                ctx = start + length
                seg.block_ids = torch.tensor(table[: -(-ctx // bs)], dtype=torch.long).to(device)
                q_pos = torch.arange(start, ctx)
                seg.mask = (torch.arange(ctx)[None, :] <= q_pos[:, None]).to(device)[None, None]
            prefills.append(seg)
        offset += length

    decode = None
    if decode_seqs:
        chunk = decode_chunk_blocks(bs)
        needed = [-(-(starts[i] + 1) // bs) for i in decode_seqs]
        num_blocks = -(-max(needed) // chunk) * chunk
        ids = torch.zeros(len(decode_seqs), num_blocks, dtype=torch.long)
        for r, (i, n) in enumerate(zip(decode_seqs, needed)):
            ids[r, :n] = torch.tensor(block_tables[i][:n], dtype=torch.long)
        ctx_lens = torch.tensor([starts[i] + 1 for i in decode_seqs], dtype=torch.long)
        mask = torch.arange(num_blocks * bs)[None, :] < ctx_lens[:, None]
        decode = DecodeBatch(
            index=torch.tensor(decode_rows, dtype=torch.long, device=device),
            block_ids=ids.view(-1).to(device),
            mask=mask.to(device)[:, None, None, :],
            chunk=chunk * bs,
        )

    meta = PagedAttentionMetadata(
        cache=cache,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        decode=decode,
        prefills=prefills,
        all_decode=not prefills,
    )
    position_ids = torch.tensor(positions, dtype=torch.long, device=device)[None]
    return meta, position_ids


def build_metadata(
    cache: PagedKVCache,
    starts: Sequence[int],
    lengths: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    device: torch.device | str,
    attention_backend: str = "torch",
    decode_split_tokens: int | None = None,
) -> tuple[PagedAttentionMetadata, torch.Tensor]:
    """Build the step's attention metadata and ``position_ids`` with tensor operations.

    From the per-sequence arrays (starts, lengths, block tables padded to one width), vectorised array
    operations give the per-token positions and slot mapping and the decode/prefill split, with no Python
    loop per token; all of it is packed into one int64 host buffer (pinned on CUDA) and copied to the
    device once. The torch path's decode block ids and masks are then computed on the device (a loop per
    prefill sequence remains, for its per-segment masks). A CPU step of decode tokens only (every step of
    steady decoding) takes a shorter path with the same fields.

    Args:
        starts: per sequence, the position of its first new token (tokens already computed).
        lengths: per sequence, how many new tokens it has in the packed row.
        block_tables: per sequence, its KV block ids (covering at least its new positions).
        attention_backend: ``"torch"`` (fills ``decode``/``prefills``), ``"cpu"`` (the same, with
            ``decode.ctx_lens`` for the CPU kernel) or ``"triton"`` (fills ``triton``).
        decode_split_tokens: force the Triton decode split length (tests); default from
            :func:`~llminfer.backends.triton_attention.decode_splits`.

    Returns:
        ``(metadata, position_ids)`` with ``position_ids`` ``[1, T]`` int64.
    """
    device = torch.device(device)
    if (device.type == "cpu" and attention_backend in ("torch", "cpu") and starts and all(n == 1 for n in lengths)
            and all(s > 0 for s in starts)):
        return _all_decode_metadata(cache, starts, block_tables, attention_backend)
    return _build_metadata_vectorised(cache, starts, lengths, block_tables, device, attention_backend,
                                      decode_split_tokens)


def _all_decode_metadata(cache: PagedKVCache, starts: Sequence[int], block_tables: Sequence[Sequence[int]],
                         attention_backend: str) -> tuple[PagedAttentionMetadata, torch.Tensor]:
    """:func:`build_metadata` for a CPU step of decode tokens only (each sequence one token after a prefix):
    the same fields from a few list and array operations (the general builder's ~40 array operations cost
    about 80 us a step at batch 1, more than a small model's attention)."""
    bs = cache.block_size
    chunk = decode_chunk_blocks(bs)
    n = len(starts)
    used = [(s + bs) // bs for s in starts]  # blocks holding positions 0..s
    dec_blocks = -(-max(used) // chunk) * chunk
    ids = np.zeros((n, dec_blocks), dtype=np.int64)
    for row, (table, u) in enumerate(zip(block_tables, used)):
        own = table[:u]
        ids[row, : len(own)] = own
    slots = [table[s // bs] * bs + s % bs for table, s in zip(block_tables, starts)]
    host = torch.tensor([*starts, *slots, *(s + 1 for s in starts), *range(n)], dtype=torch.long)
    positions, slot_mapping, ctx_lens, index = host.split(n)
    mask = torch.from_numpy(np.arange(dec_blocks * bs)[None, :] < np.asarray(starts, dtype=np.int64)[:, None] + 1)
    decode = DecodeBatch(index=index, block_ids=torch.from_numpy(ids.reshape(-1)), mask=mask[:, None, None, :], chunk=chunk * bs,
                         ctx_lens=ctx_lens if attention_backend == "cpu" else None)
    meta = PagedAttentionMetadata(cache=cache, slot_mapping=slot_mapping, decode=decode, prefills=[], all_decode=True)
    return meta, positions[None]


def _build_metadata_vectorised(cache: PagedKVCache, starts: Sequence[int], lengths: Sequence[int],
                               block_tables: Sequence[Sequence[int]], device: torch.device, attention_backend: str,
                               decode_split_tokens: int | None) -> tuple[PagedAttentionMetadata, torch.Tensor]:
    """:func:`build_metadata` for any step."""
    bs = cache.block_size
    num_seqs = len(starts)
    starts_np = np.asarray(starts, dtype=np.int64).reshape(num_seqs)
    lens_np = np.asarray(lengths, dtype=np.int64).reshape(num_seqs)
    table_lens = np.array(list(map(len, block_tables)), dtype=np.int64).reshape(num_seqs)
    is_decode = (lens_np == 1) & (starts_np > 0)
    decode_idx = np.flatnonzero(is_decode)
    prefill_idx = np.flatnonzero(~is_decode)
    num_tokens = int(lens_np.sum())
    width = int(table_lens.max()) if num_seqs else 0
    dec_blocks = 0
    if attention_backend in ("torch", "cpu") and decode_idx.size:
        chunk = decode_chunk_blocks(bs)
        most_blocks = int(((starts_np[decode_idx] + bs) // bs).max())  # cdiv(start + 1, bs)
        dec_blocks = -(-most_blocks // chunk) * chunk
        width = max(width, dec_blocks)
    width = max(width, 1)

    # Per-token arrays from per-sequence ones, vectorised on the host (a few thousand int64 at most: cheaper
    # than launching device kernels or torch's CPU dispatch for each), then everything in one buffer:
    # starts | lengths | q_start | ctx_len | decode idx | decode rows | prefill idx | positions | slots | tables.
    n_dec, n_pre = decode_idx.size, prefill_idx.size
    tables_np = np.zeros((num_seqs, width), dtype=np.int64)
    if num_seqs:
        flat_tables = np.array(list(itertools.chain.from_iterable(block_tables)), dtype=np.int64)
        row_start = np.cumsum(table_lens) - table_lens
        rows = np.repeat(np.arange(num_seqs, dtype=np.int64), table_lens)
        cols = np.arange(flat_tables.size, dtype=np.int64) - np.repeat(row_start, table_lens)
        tables_np[rows, cols] = flat_tables
    q_start_np = np.cumsum(lens_np) - lens_np
    seq_of = np.repeat(np.arange(num_seqs, dtype=np.int64), lens_np)
    positions_np = starts_np[seq_of] + np.arange(num_tokens, dtype=np.int64) - q_start_np[seq_of]
    slots_np = tables_np[seq_of, positions_np // bs] * bs + positions_np % bs
    parts = [starts_np, lens_np, q_start_np, starts_np + lens_np, decode_idx, q_start_np[decode_idx], prefill_idx,
             positions_np, slots_np, tables_np.reshape(-1)]
    if dec_blocks:
        # The torch/CPU decode batch's context lengths and block ids (entries past a row's last block zeroed),
        # host-side like the rest: on CPU each torch op here would cost more dispatch than its arithmetic.
        dec_ctx_np = starts_np[decode_idx] + 1
        dec_ids_np = tables_np[decode_idx, :dec_blocks]
        dec_ids_np[np.arange(dec_blocks)[None, :] >= (dec_ctx_np[:, None] + bs - 1) // bs] = 0
        parts += [dec_ctx_np, dec_ids_np.reshape(-1)]
    host = torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False))
    if device.type == "cuda":
        host = host.pin_memory()
    dev = host.to(device, non_blocking=True)
    views = torch.split(dev, [p.size for p in parts])
    starts_t, lens_t, q_start, ctx_len, decode_t, decode_rows, prefill_t, positions, slot_mapping = views[:9]
    tables = views[9].view(num_seqs, width)
    dec_ctx, dec_ids = views[10:] if dec_blocks else (None, None)

    decode = None
    prefills: list[PrefillSegment] = []
    triton_meta = None
    if attention_backend == "triton":
        from llminfer.backends.triton_attention import TritonStepMetadata, decode_splits

        max_ctx = int(starts_np[decode_idx].max()) + 1 if n_dec else 1
        num_splits, split_len = decode_splits(max_ctx, n_dec, cache.num_kv_heads, device, decode_split_tokens)
        triton_meta = TritonStepMetadata(
            q_start=q_start, q_len=lens_t, ctx_start=starts_t, ctx_len=ctx_len, block_tables=tables,
            decode_seqs=decode_t, decode_rows=decode_rows, prefill_seqs=prefill_t,
            max_prefill_len=int(lens_np[prefill_idx].max()) if n_pre else 0,
            num_splits=num_splits, split_len=split_len)
    else:
        if dec_blocks:
            assert dec_ctx is not None and dec_ids is not None
            if device.type == "cpu":
                mask = torch.from_numpy(np.arange(dec_blocks * bs)[None, :] < dec_ctx_np[:, None])
            else:
                mask = torch.arange(dec_blocks * bs, device=device)[None, :] < dec_ctx[:, None]
            decode = DecodeBatch(index=decode_rows, block_ids=dec_ids, mask=mask[:, None, None, :],
                                 chunk=decode_chunk_blocks(bs) * bs,
                                 ctx_lens=dec_ctx if attention_backend == "cpu" else None)
        offsets = np.cumsum(lens_np) - lens_np
        for i in prefill_idx.tolist():
            start, length = int(starts_np[i]), int(lens_np[i])
            seg = PrefillSegment(int(offsets[i]), length, start)
            ctx_n = start + length
            if attention_backend == "cpu" or start > 0:
                seg.block_ids = tables[i, : -(-ctx_n // bs)]
            if attention_backend == "cpu":
                seg.ctx_lens = torch.arange(start + 1, ctx_n + 1, device=device)
            if start > 0:  # the masked path's mask (also the kernel path's fallback where its dtypes do not fit)
                q_pos = torch.arange(start, ctx_n, device=device)
                seg.mask = (torch.arange(ctx_n, device=device)[None, :] <= q_pos[:, None])[None, None]
            prefills.append(seg)

    meta = PagedAttentionMetadata(cache=cache, slot_mapping=slot_mapping, decode=decode, prefills=prefills,
                                  all_decode=n_pre == 0 and attention_backend != "triton", triton=triton_meta)
    return meta, positions[None]

"""CUDA-graph decode for the eager backend: pure-decode steps replayed from graphs captured per batch bucket.

At batch 1 a small model's decode step is bound by kernel launches (a few hundred per step); replaying a
captured CUDA graph launches them all at once. As in vLLM and nano-vllm, a graph is captured for each
batch-size bucket (:func:`batch_buckets`: 1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond, up to
``max_batch_size``), largest first, all in one shared memory pool. Every graph reads the same static
input buffers (:class:`DecodeInputs`: token ids, positions, slot mapping, context lengths, block tables),
which are views of one device tensor filled by one host-to-device copy per step; a step of ``n``
sequences replays the smallest bucket ``>= n``, its extra rows padded (slot -1: no KV written; context
of 1; block 0), and their logits dropped. Steps with a prefill chunk, or more sequences than the largest
bucket, run eagerly.

Only the Triton attention path is captured: its kernels take the batch's metadata as device tensors with
a fixed grid (the decode split count is fixed from ``max_model_len`` at capture), whereas the torch path
sizes tensors from host-side context lengths each step.

:class:`DecodeGraphRunner` also runs on CPU without capturing (``capture=False``: each "replay" runs the
forward on the static buffers), so the padding and buffer logic is tested where there is no GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from llminfer.backends.attention import METADATA_KWARG, PagedAttentionMetadata, PagedKVCache


def batch_buckets(max_batch_size: int) -> tuple[int, ...]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8 up to 64, then every 16, the last ``>= max_batch_size``.

    Raises:
        ValueError: ``max_batch_size < 1``.
    """
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    out = [1, 2, 4, 8]
    while out[-1] < max_batch_size:
        out.append(out[-1] + (8 if out[-1] < 64 else 16))
    return tuple(b for i, b in enumerate(out) if i == 0 or out[i - 1] < max_batch_size)


def pick_bucket(num_seqs: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding ``num_seqs`` sequences, or None (run eagerly)."""
    for b in buckets:
        if b >= num_seqs:
            return b
    return None


class DecodeInputs:
    """The static input buffers, views of one int64 device tensor (and its host twin, pinned on CUDA).

    Layout, for ``B`` rows and tables ``W`` blocks wide: ``ids [B] | positions [B] | slots [B] |
    ctx_len [B] | block_tables [B, W]``.
    """

    def __init__(self, max_rows: int, width: int, device: torch.device) -> None:
        self.max_rows, self.width = max_rows, width
        size = 4 * max_rows + max_rows * width
        self.device_buf = torch.zeros(size, dtype=torch.long, device=device)
        self.host_buf = torch.zeros(size, dtype=torch.long, pin_memory=device.type == "cuda")
        self.host = self.host_buf.numpy()
        b = max_rows
        self.ids, self.positions, self.slots, self.ctx_len = (self.device_buf[i * b:(i + 1) * b] for i in range(4))
        self.block_tables = self.device_buf[4 * b:].view(b, width)
        self.rows = torch.arange(max_rows, device=device)  # q_start = decode_seqs = decode_rows: row i

    def fill(self, tokens: Sequence[int], positions: Sequence[int], block_tables: Sequence[Sequence[int]],
             block_size: int, bucket: int) -> None:
        """Stage one decode step for ``bucket`` rows (the real ``n`` first, padding after) and copy it to
        the device in one transfer.

        Args:
            tokens: per sequence, its one new token id.
            positions: per sequence, that token's position (= tokens already cached).
            block_tables: per sequence, its KV block ids (covering ``positions[i]``).
        """
        n, b, w = len(tokens), self.max_rows, self.width
        h = self.host
        pos = np.asarray(positions, dtype=np.int64)
        h[:4 * b] = 0
        h[:n] = tokens
        h[b:b + n] = pos
        tables = h[4 * b:].reshape(b, w)
        tables[:bucket] = 0
        for i, t in enumerate(block_tables):
            tables[i, :len(t)] = t
        h[2 * b:2 * b + n] = tables[np.arange(n), pos // block_size] * block_size + pos % block_size
        h[2 * b + n:2 * b + bucket] = -1  # padding rows write no KV
        h[3 * b:3 * b + n] = pos + 1
        h[3 * b + n:3 * b + bucket] = 1
        self.device_buf.copy_(self.host_buf, non_blocking=True)


class DecodeGraphRunner:
    """Captures and replays pure-decode steps (see the module docstring).

    Args:
        model: the causal LM (attention implementation ``"llminfer_paged"``).
        cache: the paged KV tensors.
        max_batch_size: the largest bucket covers it.
        max_model_len: sizes the block tables and the fixed decode split.
        capture: capture CUDA graphs (CUDA only); False runs each bucket's forward eagerly on the static
            buffers (CPU tests).
        forward_fn: what one bucket runs: ``forward_fn(input_ids [1, B], position_ids [1, B], metadata)``
            returning ``[B, V]`` logits. Default: ``model`` called with the metadata keyword (the eager
            backend); the compiled backend passes its compiled graph plus head, so
            ``compile_cudagraphs`` captures the same static buffers and buckets.

    Raises:
        ValueError: ``capture`` on a non-CUDA device.
    """

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, max_batch_size: int, max_model_len: int,
                 capture: bool = True,
                 forward_fn: Callable[[torch.Tensor, torch.Tensor, PagedAttentionMetadata], torch.Tensor] | None = None
                 ) -> None:
        self.model = model
        self.forward_fn = forward_fn or self._model_forward
        self.cache = cache
        self.device = cache.k[0].device
        if capture and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.capture = capture
        self.buckets = batch_buckets(max_batch_size)
        self.max_model_len = max_model_len
        width = -(-max_model_len // cache.block_size)
        self.inputs = DecodeInputs(self.buckets[-1], width, self.device)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.metas: dict[int, PagedAttentionMetadata] = {}
        self.pool = None
        self.num_replays = 0

    def _meta(self, bucket: int) -> PagedAttentionMetadata:
        from llminfer.backends.triton_attention import TritonStepMetadata, decode_splits

        inp = self.inputs
        rows = inp.rows[:bucket]
        num_splits, split_len = decode_splits(self.max_model_len, bucket, self.cache.num_kv_heads, self.device)
        tm = TritonStepMetadata(
            q_start=rows, q_len=torch.ones(bucket, dtype=torch.long, device=self.device),
            ctx_start=inp.positions[:bucket], ctx_len=inp.ctx_len[:bucket], block_tables=inp.block_tables[:bucket],
            decode_seqs=rows, decode_rows=rows, prefill_seqs=rows[:0], max_prefill_len=0,
            num_splits=num_splits, split_len=split_len)
        return PagedAttentionMetadata(cache=self.cache, slot_mapping=inp.slots[:bucket], decode=None, prefills=[],
                                      all_decode=False, triton=tm)

    def _model_forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: PagedAttentionMetadata) -> torch.Tensor:
        out = self.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=0,
                         **{METADATA_KWARG: meta})
        return out.logits[0]  # [bucket, V]

    def _forward(self, bucket: int) -> torch.Tensor:
        inp = self.inputs
        return self.forward_fn(inp.ids[None, :bucket], inp.positions[None, :bucket], self.metas[bucket])

    @torch.inference_mode()
    def capture_all(self) -> int:
        """Capture every bucket's graph, largest first, in one memory pool (no-op without ``capture``).

        The warm-up and captured runs see padding only (slot -1), so no KV slot is written.

        Returns:
            Graphs captured.
        """
        for b in self.buckets:
            self.metas[b] = self._meta(b)
        if not self.capture:
            return 0
        self.pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            self.inputs.fill([], [], [], self.cache.block_size, b)
            self._forward(b)  # warm-up: triton compiles its kernels outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[b] = self._forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
        return len(self.graphs)

    def fits(self, num_seqs: int) -> int | None:
        """The bucket a pure-decode step of ``num_seqs`` sequences replays, or None."""
        return pick_bucket(num_seqs, self.buckets)

    @torch.inference_mode()
    def run(self, tokens: Sequence[int], positions: Sequence[int], block_tables: Sequence[Sequence[int]]
            ) -> torch.Tensor:
        """One pure-decode step: stage the inputs, replay (or run) the bucket's graph.

        Returns:
            ``[n, V]`` float32 logits of the ``n`` real rows.

        Raises:
            ValueError: more sequences than the largest bucket.
        """
        n = len(tokens)
        bucket = self.fits(n)
        if bucket is None:
            raise ValueError(f"{n} sequences exceed the largest CUDA-graph bucket {self.buckets[-1]}")
        if bucket not in self.metas:
            self.metas[bucket] = self._meta(bucket)
        self.inputs.fill(tokens, positions, block_tables, self.cache.block_size, bucket)
        if self.capture:
            self.graphs[bucket].replay()
            logits = self.outputs[bucket]
        else:
            logits = self._forward(bucket)
        self.num_replays += 1
        return logits[:n].float()

    def describe(self) -> dict[str, Any]:
        """Facts for ``engine.info()``: buckets, graphs captured, steps replayed."""
        return {"buckets": list(self.buckets), "captured": len(self.graphs), "replayed_steps": self.num_replays}

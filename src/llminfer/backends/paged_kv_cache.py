"""The paged KV pool's tensors (:class:`PagedKVCache`), allocated once per engine; the block bookkeeping
over them is :mod:`llminfer.kv`'s, the attention that reads and writes them :mod:`llminfer.backends.attention`'s.
"""

from __future__ import annotations

import torch


class PagedKVCache:
    """The KV pool's tensors, allocated once.

    Per layer, K and V are ``[num_kv_heads, num_blocks, block_size, head_dim]`` tensors of ``dtype`` on
    ``device``; bytes in all: ``2 * num_layers * num_blocks * block_size * num_kv_heads * head_dim *
    itemsize``. Head-major (rather than vLLM's ``[num_blocks, block_size, heads, dim]``) so that gathering a
    batch's context slots gives ``[heads, batch, len, dim]``, already contiguous per (head, sequence) for
    the attention matmuls: one copy per layer instead of two.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        """Bytes one block costs over all layers, K and V."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

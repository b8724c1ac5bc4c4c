"""The KV block pool: reference-counted blocks, an LRU free queue and the prefix-cache map.

Contract (modelled on vLLM v1 ``block_pool.py`` and nano-vllm ``block_manager.py``, written anew):

* every block is either in the free queue (``ref_cnt == 0``) or referenced (``ref_cnt > 0``), never both;
* a freed block keeps its hash and stays findable until it is handed out again (lazy eviction);
* the free queue pops the least recently freed block first, so callers free a request's blocks tail
  first and its head (the most shareable prefix) is evicted last;
* a cache hit checks the stored token ids, extra keys and parent block as well as the hash, so a hash
  collision can only cost a miss, never wrong KV.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from llminfer.kv.hashing import BlockHash


class KVBlock:
    """One block of ``block_size`` KV slots.

    Attributes:
        block_id: index into the KV tensors' first dimension.
        ref_cnt: number of block tables that hold this block.
        block_hash: chained hash when the block is full and cached, else None.
        token_ids: the block's tokens when cached (collision guard).
        extra_keys: the tagged extra keys it was hashed with (collision guard).
        parent: ``(block_id, generation)`` of the previous block when cached (collision guard).
        generation: bumped every time the block gets a new identity, so stale parent links never match.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "extra_keys", "parent", "generation")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.extra_keys: tuple[str, ...] = ()
        self.parent: tuple[int, int] | None = None
        self.generation = 0

    def identity(self) -> tuple[int, int]:
        return (self.block_id, self.generation)

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """Owns all KV blocks. Not thread-safe: only the scheduler touches it.

    Args:
        num_blocks: blocks in the pool (the KV tensors' first dimension).
        enable_caching: keep full blocks findable by hash after they are freed.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference (cached-but-free ones included: they can be evicted)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by hash (referenced or not)."""
        return len(self._cached)

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the head of the free queue (LRU first), evicting their cached identity.

        Raises:
            ValueError: fewer than ``n`` free blocks (callers check :attr:`num_free_blocks` first).
        """
        if n > len(self._free):
            raise ValueError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (prefix-cache hits); revive free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block, in the given order; unreferenced ones join the free queue's
        tail (evicted last). Pass a request's blocks tail first.

        Raises:
            RuntimeError: a block is freed more often than it was referenced (ref-count drift).
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block!r}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    # An uncached block has nothing worth keeping: reuse it first.
                    self._free[block.block_id] = block
                    self._free.move_to_end(block.block_id, last=False)
                else:
                    self._free[block.block_id] = block

    def cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        """The block the prefix cache holds under ``block_hash``, if any."""
        return self._cached.get(block_hash)

    def lookup(
        self,
        block_hash: BlockHash,
        token_ids: Sequence[int],
        extra_keys: tuple[str, ...],
        parent: KVBlock | None,
    ) -> KVBlock | None:
        """Return the cached block for this hash if its tokens, extra keys and parent also match."""
        if not self.enable_caching:
            return None
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids) or block.extra_keys != extra_keys:
            return None
        expected_parent = parent.identity() if parent is not None else None
        if block.parent != expected_parent:
            return None
        return block

    def cache(
        self,
        block: KVBlock,
        block_hash: BlockHash,
        token_ids: Sequence[int],
        extra_keys: tuple[str, ...],
        parent: KVBlock | None,
    ) -> None:
        """Register a full, computed block under its hash. A hash already held by another block keeps
        that block (the duplicate stays private to its request)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        block.extra_keys = extra_keys
        block.parent = parent.identity() if parent is not None else None
        self._cached[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            self.num_evictions += 1
        block.block_hash = None
        block.token_ids = None
        block.extra_keys = ()
        block.parent = None
        block.generation += 1

    def reset_cache(self) -> int:
        """Forget every cached-but-free block (for benchmarks with a cold cache). Returns how many."""
        n = 0
        for block in list(self._free.values()):
            if block.block_hash is not None:
                self._evict(block)
                n += 1
        return n

    def check_integrity(self) -> None:
        """Assert the pool's own invariants: a block is free xor referenced, and every cached hash maps to
        a block that holds it.

        Raises:
            AssertionError: naming the broken invariant.
        """
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"negative ref count on {block!r}"
            assert (block.ref_cnt == 0) == self.is_free(block), f"{block!r} free xor referenced broken"
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash, f"hash map points at {block!r}, which holds another hash"

    def is_free(self, block: KVBlock) -> bool:
        return block.block_id in self._free

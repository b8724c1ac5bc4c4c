"""KVCacheManager: block tables of requests on top of the :class:`BlockPool`.

The scheduler asks it three things: how much of a request's prompt is already cached
(:meth:`find_cached_prefix`), whether the slots for the next ``num_new_tokens`` can be allocated
(:meth:`allocate_slots`), and to register newly completed blocks for reuse (:meth:`cache_full_blocks`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from llminfer.kv.block_pool import BlockPool, KVBlock
from llminfer.kv.hashing import BlockHash, encode_extra_keys, hash_full_blocks


class CacheableSequence(Protocol):
    """What the manager needs to know of a request."""

    request_id: str
    token_ids: list[int]
    block_hashes: list[BlockHash]
    extra_keys: tuple[str, ...]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Block tables, prefix-cache lookups and hit statistics.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_cache: reuse cached full blocks across requests.
        max_pinned_fraction: at most this share of the pool is held by pinned prefixes (:meth:`pin_prefix`);
            the oldest pins give way first.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True,
                 max_pinned_fraction: float = 0.5) -> None:
        self.block_size = block_size
        self.max_pinned_blocks = int(num_blocks * max_pinned_fraction)
        # Pinned prefixes, oldest first: key -> the canonical cached blocks it holds one reference on.
        self.pins: OrderedDict[str, list[KVBlock]] = OrderedDict()
        self.enable_prefix_cache = enable_prefix_cache
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_cache)
        self.block_tables: dict[str, list[KVBlock]] = {}
        # Per request: how many leading blocks of its table are already registered (or skipped) for reuse,
        # so each step only looks at newly filled blocks.
        self._num_registered: dict[str, int] = {}
        # Prefix-cache statistics: queries/hits in requests, tokens in tokens.
        self.num_queries = 0
        self.num_hits = 0
        self.query_tokens = 0
        self.hit_tokens = 0

    @staticmethod
    def hash_prefix(prefix: str | Sequence[int], block_size: int | None = None, *,
                    adapter_name: str | None = None, cache_salt: str | None = None) -> str:
        """A stable key for a prompt prefix: 64 hex digits of a sha256 digest (the block hashes' family).

        * Text (``KVCacheManager.hash_prefix(system_prompt)``): sha256 of its UTF-8 bytes. A label to
          group requests by the prefix they share (logs, ``run(..., prefix_key=)``). It is *not* a block
          hash: the prefix cache keys on token ids, so it needs no key to find a shared prefix.
        * Token ids with ``block_size``: the prefix cache's own key for that prefix, i.e. the chained hash
          (:func:`llminfer.kv.hashing.hash_full_blocks`) of its last full block, under which the cache
          holds the KV of all ``len(prefix) // block_size * block_size`` leading tokens. A trailing partial
          block is not part of the key (partial blocks are never shared). ``adapter_name`` and
          ``cache_salt`` partition the cache as they do for a request.

        Args:
            prefix: text, or the prompt's leading token ids (as the engine tokenized them).
            block_size: tokens per KV block (``cfg.cache.page_size_tokens``); only with token ids.

        Raises:
            ValueError: token ids without ``block_size`` or shorter than one block; ``block_size``,
                ``adapter_name`` or ``cache_salt`` with text.
        """
        if isinstance(prefix, str):
            if block_size is not None or adapter_name or cache_salt:
                raise ValueError("block_size, adapter_name and cache_salt apply to token ids, not text")
            return hashlib.sha256(prefix.encode("utf-8")).hexdigest()
        ids = [int(t) for t in prefix]
        if block_size is None or block_size < 1:
            raise ValueError("token ids need block_size >= 1 (the cache's page_size_tokens)")
        if len(ids) < block_size:
            raise ValueError(f"{len(ids)} tokens do not fill one block of {block_size}: nothing is cached")
        return hash_full_blocks(ids, block_size, encode_extra_keys(adapter_name, cache_salt))[-1].hex()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def find_cached_prefix(self, seq: CacheableSequence) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks at the start of ``seq``, capped so that at least the last
        token is computed (a prompt must still produce logits on a full hit).

        Returns:
            ``(blocks, num_cached_tokens)``; the blocks are not yet referenced.
        """
        if not self.enable_prefix_cache:
            return [], 0
        self._ensure_hashes(seq, len(seq.token_ids))
        max_blocks = (len(seq.token_ids) - 1) // self.block_size
        hits: list[KVBlock] = []
        parent: KVBlock | None = None
        for i, block_hash in enumerate(seq.block_hashes[:max_blocks]):
            start = i * self.block_size
            block = self.pool.lookup(
                block_hash, seq.token_ids[start : start + self.block_size], seq.extra_keys, parent
            )
            if block is None:
                break
            hits.append(block)
            parent = block
        return hits, len(hits) * self.block_size

    def record_query(self, num_tokens: int, num_cached_tokens: int) -> None:
        """Count one prefix-cache query (at each admission: first, and after a preemption)."""
        self.num_queries += 1
        self.query_tokens += num_tokens
        if num_cached_tokens:
            self.num_hits += 1
            self.hit_tokens += num_cached_tokens

    def allocate_slots(
        self,
        seq: CacheableSequence,
        num_total_tokens: int,
        cached_blocks: Sequence[KVBlock] = (),
        reserve_blocks: int = 0,
    ) -> bool:
        """Make ``seq``'s block table cover ``num_total_tokens`` tokens, first adopting ``cached_blocks``
        (only for a request with no table yet).

        Args:
            num_total_tokens: tokens that will have KV after the step (computed + new).
            reserve_blocks: free blocks that must remain afterwards (the admission watermark).

        Pinned prefixes give way, oldest first, before this fails: a pin keeps a prefix through eviction,
        never at the cost of a request.

        Returns:
            False (and nothing changed but released pins) when there are not enough free blocks.
        """
        while not self._try_allocate(seq, num_total_tokens, cached_blocks, reserve_blocks):
            if not self.pins:
                return False
            self.unpin_prefix(next(iter(self.pins)))
        return True

    def _try_allocate(self, seq: CacheableSequence, num_total_tokens: int, cached_blocks: Sequence[KVBlock],
                      reserve_blocks: int) -> bool:
        table = self.block_tables.get(seq.request_id)
        revived = 0
        if table is None:
            revived = sum(1 for b in cached_blocks if b.ref_cnt == 0)
            have = len(cached_blocks)
        else:
            have = len(table)
        need = max(0, self.blocks_needed(num_total_tokens) - have)
        if need + revived + reserve_blocks > self.pool.num_free_blocks:
            return False
        if table is None:
            self.pool.touch(cached_blocks)
            table = list(cached_blocks)
            self.block_tables[seq.request_id] = table
        if need:
            table.extend(self.pool.allocate(need))
        return True

    def cache_full_blocks(self, seq: CacheableSequence, num_computed_tokens: int) -> None:
        """Register every full block whose KV is now computed, so later requests can reuse it."""
        if not self.enable_prefix_cache:
            return
        table = self.block_tables.get(seq.request_id)
        if not table:
            return
        num_full = min(num_computed_tokens // self.block_size, len(table))
        done = self._num_registered.get(seq.request_id, 0)
        if num_full <= done:
            return
        self._ensure_hashes(seq, num_full * self.block_size)
        parent: KVBlock | None = table[done - 1] if done else None
        for i in range(done, num_full):
            block = table[i]
            if block.block_hash is None:
                start = i * self.block_size
                self.pool.cache(
                    block,
                    seq.block_hashes[i],
                    seq.token_ids[start : start + self.block_size],
                    seq.extra_keys,
                    parent,
                )
            parent = block
        self._num_registered[seq.request_id] = num_full

    def free(self, request_id: str) -> None:
        """Release a request's blocks, tail first (its head, the most shareable prefix, is evicted last)."""
        table = self.block_tables.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        if table:
            self.pool.free(reversed(table))

    def pin_prefix(self, key: str, seq: CacheableSequence) -> int:
        """Hold the cached full blocks of ``seq``'s prompt prefix under ``key`` so that eviction cannot
        take them (one reference each, as a request's block table holds), until :meth:`unpin_prefix`,
        :meth:`reset_cache`, or a pool too full to admit or grow a request (the oldest pins give way first).

        Which prefix: where ``key`` is the prefix cache's own key for a block of ``seq``
        (``hash_prefix(token_ids, block_size)``), exactly the blocks up to that one. Otherwise (a text key,
        ``hash_prefix(system_prompt)``) the leading blocks that every request pinned under ``key`` shares:
        the first request's whole computed prompt, narrowed by each later one to the common run.

        Returns:
            How many blocks ``key`` now pins (0: prefix caching is off, or nothing is shared).
        """
        if not self.enable_prefix_cache:
            return 0
        blocks: list[KVBlock] = []
        for i in range(self._num_registered.get(seq.request_id, 0)):
            block = self.pool.cached_block(seq.block_hashes[i])
            if block is None:
                break
            blocks.append(block)
            if seq.block_hashes[i].hex() == key:
                break
        else:
            old = self.pins.get(key)
            if old is not None:
                common = 0
                while common < min(len(old), len(blocks)) and old[common] is blocks[common]:
                    common += 1
                blocks = blocks[:common]
        self.unpin_prefix(key)
        if blocks:
            self.pool.touch(blocks)
            self.pins[key] = blocks
        while sum(map(len, self.pins.values())) > self.max_pinned_blocks and self.pins:
            self.unpin_prefix(next(iter(self.pins)))
        return len(self.pins.get(key, ()))

    def unpin_prefix(self, key: str) -> bool:
        """Release what :meth:`pin_prefix` holds under ``key`` (its blocks stay cached until evicted).
        Returns False when nothing was pinned under it."""
        blocks = self.pins.pop(key, None)
        if blocks is None:
            return False
        self.pool.free(reversed(blocks))
        return True

    def reset_cache(self) -> int:
        """Release every pin, then forget every cached-but-free block (a cold cache). Returns how many
        blocks were forgotten."""
        for key in list(self.pins):
            self.unpin_prefix(key)
        return self.pool.reset_cache()

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.block_tables.get(request_id, ())]

    def _ensure_hashes(self, seq: CacheableSequence, num_tokens: int) -> None:
        if len(seq.block_hashes) < num_tokens // self.block_size:
            seq.block_hashes[:] = hash_full_blocks(
                seq.token_ids[:num_tokens], self.block_size, seq.extra_keys, seq.block_hashes
            )

    def check_integrity(self) -> None:
        """Assert that every block's ref count equals the number of block tables and pins holding it, and that
        each block is free xor referenced (see :meth:`BlockPool.check_integrity`).

        Raises:
            AssertionError: naming the broken invariant.
        """
        refs: dict[int, int] = {}
        for table in [*self.block_tables.values(), *self.pins.values()]:
            for block in table:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), f"ref count drift on {block!r}"
        self.pool.check_integrity()

    def stats(self) -> dict[str, float | int]:
        """Prefix-cache and pool statistics (the ``cache_stats()`` payload)."""
        used = self.pool.num_blocks - self.pool.num_free_blocks
        return {
            "hit_rate": self.num_hits / self.num_queries if self.num_queries else 0.0,
            "token_hit_rate": self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
            "queries": self.num_queries,
            "hits": self.num_hits,
            "cached_tokens": self.hit_tokens,
            "blocks_total": self.pool.num_blocks,
            "blocks_used": used,
            "blocks_free": self.pool.num_free_blocks,
            "blocks_cached": self.pool.num_cached_blocks,
            "evictions": self.pool.num_evictions,
            "blocks_pinned": sum(map(len, list(self.pins.values()))),  # list(): atomic against the model thread
            "block_size": self.block_size,
        }

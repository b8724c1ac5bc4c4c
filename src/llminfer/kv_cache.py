"""The KV cache's bookkeeping under the name the project description uses (``llminfer.kv_cache``).

A thin re-export of :mod:`llminfer.kv`: :class:`KVCacheManager` (block tables, prefix lookups, hit
statistics; see :meth:`KVCacheManager.hash_prefix` for prefix keys), :class:`BlockPool` and the chained
block hashing of the prefix cache.
"""

from llminfer.kv.block_pool import BlockPool, KVBlock
from llminfer.kv.hashing import ROOT_HASH, BlockHash, hash_block_tokens, hash_full_blocks
from llminfer.kv.manager import KVCacheManager

__all__ = ["ROOT_HASH", "BlockHash", "BlockPool", "KVBlock", "KVCacheManager", "hash_block_tokens",
           "hash_full_blocks"]

"""Prompt blocks being computed right now, so that identical prompts share them instead of computing twice.

A waiting request whose next uncached prompt block is in flight (being prefilled by another running request)
waits for it, then reuses it through the prefix cache: this is how ``n > 1`` samples and concurrent
identical system prompts share their prompt's KV blocks. Owned by the scheduler (single-threaded).
"""

from __future__ import annotations

from collections.abc import Iterable

from llminfer.request import Request


class InflightPrompts:
    """Full prompt blocks being computed, by chained block hash -> the request computing them.

    Args:
        block_size: tokens per KV block.
        enabled: prefix caching is on (without it nothing can be shared, and nothing is tracked).
    """

    def __init__(self, block_size: int, enabled: bool = True) -> None:
        self.block_size = block_size
        self.enabled = enabled
        self._owner: dict[bytes, str] = {}

    def mark(self, req: Request, num_cached_blocks: int) -> None:
        """``req`` starts computing its prompt's full blocks after the first ``num_cached_blocks``."""
        if not self.enabled:
            return
        for block_hash in req.block_hashes[num_cached_blocks : req.num_prompt_tokens // self.block_size]:
            self._owner.setdefault(block_hash, req.request_id)

    def clear(self, req: Request) -> None:
        """``req``'s prompt is computed (or it left): its blocks are no longer in flight."""
        if self._owner:
            for block_hash in req.block_hashes[: req.num_prompt_tokens // self.block_size]:
                if self._owner.get(block_hash) == req.request_id:
                    del self._owner[block_hash]

    def must_wait(self, req: Request, num_cached_blocks: int) -> bool:
        """True when the next block ``req`` would compute is being computed by another request."""
        if not self._owner or num_cached_blocks >= len(req.block_hashes):
            return False
        if num_cached_blocks >= (req.num_tokens - 1) // self.block_size:
            return False  # the hit is already as long as it may be
        owner = self._owner.get(req.block_hashes[num_cached_blocks])
        return owner is not None and owner != req.request_id

    def owners(self) -> Iterable[str]:
        return self._owner.values()

    def __bool__(self) -> bool:
        return bool(self._owner)

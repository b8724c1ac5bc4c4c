"""Prefix-hash stage: chained hashes of a prompt's full blocks, computed before the scheduler needs them."""

from __future__ import annotations

from typing import Any

import attrs
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from llminfer.kv.hashing import hash_full_blocks
from llminfer.protocols.messages import TokenizedRequest


class PrefixHashStage:
    """Fills :attr:`TokenizedRequest.block_hashes` (sha256 chain over full blocks, see ``kv.hashing``).

    Args:
        block_size: tokens per KV block.
        enabled: with prefix caching off, requests pass through untouched.
    """

    name = "prefix_hash"

    def __init__(self, block_size: int, enabled: bool = True) -> None:
        self.block_size = block_size
        self.enabled = enabled

    async def run(self, inbox: ObjectReceiveStream[Any], outbox: ObjectSendStream[Any]) -> None:
        async with outbox:
            async for msg in inbox:
                if self.enabled and isinstance(msg, TokenizedRequest):
                    hashes = hash_full_blocks(msg.prompt_token_ids, self.block_size, msg.extra_keys)
                    msg = attrs.evolve(msg, block_hashes=tuple(hashes))
                await outbox.send(msg)

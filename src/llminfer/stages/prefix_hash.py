"""Prefix-hash stage: chained hashes of a prompt's full blocks, computed before the scheduler needs them."""

from __future__ import annotations

from typing import Any

import attrs
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from llminfer.errors import EngineError, is_fatal
from llminfer.kv.hashing import hash_full_blocks
from llminfer.protocols.messages import RequestFailed, TokenizedRequest


class PrefixHashStage:
    """Fills :attr:`TokenizedRequest.block_hashes` (sha256 chain over full blocks, see ``kv.hashing``).

    Args:
        block_size: tokens per KV block.
        enabled: with prefix caching off, requests pass through untouched.

    A request whose hashing fails becomes a :class:`RequestFailed` for it alone.
    """

    name = "prefix_hash"

    def __init__(self, block_size: int, enabled: bool = True) -> None:
        self.block_size = block_size
        self.enabled = enabled

    async def run(self, inbox: ObjectReceiveStream[Any], outbox: ObjectSendStream[Any]) -> None:
        async with outbox:
            async for msg in inbox:
                if self.enabled and isinstance(msg, TokenizedRequest):
                    msg = self.hashed(msg)
                await outbox.send(msg)

    def hashed(self, msg: TokenizedRequest) -> TokenizedRequest | RequestFailed:
        """``msg`` with its block hashes, or a :class:`RequestFailed` for it alone if hashing raised."""
        try:
            hashes = hash_full_blocks(msg.prompt_token_ids, self.block_size, msg.extra_keys)
            return attrs.evolve(msg, block_hashes=tuple(hashes))
        except BaseException as exc:  # noqa: BLE001 - one request's failure must not stop the stage
            if is_fatal(exc):
                raise
            return RequestFailed(msg.request_id, EngineError(f"prefix hash: {type(exc).__name__}: {exc}"))

"""Chained block hashes for prefix caching.

A full block of ``block_size`` tokens is identified by ``sha256(parent_hash || token_ids || extra_keys)``
(256-bit digest), so a block's hash commits to the whole prefix before it. Extra keys (LoRA adapter name,
cache salt) are tagged so that two kinds of key can never collide with each other. The design follows
vLLM v1 (``vllm/v1/core/kv_cache_utils.py``: ``hash_block_tokens``); the digest and encoding are our own.
A hit is additionally verified against the stored token ids and parent block (see ``BlockPool``), so even
a forced collision cannot return the wrong KV.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes
"""A 32-byte sha256 digest."""

ROOT_HASH: BlockHash = b"\x00" * 32
"""Parent hash of a sequence's first block."""


def encode_extra_keys(adapter_name: str | None = None, cache_salt: str | None = None) -> tuple[str, ...]:
    """Tag the extra keys that partition the prefix cache (``("adapter:x", "salt:y")``)."""
    keys: list[str] = []
    if adapter_name:
        keys.append(f"adapter:{adapter_name}")
    if cache_salt:
        keys.append(f"salt:{cache_salt}")
    return tuple(keys)


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int], extra_keys: tuple[str, ...] = ()) -> BlockHash:
    """Hash one full block.

    Args:
        parent: the previous block's hash, or :data:`ROOT_HASH` for the first block.
        token_ids: the block's token ids (exactly ``block_size`` of them).
        extra_keys: tagged keys from :func:`encode_extra_keys`.

    Returns:
        A 32-byte digest.
    """
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    for key in extra_keys:
        encoded = key.encode()
        h.update(struct.pack("<I", len(encoded)))
        h.update(encoded)
    return h.digest()


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple[str, ...] = (),
    prior: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Chained hashes of every full block of ``token_ids``; ``prior`` hashes are kept and extended.

    Returns:
        ``len(token_ids) // block_size`` hashes; a trailing partial block is not hashed.
    """
    hashes = list(prior)
    parent = hashes[-1] if hashes else ROOT_HASH
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra_keys)
        hashes.append(parent)
    return hashes

"""Applying a compiled grammar while decoding: one :class:`GrammarMatcher` per constrained request fills
its row of the allowed-token bitmask (:func:`allocate_bitmask`), and :func:`apply_bitmask` masks the
logits of the constrained rows before sampling."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a tensor is made: the CLI checks StructuredOutput before loading
    import torch

class GrammarMatcher:
    """One request's position in its grammar (wraps ``xgrammar.GrammarMatcher``).

    Args:
        compiled: the request's compiled grammar.
    """

    __slots__ = ("matcher",)

    def __init__(self, compiled: Any) -> None:
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (``[B, ceil(V/32)]`` int32, bit set = allowed)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False if the grammar rejects it (the matcher is left unchanged)."""
        return bool(self.matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token: the output is complete."""
        return bool(self.matcher.is_terminated())


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """``[rows, ceil(vocab_size / 32)]`` int32, every token allowed."""
    import torch

    return torch.full((rows, math.ceil(vocab_size / 32)), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set to -inf, in place, the logits of tokens not allowed by ``bitmask`` in each of ``rows``.

    Args:
        logits: ``[S, V]`` float32.
        bitmask: ``[S, ceil(V / 32)]`` int32 (rows not in ``rows`` are ignored).
        rows: indices of the constrained rows.
    """
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=logits.shape[-1],
                                         indices=list(rows))

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


def check_first_token(compiled: Any, kind: str, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
    """Refuse a compiled constraint whose first token cannot be chosen: no token at all (a regular expression or
    grammar whose language is empty, ``[^\\s\\S]``, ``root ::= root``), or for the JSON kinds (``kind``
    ``json_schema`` / ``json_object``) only the stop tokens (an empty value, which is no JSON). Without this the
    request decoded masked tokens to its length limit and answered with empty content.

    Raises:
        InvalidRequestError: ``param="structured_output"``.
    """
    import xgrammar

    from llminfer.errors import InvalidRequestError
    from llminfer.sampling.constraint import PARAM

    bitmask = allocate_bitmask(1, vocab_size)
    xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
    words = bitmask[0].tolist()  # bit t % 32 of word t // 32: token t allowed
    if kind in ("json_schema", "json_object"):
        for token in stop_token_ids:
            if 0 <= token < vocab_size:
                words[token // 32] &= ~(1 << (token % 32))
    if not any(words):
        what = "no JSON value" if kind in ("json_schema", "json_object") else "no text"
        raise InvalidRequestError(f"invalid or unsupported {kind.replace('_', ' ')}: it matches {what} "
                                  "(no token can start the output)", param=PARAM)

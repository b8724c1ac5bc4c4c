"""Tokens as text for logprobs: :class:`TokenText` (a token's text and exact bytes), and the engine's
``TokenLogprob`` entries rendered in the chat format (:func:`chat_logprobs`) and the legacy completions
format (:func:`completion_logprobs`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from llminfer.api import protocol as s

_LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a probability that underflows (JSON has no -inf)


def _byte_level_alphabet() -> dict[str, int]:
    """The reversible byte <-> printable-character table of byte-level BPE (GPT-2, Qwen, Llama 3)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(0x100 + extra)] = b
            extra += 1
    return table


_BYTE_LEVEL = _byte_level_alphabet()


class TokenText:
    """Text and raw UTF-8 bytes of single tokens (for logprobs), cached per token id.

    A byte-level BPE token can hold part of a multi-byte character: its text then contains U+FFFD while
    ``bytes`` holds the exact bytes, as the OpenAI API reports them.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        try:
            pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode(" a", add_special_tokens=False))
            self.byte_level = any("\u0120" in p for p in pieces)
        except Exception:  # noqa: BLE001 - any tokenizer without these methods is simply not byte-level
            self.byte_level = False
        self.lookup = lru_cache(maxsize=65536)(self._lookup)

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if self.byte_level:
            raw = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(raw, str) and raw and all(ch in _BYTE_LEVEL for ch in raw):
                return text, [_BYTE_LEVEL[ch] for ch in raw]
        return text, list(text.encode("utf-8", errors="replace"))


def _lp(value: float) -> float:
    return value if math.isfinite(value) else _LOGPROB_FLOOR


def chat_logprobs(chunk_logprobs: Sequence[Any], k: int, token_text: TokenText) -> list[s.ChatTokenLogprob]:
    """Engine ``TokenLogprob`` entries in the chat format (``token``, ``logprob``, ``bytes``, ``top_logprobs``)."""
    out = []
    for entry in chunk_logprobs:
        text, raw = token_text.lookup(entry.token_id)
        top = []
        for tid, value in tuple(entry.top)[:k]:
            t_text, t_raw = token_text.lookup(tid)
            top.append(s.TopLogprob(t_text, _lp(value), t_raw))
        out.append(s.ChatTokenLogprob(text, _lp(entry.logprob), raw, top))
    return out


def completion_logprobs(chunk_logprobs: Sequence[Any], k: int, token_text: TokenText,
                        offset: int) -> s.CompletionLogprobs:
    """Engine ``TokenLogprob`` entries in the legacy completions format; ``offset``: text offset of the first."""
    tokens, values, tops, offsets = [], [], [], []
    for entry in chunk_logprobs:
        text, _ = token_text.lookup(entry.token_id)
        tokens.append(text)
        values.append(_lp(entry.logprob))
        tops.append({token_text.lookup(tid)[0]: _lp(v) for tid, v in tuple(entry.top)[:k]})
        offsets.append(offset)
        offset += len(text)
    return s.CompletionLogprobs(tokens, values, tops, offsets)

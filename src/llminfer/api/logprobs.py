"""Tokens as text for logprobs: :class:`TokenText` (a token's text and exact bytes), and the engine's
``TokenLogprob`` entries rendered in the chat format (:func:`chat_logprobs`) and the legacy completions
format (:func:`completion_logprobs`).
"""

from __future__ import annotations

import codecs
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


def token_key(token_text: TokenText, token_id: int) -> str:
    """How a token is named in the legacy completions format (``tokens`` and the ``top_logprobs`` keys):
    its text, or, for a token that holds only part of a UTF-8 character (its text has U+FFFD where the
    bytes have none), ``bytes:`` and its bytes as ``\\xNN`` escapes, as the OpenAI API writes them."""
    text, raw = token_text.lookup(token_id)
    if "\ufffd" in text and "\ufffd" not in bytes(raw).decode("utf-8", errors="ignore"):
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return text


def top_map(token_text: TokenText, top: Sequence[tuple[int, float]]) -> dict[str, float]:
    """``top_logprobs`` entry of one position, keyed by :func:`token_key`, best first.

    Two candidates can share a key (distinct ids with the same text). Neither is lost: the better one
    (the first: ``top`` is sorted best first) keeps the key, a later one is keyed ``token_id:<id>``; so a
    value is never overwritten, least of all by a worse one.
    """
    out: dict[str, float] = {}
    for tid, value in top:
        key = token_key(token_text, tid)
        if key in out:
            key = f"token_id:{tid}"
        if key not in out:
            out[key] = _lp(value)
    return out


def completion_logprobs(chunk_logprobs: Sequence[Any], k: int, token_text: TokenText,
                        offset: int, *, first_token: int | None = None) -> s.CompletionLogprobs:
    """Engine ``TokenLogprob`` entries in the legacy completions format; ``offset``: text offset of the first.

    ``first_token``: a prompt's first token, which comes first with ``null`` logprob and alternatives
    (nothing precedes it; ``echo`` with ``logprobs``).

    ``text_offset`` counts characters of the joined text: each token's offset is the number of whole
    characters its predecessors' bytes decode to, so a token that ends or continues a character split
    across tokens points at that character (a UTF-8 incremental decoder over the tokens' bytes).
    """
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def width(token_id: int) -> int:
        return len(decoder.decode(bytes(token_text.lookup(token_id)[1])))

    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    if first_token is not None:
        tokens.append(token_key(token_text, first_token))
        values.append(None)
        tops.append(None)
        offsets.append(offset)
        offset += width(first_token)
    for entry in chunk_logprobs:
        tokens.append(token_key(token_text, entry.token_id))
        values.append(_lp(entry.logprob))
        tops.append(top_map(token_text, tuple(entry.top)[:k]))
        offsets.append(offset)
        offset += width(entry.token_id)
    return s.CompletionLogprobs(tokens, values, tops, offsets)


def join_logprobs(a: s.CompletionLogprobs, b: s.CompletionLogprobs) -> s.CompletionLogprobs:
    """``a`` followed by ``b`` (the prompt's logprobs, then the generated tokens')."""
    top = None if a.top_logprobs is None or b.top_logprobs is None else a.top_logprobs + b.top_logprobs
    return s.CompletionLogprobs(a.tokens + b.tokens, a.token_logprobs + b.token_logprobs, top,
                                a.text_offset + b.text_offset)


def vllm_prompt_logprobs(entries: Sequence[Any], k: int, token_text: TokenText) -> list[dict[str, s.PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs`` of one prompt: ``None`` for the first token, then per token
    ``{token id: PromptLogprob}`` holding the prompt token (with its rank) and the top ``k``."""
    out: list[dict[str, s.PromptLogprob] | None] = [None]
    for entry in entries:
        position = {str(entry.token_id): s.PromptLogprob(_lp(entry.logprob), entry.rank,
                                                         token_text.lookup(entry.token_id)[0])}
        for rank, (tid, value) in enumerate(tuple(entry.top)[:k], start=1):
            position.setdefault(str(tid), s.PromptLogprob(_lp(value), rank, token_text.lookup(tid)[0]))
        out.append(position)
    return out

"""xgrammar's tokenizer info for a Hugging Face tokenizer, with special tokens that never stand for text
(what :class:`~llminfer.sampling.grammar_compiler.GrammarCompiler` compiles against)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def special_token_ids(tokenizer: Any) -> set[int]:
    """Ids of the tokenizer's special tokens (``<|im_end|>``, ``<|endoftext|>``, ...)."""
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", ())}
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(int(i) for i, token in decoder.items() if getattr(token, "special", False))
    return ids


def text_only_tokenizer_info(xgrammar: Any, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> Any:
    """xgrammar's tokenizer info in which special tokens never stand for text.

    ``TokenizerInfo.from_huggingface`` keeps special tokens' strings, so a choice or grammar literal such
    as ``"<|im_end|>"`` could be produced as the special token itself: the stop token, which ends the
    request and is not part of the text (an empty output). Their strings are blanked here, which xgrammar
    reads as "special, never matched"; the stop tokens are still allowed where the grammar accepts.
    """
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                   stop_token_ids=list(stop_token_ids) or None)
    special = special_token_ids(tokenizer)
    if not special:
        return info
    encoded = [""] * vocab_size
    for token, idx in tokenizer.get_vocab().items():
        if idx < vocab_size and idx not in special:
            encoded[idx] = token
    return xgrammar.TokenizerInfo(encoded, vocab_type=info.vocab_type, vocab_size=vocab_size,
                                  stop_token_ids=info.stop_token_ids, add_prefix_space=info.add_prefix_space)

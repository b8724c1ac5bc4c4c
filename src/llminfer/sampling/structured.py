"""Structured output: a JSON Schema, any JSON object, a regular expression, a grammar or a choice,
enforced while decoding by a per-row token mask from `xgrammar <https://github.com/mlc-ai/xgrammar>`_.

Why xgrammar: its next-token mask is the cheaper one per token (the cost paid on every step of every
constrained row; llguidance compiles faster, but compiling happens once per constraint, off the step, and
is cached), it has the CUDA mask kernel the GPU path will use, and it is what vLLM and SGLang ship. The
comparison is ``python bench/bench_structured.py --only library``.

How it flows, and where each part lives (this module is the public door to all of them):

1. the caller sets ``SamplingParams.structured_output`` to a :class:`StructuredOutput`
   (:mod:`llminfer.sampling.constraint`; a JSON Schema is normalized by :mod:`llminfer.sampling.schema`);
2. the request's input processing (the HTTP route, or the tokenize stage) submits it to the engine's
   :class:`GrammarCompiler` (:mod:`llminfer.sampling.grammar_compiler`), which compiles it in a worker
   thread (xgrammar releases the GIL) or, for a constraint that may compile slowly, in a killable process of
   the compile server (:mod:`llminfer.sampling.grammar_server`, :mod:`llminfer.sampling.grammar_worker`),
   caches it by (constraint, tokenizer; xgrammar's view of the tokenizer: :mod:`llminfer.sampling.tokenizer_info`),
   and hands back a :class:`GrammarHandle` at once;
3. the scheduler keeps the request waiting until its grammar is ready, and fails it (``param`` named) if
   compiling failed or ran past ``timeout_s``; other requests are scheduled meanwhile;
4. the backend's sampler keeps one :class:`GrammarMatcher` per constrained request
   (:mod:`llminfer.sampling.grammar_mask`): each step it fills the row's allowed-token bitmask, masks the
   logits, and after sampling advances the matcher by the token.

JSON is generated compactly (``,`` and ``:`` with no spaces, no whitespace between tokens), so a model that
keeps choosing spaces cannot run away; EOS is allowed only where the grammar accepts.
"""

from __future__ import annotations

from llminfer.sampling.constraint import (
    COMPACT,
    MAX_ENUM_VALUES,
    MAX_SCHEMA_CHARS,
    MAX_SCHEMA_DEPTH,
    PARAM,
    StructuredOutput,
)
from llminfer.sampling.grammar_compiler import (
    SMALL_ENUM_VALUES,
    SMALL_SCHEMA_CHARS,
    GrammarCompiler,
    GrammarHandle,
)
from llminfer.sampling.grammar_mask import GrammarMatcher, allocate_bitmask, apply_bitmask
from llminfer.sampling.tokenizer_info import special_token_ids, text_only_tokenizer_info

__all__ = [
    "COMPACT",
    "MAX_ENUM_VALUES",
    "MAX_SCHEMA_CHARS",
    "MAX_SCHEMA_DEPTH",
    "PARAM",
    "SMALL_ENUM_VALUES",
    "SMALL_SCHEMA_CHARS",
    "GrammarCompiler",
    "GrammarHandle",
    "GrammarMatcher",
    "StructuredOutput",
    "allocate_bitmask",
    "apply_bitmask",
    "special_token_ids",
    "text_only_tokenizer_info",
]

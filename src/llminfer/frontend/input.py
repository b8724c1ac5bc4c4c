"""Request input: validation and tokenization, one path for the Python API and the HTTP layer.

:class:`InputProcessor` is what turns a :class:`~llminfer.protocols.messages.GenerationRequest` into a
:class:`~llminfer.protocols.messages.TokenizedRequest` (the tokenize stage calls :meth:`process`), and the
HTTP routes call :meth:`encode` on the prompts they render themselves (chat templates) and :meth:`process`
on the requests they build from the token ids, then submit the :class:`TokenizedRequest` (the tokenize stage
passes it on), so a prompt is judged once, and the same way whichever door it came through. Every error is
an :class:`~llminfer.errors.InvalidRequestError` carrying ``param`` and a ``code``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from llminfer.errors import InvalidRequestError, is_fatal, one_line
from llminfer.kv.hashing import encode_extra_keys
from llminfer.protocols import Tokenizer
from llminfer.protocols.messages import GenerationRequest, TokenizedRequest
from llminfer.sampling.params import SamplingParams
from llminfer.sampling.structured import GrammarCompiler, GrammarHandle

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
MAX_CHARS_PER_TOKEN = 128
"""A generous bound on the characters one token stands for: a text longer than ``max_model_len`` times it
cannot fit the context and is refused before it is tokenized (tokenizing a multi-megabyte prompt only to
refuse it would hold the tokenizer for a long time). The longest entry of Qwen2's 151k vocabulary decodes to 128 characters (a run of
repeated symbols; the longest thousand average 29), so only a prompt that could not fit anyway is refused."""
INLINE_TOKENIZE_CHARS = 4096
"""Texts up to this many characters are tokenized on the event loop (cheaper than a thread hop); longer ones
in a worker thread (:meth:`InputProcessor.encode_async`, the tokenize stage), so that one long prompt
never stalls every other stream."""


def build_request(prompt: str | Sequence[int], *, max_new_tokens: int | None = 64, temperature: float = 0.0,
                  top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                  stop_sequences: Sequence[str] | str | None = None, ignore_eos: bool = False, priority: int = 0,
                  cache_salt: str | None = None, adapter_name: str | None = None, prefix_key: str | None = None,
                  **sampling: Any) -> GenerationRequest:
    """Validate the arguments of one request and build its :class:`GenerationRequest` (a fresh id, the
    arrival time now). ``sampling`` takes the other :class:`SamplingParams` fields by name.

    ``prefix_key`` (e.g. ``KVCacheManager.hash_prefix(system_prompt)``) pins the prompt's shared prefix in
    the KV cache so that eviction under load does not lose it (see
    :meth:`~llminfer.kv.manager.KVCacheManager.pin_prefix`). Prefixes are found by their content either
    way; the key only keeps them.

    Raises:
        InvalidRequestError: an empty prompt (``param="prompt"``), a bad sampling value (``param`` names
            the field), an unknown keyword (``code="unsupported_parameter"``), or ``n`` other than 1.
    """
    if isinstance(prompt, str):
        p: str | tuple[int, ...] = prompt
    else:
        try:
            p = tuple(int(t) for t in prompt)
        except (TypeError, ValueError):
            raise InvalidRequestError("prompt must be a string or a sequence of token ids", param="prompt") from None
    if not p:
        raise InvalidRequestError("prompt is empty", param="prompt")
    if sampling.get("n", 1) != 1:
        raise InvalidRequestError("n > 1 makes several requests: use make_requests(..., n=) or run_n()", param="n")
    unknown = sorted(set(sampling) - SAMPLING_FIELDS)
    if unknown:
        hint = ""
        if unknown[0] in ("response_format", "json_schema", "guided_json", "guided_regex", "guided_choice",
                          "guided_grammar", "regex", "choice", "grammar"):
            hint = " (constrain the output with structured_output=StructuredOutput(...))"
        raise InvalidRequestError(f"unknown sampling argument {unknown[0]!r}{hint}", param=unknown[0],
                                  code="unsupported_parameter")
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed, stop_sequences=stop_sequences or (), ignore_eos=ignore_eos, **sampling)
    return GenerationRequest(uuid.uuid4().hex, p, params, time.perf_counter_ns(), priority=priority,
                             cache_salt=cache_salt, adapter_name=adapter_name, prefix_key=prefix_key)


SAMPLING_FIELDS = frozenset(a.name for a in SamplingParams.__attrs_attrs__)  # type: ignore[attr-defined]


def _why(text: str, exc: BaseException) -> str:
    """Why ``text`` could not be tokenized, in words: a lone surrogate (not valid Unicode; the tokenizer's
    own message names a type) is the usual cause; else the tokenizer's message. Only on the error path."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as bad:
        return (f"it is not valid Unicode (a lone surrogate U+{ord(text[bad.start]):04X} at character "
                f"{bad.start})")
    return one_line(exc)


class InputProcessor:
    """Tokenizes and validates prompts.

    Args:
        tokenizer: encodes text prompts (token-id prompts skip it).
        max_model_len: context length in tokens; a prompt must leave room for one generated token.
        vocab_size: token-id prompts must be below it (None: not checked, the backend checks).
        grammars: compiles structured-output constraints (None: the backend takes them itself, or
            refuses them).
    """

    def __init__(self, tokenizer: Tokenizer, max_model_len: int, vocab_size: int | None = None,
                 grammars: GrammarCompiler | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.grammars = grammars

    def encode(self, text: str, *, param: str = "prompt", add_special_tokens: bool = True) -> tuple[int, ...]:
        """Token ids of ``text``.

        Raises:
            InvalidRequestError: the text is empty, cannot be tokenized (a lone surrogate, ...), or
                tokenizes to no tokens.
        """
        if not text:
            raise InvalidRequestError(f"{param} is empty", param=param)
        self.check_text_size(text, param=param)
        try:
            ids = tuple(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except BaseException as exc:  # noqa: BLE001 - the tokenizer's own errors (a Rust panic too) are the input's
            if is_fatal(exc):
                raise
            raise InvalidRequestError(f"{param} could not be tokenized: {_why(text, exc)}", param=param) from None
        if not ids:
            raise InvalidRequestError(f"{param} is empty (it tokenizes to no tokens)", param=param)
        return ids

    async def encode_async(self, text: str, *, param: str = "prompt", add_special_tokens: bool = True
                           ) -> tuple[int, ...]:
        """:meth:`encode` from inside an event loop: a text over :data:`INLINE_TOKENIZE_CHARS` characters
        is size-checked at once and tokenized in a worker thread. Raises as :meth:`encode`."""
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return self.encode(text, param=param, add_special_tokens=add_special_tokens)
        import anyio.to_thread

        self.check_text_size(text, param=param)
        return await anyio.to_thread.run_sync(
            lambda: self.encode(text, param=param, add_special_tokens=add_special_tokens))

    @property
    def max_prompt_chars(self) -> int:
        """The longest text prompt (characters) worth tokenizing: ``max_model_len`` x
        :data:`MAX_CHARS_PER_TOKEN`."""
        return self.max_model_len * MAX_CHARS_PER_TOKEN

    def check_text_size(self, text: str, *, param: str = "prompt") -> None:
        """Refuse, in O(1), a text too long to fit the context whatever its tokens.

        Raises:
            InvalidRequestError: ``code="context_length_exceeded"``, with ``param``.
        """
        if len(text) > self.max_prompt_chars:
            raise InvalidRequestError(
                f"{param} has {len(text)} characters, more than the model's context of {self.max_model_len} "
                f"tokens can hold (at most {self.max_prompt_chars} characters are tokenized); shorten it",
                param=param, code=CONTEXT_LENGTH_EXCEEDED)

    def check_prompt_ids(self, ids: Sequence[int], *, max_new_tokens: int | None = None,
                         param: str = "prompt") -> tuple[int, ...]:
        """Check a tokenized prompt against the vocabulary and the context; returns it as a tuple.

        ``max_new_tokens`` (when given) must fit in the context after the prompt too.

        Raises:
            InvalidRequestError: empty, token ids outside the vocabulary (``code="invalid_value"``), or
                too long (``code="context_length_exceeded"``).
        """
        ids = tuple(ids)
        if not ids:
            raise InvalidRequestError(f"{param} is empty", param=param)
        if self.vocab_size is not None and any(not 0 <= t < self.vocab_size for t in ids):
            raise InvalidRequestError(f"{param} token ids must be in [0, {self.vocab_size})", param=param)
        n, limit = len(ids), self.max_model_len
        if n >= limit:
            raise InvalidRequestError(
                f"{param} has {n} tokens but the model's context is {limit} tokens; it must leave room for at "
                "least one generated token", param=param, code=CONTEXT_LENGTH_EXCEEDED)
        if max_new_tokens is not None and n + max_new_tokens > limit:
            raise InvalidRequestError(
                f"the model's context is {limit} tokens, but {n + max_new_tokens} were requested ({n} in the "
                f"{param}, {max_new_tokens} to generate); shorten the prompt or lower the output length",
                param=param, code=CONTEXT_LENGTH_EXCEEDED)
        return ids

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        """Token ids a request names (``logit_bias`` keys, ``stop_token_ids``) must be in the vocabulary.

        Raises:
            InvalidRequestError: naming ``param`` and the first id outside ``[0, vocab_size)``.
        """
        if self.vocab_size is None:
            return
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise InvalidRequestError(f"{param}: token id {t} is outside the vocabulary [0, {self.vocab_size})",
                                          param=param)

    def word_variants(self, word: str, param: str = "bad_words") -> tuple[tuple[int, ...], ...]:
        """Token sequences of ``word`` with a leading space (first) and without, duplicates removed.

        Raises:
            InvalidRequestError: the word cannot be tokenized.
        """
        texts = [" " + word.lstrip(), word] if not word.startswith(" ") else [word, word.lstrip()]
        try:
            seqs = [tuple(self.tokenizer.encode(t, add_special_tokens=False)) for t in texts]
        except BaseException as exc:  # noqa: BLE001 - see encode
            if is_fatal(exc):
                raise
            raise InvalidRequestError(f"word {word!r} could not be tokenized: {_why(word, exc)}",
                                      param=param) from None
        return tuple(dict.fromkeys(s for s in seqs if s))

    def process(self, req: GenerationRequest, *, param: str = "prompt",
                grammar: GrammarHandle | None = None) -> TokenizedRequest:
        """Tokenize and validate one request (prompt, bad and forced words, the prefix-cache keys), and
        start compiling its structured-output constraint (the scheduler waits for it). The tokenize stage
        calls it for the Python API's requests; an HTTP route calls it itself and submits the result, which
        the tokenize stage then passes on untouched (so a request is validated once).

        Args:
            req: the request (a token-id prompt is not tokenized again).
            param: the name of the prompt in errors (``"messages"``, ``"prompt[1]"``).
            grammar: the constraint's compile, already started by the caller (the ``n`` choices of one HTTP
                call share one); None: submitted here when the request has a constraint.

        Raises:
            InvalidRequestError: see :meth:`encode` and :meth:`check_prompt_ids` (the prompt plus
                ``max_new_tokens`` must fit in the context), :meth:`check_token_ids` and
                :meth:`word_variants`.
        """
        if isinstance(req.prompt, str):
            ids = self.encode(req.prompt, param=param)
        else:
            ids = tuple(req.prompt)
        params = req.params
        ids = self.check_prompt_ids(ids, max_new_tokens=params.max_new_tokens, param=param)
        self.check_token_ids([t for t, _ in params.logit_bias], "logit_bias")
        self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        bad = tuple(dict.fromkeys(v for w in params.bad_words for v in self.word_variants(w)))
        force = tuple(self.word_variants(w, "force_words") for w in params.force_words)
        if grammar is None and params.structured_output is not None and self.grammars is not None:
            grammar = self.grammars.submit(params.structured_output)
        return TokenizedRequest(
            request_id=req.request_id,
            prompt_token_ids=ids,
            params=params,
            arrival_ns=req.arrival_ns,
            priority=req.priority,
            extra_keys=encode_extra_keys(req.adapter_name, req.cache_salt),
            bad_words_ids=bad,
            force_words_ids=force,
            grammar=grammar,
            prefix_key=req.prefix_key,
            adapter_name=req.adapter_name,
        )

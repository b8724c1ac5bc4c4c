"""Structured output: a JSON Schema, any JSON object, a regular expression, a grammar or a choice,
enforced while decoding by a per-row token mask from `xgrammar <https://github.com/mlc-ai/xgrammar>`_.

Why xgrammar (measured on this project's built-in Qwen2 tokenizer, 151,646 tokens, 2-core AVX2 CPU shared
with other jobs, one thread, the 120-schema test corpus, ``python bench/bench_structured.py --only library``):
the next-token mask costs p50 0.008 / p99 0.17 / max 0.5 ms per token, against llguidance's p50 0.04 /
p99 1.9 / max 2.8 ms; llguidance compiles a schema faster (p50 1.4 / p99 3.8 ms, its first mask included,
against 11 / 45 ms), but compiling happens once per schema, off the step, and is cached, while the mask is
paid on every step of every constrained row. xgrammar also has the CUDA mask kernel the GPU path will use,
and it is what vLLM and SGLang ship.

How it flows:

1. the caller sets ``SamplingParams.structured_output`` to a :class:`StructuredOutput`;
2. the tokenize stage submits it to the engine's :class:`GrammarCompiler`, which compiles it in a worker
   thread (xgrammar releases the GIL), caches it by (constraint, tokenizer), and hands back a
   :class:`GrammarHandle` at once;
3. the scheduler keeps the request waiting until its grammar is ready, and fails it (``param`` named) if
   compiling failed or ran past ``timeout_s``; other requests are scheduled meanwhile;
4. the backend's sampler keeps one :class:`GrammarMatcher` per constrained request: each step it fills the
   row's allowed-token bitmask, masks the logits, and after sampling advances the matcher by the token.

JSON is generated compactly (``,`` and ``:`` with no spaces, no whitespace between tokens), so a model that
keeps choosing spaces cannot run away; EOS is allowed only where the grammar accepts.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:  # torch is imported where a tensor is made: the CLI checks StructuredOutput before loading
    import torch

from llminfer.errors import InvalidRequestError, one_line

PARAM = "structured_output"
COMPACT = (",", ":")  # JSON item and key separators: no whitespace anywhere, so none can run away


MAX_SCHEMA_DEPTH = 64
"""Deepest nesting of objects and arrays a JSON Schema may have. xgrammar's compile time grows steeply
with depth (an ``items`` chain 300 deep takes seconds, 900 deep over a minute, and a compile cannot be
interrupted), and Python's ``json`` module overflows its recursion limit near 1,000; real schemas stay far
below this (OpenAI's strict mode allows 10 levels of nesting)."""


def _depth(value: Any) -> int:
    """Nesting depth of dicts and lists in ``value``, iteratively (a deep value must not recurse); stops
    counting just past :data:`MAX_SCHEMA_DEPTH`."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_SCHEMA_DEPTH:
                stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _external_ref(value: Any) -> str | None:
    """The first ``$ref`` in ``value`` that does not point inside the schema (``#...``), or None."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
                return str(ref)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


def _schema_text(value: Any) -> str | None:
    """A JSON Schema as compact JSON text (key order kept: it is the order properties are generated in)."""
    if value is None:
        return None
    if isinstance(value, type) and hasattr(value, "model_json_schema"):  # a pydantic model class
        value = value.model_json_schema()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except RecursionError:  # nested past Python's recursion limit, so past the depth limit too
            raise InvalidRequestError(f"json_schema nests objects and arrays deeper than {MAX_SCHEMA_DEPTH} "
                                      "levels", param=PARAM) from None
        except ValueError as exc:
            raise InvalidRequestError(f"json_schema is not valid JSON: {exc}", param=PARAM) from None
    if not isinstance(value, (dict, bool)):
        raise InvalidRequestError("json_schema must be a JSON Schema object (a dict, JSON text or a pydantic "
                                  f"model class), got {type(value).__name__}", param=PARAM)
    if _depth(value) > MAX_SCHEMA_DEPTH:
        raise InvalidRequestError(f"json_schema nests objects and arrays deeper than {MAX_SCHEMA_DEPTH} levels",
                                  param=PARAM)
    external = _external_ref(value)
    if external is not None:  # xgrammar only warns and leaves that part unconstrained
        raise InvalidRequestError(f"json_schema: $ref {external!r} is not supported; only references inside the "
                                  "schema ('#/...') are", param=PARAM)
    try:
        return json.dumps(value, separators=(",", ":"))
    except (TypeError, ValueError) as exc:  # a value JSON cannot hold (a set, an object), or a cycle
        raise InvalidRequestError(f"json_schema is not JSON: {exc}", param=PARAM) from None


def _choices(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    # A list or tuple only: a string, a number, a dict (its keys) or a one-shot iterator is a client mistake.
    if not isinstance(value, (list, tuple)) or not all(isinstance(c, str) for c in value):
        raise InvalidRequestError("choice must be a list of strings", param=PARAM)
    return tuple(value)


@attrs.frozen(kw_only=True)
class StructuredOutput:
    """One output constraint: exactly one of the fields (the names of vLLM's ``StructuredOutputsParams``).

    Attributes:
        json_schema: a JSON Schema (dict, JSON text, or a pydantic model class); kept as canonical JSON text
            of its normalized form (:func:`llminfer.sampling.schema.normalize_schema`: rewritten into what
            xgrammar enforces exactly, or refused).
        strict: with ``json_schema``: close every object the schema leaves open (OpenAI's ``strict: true``);
            otherwise objects without ``additionalProperties`` are open, as JSON Schema means them.
        json_object: any JSON object (OpenAI ``response_format: {"type": "json_object"}``).
        regex: a regular expression the whole output must match.
        grammar: a context-free grammar in xgrammar's EBNF (GBNF-style: ``root ::= "yes" | "no"``).
        choice: the output is exactly one of these strings.

    Raises:
        InvalidRequestError: none or more than one constraint, or a value of the wrong type
            (``param="structured_output"``); a :class:`~llminfer.sampling.schema.SchemaError` naming the
            keyword for a schema that cannot be enforced.
    """

    json_schema: str | None = attrs.field(default=None, converter=_schema_text)
    strict: bool = False
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = attrs.field(default=None, converter=_choices)

    def __attrs_post_init__(self) -> None:
        given = [name for name in ("json_schema", "regex", "grammar", "choice") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise InvalidRequestError("structured output takes exactly one of json_schema, json_object, regex, "
                                      f"grammar or choice; got {given or 'none'}", param=PARAM)
        if not isinstance(self.json_object, bool):  # "no" would otherwise count as true
            raise InvalidRequestError("json_object must be true or false", param=PARAM)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{name} must be a non-empty string", param=PARAM)
        if self.choice is not None and (not self.choice or not all(self.choice)):
            raise InvalidRequestError("choice must be a non-empty list of non-empty strings", param=PARAM)
        if not isinstance(self.strict, bool):
            raise InvalidRequestError("strict must be true or false", param=PARAM)
        if self.json_schema is not None:
            from llminfer.sampling.schema import normalize_schema

            normalized = normalize_schema(json.loads(self.json_schema), strict=self.strict)
            object.__setattr__(self, "json_schema", json.dumps(normalized, separators=COMPACT))

    @property
    def kind(self) -> str:
        """``"json_schema"``, ``"json_object"``, ``"regex"``, ``"grammar"`` or ``"choice"``."""
        if self.json_object:
            return "json_object"
        return next(n for n in ("json_schema", "regex", "grammar", "choice") if getattr(self, n) is not None)

    def to_ebnf_choice(self) -> str:
        """The choice as an EBNF grammar (JSON string escapes are valid EBNF literals in xgrammar)."""
        assert self.choice is not None
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)


class GrammarHandle:
    """A grammar being compiled: ready when the compile finished or its deadline passed.

    Args:
        future: the compile, running in the compiler's thread pool.
        deadline: ``clock()`` value (s) after which an unfinished compile counts as failed.
        clock: the clock ``deadline`` is on (injected in tests).
        timeout_s: for the error message.
    """

    __slots__ = ("future", "deadline", "clock", "timeout_s")

    def __init__(self, future: concurrent.futures.Future, deadline: float, clock: Callable[[], float],
                 timeout_s: float) -> None:
        self.future = future
        self.deadline = deadline
        self.clock = clock
        self.timeout_s = timeout_s

    def ready(self) -> bool:
        """True once :meth:`result` returns or raises without waiting."""
        return self.future.done() or self.clock() >= self.deadline

    def result(self) -> Any:
        """The compiled grammar (an ``xgrammar.CompiledGrammar``), once :meth:`ready`.

        Raises:
            InvalidRequestError: the constraint is invalid or unsupported, or compiling ran past the
                time limit (``code="grammar_compile_timeout"``); ``param="structured_output"``.
        """
        if not self.future.done():
            raise InvalidRequestError(
                f"the structured-output constraint did not compile within {self.timeout_s:g} s; simplify the "
                "schema or grammar", param=PARAM, code="grammar_compile_timeout")
        return self.future.result()

    async def wait(self) -> Any:
        """Wait (without blocking the event loop) until ready, then return :meth:`result`."""
        import anyio

        left = self.deadline - self.clock()
        if not self.future.done() and left > 0:
            with anyio.move_on_after(left):
                await anyio.to_thread.run_sync(concurrent.futures.wait, [self.future], abandon_on_cancel=True)
        return self.result()


class GrammarCompiler:
    """Compiles :class:`StructuredOutput` constraints for one tokenizer, off the step, with a cache.

    The xgrammar tokenizer info (a pass over the vocabulary, ~1 s for 150k tokens) is built on first use
    in a worker thread, so engines that never see a constrained request never pay for it.

    A compile cannot be interrupted, and a hostile constraint can run for minutes after its request has
    timed out. So there are several worker threads (one such compile does not hold up the others), and a
    compile that reaches a worker after every request waiting for it has passed its deadline is skipped
    rather than run for nobody (a backlog behind a slow compile then drains at once).

    Args:
        tokenizer: a Hugging Face tokenizer (``PreTrainedTokenizerBase``).
        vocab_size: the model's logits width (may exceed the tokenizer's: padded embeddings).
        stop_token_ids: the ids that end a request (EOS); the mask allows them only where the grammar accepts.
        timeout_s: a compile still running after this many seconds fails its request.
        cache_size: compiled grammars kept (least recently used dropped first).
        max_workers: compile threads (compiles run in parallel: xgrammar releases the GIL).
        clock: seconds, monotonic (injected in tests).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], *, timeout_s: float = 10.0,
                 cache_size: int = 256, max_workers: int = 4, clock: Callable[[], float] = time.monotonic) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self.clock = clock
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="llminfer-grammar")
        self._cache: OrderedDict[StructuredOutput, _Compile] = OrderedDict()
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()
        self._compiler: Any = None
        self.compile_times_s: list[float] = []  # of each cache miss, for the benchmark

    def submit(self, spec: StructuredOutput) -> GrammarHandle:
        """Start compiling ``spec`` (or reuse the cached compile) and return its handle at once."""
        deadline = self.clock() + self.timeout_s
        with self._lock:
            entry = self._cache.get(spec)
            if entry is not None and entry.future.done() and entry.future.exception() is not None:
                entry = None  # a failed compile is not cached: the error is re-raised by a new compile
            if entry is None:
                entry = _Compile(deadline)
                entry.future = self._pool.submit(self._compile_if_wanted, spec, entry)
                self._cache[spec] = entry
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            entry.deadline = max(entry.deadline, deadline)
            self._cache.move_to_end(spec)
        return GrammarHandle(entry.future, deadline, self.clock, self.timeout_s)

    def prepare(self) -> concurrent.futures.Future:
        """Build the tokenizer info now, in the compile thread (a server calls this at start, so its first
        constrained request does not pay for it)."""
        return self._pool.submit(self._xgrammar)

    def compile(self, spec: StructuredOutput) -> Any:
        """Compile ``spec`` now, in the calling thread's wait (for tests and tools).

        Raises:
            InvalidRequestError: see :meth:`GrammarHandle.result`.
        """
        handle = self.submit(spec)
        concurrent.futures.wait([handle.future], timeout=max(0.0, handle.deadline - self.clock()))
        return handle.result()

    def close(self) -> None:
        """Stop the compile threads (a compile in progress finishes in the background)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _xgrammar(self) -> Any:
        # Only the compile thread calls this (max_workers threads share the lock below).
        with self._build_lock:
            return self._build()

    def _build(self) -> Any:
        if self._compiler is None:
            try:
                import xgrammar
            except ImportError as exc:  # pragma: no cover - a declared dependency
                raise InvalidRequestError(f"structured output needs xgrammar: {exc}", param=PARAM) from None
            try:
                info = text_only_tokenizer_info(xgrammar, self.tokenizer, self.vocab_size, self.stop_token_ids)
            except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer that is not a Hugging Face one
                raise InvalidRequestError(f"structured output is not available for this tokenizer: {one_line(exc)}",
                                          param=PARAM) from None
            # The cache is ours (keyed by the constraint); xgrammar's own would hold a second copy.
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def _compile_if_wanted(self, spec: StructuredOutput, entry: _Compile) -> Any:
        with self._lock:  # ordered against submit(): a request that joins this compile moves its deadline
            if self.clock() >= entry.deadline:
                if self._cache.get(spec) is entry:
                    del self._cache[spec]  # the next request for this constraint compiles it afresh
                raise InvalidRequestError(
                    f"the structured-output constraint did not compile within {self.timeout_s:g} s (it waited "
                    "behind other compiles); retry, or simplify the schema or grammar", param=PARAM,
                    code="grammar_compile_timeout")
        return self._compile(spec)

    def _compile(self, spec: StructuredOutput) -> Any:
        compiler = self._xgrammar()
        start = time.perf_counter()
        try:
            kind = spec.kind
            if kind == "json_schema":
                compiled = _compile_schema(compiler, spec.json_schema)
            elif kind == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=COMPACT)
            elif kind == "regex":
                compiled = compiler.compile_regex(spec.regex)
            elif kind == "grammar":
                compiled = compiler.compile_grammar(spec.grammar)
            else:
                compiled = compiler.compile_grammar(spec.to_ebnf_choice())
        except Exception as exc:  # noqa: BLE001 - xgrammar reports bad input as RuntimeError
            raise InvalidRequestError(f"invalid or unsupported {spec.kind.replace('_', ' ')}: {_clean(exc)}",
                                      param=PARAM) from None
        self.compile_times_s.append(time.perf_counter() - start)
        return compiled


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


# xgrammar 0.2.9 writes the characters of a string with minLength / maxLength as this class, which lets
# raw control characters (a tab, NUL) into the string: not JSON (RFC 8259 section 7), and ``json.loads``
# refuses it. Its unbounded strings use the right class, the same minus U+0000-U+001F.
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'


def _compile_schema(compiler: Any, schema: str) -> Any:
    """Compile a JSON Schema so that every output is valid JSON (see ``_LOOSE_STRING_CHAR``)."""
    import xgrammar

    # Not xgrammar's strict mode, which closes every object and array: the normalized schema says where
    # objects are closed (llminfer.sampling.schema).
    kw = dict(any_whitespace=False, separators=COMPACT, strict_mode=False)
    ebnf = str(xgrammar.Grammar.from_json_schema(schema, **kw))
    if _LOOSE_STRING_CHAR in ebnf:
        try:
            return compiler.compile_grammar(ebnf.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))
        except Exception:  # noqa: BLE001 - a grammar that does not round-trip: keep xgrammar's own
            pass
    return compiler.compile_json_schema(schema, **kw)


class _Compile:
    """A cache entry: the compile's future, and the latest deadline of the requests waiting for it."""

    __slots__ = ("future", "deadline")

    def __init__(self, deadline: float) -> None:
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.deadline = deadline


def _clean(exc: Exception) -> str:
    """xgrammar's C++ messages start with ``[time] /path/file.cc:line:``; keep what follows."""
    text = one_line(exc)
    head, sep, tail = text.partition(".cc:")
    if sep and head.startswith("["):
        text = tail.split(":", 1)[-1].strip()
    return text


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

"""Compiling structured-output constraints: :class:`GrammarCompiler` (off the step, cached, with a deadline
per request; hostile compiles run in killable processes of the compile server), the :class:`GrammarHandle`
a request waits on, and xgrammar's tokenizer info with special tokens that never stand for text.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from llminfer.errors import InvalidRequestError, one_line
from llminfer.sampling.constraint import COMPACT, PARAM, StructuredOutput, _enum_values
from llminfer.sampling.grammar_mask import check_first_token
from llminfer.sampling.grammar_server import _CompileServer
from llminfer.sampling.tokenizer_info import text_only_tokenizer_info


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

    The xgrammar tokenizer info (a pass over the whole vocabulary) is built on first use in a worker
    thread, so engines that never see a constrained request never pay for it.

    xgrammar's compile cannot be interrupted, and a hostile constraint can run for minutes. So each compile
    thread hands its compile to the compile server (:mod:`llminfer.sampling.grammar_worker`, with
    ``isolate=True``, the default), which runs it in a forked process of its own, and has that process
    killed once every request waiting for the compile has passed its deadline: a timed-out compile frees its
    thread and its CPU at once. Small JSON Schemas compile in the thread (:func:`_may_be_slow`). The
    compiled grammar comes back serialized (``CompiledGrammar.serialize_json``). The server starts in the background on first use (or :meth:`prepare`); until it
    is up, compiles run in the threads themselves, uninterruptible, as without ``isolate``. Schemas too
    large to compile in time are refused before they take a slot (:data:`MAX_SCHEMA_CHARS`,
    :data:`MAX_ENUM_VALUES`). A compile that reaches a thread after every request waiting for it has passed
    its deadline is skipped rather than run for nobody (a backlog behind slow compiles drains at once).

    Compiled grammars are cached by constraint (the normalized schema's canonical text is part of it, so
    two spellings of one schema share an entry); :attr:`cache_hits` / :attr:`cache_misses` /
    :attr:`compile_timeouts` count what happened (the server's ``/metrics`` reports them).

    Args:
        tokenizer: a Hugging Face tokenizer (``PreTrainedTokenizerBase``).
        vocab_size: the model's logits width (may exceed the tokenizer's: padded embeddings).
        stop_token_ids: the ids that end a request (EOS); the mask allows them only where the grammar accepts.
        timeout_s: a compile still running after this many seconds fails its request.
        cache_size: compiled grammars kept (least recently used dropped first).
        max_workers: compile threads, each with at most one worker process (compiles run in parallel).
        clock: seconds, monotonic (injected in tests).
        isolate: compile in killable worker processes (False: in the threads themselves, uninterruptible).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], *, timeout_s: float = 10.0,
                 cache_size: int = 256, max_workers: int = 4, clock: Callable[[], float] = time.monotonic,
                 isolate: bool = True) -> None:
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
        self.isolate = isolate
        self._info_json: str | None = None  # the tokenizer info, serialized, for worker processes
        self._server: _CompileServer | None = None  # started on first use (isolate)
        self._local = threading.local()  # the cache entry the calling compile thread works for
        self.cache_hits = 0
        self.cache_misses = 0
        self.compile_timeouts = 0
        self.workers_killed = 0

    def submit(self, spec: StructuredOutput) -> GrammarHandle:
        """Start compiling ``spec`` (or reuse the cached compile) and return its handle at once."""
        deadline = self.clock() + self.timeout_s
        with self._lock:
            entry = self._cache.get(spec)
            if entry is not None and entry.future.done() and entry.future.exception() is not None:
                entry = None  # a failed compile is not cached: the error is re-raised by a new compile
            if entry is None:
                self.cache_misses += 1
                entry = _Compile(deadline)
                entry.future = self._pool.submit(self._compile_if_wanted, spec, entry)
                self._cache[spec] = entry
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            else:
                self.cache_hits += 1
            entry.deadline = max(entry.deadline, deadline)
            self._cache.move_to_end(spec)
        return GrammarHandle(entry.future, deadline, self.clock, self.timeout_s)

    def prepare(self) -> concurrent.futures.Future:
        """Build the tokenizer info now, in the compile thread (a server calls this at start, so its first
        constrained request does not pay for it)."""
        return self._pool.submit(self._prepare)

    def wait_ready(self, timeout_s: float) -> bool:
        """:meth:`prepare`, then wait (at most ``timeout_s`` s) for the compile server to start: its
        interpreter imports xgrammar and loads the tokenizer info, seconds of a core that would otherwise
        overlap the first requests (``serve`` waits before it listens). Returns whether it is ready."""
        deadline = time.monotonic() + timeout_s
        try:
            self.prepare().result(timeout=timeout_s)
        except Exception:  # noqa: BLE001 - xgrammar missing or the build failed: constrained requests say why
            return False
        server = self._server
        return not self.isolate or server is None or server.wait_ready(deadline)

    def _prepare(self) -> None:
        self._xgrammar()
        if self.isolate:
            self._compile_server()  # started now, so the first constrained requests need not wait for it

    def compile(self, spec: StructuredOutput) -> Any:
        """Compile ``spec`` now, in the calling thread's wait (for tests and tools).

        Raises:
            InvalidRequestError: see :meth:`GrammarHandle.result`.
        """
        handle = self.submit(spec)
        concurrent.futures.wait([handle.future], timeout=max(0.0, handle.deadline - self.clock()))
        return handle.result()

    def close(self) -> None:
        """Stop the compile threads and the idle worker processes (a compile in progress finishes in the
        background, and its worker is stopped after it)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            server, self._server = self._server, None
            self._closed = True
        if server is not None:
            server.close()

    def stop_workers(self) -> None:
        """Stop the compile server process (the compiler stays usable: the next compile starts another)."""
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.close()

    def stats(self) -> dict[str, int]:
        """Counts since start: ``cache_hits``, ``cache_misses`` (compiles started), ``compile_timeouts``
        (compiles that ran past their deadline), ``workers_killed`` (compile processes killed for it)."""
        return {"cache_hits": self.cache_hits, "cache_misses": self.cache_misses,
                "compile_timeouts": self.compile_timeouts, "workers_killed": self.workers_killed}

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
            self._info = info
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
        self._local.entry = entry
        try:
            return self._compile(spec)
        finally:
            self._local.entry = None

    def _compile(self, spec: StructuredOutput) -> Any:
        compiler = self._xgrammar()
        start = time.perf_counter()
        if self.isolate and _may_be_slow(spec):
            compiled = self._compile_in_worker(spec, compiler)
        else:
            try:
                compiled = _compile_spec(compiler, spec)
            except Exception as exc:  # noqa: BLE001 - xgrammar reports bad input as RuntimeError
                raise InvalidRequestError(f"invalid or unsupported {spec.kind.replace('_', ' ')}: {clean_error(exc)}",
                                          param=PARAM) from None
        self.compile_times_s.append(time.perf_counter() - start)
        check_first_token(compiled, spec.kind, self.vocab_size, self.stop_token_ids)
        return compiled

    def _compile_in_worker(self, spec: StructuredOutput, compiler: Any) -> Any:
        """Compile ``spec`` in the compile server (in a process of its own); kill that process once nobody
        waits for the result any more. While the server is still starting, compile here instead.

        Raises:
            InvalidRequestError: the constraint is invalid, the process died, or the deadline of every
                request waiting for it passed (``code="grammar_compile_timeout"``).
        """
        import xgrammar

        server = self._compile_server()
        if server is None:  # still starting: compile in this thread (uninterruptible, as without isolate)
            try:
                return _compile_spec(compiler, spec)
            except Exception as exc:  # noqa: BLE001 - xgrammar reports bad input as RuntimeError
                raise InvalidRequestError(f"invalid or unsupported {spec.kind.replace('_', ' ')}: {clean_error(exc)}",
                                          param=PARAM) from None
        entry: _Compile | None = getattr(self._local, "entry", None)
        job = server.submit(spec)
        while True:
            left = (entry.deadline if entry is not None else self.clock() + self.timeout_s) - self.clock()
            if left <= 0:
                server.kill(job)
                with self._lock:
                    self.compile_timeouts += 1
                    self.workers_killed += 1
                raise InvalidRequestError(
                    f"the structured-output constraint did not compile within {self.timeout_s:g} s; its compile "
                    "was stopped; simplify the schema or grammar", param=PARAM, code="grammar_compile_timeout")
            if job.done.wait(min(left, 0.25)):
                break
        status, payload = job.reply
        if status != "ok":
            raise InvalidRequestError(f"invalid or unsupported {spec.kind.replace('_', ' ')}: {payload}", param=PARAM)
        return xgrammar.CompiledGrammar.deserialize_json(payload, self._info)

    def _compile_server(self) -> _CompileServer | None:
        """The running compile server, or None while it starts (it is started here on first use)."""
        with self._lock:
            server = self._server
            if server is not None and server.failed:
                server = self._server = None  # it died: start another
            if server is None and not getattr(self, "_closed", False):
                if self._info_json is None:
                    self._info_json = self._info.serialize_json()
                server = self._server = _CompileServer(self._info_json)
        return server if server is not None and server.ready.is_set() else None


SMALL_SCHEMA_CHARS = 4096
"""A JSON Schema (or choice) up to this many characters, with at most :data:`SMALL_ENUM_VALUES` enum values
and no pattern, compiles in the compile thread itself: its compile time is bounded by its size, and
shorter than the round trip through a compile process (most of which is loading the serialized grammar
back)."""
SMALL_ENUM_VALUES = 128


def _may_be_slow(spec: StructuredOutput) -> bool:
    """Whether ``spec`` goes to a killable compile process: regular expressions and grammars always
    (a short one can compile slowly), JSON Schemas and choices unless small (:data:`SMALL_SCHEMA_CHARS`)."""
    kind = spec.kind
    if kind == "json_object":
        return False
    if kind == "choice":
        return len(spec.choice or ()) > SMALL_ENUM_VALUES or sum(map(len, spec.choice or ())) > SMALL_SCHEMA_CHARS
    if kind != "json_schema":
        return True
    text = spec.json_schema or ""
    return len(text) > SMALL_SCHEMA_CHARS or '"pattern":' in text or (
        '"enum":' in text and _enum_values(json.loads(text)) > SMALL_ENUM_VALUES)


def _compile_spec(compiler: Any, spec: StructuredOutput) -> Any:
    """``spec`` compiled by an ``xgrammar.GrammarCompiler`` (raises what xgrammar raises)."""
    kind = spec.kind
    if kind == "json_schema":
        return _compile_schema(compiler, spec.json_schema)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=COMPACT)
    if kind == "regex":
        return compiler.compile_regex(spec.regex)
    if kind == "grammar":
        return compiler.compile_grammar(spec.grammar)
    return compiler.compile_grammar(spec.to_ebnf_choice())


def check_grammar_syntax(spec: StructuredOutput) -> None:
    """Build ``spec``'s grammar without a tokenizer, so that a schema, regular expression or grammar
    xgrammar cannot read is refused before a model is loaded (the CLI calls it first). Parsing is cheap:
    the costly part of compiling, the token mask tables, needs the tokenizer and is left to
    :class:`GrammarCompiler`. Does nothing without xgrammar (the compiler then says so).

    Raises:
        InvalidRequestError: xgrammar refuses the constraint (``param="structured_output"``).
    """
    try:
        import xgrammar
    except ImportError:
        return
    kind = spec.kind
    try:
        if kind == "json_schema":
            xgrammar.Grammar.from_json_schema(spec.json_schema, any_whitespace=False, separators=COMPACT,
                                              strict_mode=False)
        elif kind == "regex":
            xgrammar.Grammar.from_regex(spec.regex)
        elif kind == "grammar":
            xgrammar.Grammar.from_ebnf(spec.grammar)
        elif kind == "choice":
            xgrammar.Grammar.from_ebnf(spec.to_ebnf_choice())
    except Exception as exc:  # noqa: BLE001 - xgrammar reports bad input as RuntimeError
        raise InvalidRequestError(f"invalid or unsupported {kind.replace('_', ' ')}: {clean_error(exc)}",
                                  param=PARAM) from None


# xgrammar 0.2.9 writes the characters of a string with minLength / maxLength as this class, which lets
# raw control characters (a tab, NUL) into the string: not JSON (RFC 8259 section 7), and ``json.loads``
# refuses it. Its unbounded strings use the right class, the same minus U+0000-U+001F.
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'


def _schema_ebnf(schema: str) -> tuple[str, bool]:
    """``schema`` (JSON text) as xgrammar EBNF with compact separators, and whether its string characters
    were narrowed to JSON's (see ``_LOOSE_STRING_CHAR``)."""
    import xgrammar

    # Not xgrammar's strict mode, which closes every object and array: the normalized schema says where
    # objects are closed (llminfer.sampling.schema).
    ebnf = str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=False, separators=COMPACT, strict_mode=False))
    return ebnf.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR), _LOOSE_STRING_CHAR in ebnf


def spec_ebnf(spec: StructuredOutput) -> str:
    """``spec`` as the xgrammar EBNF text it is enforced with (a JSON Schema with compact separators and JSON
    strings), to be combined with other grammars (``xgrammar.Grammar.union`` / ``concat``).

    Raises:
        Exception: what xgrammar raises for a constraint it cannot read.
    """
    import xgrammar

    kind = spec.kind
    if kind in ("json_schema", "json_object"):
        return _schema_ebnf(spec.json_schema if kind == "json_schema" else '{"type": "object"}')[0]  # type: ignore[arg-type]
    if kind == "regex":
        return str(xgrammar.Grammar.from_regex(spec.regex))
    return spec.grammar if kind == "grammar" else spec.to_ebnf_choice()  # type: ignore[return-value]


def _compile_schema(compiler: Any, schema: str) -> Any:
    """Compile a JSON Schema so that every output is valid JSON (see ``_LOOSE_STRING_CHAR``)."""
    ebnf, narrowed = _schema_ebnf(schema)
    if narrowed:
        try:
            return compiler.compile_grammar(ebnf)
        except Exception:  # noqa: BLE001 - a grammar that does not round-trip: keep xgrammar's own
            pass
    return compiler.compile_json_schema(schema, any_whitespace=False, separators=COMPACT, strict_mode=False)


class _Compile:
    """A cache entry: the compile's future, and the latest deadline of the requests waiting for it."""

    __slots__ = ("future", "deadline")

    def __init__(self, deadline: float) -> None:
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.deadline = deadline


def clean_error(exc: Exception) -> str:
    """xgrammar's C++ messages start with ``[time] /path/file.cc:line:``; keep what follows."""
    text = one_line(exc)
    head, sep, tail = text.partition(".cc:")
    if sep and head.startswith("["):
        text = tail.split(":", 1)[-1].strip()
    return text

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
        raise InvalidRequestError(f"JSON Schema keyword '$ref': {external!r} is not supported; only references "
                                  "inside the schema ('#/...') are", param=PARAM)
    try:
        return json.dumps(value, separators=(",", ":"))
    except (TypeError, ValueError) as exc:  # a value JSON cannot hold (a set, an object), or a cycle
        raise InvalidRequestError(f"json_schema is not JSON: {exc}", param=PARAM) from None


MAX_SCHEMA_CHARS = 1_000_000
"""Longest JSON Schema accepted, as compact JSON text (characters). Real tool lists stay far below it (an
MCP server's 50 tools are ~100 kB)."""

MAX_ENUM_VALUES = 10_000
"""Most ``enum`` values (all enums of a schema together) accepted. xgrammar's compile time grows with
them: a 20,000-value enum takes ~9 s on this project's 2-core CI box, a 150,000-value one minutes."""


def _check_size(text: str) -> None:
    """Refuse a schema whose size alone makes it too slow to compile (before it takes a compile slot)."""
    if '"enum":' in text and _enum_values(json.loads(text)) > MAX_ENUM_VALUES:
        raise InvalidRequestError(f"json_schema has more than {MAX_ENUM_VALUES:,} enum values in all; compiling "
                                  "it would take too long (use a pattern, or fewer values)", param=PARAM,
                                  code="schema_too_large")
    if len(text) > MAX_SCHEMA_CHARS:
        raise InvalidRequestError(f"json_schema is {len(text):,} characters of JSON; at most {MAX_SCHEMA_CHARS:,} "
                                  "are accepted (compiling it would take too long)", param=PARAM,
                                  code="schema_too_large")


def _enum_values(value: Any) -> int:
    count = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                if key == "enum" and isinstance(child, list):
                    count += len(child)
                elif key not in ("const", "default", "examples"):
                    stack.append(child)
        elif isinstance(item, list):
            stack.extend(item)
    return count


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

            _check_size(self.json_schema)
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

    xgrammar's compile cannot be interrupted, and a hostile constraint can run for minutes. So each compile
    thread hands its compile to the compile server (:mod:`llminfer.sampling.grammar_worker`, with
    ``isolate=True``, the default), which runs it in a forked process of its own, and has that process
    killed once every request waiting for the compile has passed its deadline: a timed-out compile frees its
    thread and its CPU at once. Small JSON Schemas compile in the thread (:func:`_may_be_slow`). The compiled grammar comes back serialized (``CompiledGrammar.serialize_json``;
    ~0.1 ms per kB to load). The server starts in the background on first use (or :meth:`prepare`); until it
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
                raise InvalidRequestError(f"invalid or unsupported {spec.kind.replace('_', ' ')}: {_clean(exc)}",
                                          param=PARAM) from None
        self.compile_times_s.append(time.perf_counter() - start)
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
                raise InvalidRequestError(f"invalid or unsupported {spec.kind.replace('_', ' ')}: {_clean(exc)}",
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
and no pattern, compiles in the compile thread itself: its compile time is bounded by its size (~10 ms on
the 2-core CI box), while the round trip through a compile process costs ~60 ms (most of it loading the
serialized grammar back)."""
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


class _Job:
    __slots__ = ("id", "done", "reply")

    def __init__(self, job_id: int) -> None:
        self.id = job_id
        self.done = threading.Event()
        self.reply: tuple[str, str] = ("error", "the compile server stopped")


class _CompileServer:
    """The parent's end of :mod:`llminfer.sampling.grammar_worker`: starts it (in the background: an
    interpreter importing xgrammar takes seconds), sends jobs, and hands each reply to its :class:`_Job`
    from a reader thread."""

    def __init__(self, info_json: str) -> None:
        import os
        import subprocess
        import sys
        from pathlib import Path

        self.ready = threading.Event()
        self.failed = False
        self._jobs: dict[int, _Job] = {}
        self._next = 0
        self._lock = threading.Lock()
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # this llminfer, wherever it came from
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.process = subprocess.Popen([sys.executable, "-m", "llminfer.sampling.grammar_worker"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        from multiprocessing.connection import Connection

        self._out = Connection(os.dup(self.process.stdin.fileno()), readable=False)
        self._in = Connection(os.dup(self.process.stdout.fileno()), writable=False)
        self.process.stdin.close()
        self.process.stdout.close()
        threading.Thread(target=self._read, args=(info_json,), daemon=True,
                         name="llminfer-grammar-server").start()

    def _read(self, info_json: str) -> None:
        try:
            with self._lock:
                self._out.send(info_json)
            while True:
                job_id, reply = self._in.recv()
                if job_id == "ready":
                    self.ready.set()
                    continue
                with self._lock:
                    job = self._jobs.pop(job_id, None)
                if job is not None:
                    job.reply = reply
                    job.done.set()
        except Exception:  # noqa: BLE001 - the server died, or this process is exiting (a CLI error): stop
            pass
        self.failed = True
        with self._lock:
            jobs, self._jobs = list(self._jobs.values()), {}
        for job in jobs:
            job.done.set()

    def submit(self, spec: StructuredOutput) -> _Job:
        """Start compiling ``spec``; its :class:`_Job` is done when the reply came (or the server died)."""
        with self._lock:
            self._next += 1
            job = self._jobs[self._next] = _Job(self._next)
            try:
                self._out.send(("compile", job.id, spec))
            except OSError:
                self._jobs.pop(job.id)
                job.done.set()
        return job

    def kill(self, job: _Job) -> None:
        """End ``job``'s compile process now (its reply, if one was on its way, is dropped)."""
        with self._lock:
            self._jobs.pop(job.id, None)
            try:
                self._out.send(("kill", job.id))
            except OSError:
                pass

    def close(self) -> None:
        """Stop the server (its stdin closes: it kills its jobs and exits)."""
        try:
            self._out.close()
        except OSError:
            pass
        try:
            self.process.wait(5)
        except Exception:  # noqa: BLE001 - a server that does not exit is killed
            self.process.kill()
        self._in.close()


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

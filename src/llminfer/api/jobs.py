"""One API call's engine requests: built, validated and tokenized once (:func:`new_job`), run with the ``n``
fan-out and the accounting (:func:`run_job`), and folded back into choices (:func:`collect`, :func:`usage_of`).

A route renders its prompt into token ids itself; :func:`new_job` then makes each choice's request, starts
the call's structured-output compile once, and runs every request through the engine's
:class:`~llminfer.frontend.input.InputProcessor`. What it submits is the resulting
:class:`~llminfer.protocols.messages.TokenizedRequest`, which the engine's tokenize stage passes on: a
request is validated, tokenized and compiled for once, in the route, so every error it can cause is a plain
400 before anything is generated.
"""

from __future__ import annotations

import contextlib
import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import attrs
from anyio.abc import TaskGroup

from llminfer.api import protocol as s
from llminfer.api.errors import APIError, bad_request, from_engine_error
from llminfer.api.request_info import JobOutcome
from llminfer.errors import InvalidRequestError, LLMInferError
from llminfer.protocols.messages import TokenizedRequest
from llminfer.results import StreamChunk
from llminfer.sampling.structured import PARAM as STRUCTURED_PARAM
from llminfer.sampling.structured import GrammarHandle, StructuredOutput
from llminfer.tools import ToolPlan

if TYPE_CHECKING:
    from llminfer.api.state import ServerState, Ticket

Item = tuple[int, StreamChunk]  #: (choice index, chunk)


@attrs.define
class Job:
    """One API call: its engine requests (one per choice) and what the response needs.

    Attributes:
        kind: ``"chat"`` or ``"completion"``.
        prompt_ids: token ids of each prompt.
        choice_prompt: for each choice, the index of its prompt.
        requests: the engine requests, one per choice, in choice order, validated and tokenized.
        logprobs: top alternatives per token to report (``None``: no logprobs).
        echo_texts: for completions with ``echo``, the prompt text of each prompt.
        tools: for chat with tools, how calls are parsed out of each choice's text.
        constraint_param: the request field the output constraint came from (``response_format``,
            ``guided_regex``, ``tools``, ...): engine errors about the constraint name it.
        render_options: the endpoint's own rendering options (completions: echo logprobs, ``best_of``, ...).
    """

    kind: str
    id: str
    created: int
    model: str
    prompt_ids: list[list[int]]
    choice_prompt: list[int]
    requests: list[TokenizedRequest]
    logprobs: int | None = None
    echo_texts: list[str] | None = None
    include_usage: bool = False
    tools: ToolPlan | None = None
    constraint_param: str | None = None
    render_options: Any = None


async def new_job(state: ServerState, kind: str, model: str, prompt_ids: list[list[int]], prompt_params: Sequence[str],
                  n: int, kwargs: dict[str, Any], *, logprobs: int | None = None,
                  first_kwargs: dict[str, Any] | None = None, spec: StructuredOutput | None = None,
                  spec_param: str = "") -> Job:
    """Build the engine requests of a call, ``n`` per prompt (seed + i for the i-th sample when seeded), each
    validated and tokenized once (``InputProcessor.process``); ``first_kwargs`` are added to the first
    sample of each prompt only (prompt logprobs: one is enough). The constraint ``spec`` is compiled once for
    the call and its choices share the compile; an invalid one, or one that does not compile in time, is a
    400 naming ``spec_param`` here, for streamed calls too.

    Args:
        prompt_ids: token ids of each prompt; ``prompt_params``: the field each came from (named in errors).
        kwargs: ``engine.make_request`` arguments (see :func:`llminfer.api.sampling.sampling_kwargs`).

    Raises:
        APIError: 400 when the engine rejects a sampling value or a prompt (the param is named), or the
            constraint.
    """
    engine = state.engine
    assert state.prompts is not None
    inputs = state.prompts.inputs
    grammar = start_compile(engine, spec)
    requests: list[TokenizedRequest] = []
    choice_prompt: list[int] = []
    seed = kwargs.get("seed")
    for p, ids in enumerate(prompt_ids):
        first: TokenizedRequest | None = None
        for i in range(n):
            kw = dict(kwargs)
            if i == 0 and first_kwargs:
                kw.update(first_kwargs)
            if seed is not None:
                kw["seed"] = seed + i
            try:
                request = engine.make_request(ids, **kw)
                if first is None:
                    first = inputs.process(request, param=prompt_params[p], grammar=grammar)
                    requests.append(first)
                else:  # the samples of a prompt differ in what validation does not read (seed, prompt logprobs)
                    requests.append(attrs.evolve(first, request_id=request.request_id, params=request.params,
                                                 arrival_ns=request.arrival_ns))
            except InvalidRequestError as exc:
                raise from_engine_error(exc, prompt_param=prompt_params[p]) from None
            choice_prompt.append(p)
    if grammar is not None:
        await check_structured_output(grammar, spec_param)
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    return Job(kind=kind, id=prefix + uuid.uuid4().hex, created=int(time.time()), model=model,
               prompt_ids=prompt_ids, choice_prompt=choice_prompt, requests=requests, logprobs=logprobs,
               constraint_param=spec_param or None)


def start_compile(engine: Any, spec: StructuredOutput | None) -> GrammarHandle | None:
    """Start compiling ``spec`` on the engine's grammar compiler (cached by constraint); None without a
    constraint, or for engines whose backend compiles constraints itself (vLLM)."""
    compiler = getattr(getattr(engine, "runtime", None), "grammar_compiler", None)
    if spec is None or compiler is None:
        return None
    return compiler.submit(spec)


async def check_structured_output(grammar: GrammarHandle, param: str) -> None:
    """Wait for the call's compile, so that an invalid or unsupported constraint, or one that compiles too
    slowly, is a 400 before anything is generated (the scheduler would otherwise fail the request).

    Raises:
        APIError: 400 naming ``param`` (``code="grammar_compile_timeout"`` past the time limit).
    """
    try:
        await grammar.wait()
    except InvalidRequestError as exc:
        raise bad_request(str(exc), param, exc.code) from None


def job_error(job: Job, exc: LLMInferError, prompt_param: str) -> APIError:
    """:func:`from_engine_error`, with the engine's ``structured_output`` named as the field the client used."""
    if isinstance(exc, InvalidRequestError) and exc.param == STRUCTURED_PARAM and job.constraint_param:
        return bad_request(str(exc), job.constraint_param, exc.code)
    return from_engine_error(exc, prompt_param=prompt_param)


# ---------------------------------------------------------------------------- running
async def run_job(job: Job, engine: Any, task_group: TaskGroup | None, ticket: Ticket,
                  outcome: JobOutcome) -> AsyncIterator[Item]:
    """Run the engine requests of one call and yield ``(choice index, chunk)`` as chunks arrive, keeping the
    accounting: the outcome of each finished choice, the aborted count when the reader stops early (client
    disconnect), and the ticket released at the end, however it ends (the Prometheus metrics come from the
    engine's own statistics, see :mod:`llminfer.api.metrics`).

    This is the one place that knows choices are separate engine requests; an engine-level ``n`` would
    replace its fan-out. One request is iterated directly; several are pumped by tasks in ``task_group`` (a
    long-lived group, so no cancel scope spans a ``yield``) into one channel.

    Raises:
        LLMInferError: the first error any choice's request raised (the others are then cancelled; counted
            as failed, not aborted).

    Closing the iterator early cancels every request that has not finished (their KV blocks are freed).
    """
    finished: set[int] = set()
    done = False
    streamed: dict[int, int] = {}  # tokens sent per choice, for a choice that never gets its final stats

    def account(index: int, chunk: StreamChunk) -> None:
        # counted as they arrive, so an aborted choice (a shutdown, a disconnect) logs what it generated
        streamed[index] = streamed.get(index, 0) + len(chunk.token_ids)
        if chunk.is_final:
            finished.add(index)
            outcome.finish_reasons[index] = chunk.finish_reason or "stop"
            if chunk.stats is not None:
                streamed[index] = chunk.stats.completion_tokens
                outcome.cached_tokens[index] = chunk.stats.cached_tokens
        outcome.completion_tokens = sum(streamed.values())

    try:
        if len(job.requests) == 1:
            async with contextlib.aclosing(engine.generate_request(job.requests[0])) as chunks:
                async for chunk in chunks:
                    account(0, chunk)
                    yield 0, chunk
        else:
            async with _fan_in(engine, job.requests, task_group) as receive:
                async for i, chunk, error in receive:
                    if error is not None:
                        raise error
                    account(i, chunk)
                    yield i, chunk
        done = True
    except Exception:  # LLMInferError from the engine, or a bug: the requests failed, they were not aborted
        outcome.failed = True
        raise
    finally:
        if not done and not outcome.failed and len(finished) < len(job.requests):
            outcome.aborted = len(job.requests) - len(finished)
        ticket.release()


@contextlib.asynccontextmanager
async def _fan_in(engine: Any, requests: Sequence[TokenizedRequest], task_group: TaskGroup | None) -> Any:
    """Start one task per request in ``task_group``, each sending ``(index, chunk, None)`` (or ``(index,
    None, error)``) into one channel; yields its receiving end. Leaving cancels the tasks that still run."""
    if task_group is None:
        raise RuntimeError("several choices need the server's task group")
    send, receive = anyio.create_memory_object_stream[tuple[int, Any, BaseException | None]](math.inf)
    scopes = [anyio.CancelScope() for _ in requests]

    async def pump(i: int, out: Any) -> None:
        with scopes[i]:
            try:
                async with contextlib.aclosing(engine.generate_request(requests[i])) as chunks:
                    async for chunk in chunks:
                        out.send_nowait((i, chunk, None))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # the reader went away; closing ``chunks`` cancelled the request
            except Exception as exc:  # noqa: BLE001 - handed to the reader, never lost in the task group
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    out.send_nowait((i, None, exc))
            finally:
                out.close()

    try:
        for i in range(len(requests)):
            task_group.start_soon(pump, i, send.clone())
        send.close()
        yield receive
    finally:
        send.close()
        receive.close()
        for scope in scopes:
            scope.cancel()


# ---------------------------------------------------------------------------- folding
def usage_of(job: Job, outcome: JobOutcome) -> s.Usage:
    """Usage of a finished call: each prompt counted once (its cached tokens: the fewest any of its choices
    got from the prefix cache), completion tokens summed over choices."""
    prompt = sum(len(ids) for ids in job.prompt_ids)
    cached = 0
    for p in range(len(job.prompt_ids)):
        hits = [outcome.cached_tokens.get(i, 0) for i, q in enumerate(job.choice_prompt) if q == p]
        cached += min(hits, default=0)
    # always present, 0 included, as OpenAI reports it (clients read usage.prompt_tokens_details.cached_tokens)
    details = s.PromptTokensDetails(cached_tokens=cached)
    return s.Usage(prompt, outcome.completion_tokens, prompt + outcome.completion_tokens, details)


@attrs.define
class _Choice:
    text: list[str] = attrs.field(factory=list)
    logprobs: list[Any] = attrs.field(factory=list)
    finish_reason: str | None = None


def collect(job: Job, items: Sequence[Item]) -> list[_Choice]:
    """Fold all chunks of a finished call into per-choice text, logprob entries and finish reasons."""
    choices = [_Choice() for _ in job.requests]
    for index, chunk in items:
        c = choices[index]
        c.text.append(chunk.token)
        c.logprobs.extend(getattr(chunk, "logprobs", ()) or ())
        if chunk.is_final:
            c.finish_reason = chunk.finish_reason
    return choices

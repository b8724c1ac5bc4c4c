"""Running one API call: its engine requests, the ``n`` fan-out, accounting, and the HTTP response.

A :class:`Job` holds a call's engine requests (one per choice, built by :func:`new_job`);
:func:`generate_choices` runs them and merges their chunks (the one place that knows choices are separate
engine requests); :func:`run_job` adds the accounting (the :class:`JobOutcome`, the admission
:class:`Ticket` released at the end); :func:`execute` runs a job for an HTTP request, cancelling it when
the client goes away or a shutdown's grace period ends, and renders it as JSON or as SSE frames
(:func:`sse_frames`, shared by chat and completions; a :class:`ChunkBuffer` decouples generation from
the client's reading speed).
"""

from __future__ import annotations

import contextlib
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import attrs
import structlog
from anyio.abc import TaskGroup
from litestar import Request, Response

from llminfer.api import protocol as s
from llminfer.api.errors import SERVER_ERROR, APIError, bad_request, from_engine_error
from llminfer.api.keepalive import FramePump
from llminfer.api.logprobs import TokenText
from llminfer.api.middleware import EventStream, watch_disconnect
from llminfer.api.request_info import JobOutcome, RequestInfo, request_info
from llminfer.errors import InvalidRequestError, LLMInferError, RequestAbortedError
from llminfer.protocols.messages import GenerationRequest
from llminfer.results import StreamChunk
from llminfer.sampling.structured import PARAM as STRUCTURED_PARAM
from llminfer.tools import ToolPlan

if TYPE_CHECKING:
    from llminfer.api.state import ServerState, Ticket

log = structlog.get_logger("llminfer.api")

Item = tuple[int, StreamChunk]  #: (choice index, chunk)
RenderJSON = Callable[["Job", Sequence[Item], "JobOutcome", TokenText], Any]
RenderEvents = Callable[["Job", Sequence[Item], AsyncIterator[Item], "JobOutcome", TokenText], AsyncIterator[bytes]]


# ---------------------------------------------------------------------------- jobs
@attrs.define
class Job:
    """One API call: its engine requests (one per choice) and what the response needs.

    Attributes:
        kind: ``"chat"`` or ``"completion"``.
        prompt_ids: token ids of each prompt.
        choice_prompt: for each choice, the index of its prompt.
        requests: the engine requests, one per choice, in choice order.
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
    requests: list[GenerationRequest]
    logprobs: int | None = None
    echo_texts: list[str] | None = None
    include_usage: bool = False
    tools: ToolPlan | None = None
    constraint_param: str | None = None
    render_options: Any = None


def new_job(kind: str, model: str, prompt_ids: list[list[int]], n: int, make: Callable[..., GenerationRequest],
            kwargs: dict[str, Any], *, logprobs: int | None = None, first_kwargs: dict[str, Any] | None = None) -> Job:
    """Build the engine requests of a call: ``n`` per prompt (seed + i for the i-th sample when seeded);
    ``first_kwargs`` are added to the first sample of each prompt only (prompt logprobs: one is enough).

    Raises:
        APIError: 400 when the engine rejects a sampling value (the param is named).
    """
    requests: list[GenerationRequest] = []
    choice_prompt: list[int] = []
    seed = kwargs.get("seed")
    try:
        for p, ids in enumerate(prompt_ids):
            for i in range(n):
                kw = dict(kwargs)
                if i == 0 and first_kwargs:
                    kw.update(first_kwargs)
                if seed is not None:
                    kw["seed"] = seed + i
                requests.append(make(ids, **kw))
                choice_prompt.append(p)
    except InvalidRequestError as exc:
        raise from_engine_error(exc) from None
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    return Job(kind=kind, id=prefix + uuid.uuid4().hex, created=int(time.time()), model=model,
               prompt_ids=prompt_ids, choice_prompt=choice_prompt, requests=requests, logprobs=logprobs)


async def generate_choices(engine: Any, requests: Sequence[GenerationRequest],
                           task_group: TaskGroup | None) -> AsyncIterator[Item]:
    """Run the engine requests of one call and yield ``(choice index, chunk)`` as chunks arrive.

    This is the one place that knows choices are separate engine requests; an engine-level ``n`` would
    replace its body. One request is iterated directly; several are pumped by tasks in ``task_group`` (a
    long-lived group, so no cancel scope spans a ``yield``) into one channel.

    Raises:
        LLMInferError: the first error any choice's request raised (the others are then cancelled).

    Closing the iterator early cancels every request that has not finished (their KV blocks are freed).
    """
    if len(requests) == 1:
        async with contextlib.aclosing(engine.generate_request(requests[0])) as chunks:
            async for chunk in chunks:
                yield 0, chunk
        return
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
        async for i, chunk, error in receive:
            if error is not None:
                raise error
            yield i, chunk
    finally:
        send.close()
        receive.close()
        for scope in scopes:
            scope.cancel()


async def run_job(job: Job, engine: Any, task_group: TaskGroup | None, ticket: Ticket,
                  outcome: JobOutcome) -> AsyncIterator[Item]:
    """:func:`generate_choices` plus accounting: the outcome of each finished choice, the aborted count when
    the reader stops early (client disconnect), and the ticket released at the end, however it ends (the
    Prometheus metrics come from the engine's own statistics, see :mod:`llminfer.api.metrics`).

    Raises:
        LLMInferError: as :func:`generate_choices` (counted as failed, not aborted).
    """
    finished: set[int] = set()
    done = False
    try:
        async with contextlib.aclosing(generate_choices(engine, job.requests, task_group)) as chunks:
            async for index, chunk in chunks:
                if chunk.is_final:
                    finished.add(index)
                    outcome.finish_reasons[index] = chunk.finish_reason or "stop"
                    if chunk.stats is not None:
                        outcome.completion_tokens += chunk.stats.completion_tokens
                        outcome.cached_tokens[index] = chunk.stats.cached_tokens
                yield index, chunk
        done = True
    except Exception:  # LLMInferError from the engine, or a bug: the requests failed, they were not aborted
        outcome.failed = True
        raise
    finally:
        if not done and not outcome.failed and len(finished) < len(job.requests):
            outcome.aborted = len(job.requests) - len(finished)
        ticket.release()


def usage_of(job: Job, outcome: JobOutcome) -> s.Usage:
    """Usage of a finished call: each prompt counted once (its cached tokens: the fewest any of its choices
    got from the prefix cache), completion tokens summed over choices."""
    prompt = sum(len(ids) for ids in job.prompt_ids)
    cached = 0
    for p in range(len(job.prompt_ids)):
        hits = [outcome.cached_tokens.get(i, 0) for i, q in enumerate(job.choice_prompt) if q == p]
        cached += min(hits, default=0)
    details = s.PromptTokensDetails(cached_tokens=cached) if cached else None
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


# ---------------------------------------------------------------------------- SSE
DONE_FRAME = b"data: [DONE]\n\n"


def frame(obj: Any) -> bytes:
    """One SSE event carrying ``obj`` as JSON."""
    return b"data: " + s.json_encoder.encode(obj) + b"\n\n"


def error_frame(error: APIError) -> bytes:
    """An SSE event carrying an OpenAI error object (sent when a stream fails after it started)."""
    return frame(error.body())


async def sse_frames(job: Job, first: Sequence[Item], rest: AsyncIterator[Item], outcome: JobOutcome, *,
                     opening: Iterable[bytes], render: Callable[[int, StreamChunk], Iterable[bytes]],
                     usage_frame: Callable[[s.Usage], bytes]) -> AsyncIterator[bytes]:
    """The frames of a streamed call: ``opening``, then ``render`` of every chunk (``first``: the chunks
    already pulled, then ``rest``, which the caller closes), then ``usage_frame`` of the usage when the
    client asked for it (``include_usage``), then ``[DONE]``.

    Raises:
        LLMInferError: what ``rest`` raised (the caller turns it into an error event).
    """
    for f in opening:
        yield f
    for index, item in first:
        for f in render(index, item):
            yield f
    async for index, item in rest:
        for f in render(index, item):
            yield f
    if job.include_usage:
        yield usage_frame(usage_of(job, outcome))
    yield DONE_FRAME


def _job_error(job: Job, exc: LLMInferError, prompt_param: str) -> APIError:
    """:func:`from_engine_error`, with the engine's ``structured_output`` named as the field the client used."""
    if isinstance(exc, InvalidRequestError) and exc.param == STRUCTURED_PARAM and job.constraint_param:
        return bad_request(str(exc), job.constraint_param, exc.code)
    return from_engine_error(exc, prompt_param=prompt_param)


async def _guarded(events: AsyncIterator[bytes], chunks: Any, info: RequestInfo,
                   job: Job) -> AsyncIterator[bytes]:
    """Frames of ``events``; a failure after the stream started becomes an error event, then ``[DONE]``;
    ``chunks`` (anything with ``aclose()``) is closed at the end."""
    finished = False
    try:
        async with contextlib.aclosing(events) as frames:  # type: ignore[type-var]
            async for f in frames:
                yield f
        finished = True
    except LLMInferError as exc:
        error = _job_error(job, exc, "prompt")
        if not isinstance(exc, RequestAbortedError):  # a shutdown's aborts are logged once, by the server
            log.error("stream failed", error=repr(exc))
        info.error = error.message
        yield error_frame(error)
        yield DONE_FRAME
        finished = True
    except Exception as exc:
        log.exception("stream failed", error=repr(exc))
        error = APIError(500, f"internal server error ({type(exc).__name__})", type=SERVER_ERROR)
        info.error = error.message
        yield error_frame(error)
        yield DONE_FRAME
        finished = True
    finally:
        if not finished:
            info.disconnected = True
        await chunks.aclose()


class ChunkBuffer:
    """Pulls a streamed call's chunks (from :func:`run_job`) into memory as fast as the engine makes them,
    in a task of the server's task group, whatever the client's reading speed. So a client that stops
    reading does not hold the call's admission: it is released, and the requests are counted finished,
    when generation ends; only the chunks wait (at most ``max_tokens`` per choice).

    ``stoppers`` (the server's set) holds :meth:`stop` while generation runs: at the end of a shutdown's
    grace period the requests are cancelled and :meth:`items` raises ``RequestAbortedError`` after the
    chunks made so far. :meth:`aclose` cancels what still runs and waits until the requests are cancelled.
    """

    def __init__(self, chunks: AsyncIterator[Item], task_group: TaskGroup,
                 stoppers: set[Callable[[], None]]) -> None:
        self._send, self._receive = anyio.create_memory_object_stream[Any](math.inf)
        self._scope = anyio.CancelScope()
        self._done = anyio.Event()
        self._stopped = False
        self._stoppers = stoppers
        stoppers.add(self.stop)
        task_group.start_soon(self._pump, chunks)

    def stop(self) -> None:
        """End generation now (a shutdown): the reader gets the chunks so far, then an abort error."""
        self._stopped = True
        self._scope.cancel()

    async def _pump(self, chunks: AsyncIterator[Item]) -> None:
        try:
            with self._scope:
                async for item in chunks:
                    self._send.send_nowait(item)
        except Exception as exc:  # noqa: BLE001 - the reader raises it; it must not end the task group
            with contextlib.suppress(anyio.BrokenResourceError):
                self._send.send_nowait(exc)
        finally:
            self._stoppers.discard(self.stop)
            with anyio.CancelScope(shield=True):
                await chunks.aclose()  # type: ignore[attr-defined]
            if self._stopped:
                with contextlib.suppress(anyio.BrokenResourceError):
                    self._send.send_nowait(RequestAbortedError("the server is shutting down"))
            self._send.close()
            self._done.set()

    async def items(self) -> AsyncIterator[Item]:
        """The chunks in order.

        Raises:
            LLMInferError: what generation raised, or ``RequestAbortedError`` after :meth:`stop`.
        """
        async for item in self._receive:
            if isinstance(item, BaseException):
                raise item
            yield item

    async def aclose(self) -> None:
        """Cancel generation if it still runs, and wait until it has stopped."""
        self._scope.cancel()
        with anyio.CancelScope(shield=True):
            await self._done.wait()
        self._receive.close()


# ---------------------------------------------------------------------------- one HTTP call
async def execute(request: Request, state: ServerState, job: Job, *, stream: bool, prompt_param: str,
                  render_json: RenderJSON, render_events: RenderEvents) -> Response:
    """Admit, run and render one call (streamed or not), cancelling it if the client goes away.

    Until every choice has produced a chunk the call can still fail as a plain error response; after
    that, a failure becomes an error event in the stream. A stream whose first chunk takes longer than the
    keep-alive interval starts with a keep-alive comment instead (see :func:`_stream`).

    Raises:
        APIError: 429 when the server is full (see ``ServerState.admit``), or the engine's error mapped by
            :func:`~llminfer.api.errors.from_engine_error` (a prompt that can never fit: 400).
    """
    ticket = state.admit(len(job.requests))
    outcome = JobOutcome()
    info = request_info(request.scope)
    info.prompt_tokens = sum(len(p) for p in job.prompt_ids)
    info.choices = len(job.requests)
    info.outcome = outcome
    chunks = run_job(job, state.engine, state.task_group, ticket, outcome)

    async def collect_all() -> list[Item]:
        return [item async for item in chunks]

    async def preroll() -> list[Item]:
        # Until every choice has produced a chunk: a request that fails at once (prompt too long, cannot fit
        # in the KV cache) becomes a plain error response instead of a broken stream.
        items: list[Item] = []
        seen: set[int] = set()
        while len(seen) < len(job.requests):
            try:
                item = await chunks.__anext__()
            except StopAsyncIteration:
                break
            items.append(item)
            seen.add(item[0])
        return items

    if stream:
        return await _stream(request, state, job, chunks, preroll, ticket, info, render_events, prompt_param)
    stop = anyio.CancelScope()  # the grace period of a shutdown ended (ServerState.end_streams)
    state.stoppers.add(stop.cancel)
    try:
        with stop:
            items, disconnected = await watch_disconnect(request.receive, collect_all)
    except LLMInferError as exc:
        await chunks.aclose()
        raise _job_error(job, exc, prompt_param) from None
    except BaseException:
        await chunks.aclose()
        ticket.release()
        raise
    finally:
        state.stoppers.discard(stop.cancel)
    if stop.cancelled_caught:
        await chunks.aclose()
        ticket.release()
        raise APIError(503, "the server is shutting down", type=SERVER_ERROR, code="server_shutting_down")
    if disconnected:
        await chunks.aclose()
        ticket.release()
        info.status_override = 499
        info.disconnected = True
        state.metrics.client_disconnected()
        return Response(b"", status_code=499)
    token_text = state.token_text
    assert token_text is not None
    await chunks.aclose()
    return Response(render_json(job, items, outcome, token_text), status_code=200)


async def _stream(request: Request, state: ServerState, job: Job, chunks: AsyncIterator[Item],
                  preroll: Callable[[], Any], ticket: Ticket, info: RequestInfo,
                  render_events: RenderEvents, prompt_param: str) -> Response:
    """The streamed half of :func:`execute`.

    The frames run in a :class:`FramePump`, which sends a keep-alive comment whenever the stream is quiet for
    ``state.sse_keepalive_s``. The response starts at the first frame or keep-alive, whichever comes first; an
    error before that (the preroll) is a plain error response. After the preroll the chunks are pulled by a
    :class:`ChunkBuffer` as fast as the engine makes them (a client that stops reading does not hold the
    admission), and a shutdown's end of grace ends the stream with an error event and ``[DONE]``.
    """
    token_text = state.token_text
    assert token_text is not None and state.task_group is not None
    task_group = state.task_group
    outcome = info.outcome
    assert outcome is not None

    async def body() -> AsyncIterator[bytes]:
        stop = anyio.CancelScope()  # the grace period of a shutdown ended (ServerState.end_streams)
        state.stoppers.add(stop.cancel)
        try:
            with stop:
                items = await preroll()  # raises before any frame: a plain error response (see first())
        finally:
            state.stoppers.discard(stop.cancel)
        if stop.cancelled_caught:
            raise RequestAbortedError("the server is shutting down")
        rest = ChunkBuffer(chunks, task_group, state.stoppers)
        try:
            async with contextlib.aclosing(render_events(job, items, rest.items(), outcome, token_text)) as frames:  # type: ignore[type-var]
                async for f in frames:
                    yield f
        finally:
            await rest.aclose()

    pump = FramePump(body(), state.sse_keepalive_s, task_group)
    try:
        first, disconnected = await watch_disconnect(request.receive, pump.first)
    except LLMInferError as exc:
        await pump.aclose()
        await chunks.aclose()
        if isinstance(exc, RequestAbortedError) and state.draining:
            ticket.release()
            raise APIError(503, "the server is shutting down", type=SERVER_ERROR,
                           code="server_shutting_down") from None
        raise _job_error(job, exc, prompt_param) from None
    except BaseException:
        await pump.aclose()
        await chunks.aclose()
        ticket.release()
        raise
    if disconnected:
        await pump.aclose()
        await chunks.aclose()
        ticket.release()
        info.status_override = 499
        info.disconnected = True
        state.metrics.client_disconnected()
        return Response(b"", status_code=499)

    async def cleanup() -> None:
        # Run by the request middleware once the response is over, however it ended: the frames (and with
        # them the engine requests) are closed now rather than whenever they are garbage-collected.
        await pump.aclose()
        await chunks.aclose()

    info.cleanup = cleanup
    # A failure after the response started (a keep-alive may come before the preroll ends) is an error event.
    # ``pump`` stands in for the chunks there: only the pump's task may close them while it pulls them.
    return EventStream(_guarded(pump.rest(first), pump, info, job), media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

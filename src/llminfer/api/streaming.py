"""Streamed responses: SSE frames (:func:`sse_frames`, shared by chat and completions) and
:func:`stream_response`, the streamed half of :func:`~llminfer.api.execution.execute` (generation in a
:class:`~llminfer.api.keepalive.FramePump` task, keep-alives, the preroll that can still fail as a plain
error response, errors after the start as an error event).

For one choice, a stream is five nested async generators (:func:`_guarded` ⊃ the renderer ⊃
:func:`~llminfer.api.jobs.run_job` ⊃ ``engine.generate_request`` ⊃ ``RequestHandle.chunks``) and one task.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import structlog
from litestar import Request, Response

from llminfer.api import protocol as s
from llminfer.api.errors import SERVER_ERROR, APIError
from llminfer.api.jobs import Item, Job, job_error, usage_of
from llminfer.api.keepalive import KEEPALIVE_FRAME, FramePump
from llminfer.api.logprobs import TokenText
from llminfer.api.middleware import EventStream, watch_disconnect
from llminfer.api.request_info import JobOutcome, RequestInfo
from llminfer.errors import InvalidRequestError, LLMInferError, RequestAbortedError
from llminfer.results import StreamChunk

if TYPE_CHECKING:
    from llminfer.api.state import ServerState, Ticket

log = structlog.get_logger("llminfer.api")

RenderEvents = Callable[[Job, Sequence[Item], AsyncIterator[Item], JobOutcome, TokenText], AsyncIterator[bytes]]

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


FailureFrames = Callable[[APIError, int], Iterable[bytes]]
"""The last frames of a stream that failed after it started, given the error and the events sent so far."""


def error_and_done(error: APIError, events_sent: int) -> Iterable[bytes]:
    """Chat and completions streams end a failure with an error event (an OpenAI error object), then ``[DONE]``
    (what vLLM sends, and what the ``openai`` client raises as an ``APIError``)."""
    return (error_frame(error), DONE_FRAME)


async def _guarded(pump: FramePump, first: bytes | None, info: RequestInfo, job: Job,
                   failure_frames: FailureFrames) -> AsyncIterator[bytes]:
    """``first``, then the frames of ``pump`` (keep-alives included); a failure after the stream started
    ends it with ``failure_frames``; the pump is closed at the end."""
    finished = False
    events = 0
    try:
        frame_ = first
        while frame_ is not None:
            yield frame_
            events += frame_ != KEEPALIVE_FRAME
            frame_ = await pump.next()
        finished = True
    except LLMInferError as exc:
        error = job_error(job, exc, "prompt")
        if isinstance(exc, InvalidRequestError):  # the request's own fault (a constraint that dead-ends): a 4xx
            log.info("stream ended by a request error", error=repr(exc))
        elif not isinstance(exc, RequestAbortedError):  # a shutdown's aborts are logged once, by the server
            log.error("stream failed", error=repr(exc))
        info.error, info.error_code = error.message, error.code
        for frame_ in failure_frames(error, events):
            yield frame_
        finished = True
    except Exception as exc:
        log.exception("stream failed", error=repr(exc))
        error = APIError(500, f"internal server error ({type(exc).__name__})", type=SERVER_ERROR)
        info.error = error.message
        for frame_ in failure_frames(error, events):
            yield frame_
        finished = True
    finally:
        if not finished:
            info.disconnected = True
        await pump.aclose()



def client_gone(state: ServerState, ticket: Ticket, info: RequestInfo) -> Response:
    """What the server does once the client of a call has gone (its generators already closed): release the
    call's admission ``ticket``, log the call as HTTP 499 (nginx's "client closed request") and count it in
    ``/metrics``. Returns the empty 499 response that nobody reads."""
    ticket.release()
    info.status_override = 499
    info.disconnected = True
    state.metrics.client_disconnected()
    return Response(b"", status_code=499)


async def stream_response(request: Request, state: ServerState, job: Job, chunks: AsyncIterator[Item],
                  preroll: Callable[[], Any], ticket: Ticket, info: RequestInfo,
                  render_events: RenderEvents, prompt_param: str,
                  failure_frames: FailureFrames = error_and_done) -> Response:
    """The streamed half of :func:`~llminfer.api.execution.execute`.

    The call runs in a :class:`FramePump`: its task runs the preroll, then renders the chunks into frames as
    fast as the engine makes them (a client that stops reading does not hold the admission), and the reader
    gets a keep-alive comment whenever the stream is quiet for ``state.sse_keepalive_s``. The response starts
    at the first frame or keep-alive, whichever comes first; an error before that (the preroll) is a plain
    error response. A shutdown's end of grace cancels generation: the stream ends with the frames made so
    far, an error event and ``[DONE]``.
    """
    token_text = state.token_text
    assert token_text is not None and state.task_group is not None
    outcome = info.outcome
    assert outcome is not None

    async def produce(emit: Callable[[bytes], None]) -> None:
        stop = anyio.CancelScope()  # the grace period of a shutdown ended (ServerState.end_streams)
        state.stoppers.add(stop.cancel)
        try:
            with stop:
                items = await preroll()  # raises before any frame: a plain error response (see next())
                async with contextlib.aclosing(render_events(job, items, chunks, outcome, token_text)) as frames:  # type: ignore[type-var]
                    async for f in frames:
                        emit(f)
        finally:
            state.stoppers.discard(stop.cancel)
        if stop.cancelled_caught:
            raise RequestAbortedError("the server is shutting down")

    pump = FramePump(produce, state.sse_keepalive_s, state.task_group)
    try:
        first, disconnected = await watch_disconnect(request.receive, pump.next)
    except LLMInferError as exc:
        await pump.aclose()
        await chunks.aclose()
        if isinstance(exc, RequestAbortedError) and state.draining:
            ticket.release()
            raise APIError(503, "the server is shutting down", type=SERVER_ERROR,
                           code="server_shutting_down") from None
        raise job_error(job, exc, prompt_param) from None
    except BaseException:
        await pump.aclose()
        await chunks.aclose()
        ticket.release()
        raise
    if disconnected:
        await pump.aclose()
        await chunks.aclose()
        return client_gone(state, ticket, info)

    async def cleanup() -> None:
        # Run by the request middleware once the response is over, however it ended: the frames (and with
        # them the engine requests) are closed now rather than whenever they are garbage-collected.
        await pump.aclose()
        await chunks.aclose()

    info.cleanup = cleanup
    # A failure after the response started (a keep-alive may come before the preroll ends) is an error event.
    # ``pump`` stands in for the chunks there: only the pump's task may close them while it pulls them.
    return EventStream(_guarded(pump, first, info, job, failure_frames), media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

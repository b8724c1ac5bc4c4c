"""Running one API call for an HTTP request (:func:`execute`): admission, the call's engine requests (a
:class:`~llminfer.api.jobs.Job`, built by :func:`~llminfer.api.jobs.new_job`), cancellation when the client
goes away or a shutdown's grace period ends, and the response: JSON here, SSE frames in
:mod:`llminfer.api.streaming`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
from litestar import Request, Response

from llminfer.api.errors import SERVER_ERROR, APIError
from llminfer.api.jobs import Item, Job, job_error, run_job
from llminfer.api.logprobs import TokenText
from llminfer.api.middleware import watch_disconnect
from llminfer.api.request_info import JobOutcome, request_info
from llminfer.api.streaming import FailureFrames, RenderEvents, client_gone, error_and_done, stream_response
from llminfer.errors import LLMInferError

if TYPE_CHECKING:
    from llminfer.api.state import ServerState

RenderJSON = Callable[[Job, Sequence[Item], JobOutcome, TokenText], Any]


async def execute(request: Request, state: ServerState, job: Job, *, stream: bool, prompt_param: str,
                  render_json: RenderJSON, render_events: RenderEvents,
                  failure_frames: FailureFrames = error_and_done) -> Response:
    """Admit, run and render one call (streamed or not), cancelling it if the client goes away.

    Until every choice has produced a chunk the call can still fail as a plain error response; after
    that, a failure ends the stream with ``failure_frames`` (an error event and ``[DONE]`` by default). A stream whose first chunk takes longer than the
    keep-alive interval starts with a keep-alive comment instead (see
    :func:`~llminfer.api.streaming.stream_response`).

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
        return await stream_response(request, state, job, chunks, preroll, ticket, info, render_events, prompt_param,
                                     failure_frames)
    stop = anyio.CancelScope()  # the grace period of a shutdown ended (ServerState.end_streams)
    state.stoppers.add(stop.cancel)
    try:
        with stop:
            items, disconnected = await watch_disconnect(request.receive, collect_all)
    except LLMInferError as exc:
        await chunks.aclose()
        raise job_error(job, exc, prompt_param) from None
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
        return client_gone(state, ticket, info)
    token_text = state.token_text
    assert token_text is not None
    await chunks.aclose()
    return Response(render_json(job, items, outcome, token_text), status_code=200)

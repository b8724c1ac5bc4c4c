"""``POST /v1/chat/completions``: the handler, and its JSON (:func:`chat_response`) and SSE
(:func:`chat_events`) renderers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from litestar import Request, post
from litestar.params import SkipValidation
from msgspec import UNSET

from llminfer.api import protocol as s
from llminfer.api.errors import OPENAPI_ERRORS
from llminfer.api.execution import (
    Item,
    Job,
    JobOutcome,
    collect,
    execute,
    frame,
    new_job,
    sse_frames,
    usage_of,
)
from llminfer.api.logprobs import TokenText, chat_logprobs
from llminfer.api.middleware import server_state
from llminfer.api.translate import check_chat, check_context, include_usage, max_new_tokens, sampling_kwargs
from llminfer.results import StreamChunk


@post("/chat/completions", status_code=200, responses=OPENAPI_ERRORS, summary="Create a chat completion",
      description="OpenAI-compatible. With `stream: true` the response is `text/event-stream` of "
                  "`chat.completion.chunk` objects ending with `data: [DONE]`.")
async def chat_completions(request: Request, data: SkipValidation[s.ChatCompletionRequest]) -> s.ChatCompletion:
    """Chat completion: the messages through the model's chat template, then generation (JSON or SSE).

    Raises:
        APIError: 400 bad input (incl. ``context_length_exceeded``), 404 unknown model, 429 queue full.
    """
    data = s.parse_body(data, s.ChatCompletionRequest)
    state = server_state(request)
    model = state.resolve_model(data.model)
    logprobs = check_chat(data)
    assert state.prompts is not None
    # Tokenized in the event loop, as the engine's own tokenize stage does: the HF tokenizer is shared
    # with the pipeline and a fast tokenizer must not be used from two threads at once.
    ids = state.prompts.chat(data.messages)
    max_new, _ = max_new_tokens(data, None)
    check_context(state.prompts.inputs, ids, max_new, param="messages")
    job = new_job("chat", model, [ids], data.n or 1, state.engine.make_request,
                  sampling_kwargs(data, max_new, logprobs), logprobs=logprobs)
    job.include_usage = include_usage(data)
    return await execute(request, state, job, stream=bool(data.stream),  # type: ignore[return-value]
                         prompt_param="messages", render_json=chat_response, render_events=chat_events)


def chat_response(job: Job, items: Sequence[Item], outcome: JobOutcome, token_text: TokenText) -> s.ChatCompletion:
    """The non-streamed chat completion."""
    choices = []
    for i, c in enumerate(collect(job, items)):
        lp = None
        if job.logprobs is not None:
            lp = s.ChatLogprobs(content=chat_logprobs(c.logprobs, job.logprobs, token_text))
        choices.append(s.ChatChoice(i, s.ChatResponseMessage("assistant", "".join(c.text)), lp, c.finish_reason))
    return s.ChatCompletion(job.id, job.created, job.model, choices, usage_of(job, outcome))


def chat_events(job: Job, first: Sequence[Item], rest: AsyncIterator[Item], outcome: JobOutcome,
                token_text: TokenText) -> AsyncIterator[bytes]:
    """SSE frames of a streamed chat completion.

    Every choice first gets a delta with the role, then content deltas, then a chunk with an empty delta
    and its ``finish_reason``; with ``include_usage`` every chunk has ``usage: null`` and one last chunk
    with empty ``choices`` carries the usage; then ``[DONE]``. ``first`` are chunks already pulled,
    ``rest`` the remaining ones (the caller closes it).
    """
    usage_field: Any = None if job.include_usage else UNSET

    def chunk_frame(choices: list[s.ChatChunkChoice], usage: Any = usage_field) -> bytes:
        return frame(s.ChatCompletionChunk(job.id, job.created, job.model, choices, usage=usage))

    def render(index: int, item: StreamChunk) -> list[bytes]:
        frames = []
        entries = getattr(item, "logprobs", ()) or ()
        if item.token or (job.logprobs is not None and entries):
            lp = None
            if job.logprobs is not None:
                lp = s.ChatLogprobs(content=chat_logprobs(entries, job.logprobs, token_text))
            frames.append(chunk_frame([s.ChatChunkChoice(index, s.ChatDelta(content=item.token), lp)]))
        if item.is_final:
            frames.append(chunk_frame([s.ChatChunkChoice(index, s.ChatDelta(), None,
                                                         item.finish_reason or "stop")]))
        return frames

    opening = [chunk_frame([s.ChatChunkChoice(i, s.ChatDelta(role="assistant", content=""))])
               for i in range(len(job.requests))]
    return sse_frames(job, first, rest, outcome, opening=opening, render=render,
                      usage_frame=lambda usage: chunk_frame([], usage))

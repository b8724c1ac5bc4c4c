"""``POST /v1/chat/completions``: the handler, and its JSON (:func:`chat_response`) and SSE
(:func:`chat_events`) renderers.

With tools, each choice's text goes through a :class:`~llminfer.tools.ToolCallParser` (one per choice):
the JSON response folds its events into ``message.content`` and ``message.tool_calls``; the stream sends
the same events as they become certain, content as ``delta.content`` and calls as ``delta.tool_calls``
fragments (the first with ``id``, ``type`` and ``function.name``), so both agree.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import anyio
from litestar import Request, post
from litestar.params import SkipValidation
from msgspec import UNSET

from llminfer.api import protocol as s
from llminfer.api.errors import OPENAPI_ERRORS
from llminfer.api.execution import execute
from llminfer.api.jobs import Item, Job, collect, new_job, usage_of
from llminfer.api.logprobs import TokenText, chat_logprobs
from llminfer.api.middleware import server_state
from llminfer.api.request_info import JobOutcome
from llminfer.api.sampling import sampling_kwargs
from llminfer.api.streaming import frame, sse_frames
from llminfer.api.translate import (
    check_chat,
    check_logit_bias,
    include_usage,
    max_new_tokens,
    structured_output,
    tool_plan,
    truncate_prompt,
    unknown_fields,
)
from llminfer.results import StreamChunk
from llminfer.sampling.structured import StructuredOutput
from llminfer.tools import Event, ToolCallDelta, ToolCallParser, ToolPlan, finish_reason, fold_events


@post("/chat/completions", status_code=200, responses=OPENAPI_ERRORS, summary="Create a chat completion",
      description="OpenAI-compatible. With `stream: true` the response is `text/event-stream` of "
                  "`chat.completion.chunk` objects ending with `data: [DONE]`.")
async def chat_completions(request: Request, data: SkipValidation[s.ChatCompletionRequest]) -> s.ChatCompletion:
    """Chat completion: the messages through the model's chat template, then generation (JSON or SSE).

    Raises:
        APIError: 400 bad input (incl. ``context_length_exceeded`` and constraints that do not compile),
            404 unknown model, 429 queue full.
    """
    raw = data
    data = s.parse_body(raw, s.ChatCompletionRequest)
    state = server_state(request)
    unknown_fields(raw, s.ChatCompletionRequest, reject=state.reject_unknown_fields)
    model = state.resolve_model(data.model)
    logprobs = check_chat(data)
    assert state.prompts is not None
    state.check_prompt_chars(message_texts(data.messages))
    tokenizer = state.engine.tokenizer
    if data.tools:  # checking tools' schemas and building their grammar can take seconds: off the event loop
        plan, (spec, spec_param) = await anyio.to_thread.run_sync(_plan_output, data, tokenizer)
    else:
        plan, (spec, spec_param) = _plan_output(data, tokenizer)
    ids = await state.tokenize(state.prompts.chat, data.messages, plan.tools if plan is not None else ())
    max_new, _ = max_new_tokens(data, None)
    ids = truncate_prompt(ids, data, state.prompts.inputs.max_model_len, max_new)
    check_logit_bias(data)
    job = await new_job(state, "chat", model, [ids], ["messages"], data.n or 1,
                        sampling_kwargs(data, max_new_tokens=max_new, logprobs=logprobs, structured=spec),
                        logprobs=logprobs, spec=spec, spec_param=spec_param)
    job.include_usage = include_usage(data)
    job.tools = plan if plan is not None and plan.mode != "none" else None
    return await execute(request, state, job, stream=bool(data.stream),  # type: ignore[return-value]
                         prompt_param="messages", render_json=chat_response, render_events=chat_events)


def _plan_output(data: s.ChatCompletionRequest,
                 tokenizer: Any) -> tuple[ToolPlan | None, tuple[StructuredOutput | None, str]]:
    """The request's tool plan and its output constraint (with the field it came from)."""
    plan = tool_plan(data)
    return plan, structured_output(data, plan, tokenizer=tokenizer)


def message_texts(messages: Sequence[s.ChatMessage]) -> Iterator[tuple[str, str | None]]:
    """``(param, text)`` of every text the chat template will render, for the prompt-size bound."""
    for i, message in enumerate(messages):
        content = message.content
        if content is None or isinstance(content, str):
            yield f"messages[{i}].content", content
        else:
            for j, part in enumerate(content):
                yield f"messages[{i}].content[{j}].text", getattr(part, "text", None)
        for call in message.tool_calls or ():
            yield f"messages[{i}].tool_calls", call.function.arguments


def _tool_call_out(events: Sequence[Event]) -> tuple[str | None, list[s.ToolCallOut]]:
    content, calls = fold_events(events)
    return content, [s.ToolCallOut(c.id, s.FunctionCallOut(c.name, c.arguments)) for c in calls]


def chat_response(job: Job, items: Sequence[Item], outcome: JobOutcome, token_text: TokenText) -> s.ChatCompletion:
    """The non-streamed chat completion (with tools: the text parsed into content and ``tool_calls``)."""
    choices = []
    for i, c in enumerate(collect(job, items)):
        lp = None
        if job.logprobs is not None:
            lp = s.ChatLogprobs(content=chat_logprobs(c.logprobs, job.logprobs, token_text))
        text = "".join(c.text)
        if job.tools is None:
            message = s.ChatResponseMessage("assistant", text)
            reason = c.finish_reason
        else:
            parser = ToolCallParser(job.tools)
            content, calls = _tool_call_out([*parser.feed(text), *parser.finish()])
            message = s.ChatResponseMessage("assistant", content, tool_calls=calls or UNSET)
            reason = finish_reason(c.finish_reason, bool(calls))
        choices.append(s.ChatChoice(i, message, lp, reason))
    return s.ChatCompletion(job.id, job.created, job.model, choices, usage_of(job, outcome))


def _delta(event: Event) -> s.ChatDelta:
    if isinstance(event, str):
        return s.ChatDelta(content=event)
    assert isinstance(event, ToolCallDelta)
    if event.id is not None:
        chunk = s.ToolCallChunk(event.index, s.FunctionDelta(event.name or "", event.arguments), event.id,
                                "function")
    else:
        chunk = s.ToolCallChunk(event.index, s.FunctionDelta(arguments=event.arguments))
    return s.ChatDelta(tool_calls=[chunk])


def chat_events(job: Job, first: Sequence[Item], rest: AsyncIterator[Item], outcome: JobOutcome,
                token_text: TokenText) -> AsyncIterator[bytes]:
    """SSE frames of a streamed chat completion.

    Every choice first gets a delta with the role, then content (and, with tools, ``tool_calls``) deltas,
    then a chunk with an empty delta and its ``finish_reason``; with ``include_usage`` every chunk has
    ``usage: null`` and one last chunk with empty ``choices`` carries the usage; then ``[DONE]``. ``first``
    are chunks already pulled, ``rest`` the remaining ones (the caller closes it).
    """
    usage_field: Any = None if job.include_usage else UNSET
    parsers = [ToolCallParser(job.tools) for _ in job.requests] if job.tools is not None else None

    def chunk_frame(choices: list[s.ChatChunkChoice], usage: Any = usage_field) -> bytes:
        return frame(s.ChatCompletionChunk(job.id, job.created, job.model, choices, usage=usage))

    def render(index: int, item: StreamChunk) -> list[bytes]:
        frames = []
        entries = getattr(item, "logprobs", ()) or ()
        if parsers is None:
            if item.token or (job.logprobs is not None and entries):
                lp = None
                if job.logprobs is not None:
                    lp = s.ChatLogprobs(content=chat_logprobs(entries, job.logprobs, token_text))
                frames.append(chunk_frame([s.ChatChunkChoice(index, s.ChatDelta(content=item.token), lp)]))
            reason = item.finish_reason or "stop"
        else:
            lp = None
            if job.logprobs is not None and entries:
                lp = s.ChatLogprobs(content=chat_logprobs(entries, job.logprobs, token_text))
            parser = parsers[index]
            events = parser.feed(item.token) if item.token else []
            if item.is_final:
                events += parser.finish()
            for event in events:
                # A token's logprobs ride on the first frame it produced (or an empty delta if held back).
                frames.append(chunk_frame([s.ChatChunkChoice(index, _delta(event), lp)]))
                lp = None
            if lp is not None:
                frames.append(chunk_frame([s.ChatChunkChoice(index, s.ChatDelta(), lp)]))
            reason = finish_reason(item.finish_reason, parser.calls > 0)
        if item.is_final:
            frames.append(chunk_frame([s.ChatChunkChoice(index, s.ChatDelta(), None, reason)]))
        return frames

    opening = [chunk_frame([s.ChatChunkChoice(i, s.ChatDelta(role="assistant", content=""))])
               for i in range(len(job.requests))]
    return sse_frames(job, first, rest, outcome, opening=opening, render=render,
                      usage_frame=lambda usage: chunk_frame([], usage))

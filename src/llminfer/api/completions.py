"""``POST /v1/completions`` (legacy completions): the handler, and its JSON (:func:`completion_response`)
and SSE (:func:`completion_events`) renderers."""

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
from llminfer.api.logprobs import TokenText, completion_logprobs
from llminfer.api.middleware import server_state
from llminfer.api.translate import (
    check_completion,
    check_context,
    check_structured_output,
    include_usage,
    max_new_tokens,
    sampling_kwargs,
    structured_output,
)
from llminfer.results import StreamChunk


@post("/completions", status_code=200, responses=OPENAPI_ERRORS, summary="Create a completion",
      description="OpenAI-compatible (legacy completions). `prompt` may be a string, a list of strings, a list "
                  "of token ids or a list of token-id lists.")
async def completions(request: Request, data: SkipValidation[s.CompletionRequest]) -> s.Completion:
    """Legacy completion of one or several prompts (text or token ids), JSON or SSE.

    Raises:
        APIError: 400 bad input (incl. ``context_length_exceeded`` and constraints that do not compile),
            404 unknown model, 429 queue full.
    """
    data = s.parse_body(data, s.CompletionRequest)
    state = server_state(request)
    model = state.resolve_model(data.model)
    check_completion(data)
    spec, spec_param = structured_output(data)
    assert state.prompts is not None
    if isinstance(data.prompt, str):
        state.check_prompt_chars([("prompt", data.prompt)])
    else:
        for i, p in enumerate(data.prompt):
            if isinstance(p, str):
                state.check_prompt_chars([(f"prompt[{i}]", p)])
    prompt_ids = await state.tokenize(state.prompts.completion, data.prompt)
    max_new, _ = max_new_tokens(data, 16)
    for i, ids in enumerate(prompt_ids):
        check_context(state.prompts.inputs, ids, max_new,
                      param="prompt" if len(prompt_ids) == 1 else f"prompt[{i}]")
    job = new_job("completion", model, prompt_ids, data.n or 1, state.engine.make_request,
                  sampling_kwargs(data, max_new, data.logprobs, spec), logprobs=data.logprobs)
    job.include_usage = include_usage(data)
    job.constraint_param = spec_param or None
    await check_structured_output(state.engine, spec, spec_param)
    if data.echo:
        if isinstance(data.prompt, str):
            job.echo_texts = [data.prompt]
        elif all(isinstance(p, str) for p in data.prompt):
            job.echo_texts = list(data.prompt)  # type: ignore[arg-type]
        else:
            job.echo_texts = [state.engine.tokenizer.decode(ids) for ids in prompt_ids]
    return await execute(request, state, job, stream=bool(data.stream),  # type: ignore[return-value]
                         prompt_param="prompt", render_json=completion_response, render_events=completion_events)


def completion_response(job: Job, items: Sequence[Item], outcome: JobOutcome, token_text: TokenText) -> s.Completion:
    """The non-streamed completion (``echo`` puts the prompt text in front)."""
    choices = []
    for i, c in enumerate(collect(job, items)):
        prefix = job.echo_texts[job.choice_prompt[i]] if job.echo_texts is not None else ""
        lp = None
        if job.logprobs is not None:
            lp = completion_logprobs(c.logprobs, job.logprobs, token_text, len(prefix))
        choices.append(s.CompletionChoice(i, prefix + "".join(c.text), lp, c.finish_reason))
    return s.Completion(job.id, job.created, job.model, choices, usage=usage_of(job, outcome))


def completion_events(job: Job, first: Sequence[Item], rest: AsyncIterator[Item], outcome: JobOutcome,
                      token_text: TokenText) -> AsyncIterator[bytes]:
    """SSE frames of a streamed completion: text pieces per choice (the prompt first with ``echo``), the
    last one of each choice with its ``finish_reason``, an optional usage chunk, then ``[DONE]``."""
    usage_field: Any = None if job.include_usage else UNSET
    offsets = [0] * len(job.requests)

    def chunk_frame(choices: list[s.CompletionChoice], usage: Any = usage_field) -> bytes:
        return frame(s.Completion(job.id, job.created, job.model, choices, usage=usage))

    def render(index: int, item: StreamChunk) -> list[bytes]:
        entries = getattr(item, "logprobs", ()) or ()
        if not (item.token or item.is_final or (job.logprobs is not None and entries)):
            return []
        lp = None
        if job.logprobs is not None:
            lp = completion_logprobs(entries, job.logprobs, token_text, offsets[index])
        offsets[index] += len(item.token)
        finish = (item.finish_reason or "stop") if item.is_final else None
        return [chunk_frame([s.CompletionChoice(index, item.token, lp, finish)])]

    opening = []
    if job.echo_texts is not None:
        for i in range(len(job.requests)):
            text = job.echo_texts[job.choice_prompt[i]]
            offsets[i] = len(text)
            opening.append(chunk_frame([s.CompletionChoice(i, text, None, None)]))
    return sse_frames(job, first, rest, outcome, opening=opening, render=render,
                      usage_frame=lambda usage: chunk_frame([], usage))

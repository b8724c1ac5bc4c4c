"""``POST /v1/completions`` (legacy completions): the handler, and its JSON (:func:`completion_response`)
and SSE (:func:`completion_events`) renderers.

Scoring, the way lm-evaluation-harness asks for it: ``echo`` with ``logprobs`` puts the prompt's tokens in
front of the generated ones in ``logprobs`` (the first with ``null``: nothing precedes it), computed in the
prefill of the first sample of each prompt (``prompt_logprobs`` of the engine). ``max_tokens: 0`` returns
the prompt alone: the engine still samples the one token that ends the prefill, and it is not returned or
counted. vLLM's ``prompt_logprobs`` gives the same numbers in vLLM's shape. ``best_of`` > ``n`` generates
``best_of`` samples per prompt and returns the ``n`` with the highest cumulative logprob.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import attrs
from litestar import Request, post
from litestar.params import SkipValidation
from msgspec import UNSET

from llminfer.api import protocol as s
from llminfer.api.errors import OPENAPI_ERRORS
from llminfer.api.execution import execute
from llminfer.api.jobs import Item, Job, collect, new_job, usage_of
from llminfer.api.logprobs import TokenText, completion_logprobs, join_logprobs, vllm_prompt_logprobs
from llminfer.api.middleware import server_state
from llminfer.api.request_info import JobOutcome
from llminfer.api.sampling import sampling_kwargs
from llminfer.api.streaming import frame, sse_frames
from llminfer.api.translate import (
    check_completion,
    check_logit_bias,
    check_suffix,
    include_usage,
    max_new_tokens,
    structured_output,
    truncate_prompt,
    unknown_fields,
)
from llminfer.results import StreamChunk


@attrs.frozen
class CompletionOptions:
    """How a completion call is rendered (``Job.render_options``).

    Attributes:
        echo_logprobs: ``echo`` with ``logprobs``: the prompt's tokens lead ``logprobs``.
        score_only: ``max_tokens`` 0: the token sampled at the end of the prefill is not returned or counted.
        num_return: choices returned per prompt (``n``).
        ranked: ``best_of`` > ``n``: return the ``n`` samples of highest cumulative logprob.
        prompt_logprobs: vLLM's ``prompt_logprobs`` (top alternatives per prompt token), None when not asked.
    """

    echo_logprobs: bool = False
    score_only: bool = False
    num_return: int = 1
    ranked: bool = False
    prompt_logprobs: int | None = None


@post("/completions", status_code=200, responses=OPENAPI_ERRORS, summary="Create a completion",
      description="OpenAI-compatible (legacy completions). `prompt` may be a string, a list of strings, a list "
                  "of token ids or a list of token-id lists. `echo` with `logprobs` (and `max_tokens: 0`) "
                  "scores the prompt, as lm-evaluation-harness does. With `stream: true` the response is "
                  "`text/event-stream` of `text_completion` objects ending with `data: [DONE]`.")
async def completions(request: Request, data: SkipValidation[s.CompletionRequest]) -> s.Completion:
    """Legacy completion of one or several prompts (text or token ids), JSON or SSE.

    Raises:
        APIError: 400 bad input (incl. ``context_length_exceeded``, ``suffix`` and constraints that do not
            compile), 404 unknown model, 429 queue full.
    """
    raw = data
    check_suffix(raw)
    data = s.parse_body(raw, s.CompletionRequest)
    state = server_state(request)
    # An empty ``suffix`` (some clients always send it) is harmless: not counted as an unknown field.
    unknown_fields({k: v for k, v in raw.items() if k != "suffix"} if isinstance(raw, dict) else raw,
                   s.CompletionRequest, reject=state.reject_unknown_fields)
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
    score_only = max_new == 0
    engine_max_new = 1 if score_only else max_new
    truncated = [truncate_prompt(ids, data, state.prompts.inputs.max_model_len, engine_max_new) for ids in prompt_ids]
    was_truncated = any(len(a) != len(b) for a, b in zip(truncated, prompt_ids))
    prompt_ids = truncated
    params = ["prompt"] if len(prompt_ids) == 1 else [f"prompt[{i}]" for i in range(len(prompt_ids))]
    n = data.n or 1
    samples = data.best_of if data.best_of is not None and data.best_of > n else n
    echo_logprobs = bool(data.echo) and data.logprobs is not None
    wanted = [k for k in (data.logprobs if echo_logprobs else None, data.prompt_logprobs) if k is not None]
    # Ranking best_of samples needs each token's logprob, even when the client asked for none.
    engine_logprobs = data.logprobs if data.logprobs is not None else (0 if samples > n else None)
    check_logit_bias(data)
    kwargs = sampling_kwargs(data, max_new_tokens=engine_max_new, logprobs=engine_logprobs, structured=spec)
    if score_only:
        kwargs.pop("min_new_tokens", None)  # the one hidden token needs no minimum
    job = await new_job(state, "completion", model, prompt_ids, params, samples, kwargs, logprobs=data.logprobs,
                        first_kwargs={"prompt_logprobs": max(wanted)} if wanted else None, spec=spec,
                        spec_param=spec_param)
    job.render_options = CompletionOptions(echo_logprobs, score_only, n, samples > n, data.prompt_logprobs)
    job.include_usage = include_usage(data)
    if data.echo:
        if isinstance(data.prompt, str) and not was_truncated:
            job.echo_texts = [data.prompt]
        elif not was_truncated and all(isinstance(p, str) for p in data.prompt):
            job.echo_texts = list(data.prompt)  # type: ignore[arg-type]
        else:
            job.echo_texts = [state.engine.tokenizer.decode(ids) for ids in prompt_ids]
    return await execute(request, state, job, stream=bool(data.stream),  # type: ignore[return-value]
                         prompt_param="prompt", render_json=completion_response, render_events=completion_events)


def _options(job: Job) -> CompletionOptions:
    return job.render_options if job.render_options is not None else CompletionOptions(num_return=len(job.requests))


def _prompt_entries(job: Job, items: Sequence[Item]) -> dict[int, tuple[Any, ...]]:
    """The engine's prompt logprobs of each prompt (they ride on the first chunk of its first sample)."""
    return {job.choice_prompt[i]: chunk.prompt_logprobs for i, chunk in items if chunk.prompt_logprobs}


def _usage(job: Job, outcome: JobOutcome) -> s.Usage:
    usage = usage_of(job, outcome)
    if _options(job).score_only:  # the hidden token is not a completion token
        return s.Usage(usage.prompt_tokens, 0, usage.prompt_tokens, usage.prompt_tokens_details)
    return usage


def _head(job: Job, prompt: int, entries: dict[int, tuple[Any, ...]], token_text: TokenText
          ) -> tuple[s.CompletionLogprobs | None, Any]:
    """The prompt's part of a choice: its ``logprobs`` head (``echo`` with ``logprobs``) and vLLM's
    ``prompt_logprobs`` (UNSET when not asked)."""
    opts = _options(job)
    found = entries.get(prompt, ())
    head = None
    if opts.echo_logprobs and job.logprobs is not None:
        head = completion_logprobs(found, job.logprobs, token_text, 0, first_token=job.prompt_ids[prompt][0])
    vllm: Any = UNSET
    if opts.prompt_logprobs is not None:
        vllm = vllm_prompt_logprobs(found, opts.prompt_logprobs, token_text)
    return head, vllm


def _selected(job: Job, collected: Sequence[Any]) -> list[int]:
    """Choice indices to return, in order: all of them, or with ``best_of`` > ``n`` the ``n`` samples of
    each prompt with the highest cumulative logprob (ties: the earlier sample)."""
    opts = _options(job)
    if not opts.ranked:
        return list(range(len(collected)))
    out: list[int] = []
    for p in range(len(job.prompt_ids)):
        samples = [i for i, q in enumerate(job.choice_prompt) if q == p]
        samples.sort(key=lambda i: -sum(e.logprob for e in collected[i].logprobs))
        out.extend(samples[: opts.num_return])
    return out


def completion_response(job: Job, items: Sequence[Item], outcome: JobOutcome, token_text: TokenText) -> s.Completion:
    """The non-streamed completion (``echo`` puts the prompt text, and with ``logprobs`` its tokens, in front)."""
    opts = _options(job)
    collected = collect(job, items)
    entries = _prompt_entries(job, items)
    choices = []
    for index, i in enumerate(_selected(job, collected)):
        c = collected[i]
        p = job.choice_prompt[i]
        prefix = job.echo_texts[p] if job.echo_texts is not None else ""
        text = "" if opts.score_only else "".join(c.text)
        head, vllm = _head(job, p, entries, token_text)
        lp = None
        if job.logprobs is not None:
            lp = completion_logprobs(() if opts.score_only else c.logprobs, job.logprobs, token_text, len(prefix))
            lp = join_logprobs(head, lp) if head is not None else lp
        finish = "length" if opts.score_only else c.finish_reason
        choices.append(s.CompletionChoice(index, prefix + text, lp, finish, vllm))
    return s.Completion(job.id, job.created, job.model, choices, usage=_usage(job, outcome))


def completion_events(job: Job, first: Sequence[Item], rest: AsyncIterator[Item], outcome: JobOutcome,
                      token_text: TokenText) -> AsyncIterator[bytes]:
    """SSE frames of a streamed completion: per choice an opening chunk when the prompt is echoed or
    scored (its text, its tokens' logprobs, vLLM's ``prompt_logprobs``), then text pieces, the last one
    of each choice with its ``finish_reason``, an optional usage chunk, then ``[DONE]``."""
    opts = _options(job)
    usage_field: Any = None if job.include_usage else UNSET
    offsets = [0] * len(job.requests)

    def chunk_frame(choices: list[s.CompletionChoice], usage: Any = usage_field) -> bytes:
        return frame(s.Completion(job.id, job.created, job.model, choices, usage=usage))

    def render(index: int, item: StreamChunk) -> list[bytes]:
        if opts.score_only:
            return [chunk_frame([s.CompletionChoice(index, "", None, "length")])] if item.is_final else []
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
    if job.echo_texts is not None or opts.prompt_logprobs is not None:
        entries = _prompt_entries(job, first)
        for i in range(len(job.requests)):
            p = job.choice_prompt[i]
            text = job.echo_texts[p] if job.echo_texts is not None else ""
            offsets[i] = len(text)
            head, vllm = _head(job, p, entries, token_text)
            opening.append(chunk_frame([s.CompletionChoice(i, text, head, None, vllm)]))
    return sse_frames(job, first, rest, outcome, opening=opening, render=render,
                      usage_frame=lambda usage: chunk_frame([], _usage(job, outcome)))

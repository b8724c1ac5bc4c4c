"""From an OpenAI request to engine requests and back: prompts, sampling arguments, choices, logprobs.

The HTTP layer (``llminfer.api.app``) stays thin: it validates the body (msgspec), calls
:func:`prepare_chat` / :func:`prepare_completion` to get a :class:`Job` (engine requests, one per
choice), runs it with :func:`run_job`, and renders the chunks with the ``*_response`` / ``*_events``
helpers here.
"""

from __future__ import annotations

import contextlib
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from functools import lru_cache
from typing import Any

import anyio
import attrs
from anyio.abc import TaskGroup
from msgspec import UNSET

from llminfer.api import protocol as s
from llminfer.api.errors import APIError, bad_request, from_engine_error
from llminfer.errors import InvalidRequestError
from llminfer.protocols.messages import GenerationRequest
from llminfer.results import StreamChunk

_LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a probability that underflows (JSON has no -inf)


# ---------------------------------------------------------------------------- tokens as text
def _byte_level_alphabet() -> dict[str, int]:
    """The reversible byte <-> printable-character table of byte-level BPE (GPT-2, Qwen, Llama 3)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(0x100 + extra)] = b
            extra += 1
    return table


_BYTE_LEVEL = _byte_level_alphabet()


class TokenText:
    """Text and raw UTF-8 bytes of single tokens (for logprobs), cached per token id.

    A byte-level BPE token can hold part of a multi-byte character: its text then contains U+FFFD while
    ``bytes`` holds the exact bytes, as the OpenAI API reports them.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        try:
            pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode(" a", add_special_tokens=False))
            self.byte_level = any("\u0120" in p for p in pieces)
        except Exception:  # noqa: BLE001 - any tokenizer without these methods is simply not byte-level
            self.byte_level = False
        self.lookup = lru_cache(maxsize=65536)(self._lookup)

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if self.byte_level:
            raw = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(raw, str) and raw and all(ch in _BYTE_LEVEL for ch in raw):
                return text, [_BYTE_LEVEL[ch] for ch in raw]
        return text, list(text.encode("utf-8", errors="replace"))


# ---------------------------------------------------------------------------- prompts
class PromptBuilder:
    """Turns chat messages and completion prompts into token ids the way the model expects.

    Args:
        tokenizer: the engine's Hugging Face tokenizer.
        vocab_size: token ids must be below it (``None``: not checked here).
    """

    def __init__(self, tokenizer: Any, vocab_size: int | None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        bos = getattr(tokenizer, "bos_token_id", None)
        self.bos_id: int | None = bos if isinstance(bos, int) else None
        self.adds_bos = False
        if self.bos_id is not None:
            with contextlib.suppress(Exception):
                self.adds_bos = tokenizer.encode("a")[:1] == [self.bos_id]

    def encode(self, text: str, param: str) -> list[int]:
        """Tokenize a completion prompt as the engine's tokenize stage does (special tokens added).

        Raises:
            APIError: 400 when the text cannot be tokenized or tokenizes to nothing.
        """
        try:
            ids = list(self.tokenizer.encode(text))
        except Exception as exc:  # noqa: BLE001 - e.g. lone surrogates in the JSON string
            raise bad_request(f"the prompt could not be tokenized: {exc}", param) from None
        if not ids:
            raise bad_request("the prompt is empty", param, "invalid_value")
        return ids

    def chat(self, messages: Sequence[s.ChatMessage]) -> list[int]:
        """Render the conversation with the chat template (generation prompt added) and tokenize it with
        exactly one BOS token (when the model uses one).

        Raises:
            APIError: 400 for a non-text content part, a model without a chat template, or messages the
                template rejects.
        """
        conversation = []
        for i, message in enumerate(messages):
            content = message.content
            if content is None:
                text = ""
            elif isinstance(content, str):
                text = content
            else:
                parts = []
                for j, part in enumerate(content):
                    if part.type != "text":
                        raise bad_request(f"content parts of type '{part.type}' are not supported; only 'text'",
                                          f"messages[{i}].content[{j}].type", "unsupported_content_type")
                    if part.text is None:
                        raise bad_request("a 'text' content part needs a 'text' field",
                                          f"messages[{i}].content[{j}].text", "missing_required_parameter")
                    parts.append(part.text)
                text = "\n".join(parts)
            role = "system" if message.role == "developer" else message.role
            conversation.append({"role": role, "content": text})
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions", "messages",
                              "no_chat_template")
        try:
            rendered = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
            ids = list(self.tokenizer.encode(rendered, add_special_tokens=False))
        except Exception as exc:  # noqa: BLE001 - jinja TemplateError, tokenizer errors: the messages' fault
            raise bad_request(f"the messages could not be rendered with the chat template: {exc}",
                              "messages") from None
        bos = self.bos_id
        if bos is not None:
            while len(ids) > 1 and ids[0] == bos and ids[1] == bos:
                del ids[0]
            if self.adds_bos and (not ids or ids[0] != bos):
                ids.insert(0, bos)
        if not ids:
            raise bad_request("the messages render to an empty prompt", "messages", "invalid_value")
        return ids

    def completion(self, prompt: str | list[Any]) -> list[list[int]]:
        """Split ``prompt`` into prompts (a string, strings, token ids, or token-id lists) as token ids.

        Raises:
            APIError: 400 for a mixed or empty list, an empty prompt, or token ids outside the vocabulary.
        """
        if isinstance(prompt, str):
            return [self.encode(prompt, "prompt")]
        kinds = {type(x) for x in prompt}
        if kinds == {str}:
            return [self.encode(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        if kinds == {int}:
            return [self._check_ids(prompt, "prompt")]
        if kinds == {list}:
            return [self._check_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of token-id "
                          "lists (not a mix)", "prompt", "invalid_type")

    def _check_ids(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise bad_request("the prompt is empty", param, "invalid_value")
        if self.vocab_size is not None and any(t >= self.vocab_size for t in ids):
            raise bad_request(f"token ids must be in [0, {self.vocab_size})", param, "invalid_value")
        return list(ids)


def check_context(prompt_len: int, max_new: int | None, max_model_len: int, *, param: str) -> None:
    """Refuse a prompt that leaves no room in the context, or that with ``max_new`` tokens overflows it.

    Raises:
        APIError: 400 with code ``context_length_exceeded``.
    """
    if prompt_len >= max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens; your prompt has "
                          f"{prompt_len} tokens and leaves no room for a completion.", param,
                          "context_length_exceeded")
    if max_new is not None and prompt_len + max_new > max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                          f"{prompt_len + max_new} tokens ({prompt_len} in the prompt, {max_new} for the "
                          "completion). Reduce the prompt or the completion length.", param,
                          "context_length_exceeded")


# ---------------------------------------------------------------------------- sampling arguments
_MIN_TEMPERATURE = 1e-5
_PASS_THROUGH = ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "no_repeat_ngram_size")


def max_new_tokens(body: s.ChatCompletionRequest | s.CompletionRequest, default: int | None) -> tuple[int | None, str]:
    """The completion length the client asked for, and the field it came from.

    ``max_completion_tokens`` wins over ``max_tokens``; an explicit ``null`` means "until the context fills".
    """
    if body.max_completion_tokens is not UNSET:
        return body.max_completion_tokens, "max_completion_tokens"  # type: ignore[return-value]
    if body.max_tokens is not UNSET:
        return body.max_tokens, "max_tokens"  # type: ignore[return-value]
    return default, "max_tokens"


def sampling_kwargs(body: s.ChatCompletionRequest | s.CompletionRequest, max_new: int | None,
                    logprobs: int | None) -> dict[str, Any]:
    """Keyword arguments of ``engine.make_request`` for an OpenAI request (OpenAI defaults: temperature 1,
    top_p 1; a temperature below 1e-5 is greedy). Fields the client did not send are left out, so the
    engine's defaults apply."""
    temperature = 1.0 if body.temperature is None else float(body.temperature)
    kw: dict[str, Any] = {
        "max_new_tokens": max_new,
        # Below 1e-5 the logits / temperature can overflow to inf; such a temperature means greedy anyway.
        "temperature": 0.0 if temperature < _MIN_TEMPERATURE else temperature,
        "top_p": 1.0 if body.top_p is None else float(body.top_p),
    }
    if body.top_k is not None:
        kw["top_k"] = max(body.top_k, 0)  # -1 (vLLM's "off") is 0 here
    if body.stop:
        kw["stop_sequences"] = [body.stop] if isinstance(body.stop, str) else list(body.stop)
    if body.seed is not None:
        kw["seed"] = body.seed
    if body.ignore_eos:
        kw["ignore_eos"] = True
    for name in _PASS_THROUGH:
        value = getattr(body, name)
        if value is not None:
            kw[name] = value
    if body.bad_words:
        kw["bad_words"] = tuple(body.bad_words)
    if body.force_words:
        kw["force_words"] = tuple(body.force_words)
    if logprobs is not None:
        kw["logprobs"] = logprobs
    return kw


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


def new_job(kind: str, model: str, prompt_ids: list[list[int]], n: int, make: Callable[..., GenerationRequest],
            kwargs: dict[str, Any], *, logprobs: int | None = None) -> Job:
    """Build the engine requests of a call: ``n`` per prompt (seed + i for the i-th sample when seeded).

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
                           task_group: TaskGroup | None) -> AsyncIterator[tuple[int, StreamChunk]]:
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


class Ticket:
    """A slot reservation for ``count`` engine requests; :meth:`release` (idempotent) gives it back."""

    def __init__(self, release: Callable[[int], None], count: int) -> None:
        self._release = release
        self.count = count
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._release(self.count)


@attrs.define
class JobOutcome:
    """Per-call bookkeeping filled while the job runs (read by the request log line)."""

    completion_tokens: int = 0
    cached_tokens: dict[int, int] = attrs.field(factory=dict)
    finish_reasons: dict[int, str] = attrs.field(factory=dict)
    aborted: int = 0
    failed: bool = False


async def run_job(job: Job, engine: Any, task_group: TaskGroup | None, ticket: Ticket, metrics: Any,
                  outcome: JobOutcome) -> AsyncIterator[tuple[int, StreamChunk]]:
    """:func:`generate_choices` plus accounting: metrics for each finished choice, the aborted count when
    the reader stops early (client disconnect), and the ticket released at the end, however it ends.

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
                    metrics.observe_finished(chunk.stats, chunk.finish_reason)
                yield index, chunk
        done = True
    except Exception:  # LLMInferError from the engine, or a bug: the requests failed, they were not aborted
        outcome.failed = True
        metrics.failed(len(job.requests) - len(finished))
        raise
    finally:
        if not done and not outcome.failed and len(finished) < len(job.requests):
            outcome.aborted = len(job.requests) - len(finished)
            metrics.aborted(outcome.aborted)
        ticket.release()


# ---------------------------------------------------------------------------- rendering
def _lp(value: float) -> float:
    return value if math.isfinite(value) else _LOGPROB_FLOOR


def chat_logprobs(chunk_logprobs: Sequence[Any], k: int, token_text: TokenText) -> list[s.ChatTokenLogprob]:
    """Engine ``TokenLogprob`` entries in the chat format (``token``, ``logprob``, ``bytes``, ``top_logprobs``)."""
    out = []
    for entry in chunk_logprobs:
        text, raw = token_text.lookup(entry.token_id)
        top = []
        for tid, value in tuple(entry.top)[:k]:
            t_text, t_raw = token_text.lookup(tid)
            top.append(s.TopLogprob(t_text, _lp(value), t_raw))
        out.append(s.ChatTokenLogprob(text, _lp(entry.logprob), raw, top))
    return out


def completion_logprobs(chunk_logprobs: Sequence[Any], k: int, token_text: TokenText,
                        offset: int) -> s.CompletionLogprobs:
    """Engine ``TokenLogprob`` entries in the legacy completions format; ``offset``: text offset of the first."""
    tokens, values, tops, offsets = [], [], [], []
    for entry in chunk_logprobs:
        text, _ = token_text.lookup(entry.token_id)
        tokens.append(text)
        values.append(_lp(entry.logprob))
        tops.append({token_text.lookup(tid)[0]: _lp(v) for tid, v in tuple(entry.top)[:k]})
        offsets.append(offset)
        offset += len(text)
    return s.CompletionLogprobs(tokens, values, tops, offsets)


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


def collect(job: Job, items: Sequence[tuple[int, StreamChunk]]) -> list[_Choice]:
    """Fold all chunks of a finished call into per-choice text, logprob entries and finish reasons."""
    choices = [_Choice() for _ in job.requests]
    for index, chunk in items:
        c = choices[index]
        c.text.append(chunk.token)
        c.logprobs.extend(getattr(chunk, "logprobs", ()) or ())
        if chunk.is_final:
            c.finish_reason = chunk.finish_reason
    return choices


def chat_response(job: Job, items: Sequence[tuple[int, StreamChunk]], outcome: JobOutcome,
                  token_text: TokenText) -> s.ChatCompletion:
    """The non-streamed chat completion."""
    choices = []
    for i, c in enumerate(collect(job, items)):
        lp = None
        if job.logprobs is not None:
            lp = s.ChatLogprobs(content=chat_logprobs(c.logprobs, job.logprobs, token_text))
        choices.append(s.ChatChoice(i, s.ChatResponseMessage("assistant", "".join(c.text)), lp, c.finish_reason))
    return s.ChatCompletion(job.id, job.created, job.model, choices, usage_of(job, outcome))


def completion_response(job: Job, items: Sequence[tuple[int, StreamChunk]], outcome: JobOutcome,
                        token_text: TokenText) -> s.Completion:
    """The non-streamed completion (``echo`` puts the prompt text in front)."""
    choices = []
    for i, c in enumerate(collect(job, items)):
        prefix = job.echo_texts[job.choice_prompt[i]] if job.echo_texts is not None else ""
        lp = None
        if job.logprobs is not None:
            lp = completion_logprobs(c.logprobs, job.logprobs, token_text, len(prefix))
        choices.append(s.CompletionChoice(i, prefix + "".join(c.text), lp, c.finish_reason))
    return s.Completion(job.id, job.created, job.model, choices, usage=usage_of(job, outcome))


def _frame(obj: Any) -> bytes:
    return b"data: " + s.json_encoder.encode(obj) + b"\n\n"


DONE_FRAME = b"data: [DONE]\n\n"


def error_frame(error: APIError) -> bytes:
    """An SSE event carrying an OpenAI error object (sent when a stream fails after it started)."""
    return _frame(error.body())


async def chat_events(job: Job, first: Sequence[tuple[int, StreamChunk]],
                      rest: AsyncIterator[tuple[int, StreamChunk]], outcome: JobOutcome,
                      token_text: TokenText) -> AsyncIterator[bytes]:
    """SSE frames of a streamed chat completion.

    Every choice first gets a delta with the role, then content deltas, then a chunk with an empty delta
    and its ``finish_reason``; with ``include_usage`` every chunk has ``usage: null`` and one last chunk
    with empty ``choices`` carries the usage; then ``[DONE]``. ``first`` are chunks already pulled,
    ``rest`` the remaining ones (the caller closes it).
    """
    usage_field: Any = None if job.include_usage else UNSET

    def frame(choices: list[s.ChatChunkChoice], usage: Any = usage_field) -> bytes:
        return _frame(s.ChatCompletionChunk(job.id, job.created, job.model, choices, usage=usage))

    def render(index: int, item: StreamChunk) -> list[bytes]:
        frames = []
        entries = getattr(item, "logprobs", ()) or ()
        if item.token or (job.logprobs is not None and entries):
            lp = None
            if job.logprobs is not None:
                lp = s.ChatLogprobs(content=chat_logprobs(entries, job.logprobs, token_text))
            frames.append(frame([s.ChatChunkChoice(index, s.ChatDelta(content=item.token), lp)]))
        if item.is_final:
            frames.append(frame([s.ChatChunkChoice(index, s.ChatDelta(), None, item.finish_reason or "stop")]))
        return frames

    for i in range(len(job.requests)):
        yield frame([s.ChatChunkChoice(i, s.ChatDelta(role="assistant", content=""))])
    for index, item in first:
        for f in render(index, item):
            yield f
    async for index, item in rest:
        for f in render(index, item):
            yield f
    if job.include_usage:
        yield frame([], usage_of(job, outcome))
    yield DONE_FRAME


async def completion_events(job: Job, first: Sequence[tuple[int, StreamChunk]],
                            rest: AsyncIterator[tuple[int, StreamChunk]], outcome: JobOutcome,
                            token_text: TokenText) -> AsyncIterator[bytes]:
    """SSE frames of a streamed completion: text pieces per choice (the prompt first with ``echo``), the
    last one of each choice with its ``finish_reason``, an optional usage chunk, then ``[DONE]``."""
    usage_field: Any = None if job.include_usage else UNSET
    offsets = [0] * len(job.requests)

    def frame(choices: list[s.CompletionChoice], usage: Any = usage_field) -> bytes:
        return _frame(s.Completion(job.id, job.created, job.model, choices, usage=usage))

    def render(index: int, item: StreamChunk) -> list[bytes]:
        entries = getattr(item, "logprobs", ()) or ()
        if not (item.token or item.is_final or (job.logprobs is not None and entries)):
            return []
        lp = None
        if job.logprobs is not None:
            lp = completion_logprobs(entries, job.logprobs, token_text, offsets[index])
        offsets[index] += len(item.token)
        finish = (item.finish_reason or "stop") if item.is_final else None
        return [frame([s.CompletionChoice(index, item.token, lp, finish)])]

    if job.echo_texts is not None:
        for i in range(len(job.requests)):
            text = job.echo_texts[job.choice_prompt[i]]
            offsets[i] = len(text)
            yield frame([s.CompletionChoice(i, text, None, None)])
    for index, item in first:
        for f in render(index, item):
            yield f
    async for index, item in rest:
        for f in render(index, item):
            yield f
    if job.include_usage:
        yield frame([], usage_of(job, outcome))
    yield DONE_FRAME

"""``POST /v1/responses`` (OpenAI's Responses API), stateless: the request and response structs, the handler,
and its JSON (:func:`response_json`) and SSE (:func:`response_events`) renderers.

The input (a string, or a list of message items) becomes a chat conversation (``instructions`` first, as a
system message) and runs through the chat template like ``/v1/chat/completions``; ``text.format``
(``json_schema`` / ``json_object``) is the same structured-output constraint as chat's ``response_format``.

Stateless by design: nothing is stored, so ``store: true``, ``previous_response_id`` and ``conversation``
are refused with a 400 naming the field, as are ``tools`` and ``background``. A response that ran into
``max_output_tokens`` (or the context) has ``status: "incomplete"`` with
``incomplete_details.reason = "max_output_tokens"``, and its stream ends with ``response.incomplete``,
as OpenAI's does; otherwise ``status: "completed"`` and ``response.completed``.

The stream is typed SSE events (``event: <type>`` and a JSON ``data`` with the same ``type`` and a
``sequence_number`` counting from 0): ``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta`` (one per
piece of text), ``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``,
then ``response.completed`` (or ``response.incomplete``) carrying the whole response with its usage. A
stream that fails after it started (a shutdown's end of grace, an engine error) ends with an ``error``
event (``code``, ``message``, ``param``), then ``response.failed`` (``status: "failed"`` and the error), and
no ``[DONE]``: the Responses API has none.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Annotated, Any, Literal

from litestar import Request, post
from litestar.params import SkipValidation
from msgspec import Meta, Struct

from llminfer.api import protocol as s
from llminfer.api.errors import OPENAPI_ERRORS, APIError, bad_request, from_engine_error
from llminfer.api.execution import execute
from llminfer.api.jobs import Item, Job, collect, new_job, usage_of
from llminfer.api.logprobs import TokenText
from llminfer.api.middleware import server_state
from llminfer.api.request_info import JobOutcome
from llminfer.api.sampling import sampling_kwargs
from llminfer.api.translate import unknown_fields
from llminfer.errors import InvalidRequestError
from llminfer.results import StreamChunk
from llminfer.sampling.structured import StructuredOutput

# ---------------------------------------------------------------------------- request
# Fields of OpenAI's Responses request this stateless server refuses (the value that is still accepted,
# if any, is the one that changes nothing). They are not in the request schema, so the OpenAPI document
# does not advertise them; they are checked on the raw body, since unknown fields are otherwise ignored.
_REFUSED = {
    "previous_response_id": "this server is stateless: it keeps no responses to continue from; send the whole "
                            "conversation in `input`",
    "conversation": "this server is stateless: it keeps no conversations; send the whole conversation in `input`",
    "tools": "tools are not supported on /v1/responses; use /v1/chat/completions with `tools`",
    "background": "background responses are not supported (nothing is stored to poll)",
    "prompt": "stored prompt templates are not supported; send the text in `input` and `instructions`",
}


class InputContent(Struct, kw_only=True):
    """One part of an input message's ``content`` list: ``input_text`` (or ``output_text`` in an
    assistant message of earlier turns)."""

    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(Struct, kw_only=True):
    """One input item: a message (``developer`` is treated as ``system``)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputContent]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None


class TextFormat(Struct, kw_only=True):
    """``text.format``: plain text, any JSON object, or JSON matching ``schema`` (held to the whole schema,
    or refused; ``strict`` closes the objects the schema leaves open)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(Struct, kw_only=True):
    """``text``: the output's format (``verbosity`` is accepted and has no effect on this server)."""

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(Struct, kw_only=True):
    """``POST /v1/responses`` (the fields of OpenAI's request this server serves, plus llminfer sampling
    extras that clients send through ``extra_body``)."""

    input: str | Annotated[list[InputMessage], Meta(min_length=1)]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: s.PositiveTokens | None = None
    temperature: s.Temperature | None = None
    top_p: s.TopP | None = None
    stream: bool | None = None
    store: Literal[False] | None = None  # stateless: ``true`` is refused (see ``_REFUSED`` for why not absent)
    text: TextConfig | None = None
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None
    metadata: Annotated[dict[str, str], Meta(max_length=16)] | None = None
    user: str | None = None
    # llminfer extras
    top_k: Annotated[int, Meta(ge=-1, le=2**31 - 1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(ge=0.01, le=10.0)] | None = None
    seed: s.Seed | None = None
    ignore_eos: bool | None = None


# ---------------------------------------------------------------------------- response
class OutputText(Struct, kw_only=True):
    text: str
    type: str = "output_text"
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(Struct, kw_only=True):
    """The assistant message of a response (``status`` follows the response's)."""

    id: str
    content: list[OutputText]
    status: str
    role: str = "assistant"
    type: str = "message"


class InputTokensDetails(Struct):
    cached_tokens: int = 0


class OutputTokensDetails(Struct):
    reasoning_tokens: int = 0


class ResponseUsage(Struct):
    """Token counts: ``input_tokens`` of the rendered conversation, ``output_tokens`` generated."""

    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails


class IncompleteDetails(Struct):
    reason: str


class FormatOut(Struct, kw_only=True):
    type: str
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class TextOut(Struct):
    format: FormatOut


class ResponseError(Struct):
    code: str
    message: str


class Response(Struct, kw_only=True):
    """A response object: ``status`` is ``in_progress`` (stream start), ``completed`` or ``incomplete``."""

    id: str
    created_at: int
    model: str
    status: str
    output: list[OutputMessage]
    usage: ResponseUsage | None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextOut
    metadata: dict[str, str] | None = None
    user: str | None = None
    object: str = "response"
    error: ResponseError | None = None
    parallel_tool_calls: bool = False
    tool_choice: str = "none"
    tools: list[Any] = []
    store: bool = False
    previous_response_id: None = None


# ---------------------------------------------------------------------------- request checks
def _refuse_stateful(raw: Any) -> None:
    """Refuse fields a stateless server without tools cannot serve (they are not in the schema).

    Raises:
        APIError: 400 naming the field, code ``unsupported_parameter``.
    """
    if not isinstance(raw, dict):
        return  # parse_body names the problem
    for field, why in _REFUSED.items():
        value = raw.get(field)
        if value not in (None, False, [], ""):
            raise bad_request(f"'{field}' is not supported: {why}", field, "unsupported_parameter")
    if raw.get("store") is True:
        raise bad_request("'store' must be false or absent: this server is stateless and stores no responses",
                          "store", "unsupported_parameter")
    items = raw.get("input")
    if isinstance(items, list):
        for i, item in enumerate(items):
            kind = item.get("type", "message") if isinstance(item, dict) else "message"
            if kind != "message":
                raise bad_request(f"input items of type '{kind}' are not supported; only messages",
                                  f"input[{i}].type", "unsupported_parameter")


def conversation(body: ResponsesRequest) -> list[s.ChatMessage]:
    """The chat messages of a request: ``instructions`` as a system message, then the input."""
    messages = [s.ChatMessage("system", body.instructions)] if body.instructions else []
    if isinstance(body.input, str):
        return [*messages, s.ChatMessage("user", body.input)]
    for item in body.input:
        content = item.content
        text = content if isinstance(content, str) else "\n".join(part.text for part in content)
        messages.append(s.ChatMessage(item.role, text))
    return messages


def _input_texts(body: ResponsesRequest) -> Iterator[tuple[str, str | None]]:
    """``(param, text)`` of every text the chat template renders, for the prompt-size bound."""
    yield "instructions", body.instructions
    if isinstance(body.input, str):
        yield "input", body.input
        return
    for i, item in enumerate(body.input):
        content = item.content
        if isinstance(content, str):
            yield f"input[{i}].content", content
        else:
            for j, part in enumerate(content):
                yield f"input[{i}].content[{j}].text", part.text


def text_format(body: ResponsesRequest) -> StructuredOutput | None:
    """The output constraint ``text.format`` asks for (``None``: plain text).

    Raises:
        APIError: 400 naming ``text.format.schema`` when ``json_schema`` comes without a schema object.
    """
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput(json_object=True)
    if fmt.schema is None:
        raise bad_request("text.format of type 'json_schema' needs a 'schema' object", "text.format.schema",
                          "missing_required_parameter")
    try:
        return StructuredOutput(json_schema=fmt.schema, strict=bool(fmt.strict))
    except InvalidRequestError as exc:
        raise bad_request(str(exc), "text.format.schema", exc.code) from None


# ---------------------------------------------------------------------------- handler
@post("/responses", status_code=200, responses=OPENAPI_ERRORS, summary="Create a model response",
      description="OpenAI Responses API, stateless (`store`, `previous_response_id`, `conversation`, `tools` "
                  "and `background` are refused). With `stream: true` the response is `text/event-stream` "
                  "of typed events (`response.created` ... `response.completed`).")
async def create_response(request: Request, data: SkipValidation[ResponsesRequest]) -> Response:
    """A model response to a text or a list of messages, as JSON or typed SSE events.

    Raises:
        APIError: 400 bad input or a refused field (named in ``param``), 404 unknown model, 429 queue full.
    """
    _refuse_stateful(data)
    body = s.parse_body(data, ResponsesRequest)
    state = server_state(request)
    unknown_fields(data, ResponsesRequest, reject=state.reject_unknown_fields)
    model = state.resolve_model(body.model)
    if body.input == "":
        raise bad_request("input is empty: give a text or at least one message", "input", "invalid_value")
    spec = text_format(body)
    assert state.prompts is not None
    messages = conversation(body)
    state.check_prompt_chars(_input_texts(body))
    ids = await state.tokenize(state.prompts.chat, messages)  # off the event loop, like chat's
    inputs = state.prompts.inputs
    try:
        inputs.check_prompt_ids(ids, max_new_tokens=body.max_output_tokens, param="input")
    except InvalidRequestError as exc:
        # too long by itself: the input's fault; fits, but not with max_output_tokens: that field's
        error = from_engine_error(exc, prompt_param="input")
        if error.code == "context_length_exceeded" and len(ids) < inputs.max_model_len:
            error.param = "max_output_tokens"
        raise error from None
    job = await new_job(state, "chat", model, [ids], ["input"], 1,
                        sampling_kwargs(body, max_new_tokens=body.max_output_tokens, structured=spec), spec=spec,
                        spec_param="text.format" if spec is not None else "")
    job.id = "resp_" + uuid.uuid4().hex
    view = _View(body, job)
    return await execute(request, state, job, stream=bool(body.stream), prompt_param="input",  # type: ignore[return-value]
                         render_json=view.json, render_events=view.events, failure_frames=view.failure_frames)


# ---------------------------------------------------------------------------- rendering
def _event(kind: str, seq: int, **fields: Any) -> bytes:
    """One typed SSE event: ``event: <kind>`` and its JSON data (``type`` and ``sequence_number`` first)."""
    data = {"type": kind, "sequence_number": seq, **fields}
    return b"event: " + kind.encode() + b"\ndata: " + s.json_encoder.encode(data) + b"\n\n"



class _View:
    """Renders one job as a response object or as its typed events."""

    def __init__(self, body: ResponsesRequest, job: Job) -> None:
        self.body = body
        self.job = job
        self.item_id = "msg_" + uuid.uuid4().hex
        fmt = body.text.format if body.text is not None else None
        self.format = (FormatOut(type=fmt.type, name=fmt.name, schema=fmt.schema, strict=fmt.strict)
                       if fmt is not None else FormatOut(type="text"))

    def response(self, status: str, output: list[OutputMessage], usage: ResponseUsage | None,
                 incomplete: bool = False) -> Response:
        b = self.body
        return Response(id=self.job.id, created_at=self.job.created, model=self.job.model, status=status,
                        output=output, usage=usage,
                        incomplete_details=IncompleteDetails("max_output_tokens") if incomplete else None,
                        instructions=b.instructions, max_output_tokens=b.max_output_tokens,
                        temperature=1.0 if b.temperature is None else b.temperature,
                        top_p=1.0 if b.top_p is None else b.top_p, text=TextOut(self.format),
                        metadata=b.metadata, user=b.user, parallel_tool_calls=bool(b.parallel_tool_calls))

    def failure_frames(self, error: APIError, events_sent: int) -> Iterator[bytes]:
        """How a stream that failed after ``events_sent`` events ends: an ``error`` event, then
        ``response.failed`` carrying the error (the Responses API has no ``[DONE]``)."""
        code = error.code or ("server_error" if error.status >= 500 else "invalid_request_error")
        failed = self.response("failed", [], None)
        failed.error = ResponseError(code, error.message)
        yield _event("error", events_sent, code=code, message=error.message, param=error.param)
        yield _event("response.failed", events_sent + 1, response=failed)

    def final(self, text: str, finish_reason: str | None, outcome: JobOutcome) -> Response:
        incomplete = finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        u = usage_of(self.job, outcome)
        cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details is not None else 0
        usage = ResponseUsage(u.prompt_tokens, u.completion_tokens, u.total_tokens, InputTokensDetails(cached),
                              OutputTokensDetails())
        message = OutputMessage(id=self.item_id, content=[OutputText(text=text)], status=status)
        return self.response(status, [message], usage, incomplete)

    def json(self, job: Job, items: Sequence[Item], outcome: JobOutcome, token_text: TokenText) -> Response:
        (choice,) = collect(job, items)
        return self.final("".join(choice.text), choice.finish_reason, outcome)

    async def events(self, job: Job, first: Sequence[Item], rest: AsyncIterator[Item], outcome: JobOutcome,
                     token_text: TokenText) -> AsyncIterator[bytes]:
        seq = 0

        def event(kind: str, **fields: Any) -> bytes:
            nonlocal seq
            seq += 1
            return _event(kind, seq - 1, **fields)

        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        started = self.response("in_progress", [], None)
        yield event("response.created", response=started)
        yield event("response.in_progress", response=started)
        yield event("response.output_item.added", output_index=0,
                    item=OutputMessage(id=self.item_id, content=[], status="in_progress"))
        yield event("response.content_part.added", part=OutputText(text=""), **where)
        pieces: list[str] = []
        reason: str | None = None

        def on(chunk: StreamChunk) -> bytes | None:
            nonlocal reason
            if chunk.is_final:
                reason = chunk.finish_reason
            if not chunk.token:
                return None
            pieces.append(chunk.token)
            return event("response.output_text.delta", delta=chunk.token, logprobs=[], **where)

        for _, chunk in first:  # the chunks already pulled, then the rest as they come
            if (f := on(chunk)) is not None:
                yield f
        async for _, chunk in rest:
            if (f := on(chunk)) is not None:
                yield f
        text = "".join(pieces)
        final = self.final(text, reason, outcome)
        yield event("response.output_text.done", text=text, logprobs=[], **where)
        yield event("response.content_part.done", part=OutputText(text=text), **where)
        yield event("response.output_item.done", output_index=0, item=final.output[0])
        yield event("response.incomplete" if final.status == "incomplete" else "response.completed", response=final)

"""The wire protocol: OpenAI request and response bodies as msgspec structs, and :func:`parse_body`.

Litestar decodes request bodies into these structs (types and ranges are checked there, and a failure
becomes a 400 naming the field), and they make up the OpenAPI document. Unknown top-level request fields are
accepted and ignored by default, as vLLM does, so clients that send newer fields keep working; the server
logs one warning naming them, and ``reject_unknown_fields`` (``--reject-unknown-fields``) makes them a 400
instead (see :func:`unknown_fields`).

Ranges follow the OpenAI API reference; llminfer extras (``top_k``, ``min_p``, ...) follow the engine's
:class:`~llminfer.sampling.params.SamplingParams`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from llminfer.api.errors import bad_request

T = TypeVar("T")

# ---------------------------------------------------------------------------- shared field types
MAX_CHOICES = 128  #: most choices one request may ask for (prompts x n)

PositiveTokens = Annotated[int, Meta(ge=1, le=2**31 - 1)]
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
NumChoices = Annotated[int, Meta(ge=1, le=16)]
StopList = Annotated[list[str], Meta(max_length=16)]
WordList = Annotated[list[str], Meta(max_length=64)]
TokenIdList = Annotated[list[TokenId], Meta(max_length=64)]
LogitBias = dict[Annotated[str, Meta(pattern=r"^\d{1,10}$")], Annotated[float, Meta(ge=-100.0, le=100.0)]]
Logprobs = Annotated[int, Meta(ge=0, le=20)]


class StreamOptions(Struct):
    """``stream_options``: ``include_usage`` adds one final chunk with the usage and empty ``choices``."""

    include_usage: bool | None = None


class _Common(Struct, kw_only=True):
    """Fields shared by completions and chat completions (OpenAI names, plus llminfer extras)."""

    model: str | None = None
    max_tokens: PositiveTokens | None | UnsetType = UNSET
    max_completion_tokens: PositiveTokens | None | UnsetType = UNSET
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: NumChoices | None = None
    stop: str | StopList | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Seed | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: LogitBias | None = None
    # llminfer extras (OpenAI clients send them through ``extra_body``)
    top_k: Annotated[int, Meta(ge=-1, le=2**31 - 1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    typical_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    epsilon_cutoff: Annotated[float, Meta(ge=0.0, lt=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(ge=0.01, le=10.0)] | None = None
    no_repeat_ngram_size: Annotated[int, Meta(ge=0, le=64)] | None = None
    bad_words: WordList | None = None
    force_words: WordList | None = None
    ignore_eos: bool | None = None
    # vLLM's extras
    stop_token_ids: TokenIdList | None = None
    min_tokens: Annotated[int, Meta(ge=0, le=2**31 - 1)] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=2**31 - 1, description=(
        "Keep the last k prompt tokens; -1: as many as fit with the output length. 0 is refused."))] | None = None
    # Structured output: OpenAI's ``response_format``, vLLM's older ``guided_*`` fields and its newer
    # ``structured_outputs`` object (checked in :func:`llminfer.api.translate.structured_output`).
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_json_object: bool | None = None
    structured_outputs: dict[str, Any] | None = None


class ContentPart(Struct):
    """One part of a message's ``content`` list; only ``{"type": "text", "text": ...}`` is supported."""

    type: str
    text: str | None = None


class FunctionCall(Struct):
    """``function`` of a tool call: ``arguments`` is JSON text (an object is accepted too)."""

    name: str
    arguments: str | dict[str, Any] | None = None


class MessageToolCall(Struct):
    """A tool call the assistant made earlier in the conversation."""

    function: FunctionCall
    id: str | None = None
    type: str = "function"


class ChatMessage(Struct):
    """One message of the conversation (``developer`` is treated as ``system``; ``tool`` carries the
    result of the call ``tool_call_id``; an assistant message may hold ``tool_calls`` and null content)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Common, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Common, kw_only=True):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids or a list
    of token-id lists (msgspec allows one array type per union, so the list elements are checked later)."""

    prompt: str | Annotated[list[str | TokenId | list[TokenId]], Meta(min_length=1)]
    echo: bool | None = None
    logprobs: Logprobs | None = None
    best_of: Annotated[int, Meta(ge=1, le=16, description=(
        "Samples per prompt; the n with the highest cumulative logprob are returned. Must be >= n; above n it "
        "cannot be streamed."))] | None = None
    # vLLM's extra: the prompt tokens' logprobs in vLLM's own shape (``choices[i].prompt_logprobs``)
    prompt_logprobs: Logprobs | None = None
    # ``max_tokens`` may be 0 here: with ``echo`` and ``logprobs`` that scores the prompt (lm-eval).
    max_tokens: Annotated[int, Meta(ge=0, le=2**31 - 1, description=(
        "Tokens to generate (default 16). 0 only with echo or prompt_logprobs: the prompt is scored, nothing "
        "is generated."))] | None | UnsetType = UNSET


# ---------------------------------------------------------------------------- responses
class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class Usage(Struct):
    """Token counts of one response (the prompt once per prompt, completions summed over choices)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class FunctionCallOut(Struct):
    name: str
    arguments: str


class ToolCallOut(Struct):
    """A call in a response: ``function.arguments`` is JSON text."""

    id: str
    function: FunctionCallOut
    type: str = "function"


class ChatResponseMessage(Struct):
    role: str
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCallOut] | UnsetType = UNSET


class FunctionDelta(Struct):
    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET


class ToolCallChunk(Struct):
    """A fragment of a streamed call: the first one of a call has ``id``, ``type`` and ``function.name``;
    ``function.arguments`` fragments concatenate to the arguments."""

    index: int
    function: FunctionDelta
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET


class ChatChoice(Struct):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(Struct):
    """A non-streamed chat completion."""

    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: str | None = None


class ChatDelta(Struct):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    tool_calls: list[ToolCallChunk] | UnsetType = UNSET


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Struct):
    """One SSE event of a streamed chat completion (``usage`` is null on every chunk but the last when
    ``include_usage`` is set, absent otherwise)."""

    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None | UnsetType = UNSET


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class PromptLogprob(Struct):
    """vLLM's ``Logprob``: one candidate at one prompt position (``rank`` 1 is the most likely)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    #: with ``prompt_logprobs``: per prompt token ``{token id: PromptLogprob}`` (the prompt token and the
    #: top alternatives), ``null`` for the first token
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | UnsetType = UNSET


class Completion(Struct):
    """A non-streamed completion, and (with ``object`` the same) one streamed event."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | None | UnsetType = UNSET


class ModelCard(Struct):
    id: str
    created: int
    owned_by: str = "llminfer"
    object: str = "model"
    max_model_len: int | None = None


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class Health(Struct):
    status: str


json_encoder = msgspec.json.Encoder()

_AT_PATH = re.compile(r" - at `(?:key` in `)?\$\.?(?P<path>[^`]*)`$")  # a value, or a key of the object there


def parse_body(raw: Any, cls: type[T]) -> T:
    """Validate a decoded JSON body against ``cls`` in msgspec's strict mode (``"2"`` is not a number).

    Litestar checks the body in lax mode; handlers take the raw JSON (``SkipValidation``, so the OpenAPI
    document still shows ``cls``) and call this instead.

    Raises:
        APIError: 400 ``invalid_request_error`` naming the field (``messages[0].role``).
    """
    try:
        return msgspec.convert(raw, cls, strict=True)
    except msgspec.ValidationError as exc:
        message = str(exc)
        m = _AT_PATH.search(message)
        path = m.group("path") if m else ""
        path = path.removesuffix("[...]")  # a value of a map (``logit_bias``): name the map
        detail = message[: m.start()] if m else message
        missing = re.fullmatch(r"Object missing required field `(\w+)`", detail)
        if missing:
            param = f"{path}.{missing.group(1)}" if path else missing.group(1)
            raise bad_request(f"Missing required parameter: '{param}'", param, "missing_required_parameter") from None
        if not path:
            raise bad_request(f"Invalid request body: {detail}", None, "invalid_body") from None
        raise bad_request(f"Invalid value for '{path}': {detail}", path, "invalid_value") from None

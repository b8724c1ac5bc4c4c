"""``POST /tokenize`` and ``POST /detokenize``: the served model's tokenizer, with the bodies vLLM's server uses.

Clients count tokens before they send a prompt (to fit a context, to price a request) and turn ids from
``logprobs`` or a token-id prompt back into text. ``/tokenize`` takes either a completion ``prompt`` (special
tokens added unless ``add_special_tokens`` is false) or chat ``messages`` (rendered with the chat template and
the generation prompt, ``tools`` included, exactly as ``/v1/chat/completions`` renders them), so its ``count`` is
the ``prompt_tokens`` that route would report. Both routes are outside ``/v1``, where vLLM has them, and need the
API key when the server has one.
"""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any, TypeVar

from litestar import Request, Router, post
from litestar.params import SkipValidation
from msgspec import Meta, Struct

from llminfer.api import protocol as s
from llminfer.api.chat import message_texts
from llminfer.api.errors import OPENAPI_ERRORS, bad_request
from llminfer.api.middleware import server_state
from llminfer.api.state import ServerState
from llminfer.api.translate import tool_plan, unknown_fields

T = TypeVar("T", "TokenizeRequest", "DetokenizeRequest")

__all__ = ["DetokenizeRequest", "DetokenizeResponse", "TokenizeRequest", "TokenizeResponse", "tokenizer_router"]


class TokenizeRequest(Struct, kw_only=True):
    """``POST /tokenize``: exactly one of ``prompt`` (text) and ``messages`` (a chat; vLLM's
    ``add_generation_prompt`` may only be true, its ``add_special_tokens`` only false)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[s.ChatMessage], Meta(min_length=1)] | None = None
    tools: list[Any] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    return_token_strs: bool | None = None


class TokenizeResponse(Struct, kw_only=True):
    """``tokens``: the ids; ``count``: how many; ``max_model_len``: the context length in tokens;
    ``token_strs``: each id's vocabulary entry (only with ``return_token_strs``)."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Struct, kw_only=True):
    """``POST /detokenize``: token ids (inside the vocabulary) to text."""

    tokens: list[s.TokenId]
    model: str | None = None


class DetokenizeResponse(Struct, kw_only=True):
    """``prompt``: the text of ``tokens``, special tokens included."""

    prompt: str


@post("/tokenize", status_code=200, responses=OPENAPI_ERRORS, summary="Tokenize a prompt or a chat",
      description="vLLM-compatible. `prompt` is tokenized as /v1/completions does; `messages` (and `tools`) "
                  "are rendered with the chat template as /v1/chat/completions does.")
async def tokenize(request: Request, data: SkipValidation[TokenizeRequest]) -> TokenizeResponse:
    """The token ids of a completion prompt or of a chat, with the context length.

    Raises:
        APIError: 400 when neither or both of ``prompt`` and ``messages`` are given, for ``tools`` without
            ``messages``, ``add_special_tokens: true`` or ``add_generation_prompt: false`` with them, and for
            what the chat route refuses in ``messages`` and ``tools``; 404 unknown model.
    """
    data, state = _parse(request, data, TokenizeRequest)
    prompts = state.prompts
    assert prompts is not None
    if (data.prompt is None) == (data.messages is None):
        raise bad_request("give exactly one of 'prompt' and 'messages'", "prompt" if data.prompt is None
                          else "messages", "invalid_value" if data.prompt is not None else "missing_required_parameter")
    if data.messages is not None:
        messages = data.messages
        if data.add_special_tokens:
            raise bad_request("a chat gets the special tokens its template writes; 'add_special_tokens' must be "
                              "false or absent with 'messages'", "add_special_tokens", "invalid_value")
        if data.add_generation_prompt is False:
            raise bad_request("only add_generation_prompt=true is supported: the count is the prompt a chat "
                              "completion would see", "add_generation_prompt", "invalid_value")
        state.check_prompt_chars(message_texts(messages))

        def render() -> list[int]:  # the tools' schemas too: a large one takes seconds to check
            plan = tool_plan(s.ChatCompletionRequest(messages=messages, tools=data.tools))
            return prompts.chat(messages, plan.tools if plan is not None else ())

        ids = await state.tokenize_only(render)
    else:
        if data.tools:
            raise bad_request("'tools' applies to 'messages'", "tools", "invalid_value")
        assert data.prompt is not None
        state.check_prompt_chars([("prompt", data.prompt)])
        add_special = data.add_special_tokens is not False
        ids = await state.tokenize_only(partial(prompts.encode, add_special_tokens=add_special), data.prompt,
                                        "prompt")
    strs = await state.tokenize_only(state.engine.tokenizer.convert_ids_to_tokens, ids) \
        if data.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=prompts.inputs.max_model_len, tokens=ids, token_strs=strs)


@post("/detokenize", status_code=200, responses=OPENAPI_ERRORS, summary="Detokenize token ids",
      description="vLLM-compatible: the text of `tokens`, special tokens included.")
async def detokenize(request: Request, data: SkipValidation[DetokenizeRequest]) -> DetokenizeResponse:
    """The text of token ids.

    Raises:
        APIError: 400 for ids outside the vocabulary; 404 unknown model.
    """
    data, state = _parse(request, data, DetokenizeRequest)
    assert state.prompts is not None
    vocab_size = state.prompts.inputs.vocab_size
    tokens = data.tokens

    def decode() -> str:  # millions of ids take a second to check and decode: off the event loop
        if vocab_size is not None:
            for i, t in enumerate(tokens):
                if t >= vocab_size:
                    raise bad_request(f"token id {t} is outside the vocabulary [0, {vocab_size})", f"tokens[{i}]",
                                      "invalid_value")
        return state.engine.tokenizer.decode(tokens)

    return DetokenizeResponse(prompt=await state.tokenize_only(decode))


def _parse(request: Request, raw: Any, cls: type[T]) -> tuple[T, ServerState]:
    """The body as ``cls`` (strict), the server state; unknown fields warned about (or refused), the model checked.

    Raises:
        APIError: 400 for a malformed body, 404 for an unknown model.
    """
    data = s.parse_body(raw, cls)
    state = server_state(request)
    unknown_fields(raw, cls, reject=state.reject_unknown_fields)
    state.resolve_model(data.model)  # type: ignore[attr-defined]
    return data, state


def tokenizer_router(guards: list[Any]) -> Router:
    """The two routes at the root path, behind ``guards`` (the API key guard)."""
    return Router("/", route_handlers=[tokenize, detokenize], guards=guards)

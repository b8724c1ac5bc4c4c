"""From an OpenAI request body to engine request arguments.

:class:`PromptBuilder` turns chat messages and completion prompts into token ids, :func:`max_new_tokens`
(and :func:`llminfer.api.sampling.sampling_kwargs`) build the arguments of ``engine.make_request``, and the
``check_*`` functions refuse options this server does not support. Prompts are judged by the engine's own
:class:`~llminfer.frontend.input.InputProcessor` (``engine.inputs``), with the rest of the request, once, in
:func:`llminfer.api.jobs.new_job`; its :class:`~llminfer.errors.InvalidRequestError` becomes an
:class:`~llminfer.api.errors.APIError` naming the OpenAI field (``messages``, ``prompt``, ``prompt[1]``).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import structlog
from msgspec import UNSET

from llminfer.api import protocol as s
from llminfer.api.errors import bad_request, from_engine_error
from llminfer.chat import ChatRenderer
from llminfer.errors import InvalidRequestError
from llminfer.frontend.input import InputProcessor
from llminfer.sampling.constraint import PARAM as STRUCTURED_OUTPUT_PARAM
from llminfer.sampling.structured import StructuredOutput
from llminfer.tools import Tool, ToolPlan, plan_tools
from llminfer.tools.answer_format import calls_or_answer

Body = s.ChatCompletionRequest | s.CompletionRequest

log = structlog.get_logger("llminfer.api")


# ---------------------------------------------------------------------------- prompts
class PromptBuilder:
    """Turns chat messages and completion prompts into token ids the way the model expects.

    Args:
        tokenizer: the engine's Hugging Face tokenizer.
        vocab_size: token ids must be below it (``None``: not checked here); used when ``inputs`` is not given.
        inputs: the engine's input validation (``engine.inputs``). Default: one over ``tokenizer`` and
            ``vocab_size`` with no context limit.
    """

    def __init__(self, tokenizer: Any, vocab_size: int | None = None, *, inputs: InputProcessor | None = None) -> None:
        self.tokenizer = tokenizer
        self.inputs = inputs if inputs is not None else InputProcessor(tokenizer, sys.maxsize, vocab_size)
        self.renderer = ChatRenderer(tokenizer)

    def encode(self, text: str, param: str, *, add_special_tokens: bool = True) -> list[int]:
        """Tokenize a prompt as the engine's tokenize stage does (special tokens added by default).

        Raises:
            APIError: 400 naming ``param`` when the text is empty, cannot be tokenized or tokenizes to nothing.
        """
        try:
            return list(self.inputs.encode(text, param=param, add_special_tokens=add_special_tokens))
        except InvalidRequestError as exc:
            raise from_engine_error(exc, prompt_param=param) from None

    def chat(self, messages: Sequence[s.ChatMessage], tools: Sequence[Tool] = ()) -> list[int]:
        """Render the conversation (and ``tools``) with the chat template, generation prompt added (see
        :class:`llminfer.chat.ChatRenderer`: templates without tool support get the documented fallback),
        and tokenize it with exactly one BOS token (when the model uses one).

        Raises:
            APIError: 400 for a non-text content part, a model without a chat template, messages the
                template rejects, or an empty rendering.
        """
        conversation = []
        for i, message in enumerate(messages):
            content = message.content
            if content is None and not (message.role == "assistant" and message.tool_calls):
                raise bad_request(f"messages[{i}] ({message.role}) needs 'content' (only an assistant message "
                                  "with tool_calls may omit it)", f"messages[{i}].content",
                                  "missing_required_parameter")
            if content is not None and not isinstance(content, str):
                parts = []
                for j, part in enumerate(content):
                    if part.type != "text":
                        raise bad_request(f"content parts of type '{part.type}' are not supported; only 'text'",
                                          f"messages[{i}].content[{j}].type", "unsupported_content_type")
                    if part.text is None:
                        raise bad_request("a 'text' content part needs a 'text' field",
                                          f"messages[{i}].content[{j}].text", "missing_required_parameter")
                    parts.append(part.text)
                content = "\n".join(parts)
            entry: dict[str, Any] = {"role": message.role, "content": content, "name": message.name,
                                     "tool_call_id": message.tool_call_id}
            if message.tool_calls:
                entry["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                    "name": c.function.name, "arguments": c.function.arguments}} for c in message.tool_calls]
            conversation.append(entry)
        try:
            rendered = self.renderer.render(conversation, tools)
        except InvalidRequestError as exc:
            if exc.code == "no_chat_template":
                raise bad_request("this model has no chat template; use /v1/completions", "messages",
                                  "no_chat_template") from None
            raise from_engine_error(exc, prompt_param="messages") from None
        return self.renderer.fix_bos(self.encode(rendered, "messages", add_special_tokens=False))

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
            return [self.check_ids(prompt, "prompt")]
        if kinds == {list}:
            return [self.check_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of token-id "
                          "lists (not a mix)", "prompt", "invalid_type")

    def check_ids(self, ids: list[int], param: str) -> list[int]:
        """Token ids as a prompt: not empty, inside the vocabulary. Their length is checked later, as a text
        prompt's is, after ``truncate_prompt_tokens`` has cut them.

        Raises:
            APIError: 400 naming ``param`` (``invalid_value``).
        """
        if not ids:
            raise bad_request(f"{param} is empty", param, "invalid_value")
        try:
            self.inputs.check_token_ids(ids, param)
        except InvalidRequestError as exc:
            raise from_engine_error(exc, prompt_param=param) from None
        return list(ids)


def check_logit_bias(body: Body) -> None:
    """``logit_bias`` must name each token once (``"5"`` and ``"005"`` name one token: which bias would win
    is arbitrary). Its ids are checked against the vocabulary with the rest of the request, by
    :meth:`~llminfer.frontend.input.InputProcessor.process`.

    Raises:
        APIError: 400 ``invalid_value`` naming ``logit_bias``.
    """
    bias_ids = [int(k) for k in body.logit_bias or {}]
    if len(set(bias_ids)) < len(bias_ids):
        dup = next(i for i in bias_ids if bias_ids.count(i) > 1)
        raise bad_request(f"logit_bias names token {dup} more than once", "logit_bias", "invalid_value")


def truncate_prompt(ids: list[int], body: Body, max_model_len: int, max_new: int | None) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: keep the last ``k`` prompt tokens (``-1``: as many as fit in the
    context with the requested output length, at least one generated token)."""
    k = body.truncate_prompt_tokens
    if k is None:
        return ids
    if k == -1:
        k = max(1, max_model_len - (max_new or 1))
    return ids[-k:]


# ---------------------------------------------------------------------------- body checks
def unknown_fields(raw: Any, cls: type, *, reject: bool) -> list[str]:
    """Top-level fields of the body ``raw`` that ``cls`` does not define: a warning naming them (they are
    ignored), or with ``reject`` a 400 naming the first.

    Raises:
        APIError: 400 ``unknown_parameter`` (only with ``reject``).
    """
    if not isinstance(raw, Mapping):
        return []
    known = cls.__struct_fields__  # type: ignore[attr-defined]
    unknown = sorted(k for k in raw if k not in known)
    if unknown and reject:
        raise bad_request(f"Unrecognized request argument supplied: {unknown[0]} (this server rejects unknown "
                          "fields)", unknown[0], "unknown_parameter")
    if unknown:
        log.warning("ignoring unknown request fields", fields=unknown)
    return unknown


def check_common(body: Body, num_prompts: int, num_samples: int | None = None) -> None:
    """Checks shared by chat and completions: ``stream_options``, ``truncate_prompt_tokens``, the number of
    choices (``num_samples``: engine requests per prompt, default ``n``).

    Raises:
        APIError: 400 naming the field.
    """
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if body.truncate_prompt_tokens == 0:
        raise bad_request("truncate_prompt_tokens must be >= 1 (or -1: as many as fit)", "truncate_prompt_tokens",
                          "invalid_value")
    if num_prompts * (num_samples or body.n or 1) > s.MAX_CHOICES:
        raise bad_request(f"at most {s.MAX_CHOICES} choices per request (prompts x n, or prompts x best_of)",
                          "best_of" if num_samples else "n", "invalid_value")


def check_chat(body: s.ChatCompletionRequest) -> int | None:
    """Refuse chat options this server does not support; return the logprobs to report (``None``: none).

    Raises:
        APIError: 400 naming the field (``top_logprobs``, or see :func:`check_common`).
    """
    check_common(body, 1)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def tool_plan(body: s.ChatCompletionRequest) -> ToolPlan | None:
    """How the request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` are served (None: no tools).

    Raises:
        APIError: 400 naming ``tools[...]``, ``tool_choice`` or ``parallel_tool_calls``.
    """
    try:
        return plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    except InvalidRequestError as exc:
        # the constraint's own limits (its size) name "structured_output", no field of this request: the tools'
        raise bad_request(str(exc), "tools" if exc.param == STRUCTURED_OUTPUT_PARAM else exc.param, exc.code) from None


_STRUCTURED_OUTPUTS_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                            "json_object": "json_object"}


def _response_format(value: dict[str, Any]) -> StructuredOutput | None:
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequestError("response_format type 'json_schema' needs a 'json_schema' object "
                                      "({\"name\": ..., \"schema\": {...}, \"strict\": ...})")
        schema = spec.get("schema", spec.get("json_schema"))  # some clients nest it under the older name
        if not isinstance(schema, dict):
            raise InvalidRequestError("response_format.json_schema needs a 'schema' object")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequestError("response_format.json_schema.strict must be a boolean")
        # strict closes the objects the schema leaves open (OpenAI's strict mode); the output is held to the
        # whole schema either way (llminfer.sampling.schema refuses what it cannot enforce).
        return StructuredOutput(json_schema=schema, strict=bool(strict))
    raise InvalidRequestError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


# vLLM's options of ``structured_outputs`` that change nothing here (JSON is always compact and strict).
_STRUCTURED_OUTPUTS_FLAGS = frozenset({"disable_any_whitespace", "disable_additional_properties", "disable_fallback"})


def _structured_outputs(value: dict[str, Any]) -> StructuredOutput:
    unknown = sorted(k for k, v in value.items() if k not in _STRUCTURED_OUTPUTS_KEYS
                     and k not in _STRUCTURED_OUTPUTS_FLAGS and v not in (None, False))
    if unknown:
        raise InvalidRequestError(f"structured_outputs.{unknown[0]} is not supported by this server (it takes "
                                  f"{', '.join(sorted(_STRUCTURED_OUTPUTS_KEYS))})")
    given = {k: v for k, v in value.items() if k in _STRUCTURED_OUTPUTS_KEYS and v not in (None, False)}
    if len(given) != 1:
        raise InvalidRequestError(f"structured_outputs takes exactly one of {sorted(_STRUCTURED_OUTPUTS_KEYS)}, "
                                  f"got {sorted(given) or 'none'}")
    ((key, v),) = given.items()
    if key == "json_object":
        return StructuredOutput(json_object=v)  # a non-boolean is refused there, not taken as true
    return StructuredOutput(**{_STRUCTURED_OUTPUTS_KEYS[key]: v})


def structured_output(body: Body, plan: ToolPlan | None = None, *,
                      tokenizer: Any = None) -> tuple[StructuredOutput | None, str]:
    """The output constraint of a request and the field it came from (to name in errors).

    Sources: ``response_format`` (OpenAI), ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
    ``guided_grammar`` / ``guided_json_object`` (vLLM's older fields), ``structured_outputs`` (vLLM's
    newer object), and the constraint ``tool_choice`` ``required`` or a named function implies. At most one
    of the first kinds. With ``tool_choice`` ``auto`` the output is tool calls or an answer in that format
    (:func:`~llminfer.tools.answer_format.calls_or_answer`, the branch picked by the model's first choice
    with ``tokenizer``); ``required`` or a named function decide the
    output themselves (the format is then for later turns' answers).

    Raises:
        APIError: 400 naming the field: a malformed value or two sources.
    """
    sources: list[tuple[str, Any]] = []
    if body.response_format is not None and "type" not in body.response_format:
        raise bad_request("response_format needs a 'type': 'text', 'json_object' or 'json_schema'",
                          "response_format.type", "missing_required_parameter")
    if body.response_format is not None and body.response_format.get("type", "text") != "text":
        sources.append(("response_format", lambda: _response_format(body.response_format)))  # type: ignore[arg-type]
    guided = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
              "guided_grammar": "grammar"}
    for field, kind in guided.items():
        value = getattr(body, field)
        if value is not None:
            sources.append((field, lambda kind=kind, value=value: StructuredOutput(**{kind: value})))
    if body.guided_json_object:
        sources.append(("guided_json_object", lambda: StructuredOutput(json_object=True)))
    if body.structured_outputs is not None:
        sources.append(("structured_outputs", lambda: _structured_outputs(body.structured_outputs)))  # type: ignore[arg-type]
    if len(sources) > 1:
        names = [name for name, _ in sources]
        raise bad_request(f"at most one output constraint per request; got {', '.join(names)}", names[1],
                          "conflicting_parameters")
    if sources:
        param, make = sources[0]
        try:
            answer = make()
            if plan is not None and plan.mode == "auto":
                return calls_or_answer(plan, answer, answer_param=param, tokenizer=tokenizer), param
        except InvalidRequestError as exc:
            # a tool's parameters the combined grammar cannot enforce are blamed on the tool, the rest on param
            on_tools = plan is not None and (exc.param or "").startswith(plan.tools_param)
            raise bad_request(str(exc), exc.param if on_tools else param, exc.code) from None
        # "none": the answer is all there is; "required" and a named function: the output is the calls, and
        # the format is for answers in later turns (OpenAI's reading), so it is checked above but not applied.
        if plan is None or plan.mode == "none":
            return answer, param
    if plan is not None and plan.structured_output is not None:
        return plan.structured_output, plan.constraint_param
    return None, ""


def check_suffix(raw: Any) -> None:
    """``suffix`` (fill-in-the-middle) is refused: the models served here have no FIM format. It is not
    part of the schema, so it is checked on the raw body, before the unknown-field policy.

    Raises:
        APIError: 400 naming ``suffix``.
    """
    if isinstance(raw, Mapping) and raw.get("suffix") not in (None, ""):
        raise bad_request("suffix (fill-in-the-middle) is not supported: the served model has no FIM format",
                          "suffix", "unsupported_parameter")


def check_completion(body: s.CompletionRequest) -> None:
    """Refuse completion options this server does not support or that contradict each other.

    Raises:
        APIError: 400 naming the field (``best_of``, ``max_tokens``, or see :func:`check_common`).
    """
    n = body.n or 1
    if body.best_of is not None and body.best_of < n:
        raise bad_request(f"best_of ({body.best_of}) must be >= n ({n})", "best_of", "invalid_value")
    if body.best_of is not None and body.best_of > n and body.stream:
        raise bad_request("best_of > n cannot be streamed (the best choices are known only at the end)",
                          "best_of", "invalid_value")
    if body.max_tokens == 0 and not body.echo and body.prompt_logprobs is None:
        raise bad_request("max_tokens 0 generates nothing: it needs echo (with logprobs: prompt scoring) or "
                          "prompt_logprobs", "max_tokens", "invalid_value")
    prompt = body.prompt
    num_prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    check_common(body, num_prompts, body.best_of if body.best_of and body.best_of > n else None)


def include_usage(body: Body) -> bool:
    """A streamed call asked for the final usage chunk."""
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


# ---------------------------------------------------------------------------- sampling arguments


def max_new_tokens(body: Body, default: int | None) -> tuple[int | None, str]:
    """The completion length the client asked for, and the field it came from.

    ``max_completion_tokens`` wins over ``max_tokens``. An explicit ``null`` means "until the context fills"
    where neither field has a number: a ``null`` beside a number is a field the client left unset (SDKs and
    proxies send every field, unset ones as ``null``), so it does not lift the other's limit.
    """
    for name in ("max_completion_tokens", "max_tokens"):
        value = getattr(body, name)
        if value is not UNSET and value is not None:
            return value, name
    for name in ("max_completion_tokens", "max_tokens"):
        if getattr(body, name) is None:
            return None, name
    return default, "max_tokens"

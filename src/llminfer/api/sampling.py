"""One builder of the engine's sampling arguments from any HTTP body (chat, completions, responses).

A body field reaches :class:`~llminfer.sampling.params.SamplingParams` when it has the field's name (or
an OpenAI/vLLM alias in :data:`RENAMED`); so a new decoding control needs only its ``SamplingParams`` field
and the same-named field in the API schema. OpenAI's defaults apply where the client sends nothing
(temperature 1, top_p 1); the engine validates every value.
"""

from __future__ import annotations

from typing import Any

from msgspec import UNSET

from llminfer.sampling.params import GREEDY_TEMPERATURE, SamplingParams
from llminfer.sampling.structured import StructuredOutput

#: body field -> SamplingParams field, where the HTTP name differs
RENAMED = {"stop": "stop_sequences", "min_tokens": "min_new_tokens"}
#: SamplingParams fields set from elsewhere than a same-named body field: the length (from max_tokens /
#: max_completion_tokens / max_output_tokens), logprobs (chat's are a flag plus top_logprobs), the
#: structured-output constraint (from response_format and friends), n and prompt_logprobs (the route fans
#: out and scores itself)
ROUTED = frozenset({"max_new_tokens", "logprobs", "structured_output", "n", "prompt_logprobs", "temperature",
                    "top_p"})
_FIELDS = tuple(a.name for a in SamplingParams.__attrs_attrs__)  # type: ignore[attr-defined]


def _sent(value: Any) -> bool:
    """The client sent a value that means something (an empty list or string is the same as none)."""
    if value is None or value is UNSET:
        return False
    if isinstance(value, (str, list, tuple, dict)):
        return bool(value)
    return True


def sampling_kwargs(body: Any, *, max_new_tokens: int | None, logprobs: int | None = None,
                    structured: StructuredOutput | None = None) -> dict[str, Any]:
    """Keyword arguments of ``engine.make_request`` for an HTTP request body.

    Args:
        body: a chat, completion or responses request (a msgspec struct); fields it lacks count as unsent.
        max_new_tokens: the completion length the route resolved (None: until the context fills).
        logprobs: top logprobs per token, or None for none.
        structured: the route's structured-output constraint.

    Returns:
        ``SamplingParams`` field -> value, for the fields the client sent, plus temperature and top_p
        (OpenAI defaults 1.0; a temperature below ``GREEDY_TEMPERATURE`` becomes 0.0, greedy).
    """
    temperature = getattr(body, "temperature", None)
    temperature = 1.0 if temperature is None else float(temperature)
    top_p = getattr(body, "top_p", None)
    kw: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": 0.0 if temperature < GREEDY_TEMPERATURE else temperature,
        "top_p": 1.0 if top_p is None else float(top_p),
    }
    aliases = {field: http for http, field in RENAMED.items()}
    for field in _FIELDS:
        if field in ROUTED:
            continue
        value = getattr(body, aliases.get(field, field), None)
        if _sent(value):
            kw[field] = _convert(field, value)
    if logprobs is not None:
        kw["logprobs"] = logprobs
    if structured is not None:
        kw["structured_output"] = structured
    return kw


def _convert(field: str, value: Any) -> Any:
    if field == "top_k":
        return max(value, 0)  # -1 (vLLM's "off") is 0 here
    if field == "stop_sequences" and isinstance(value, str):
        return [value]
    if field == "logit_bias":
        return {int(k): float(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(value)
    return value

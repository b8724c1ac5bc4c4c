"""One request between llminfer and vLLM: llminfer's sampling parameters as vLLM's, and vLLM's outputs
(finish reasons, logprobs) as llminfer's (pure functions, unit-tested without vLLM)."""

from __future__ import annotations

import json
import math
from typing import Any

from llminfer.errors import InvalidRequestError
from llminfer.results import TokenLogprob
from llminfer.sampling.params import SamplingParams


def sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """llminfer :class:`SamplingParams` → keyword arguments of ``vllm.SamplingParams`` (pure; no vLLM).

    ``top_k=0`` (off) becomes vLLM's ``-1``; stop strings go to ``stop`` and are cut from the text as in
    llminfer (``include_stop_str_in_output=False``); ``n`` is always 1 (the engine fans out samples).
    ``output_kind`` is added by the backend (``RequestOutputKind.DELTA``).

    Returns:
        A dict of vLLM ``SamplingParams`` keyword arguments.

    Raises:
        InvalidRequestError: a setting vLLM has no equivalent for: a processor or warper of
            :mod:`llminfer.sampling.processors` or :mod:`llminfer.sampling.warpers` with ``in_vllm = False``
            (``no_repeat_ngram_size``, ``force_words``, ``typical_p``, ``epsilon_cutoff``), named in ``param``.
    """
    from llminfer.sampling.processors import ROW_PROCESSORS
    from llminfer.sampling.warpers import WARPERS

    for processor in (*ROW_PROCESSORS, *WARPERS):
        if not processor.in_vllm and processor.applies(params):
            raise InvalidRequestError(f"{processor.field} is not supported by the vLLM backend", param=processor.field)
    kw: dict[str, Any] = {
        "n": 1,
        "max_tokens": params.max_new_tokens,
        "min_tokens": params.min_new_tokens,
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": params.top_k if params.top_k > 0 else -1,
        "min_p": float(params.min_p),
        "seed": params.seed,
        "stop": list(params.stop_sequences),
        "stop_token_ids": list(params.stop_token_ids),
        "include_stop_str_in_output": params.include_stop_str_in_output,
        "ignore_eos": params.ignore_eos,
        "repetition_penalty": float(params.repetition_penalty),
        "presence_penalty": float(params.presence_penalty),
        "frequency_penalty": float(params.frequency_penalty),
        "logprobs": params.logprobs,
        "skip_special_tokens": params.skip_special_tokens,
    }
    if params.prompt_logprobs is not None:
        kw["prompt_logprobs"] = params.prompt_logprobs
    if not params.spaces_between_special_tokens:
        kw["spaces_between_special_tokens"] = False
    if params.logit_bias:
        kw["logit_bias"] = dict(params.logit_bias)
    if params.bad_words:
        kw["bad_words"] = list(params.bad_words)
    so = params.structured_output
    if so is not None:
        # The fields of vLLM's ``StructuredOutputsParams`` (``GuidedDecodingParams`` before 0.10.2).
        kw["structured_outputs"] = {
            # compact JSON, as llminfer's own constraint makes it: vLLM's default lets whitespace run on
            # (a weak model fills max_tokens with it and never closes the object)
            "json_schema": {"json": json.loads(so.json_schema) if so.json_schema is not None else None,
                            "disable_any_whitespace": True},
            "json_object": {"json_object": True, "disable_any_whitespace": True},
            "regex": {"regex": so.regex},
            "grammar": {"grammar": so.grammar},
            "choice": {"choice": list(so.choice or ())},
        }[so.kind]
    return kw

def structured_outputs_param(vllm: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """``structured_outputs`` fields → the keyword vLLM's ``SamplingParams`` takes for them in the
    installed version: ``structured_outputs=StructuredOutputsParams(...)``, else the older
    ``guided_decoding=GuidedDecodingParams(...)``."""
    sp = vllm.sampling_params
    if hasattr(sp, "StructuredOutputsParams"):
        return {"structured_outputs": sp.StructuredOutputsParams(**fields)}
    return {"guided_decoding": sp.GuidedDecodingParams(**fields)}

def finish_reason(vllm_reason: str | None) -> str | None:
    """vLLM's ``CompletionOutput.finish_reason`` → llminfer's (``stop``, ``length``, ``abort``, ``error``)."""
    if vllm_reason is None:
        return None
    return vllm_reason if vllm_reason in ("stop", "length", "abort") else "error"

def convert_logprobs(token_ids: list[int], entries: list[dict[int, Any]] | None, k: int) -> tuple[TokenLogprob, ...]:
    """vLLM's per-token ``{token_id: Logprob}`` dicts → :class:`TokenLogprob` (chosen token, top ``k``)."""
    if not entries:
        return ()
    out = []
    for tok, entry in zip(token_ids, entries):
        chosen = entry.get(tok)
        lp = float(getattr(chosen, "logprob", chosen if isinstance(chosen, (int, float)) else -math.inf))
        ranked = sorted(((int(t), float(getattr(v, "logprob", v))) for t, v in entry.items()),
                        key=lambda item: -item[1])
        out.append(TokenLogprob(int(tok), lp, tuple(ranked[:k])))
    return tuple(out)

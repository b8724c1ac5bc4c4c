"""``tool_choice: "auto"`` together with an answer format (``response_format``): the output is either tool calls
in the syntax the parser reads, or an answer in the format.

OpenAI accepts both in one request: the model may call tools, and when it answers instead the answer follows
``response_format``. Agents that want a typed final answer send both (LangChain's ``create_agent`` with a
provider ``response_format`` does). Served here as one grammar, the union of

- one or more ``<tool_call>\\n{"name": <a tool>, "arguments": <its parameters>}\\n</tool_call>`` blocks,
  separated by a newline (exactly one when ``parallel_tool_calls`` is false), the Hermes / Qwen syntax the chat
  templates ask for and :class:`~llminfer.tools.ToolCallParser` reads in auto mode; and
- the answer's own grammar (:func:`~llminfer.sampling.grammar_compiler.spec_ebnf`).

Which branch is the model's own first choice (:class:`~llminfer.sampling.processors.CallOrAnswer`, given the
tokens that open a call, :func:`call_opening_ids`): left to the masked distribution, the call would nearly always
win, because the mask takes away the prose an answer starts with.
"""

from __future__ import annotations

import json
import re
from typing import Any

from llminfer.errors import InvalidRequestError
from llminfer.sampling.constraint import PARAM, StructuredOutput
from llminfer.sampling.grammar_compiler import clean_error, spec_ebnf
from llminfer.tools.calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from llminfer.tools.definitions import ToolPlan, call_schema

__all__ = ["calls_or_answer"]

_BLOCK = "llminfer_tool_call_block"
_MORE = "llminfer_more_tool_calls"


def calls_or_answer(plan: ToolPlan, answer: StructuredOutput, *, answer_param: str,
                    tokenizer: Any = None) -> StructuredOutput:
    """The constraint of an ``auto`` plan whose answers must follow ``answer``: an xgrammar EBNF grammar.

    Args:
        plan: the request's tools (``mode == "auto"``).
        answer: the answer's format (any kind: a JSON Schema, a JSON object, a regex, a grammar, a choice).
        answer_param: the request field ``answer`` came from, named when xgrammar cannot read it.
        tokenizer: the model's Hugging Face tokenizer: with it, the model's own first choice picks the branch
            (``call_opening_ids``, :class:`~llminfer.sampling.processors.CallOrAnswer`); without it, the
            constrained distribution does.

    Returns:
        ``StructuredOutput(grammar=...)``.

    Raises:
        InvalidRequestError: xgrammar cannot read the answer's format (``param=answer_param``) or a tool's
            parameters (``param`` names the tools); a tool's parameters that cannot be enforced raise
            :class:`~llminfer.sampling.schema.SchemaError` naming the keyword.
    """
    import xgrammar

    try:
        call = StructuredOutput(json_schema=call_schema(plan.tools, tools_param=plan.tools_param))
    except InvalidRequestError as exc:  # the size limits name the constraint: here it is the tools'
        if exc.param != PARAM:
            raise
        raise InvalidRequestError(str(exc), param=plan.tools_param, code=exc.code) from None
    answer_grammar = _grammar(answer, answer_param)
    open_, close = (xgrammar.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")
                    for text in (TOOL_CALL_OPEN + "\n", "\n" + TOOL_CALL_CLOSE))
    block = xgrammar.Grammar.concat(open_, _grammar(call, plan.tools_param), close)
    # concat names its own root ``root`` and renames the parts' rules, so nothing refers to ``root``; renamed,
    # it becomes a rule the repetition below can use (from_ebnf with that root would fail on a dangling name).
    renamed = re.sub(r"^root ::= ", f"{_BLOCK} ::= ", str(block), count=1, flags=re.MULTILINE)
    xgrammar.Grammar.from_ebnf(renamed, root_rule_name=_BLOCK)
    more = f'{_MORE} ::= "" | ("\\n" {_BLOCK} {_MORE})\n' if plan.parallel_tool_calls else ""
    tail = f" {_MORE}" if more else ""
    calls = xgrammar.Grammar.from_ebnf(f"{renamed}\n{more}root ::= {_BLOCK}{tail}\n")
    return StructuredOutput(grammar=str(xgrammar.Grammar.union(calls, answer_grammar)),
                            call_opening_ids=call_opening_ids(tokenizer) if tokenizer is not None else ())


def call_opening_ids(tokenizer: Any) -> tuple[int, ...]:
    """The ids of the tokens a tool call can start with: each one's text is a non-empty start of
    ``"<tool_call>\\n"`` or starts with ``"<tool_call>"`` (a special token of that name included). Only the
    vocabulary entries starting with ``<`` are decoded; cached per tokenizer."""
    key = id(tokenizer)
    cached = _OPENINGS.get(key)
    if cached is not None and cached[0] is tokenizer:
        return cached[1]
    opening = TOOL_CALL_OPEN + "\n"
    ids = []
    for piece, i in tokenizer.get_vocab().items():
        if piece.startswith("<"):
            text = tokenizer.decode([i], skip_special_tokens=False)
            if text and (opening.startswith(text) or text.startswith(TOOL_CALL_OPEN)):
                ids.append(i)
    result = tuple(sorted(ids))
    _OPENINGS[key] = (tokenizer, result)
    return result


_OPENINGS: dict[int, tuple[Any, tuple[int, ...]]] = {}


def _grammar(spec: StructuredOutput, param: str) -> Any:
    """``spec`` as an ``xgrammar.Grammar``.

    Raises:
        InvalidRequestError: xgrammar cannot read it (``param`` named).
    """
    import xgrammar

    try:
        return xgrammar.Grammar.from_ebnf(spec_ebnf(spec))
    except Exception as exc:  # noqa: BLE001 - xgrammar reports bad input as RuntimeError
        raise InvalidRequestError(f"invalid or unsupported {spec.kind.replace('_', ' ')}: {clean_error(exc)}",
                                  param=param) from None

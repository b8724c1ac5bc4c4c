"""Tool calling: tool definitions, ``tool_choice``, the constraint it implies, and parsing tool calls out of
generated text (shared by the HTTP server and :meth:`llminfer.InferenceEngine.chat`).

How each ``tool_choice`` is served (:class:`ToolPlan`):

- ``"none"``: tools may be shown to the model, but its output is plain content; nothing is parsed.
- ``"auto"``: unconstrained; calls are parsed from the Hermes / Qwen syntax the chat templates ask for,
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (several allowed). Text outside the
  blocks is content; a block whose JSON is malformed (or names an unknown tool) stays content. With an answer
  format (``response_format``) the output is constrained to call blocks or an answer in that format
  (:func:`llminfer.tools.answer_format.calls_or_answer`), the model's own first choice picking which.
- ``"required"``: the output is constrained to a JSON array of ``{"name": <a tool>, "arguments": <its
  parameters>}`` objects (at most one when ``parallel_tool_calls`` is false), parsed into calls.
- a named function (``{"type": "function", "function": {"name": ...}}``): the output is constrained to
  that function's ``parameters`` schema and *is* the call's arguments.

Parsing is incremental (:class:`ToolCallParser`: ``feed`` text as it is generated, then ``finish``) and
yields content strings and :class:`ToolCallDelta` fragments; the non-streamed result is the fold of the
same events (:func:`fold_events`), so streamed and non-streamed answers agree by construction.

The definitions and the plan are :mod:`llminfer.tools.definitions`, the parsing :mod:`llminfer.tools.calls`;
this package is the public door to both.
"""

from llminfer.tools.calls import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    Event,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    finish_reason,
    fold_events,
    new_call_id,
    parse_tool_calls,
)
from llminfer.tools.definitions import (
    Tool,
    ToolPlan,
    arguments_schema,
    parse_tools,
    plan_tools,
    required_schema,
)

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "Event",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolPlan",
    "arguments_schema",
    "finish_reason",
    "fold_events",
    "new_call_id",
    "parse_tool_calls",
    "parse_tools",
    "plan_tools",
    "required_schema",
]

"""Tool calling: tool definitions, ``tool_choice``, the constraint it implies, and parsing tool calls out of
generated text (shared by the HTTP server and :meth:`llminfer.InferenceEngine.chat`).

How each ``tool_choice`` is served (:class:`ToolPlan`):

- ``"none"``: tools may be shown to the model, but its output is plain content; nothing is parsed.
- ``"auto"``: unconstrained; calls are parsed from the Hermes / Qwen syntax the chat templates ask for,
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (several allowed). Text outside the
  blocks is content; a block whose JSON is malformed (or names an unknown tool) stays content.
- ``"required"``: the output is constrained to a JSON array of ``{"name": <a tool>, "arguments": <its
  parameters>}`` objects (at most one when ``parallel_tool_calls`` is false), parsed into calls.
- a named function (``{"type": "function", "function": {"name": ...}}``): the output is constrained to
  that function's ``parameters`` schema and *is* the call's arguments.

Parsing is incremental (:class:`ToolCallParser`: ``feed`` text as it is generated, then ``finish``) and
yields content strings and :class:`ToolCallDelta` fragments; the non-streamed result is the fold of the
same events (:func:`fold_events`), so streamed and non-streamed answers agree by construction.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from llminfer.errors import InvalidRequestError
from llminfer.sampling.schema import KEYWORDS, SchemaError, normalize_schema, split_defs
from llminfer.sampling.structured import StructuredOutput

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@attrs.frozen
class Tool:
    """A function the model may call.

    Attributes:
        name: the function name.
        description: what it does (shown to the model).
        parameters: a JSON Schema of its arguments (an object schema; default: no arguments).
        strict: OpenAI's ``function.strict``: a forced call's arguments close every object the schema
            leaves open (None or False: open, as JSON Schema means them).
    """

    name: str
    description: str | None = None
    parameters: dict[str, Any] = attrs.field(factory=lambda: dict(_EMPTY_PARAMETERS))
    strict: bool | None = None

    def to_openai(self) -> dict[str, Any]:
        """``{"type": "function", "function": {...}}``, the form chat templates take."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@attrs.frozen
class ToolCall:
    """One parsed call.

    Attributes:
        id: ``call_<hex>``.
        name: the function called.
        arguments: its arguments as JSON text (OpenAI's ``function.arguments``).
    """

    id: str
    name: str
    arguments: str
    type: str = "function"

    def parsed_arguments(self) -> Any:
        """``json.loads(arguments)``. Raises ValueError when the text is not JSON (a truncated output)."""
        return json.loads(self.arguments)


@attrs.frozen
class ToolCallDelta:
    """A fragment of the ``index``-th call: the first one of a call carries ``id`` and ``name``, every one
    carries a piece of ``arguments`` (the call's arguments are their concatenation)."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


Event = str | ToolCallDelta  #: content text, or a fragment of a call


def new_call_id() -> str:
    """A fresh ``call_<24 hex>`` id."""
    return "call_" + uuid.uuid4().hex[:24]


# ---------------------------------------------------------------------------- definitions
def parse_tools(tools: Sequence[Any] | None, *, param: str = "tools") -> tuple[Tool, ...]:
    """Validate OpenAI tool definitions (``{"type": "function", "function": {"name", "description",
    "parameters"}}`` dicts, or :class:`Tool` objects).

    Raises:
        InvalidRequestError: a malformed or duplicate tool; ``param`` names it (``tools[1].function.name``).
    """
    if tools is None:
        return ()
    if isinstance(tools, (str, bytes, dict)) or not isinstance(tools, Sequence):
        raise InvalidRequestError("tools must be a list of tool definitions", param=param)
    out: list[Tool] = []
    for i, tool in enumerate(tools):
        where = f"{param}[{i}]"
        if isinstance(tool, Tool):
            out.append(tool)
            continue
        if not isinstance(tool, dict):
            raise InvalidRequestError("a tool must be an object", param=where)
        if tool.get("type", "function") != "function":
            raise InvalidRequestError(f"tool type {tool.get('type')!r} is not supported; only 'function'",
                                      param=f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidRequestError("a function tool needs a 'function' object", param=f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("a function needs a non-empty 'name'", param=f"{where}.function.name")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequestError("'description' must be a string", param=f"{where}.function.description")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = dict(_EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise InvalidRequestError("'parameters' must be a JSON Schema object",
                                      param=f"{where}.function.parameters")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequestError("'strict' must be a boolean", param=f"{where}.function.strict")
        out.append(Tool(name, description, parameters, strict))
    names = [t.name for t in out]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise InvalidRequestError(f"duplicate tool name {name!r}", param=f"{param}[{i}].function.name")
    return tuple(out)


def arguments_schema(tool: Tool, *, param: str = "tools[0].function.parameters", prefix: str = "") -> dict[str, Any]:
    """The normalized JSON Schema of ``tool``'s arguments (:func:`~llminfer.sampling.schema.normalize_schema`).

    Arguments are always a JSON object: empty or missing ``parameters`` (``{}``, only annotations such as
    a title, or ``{"type": "object"}`` with no properties) mean an object with no properties, closed: the
    tool takes none. A schema without a ``type`` is read as an object; one whose ``type`` excludes
    ``"object"`` is refused.

    Args:
        tool: the tool.
        param: the request field named in errors.
        prefix: prepended to the names in ``$defs`` (several tools in one schema).

    Raises:
        SchemaError: a schema that cannot be enforced, or not an object (``param``, keyword named).
    """
    params = tool.parameters
    asserted = {k: v for k, v in params.items() if k in KEYWORDS and KEYWORDS[k][0] != "annotation"}
    if asserted in ({}, {"type": "object"}, {"type": "object", "properties": {}}, {"properties": {}}):
        return dict(_EMPTY_PARAMETERS, additionalProperties=False)
    types = params.get("type")
    if types is None:
        params = {"type": "object", **params}
    elif types != "object":
        if not isinstance(types, list) or "object" not in types:
            raise SchemaError(f"JSON Schema keyword 'type': a tool's arguments are a JSON object, but its "
                              f"parameters have type {types!r}", keyword="type", param=param)
        params = {**params, "type": "object"}
    return normalize_schema(params, strict=bool(tool.strict), prefix=prefix, param=param)


def required_schema(tools: Sequence[Tool], parallel_tool_calls: bool = True, *,
                    tools_param: str = "tools") -> dict[str, Any]:
    """The JSON Schema ``tool_choice="required"`` constrains the output to: a non-empty array (of one
    item when not ``parallel_tool_calls``) of ``{"name": <const>, "arguments": <parameters>}``.

    Each tool's ``$defs`` (and every other ``$ref`` target) are hoisted to the root under a name prefixed
    by the tool's index, so references keep resolving once the schemas are nested under a new root.

    Raises:
        SchemaError: a tool's parameters cannot be enforced (``param`` names ``tools[i].function.parameters``).
    """
    defs: dict[str, Any] = {}
    items = []
    for i, t in enumerate(tools):
        args, own = split_defs(arguments_schema(t, param=f"{tools_param}[{i}].function.parameters",
                                                prefix=f"t{i}_"))
        defs.update(own)
        items.append({"type": "object", "properties": {"name": {"const": t.name}, "arguments": args},
                      "required": ["name", "arguments"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


# ---------------------------------------------------------------------------- tool_choice
@attrs.frozen
class ToolPlan:
    """How one request's tools are served (see the module docstring).

    Attributes:
        tools: the validated tools (rendered into the prompt).
        mode: ``"none"``, ``"auto"``, ``"required"`` or ``"named"``.
        function: the forced tool (``mode == "named"``).
        parallel_tool_calls: more than one call allowed.
        tools_param: the request field the tools came in (named in errors).
    """

    tools: tuple[Tool, ...]
    mode: str
    function: Tool | None = None
    parallel_tool_calls: bool = True
    tools_param: str = "tools"

    @property
    def structured_output(self) -> StructuredOutput | None:
        """The constraint this plan puts on the output (``required`` and named modes).

        Raises:
            SchemaError: a tool's parameters cannot be enforced (``param`` names the tool's parameters).
        """
        if self.mode == "required":
            return StructuredOutput(json_schema=required_schema(self.tools, self.parallel_tool_calls,
                                                                tools_param=self.tools_param))
        if self.mode == "named":
            assert self.function is not None
            return StructuredOutput(json_schema=arguments_schema(self.function, param=self.constraint_param))
        return None

    @property
    def constraint_param(self) -> str:
        """The request field to blame when the constraint does not compile (a bad ``parameters`` schema)."""
        if self.mode == "named":
            assert self.function is not None
            return f"{self.tools_param}[{[t.name for t in self.tools].index(self.function.name)}].function.parameters"
        return self.tools_param

    def parser(self) -> ToolCallParser:
        """A fresh parser for one output (one per choice)."""
        return ToolCallParser(self)


def plan_tools(tools: Sequence[Any] | None, tool_choice: Any = None, parallel_tool_calls: bool | None = None,
               *, tools_param: str = "tools", choice_param: str = "tool_choice") -> ToolPlan | None:
    """Validate ``tools`` and ``tool_choice`` (OpenAI shapes) and decide how to serve them.

    ``tool_choice`` defaults to ``"auto"`` with tools; without tools only ``None`` or ``"none"`` is allowed
    (and the result is ``None``: no tools at all).

    Raises:
        InvalidRequestError: malformed tools (``param`` under ``tools``), a ``tool_choice`` that is not one
            of the forms, names an unknown tool, or is given without tools (``param="tool_choice"``).
    """
    parsed = parse_tools(tools, param=tools_param)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequestError("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    if not parsed:
        if tool_choice is None or tool_choice == "none":
            return None
        raise InvalidRequestError("tool_choice needs tools", param=choice_param)
    if tool_choice is None:
        tool_choice = "auto"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidRequestError(f"tool_choice must be 'none', 'auto', 'required' or a named function, got "
                                      f"{tool_choice!r}", param=choice_param)
        return _checked(ToolPlan(parsed, tool_choice, None, parallel, tools_param))
    if isinstance(tool_choice, dict) and tool_choice.get("type", "function") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise InvalidRequestError("a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                                      param=choice_param)
        for tool in parsed:
            if tool.name == name:
                return _checked(ToolPlan(parsed, "named", tool, parallel, tools_param))
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not one of the tools "
                                  f"{[t.name for t in parsed]}", param=choice_param)
    raise InvalidRequestError("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                              "\"function\": {\"name\": ...}}", param=choice_param)


def _checked(plan: ToolPlan) -> ToolPlan:
    """``plan``, once the constraint it implies is known to be enforceable (a bad ``parameters`` schema is
    refused here, naming ``tools[i].function.parameters`` and the keyword)."""
    _ = plan.structured_output
    return plan


# ---------------------------------------------------------------------------- parsing
def _call_from_json(text: str, names: frozenset[str]) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of one ``{"name": ..., "arguments": ...}`` object, or None if it is not one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names and obj["name"] not in names:
        return None
    # Some models write "parameters" for "arguments"; arguments given as a JSON string are kept as they are.
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        return obj["name"], args
    return obj["name"], json.dumps(args, ensure_ascii=False, separators=(",", ":"))


def _bare_json_calls(text: str, names: frozenset[str]) -> list[tuple[str, str]]:
    """The calls of an output made only of JSON call objects (Llama 3.x's tool-call syntax: one object, or
    several separated by ``;`` or whitespace, or a JSON array of them); empty if anything else is in it."""
    decoder = json.JSONDecoder()
    calls: list[tuple[str, str]] = []
    pos, n = 0, len(text)
    while True:
        while pos < n and (text[pos].isspace() or text[pos] == ";"):
            pos += 1
        if pos == n:
            return calls
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return []
        for item in obj if isinstance(obj, list) else [obj]:
            parsed = _call_from_json(json.dumps(item), names) if isinstance(item, dict) else None
            if parsed is None:
                return []
            calls.append(parsed)


def _partial_open_len(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``: text that may
    still become a call once more arrives, so it is held back."""
    for n in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """Incremental parser of one output under a :class:`ToolPlan`.

    :meth:`feed` takes text as it is generated and returns the events that are certain so far;
    :meth:`finish` returns the rest at the end. Events are content strings and :class:`ToolCallDelta`.

    In ``auto`` mode, calls are Hermes/Qwen ``<tool_call>{json}</tool_call>`` blocks, or an output that is
    only JSON call objects (Llama 3.x: ``{"name": ..., "parameters": {...}}``, several separated by ``;``);
    an output starting with ``{`` is therefore held back to its end. Text that could still be the start of
    ``<tool_call>`` is held back, whitespace just
    before a call or just after one is dropped (``"</tool_call>\\n<tool_call>"`` has no content between), and
    an unclosed or malformed block is given back as content. Without ``parallel_tool_calls`` only the first
    call is kept.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.names = frozenset(t.name for t in plan.tools)
        self.calls = 0
        self._buffer = ""
        self._in_call = False
        self._after_call = False  # only whitespace since the last call
        self._gap = ""  # that whitespace: it separates the content before the call from what follows
        self._before = ""  # whitespace stripped in front of an open block (given back if it is malformed)
        self._content_seen = False
        self._maybe_bare: bool | None = None  # the output starts with "{" (None: no text yet)
        self._named_id: str | None = None

    def feed(self, text: str) -> list[Event]:
        """Events made certain by ``text`` (appended to what came before)."""
        mode = self.plan.mode
        if mode == "none":
            return [text] if text else []
        if mode == "named":
            if not text and self._named_id is not None:
                return []
            events: list[Event] = []
            if self._named_id is None:
                assert self.plan.function is not None
                self._named_id = new_call_id()
                self.calls = 1
                events.append(ToolCallDelta(0, "", self._named_id, self.plan.function.name))
            if text:
                events.append(ToolCallDelta(0, text))
            return events
        self._buffer += text
        if mode == "required":
            return []  # one JSON document: parsed whole at the end
        return self._scan(final=False)

    def finish(self) -> list[Event]:
        """The remaining events, once the output is complete."""
        mode = self.plan.mode
        if mode == "named":
            return self.feed("") if self._named_id is None else []
        if mode == "required":
            return self._finish_required()
        if mode == "auto":
            return self._scan(final=True)
        return []

    def _finish_required(self) -> list[Event]:
        text, self._buffer = self._buffer, ""
        try:
            items = json.loads(text)
        except ValueError:
            items = None
        calls = []
        if isinstance(items, list) and items:
            for item in items:
                parsed = _call_from_json(json.dumps(item), self.names) if isinstance(item, dict) else None
                if parsed is None:
                    calls = []
                    break
                calls.append(parsed)
        if not calls:  # a truncated output (max_tokens): what was generated is returned as content
            return [text] if text else []
        events: list[Event] = []
        for name, args in calls:
            events.append(ToolCallDelta(self.calls, args, new_call_id(), name))
            self.calls += 1
        return events

    def _content(self, text: str) -> list[Event]:
        if not text:
            return []
        self._content_seen = True
        return [text]

    def _emit_call(self, block: str) -> list[Event]:
        parsed = _call_from_json(block, self.names)
        before, self._before = self._before, ""
        if parsed is None:
            return self._content(before + TOOL_CALL_OPEN + block + TOOL_CALL_CLOSE)
        self._after_call, self._gap = True, ""
        if self.calls and not self.plan.parallel_tool_calls:
            return []  # one call only: later ones are dropped
        name, args = parsed
        event = ToolCallDelta(self.calls, args, new_call_id(), name)
        self.calls += 1
        return [event]

    def _scan(self, *, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            if self._in_call:
                end = self._buffer.find(TOOL_CALL_CLOSE)
                if end < 0:
                    if final:  # unclosed (the output was cut off): given back as content
                        events += self._content(self._before + TOOL_CALL_OPEN + self._buffer)
                        self._buffer = self._before = ""
                    return events
                block = self._buffer[:end]
                self._buffer = self._buffer[end + len(TOOL_CALL_CLOSE):]
                self._in_call = False
                events += self._emit_call(block)
                continue
            if self._after_call:
                # Whitespace after a call is kept aside: dropped before another call or the end, kept as
                # the separator when content follows content.
                stripped = self._buffer.lstrip()
                self._gap += self._buffer[: len(self._buffer) - len(stripped)]
                self._buffer = stripped
                if not stripped or (not final and TOOL_CALL_OPEN.startswith(stripped)):
                    return events  # nothing yet, or perhaps the next call: wait for more
                self._after_call = False
                if self._content_seen and not stripped.startswith(TOOL_CALL_OPEN):
                    self._buffer = self._gap + stripped
                self._gap = ""
            if self._maybe_bare is None and self._buffer.strip():
                self._maybe_bare = self._buffer.lstrip().startswith("{")  # decided once: no copy per token
            if self._maybe_bare and not self._content_seen and not self.calls:
                # Perhaps Llama 3.x's bare JSON call(s): an output that is only ``{"name": ..., "parameters":
                # ...}`` objects (separated by ";" or whitespace). Only the whole output can tell.
                if not final:
                    return events
                bare = _bare_json_calls(self._buffer, self.names)
                if bare:
                    self._buffer = ""
                    for name, args in bare[: None if self.plan.parallel_tool_calls else 1]:
                        events.append(ToolCallDelta(self.calls, args, new_call_id(), name))
                        self.calls += 1
                    return events
            start = self._buffer.find(TOOL_CALL_OPEN)
            if start >= 0:
                content = self._buffer[:start].rstrip()  # whitespace before a call is not content
                self._before = self._buffer[len(content):start]
                events += self._content(content)
                self._buffer = self._buffer[start + len(TOOL_CALL_OPEN):]
                self._in_call = True
                continue
            if final:
                events += self._content(self._buffer)
                self._buffer = ""
                return events
            hold = _partial_open_len(self._buffer)
            body = self._buffer[: len(self._buffer) - hold]
            ready = body.rstrip()  # trailing whitespace waits: a call may follow
            events += self._content(ready)
            self._buffer = self._buffer[len(ready):]
            return events


def fold_events(events: Iterable[Event]) -> tuple[str | None, tuple[ToolCall, ...]]:
    """``(content, calls)`` from parser events; content is None when empty."""
    content: list[str] = []
    calls: dict[int, list[Any]] = {}
    for event in events:
        if isinstance(event, str):
            content.append(event)
        elif event.index not in calls:
            calls[event.index] = [event.id or new_call_id(), event.name or "", event.arguments]
        else:
            calls[event.index][2] += event.arguments
    text = "".join(content)
    return (text or None), tuple(ToolCall(i, n, a) for i, n, a in (calls[k] for k in sorted(calls)))


def parse_tool_calls(text: str, plan: ToolPlan) -> tuple[str | None, tuple[ToolCall, ...]]:
    """Parse a whole output under ``plan``: ``(content or None, calls)``."""
    parser = plan.parser()
    return fold_events([*parser.feed(text), *parser.finish()])


def finish_reason(reason: str | None, has_calls: bool) -> str:
    """OpenAI's ``finish_reason``: ``"tool_calls"`` when the output ended with calls (not when cut off)."""
    reason = reason or "stop"
    return "tool_calls" if has_calls and reason != "length" else reason

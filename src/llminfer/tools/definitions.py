"""Tool definitions and ``tool_choice``: validating OpenAI tool definitions (:func:`parse_tools`), the
JSON Schemas of their arguments, and how a request's tools are served (:func:`plan_tools`,
:class:`ToolPlan`, with the output constraint it implies). Parsing calls out of generated text is
:mod:`llminfer.tools.calls`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import attrs

from llminfer.errors import InvalidRequestError
from llminfer.sampling.schema import KEYWORDS, SchemaError, normalize_schema, split_defs
from llminfer.sampling.structured import StructuredOutput

_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


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
        if not _TOOL_NAME.fullmatch(name):
            # OpenAI's rule, plus '.' and ':' (namespaced MCP tools); a quote, a newline or '</tool_call>' in a
            # name would break the call syntax the model writes and the parser reads
            raise InvalidRequestError(f"a function name must be 1 to 64 letters, digits, '_', '-', '.' or ':'; got "
                                      f"{name[:80]!r}", param=f"{where}.function.name")
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


def call_schema(tools: Sequence[Tool], *, tools_param: str = "tools") -> dict[str, Any]:
    """The JSON Schema of one call of any of ``tools``: ``{"name": <const>, "arguments": <parameters>}`` (an
    ``anyOf`` of them for several tools).

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
    schema: dict[str, Any] = dict(items[0]) if len(items) == 1 else {"anyOf": items}
    if defs:
        schema["$defs"] = defs
    return schema


def required_schema(tools: Sequence[Tool], parallel_tool_calls: bool = True, *,
                    tools_param: str = "tools") -> dict[str, Any]:
    """The JSON Schema ``tool_choice="required"`` constrains the output to: a non-empty array (of one
    item when not ``parallel_tool_calls``) of :func:`call_schema` items, ``$defs`` at the root.

    Raises:
        SchemaError: a tool's parameters cannot be enforced (``param`` names ``tools[i].function.parameters``).
    """
    item = call_schema(tools, tools_param=tools_param)
    defs = item.pop("$defs", None)
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": item}
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

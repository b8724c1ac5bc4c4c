"""The structured-output constraint a request carries (:class:`StructuredOutput`), and the checks that
refuse, before anything is compiled, a constraint too large or too deep to compile in time.

A JSON Schema is normalized on the way in (:func:`llminfer.sampling.schema.normalize_schema`), so the
constraint's value is what xgrammar will enforce, and two spellings of one schema are one cache key of
the :class:`~llminfer.sampling.grammar_compiler.GrammarCompiler`.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from llminfer.errors import InvalidRequestError

PARAM = "structured_output"
COMPACT = (",", ":")  # JSON item and key separators: no whitespace anywhere, so none can run away


MAX_SCHEMA_DEPTH = 64
"""Deepest nesting of objects and arrays a JSON Schema may have. xgrammar's compile time grows steeply
with depth (and a compile cannot be interrupted), and Python's ``json`` module overflows its recursion
limit near 1,000 levels; real schemas stay far below this (OpenAI's strict mode allows 10 levels of
nesting)."""


def _depth(value: Any) -> int:
    """Nesting depth of dicts and lists in ``value``, iteratively (a deep value must not recurse); stops
    counting just past :data:`MAX_SCHEMA_DEPTH`."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_SCHEMA_DEPTH:
                stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _external_ref(value: Any) -> str | None:
    """The first ``$ref`` in ``value`` that does not point inside the schema (``#...``), or None."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
                return str(ref)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


def _schema_text(value: Any) -> str | None:
    """A JSON Schema as compact JSON text (key order kept: it is the order properties are generated in)."""
    if value is None:
        return None
    if isinstance(value, type) and hasattr(value, "model_json_schema"):  # a pydantic model class
        value = value.model_json_schema()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except RecursionError:  # nested past Python's recursion limit, so past the depth limit too
            raise InvalidRequestError(f"json_schema nests objects and arrays deeper than {MAX_SCHEMA_DEPTH} "
                                      "levels", param=PARAM) from None
        except ValueError as exc:
            raise InvalidRequestError(f"json_schema is not valid JSON: {exc}", param=PARAM) from None
    if not isinstance(value, (dict, bool)):
        raise InvalidRequestError("json_schema must be a JSON Schema object (a dict, JSON text or a pydantic "
                                  f"model class), got {type(value).__name__}", param=PARAM)
    if _depth(value) > MAX_SCHEMA_DEPTH:
        raise InvalidRequestError(f"json_schema nests objects and arrays deeper than {MAX_SCHEMA_DEPTH} levels",
                                  param=PARAM)
    external = _external_ref(value)
    if external is not None:  # xgrammar only warns and leaves that part unconstrained
        raise InvalidRequestError(f"JSON Schema keyword '$ref': {external!r} is not supported; only references "
                                  "inside the schema ('#/...') are", param=PARAM)
    try:
        return json.dumps(value, separators=(",", ":"))
    except (TypeError, ValueError) as exc:  # a value JSON cannot hold (a set, an object), or a cycle
        raise InvalidRequestError(f"json_schema is not JSON: {exc}", param=PARAM) from None


MAX_SCHEMA_CHARS = 1_000_000
"""Longest JSON Schema accepted, as compact JSON text (characters). Real tool lists stay far below it (an
MCP server's 50 tools are ~100 kB)."""

MAX_ENUM_VALUES = 10_000
"""Most ``enum`` values (all enums of a schema together) accepted. xgrammar's compile time grows with
them, past the compile deadline well before 100,000 values."""


def _check_size(text: str) -> None:
    """Refuse a schema whose size alone makes it too slow to compile (before it takes a compile slot)."""
    if '"enum":' in text and _enum_values(json.loads(text)) > MAX_ENUM_VALUES:
        raise InvalidRequestError(f"json_schema has more than {MAX_ENUM_VALUES:,} enum values in all; compiling "
                                  "it would take too long (use a pattern, or fewer values)", param=PARAM,
                                  code="schema_too_large")
    if len(text) > MAX_SCHEMA_CHARS:
        raise InvalidRequestError(f"json_schema is {len(text):,} characters of JSON; at most {MAX_SCHEMA_CHARS:,} "
                                  "are accepted (compiling it would take too long)", param=PARAM,
                                  code="schema_too_large")


def _enum_values(value: Any) -> int:
    count = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                if key == "enum" and isinstance(child, list):
                    count += len(child)
                elif key not in ("const", "default", "examples"):
                    stack.append(child)
        elif isinstance(item, list):
            stack.extend(item)
    return count


def _choices(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    # A list or tuple only: a string, a number, a dict (its keys) or a one-shot iterator is a client mistake.
    if not isinstance(value, (list, tuple)) or not all(isinstance(c, str) for c in value):
        raise InvalidRequestError("choice must be a list of strings", param=PARAM)
    return tuple(value)


@attrs.frozen(kw_only=True)
class StructuredOutput:
    """One output constraint: exactly one of the fields (the names of vLLM's ``StructuredOutputsParams``).

    Attributes:
        json_schema: a JSON Schema (dict, JSON text, or a pydantic model class); kept as canonical JSON text
            of its normalized form (:func:`llminfer.sampling.schema.normalize_schema`: rewritten into what
            xgrammar enforces exactly, or refused).
        strict: with ``json_schema``: close every object the schema leaves open (OpenAI's ``strict: true``);
            otherwise objects without ``additionalProperties`` are open, as JSON Schema means them.
        json_object: any JSON object (OpenAI ``response_format: {"type": "json_object"}``).
        regex: a regular expression the whole output must match.
        grammar: a context-free grammar in xgrammar's EBNF (GBNF-style: ``root ::= "yes" | "no"``).
        choice: the output is exactly one of these strings.
        call_opening_ids: with ``grammar``: the tokens that open its tool-call branch, when the grammar is
            tool calls or an answer (:func:`llminfer.tools.answer_format.calls_or_answer`): the model's own
            first choice then picks the branch (:class:`~llminfer.sampling.processors.CallOrAnswer`).

    Raises:
        InvalidRequestError: none or more than one constraint, or a value of the wrong type
            (``param="structured_output"``); a :class:`~llminfer.sampling.schema.SchemaError` naming the
            keyword for a schema that cannot be enforced.
    """

    json_schema: str | None = attrs.field(default=None, converter=_schema_text)
    strict: bool = False
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = attrs.field(default=None, converter=_choices)
    call_opening_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)

    def __attrs_post_init__(self) -> None:
        given = [name for name in ("json_schema", "regex", "grammar", "choice") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise InvalidRequestError("structured output takes exactly one of json_schema, json_object, regex, "
                                      f"grammar or choice; got {given or 'none'}", param=PARAM)
        if not isinstance(self.json_object, bool):  # "no" would otherwise count as true
            raise InvalidRequestError("json_object must be true or false", param=PARAM)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{name} must be a non-empty string", param=PARAM)
        if self.choice is not None and (not self.choice or not all(self.choice)):
            raise InvalidRequestError("choice must be a non-empty list of non-empty strings", param=PARAM)
        if self.call_opening_ids and (self.grammar is None or not all(
                isinstance(i, int) and i >= 0 for i in self.call_opening_ids)):
            raise InvalidRequestError("call_opening_ids are token ids, with a grammar", param=PARAM)
        if not isinstance(self.strict, bool):
            raise InvalidRequestError("strict must be true or false", param=PARAM)
        if self.json_schema is not None:
            from llminfer.sampling.schema import normalize_schema

            _check_size(self.json_schema)
            normalized = normalize_schema(json.loads(self.json_schema), strict=self.strict)
            object.__setattr__(self, "json_schema", json.dumps(normalized, separators=COMPACT))

    @property
    def kind(self) -> str:
        """``"json_schema"``, ``"json_object"``, ``"regex"``, ``"grammar"`` or ``"choice"``."""
        if self.json_object:
            return "json_object"
        return next(n for n in ("json_schema", "regex", "grammar", "choice") if getattr(self, n) is not None)

    def to_ebnf_choice(self) -> str:
        """The choice as an EBNF grammar (JSON string escapes are valid EBNF literals in xgrammar)."""
        assert self.choice is not None
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)

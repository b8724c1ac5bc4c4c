"""Writes tools_corpus.json: real-world tool schemas for tests/test_structured_corpus.py (issue 36).

Three sources: the JSON Schemas pydantic v2 emits for nested models (generated here with pydantic), the
shapes zod-to-json-schema emits (draft-07, ``definitions``, ``additionalProperties: false``, nullable as a
type list), and MCP-style tool lists (``inputSchema`` with ``required`` names not under ``properties``, empty
schemas, free-form objects). Each entry is ``{"source", "tools": [OpenAI tool, ...], "refused": keyword or
null}``; a refused entry's schemas use a keyword a grammar cannot enforce.

    python tests/data/json_schemas/make_tools_corpus.py
"""

from __future__ import annotations

import enum
import json
from datetime import date, datetime
from pathlib import Path
from typing import Annotated, Literal
from uuid import UUID

from pydantic import BaseModel, Field


class Unit(str, enum.Enum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class Location(BaseModel):
    city: str = Field(max_length=40)
    country: str = Field(min_length=2, max_length=2, description="ISO 3166 code")


class Weather(BaseModel):
    location: Location
    unit: Unit = Unit.celsius
    days: int = Field(1, ge=1, le=14)


class Address(BaseModel):
    street: str = Field(max_length=30)
    zip: str = Field(pattern=r"^[0-9]{5}$", max_length=5)  # the pattern bounds it: the length is kept


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int | None = Field(None, ge=0, le=130)
    emails: list[Annotated[str, Field(max_length=30)]] = Field(default_factory=list, max_length=3)
    home: Address | None = None
    work: Address | None = None


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int = Field(ge=0, le=9)


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class AdoptPet(BaseModel):
    pet: Cat | Dog = Field(discriminator="kind")
    owner: Person


class TreeNode(BaseModel):
    label: str = Field(max_length=10)
    children: list[TreeNode] = Field(default_factory=list, max_length=2)


class Event(BaseModel):
    id: UUID
    title: str = Field(max_length=30)
    day: date
    starts: datetime
    attendees: list[Person] = Field(default_factory=list, max_length=2)


class Query(BaseModel):
    sql: str = Field(max_length=80)
    limit: int = Field(10, ge=1, le=1000)
    dry_run: bool = False


class Priority(enum.IntEnum):
    low = 1
    high = 2


class Ticket(BaseModel):
    title: str = Field(max_length=40)
    priority: Priority
    labels: list[Literal["bug", "feature", "docs"]] = Field(default_factory=list, max_length=3)
    assignee: Person | str | None = None


class Tags(BaseModel):
    tags: set[str]  # uniqueItems: a grammar cannot enforce it


def tool(name: str, parameters: dict | None, description: str = "", strict: bool | None = None) -> dict:
    function: dict = {"name": name, "description": description or name.replace("_", " ")}
    if parameters is not None:
        function["parameters"] = parameters
    if strict is not None:
        function["strict"] = strict
    return {"type": "function", "function": function}


def pydantic_entries() -> list[dict]:
    models = [Weather, Person, AdoptPet, TreeNode, Event, Query, Ticket, Location, Address]
    out = [{"source": f"pydantic:{m.__name__}", "tools": [tool(m.__name__.lower(), m.model_json_schema())],
            "refused": None} for m in models]
    out.append({"source": "pydantic:several", "refused": None,
                "tools": [tool(m.__name__.lower(), m.model_json_schema()) for m in (Weather, AdoptPet, TreeNode)]})
    out.append({"source": "pydantic:strict", "refused": None,
                "tools": [tool("person", Person.model_json_schema(), strict=True)]})
    out.append({"source": "pydantic:Tags", "tools": [tool("tags", Tags.model_json_schema())],
                "refused": "uniqueItems"})
    return out


ZOD = [
    # z.object({...}) with zod-to-json-schema defaults
    {"type": "object", "properties": {"query": {"type": "string", "maxLength": 50},
                                      "page": {"type": "integer", "minimum": 1, "maximum": 50}},
     "required": ["query"], "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"},
    # z.enum, z.boolean().optional(), z.string().nullable()
    {"type": "object", "properties": {"mode": {"type": "string", "enum": ["fast", "slow"]},
                                      "verbose": {"type": "boolean"},
                                      "note": {"type": ["string", "null"], "maxLength": 20}},
     "required": ["mode", "note"], "additionalProperties": False,
     "$schema": "http://json-schema.org/draft-07/schema#"},
    # z.union of objects
    {"type": "object", "properties": {"target": {"anyOf": [
        {"type": "object", "properties": {"file": {"type": "string", "maxLength": 30}}, "required": ["file"],
         "additionalProperties": False},
        {"type": "object", "properties": {"host": {"type": "string", "format": "ipv4"}},
         "required": ["host"], "additionalProperties": False}]}},
     "required": ["target"], "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"},
    # z.discriminatedUnion
    {"type": "object", "properties": {"shape": {"anyOf": [
        {"type": "object", "properties": {"type": {"type": "string", "const": "circle"},
                                          "r": {"type": "number", "minimum": 0, "maximum": 100}},
         "required": ["type", "r"], "additionalProperties": False},
        {"type": "object", "properties": {"type": {"type": "string", "const": "square"},
                                          "side": {"type": "number", "exclusiveMinimum": 0, "maximum": 100}},
         "required": ["type", "side"], "additionalProperties": False}]}},
     "required": ["shape"], "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"},
    # reused schema with $refStrategy "root": definitions + $ref
    {"type": "object", "properties": {"from": {"$ref": "#/definitions/point"}, "to": {"$ref": "#/definitions/point"}},
     "required": ["from", "to"], "additionalProperties": False,
     "definitions": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -99,
                                                                      "maximum": 99},
                                                                "y": {"type": "integer", "minimum": -99,
                                                                      "maximum": 99}},
                               "required": ["x", "y"], "additionalProperties": False}},
     "$schema": "http://json-schema.org/draft-07/schema#"},
    # reused schema with the default $refStrategy: a pointer into properties
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                                                     "maximum": 9}},
                                            "required": ["n"], "additionalProperties": False},
                                      "b": {"$ref": "#/properties/a"}},
     "required": ["a", "b"], "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"},
    # z.intersection -> allOf
    {"allOf": [{"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}},
                "required": ["id"]},
               {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]}],
     "$schema": "http://json-schema.org/draft-07/schema#"},
    # z.array(z.string()).min(1).max(3), z.number().int().multipleOf(5)
    {"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                              "minItems": 1, "maxItems": 3},
                                      "step": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}},
     "required": ["ids", "step"], "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"},
    # z.tuple (draft-07 items list)
    {"type": "object", "properties": {"pair": {"type": "array", "items": [{"type": "string", "maxLength": 5},
                                                                         {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}],
                                               "minItems": 2, "maxItems": 2}},
     "required": ["pair"], "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"},
    # z.record(z.string().max(6), z.number().int())
    {"type": "object", "properties": {"scores": {"type": "object", "additionalProperties": {
        "type": "integer", "minimum": 0, "maximum": 10}, "propertyNames": {"maxLength": 6}, "maxProperties": 3}},
     "required": ["scores"], "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"},
]

ZOD_REFUSED = [
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
      "required": ["tags"], "additionalProperties": False}, "uniqueItems"),  # z.set()
    ({"type": "object", "properties": {"n": {"type": "number", "multipleOf": 0.5}}, "required": ["n"]}, "multipleOf"),
    ({"type": "object", "properties": {"x": {"not": {"type": "null"}}}, "required": ["x"]}, "not"),
    # z.string().url().max(60): xgrammar drops the length next to a format
    ({"type": "object", "properties": {"url": {"type": "string", "format": "uri", "maxLength": 60}},
      "required": ["url"]}, "maxLength"),
]

MCP = [
    [tool("get_time", {"type": "object", "properties": {}}), tool("ping", None),
     tool("list_files", {"type": "object", "properties": {"path": {"type": "string", "maxLength": 30}},
                         "required": ["path"]})],
    # required names not under properties (bounded here: a random model fills free values to max_tokens)
    [tool("read_resource", {"type": "object", "required": ["uri"], "maxProperties": 1,
                            "additionalProperties": {"type": "string", "maxLength": 40}}),
     tool("set_config", {"type": "object", "properties": {"key": {"type": "string", "maxLength": 10}},
                         "required": ["key", "value"], "additionalProperties": {"type": "string", "maxLength": 10},
                         "propertyNames": {"maxLength": 8}, "maxProperties": 3})],
    [tool("search_issues", {"type": "object", "$schema": "http://json-schema.org/draft-07/schema#",
                            "properties": {"repo": {"type": "string", "pattern": "^[a-z]{1,9}/[a-z]{1,9}$",
                                                    "maxLength": 20},
                                           "state": {"type": "string", "enum": ["open", "closed", "all"]},
                                           "labels": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                      "maxItems": 2}},
                            "required": ["repo"], "additionalProperties": False}),
     tool("create_issue", {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30},
                                                            "body": {"type": "string", "maxLength": 40}},
                           "required": ["title"]})],
    [tool("noop", {}), tool("echo", {"properties": {"text": {"type": "string", "maxLength": 20}},
                                     "required": ["text"]})],
    [tool("run_sql", {"type": "object", "properties": {"query": {"type": "string", "maxLength": 60},
                                                       "params": {"type": "array", "maxItems": 3, "items": {
                                                           "type": ["string", "integer", "null"], "maxLength": 8,
                                                           "minimum": -99, "maximum": 99}}},
                      "required": ["query"]}),
     tool("fetch", {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"},
                                                     "max_length": {"type": "integer", "exclusiveMinimum": 0,
                                                                    "exclusiveMaximum": 1000000}},
                    "required": ["id"]})],
]


def main() -> None:
    entries = pydantic_entries()
    entries += [{"source": f"zod:{i}", "tools": [tool(f"zod_tool_{i}", s)], "refused": None}
                for i, s in enumerate(ZOD)]
    entries += [{"source": f"zod:refused:{kw}", "tools": [tool(f"zod_refused_{i}", s)], "refused": kw}
                for i, (s, kw) in enumerate(ZOD_REFUSED)]
    entries += [{"source": f"mcp:{i}", "tools": tools, "refused": None} for i, tools in enumerate(MCP)]
    path = Path(__file__).with_name("tools_corpus.json")
    path.write_text(json.dumps(entries, indent=1) + "\n", encoding="utf-8")
    print(f"{len(entries)} entries, {sum(len(e['tools']) for e in entries)} tools -> {path}")


if __name__ == "__main__":
    main()

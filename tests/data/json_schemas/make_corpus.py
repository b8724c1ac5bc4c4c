"""Write ``corpus.json``: 120 JSON Schemas for the structured-output tests and benchmark, deterministically.

The first schemas are written by hand, one per feature (so a failure names the feature); the rest are
composed at random (``random.Random(SEED)``) from the same building blocks, nested up to three levels.
Every string has a ``maxLength`` (or is an enum, const, pattern or format of bounded length), every array a
``maxItems`` and every number a range, so a random-weight model cannot produce an unbounded output.
xgrammar 0.2.9 ignores ``minLength``/``maxLength`` next to ``format`` or ``pattern`` (it warns), so neither is
combined with them here, and ``format: email`` (unbounded without ``maxLength``) is written as a bounded
``pattern`` instead, as is ``format: ipv4`` (xgrammar allows leading zeros, Python's ``ipaddress`` does
not); ``format: time`` is kept out of the random leaves (its fractional seconds are unbounded).
``oneOf`` branches are disjoint (different types or a const discriminator): a value matching two branches
would be valid for xgrammar (which treats ``oneOf`` like ``anyOf``) but not for ``jsonschema``.

    python tests/data/json_schemas/make_corpus.py      # rewrites corpus.json next to this script
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

SEED = 13
TOTAL = 120
OUT = Path(__file__).resolve().parent / "corpus.json"

WORDS = ["id", "name", "title", "count", "score", "tags", "kind", "active", "note", "owner", "items", "meta",
         "price", "level", "color", "email", "created", "uid", "flag", "ratio", "parent", "value", "code", "size"]


# format: ipv4 in xgrammar allows leading zeros ("077.1.2.3"), which jsonschema's check (Python's ipaddress)
# rejects: a pattern says what is meant.
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
IPV4 = f"^({_OCTET}\\.){{3}}{_OCTET}$"


def hand_written() -> list[dict[str, Any]]:
    """One schema per feature the corpus must cover."""
    s: list[dict[str, Any]] = [
        {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]},
        {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 5}}, "required": ["n"]},
        {"type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}},
         "required": ["n"]},
        {"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["x"]},
        {"type": "object", "properties": {"x": {"type": "number", "exclusiveMinimum": -1, "exclusiveMaximum": 1}},
         "required": ["x"]},
        {"type": "object", "properties": {"ok": {"type": "boolean"}, "nothing": {"type": "null"}},
         "required": ["ok", "nothing"]},
        {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
        {"type": "object", "properties": {"mixed": {"enum": [1, "two", None, True, 3.5]}}, "required": ["mixed"]},
        {"type": "object", "properties": {"version": {"const": "v1"}, "n": {"const": 42}},
         "required": ["version", "n"]},
        {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                                                    "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
        {"type": "object", "properties": {"pair": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                               "maximum": 9},
                                                    "minItems": 2, "maxItems": 2}}, "required": ["pair"]},
        {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
         "required": ["code"]},
        {"type": "object", "properties": {"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}, "required": ["hex"]},
        {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}, "required": ["d"]},
        {"type": "object", "properties": {"e": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"}},
         "required": ["e"]},
        {"type": "object", "properties": {"u": {"type": "string", "format": "uuid"}}, "required": ["u"]},
        {"type": "object", "properties": {"ip": {"type": "string", "pattern": IPV4}}, "required": ["ip"]},
        {"type": "object", "properties": {"t": {"type": "string", "format": "time"}}, "required": ["t"]},
        {"type": "object", "properties": {"ts": {"type": "string", "format": "date-time"}}, "required": ["ts"]},
        {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 3},
                                          "b": {"type": "string", "maxLength": 4}},
         "required": ["a"], "additionalProperties": False},
        {"type": "object", "properties": {"opt1": {"type": "boolean"}, "opt2": {"type": "string", "maxLength": 3}}},
        {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                                                          {"type": "string", "maxLength": 6}]}}, "required": ["v"]},
        {"type": "object", "properties": {"shape": {"oneOf": [
            {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 9}},
             "required": ["kind", "r"], "additionalProperties": False},
            {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1,
                                                                                     "maximum": 9}},
             "required": ["kind", "side"], "additionalProperties": False}]}}, "required": ["shape"]},
        {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                              "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                             "required": ["x", "y"], "additionalProperties": False}},
         "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
         "required": ["a", "b"]},
        {"$defs": {"name": {"type": "string", "maxLength": 8}},
         "type": "object", "properties": {"names": {"type": "array", "items": {"$ref": "#/$defs/name"},
                                                     "maxItems": 4}}, "required": ["names"]},
        {"type": "object", "properties": {"user": {"type": "object", "properties": {
            "profile": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 130},
                                                         "nick": {"type": "string", "maxLength": 6}},
                        "required": ["age"]}}, "required": ["profile"]}}, "required": ["user"]},
        {"type": "object", "properties": {"maybe": {"type": ["string", "null"], "maxLength": 5}},
         "required": ["maybe"]},
        {"type": "object", "properties": {"m": {"anyOf": [{"type": "null"},
                                                          {"type": "integer", "minimum": 1, "maximum": 5}]}},
         "required": ["m"]},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 1, "maxItems": 5},
        {"type": "string", "maxLength": 10},
        {"type": "integer", "minimum": 100, "maximum": 999},
        {"type": "boolean"},
        {"enum": ["alpha", "beta", "gamma"]},
        {"type": "object", "properties": {"rows": {"type": "array", "maxItems": 3, "items": {
            "type": "array", "maxItems": 3, "items": {"type": "integer", "minimum": 0, "maximum": 1}}}},
         "required": ["rows"]},
        {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4}}, "required": ["s"]},
        {"type": "object", "properties": {"word": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
         "required": ["word"]},
        {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[0-9]{4}$"},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 20}},
            "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"],
         "additionalProperties": False},
        {"type": "object", "properties": {"ip6": {"type": "string", "format": "ipv6"}},
         "required": ["ip6"]},
        {"type": "object", "properties": {"unicode": {"enum": ["café", "日本", "naïve \"quoted\""]}},
         "required": ["unicode"]},
        {"type": "object", "properties": {"p": {"type": "number", "minimum": -100.5, "maximum": 100.5},
                                          "q": {"type": "integer", "minimum": -1000, "maximum": -10}},
         "required": ["p", "q"]},
    ]
    return s


def leaf(rng: random.Random) -> dict[str, Any]:
    """A bounded scalar schema."""
    k = rng.randrange(12)
    if k == 0:
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if k == 1:
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(1, 8)}
    if k == 2:
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if k == 3:
        lo = rng.randint(-20, 20)
        return {"type": "integer", "exclusiveMinimum": lo, "exclusiveMaximum": lo + rng.randint(2, 40)}
    if k == 4:
        return {"type": "number", "minimum": rng.choice([-10, 0, 0.5]), "maximum": rng.choice([1, 10, 99.5])}
    if k == 5:
        return {"type": "boolean"}
    if k == 6:
        return {"type": "null"}
    if k == 7:
        return {"enum": rng.sample(["a", "bb", "ccc", "north", "south", "x y", "ünï", 0, 1, True, None], 3)}
    if k == 8:
        return {"const": rng.choice(["fixed", 7, False, "ok"])}
    if k == 9:
        return {"type": "string", "pattern": rng.choice(["^[a-z]{2,5}$", "^[0-9]{2}-[0-9]{2}$", "^(yes|no)$",
                                                         "^[A-F0-9]{4}$", "^v[0-9]\\.[0-9]$"])}
    if k == 10:
        return {"type": "string", "format": rng.choice(["date", "uuid", "ipv6", "date"])}
    return {"type": ["integer", "null"], "minimum": 0, "maximum": 9}


def node(rng: random.Random, depth: int, defs: dict[str, Any]) -> dict[str, Any]:
    """A schema of nesting depth at most ``depth``."""
    if depth == 0:
        return leaf(rng)
    k = rng.randrange(9)
    if k <= 2:
        return obj(rng, depth, defs)
    if k == 3:
        lo = rng.randint(0, 2)
        return {"type": "array", "items": node(rng, depth - 1, defs), "minItems": lo,
                "maxItems": lo + rng.randint(0, 3)}
    if k == 4:
        return {"anyOf": [node(rng, depth - 1, defs), leaf(rng)]}
    if k == 5:  # disjoint branches: different JSON types
        return {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 4},
                          {"type": "boolean"}][: rng.randint(2, 3)]}
    if k == 6:  # disjoint branches: a const discriminator
        return {"oneOf": [{"type": "object", "properties": {"tag": {"const": t}, "v": leaf(rng)},
                           "required": ["tag", "v"], "additionalProperties": False} for t in ("a", "b")]}
    if k == 7:
        name = f"d{len(defs)}"
        defs[name] = {}  # reserve the name first: a nested $ref must not take it (that made a circular ref)
        defs[name] = node(rng, depth - 1, defs)
        return {"$ref": f"#/$defs/{name}"}
    return leaf(rng)


def obj(rng: random.Random, depth: int, defs: dict[str, Any]) -> dict[str, Any]:
    names = rng.sample(WORDS, rng.randint(1, 4))
    props = {n: node(rng, depth - 1, defs) for n in names}
    required = [n for n in names if rng.random() < 0.6]
    out: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        out["required"] = required
    if rng.random() < 0.5:
        out["additionalProperties"] = False
    return out


def generated(rng: random.Random, count: int, seen: set[str]) -> list[dict[str, Any]]:
    """``count`` random schemas, none equal to one in ``seen`` (canonical JSON texts) or to each other."""
    schemas = []
    while len(schemas) < count:
        defs: dict[str, Any] = {}
        schema = obj(rng, rng.randint(1, 3), defs)
        if defs:
            schema = {"$defs": defs, **schema}
        key = json.dumps(schema, sort_keys=True)
        if key not in seen:
            seen.add(key)
            schemas.append(schema)
    return schemas


def corpus() -> list[dict[str, Any]]:
    """The corpus: the hand-written schemas, then random compositions up to ``TOTAL``."""
    first = hand_written()
    seen = {json.dumps(s, sort_keys=True) for s in first}
    return first + generated(random.Random(SEED), TOTAL - len(first), seen)


if __name__ == "__main__":
    OUT.write_text(json.dumps(corpus(), indent=1, ensure_ascii=False) + "\n")
    print(f"{TOTAL} schemas -> {OUT}")

"""JSON Schema normalization: every schema a client sends is rewritten into the subset that xgrammar 0.2.9
enforces exactly, or refused naming the keyword. Shared by ``response_format``, the Responses API's
``text.format``, vLLM's ``guided_json`` / ``structured_outputs`` and tools (named and ``required``).

Why: xgrammar's JSON Schema converter drops what it does not understand. Measured on 0.2.9 by comparing the
grammar it builds with and without each keyword (``Grammar.from_json_schema``): ``uniqueItems``,
``contains``, ``not``, ``if``/``then``/``else``, ``dependentRequired``, ``dependentSchemas``,
``unevaluatedProperties``/``unevaluatedItems``, ``$dynamicRef`` and ``multipleOf`` on numbers are ignored;
``allOf`` with more than one member is dropped entirely; ``oneOf`` whose branches it cannot prove disjoint
falls back to ``anyOf``; siblings of ``$ref`` and of ``anyOf`` are dropped; ``enum`` drops its siblings
(``{"enum": ["aaaa"], "maxLength": 2}`` yields ``"aaaa"``); names in ``required`` but not in
``properties`` are never generated; draft-7 tuple ``items`` / ``additionalItems`` are errors. So:

- *enforced*: passed to xgrammar as they are (it enforces them);
- *rewritten*: turned into enforced keywords with the same meaning (``allOf`` merged, siblings of ``$ref``
  and ``anyOf`` distributed, ``oneOf`` with provably disjoint branches turned into ``anyOf``, ``enum``
  filtered by its siblings with ``jsonschema``, ``required`` names added to ``properties``...);
- *refused*: a 400 naming the keyword and where it is (``param`` is the field the schema came in);
- *annotation*: no effect on validity in JSON Schema (``title``, ``description``, ``default``...), dropped.
  Keywords JSON Schema does not define are annotations too (2020-12, section 4.3.1).

Objects are closed (``additionalProperties: false``) where the client asked: ``strict: true`` on the request,
or ``additionalProperties: false`` in the schema. Otherwise they stay open as JSON Schema means them (an
``additionalProperties`` schema, ``patternProperties``, or an object schema listing no properties, generate
keys of their own), except that names the schema never mentions are not invented where it lists properties
(see :func:`_close_objects`); names in ``required`` are always generated.
Every ``$ref`` target becomes an entry of the root ``$defs`` (hoisted, under a sanitized name), so schemas
can be combined (:func:`combine_defs`) without breaking references.

:data:`KEYWORDS` is the table (the README's is generated from it by :func:`keyword_table_markdown`).
"""

from __future__ import annotations

import json
import re
import urllib.parse
from typing import Any

from llminfer.errors import InvalidRequestError

PARAM = "structured_output"
CODE = "unsupported_schema"

ENFORCED, REWRITTEN, REFUSED, ANNOTATION = "enforced", "rewritten", "refused", "annotation"

KEYWORDS: dict[str, tuple[str, str]] = {
    "type": (ENFORCED, ""),
    "enum": (ENFORCED, "values that break the sibling keywords are removed first (checked with jsonschema)"),
    "const": (ENFORCED, "as a one-value enum, checked against its siblings the same way"),
    "properties": (ENFORCED, "generated in the order given"),
    "required": (REWRITTEN, "a name missing from properties is added to them, with additionalProperties' "
                            "schema (any value if none); refused if additionalProperties is false"),
    "additionalProperties": (ENFORCED, "absent means an open object, unless the request is strict"),
    "patternProperties": (ENFORCED, ""),
    "propertyNames": (ENFORCED, ""),
    "minProperties": (ENFORCED, ""),
    "maxProperties": (ENFORCED, ""),
    "items": (ENFORCED, "a list (draft 4-7 tuple form) is rewritten to prefixItems"),
    "prefixItems": (ENFORCED, ""),
    "additionalItems": (REWRITTEN, "becomes items, next to a tuple-form items list"),
    "minItems": (ENFORCED, ""),
    "maxItems": (ENFORCED, ""),
    "minLength": (ENFORCED, "next to pattern or format (which xgrammar then ignores it for): dropped where the "
                            "pattern's or format's own lengths are within the bounds, refused otherwise"),
    "maxLength": (ENFORCED, "as minLength"),
    "pattern": (ENFORCED, "the whole string matches it (a subset of what the unanchored pattern allows)"),
    "format": (ENFORCED, "xgrammar's rules for date-time, date, time, duration, email, hostname, ipv6, uri, "
                         "uri-reference, uuid...; 'date' bounds the day at 31 whatever the month; 'ipv4' is "
                         "rewritten to an exact pattern (xgrammar's allows leading zeros, '055')"),
    "minimum": (ENFORCED, ""),
    "maximum": (ENFORCED, ""),
    "exclusiveMinimum": (ENFORCED, "draft-4 boolean form rewritten to the number form"),
    "exclusiveMaximum": (ENFORCED, "draft-4 boolean form rewritten to the number form"),
    "multipleOf": (ENFORCED, "integers only (an integer type and an integer divisor); refused on numbers"),
    "anyOf": (ENFORCED, "sibling keywords are merged into each branch (xgrammar drops them)"),
    "oneOf": (REWRITTEN, "becomes anyOf when the branches are provably disjoint (types, const/enum values, "
                         "or a required discriminator property); refused otherwise"),
    "allOf": (REWRITTEN, "merged into one schema (properties, required, bounds, enums intersected); refused "
                         "where two members conflict in a way a merge cannot express"),
    "$ref": (REWRITTEN, "targets inside the document only ('#', '#/$defs/...', any '#/...' pointer), "
                        "hoisted into the root $defs; sibling keywords merged with the target"),
    "$defs": (REWRITTEN, "hoisted to the root, renamed when schemas are combined"),
    "definitions": (REWRITTEN, "as $defs"),
    "unevaluatedProperties": (REWRITTEN, "as additionalProperties where no applicator (allOf, anyOf, oneOf, "
                                         "$ref) could evaluate other properties; refused otherwise"),
    "unevaluatedItems": (REWRITTEN, "as items where no applicator could evaluate other items; refused "
                                    "otherwise"),
    "uniqueItems": (REFUSED, "a grammar cannot enforce it (false is accepted: it changes nothing)"),
    "contains": (REFUSED, "ignored by xgrammar"),
    "minContains": (REFUSED, "with contains; alone it is an annotation"),
    "maxContains": (REFUSED, "with contains; alone it is an annotation"),
    "not": (REFUSED, "ignored by xgrammar"),
    "if": (REFUSED, "ignored by xgrammar (then / else without if are annotations)"),
    "dependentRequired": (REFUSED, "ignored by xgrammar"),
    "dependentSchemas": (REFUSED, "ignored by xgrammar"),
    "dependencies": (REFUSED, "draft-7 form of the two above"),
    "$dynamicRef": (REFUSED, "ignored by xgrammar"),
    "$recursiveRef": (REFUSED, "draft 2019-09 form of $dynamicRef"),
    "$id": (REFUSED, "below the root (it changes what $ref resolves to); at the root an annotation"),
}
_ANNOTATIONS = ("title", "description", "default", "examples", "example", "$comment", "deprecated", "readOnly",
                "writeOnly", "contentEncoding", "contentMediaType", "contentSchema", "$schema", "$anchor",
                "$dynamicAnchor", "$recursiveAnchor", "$vocabulary", "discriminator", "nullable", "then", "else")
for _name in _ANNOTATIONS:
    KEYWORDS[_name] = (ANNOTATION, "dropped: it does not constrain the value")
KEYWORDS["nullable"] = (ANNOTATION, "OpenAPI 3.0, not JSON Schema: dropped (use type [..., 'null'])")
KEYWORDS["discriminator"] = (ANNOTATION, "OpenAPI hint next to oneOf / anyOf: dropped (the branches decide)")

_REFUSED = frozenset(k for k, (h, _) in KEYWORDS.items() if h == REFUSED) - {"$id"}
_SUBSCHEMA_MAPS = ("properties", "patternProperties")
_KNOWN = frozenset(k for k, (h, _) in KEYWORDS.items() if h != ANNOTATION)
MAX_INLINE = 32  # nested $ref-with-siblings / allOf-with-$ref resolutions before giving up


class SchemaError(InvalidRequestError):
    """A schema refused by :func:`normalize_schema`; ``keyword`` is the JSON Schema keyword at fault."""

    def __init__(self, message: str, *, keyword: str, param: str = PARAM) -> None:
        super().__init__(message, param=param, code=CODE)
        self.keyword = keyword


class _Unsatisfiable(Exception):
    """A schema no value matches (an anyOf branch that can be dropped; elsewhere a refusal)."""

    def __init__(self, keyword: str = "allOf", where: str = "") -> None:
        super().__init__(keyword, where)
        self.keyword = keyword
        self.where = where


def _refuse(keyword: str, where: str, why: str) -> SchemaError:
    at = f" at {where}" if where else ""
    return SchemaError(f"JSON Schema keyword '{keyword}'{at} is not supported: {why}", keyword=keyword)


def _types(schema: dict[str, Any]) -> set[str] | None:
    t = schema.get("type")
    if t is None:
        return None
    return {t} if isinstance(t, str) else set(t)


def _key(value: Any) -> str:
    """Identity of a JSON value as JSON Schema compares them (``1 == 1.0``, ``true != 1``)."""
    def canon(v: Any) -> Any:
        if isinstance(v, bool) or v is None or isinstance(v, str):
            return v
        if isinstance(v, (int, float)):
            return float(v) if v == v else v
        if isinstance(v, list):
            return [canon(x) for x in v]
        if isinstance(v, dict):
            return {k: canon(x) for k, x in v.items()}
        return v
    return json.dumps(canon(value), sort_keys=True)


def _sanitize(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name) or "_"


class _Normalizer:
    def __init__(self, doc: Any, strict: bool, prefix: str) -> None:
        self.doc = doc
        self.strict = strict
        self.prefix = prefix
        self.defs: dict[str, Any] = {}
        self.names: dict[str, str] = {}  # JSON pointer -> def name
        self.pending: set[str] = set()  # defs being normalized (a reference cycle)

    # ------------------------------------------------------------------ references
    def _pointer_target(self, pointer: str, where: str) -> Any:
        node = self.doc
        if pointer:
            for raw in pointer.lstrip("/").split("/"):
                part = urllib.parse.unquote(raw).replace("~1", "/").replace("~0", "~")
                if isinstance(node, dict) and part in node:
                    node = node[part]
                elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                    node = node[int(part)]
                else:
                    raise _refuse("$ref", where, f"'#{pointer}' points to nothing in the schema")
        return node

    def ref(self, ref: Any, where: str) -> dict[str, Any]:
        """``{"$ref": "#/$defs/<name>"}`` for a reference inside the document; its target normalized into
        :attr:`defs` once."""
        if not isinstance(ref, str) or not ref.startswith("#") or (len(ref) > 1 and ref[1] != "/"):
            raise _refuse("$ref", where, f"{ref!r}: only references inside the schema ('#' or '#/...') are")
        pointer = ref[1:]
        name = self.names.get(pointer)
        if name is None:
            parts = pointer.lstrip("/").split("/")
            base = parts[-1] if len(parts) == 2 and parts[0] in ("$defs", "definitions") else (
                "root" if not pointer else "ref_" + "_".join(parts))
            name = self.prefix + _sanitize(urllib.parse.unquote(base))
            while name in self.defs or name in self.pending:
                name += "_"
            self.names[pointer] = name
            self.pending.add(name)
            target = self._pointer_target(pointer, where)
            self.defs[name] = self.norm(target, f"#{pointer}")
            self.pending.discard(name)
        return {"$ref": f"#/$defs/{name}"}

    def resolve(self, schema: Any, where: str, depth: int = 0) -> Any:
        """``schema`` with a top-level ``$ref`` replaced by its (normalized) target."""
        while isinstance(schema, dict) and "$ref" in schema:
            name = schema["$ref"].rsplit("/", 1)[-1]
            if name in self.pending or depth > MAX_INLINE:
                raise _refuse("$ref", where, "a reference cycle through allOf or sibling keywords cannot be merged")
            schema = self.defs[name]
            depth += 1
        return schema

    # ------------------------------------------------------------------ one schema
    def norm(self, node: Any, where: str) -> Any:
        if node is True:
            return {}
        if node is False:
            return False
        if not isinstance(node, dict):
            raise SchemaError(f"a JSON Schema must be an object or a boolean, got {type(node).__name__} at "
                              f"{where or 'the root'}", keyword="type")
        for key in node:
            if key in _REFUSED:
                self._check_refused(node, key, where)
        unevaluated = [k for k in ("unevaluatedProperties", "unevaluatedItems") if k in node]
        if unevaluated and set(node) & {"allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas"}:
            raise _refuse(unevaluated[0], where, "next to applicators (allOf, anyOf, oneOf, $ref) it depends on "
                                                 "what they evaluate, which xgrammar ignores")
        if "$id" in node and where:
            raise _refuse("$id", where, "an $id below the root changes what references resolve to")
        work = {k: v for k, v in node.items() if k in _KNOWN}
        work.pop("$defs", None)
        work.pop("definitions", None)
        work.pop("$id", None)  # at the root: an annotation
        for key in ("uniqueItems", "dependentRequired", "dependentSchemas", "dependencies", "minContains",
                    "maxContains"):
            work.pop(key, None)  # only their no-op forms got past _check_refused
        return self._applicators(work, where)

    def _check_refused(self, node: dict[str, Any], key: str, where: str) -> None:
        value = node[key]
        if key == "uniqueItems" and value is False:
            return
        if key in ("minContains", "maxContains") and "contains" not in node:
            return
        if key in ("dependentRequired", "dependentSchemas", "dependencies") and not value:
            return
        why = KEYWORDS[key][1]
        raise _refuse(key, where, f"{why}; remove it, or check the output yourself")

    def _applicators(self, work: dict[str, Any], where: str) -> Any:
        members: list[Any] = []
        # $ref with siblings: the target merged with them (xgrammar uses the target alone).
        if "$ref" in work:
            ref = self.ref(work.pop("$ref"), where)
            if not work:
                return ref
            members.append(ref)
        if "allOf" in work:
            raw = work.pop("allOf")
            if not isinstance(raw, list) or not raw:
                raise _refuse("allOf", where, "allOf must be a non-empty list of schemas")
            members += [self.norm(m, f"{where}/allOf/{i}") for i, m in enumerate(raw)]
        if members:
            merged = self._applicators(work, where) if work else {}
            for member in members:
                merged = self.merge(merged, member, where)
            return merged
        if "oneOf" in work and "anyOf" in work:
            raise _refuse("oneOf", where, "oneOf next to anyOf cannot be merged")
        for keyword in ("oneOf", "anyOf"):
            if keyword not in work:
                continue
            raw = work.pop(keyword)
            if not isinstance(raw, list) or not raw:
                raise _refuse(keyword, where, f"{keyword} must be a non-empty list of schemas")
            normed = []
            for i, branch in enumerate(raw):
                try:
                    normed.append(self.norm(branch, f"{where}/{keyword}/{i}"))
                except _Unsatisfiable:
                    continue  # a branch no value matches changes nothing
            kept = self._distribute(self._plain(work, where), normed, where, keyword)
            if keyword == "oneOf" and not self._disjoint(kept, where):
                raise _refuse("oneOf", where, "its branches are not provably disjoint (a value could match "
                                              "two), and a grammar enforces anyOf only; use anyOf, or tell the "
                                              "branches apart by a required property with distinct const values")
            return kept[0] if len(kept) == 1 else {"anyOf": kept}
        return self._plain(work, where)

    def _distribute(self, base: Any, branches: list[Any], where: str, keyword: str) -> list[Any]:
        """Each branch merged with the keywords next to it (xgrammar drops them); branches no value can
        match are dropped."""
        kept = []
        for i, branch in enumerate(branches):
            try:
                kept.append(self.merge(base, branch, f"{where}/{keyword}/{i}") if base != {} else branch)
            except _Unsatisfiable:
                continue
        if not kept:
            raise _refuse(keyword, where, "no branch is compatible with the keywords next to it")
        return kept

    def _plain(self, work: dict[str, Any], where: str) -> Any:
        """A schema without applicators: subschemas normalized, keyword forms rewritten."""
        out: dict[str, Any] = {}
        for key, value in work.items():
            if key in ("anyOf", "oneOf", "allOf", "$ref"):
                continue
            if key in _SUBSCHEMA_MAPS:
                if not isinstance(value, dict):
                    raise _refuse(key, where, f"{key} must be an object of schemas")
                out[key] = {n: self.norm(s, f"{where}/{key}/{n}") for n, s in value.items()}
            elif key in ("additionalProperties", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
                         "additionalItems"):
                out[key] = value if isinstance(value, bool) else self.norm(value, f"{where}/{key}")
            elif key == "items":
                if isinstance(value, list):  # draft 4-7 tuple form
                    out["prefixItems"] = [self.norm(s, f"{where}/items/{i}") for i, s in enumerate(value)]
                else:
                    out["items"] = value if isinstance(value, bool) else self.norm(value, f"{where}/items")
            elif key == "prefixItems":
                if not isinstance(value, list):
                    raise _refuse(key, where, "prefixItems must be a list of schemas")
                out[key] = [self.norm(s, f"{where}/prefixItems/{i}") for i, s in enumerate(value)]
            else:
                out[key] = value
        if "additionalItems" in out:
            extra = out.pop("additionalItems")
            if isinstance(work.get("items"), list):
                out["items"] = extra
        for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if isinstance(out.get(bound), bool):  # draft 4: a flag on minimum / maximum
                if out.pop(bound) and plain in out:
                    out[bound] = out.pop(plain)
        if "unevaluatedProperties" in out:
            value = out.pop("unevaluatedProperties")
            if set(work) & {"anyOf", "oneOf", "allOf", "$ref"} or "additionalProperties" in out:
                raise _refuse("unevaluatedProperties", where, "next to applicators or additionalProperties")
            out["additionalProperties"] = value
        if "unevaluatedItems" in out:
            value = out.pop("unevaluatedItems")
            if set(work) & {"anyOf", "oneOf", "allOf", "$ref"} or "items" in out:
                raise _refuse("unevaluatedItems", where, "next to applicators or items")
            out["items"] = value
        if "multipleOf" in out:
            self._check_multiple_of(out, where)
        if out.get("format") == "ipv4" and "pattern" not in out:
            del out["format"]
            out["pattern"] = _IPV4
        if ("minLength" in out or "maxLength" in out) and ("pattern" in out or "format" in out):
            self._check_lengths(out, where)
        self._objects(out, where)
        if "const" in out or "enum" in out:
            return self._values(out, where)
        return out

    def _check_lengths(self, out: dict[str, Any], where: str) -> None:
        """xgrammar drops minLength / maxLength next to a pattern or a format. Keep the schema only where the
        pattern or format bounds the length within them anyway (then the keywords are dropped)."""
        lo, hi = _string_width(out)
        low, high = out.get("minLength", 0), out.get("maxLength")
        if lo is not None and lo >= low and (high is None or (hi is not None and hi <= high)):
            out.pop("minLength", None)
            out.pop("maxLength", None)
            return
        keyword = "maxLength" if high is not None else "minLength"
        other = "pattern" if "pattern" in out else "format"
        raise _refuse(keyword, where, f"xgrammar ignores string length bounds next to {other}; write the bound "
                                      "into the pattern (for example ^[a-z]{1,20}$), or drop one of them")

    def _check_multiple_of(self, out: dict[str, Any], where: str) -> None:
        m = out["multipleOf"]
        if isinstance(m, float) and m.is_integer():
            m = out["multipleOf"] = int(m)
        if isinstance(m, bool) or not isinstance(m, int) or m <= 0 or _types(out) != {"integer"}:
            raise _refuse("multipleOf", where, "xgrammar enforces it on integers only (type 'integer' and a "
                                               "positive integer divisor)")

    def _objects(self, out: dict[str, Any], where: str) -> None:
        types = _types(out)
        is_object = (types is not None and "object" in types) or (
            types is None and bool(set(out) & {"properties", "required", "additionalProperties",
                                                "patternProperties"}))
        if not is_object:
            return
        props = out.get("properties")
        required = out.get("required")
        if required is not None:
            if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
                raise _refuse("required", where, "required must be a list of property names")
            missing = [r for r in required if props is None or r not in props]
            if missing:
                props = out["properties"] = dict(props or {})
                extra = out.get("additionalProperties", True)
                for name in missing:
                    pattern_schema = next((s for p, s in (out.get("patternProperties") or {}).items()
                                           if re.search(p, name)), None)
                    schema = pattern_schema if pattern_schema is not None else extra
                    if schema is False:
                        raise _refuse("required", where, f"'{name}' is required but additionalProperties is "
                                                         "false and it is not under properties")
                    props[name] = {} if schema is True else schema

    def _values(self, out: dict[str, Any], where: str) -> dict[str, Any]:
        """``const`` / ``enum`` with the values their siblings reject removed (xgrammar drops the siblings)."""
        import jsonschema

        values = [out["const"]] if "const" in out else out.get("enum")
        if not isinstance(values, list) or not values:
            raise _refuse("enum", where, "enum must be a non-empty list")
        if "const" in out and "enum" in out:
            enum_keys = {_key(v) for v in out["enum"]}
            values = [v for v in values if _key(v) in enum_keys]
        rest = {k: v for k, v in out.items() if k not in ("const", "enum")}
        if rest:
            doc = dict(rest)
            if self.defs:
                doc["$defs"] = self.defs
            try:
                validator = jsonschema.Draft202012Validator(doc)
                values = [v for v in values if validator.is_valid(v)]
            except Exception as exc:  # noqa: BLE001 - an invalid sibling, or a reference still being resolved
                raise _refuse("enum", where, f"its sibling keywords cannot be checked: {exc}") from None
        if not values:
            raise _Unsatisfiable("enum", where)
        return {"const": values[0]} if "const" in out else {"enum": values}

    # ------------------------------------------------------------------ merging (allOf)
    def merge(self, a: Any, b: Any, where: str, depth: int = 0) -> Any:
        """A schema that matches exactly what both ``a`` and ``b`` match (both normalized).

        Raises:
            _Unsatisfiable: nothing matches both.
            SchemaError: the combination cannot be written without allOf (keyword ``allOf``).
        """
        if a is False or b is False:
            raise _Unsatisfiable("allOf", where)
        if depth > MAX_INLINE:
            raise _refuse("allOf", where, "nested too deeply to merge")
        a = self.resolve(a, where)
        b = self.resolve(b, where)
        if a == {}:
            return b
        if b == {}:
            return a
        if "anyOf" in a and "anyOf" in b:
            raise _refuse("allOf", where, "two anyOf / oneOf lists in one allOf cannot be merged")
        if "anyOf" in b:
            a, b = b, a
        if "anyOf" in a:
            rest = {k: v for k, v in a.items() if k != "anyOf"}
            base = self.merge(rest, b, where, depth + 1) if rest else b
            return {"anyOf": self._distribute(base, a["anyOf"], where, "allOf")}
        out = dict(a)
        for key, vb in b.items():
            if key not in out:
                out[key] = vb
                continue
            va = out[key]
            if va == vb:
                continue
            if key == "type":
                ta, tb = _types(a) or set(), _types(b) or set()
                both = (ta & tb) | ({"integer"} if ("integer" in ta and "number" in tb)
                                    or ("number" in ta and "integer" in tb) else set())
                if not both:
                    raise _Unsatisfiable("allOf", where)
                order = va if isinstance(va, list) else [va]
                kept = [t for t in order if t in both] + sorted(both - set(order))
                out[key] = kept[0] if len(kept) == 1 else kept
            elif key in ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties"):
                out[key] = max(va, vb)
            elif key in ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties"):
                out[key] = min(va, vb)
            elif key == "required":
                out[key] = list(va) + [n for n in vb if n not in va]
            elif key == "properties":
                props = dict(va)
                for name, s in vb.items():
                    props[name] = self.merge(props[name], s, f"{where}/properties/{name}", depth + 1) \
                        if name in props else s
                out[key] = props
            elif key in ("items", "additionalProperties", "propertyNames"):
                if va is True or vb is False:
                    out[key] = vb
                elif vb is True or va is False:
                    out[key] = va
                else:
                    out[key] = self.merge(va, vb, f"{where}/{key}", depth + 1)
            elif key == "enum":
                keys = {_key(v) for v in vb}
                out[key] = [v for v in va if _key(v) in keys]
                if not out[key]:
                    raise _Unsatisfiable("allOf", where)
            elif key == "const":
                raise _Unsatisfiable("allOf", where)  # two different constants
            elif key == "multipleOf" and isinstance(va, int) and isinstance(vb, int):
                import math
                out[key] = va * vb // math.gcd(va, vb)
            else:
                raise _refuse("allOf", where, f"its members give '{key}' two different values, which cannot be "
                                              "merged into one schema")
        # additionalProperties of one member also governs the properties only the other lists.
        for one, other in ((a, b), (b, a)):
            extra = one.get("additionalProperties")
            if extra is None or extra is True or "patternProperties" in one:
                continue
            own = set(one.get("properties", {}))
            props = dict(out.get("properties", {}))
            for name in list(props):
                if name in own or name not in other.get("properties", {}):
                    continue
                if extra is False:
                    if name in out.get("required", []):
                        raise _Unsatisfiable("allOf", where)
                    del props[name]
                else:
                    props[name] = self.merge(props[name], extra, f"{where}/properties/{name}", depth + 1)
            if "properties" in out:
                out["properties"] = props
        if "const" in out or "enum" in out:
            return self._values(out, where)
        if "properties" in out or "required" in out:
            self._objects(out, where)
        return out

    # ------------------------------------------------------------------ oneOf
    def _values_of(self, s: dict[str, Any]) -> list[Any] | None:
        if "const" in s:
            return [s["const"]]
        return s.get("enum")

    def _disjoint(self, branches: list[Any], where: str) -> bool:
        resolved = [self.resolve(b, where) for b in branches]
        return all(self._pair_disjoint(resolved[i], resolved[j], where)
                   for i in range(len(resolved)) for j in range(i + 1, len(resolved)))

    def _pair_disjoint(self, a: Any, b: Any, where: str) -> bool:
        import jsonschema

        if a is False or b is False:
            return True
        if "anyOf" in a or "anyOf" in b:
            parts_a = a.get("anyOf", [a])
            parts_b = b.get("anyOf", [b])
            return all(self._pair_disjoint(self.resolve(x, where), self.resolve(y, where), where)
                       for x in parts_a for y in parts_b)
        va, vb = self._values_of(a), self._values_of(b)
        defs = {"$defs": self.defs} if self.defs else {}
        if va is not None and vb is not None:
            return not ({_key(v) for v in va} & {_key(v) for v in vb})
        if va is not None:
            return not any(jsonschema.Draft202012Validator({**b, **defs}).is_valid(v) for v in va)
        if vb is not None:
            return not any(jsonschema.Draft202012Validator({**a, **defs}).is_valid(v) for v in vb)
        ta, tb = _types(a), _types(b)
        if ta is not None and tb is not None:
            widen = lambda t: t | ({"integer"} if "number" in t else set())  # noqa: E731
            if not (widen(ta) & widen(tb)):
                return True
        pa, pb = a.get("properties", {}), b.get("properties", {})
        for name in set(a.get("required", [])) & set(b.get("required", [])):
            if name in pa and name in pb:
                sa, sb = self.resolve(pa[name], where), self.resolve(pb[name], where)
                xa, xb = self._values_of(sa) if sa else None, self._values_of(sb) if sb else None
                if xa is not None and xb is not None and not ({_key(v) for v in xa} & {_key(v) for v in xb}):
                    return True
        return False


_FORMAT_WIDTHS = {"date": (10, 10), "uuid": (36, 36), "ipv4": (7, 15)}
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_IPV4 = rf"^{_OCTET}(\.{_OCTET}){{3}}$"  # RFC 2673 dotted quad, no leading zeros (Python's ipaddress)


def _string_width(schema: dict[str, Any]) -> tuple[int | None, int | None]:
    """(shortest, longest) length of the strings ``schema``'s pattern / format allow (None: unknown or
    unbounded)."""
    if "pattern" in schema:
        try:
            import re._parser as sre_parse  # type: ignore[import-not-found]
        except ImportError:  # Python 3.10
            import sre_parse  # type: ignore[no-redef]
        pattern = str(schema["pattern"])
        try:
            lo, hi = sre_parse.parse(pattern.removeprefix("^").removesuffix("$")).getwidth()
        except Exception:  # noqa: BLE001 - a pattern Python cannot read: xgrammar will say what is wrong
            return None, None
        return lo, (hi if hi < 2**16 else None)
    return _FORMAT_WIDTHS.get(schema.get("format"), (None, None))


def normalize_schema(schema: Any, *, strict: bool = False, prefix: str = "",
                     param: str = PARAM) -> dict[str, Any]:
    """The schema rewritten into keywords xgrammar enforces exactly (see the module docstring).

    Args:
        schema: a JSON Schema (dict or boolean), already checked to be JSON.
        strict: close every object that does not say otherwise (``additionalProperties: false``).
        prefix: prepended to every ``$defs`` name (to combine several schemas in one document).
        param: the request field named in errors.

    Returns:
        A schema whose ``$defs`` (at the root only) hold every ``$ref`` target; references are
        ``#/$defs/<name>``.

    Raises:
        SchemaError: a keyword that cannot be enforced (``keyword`` names it, the message says where and
            why), with ``param``.
    """
    normalizer = _Normalizer(schema, strict, prefix)
    try:
        root = normalizer.norm(schema, "")
    except SchemaError as exc:
        raise SchemaError(str(exc), keyword=exc.keyword, param=param) from None
    except _Unsatisfiable as exc:
        at = f" at {exc.where}" if exc.where else ""
        raise SchemaError(f"JSON Schema keyword '{exc.keyword}'{at}: no value can match the schema there",
                          keyword=exc.keyword, param=param) from None
    if root is False:
        raise SchemaError("the schema is false: it matches no value", keyword="false", param=param)
    for schema in (root, *normalizer.defs.values()):
        _close_objects(schema, listed_only=not strict)
    root = _canonical(root)
    if normalizer.defs:
        root["$defs"] = {name: _canonical(d) for name, d in normalizer.defs.items()}
    return root


def _canonical(schema: Any) -> Any:
    """``schema`` with each schema's keywords sorted (so two spellings of a schema are one cache key), the
    order of properties kept (it is the order they are generated in)."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key in sorted(schema):
        value = schema[key]
        if key in _SUBSCHEMA_MAPS:
            out[key] = {n: _canonical(v) for n, v in value.items()}
        elif key in ("enum", "const", "required"):
            out[key] = value
        elif isinstance(value, dict):
            out[key] = _canonical(value)
        elif isinstance(value, list):
            out[key] = [_canonical(v) for v in value]
        else:
            out[key] = value
    return out


def _close_objects(schema: Any, *, listed_only: bool) -> None:
    """``additionalProperties: false`` on the object schemas in ``schema`` (normalized, changed in place)
    that do not say otherwise: all of them (a strict request), or with ``listed_only`` those that list
    properties. That is what is *generated*: an object schema without ``additionalProperties`` still
    accepts other keys (the output is valid either way), but the model is not led to invent names the
    schema never mentions (unbounded keys and values that could run to ``max_tokens``); an object schema
    that lists no properties generates any object."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        types = _types(node)
        is_object = (types is not None and "object" in types) or "properties" in node or "required" in node
        if is_object and "additionalProperties" not in node and "patternProperties" not in node and \
                (not listed_only or node.get("properties")):
            node["additionalProperties"] = False
        for key, value in node.items():
            if key in _SUBSCHEMA_MAPS:
                stack.extend(value.values())
            elif key in ("enum", "const"):
                continue
            elif isinstance(value, dict):
                stack.append(value)
            elif isinstance(value, list):
                stack.extend(value)


def split_defs(schema: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(schema without $defs, $defs)`` of a normalized schema."""
    rest = {k: v for k, v in schema.items() if k != "$defs"}
    return rest, dict(schema.get("$defs", {}))


def keyword_table_markdown() -> str:
    """:data:`KEYWORDS` as a Markdown table (the README's), grouped by handling."""
    rows = ["| keyword | handling | how |", "|---|---|---|"]
    order = {ENFORCED: 0, REWRITTEN: 1, REFUSED: 2, ANNOTATION: 3}
    for name, (handling, how) in sorted(KEYWORDS.items(), key=lambda kv: (order[kv[1][0]], kv[0].lstrip("$"))):
        rows.append(f"| `{name}` | {handling} | {how} |")
    rows.append("| any other keyword | annotation | not a JSON Schema 2020-12 assertion: dropped |")
    return "\n".join(rows)

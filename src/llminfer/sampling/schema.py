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
(see :func:`_close_objects`); names in ``required`` are always generated. Every ``$ref`` target becomes an
entry of the root ``$defs`` (hoisted, under a sanitized name, ``prefix``-ed), so schemas can be combined.

:data:`KEYWORDS` is the table (:mod:`llminfer.sampling.schema_keywords`; the README's is generated from it
by :func:`keyword_table_markdown`); ``allOf`` merging and ``oneOf`` disjointness are
:mod:`llminfer.sampling.schema_combine`. This module rewrites one schema and is the public door to both.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import Any

from llminfer.sampling.schema_combine import MAX_INLINE, SchemaCombiner
from llminfer.sampling.schema_keywords import (
    ANNOTATION,
    CODE,
    ENFORCED,
    KEYWORDS,
    KNOWN_KEYWORDS,
    PARAM,
    REFUSED,
    REFUSED_KEYWORDS,
    REWRITTEN,
    SchemaError,
    _key,
    _refuse,
    _types,
    _Unsatisfiable,
    check_bounds,
    check_multiple_of,
    check_number_range,
    check_patterns,
    check_string_keywords,
    check_type,
    finite_property_names,
    integer_bounds,
    keyword_table_markdown,
)

__all__ = ["ANNOTATION", "CODE", "ENFORCED", "KEYWORDS", "PARAM", "REFUSED", "REWRITTEN", "SchemaError",
           "keyword_table_markdown", "normalize_schema", "split_defs"]

_SUBSCHEMA_MAPS = ("properties", "patternProperties")


def _sanitize(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name) or "_"


class _Normalizer(SchemaCombiner):
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
        if "type" in node:
            check_type(node["type"], where)
        check_patterns(node, where)
        for key in node:
            if key in REFUSED_KEYWORDS:
                self._check_refused(node, key, where)
        unevaluated = [k for k in ("unevaluatedProperties", "unevaluatedItems") if k in node]
        if unevaluated and set(node) & {"allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas"}:
            raise _refuse(unevaluated[0], where, "next to applicators (allOf, anyOf, oneOf, $ref) it depends on "
                                                 "what they evaluate, which xgrammar ignores")
        if "$id" in node and where:
            raise _refuse("$id", where, "an $id below the root changes what references resolve to")
        work = {k: v for k, v in node.items() if k in KNOWN_KEYWORDS}
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
            if keyword == "oneOf" and not self.disjoint(kept, where):
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
            check_multiple_of(out, where)
        if out.get("format") == "ipv4" and "pattern" not in out:
            del out["format"]
            out["pattern"] = _IPV4
        if "propertyNames" in out:
            finite_property_names(out, where, self.defs)
        integer_bounds(out, where)
        check_bounds(out, where)
        check_number_range(out, where)
        check_string_keywords(out, where)
        self._objects(out, where)
        if "const" in out or "enum" in out:
            return self._values(out, where)
        return out

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

_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_IPV4 = rf"^{_OCTET}(\.{_OCTET}){{3}}$"  # RFC 2673 dotted quad, no leading zeros (Python's ipaddress)


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

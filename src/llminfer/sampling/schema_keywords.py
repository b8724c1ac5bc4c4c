"""The JSON Schema keyword table (:data:`KEYWORDS`): how each keyword is handled on the way to xgrammar
(enforced, rewritten, refused or dropped as an annotation, and why), the errors a refusal raises, and the
README's table generated from it (:func:`keyword_table_markdown`). The rewriting itself is
:mod:`llminfer.sampling.schema`.
"""

from __future__ import annotations

import json
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
    "propertyNames": (ENFORCED, "an enum or const of names is rewritten into closed properties, one per name "
                                "(xgrammar let a name repeat)"),
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
    "pattern": (ENFORCED, "the whole string matches it (a subset of what the unanchored pattern allows); refused "
                          "next to a format xgrammar implements (date, date-time, email, uuid...: it ignores the "
                          "pattern there) and where it names a quote, a backslash or a control character (xgrammar "
                          "writes them unescaped)"),
    "format": (ENFORCED, "xgrammar's rules for date-time, date, time, duration, email, hostname, ipv6, uri, "
                         "uri-reference, uuid...; 'date' bounds the day at 31 whatever the month; 'ipv4' is "
                         "rewritten to an exact pattern (xgrammar's allows leading zeros, '055')"),
    "minimum": (ENFORCED, "with a bound, xgrammar writes numbers with at most 6 decimals and no exponent: "
                          "bounds that leave no such number are refused; on integers a fractional bound becomes "
                          "the nearest integer inside it, and one beyond 64 bits is refused"),
    "maximum": (ENFORCED, "as minimum"),
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

REFUSED_KEYWORDS = frozenset(k for k, (h, _) in KEYWORDS.items() if h == REFUSED) - {"$id"}
KNOWN_KEYWORDS = frozenset(k for k, (h, _) in KEYWORDS.items() if h != ANNOTATION)


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


JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})


def check_type(value: Any, where: str) -> None:
    """``type`` names JSON types: one, or a non-empty list.

    Raises:
        SchemaError: anything else. An empty list would be read by xgrammar as "any value" (no value is of
            none of the types); a number or a boolean reached code that expects names.
    """
    names = [value] if isinstance(value, str) else value if isinstance(value, list) else None
    if not names or not all(isinstance(n, str) and n in JSON_TYPES for n in names):
        raise _refuse("type", where, "type must name a JSON type (" + ", ".join(sorted(JSON_TYPES))
                      + ") or a non-empty list of them")


def check_patterns(node: dict[str, Any], where: str) -> None:
    """:func:`check_pattern` on a schema's ``pattern`` and on its ``patternProperties`` names."""
    if isinstance(node.get("pattern"), str):
        check_pattern(node["pattern"], "pattern", where)
    for pattern in node.get("patternProperties") or ():
        if isinstance(pattern, str):
            check_pattern(pattern, "patternProperties", where)


def check_pattern(pattern: str, keyword: str, where: str) -> None:
    """Refuse a regular expression with lookaround assertions, word boundaries or backreferences: a grammar
    cannot enforce them, and xgrammar drops a lookahead inside a schema without a word (the same regex as
    ``guided_regex`` is refused). A pattern Python cannot read is left to xgrammar, which says what is wrong.

    Raises:
        SchemaError: naming ``keyword`` (``pattern`` or ``patternProperties``) and what the pattern holds.
    """
    try:
        import re._constants as sre_constants  # type: ignore[import-not-found]
        import re._parser as sre_parse  # type: ignore[import-not-found]
    except ImportError:  # Python 3.10
        import sre_constants  # type: ignore[no-redef]
        import sre_parse  # type: ignore[no-redef]
    try:
        parsed = sre_parse.parse(pattern)
    except Exception:  # noqa: BLE001 - not Python's syntax (e.g. \p{L}): xgrammar decides
        return
    refused = {sre_constants.ASSERT: "a lookahead or lookbehind", sre_constants.ASSERT_NOT: "a lookahead or lookbehind",
               sre_constants.GROUPREF: "a backreference", sre_constants.GROUPREF_EXISTS: "a conditional group"}
    boundaries = {sre_constants.AT_BOUNDARY, sre_constants.AT_NON_BOUNDARY}
    stack = [parsed]
    while stack:
        for op, arg in stack.pop():
            if op in refused or (op == sre_constants.AT and arg in boundaries):
                what = refused.get(op, "a word boundary (\\b or \\B)")
                raise _refuse(keyword, where, f"the regular expression {pattern!r} holds {what}, which a grammar "
                                              "cannot enforce")
            if _names_json_escaped(op, arg, sre_constants):
                raise _refuse(keyword, where, f"the regular expression {pattern!r} names a quote, a backslash or a "
                                              "control character, which xgrammar 0.2.9 writes into the JSON text "
                                              "unescaped (invalid JSON)")
            for item in arg if isinstance(arg, (tuple, list)) else (arg,):
                if isinstance(item, sre_parse.SubPattern):
                    stack.append(item)
                elif isinstance(item, (tuple, list)):
                    stack.extend(x for x in item if isinstance(x, sre_parse.SubPattern))


def _json_escaped(code: int) -> bool:
    """Whether JSON writes the character ``code`` as an escape inside a string: '"', '\\' and U+0000-U+001F."""
    return code < 0x20 or code in (0x22, 0x5C)


def _names_json_escaped(op: Any, arg: Any, sre_constants: Any) -> bool:
    """Whether one parsed regex item names a character JSON escapes: a literal one, a class member, or a class
    range of control characters only. xgrammar matches a pattern against the JSON text, not the decoded string:
    measured on 0.2.9, ``^"$``, ``^["\\\\]{3}$``, ``^\\t$`` and ``^[\\x00-\\x1f]{2}$`` generate those characters raw
    (invalid JSON), ``^[a-z]{2}\\\\[a-z]{2}$`` a backslash that starts an escape. Ranges that also hold other
    characters (``[ -~]``), ``.``, negated classes and ``\\s`` are written without them, so they are kept."""
    if op == sre_constants.LITERAL:
        return _json_escaped(arg)
    if op != sre_constants.IN or any(o == sre_constants.NEGATE for o, _ in arg):
        return False
    return any((o == sre_constants.LITERAL and _json_escaped(a)) or (o == sre_constants.RANGE and a[1] < 0x20)
               for o, a in arg)


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


def keyword_table_markdown() -> str:
    """:data:`KEYWORDS` as a Markdown table (the README's), grouped by handling."""
    rows = ["| keyword | handling | how |", "|---|---|---|"]
    order = {ENFORCED: 0, REWRITTEN: 1, REFUSED: 2, ANNOTATION: 3}
    for name, (handling, how) in sorted(KEYWORDS.items(), key=lambda kv: (order[kv[1][0]], kv[0].lstrip("$"))):
        rows.append(f"| `{name}` | {handling} | {how} |")
    rows.append("| any other keyword | annotation | not a JSON Schema 2020-12 assertion: dropped |")
    return "\n".join(rows)


#: lower and upper bounds of one keyword family: a schema with lower > upper matches nothing
_BOUND_PAIRS = (("minLength", "maxLength", {"string"}), ("minItems", "maxItems", {"array"}),
                ("minProperties", "maxProperties", {"object"}), ("minimum", "maximum", {"number", "integer"}))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_bounds(out: dict[str, Any], where: str) -> None:
    """A lower bound above its upper bound (minLength 5, maxLength 3): no value of that type matches.

    Raises:
        _Unsatisfiable: the schema allows only that type, so nothing matches it (an anyOf branch is dropped).
        SchemaError: other types are allowed beside it (xgrammar refuses such a grammar when it compiles).
    """
    for low, high, family in _BOUND_PAIRS:
        if _is_number(out.get(low)) and _is_number(out.get(high)) and out[low] > out[high]:
            types = _types(out)
            if types is not None and types <= family:
                raise _Unsatisfiable(low, where)
            raise _refuse(low, where, f"{low} {out[low]} is above {high} {out[high]}")


#: Digits after the decimal point of a number xgrammar 0.2.9 writes under a bound (``minimum``, ``maximum`` and
#: their exclusive forms): a plain decimal, no exponent. Measured with its grammars: under ``minimum: 0.1234567``
#: it writes ``0.123457`` but not ``0.1234568``; for ``minimum: 1e-7, maximum: 2e-7`` it builds a grammar of the
#: empty string, which no JSON value is.
BOUNDED_NUMBER_DECIMALS = 6


def check_number_range(out: dict[str, Any], where: str) -> None:
    """A ``type: number`` schema's bounds must leave a number xgrammar can write (at most
    :data:`BOUNDED_NUMBER_DECIMALS` decimals, no exponent); they must leave some number at all.

    Raises:
        _Unsatisfiable: the schema allows only numbers (and integers) and its bounds leave none
            (``exclusiveMinimum: 1, exclusiveMaximum: 1``; an anyOf branch is dropped).
        SchemaError: the bounds leave no number with that many decimals (``minimum: 1e-7, maximum: 2e-7``:
            xgrammar would generate an empty value), or they leave none and other types are allowed.
    """
    import decimal
    import math

    types = _types(out)
    if types is None or "number" not in types:
        return
    lows = [(decimal.Decimal(repr(out[k])), k) for k in ("minimum", "exclusiveMinimum") if _is_number(out.get(k))]
    highs = [(decimal.Decimal(repr(out[k])), k) for k in ("maximum", "exclusiveMaximum") if _is_number(out.get(k))]
    if not lows or not highs or not all(math.isfinite(v) for v, _ in lows + highs):
        return  # one side open: numbers with few decimals always lie in it
    # the tighter bound of each side; at a tie the exclusive one
    low, low_key = max(lows, key=lambda b: (b[0], b[1].startswith("exclusive")))
    high, high_key = min(highs, key=lambda b: (b[0], not b[1].startswith("exclusive")))
    open_low, open_high = low_key.startswith("exclusive"), high_key.startswith("exclusive")
    if low > high or (low == high and (open_low or open_high)):
        if types <= {"number", "integer"}:
            raise _Unsatisfiable(low_key, where)
        raise _refuse(low_key, where, f"{low_key} {out[low_key]} leaves no number below {high_key} {out[high_key]}")
    unit = decimal.Decimal(10) ** BOUNDED_NUMBER_DECIMALS
    with decimal.localcontext() as ctx:
        ctx.prec = 400  # exact for any float's decimal expansion times 10^6
        first, last = (low * unit).to_integral_value(decimal.ROUND_CEILING), \
            (high * unit).to_integral_value(decimal.ROUND_FLOOR)
        if open_low and first == low * unit:
            first += 1
        if open_high and last == high * unit:
            last -= 1
    if first > last:
        raise _refuse(low_key, where, f"xgrammar writes a bounded number with at most {BOUNDED_NUMBER_DECIMALS} "
                                      f"decimals and no exponent, and none lies between {low_key} {out[low_key]} "
                                      f"and {high_key} {out[high_key]}; widen the range or change the unit")


def integer_bounds(out: dict[str, Any], where: str) -> None:
    """A ``type: integer`` schema's bounds as the integers they allow, in place: ``minimum: 1.5`` is
    ``minimum: 2``, ``exclusiveMaximum: 2.5`` is ``maximum: 2`` (xgrammar refused fractional bounds on integers
    with its own message).

    Raises:
        SchemaError: a bound outside the 64-bit integers, which xgrammar cannot take.
    """
    import math

    types = _types(out)
    if types is None or "integer" not in types or "number" in types:  # the bounds bind integers alone
        return
    for key, down in (("minimum", False), ("exclusiveMinimum", False), ("maximum", True), ("exclusiveMaximum", True)):
        value = out.get(key)
        if not _is_number(value) or not math.isfinite(value):
            continue
        if not -(2.0**63) <= value <= 2.0**63:  # xgrammar's limits: INT64_MIN and INT64_MAX as doubles
            raise _refuse(key, where, f"{key} {value} is outside the 64-bit integers, the integer bounds xgrammar "
                                      "takes")
        if float(value).is_integer():
            out[key] = int(value)
            continue
        del out[key]
        plain = "maximum" if down else "minimum"
        bound = math.floor(value) if down else math.ceil(value)
        if plain in out and _is_number(out[plain]):  # both forms given: the tighter one
            bound = min(bound, out[plain]) if down else max(bound, out[plain])
        out[plain] = int(bound)


def finite_property_names(out: dict[str, Any], where: str, defs: dict[str, Any] | None = None) -> None:
    """``propertyNames`` with an ``enum`` or ``const`` of names (the keys a finite list; inline or a ``$ref`` into
    ``defs``, the hoisted definitions): rewritten into
    ``properties``, one per name (its own schema, else the ``additionalProperties`` one), closed. xgrammar
    enforced the names but not their uniqueness: ``{"propertyNames": {"enum": ["x", "y"]},
    "additionalProperties": {...}, "minProperties": 2}`` gave ``{"x":1,"x":1,...}``.

    Raises:
        _Unsatisfiable: a required name is not among them.
    """
    names = out["propertyNames"]
    ref = names.get("$ref") if isinstance(names, dict) and len(names) == 1 else None
    if isinstance(ref, str) and ref.startswith("#/$defs/") and defs is not None:
        names = defs.get(ref.removeprefix("#/$defs/"))  # pydantic's Dict[SomeEnum, V]: the enum is a $def
    if (not isinstance(names, dict) or not ({"enum", "const"} & set(names)) or "patternProperties" in out
            or not set(names) <= {"enum", "const", "type"}):
        return
    listed = names["enum"] if "enum" in names else [names["const"]]
    keys = list(dict.fromkeys(v for v in listed if isinstance(v, str)))
    props, extra = out.get("properties") or {}, out.get("additionalProperties", True)
    if any(r not in keys for r in out.get("required") or ()):
        raise _Unsatisfiable("propertyNames", where)
    out["properties"] = {k: props[k] if k in props else ({} if extra is True else extra)
                         for k in keys if k in props or extra is not False}
    out["additionalProperties"] = False
    del out["propertyNames"]


_FORMAT_WIDTHS = {"date": (10, 10), "uuid": (36, 36), "ipv4": (7, 15)}
#: The formats next to which xgrammar 0.2.9 ignores a ``pattern`` (it enforces the format alone), measured with
#: ``{"type": "string", "format": f, "pattern": "^zzz$"}`` accepting ``"zzz"`` or not. Next to other formats
#: (``password``, ``hostname``...) it enforces the pattern.
PATTERN_IGNORING_FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "ipv4", "ipv6", "uri", "uuid",
                                      "json-pointer", "relative-json-pointer"})


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


def check_string_keywords(out: dict[str, Any], where: str) -> None:
    """A pattern or a format next to keywords xgrammar ignores there: ``pattern`` next to ``format`` is refused;
    ``minLength`` / ``maxLength`` next to either are dropped where the pattern or format bounds the length
    within them anyway, refused otherwise.

    Raises:
        SchemaError: naming the keyword xgrammar would ignore.
    """
    if "pattern" in out and out.get("format") in PATTERN_IGNORING_FORMATS:
        raise _refuse("pattern", where, f"xgrammar ignores a pattern next to format {out['format']!r}; write the "
                                        "format into the pattern, or drop one of them")
    if not ("minLength" in out or "maxLength" in out) or not ("pattern" in out or "format" in out):
        return
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


def check_multiple_of(out: dict[str, Any], where: str) -> None:
    """multipleOf as xgrammar enforces it: a positive integer divisor on type 'integer' (a float that is a
    whole number becomes an int in ``out``).

    Raises:
        SchemaError: any other form.
    """
    m = out["multipleOf"]
    if isinstance(m, float) and m.is_integer():
        m = out["multipleOf"] = int(m)
    if isinstance(m, bool) or not isinstance(m, int) or m <= 0 or _types(out) != {"integer"}:
        raise _refuse("multipleOf", where, "xgrammar enforces it on integers only (type 'integer' and a "
                                           "positive integer divisor)")

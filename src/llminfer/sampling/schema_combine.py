"""Combining normalized JSON Schemas, for the applicators xgrammar does not enforce as written: ``allOf``
merged into one schema (:meth:`SchemaCombiner.merge`), and ``oneOf`` proved disjoint
(:meth:`SchemaCombiner.disjoint`) so that it can become ``anyOf``. A mixin of the normalizer in
:mod:`llminfer.sampling.schema`, whose references (``resolve``, ``defs``) and keyword rewrites
(``_values``, ``_objects``, ``_distribute``) it uses.
"""

from __future__ import annotations

import math
from typing import Any

from llminfer.sampling.schema_keywords import _key, _refuse, _types, _Unsatisfiable

MAX_INLINE = 32  # nested $ref-with-siblings / allOf-with-$ref resolutions before giving up


class SchemaCombiner:
    """``allOf`` merging and ``oneOf`` disjointness over normalized schemas (see the module docstring)."""

    defs: dict[str, Any]  #: the normalizer's hoisted $defs

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

    def disjoint(self, branches: list[Any], where: str) -> bool:
        """No value can match two of ``branches`` (by their types, their const / enum values, or a required
        discriminator property with distinct values): then ``oneOf`` means ``anyOf``. False when unproven."""
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

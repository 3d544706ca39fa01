"""Ranges of settings, said once: as `msgspec.Meta` constraints on the struct's fields.

A knob's range is its annotation (`Annotated[int, Meta(ge=0, le=5)]`); msgspec checks it
when the struct is decoded, and this module turns msgspec's "Expected `int` <= 5" (which
names only the bound that failed) into the whole range, read back from the same
annotation, so that an error says key, value and range without a second copy of them.
Used by the pipeline config (`pipeline.config.errors`) and the replay workloads.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
import msgspec.inspect as mi


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else f"{x:,}".replace(",", "_") if abs(x) >= 10**6 else str(x)


def describe(t: mi.Type) -> str | None:
    """'in [0, 5]', '>= 1', 'at most 16 items' ... for a constrained type; None if unconstrained."""
    if isinstance(t, mi.UnionType):  # `X | None`: the range is X's
        parts = [d for d in (describe(u) for u in t.types) if d]
        return parts[0] if parts else None
    if isinstance(t, mi.IntType | mi.FloatType):
        lo = ("[", t.ge) if t.ge is not None else ("(", t.gt) if t.gt is not None else None
        hi = ("]", t.le) if t.le is not None else (")", t.lt) if t.lt is not None else None
        if lo and hi:
            return f"in {lo[0]}{_num(lo[1])}, {_num(hi[1])}{hi[0]}"
        if lo:
            return f"{'>=' if lo[0] == '[' else '>'} {_num(lo[1])}"
        if hi:
            return f"{'<=' if hi[0] == ']' else '<'} {_num(hi[1])}"
        return None
    if isinstance(t, mi.StrType) and t.max_length is not None:
        return f"of at most {t.max_length} characters"
    if isinstance(t, mi.VarTupleType | mi.ListType) and t.max_length is not None:
        return f"of at most {t.max_length} items"
    return None


def type_at(root: type, key: tuple[str, ...]) -> mi.Type | None:
    """The msgspec type of the field at a dotted key (list indices as digit strings)."""
    t: mi.Type = mi.type_info(root)
    for part in key:
        while isinstance(t, mi.UnionType):  # step into the union's struct/collection member
            inner = [u for u in t.types if not isinstance(u, mi.NoneType)]
            if len(inner) != 1:
                return None
            t = inner[0]
        if isinstance(t, mi.StructType):
            fields = {f.name: f.type for f in t.fields}
            if part not in fields:
                return None
            t = fields[part]
        elif isinstance(t, mi.VarTupleType | mi.ListType) and part.isdigit():
            t = t.item_type
        elif isinstance(t, mi.TupleType) and part.isdigit() and int(part) < len(t.item_types):
            t = t.item_types[int(part)]
        else:
            return None
    return t


def range_at(root: type, key: tuple[str, ...]) -> str | None:
    t = type_at(root, key)
    return describe(t) if t is not None else None


_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


def convert_bounded(raw: dict[str, Any], tp: type, what: str) -> Any:
    """`msgspec.convert(raw, tp)`, a failure as one ValueError naming the key and range."""
    try:
        return msgspec.convert(raw, type=tp, strict=True)
    except msgspec.ValidationError as e:
        m = _AT.match(str(e))
        assert m is not None  # the pattern matches any string
        key = tuple(p for p in re.split(r"\.|\[(\d+)\]", m.group("path") or "") if p)
        where = ".".join(key) or "value"
        value = raw.get(key[0]) if len(key) == 1 else None
        rng = range_at(tp, key)
        if rng is not None and value is not None:
            raise ValueError(f"{what}: {where} must be {rng}, got {value!r}") from None
        raise ValueError(f"{what}: {where}: {m.group('msg')}") from None

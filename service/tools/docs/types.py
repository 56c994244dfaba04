"""A msgspec type as a reader writes it (`int ≥ 1`, `list[str]`, `"landed" | "direct"`), from
`msgspec.inspect`: the constraints a type alias carries (`Positive`) are spelled out."""

from __future__ import annotations

from typing import Any

import msgspec.inspect as mi

_NAMES: dict[type[mi.Type], str] = {
    mi.AnyType: "any",
    mi.NoneType: "null",
    mi.BoolType: "bool",
    mi.IntType: "int",
    mi.FloatType: "float",
    mi.StrType: "str",
    mi.BytesType: "bytes",
}
_BOUNDS = (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"), ("min_length", "length ≥"))


def type_name(t: mi.Type) -> str:
    match t:
        case mi.UnionType():
            return " | ".join(type_name(u) for u in t.types)
        case mi.LiteralType():
            return " | ".join(_literal(v) for v in t.values)
        case mi.ListType() | mi.SetType() | mi.FrozenSetType() | mi.VarTupleType():
            return f"list[{type_name(t.item_type)}]"
        case mi.DictType():
            return f"dict[{type_name(t.key_type)}, {type_name(t.value_type)}]"
        case mi.StructType():
            return t.cls.__name__
        case mi.Metadata():
            return type_name(t.type)
    name = _NAMES.get(type(t), type(t).__name__.removesuffix("Type").lower())
    bounds = [
        f"{sign} {getattr(t, key)}" for key, sign in _BOUNDS if getattr(t, key, None) is not None
    ]
    return f"{name} ({', '.join(bounds)})" if bounds else name


def _literal(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)

"""docs/reference/config.md: every key of `kvhandoff.service.config.Config`, its type, default,
environment variable and the comment that documents it, walked from the Structs themselves."""

from __future__ import annotations

from typing import Any

import msgspec
import msgspec.inspect as mi

from kvhandoff.service.config import DEFAULT_BACKEND, ENV_PREFIX, Config
from kvhandoff.service.tools.docs.fields import field_comments, own_doc
from kvhandoff.service.tools.docs.types import type_name

_INTRO = f"""# Configuration keys

Generated from `service/config.py` (and `transport/` for the Mooncake keys) by
`python -m kvhandoff.service.tools.docs`; do not edit by hand. How the file, the environment and the
command line combine: [Configuration](../operations/configuration.md).

A key is set in the TOML file under its section, or by the environment variable
`{ENV_PREFIX}<SECTION>__<KEY>` (a value starting with `[` or `{{` is read as JSON, which is how a
list or a table such as `stages` is given there).
"""


def config_page() -> str:
    out = [_INTRO]
    top = _struct(Config)
    plain = [f for f in top.fields if not (_section(f.type) or _variants(f.type))]
    out += _table("Top level", Config, plain, [])
    for f in top.fields:
        out += _sections(f, [])
    return "\n".join(out).rstrip() + "\n"


def _struct(cls: type) -> mi.StructType:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return info


def _section(t: mi.Type) -> mi.StructType | None:
    """The Struct a field opens as a section (`X`, `X | None`, or `list[X]`), else None."""
    if isinstance(t, mi.UnionType):
        structs = [u for u in t.types if not isinstance(u, mi.NoneType)]
        t = structs[0] if len(structs) == 1 else t
    if isinstance(t, mi.ListType):
        t = t.item_type
    return t if isinstance(t, mi.StructType) else None


def _variants(t: mi.Type) -> list[mi.StructType]:
    """The members of a tagged union of Structs (`transport`: one per backend), else []."""
    if not isinstance(t, mi.UnionType):
        return []
    members = [u for u in t.types if isinstance(u, mi.StructType) and u.tag_field is not None]
    return members if len(members) == len(t.types) > 1 else []


def _tagged_sections(f: mi.Field, variants: list[mi.StructType]) -> list[str]:
    """One table per member, each headed by the tag value that selects it."""
    tag_field = variants[0].tag_field
    tags = ", ".join(f"`{v.tag}`" for v in variants)
    out = [
        f"## `[{f.name}]`",
        "",
        f"One table per `{tag_field}` ({tags}); without `{tag_field}` the section is read as "
        f"`{tag_field} = {msgspec.json.encode(DEFAULT_BACKEND).decode()}`. A key of another "
        f"{tag_field} is refused, naming the {tag_field} it was read for.",
        "",
    ]
    env = f"`{ENV_PREFIX}{f.name.upper()}__{str(tag_field).upper()}`"
    for v in variants:
        tag = msgspec.json.encode(v.tag).decode()
        heading = f"### `[{f.name}]` {tag_field} = `{tag}`"
        table = _table(f.name, v.cls, list(v.fields), [f.name], heading=heading)
        default = "`" + tag + "`" if v.tag == DEFAULT_BACKEND else "required"
        row = f"| `{tag_field}` | `{tag}` | {default} | {env} | selects this table |"
        at = table.index("|---|---|---|---|---|") + 1
        out += [*table[:at], row, *table[at:]]
    return out


def _sections(f: mi.Field, path: list[str]) -> list[str]:
    variants = _variants(f.type)
    if variants and not path:
        return _tagged_sections(f, variants)
    inner = _section(f.type)
    if inner is None:
        return []
    here = [*path, f.name]
    keys = [g for g in inner.fields if not _section(g.type)]
    out = _table(".".join(here), inner.cls, keys, here, many=isinstance(f.type, mi.ListType))
    for g in inner.fields:
        out += _sections(g, here)
    return out


def _table(
    title: str,
    cls: type,
    keys: list[mi.Field],
    path: list[str],
    *,
    many: bool = False,
    heading: str = "",
) -> list[str]:
    header = f"[[{title}]]" if many else (f"[{title}]" if path else title)
    out = [heading or (f"## `{header}`" if path else f"## {header}"), ""]
    if doc := own_doc(cls):
        out += [doc, ""]
    if many:
        out += [
            f"A list of tables; from the environment, `{ENV_PREFIX}{path[0].upper()}` as JSON.",
            "",
        ]
    out += ["| key | type | default | environment | |", "|---|---|---|---|---|"]
    comments = field_comments(cls)
    for f in keys:
        env = "" if many else f"`{ENV_PREFIX}{'__'.join(p.upper() for p in [*path, f.name])}`"
        text = comments.get(f.name, "").replace("|", "\\|")
        out.append(f"| `{f.name}` | {_cell(type_name(f.type))} | {_default(f)} | {env} | {text} |")
    return [*out, ""]


def _default(f: mi.Field) -> str:
    if f.required:
        return "required"
    value: Any = f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
    return _cell(msgspec.json.encode(value).decode())


def _cell(text: str) -> str:
    return f"`{text}`"

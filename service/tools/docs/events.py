"""docs/reference/events.md: every member of the event union (`kvhandoff.pipelines.events.Event`),
its `type` tag, what it says and its fields, from the Structs themselves."""

from __future__ import annotations

import typing

import msgspec.inspect as mi

from kvhandoff.pipelines.events import EVENT_SCHEMA_VERSION, Event
from kvhandoff.service.tools.docs.fields import field_comments, own_doc
from kvhandoff.service.tools.docs.types import type_name


def events_page() -> str:
    members = typing.get_args(Event)
    base = members[0].__mro__[1]  # the fields every event carries are its base's
    common = _fields(base)
    common_names = {f.name for f in common}
    out = [
        "# Event types",
        "",
        "Generated from `pipelines/events.py` by `python -m kvhandoff.service.tools.docs`; do not "
        "edit by hand. The same events feed the logs, a handoff's timeline, the SSE stream, "
        "webhooks and metrics: [Events](../operations/events.md) says how to read them.",
        "",
        f"Event schema version: **{EVENT_SCHEMA_VERSION}** (carried in SSE and webhook payloads; "
        "bumped when an event's fields change incompatibly).",
        "",
        "## Fields of every event",
        "",
        *_table(base, common),
    ]
    for cls in members:
        info = mi.type_info(cls)
        assert isinstance(info, mi.StructType)
        out += [f"## `{info.tag}`", "", f"`{cls.__name__}`", ""]
        if doc := own_doc(cls):
            out += [doc, ""]
        own = [f for f in _fields(cls) if f.name not in common_names]
        out += _table(cls, own) if own else ["No fields beyond those of every event.", ""]
    return "\n".join(out).rstrip() + "\n"


def _fields(cls: type) -> list[mi.Field]:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return list(info.fields)


def _table(cls: type, fields: list[mi.Field]) -> list[str]:
    comments = field_comments(cls)
    out = ["| field | type | |", "|---|---|---|"]
    for f in fields:
        text = comments.get(f.name, "").replace("|", "\\|")
        optional = "" if f.required else " (optional)"
        out.append(f"| `{f.name}` | `{type_name(f.type)}`{optional} | {text} |")
    return [*out, ""]

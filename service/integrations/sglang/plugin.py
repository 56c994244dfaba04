"""The SGLang plugin: makes `kvhandoff` a transfer backend SGLang can select.

Called by SGLang's `load_plugins()` (entry point group `sglang.srt.plugins`) in every SGLang
process, before any backend lookup. SGLang's backend selection is closed (an Enum and an if/elif
in `get_kv_class`), so `register`:

1. adds `kvhandoff` to the CLI choices (`add_disagg_transfer_backend_choices`);
2. adds a `TransferBackend.KVHANDOFF` member (Python 3.11's Enum has no public way to grow);
3. wraps `get_kv_class` with an AROUND hook: for KVHANDOFF it answers our classes, for any other
   backend it calls the original (Mooncake and the rest resolve as before).

The classes are imported lazily, at lookup, so loading the plugin costs nothing in a process that
never uses this backend.
"""

from __future__ import annotations

import importlib
from enum import Enum
from typing import Any

BACKEND = "kvhandoff"
MEMBER = "KVHANDOFF"
TARGET = "sglang.srt.disaggregation.utils.get_kv_class"

#: KVClassType member name -> "module:class" of ours (KVARGS stays SGLang's shared container).
CLASSES = {
    "MANAGER": "kvhandoff.service.integrations.sglang.manager:KVHandoffManager",
    "SENDER": "kvhandoff.service.integrations.sglang.sender:KVHandoffSender",
    "RECEIVER": "kvhandoff.service.integrations.sglang.receiver:KVHandoffReceiver",
    "BOOTSTRAP_SERVER": "kvhandoff.service.integrations.sglang.bootstrap:KVHandoffBootstrapServer",
}


def register() -> None:
    """The entry point: idempotent, as SGLang may load plugins more than once per process."""
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    add_enum_member(TransferBackend, MEMBER, BACKEND)
    registered = HookRegistry._hooks.get(TARGET, [])
    if not any(hook is around_get_kv_class for _, hook, _ in registered):
        HookRegistry.register(TARGET, around_get_kv_class, HookType.AROUND)


def around_get_kv_class(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    """`get_kv_class` with our backend: our class for KVHANDOFF, SGLang's for the rest."""
    if getattr(transfer_backend, "value", transfer_backend) != BACKEND:
        return original(transfer_backend, class_type)
    name = getattr(class_type, "name", None)
    if name == "KVARGS":
        return original(transfer_backend, class_type)  # every backend shares SGLang's KVArgs
    if name not in CLASSES:
        raise ValueError(f"the kvhandoff backend has no {class_type!r} class")
    module, _, attr = CLASSES[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def add_enum_member(enum_cls: type[Enum], name: str, value: str) -> Enum:
    """Add `name = value` to an existing Enum (lookup by name, by value, iteration); returns the
    member, the existing one when it is there already."""
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = object.__new__(enum_cls)
    member._name_ = name
    member._value_ = value
    # Enum's own __setattr__ refuses to rebind members; the member is not one yet.
    type.__setattr__(enum_cls, name, member)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    return member

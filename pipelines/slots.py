"""A request's indices beside its pages: one slot per state component and its aux row.

Called wherever a handoff's source or destination is checked, planned, packed, fenced or
digested. A state entry belongs to a **component** (`StateEntry.component`: the tensors that
share one index per request, e.g. a Mamba layer's conv and temporal state); an aux entry
(`AuxEntry`: per-request metadata rows, from the last PP stage only) is indexed by the
request's **aux row**. `slot` is the index of every component `by_component` does not name, so
the single-slot form of earlier callers (`dst_slot = 3`) keeps its meaning for a layout of one
component. Field names follow the API: `<side>_slot`, `<side>_slots.<component>`,
`<side>_aux`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

#: The index space of aux rows among a pairing's slot rows (state rows name their component).
AUX = None
Space = str | None


@dataclass(frozen=True, slots=True)
class RequestSlots:
    """One side's per-request indices: `slot` for every component `by_component` leaves out."""

    slot: int | None = None
    by_component: Mapping[str, int] = field(default_factory=dict)
    aux: int | None = None

    def of(self, space: Space) -> int | None:
        """The index of a component, or of the aux row (`AUX`)."""
        if space is AUX:
            return self.aux
        return self.by_component.get(space, self.slot)

    def field_of(self, space: Space, prefix: str) -> str:
        """The request field that gives `space`'s index, for errors: `dst_slots.mamba`."""
        if space is AUX:
            return f"{prefix}_aux"
        return f"{prefix}_slots.{space}" if space in self.by_component else f"{prefix}_slot"

    @property
    def empty(self) -> bool:
        return self.slot is None and not self.by_component and self.aux is None


NO_SLOTS = RequestSlots()
#: What planning and packing accept: the single-slot form (an int, or None) of earlier callers.
SlotsLike = RequestSlots | int | None


def as_slots(value: SlotsLike) -> RequestSlots:
    """`value` as RequestSlots: an int is the slot of every component."""
    if isinstance(value, RequestSlots):
        return value
    return NO_SLOTS if value is None else RequestSlots(slot=int(value))


def space_name(space: Space) -> str:
    """How errors name an index space: `component 'mamba'` or `the aux row`."""
    return "the aux row" if space is AUX else f"component {space!r}"

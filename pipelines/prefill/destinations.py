"""What a destination says of its decode, checked: the prefill's one place to trust it.

Since v8 a destination carries its decode's layout, arena and transport target instead of a
fingerprint to look them up by, so the prefill asks the decode for nothing. Called by
`PrefillPipeline.deliver` (`check_destination` before the destination is accepted: a malformed
one is refused naming its field, and nothing changes; `DecodeLives.pin` once it is) and by its
handoff task (`DecodeLives.side`, `check_decode_side`, before any write). A decode life is held
to what its first accepted destination named: a later destination of that life naming another
target, arena, mode or layout fails its handoff naming the field, and nothing is written. The
pages are validated here once, against the layout the destination carries (the decode validated
them against its own at create): the stages do not validate the destination again.

A destination's layout arrives as JSON bytes (`DestinationMsg.decode_layout`) and is decoded
once per decode life: a later destination whose bytes equal those its life pinned uses the
pinned, already validated layout (for a real model, hundreds of entries a prefill would
otherwise decode and compare per handoff, on every stage's process). Equal bytes are equal
content, so that shortcut accepts nothing a decode would refuse; a layout with equal content but
other bytes (key order, spacing, another encoder) misses it and is decoded, validated and
compared by content as any other: a byte difference costs a decode, never an acceptance.
"""

from __future__ import annotations

from collections.abc import Collection

import msgspec

from kvhandoff.pipelines.errors import ConflictError, InvalidInput, LayoutError, NotFoundError
from kvhandoff.pipelines.layout import StageLayout
from kvhandoff.pipelines.messages import DestinationMsg, TransferMode, decode_error_field
from kvhandoff.pipelines.peercache import MAX_PEERS, PeerCache
from kvhandoff.pipelines.planning import validate_pages_for_layout
from kvhandoff.pipelines.prefill.handoff import DecodeSide
from kvhandoff.pipelines.prefill.staged import check_grant
from kvhandoff.pipelines.urls import canonical_url


def check_addressed(
    dest: DestinationMsg, incarnation: str, mode: TransferMode, hosted: Collection[int]
) -> None:
    """Refuse a destination issued for another life of this prefill, naming the other transfer
    mode than the one it serves, or a stage it does not host."""
    if dest.prefill_incarnation != incarnation:
        raise ConflictError(
            f"the destination of {dest.handoff_id!r} was issued for prefill incarnation "
            f"{dest.prefill_incarnation}, this is {incarnation} (did it restart?)",
            field="prefill_incarnation",
        )
    if dest.mode != mode:
        raise ConflictError(
            f"the destination of {dest.handoff_id!r} asks for {dest.mode} transfers; this "
            f"prefill serves {mode} mode only (transfer.mode, set on both sides)",
            field="mode",
        )
    missing = [r for r in dest.pp_ranks if r not in hosted]
    if missing:
        raise NotFoundError(
            f"stage {missing[0]} is not hosted here (hosted: {sorted(hosted)})",
            field="pp_ranks",
            pp_rank=missing[0],
        )


def check_destination(dest: DestinationMsg, layout: StageLayout) -> None:
    """Refuse, naming the field, a destination whose decode side contradicts its mode (an arena
    on a direct decode, none or page addresses on a landed one) or whose pages or slots lie
    outside the layout it carries. `layout` is that layout (`DecodeLives.layout`: the same
    content, perhaps an earlier destination's object whose bounds are computed already)."""
    if dest.mode == "landed":
        if dest.arena is None:
            raise InvalidInput(
                f"the landed destination of {dest.handoff_id!r} names no landing arena",
                field="arena",
            )
        if layout.has_addresses:
            raise InvalidInput(
                f"the landed destination of {dest.handoff_id!r} names page addresses: a landed "
                "decode publishes none (every base is 0)",
                field="decode_layout",
            )
    elif dest.arena is not None or dest.grants:
        raise InvalidInput(
            f"the direct destination of {dest.handoff_id!r} names a landing arena or windows",
            field="arena" if dest.arena is not None else "grants",
        )
    validate_pages_for_layout(layout, dest.dst_pages, dest.slots, side="destination", unique=True)


class DecodeLives:
    """The decode side each decode life named in its first accepted destination, with the bytes
    its layout came as (bounded)."""

    def __init__(self, maxsize: int = MAX_PEERS) -> None:
        self._sides: PeerCache[tuple[DecodeSide, msgspec.Raw]] = PeerCache(maxsize)

    def pin(self, dest: DestinationMsg, layout: StageLayout) -> None:
        """Hold `dest`'s decode life to what `dest` names, `layout` being its layout decoded
        (`layout(dest)`), unless an earlier destination named it (call once `dest`, checked by
        `check_destination`, is accepted)."""
        key = _life(dest)
        if self._sides.get(key) is None:
            # A copy: the received bytes are a view of the whole request body.
            self._sides.put(key, (_side_of(dest, layout), dest.decode_layout.copy()))

    def layout(self, dest: DestinationMsg) -> StageLayout:
        """The layout `dest` carries: the object its decode life pinned when the bytes are
        those it pinned (a decode's layout is fixed for its life, so this is every destination
        of a known life), without decoding them; otherwise decoded and validated afresh
        (raising InvalidInput naming `decode_layout`), and checked as itself (a different
        layout is later refused by `check_decode_side`)."""
        pinned = self._sides.get(_life(dest))
        if pinned is not None and pinned[1] == dest.decode_layout:
            return pinned[0].layout
        return decoded_layout(dest)

    def side(self, dest: DestinationMsg) -> DecodeSide:
        """What `dest`'s decode life named first (as `dest` says, if that life was forgotten)."""
        pinned = self._sides.get(_life(dest))
        return pinned[0] if pinned is not None else _side_of(dest, decoded_layout(dest))


_layout_decoder = msgspec.json.Decoder(StageLayout)


def decoded_layout(dest: DestinationMsg) -> StageLayout:
    """`dest.decode_layout` decoded and validated as a StageLayout, or InvalidInput naming the
    field within it (`decode_layout.kv[0].num_items`; `decode_layout` for the whole)."""
    try:
        return _layout_decoder.decode(dest.decode_layout)
    except msgspec.DecodeError as exc:  # also ValidationError
        within, why = decode_error_field(exc), str(exc)
    except LayoutError as exc:  # StageLayout.__post_init__: inconsistent in itself
        within, why = str(exc.context.get("field") or "$"), str(exc)
    raise InvalidInput(
        f"the destination of {dest.handoff_id!r} carries an invalid decode_layout: {why}",
        field="decode_layout" if within == "$" else f"decode_layout.{within}",
    )


def check_decode_side(dest: DestinationMsg, side: DecodeSide, layout: StageLayout) -> None:
    """A destination must name the transport target, mode, layout and arena its decode life
    named, and in landed mode grant only windows inside that arena: otherwise a destination
    could make this prefill write into any memory of the decode's, or another endpoint's (which
    may hold memory at the same addresses). `layout` is the one it carries
    (`DecodeLives.layout`: the pinned object itself when its bytes are the pinned ones). Raises
    naming the field."""
    if dest.decode_target != side.target:
        raise ConflictError(
            f"the destination of {dest.handoff_id!r} names transport target "
            f"{dest.decode_target!r}, but its decode named {side.target!r}",
            field="decode_target",
        )
    if dest.mode != side.mode:
        raise ConflictError(
            f"the destination of {dest.handoff_id!r} names {dest.mode} mode, but its decode "
            f"serves {side.mode} mode",
            field="mode",
        )
    if layout is not side.layout and layout != side.layout:
        raise ConflictError(
            f"the destination of {dest.handoff_id!r} names another layout than its decode life did",
            field="decode_layout",
        )
    if dest.arena != side.arena:
        raise ConflictError(
            f"the destination of {dest.handoff_id!r} names another landing arena than its "
            "decode life did",
            field="arena",
        )
    if side.arena is None:
        return
    for grant in dest.grants:
        if grant.pp_rank not in dest.pp_ranks:
            raise ConflictError(
                f"grant {grant.grant_id} is for stage {grant.pp_rank}, which the destination "
                f"does not name (pp_ranks {dest.pp_ranks})",
                field="grants",
            )
        check_grant(grant, side.arena, grant.pp_rank)


def _life(dest: DestinationMsg) -> str:
    return f"{canonical_url(dest.decode_url)}|{dest.decode_incarnation}"


def _side_of(dest: DestinationMsg, layout: StageLayout) -> DecodeSide:
    return DecodeSide(layout, dest.mode, dest.arena, dest.decode_target)

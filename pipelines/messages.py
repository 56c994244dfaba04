"""The peer wire format: messages prefill and decode services exchange, named for their direction.

Each message carries `version` (PEER_PROTOCOL_VERSION); a receiver rejects a major version it does
not speak instead of guessing. Change history:

- v1: layout exchange, destination delivery, arrival and failure notices, abort, heartbeat.
- v2: incarnations (`LayoutInfo.incarnation`; every message names its sender's incarnation and,
  where it has one, the addressee's; a message for another incarnation is refused); a
  destination's deadline travels as a remaining duration (`deadline_in_s`, measured on receipt)
  instead of a wall-clock instant; each prefill declares `max_call_s`, the longest one of its
  engine calls can still write (in its layout, arrivals, failures and abort acks), which bounds
  the decode's grace; arrivals and failures name their sender (`sender_url`); heartbeat acks
  carry the receiver's incarnation and live handoff ids, so each side fails at once a handoff its
  peer no longer has.
- v3: landed transfers. A destination names its `mode`: `direct` (the prefill writes into the
  decode's KV pages, as before) or `landed` (it writes only into windows of the decode's landing
  arena, granted as credits: `Grant`, first with the destination, then with each `SegmentAck`
  or on a `WindowRequest`); each segment's notice (`SegmentMsg`) names its window, its pieces,
  its byte count and the digest (`digest`) of its packed bytes, and the last one is the stage's
  arrival; the decode commits a segment into its pages only once the digest matches.
- v4: messages are bound to both ends over HTTP (`service/http/peer_signing.py`): a signed request
  names its recipient (URL, and incarnation once known), which refuses one meant for another
  service or life; every answer to a signed request is signed by its responder, bound to the
  request's nonce, and checked by the caller before any field of it (a layout's incarnation, an
  abort ack, a heartbeat's live list) is used; peer calls never follow redirects. The bodies
  are unchanged.
- v5: segment notices travel in batches, as arrivals do: `POST /v1/peer/segments` takes a list
  and answers one outcome per notice (its `SegmentAck`, or a problem); a prefill batches the
  small notices queued for one decode while a request to it is in flight. A destination
  carries a slot per state component (`dst_slots`, beside `dst_slot`, the slot of every
  component it leaves out) and the request's aux row (`dst_aux`); layouts carry aux entries
  (`StageLayout.aux`) and each state entry's component. Segment pieces and arrival digests
  cover the aux rows (`aux:<i>`) after the state slots.
- v6: a destination may skip a prefix (`prefix_pages`): the decode holds the request's first
  pages already (a prefix it cached), its `dst_pages` are for the positions after them, and the
  prefill sends those only. A v5 prefill would send every page into the wrong positions, so
  the version changes. A destination says how many decode handoffs take the same bytes from
  the same stages (`fan_out`), for the prefill's engine to keep its pages until all have them.
- v7: only the arena is reachable. A layout names the one transfer mode its service serves
  (`LayoutInfo.mode`) and, on a landed decode, its landing arena (`arena`), where a prefill
  checks every grant lies; its stage layouts carry addresses only on a direct decode (elsewhere
  every base is 0, and `decode_address_key` is that of the unplaced layout). A prefill refuses a
  destination naming another mode than its own. Every integer on the wire is at most 2**63 - 1
  (`MAX_WIRE_INT`): a larger one is refused naming its field, item by item in a batch. A
  segment's digest is seeded with its decode life, handoff, stage, grant and pieces
  (`kvhandoff.pipelines.digest.segment_seed`), and device arenas digest with the non-linear `mix64`
  instead of the linear `wsum64`.
- v8: a destination carries its decode's layout (`decode_layout`: placed on a direct decode,
  every base 0 on a landed one) and, landed, its arena (`arena`), in place of the layout's
  fingerprint and address key: a prefill no longer asks the decode for its layout
  (`GET /v1/layout` is now decode → prefill only). The prefill validates what the destination
  carries on receipt (mode, placement, arena, the pages against the layout) and holds each
  decode life to the target, arena and layout its first destination named.
  Its receiver keeps `decode_layout` as the JSON bytes that came (`msgspec.Raw`) and decodes
  them only when they differ from the bytes its decode life pinned: the wire is unchanged.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Raw, Struct

from kvhandoff.pipelines.layout import MAX_WIRE_INT, NonNeg, Positive, StageLayout
from kvhandoff.pipelines.slots import RequestSlots

PEER_PROTOCOL_VERSION = 8

#: A protocol version: bounded like every integer on the wire
#: (`kvhandoff.pipelines.layout.MAX_WIRE_INT`).
Version = NonNeg
Seconds = Annotated[float, Meta(ge=0)]
#: A random id a service draws at start: messages of an earlier (or later) life are refused.
Incarnation = Annotated[str, Meta(min_length=1, max_length=64)]
Pages = list[NonNeg]
#: A `StageLayout` as the JSON text it travels as, decoded by whoever needs the layout
#: (`kvhandoff.pipelines.prefill.destinations`): a prefill decodes a decode life's layout once
#: and compares the bytes of every later destination, not a decoded copy. The schema is
#: StageLayout's (an OpenAPI component reference: the layout routes publish that component).
LayoutJSON = Annotated[Raw, Meta(extra_json_schema={"$ref": "#/components/schemas/StageLayout"})]


class ShmPlacement(Struct, frozen=True):
    """Where a stage's entries live when its pool is a shared-memory file (KV first, then state)."""

    name: str  # file name under /dev/shm
    offsets: list[NonNeg]  # byte offset of every entry in the file
    size: NonNeg


class StageInfo(Struct, frozen=True):
    layout: StageLayout
    fingerprint: str
    shm: ShmPlacement | None = None


#: How often one segment (the same pieces of one stage) may be sent again after its window did not
#: match its digest: the one rule both sides keep (the prefill resends that often, the decode
#: fails the handoff on the next refusal of any of those pieces).
RESENDS_PER_SEGMENT = 1

TransferMode = Literal["direct", "landed"]
DigestAlgorithm = Literal["xxh3_128", "mix64"]


class ArenaSpan(Struct, frozen=True):
    """A landed decode's landing arena: the one memory it registers, where every window it
    grants lies (a prefill writes nowhere else)."""

    addr: NonNeg
    length: NonNeg


class LayoutInfo(Struct, frozen=True):
    """The answer to GET /v1/layout (a decode asks its prefills; every service answers it):
    what this process registered and how to reach it.

    Stage layouts carry their entries' addresses only on a direct-mode decode, whose prefills
    write into its pages; elsewhere every base is 0 (that memory is not registered)."""

    version: Version
    role: str
    url: str  # the service's public URL
    target: str  # the transport's target name (Mooncake: host:rpc_port)
    stages: list[StageInfo]
    incarnation: Incarnation
    # Prefill: the longest one engine call of this process can still write once started.
    max_call_s: Seconds = 0.0
    # The one transfer mode this service serves (`transfer.mode`), and on a landed decode its
    # landing arena (v7).
    mode: TransferMode = "landed"
    arena: ArenaSpan | None = None


class Grant(Struct, frozen=True, kw_only=True):
    """Decode → prefill: stage `pp_rank` may write one segment of up to `length` bytes at `addr`
    (in the decode's landing arena, on `DestinationMsg.decode_target`), once."""

    grant_id: NonNeg
    pp_rank: NonNeg
    addr: NonNeg
    length: NonNeg


def decode_error_field(exc: msgspec.DecodeError) -> str:
    """The key path msgspec's "Expected `int`, got `str` - at `$.dst_pages[3]`" names, in the
    style every other check uses (`dst_pages[3]`; `$` for the whole text); a missing or unknown
    key is named itself, not its object."""
    message, _, at = str(exc).partition(" - at `")
    path = at.rstrip("`") if at else "$"
    key = _NAMED_KEY.match(message)
    if key:
        path = f"{path}.{key['key']}"
    if path.startswith("$."):
        return path[2:]
    return path[1:] if path.startswith("$[") else path


_NAMED_KEY = re.compile(r"^Object (?:missing required|contains unknown) field `(?P<key>[^`]*)`$")


def layout_json(layout: StageLayout) -> Raw:
    """`layout` as a destination carries it (`DestinationMsg.decode_layout`)."""
    return Raw(_encode(layout))


_encode = msgspec.json.Encoder().encode


class DestinationMsg(Struct, frozen=True, kw_only=True):
    """Decode → prefill: where one handoff's bytes go. One message per prefill process."""

    version: Version = PEER_PROTOCOL_VERSION
    handoff_id: str
    decode_url: str
    decode_incarnation: Incarnation  # the decode life that leased the pages
    prefill_incarnation: Incarnation  # the prefill life the decode bound these stages to
    decode_target: str
    # The decode's layout as it publishes it: its pages' addresses on a direct decode (prefills
    # write into them), every base 0 on a landed one (v8). Its JSON bytes (`layout_json`): the
    # decode encodes it once per life, a prefill decodes it once per decode life.
    decode_layout: LayoutJSON
    pp_ranks: list[NonNeg]  # the stages of the receiving process this handoff expects
    dst_pages: Pages
    # The request's first pages, which the decode holds already (a prefix it cached): source
    # position `prefix_pages + i` goes to `dst_pages[i]`, and the positions before are not sent
    # (v6).
    prefix_pages: NonNeg = 0
    # How many decode handoffs take these same bytes from these stages, this one included (v6).
    fan_out: Annotated[int, Meta(ge=1, le=MAX_WIRE_INT)] = 1
    dst_slot: NonNeg | None = None
    dst_slots: dict[str, NonNeg] = {}  # per state component (v5)
    dst_aux: NonNeg | None = None  # the request's aux row (v5)
    # Seconds left until the handoff's deadline when the decode sent this; the receiver adds it
    # to its own monotonic clock on receipt (transit only shortens it: no clocks to agree on).
    deadline_in_s: Seconds
    verify: bool = False
    # `landed`: write only into granted windows of the decode's landing arena (see v3).
    mode: TransferMode = "direct"
    digest: DigestAlgorithm = "xxh3_128"  # what each segment's digest is computed with
    grants: list[Grant] = []  # first windows, at most one per stage (landed mode)
    arena: ArenaSpan | None = None  # the decode's landing arena (landed mode; v8)
    window_bytes: NonNeg = 0  # the largest window the decode grants (landed mode)

    @property
    def slots(self) -> RequestSlots:
        return RequestSlots(self.dst_slot, self.dst_slots, self.dst_aux)


class ArrivalMsg(Struct, frozen=True, kw_only=True):
    """Prefill → decode: every byte of one stage has landed."""

    version: Version = PEER_PROTOCOL_VERSION
    handoff_id: str
    sender_url: str  # the prefill service that hosts the stage
    sender_incarnation: Incarnation
    decode_incarnation: Incarnation  # the addressee's life, from the destination
    max_call_s: Seconds = 0.0
    pp_rank: NonNeg
    bytes: NonNeg
    blocks: NonNeg
    # Present when verification is on: "kv:<layer>:<group>" / "state:<layer>:<kind>" /
    # "aux:<i>" -> hex digest
    digests: dict[str, str] | None = None


class StageFailedMsg(Struct, frozen=True, kw_only=True):
    """Prefill → decode: one stage failed; no write of it can still land."""

    version: Version = PEER_PROTOCOL_VERSION
    handoff_id: str
    sender_url: str
    sender_incarnation: Incarnation
    decode_incarnation: Incarnation
    max_call_s: Seconds = 0.0
    pp_rank: NonNeg
    code: str
    reason: str
    context: dict[str, Any] = {}


class AbortMsg(Struct, frozen=True, kw_only=True):
    """Decode → prefill: stop this handoff; answer only once no write can still land."""

    version: Version = PEER_PROTOCOL_VERSION
    handoff_id: str
    reason: str
    decode_incarnation: Incarnation  # an abort from another decode life is refused


class AbortAck(Struct, frozen=True, kw_only=True):
    version: Version = PEER_PROTOCOL_VERSION
    handoff_id: str
    quiesced: bool
    stages: list[NonNeg]  # the stages that were still running and were stopped
    incarnation: Incarnation  # the answering prefill's
    max_call_s: Seconds = 0.0


class HeartbeatMsg(Struct, frozen=True, kw_only=True):
    """Either direction, every heartbeat interval while the two share a live handoff."""

    version: Version = PEER_PROTOCOL_VERSION
    sender_url: str
    sender_incarnation: Incarnation
    role: str
    live: list[str] = []  # handoff ids the sender still runs with the receiver


class HeartbeatAck(Struct, frozen=True, kw_only=True):
    """The receiver's life and the handoffs it still runs with the sender: what the sender
    reconciles against (a handoff it runs that the receiver no longer has fails at once)."""

    version: Version = PEER_PROTOCOL_VERSION
    role: str
    url: str
    incarnation: Incarnation
    live: list[str] = []


class WindowRequest(Struct, frozen=True, kw_only=True):
    """Prefill → decode: stage `pp_rank` wants a window of `bytes` for its next segment."""

    version: Version = PEER_PROTOCOL_VERSION
    handoff_id: str
    sender_url: str
    sender_incarnation: Incarnation
    decode_incarnation: Incarnation
    max_call_s: Seconds = 0.0
    pp_rank: NonNeg
    bytes: Positive


class WindowAnswer(Struct, frozen=True, kw_only=True):
    """None: the arena stayed full for as long as the decode holds a request; ask again."""

    version: Version = PEER_PROTOCOL_VERSION
    grant: Grant | None = None


class SegmentMsg(Struct, frozen=True, kw_only=True):
    """Prefill → decode: one packed segment of stage `pp_rank` has landed in window `grant_id`.

    Piece i is pairing row `rows[i]` over the request's page positions `starts[i]:ends[i]`
    (`kvhandoff.pipelines.packing`); `digest` is of the `bytes` packed bytes. `last`: the stage has
    no more segments, and this notice is its arrival."""

    version: Version = PEER_PROTOCOL_VERSION
    handoff_id: str
    sender_url: str
    sender_incarnation: Incarnation
    decode_incarnation: Incarnation
    max_call_s: Seconds = 0.0
    pp_rank: NonNeg
    grant_id: NonNeg
    rows: list[NonNeg]
    starts: list[NonNeg]
    ends: list[NonNeg]
    bytes: NonNeg
    blocks: NonNeg  # transfer blocks the segment travelled in
    digest: str
    last: bool = False


class SegmentAck(Struct, frozen=True, kw_only=True):
    """Decode → prefill: the segment was committed, or (`committed` false) its window did not
    hash to its digest and it may be sent once more, into `next_grant`."""

    version: Version = PEER_PROTOCOL_VERSION
    committed: bool
    reason: str = ""
    next_grant: Grant | None = None


class Outcome(Struct, frozen=True, omit_defaults=True):
    """The receiver's answer for one notice of a batch: its status, and a problem if it failed."""

    status: int
    problem: dict[str, Any] | None = None


class SegmentOutcome(Struct, frozen=True, omit_defaults=True):
    """The decode's answer for one segment notice of a batch: its ack, or a problem."""

    status: int
    ack: SegmentAck | None = None
    problem: dict[str, Any] | None = None


def check_version(version: int) -> None:
    """Refuse a peer message of another protocol version instead of guessing at it."""
    from kvhandoff.pipelines.errors import (
        InvalidInput,  # here, so this check stays one block at the end
    )

    if version != PEER_PROTOCOL_VERSION:
        raise InvalidInput(
            f"peer protocol version {version} is not supported (this service speaks "
            f"{PEER_PROTOCOL_VERSION}); upgrade the older side",
            field="version",
        )

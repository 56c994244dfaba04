"""The peer wire format: messages prefill and decode services exchange, named for their direction.

Each message carries `version` (PEER_PROTOCOL_VERSION); a receiver rejects a major version it does
not speak instead of guessing. Change history:

- v1: layout exchange, destination delivery, arrival and failure notices, abort, heartbeat.
"""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta, Struct

from pipelines.layout import StageLayout

PEER_PROTOCOL_VERSION = 1

NonNeg = Annotated[int, Meta(ge=0)]
Pages = list[NonNeg]


class ShmPlacement(Struct, frozen=True):
    """Where a stage's entries live when its pool is a shared-memory file (KV first, then state)."""

    name: str  # file name under /dev/shm
    offsets: list[int]  # byte offset of every entry in the file
    size: int


class StageInfo(Struct, frozen=True):
    layout: StageLayout
    fingerprint: str
    shm: ShmPlacement | None = None


class LayoutInfo(Struct, frozen=True):
    """Decode/prefill → peer (GET /v1/layout): what this process registered and how to reach it."""

    version: int
    role: str
    url: str  # the service's public URL
    target: str  # the transport's target name (Mooncake: host:rpc_port)
    stages: list[StageInfo]


class DestinationMsg(Struct, frozen=True, kw_only=True):
    """Decode → prefill: where one handoff's bytes go. One message per prefill process."""

    version: int = PEER_PROTOCOL_VERSION
    handoff_id: str
    decode_url: str
    decode_target: str
    decode_fingerprint: str
    # With the fingerprint, identifies the registered decode memory: a decode process restarted
    # with the same configuration has the same fingerprint but new addresses.
    decode_address_key: str
    pp_ranks: list[NonNeg]  # the stages of the receiving process this handoff expects
    dst_pages: Pages
    dst_slot: NonNeg | None = None
    deadline_at: float  # unix seconds
    verify: bool = False


class ArrivalMsg(Struct, frozen=True, kw_only=True):
    """Prefill → decode: every byte of one stage has landed."""

    version: int = PEER_PROTOCOL_VERSION
    handoff_id: str
    pp_rank: NonNeg
    bytes: NonNeg
    blocks: NonNeg
    # Present when verification is on: "kv:<layer>:<group>" / "state:<layer>:<kind>" -> hex digest
    digests: dict[str, str] | None = None


class StageFailedMsg(Struct, frozen=True, kw_only=True):
    """Prefill → decode: one stage failed; no write of it can still land."""

    version: int = PEER_PROTOCOL_VERSION
    handoff_id: str
    pp_rank: NonNeg
    code: str
    reason: str
    context: dict[str, Any] = {}


class AbortMsg(Struct, frozen=True, kw_only=True):
    """Decode → prefill: stop this handoff; answer only once no write can still land."""

    version: int = PEER_PROTOCOL_VERSION
    handoff_id: str
    reason: str


class AbortAck(Struct, frozen=True, kw_only=True):
    version: int = PEER_PROTOCOL_VERSION
    handoff_id: str
    quiesced: bool
    stages: list[int]  # the stages that were still running and were stopped


class HeartbeatMsg(Struct, frozen=True, kw_only=True):
    """Either direction, every heartbeat interval while the two share a live handoff."""

    version: int = PEER_PROTOCOL_VERSION
    sender_url: str
    role: str
    live: list[str] = []  # handoff ids the sender still runs with the receiver


class HeartbeatAck(Struct, frozen=True, kw_only=True):
    version: int = PEER_PROTOCOL_VERSION
    role: str
    url: str

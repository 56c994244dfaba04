"""The kvhandoff transfer backend's manager, sender and receiver for SGLang.

SGLang's schedulers construct these through `get_kv_class` (see `plugin.py`) and reach into the
`Common*` classes beyond the `Base*` ABCs, so these subclass them: SGLang's own code keeps the
request table (`request_status`, monotone: `update_status` takes the max and keeps Failed), the
failure records, the PP consensus store (prefill PP rank 0 polls the minimum over the stages),
the bootstrap look-ups and the timeouts. What moves bytes and decides outcomes is kvhandoff:

- every scheduler rank runs one embedded kvhandoff service (`service.embedded`) over the
  engine's own buffers (layouts from `KVArgs`, `layouts.py`), with its own Mooncake engine, free
  port and locked state directory; prefill ranks register its URL with the bootstrap server,
  signed (`bootstrap.py`);
- one handoff per request and sending prefill attention-TP rank: id
  `sglang-<bootstrap_room>-tp<rank>`; with attention CP on the prefill, CP rank 0 sends it and
  the other CP ranks, SGLang's dummy participants, move nothing (SGLang's `CommonKVSender.send`
  ends them at their last send). An MLA prefill of k times the decode's attention TP sends
  from the first of each decode rank's k prefill ranks; the decode rank excuses the other
  k - 1 per request, signed (`excusal.py`), and they reach Success at their last send. An MLA
  decode of k times the prefill's attention TP takes a copy on each of the k decode ranks of a
  prefill rank, a handoff each (`-r<i>` after the first: `handoff_id`) whose destination says
  k (`fan_out`); the prefill rank signals every range to all of them and reaches Success once
  all have their bytes;
- decode `send_metadata` creates the handoff (destination pages, a slot per state component,
  the aux row; with SGLang's decode radix cache, the pages of the prefix it holds, which the
  prefill's service then skips) on the decode service, naming the prefill stages' services;
  each prefill `send` signals its chunk's pages ready at once, as a page range of the stage
  (the slots and aux row with the last), so the chunk's segments travel while the next chunk
  is prefilled;
- the service's events drive `update_status` / `record_failure` on its own thread, so `poll()`
  only reads SGLang's table (a snapshot) and never waits; engine-facing calls that wait
  (create, stage ready, a prefill's abort) run on one worker thread per rank, in order, and a
  decode's aborts on threads of their own, never behind a create;
- the boundary (DESIGN.md): the decode declares SGLang's deferred release, so SGLang frees a
  failed request's pages only once `is_abort_release_safe` says every handoff of the room is
  released (`service.integrations.rooms.decode`); the prefill stops every handoff of a room
  before SGLang's table says Failed (`_stop_then_fail`).

Called by: SGLang's prefill scheduler (`prefill.py`: sender `__init__`, `init`, `send` per
chunk, `poll` / `poll_pp_consensus`, `failure_exception`, `abort`, `clear`) and decode scheduler
(`decode.py`: `try_ensure_parallel_info`, receiver `__init__`, `init`, `send_metadata`, `poll`,
`failure_exception`, `abort` / `ensure_abort_notified` (every Failed), `clear`, then the
manager's `is_abort_release_safe(room, required_acks)` each pass until it frees the pages).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import requests
from sglang.srt.disaggregation.base.conn import (
    KVPoll,
    KVTransferDestination,
    KVTransferMetric,
)
from sglang.srt.disaggregation.common.conn import (
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs
from sglang.srt.runtime_context import get_parallel

from pipelines.decode.views import HandoffRequest
from pipelines.errors import KVHandoffError, PeerUnreachable
from pipelines.events import (
    DestinationReceived,
    Event,
    HandoffAborted,
    HandoffCompleted,
    HandoffCreated,
    HandoffFailed,
    HandoffReleased,
    StageReady,
    StageTransferred,
)
from service.embedded import EmbeddedService
from service.integrations.rooms.decode import DecodeRooms
from service.integrations.sglang import excusal
from service.integrations.sglang.bootstrap import MAX_SKEW_S, SIGNATURE_HEADER, URL_FIELD, sign
from service.integrations.sglang.layouts import (
    RankLayout,
    Unsupported,
    component_slots,
    pool_device,
    rank_layout,
    refuse_unsupported,
    state_types,
)
from service.integrations.sglang.settings import rank_config
from service.runtime.stages import EngineStage

log = logging.getLogger("kvhandoff.sglang")
RELEASED_KEPT = 65536
ABORT_THREADS = 4


def handoff_id(room: int, tp_rank: int, copy: int = 0) -> str:
    """The id of the handoff prefill TP rank `tp_rank` sends for `room`; `copy` > 0: to the
    decode rank of that index among the ones it fans out to (an MLA decode of larger TP)."""
    base = f"sglang-{int(room)}-tp{int(tp_rank)}"
    return f"{base}-r{int(copy)}" if copy else base


_COPY = re.compile(r"^(.*)-r([1-9][0-9]*)$")


def own_of(hid: str) -> str:
    """The id a fanned-out copy's id is a copy of (the id itself when it is none)."""
    m = _COPY.match(hid)
    return m.group(1) if m else hid


def tp_pairing_refusal(
    prefill_tp: int, decode_tp: int, *, mla: bool, hybrid_mla: bool, state: bool
) -> str | None:
    """Why a decode rank of attention TP `decode_tp` cannot pair with a prefill of `prefill_tp`
    as kvhandoff pairs them (one sending prefill rank per decode rank), or None. Equal TP pairs
    rank with rank. Unequal TP pairs only an MLA model's KV, which every TP rank holds whole,
    and only with no state component (its heads are split over TP ranks): with a larger
    prefill TP, the first of the decode rank's prefill ranks sends and the others are excused
    (`excusal.py`); with a larger decode TP, each prefill rank sends a copy to each of its
    decode ranks, a handoff each (`handoff_id`'s `copy`)."""
    if prefill_tp == decode_tp:
        return None
    sizes = f"prefill attention TP {prefill_tp}, decode {decode_tp}"
    if not mla or hybrid_mla:
        return (
            f"kvhandoff pairs unequal TP for MLA models only ({sizes}): another model's KV "
            "heads are split over TP ranks, and kvhandoff does not slice them"
        )
    if prefill_tp < decode_tp and decode_tp % prefill_tp:
        return f"the decode's attention TP is not a multiple of the prefill's ({sizes})"
    if prefill_tp > decode_tp and prefill_tp % decode_tp:
        return f"the prefill's attention TP is not a multiple of the decode's ({sizes})"
    if state:
        return (
            f"kvhandoff pairs unequal TP for MLA models without state components only "
            f"({sizes}): a state component's heads are split over TP ranks"
        )
    return None


def refuse_rust_registry(*, prefill: bool, attn_dp_size: int) -> None:
    """With `SGLANG_RUST_SERVER` and DP attention, SGLang gathers every rank's registration and
    has the rank that owns a Rust listener register them all, unsigned, with that listener:
    each row would carry the wrong rank's kvhandoff URL, in a registry kvhandoff does not run.
    Refused at start-up by name."""
    if prefill and attn_dp_size > 1 and envs.SGLANG_RUST_SERVER.get():
        raise Unsupported(
            "SGLANG_RUST_SERVER with DP attention is not supported by kvhandoff: SGLang then "
            "registers every rank's row from one rank with the Rust registry, not with "
            "kvhandoff's signed bootstrap server"
        )


def refuse_early_release(handoff: Any) -> None:
    """SGLang frees a failed request's decode pages when kvhandoff says they are released
    (`is_abort_release_safe`), or when its own release timeout passes, whichever comes first.
    kvhandoff releases a handoff's pages at the latest its deadline plus `max_grace_s` after
    the create (the longest a prefill writer it cannot hear from may still write); SGLang's
    clock starts later, at Failed. A timeout shorter than that bound, or SGLang's deferred
    release turned off (it then frees the pages at Failed), could free pages a commit still
    writes: refused at start-up by name."""
    if not envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get():
        raise Unsupported(
            "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=0 with kvhandoff: SGLang would "
            "free a failed request's decode pages before kvhandoff released them"
        )
    bound_s = float(handoff.default_deadline_s) + float(handoff.max_grace_s)
    timeout_s = float(envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.get())
    if timeout_s < bound_s:
        raise Unsupported(
            f"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT = {timeout_s:g} s is "
            f"shorter than the longest kvhandoff may hold a failed request's pages "
            f"(handoff.default_deadline_s {handoff.default_deadline_s:g} s + "
            f"handoff.max_grace_s {handoff.max_grace_s:g} s = {bound_s:g} s): raise it, or "
            "lower those"
        )


def refuse_decode_prefix_reuse(server_args: Any, *, prefill: bool) -> None:
    """A decode with SGLang's radix cache holds a prefix of some requests and takes the rest
    only (`decode_prefix_len`): kvhandoff skips the prefix on the prefill's side
    (`HandoffRequest.prefix_pages`), which SGLang's prefill never learns (its sends start
    before the decode's metadata comes). SGLang's own KV checksum would then digest the whole
    request on the prefill and the suffix on the decode, failing every request that hits the
    cache: that pair is refused at start-up by name (kvhandoff digests every segment itself)."""
    if prefill or not getattr(server_args, "disaggregation_decode_enable_radix_cache", False):
        return
    if getattr(server_args, "disaggregation_enable_kv_checksum", False):
        raise Unsupported(
            "--disaggregation-enable-kv-checksum with --disaggregation-decode-enable-radix-cache "
            "is not supported by kvhandoff: SGLang's prefill would digest a request's whole KV, "
            "its decode only the pages after the prefix it cached (kvhandoff checks each "
            "segment's digest itself)"
        )


def refuse_context_parallel(parallel: Any, kv_args: Any, *, prefill: bool) -> None:
    """Attention CP as kvhandoff carries it: on the prefill only, where SGLang's CP rank 0
    holds every page of a request and sends alone, the other CP ranks being SGLang's "dummy"
    participants (they report Success at their last send and move nothing). The modes where
    each CP rank sends its own share of the pages, or a CP rank stands in for a TP rank, are
    refused by name before anything starts."""
    if parallel.attn_cp_size <= 1:
        return
    if not prefill:
        raise Unsupported("attention context parallelism on the decode (attn_cp_size > 1)")
    shared: list[str] = []
    if envs.SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER.get():
        shared.append("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER")
    if getattr(kv_args, "is_hybrid_mla_backend", False):
        shared.append("a hybrid MLA model (SGLang shards its KV over CP ranks)")
    if parallel.enable_dsa_cache_layer_split:
        shared.append("DSA cache layer split")
    if parallel.enable_cp_tp_group_sharing:
        shared.append("CP-TP group sharing (each CP rank transfers as a TP rank)")
    if shared:
        raise Unsupported(
            f"attention CP where every CP rank sends ({', '.join(shared)}) is not supported by "
            "kvhandoff: it pairs each decode rank with CP rank 0 of its prefill TP rank"
        )


def failure_reason(event: HandoffFailed | HandoffAborted) -> str:
    """What `failure_exception()` raises: the code, the stage and the layer when known."""
    if isinstance(event, HandoffAborted):
        return f"kvhandoff handoff {event.handoff_id} aborted: {event.reason}"
    where = []
    if event.pp_rank is not None:
        where.append(f"stage {event.pp_rank}")
    for key in ("layer_id", "group", "kind", "field"):
        if key in event.context:
            where.append(f"{key.replace('_id', '')} {event.context[key]}")
    at = f" at {', '.join(where)}" if where else ""
    return f"kvhandoff handoff {event.handoff_id} failed ({event.code}){at}: {event.reason}"


@dataclass(frozen=True)
class _Range:
    """One page range a prefill rank signalled for its own handoff, kept to replay to the
    room's other copies (a fan-out learned later)."""

    pages: Any  # the rank's own copy of SGLang's page indices
    at: int
    last: bool
    slots: dict[str, int] | None
    aux: int | None


class KVHandoffManager(CommonKVManager):
    """One scheduler rank's side of the backend: its embedded service and the room table."""

    # SGLang holds a failed request's decode pages until `is_abort_release_safe` says kvhandoff
    # released them (its deferred release), instead of freeing them at Failed.
    supports_deferred_decode_kv_release = True

    # prefill: reads the excusals decode ranks send (SGLang's MLA dummy ranks).
    _excusals: excusal.Listener | None
    _prefill_role = False  # set by __init__

    def __init__(
        self,
        args: Any,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ) -> None:
        parallel = get_parallel()
        device = str(getattr(server_args, "device", "cpu"))
        refuse_unsupported(
            args, device=device, custom_mem_pool=envs.SGLANG_MOONCAKE_CUSTOM_MEM_POOL.get()
        )
        prefill = disaggregation_mode == DisaggregationMode.PREFILL
        refuse_context_parallel(parallel, args, prefill=prefill)
        refuse_decode_prefix_reuse(server_args, prefill=prefill)
        refuse_rust_registry(prefill=prefill, attn_dp_size=int(parallel.attn_dp_size))
        if parallel.attn_dcp_size > 1:
            raise Unsupported("decode context parallelism (--dcp-size > 1) with kvhandoff")
        if parallel.enable_kv_cache_sharding:
            raise Unsupported("--enable-kv-cache-sharding with kvhandoff")
        pp_size = int(parallel.pp_size) if prefill else 1
        pp_rank = int(args.pp_rank) if prefill else 0
        self.stage_rank = pp_rank
        self.tp_rank_for_handoffs = int(parallel.attn_tp_rank)
        self.state_types = state_types(args)  # what `state_indices` lists are parallel to
        self.rank: RankLayout = rank_layout(
            args,
            pp_rank=pp_rank,
            pp_size=pp_size,
            is_mla=bool(is_mla_backend),
            with_aux=not prefill or pp_rank == pp_size - 1,
            device=pool_device(device, int(getattr(args, "gpu_id", 0) or 0)),
        )
        role = "prefill" if prefill else "decode"
        rank_name = f"sglang-{role}-dp{parallel.attn_dp_rank}-pp{pp_rank}-tp{parallel.attn_tp_rank}"
        if parallel.attn_cp_size > 1:  # CP ranks share their TP rank: each its own state dir
            rank_name += f"-cp{parallel.attn_cp_rank}"
        num_pages = min((e.num_items for e in self.rank.layout.kv), default=1)
        stage = {"pp_rank": pp_rank, "pp_size": pp_size, "num_pages": num_pages}
        npu = int(getattr(args, "gpu_id", 0) or 0) if device == "npu" else None
        self.kv_config = rank_config(
            os.environ, role=role, stage=stage, rank_name=rank_name, npu=npu
        )
        if not prefill:
            refuse_early_release(self.kv_config.handoff)
        # A prefill CP rank other than 0 is SGLang's dummy participant (the modes where every CP
        # rank sends are refused above): it moves nothing, so it runs no service (no Mooncake
        # engine, no port) and registers no URL.
        self.dummy_cp = prefill and parallel.attn_cp_size > 1 and parallel.attn_cp_rank != 0
        self._service: EmbeddedService | None = None
        self.service_url: str | None = None
        if not self.dummy_cp:
            self._service = EmbeddedService(
                self.kv_config,
                buffers={pp_rank: EngineStage(self.rank.layout, self.rank.tensors())},
            ).start()
            self.service_url = self._service.url
        # The peer secrets: the current one signs; any of them verifies (a rotation).
        self.secrets = tuple(k.encode() for k in self.kv_config.secrets("peer"))
        self.secret = self.secrets[0]
        # An excusal that comes before its request is kept as long as a decode may still wait
        # on the room: SGLang's bootstrap and waiting timeouts (the decode excuses at `init`,
        # before its handoff's deadline starts), or the handoff deadline, and the skew.
        wait_s = max(
            envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get()
            + envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get(),
            self.kv_config.handoff.default_deadline_s,
        )
        self._prefill_role = prefill
        self._init_rooms(wait_s + MAX_SKEW_S)
        try:
            if self._service is not None:
                self._service.add_listener(self._on_event)
            super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
            if prefill and self.attn_cp_size > 1 and self.enable_all_cp_ranks_for_transfer:
                # SGLang's own verdict, should a condition of it not be named above.
                raise Unsupported(
                    "attention CP with every CP rank sending its share of the pages "
                    "(SGLang's enable_all_cp_ranks_for_transfer) is not supported by kvhandoff"
                )
            if bool(getattr(self, "is_dummy_cp_rank", False)) != self.dummy_cp:
                raise Unsupported(  # SGLang's own verdict on which CP ranks send
                    f"SGLang {'makes' if self.dummy_cp else 'does not make'} CP rank "
                    f"{parallel.attn_cp_rank} a dummy participant, which kvhandoff does not "
                    "expect of this layout"
                )
            # SGLang's metric multiplies its byte count by this; kvhandoff reports the bytes
            # its handoffs moved instead, every copy of a fanned-out room included
            # (`get_transfer_metric`), so the factor stays 1 and SGLang need not learn it.
            self._kv_replica_factor = 1
            if prefill and self.service_url is not None:
                self._excusals = excusal.Listener(
                    self.server_socket, self.secrets, self.service_url, self.excuse
                ).start()
        except BaseException:
            self._calls.shutdown(wait=False)
            self._aborts.shutdown(wait=False)
            if self._service is not None:
                self._service.stop()  # a rank that did not come up leaves nothing registered
            raise

    @property
    def service(self) -> EmbeddedService:
        """The rank's kvhandoff service: every rank that moves bytes runs one."""
        if self._service is None:
            raise RuntimeError("a dummy CP rank of the prefill runs no kvhandoff service")
        return self._service

    def _init_rooms(self, excusal_ttl_s: float) -> None:
        """The rank's room tables, locks and worker thread (all a room's bookkeeping reads)."""
        self._rooms: dict[str, int] = {}  # handoff id -> room, of live senders / receivers
        self._sent: dict[int, int] = {}  # prefill: pages signalled so far, per room
        self._signalled: set[int] = set()  # prefill: rooms whose last page range was signalled
        # prefill: rooms whose pages all came, by SGLang's count, before their state slots
        self._ended: dict[int, int] = {}
        # prefill: rooms a decode rank excused (SGLang's MLA dummy ranks: `excusal.py`)
        self._excused = excusal.Excusals(excusal_ttl_s, RELEASED_KEPT)
        # decode: each handoff's record, until released (SGLang asks `is_abort_release_safe`
        # after it cleared the receiver): what SGLang's deferred release waits for.
        self.decode_rooms = DecodeRooms()
        # decode: rooms that failed because a prefill rank was unreachable (gone, or started
        # again elsewhere): their receiver has SGLang forget the prefill's bootstrap rows.
        self._unreachable: set[int] = set()
        # prefill: per room, the bytes this rank's stage moved so far and when (perf_counter)
        # its last segment was committed on the decode: what `get_transfer_metric` reports.
        self._moved: dict[int, tuple[int, float | None]] = {}
        # prefill, a room whose bytes go to several decode ranks (an MLA decode of k times this
        # TP: `DestinationReceived.fan_out`): k, the ranges signalled so far (replayed to each
        # copy, `_flush`), how many of them each copy got, and the ids whose stage has all its
        # bytes (Success once every one has). Ranges are kept only until k is known to be 1.
        self._fan_out: dict[int, int] = {}
        self._ranges: dict[int, list[_Range]] = {}
        # ... and how many of them the own handoff was signalled (its `wait_event` waited for):
        # only those are replayed, so no copy gathers pages a forward may still be writing.
        self._own_signalled: dict[int, int] = {}
        self._replayed: dict[int, dict[str, int]] = {}
        self._finals: dict[int, set[str]] = {}
        # prefill: a fan-out whose destination came before SGLang opened the room, by the
        # room's own id (bounded, oldest first out); and the rooms that failed or were aborted
        # (no copy is signalled after that).
        self._early_fan_out: OrderedDict[str, int] = OrderedDict()
        self._stopped: set[int] = set()
        # Re-entrant: a send refused under it fails its room, which reads `_excused` under it.
        self._lock = threading.RLock()
        # SGLang's update_status reads, then writes: two threads (the scheduler's and the
        # service's) interleaving there could move a room backwards. One writer at a time.
        self._status_lock = threading.RLock()
        self._excusals = None
        # One thread for the calls that wait on the service, so the scheduler never does.
        self._calls = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvhandoff")
        # decode: aborts on their own threads, never queued behind a create (each returns once
        # its handoff is released; a few at once, so one slow release holds up no other abort).
        self._aborts = concurrent.futures.ThreadPoolExecutor(
            ABORT_THREADS, thread_name_prefix="kvhandoff-abort"
        )

    def update_status(self, bootstrap_room: int, status: int) -> None:
        with self._status_lock:
            super().update_status(bootstrap_room, status)

    # ------------------------------------------------------------------ rooms

    def own_handoff(self, room: int) -> str:
        """The id of the handoff this rank's own TP rank sends (a prefill's)."""
        return handoff_id(room, self.tp_rank_for_handoffs)

    def open_room(self, room: int, hid: str | None = None) -> str:
        """Follow `hid` (by default this rank's own) as the room's handoff; an excused
        prefill room has none to follow."""
        hid = hid or self.own_handoff(room)
        room = int(room)
        with self._lock:
            if not self._excused.open(room):  # an excused room has no handoff to follow
                self._rooms[hid] = room
            early = self._early_fan_out.pop(hid, None)
        if early is not None:
            self._learn_fan_out(room, hid, early)
        return hid

    def close_room(self, room: int, hid: str | None = None) -> None:
        with self._lock:
            self._rooms.pop(hid or self.own_handoff(room), None)
            self._sent.pop(int(room), None)
            self._ended.pop(int(room), None)
            self._signalled.discard(int(room))
            self._unreachable.discard(int(room))
            self._moved.pop(int(room), None)
            self._excused.close(int(room))
            for copy in self._copies(int(room)):
                self._rooms.pop(copy, None)
            tables = (
                self._fan_out,
                self._ranges,
                self._own_signalled,
                self._replayed,
                self._finals,
            )
            for table in tables:
                table.pop(int(room), None)  # type: ignore[attr-defined]
            self._stopped.discard(int(room))

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int = 0) -> bool:
        """SGLang's deferred release (decode.py `resolve_deferred_releases`): True once no
        handoff of the room may still write its pages, from `handoff.released` alone; SGLang's
        prefill acks (`required_acks`) are not kvhandoff's and are not counted."""
        return self.decode_rooms.release_safe(bootstrap_room)

    def abort_decode(self, room: int, hid: str) -> None:
        """SGLang gave up the room's handoff `hid`: stopped on the abort threads (a create still
        queued or running is cancelled instead: `DecodeRooms.cancel`). SGLang holds the pages
        until `handoff.released`, so nothing here waits or fails the room again."""
        if not self.decode_rooms.cancel(hid):
            return

        def stop() -> None:
            try:
                self.service.abort(hid)
            except (KVHandoffError, TimeoutError) as exc:  # ended already: released by itself
                log.info("abort of %s (room %s): %s", hid, room, exc)

        self._aborts.submit(stop)

    def excused(self, room: int) -> bool:
        with self._lock:
            return int(room) in self._excused

    def excuse(self, room: int) -> None:
        """A decode rank excused this prefill rank from `room` (verified: `excusal.py`): the
        room moves nothing from here and reaches Success at its last send. Ranges already
        signalled are withdrawn first, on the worker thread after them, and the room's events
        no longer move it. Success, should the last send have come already, follows the
        withdrawal there."""
        room = int(room)
        hid = self.own_handoff(room)
        with self._lock:
            if not self._excused.excuse(room, opened=hid in self._rooms):
                return  # a repeat (a replay within the skew window)
            self._rooms.pop(hid, None)
            signalled = room in self._sent or room in self._ended or room in self._signalled
            last = room in self._signalled
            # Queued under the lock: in order with any stage signal `add_transfer_request`
            # queues (which checks `_excused` under it).
            if signalled:
                self._calls.submit(self._withdraw, hid)
            if last:
                self._calls.submit(self.update_status, room, KVPoll.Success)
        log.info("room %d excused: the decode pairs with another prefill TP rank", room)

    def fail(self, room: int, reason: str, *, unreachable: bool = False) -> bool:
        """Fail the room with `reason`, unless it failed already (SGLang's abort, say: its
        reason stands, not that of the handoff's abort event that follows it); `unreachable`:
        a prefill rank could not be reached (noted before the status moves, so a poll that sees
        Failed sees the note too). False, changing nothing, for a room this rank is excused
        from: nothing of it can fail."""
        with self._lock:
            if int(room) in self._excused:
                return False
            if unreachable:
                self._unreachable.add(int(room))
            if self._prefill_role and self.own_handoff(room) in self._rooms:
                self._stopped.add(int(room))  # no copy is signalled after this
        with self._status_lock:  # checked and written as one: the first reason stands
            if self.request_status.get(int(room)) == KVPoll.Failed:
                return True  # failed already (SGLang's abort, or an earlier failure of ours)
            self.record_failure(room, reason)
            self.update_status(room, KVPoll.Failed)
        return True

    def prefill_unreachable(self, room: int) -> bool:
        with self._lock:
            return int(room) in self._unreachable

    def moved(self, room: int) -> tuple[int, float | None] | None:
        """(bytes this rank's stage moved, perf_counter of its last commit or None), or None
        when nothing of the room moved from here."""
        with self._lock:
            return self._moved.get(int(room))

    def submit(
        self, room: int, what: str, call: Callable[[], Any]
    ) -> concurrent.futures.Future[Any]:
        """Run `call` on the rank's worker thread; an error fails the room naming `what` (a
        prefill's once every handoff of it is stopped: `_stop_then_fail`). Nobody reads the
        call's result, so any error counts: an unexpected one (a CUDA error while waiting for
        SGLang's forward) is logged with its traceback and fails the room the same way."""

        def run() -> Any:
            try:
                return call()
            except Exception as exc:
                expected = isinstance(exc, (KVHandoffError, TimeoutError, ValueError))
                reason = f"kvhandoff {what} {'refused' if expected else 'failed'}: {exc}"
                unreachable = isinstance(exc, PeerUnreachable)
                if not self._prefill_role:
                    if not expected:
                        log.exception("kvhandoff %s of room %s failed", what, room)
                    self.fail(room, reason, unreachable=unreachable)
                elif not self._claim_stop(room):
                    # Excused (nothing of it can fail), or stopped already (failing, failed or
                    # aborted): its first reason stands.
                    log.warning("kvhandoff %s of stopped room %s: %s", what, room, exc)
                else:
                    if not expected:
                        log.exception("kvhandoff %s of room %s failed", what, room)
                    self._stop_then_fail(room, reason, unreachable=unreachable)
                return None

        return self._calls.submit(run)

    def refuse_send(self, room: int, reason: str) -> None:
        """A prefill send this backend refuses: the request fails, once every handoff of it
        is stopped (on the worker thread, after what is queued there), so the decode is told
        now (with the stage and the reason), not at its deadline, and SGLang frees the source
        pages only once no segment gathers from them; a destination that comes later is
        refused."""
        self.stop_room(room, reason)

    def stop_room(
        self, room: int, reason: str, *, unreachable: bool = False, ended: str | None = None
    ) -> None:
        """Prefill: stop every handoff of the room, then fail it (`_stop_then_fail`, queued on
        the worker thread). Once per room: a room stopped already keeps its first reason; an
        excused one moves nothing and never fails."""
        if self._claim_stop(room):
            self._calls.submit(
                self._stop_then_fail, int(room), reason, unreachable=unreachable, ended=ended
            )

    def _claim_stop(self, room: int) -> bool:
        """Mark a prefill room stopped (no copy or range is signalled after this); False when
        it was stopped already or is excused."""
        room = int(room)
        with self._lock:
            if room in self._excused or room in self._stopped:
                return False
            if self.own_handoff(room) in self._rooms:  # no entry outlives a closed room
                self._stopped.add(room)
            return True

    # ------------------------------------------------------------------ fan-out (prefill)

    def _copies(self, room: int) -> list[str]:
        """The ids of the room's copies beyond its own handoff (none until a fan-out is known)."""
        k = self._fan_out.get(room, 1)
        return [handoff_id(room, self.tp_rank_for_handoffs, i) for i in range(1, k)]

    def fanned_out(self, room: int) -> bool:
        with self._lock:
            return self._fan_out.get(int(room), 1) > 1

    def stopped(self, room: int) -> bool:
        with self._lock:
            return int(room) in self._stopped

    def _destination(self, event: DestinationReceived) -> None:
        """A decode said where a handoff of this rank's goes, and how many decode handoffs take
        the same bytes: the room's fan-out (its own id's destination, or a copy's)."""
        own = own_of(event.handoff_id)
        with self._lock:
            room = self._rooms.get(own)
            if room is None:  # SGLang has not opened the room yet: kept for `open_room`
                self._early_fan_out[own] = event.fan_out
                while len(self._early_fan_out) > RELEASED_KEPT:
                    self._early_fan_out.popitem(last=False)
                return
        self._learn_fan_out(room, own, event.fan_out)

    def _learn_fan_out(self, room: int, own: str, k: int) -> None:
        """The room's bytes go to `k` decode handoffs: its own and k - 1 copies, each signalled
        every range the own one was (`_flush`, on the worker thread after what is queued). Two
        decodes that disagree on k fail the room."""
        with self._lock:
            known = self._fan_out.get(room)
            if known is None:
                self._fan_out[room] = k
                if k == 1:
                    self._ranges.pop(room, None)  # nothing to replay: no copy will come
                    return
                for copy in self._copies(room):
                    self._rooms[copy] = room
                self._replayed[room] = dict.fromkeys(self._copies(room), 0)
            elif known == k:
                return
        if known is not None:
            why = f"kvhandoff: decode ranks disagree on the fan-out of {own} ({known} and {k})"
            self.stop_room(room, why)
            return
        self.submit(room, "stage ready", lambda: self._flush(room))

    def _flush(self, room: int) -> None:
        """On the worker thread: signal each copy the ranges its own handoff was signalled (its
        forward waited for) and it was not yet, in their order; a stopped room's copies are
        given up instead."""
        with self._lock:
            cursors = self._replayed.get(room)
            if cursors is None:
                return
            ranges = self._ranges.get(room, [])[: self._own_signalled.get(room, 0)]
            stopped = room in self._stopped
            todo = [(copy, ranges[n:]) for copy, n in cursors.items()]
            for copy in cursors:
                cursors[copy] = len(ranges)
        for copy, pending in todo:
            if stopped:
                self._give_up(copy, "the request failed or was aborted on the prefill")
                continue
            for r in pending:
                self.service.stage_ready(
                    copy,
                    self.stage_rank,
                    r.pages,
                    pages_from=r.at,
                    last_pages=r.last,
                    src_slots=r.slots,
                    src_aux=r.aux,
                )

    def _stop_then_fail(
        self, room: int, reason: str, *, unreachable: bool = False, ended: str | None = None
    ) -> None:
        """On the worker thread, for a room `_claim_stop` marked: it fails only once none of
        its handoffs can still read its source pages (each give-up returns then; `ended`: one
        that has stopped already, aborted). SGLang frees those pages once it sees Failed, and a
        segment still gathering from them would send another request's bytes as this one's."""
        with self._lock:
            ids = [self.own_handoff(room), *self._copies(room)]
        for hid in ids:
            if hid == ended:
                continue
            try:
                self._give_up(hid, reason)
            except Exception:  # a bug: logged; the others are still stopped, the room fails
                log.exception("giving up %s of room %s failed", hid, room)
        self.fail(room, reason, unreachable=unreachable)

    def abort_room(self, room: int, reason: str) -> None:
        """On the worker thread: stop every handoff of the room (its own, and its copies when a
        fan-out is known); each returns once no write of it can land."""
        with self._lock:
            self._stopped.add(room)
            ids = [self.own_handoff(room), *self._copies(room)]
        first: Exception | None = None
        for hid in ids:  # each one tried, whatever another one raised
            try:
                self.service.abort_prefill(hid, reason)
            except Exception as exc:  # noqa: BLE001 - raised once every other one was tried
                first = first or exc
        if first is not None:
            raise first

    def _withdraw(self, hid: str) -> None:
        """An excused room's signalled ranges: withdrawn (`aborted`, no failure anywhere); a
        handoff some decode holds after all is given up, which fails it there."""
        reason = "excused: the decode pairs with another prefill TP rank (MLA)"
        try:
            if self.service.withdraw_prefill(hid, reason):
                return
        except (KVHandoffError, TimeoutError) as exc:
            log.warning("withdrawing %s failed: %s", hid, exc)
        self._give_up(hid, reason)

    def _give_up(self, hid: str, reason: str) -> None:
        try:
            self.service.abort_prefill(hid, reason)
        except (KVHandoffError, TimeoutError) as exc:  # the failure above stands either way
            log.warning("giving up %s after %s failed: %s", hid, reason, exc)

    # ------------------------------------------------------------------ events -> status

    def _on_event(self, event: Event) -> None:
        """On the service's thread: SGLang's status table follows the handoff (monotone)."""
        if isinstance(event, DestinationReceived):
            if event.role == "prefill":
                self._destination(event)
            return
        if isinstance(event, HandoffReleased) and event.role == "decode":
            self.decode_rooms.released(event.handoff_id)
            return
        with self._lock:
            room = self._rooms.get(event.handoff_id)
        if room is None:
            return
        match event:
            case HandoffFailed() | HandoffAborted():
                gone = isinstance(event, HandoffFailed) and event.code == PeerUnreachable.code
                if event.role == "prefill":  # every handoff of it stops before SGLang hears
                    # (an aborted one has: the prefill publishes that once it stopped)
                    ended = event.handoff_id if isinstance(event, HandoffAborted) else None
                    self.stop_room(room, failure_reason(event), unreachable=gone, ended=ended)
                else:  # SGLang holds the decode's pages until `handoff.released`
                    self.fail(room, failure_reason(event), unreachable=gone)
            case StageReady() if event.role == "prefill":
                self.update_status(room, KVPoll.Transferring)
            case StageTransferred() if event.role == "prefill" and event.pp_rank == self.stage_rank:
                with self._lock:  # noted before Success, which SGLang's metric read follows
                    nbytes, _ = self._moved.get(room, (0, None))
                    done = False
                    if event.final:  # a fanned-out room: once every copy has all its bytes
                        finals = self._finals.setdefault(room, set())
                        finals.add(event.handoff_id)
                        done = len(finals) >= self._fan_out.get(room, 1)
                    self._moved[room] = (
                        nbytes + event.bytes,
                        time.perf_counter() if done else None,
                    )
                if done:
                    self.update_status(room, KVPoll.Success)
            case HandoffCreated() if event.role == "decode":
                self.update_status(room, KVPoll.Transferring)
            case HandoffCompleted() if event.role == "decode":
                self.update_status(room, KVPoll.Success)
            case _:
                pass

    # ------------------------------------------------------------------ prefill

    def _register_topology_row(self, url: str, payload: dict[str, Any]) -> None:
        """SGLang's registration, with this rank's service URL and signed (`bootstrap.py`).
        At start-up: retried for a while, then the rank does not come up."""
        body = {**payload, URL_FIELD: self.service_url}  # None: a dummy CP rank
        for attempt in range(5):
            why = self._signed("PUT", url, body)
            if why is None:
                return
            log.warning("bootstrap PUT %s attempt %d: %s", url, attempt + 1, why)
            time.sleep(min(2.0**attempt, 8.0))
        raise RuntimeError(f"kvhandoff could not register with the bootstrap server at {url}")

    def _signed(self, method: str, url: str, body: dict[str, Any]) -> str | None:
        """One signed request to the bootstrap server: None when it answered 200, else why not."""
        data = json.dumps(body).encode()
        path = "/" + url.split("://", 1)[1].split("/", 1)[1]
        headers = {
            "Content-Type": "application/json",
            SIGNATURE_HEADER: sign(self.secret, method, path, data),
        }
        try:
            response = requests.request(method, url, data=data, headers=headers, timeout=5)
        except requests.RequestException as exc:
            return str(exc)
        if response.status_code == 200:
            return None
        return f"{response.status_code} {response.text}"

    def add_transfer_request(
        self,
        bootstrap_room: int,
        kv_indices: Any,
        index_slice: slice,
        is_last_chunk: bool,
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        num_kv_tokens: int | None = None,
        wait_event: Any = None,
        indices_event: Any = None,
        **_: Any,
    ) -> None:
        """One prefill chunk's pages (from `CommonKVSender.send`), signalled at once as the
        stage's next page range: its segments travel while the engine prefills the next chunk.
        The last chunk brings the aux row (on the last PP stage) and each state component's
        slot (`state_indices`: one MAMBA index per request). SGLang counts a chunk last once
        its pages are all sent, but the scheduler's state indices come with its own last send,
        which may be an empty one after that: a stage with state ends its ranges only once its
        slots came. Signals go out in order on the rank's worker thread, so the ranges reach
        the service in SGLang's order. A room this rank is excused from moves nothing: it
        reaches Success at SGLang's last chunk.

        Two CUDA events may come with a chunk. `wait_event`: SGLang sends a cached prefix early,
        while the previous forward may still be writing those pages on its own stream; the
        worker waits for it before it signals the range, so no gather reads them sooner.
        `indices_event`: the page indices are still being copied to the host (SGLang passes it
        only to senders that declare `supports_host_tensor_indices`, which this one does not;
        waited for here all the same, before the indices are read)."""
        room = int(bootstrap_room)
        slots, refused = component_slots(self.state_types, state_indices)
        if indices_event is not None:
            indices_event.synchronize()
        pages = np.array(kv_indices, dtype=np.int64)  # a copy: SGLang reuses its array
        waiting = set(self.rank.layout.components) - set(slots)
        last = bool(is_last_chunk) and not waiting
        with self._lock:
            # Checked with the bookkeeping `excuse` reads, in one critical section: an excusal
            # sees either none of this send or all of it.
            if room in self._excused:
                if is_last_chunk:  # queued after any withdrawal `excuse` queued
                    self._calls.submit(self.update_status, room, KVPoll.Success)
                return
            if room in self._stopped:
                return  # failing or failed: nothing more is signalled, the first reason stands
            if refused:
                self.refuse_send(room, f"kvhandoff: {refused}")
                return
            if room in self._signalled:
                if len(pages):
                    self.refuse_send(
                        room, f"kvhandoff: {len(pages)} pages sent after the last chunk"
                    )
                return  # SGLang's empty closing send after a chunk that already ended the pages
            at = self._sent.get(room, 0)
            if not last and room in self._ended:
                # A second send after the pages ended, still without the slots: none will come.
                self.refuse_send(room, f"kvhandoff: no state slot of {sorted(waiting)} came")
                return
            self._sent[room] = at + len(pages)
            if is_last_chunk and not last:
                self._ended[room] = at + len(pages)  # pages done; the slots come next
            if last:
                self._signalled.add(room)
                self._sent.pop(room, None)
                self._ended.pop(room, None)
        start = index_slice.start if isinstance(index_slice, slice) else None
        if start is not None and int(start) != at:
            # SGLang's positions and ours disagree (a sharded or CP-filtered send, which this
            # backend refuses at start-up): never guess where the pages go.
            self.refuse_send(room, f"kvhandoff: chunk at page position {start}, expected {at}")
            return
        aux = None
        if self.rank.has_aux and last and aux_index is not None:
            aux = int(aux_index)
        hid = self.own_handoff(room)
        rank = self.stage_rank
        with self._lock:  # queued in order with an excusal's withdrawal (see `excuse`)
            if room in self._excused:
                # Excused since the bookkeeping above, which `excuse` saw: it queued the
                # withdrawal of what was signalled, and Success if this send was the last.
                return

            def signal() -> None:
                if wait_event is not None:
                    wait_event.synchronize()  # the forward that writes these pages has run
                self.service.stage_ready(
                    hid,
                    rank,
                    pages,
                    pages_from=at,
                    last_pages=last,
                    src_slots=slots if last else None,
                    src_aux=aux,
                )
                if kept:  # the room's copies (once known) get what the own handoff got
                    with self._lock:
                        if room in self._ranges:  # still kept (no fan-out of 1, not closed)
                            self._own_signalled[room] = self._own_signalled.get(room, 0) + 1
                    self._flush(room)

            # Kept for the room's copies, until it is known none will come (a fan-out of 1).
            kept = self._fan_out.get(room) != 1
            if kept:
                self._ranges.setdefault(room, []).append(
                    _Range(pages, at, last, slots if last else None, aux)
                )
            self.submit(room, "stage ready", signal)

    def register_prefill_dp_rank_signed(self, bootstrap_addr: str, room: int) -> None:
        """Tell the bootstrap server which DP rank prefills `room` (signed), on the rank's worker
        thread: the scheduler goes on, and a decode asking before it is there asks again, as
        it does for SGLang's own backends. Refused or unreachable, the request fails with why."""
        url = f"http://{bootstrap_addr}/register_dp_rank"
        body = {"bootstrap_room": int(room), "dp_rank": int(self.attn_dp_rank)}

        def register() -> None:
            why = self._signed("POST", url, body)
            if why is not None:
                self.stop_room(
                    room,
                    f"kvhandoff could not register DP rank {body['dp_rank']} of "
                    f"room {room} with the bootstrap server at {bootstrap_addr}: {why}",
                )

        self._calls.submit(register)

    # ------------------------------------------------------------------ decode

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """SGLang's first contact with a prefill instance: a prefill this decode cannot pair
        with is named here, once, in the log (refusing it here would make SGLang retry it for
        ever or stop the scheduler); each of its requests then fails at `init` with the reason."""
        known = bootstrap_addr in self.prefill_info_table
        found = bool(super().try_ensure_parallel_info(bootstrap_addr))
        info = self.prefill_info_table.get(bootstrap_addr)
        why = self.pairing_refusal(info) if found and not known and info is not None else None
        if why is not None:
            log.error("the prefill at %s cannot serve this decode rank: %s", bootstrap_addr, why)
        return found

    def pairing_refusal(self, info: Any) -> str | None:
        """Why this decode rank cannot pair with one prefill rank per PP stage, as kvhandoff
        does (`tp_pairing_refusal`; one CP rank sending: SGLang's `target_cp_ranks`), or None."""
        why = tp_pairing_refusal(
            int(info.attn_tp_size),
            int(self.attn_tp_size),
            mla=bool(self.is_mla_backend),
            hybrid_mla=bool(self.is_hybrid_mla_backend),
            state=bool(self.rank.layout.state),
        )
        if why is not None:
            return why
        if len(list(getattr(info, "target_cp_ranks", None) or [0])) > 1:
            return (
                f"kvhandoff pairs a decode rank with CP rank 0 of the prefill; this prefill's "
                f"{info.attn_cp_size} CP ranks would each send a share of the pages"
            )
        return None

    def check_pairing(self, room: int, info: Any) -> bool:
        why = self.pairing_refusal(info)
        if why is not None:
            self.fail(room, why)
        return why is None

    def close(self) -> None:
        """Stop this rank's service (tests, role switch); no write lands afterwards."""
        if self._excusals is not None:
            self._excusals.stop()
        self._calls.shutdown(wait=True)
        self._aborts.shutdown(wait=True)
        if self._service is not None:
            self._service.stop()


class KVHandoffSender(CommonKVSender):
    """Prefill side of one request on one rank (see the module doc for the call order)."""

    kv_mgr: KVHandoffManager

    def __init__(
        self,
        mgr: KVHandoffManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ) -> None:
        mgr.open_room(bootstrap_room)
        # What `get_transfer_metric` reports once `clear()` forgot the room (SGLang reads it
        # after): (bytes moved and when the last commit was, or None; excused).
        self._at_clear: tuple[tuple[int, float | None] | None, bool] | None = None
        super().__init__(mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)
        if self.conclude_state is None and self.bootstrap_room in mgr.request_status:
            # kvhandoff takes a stage's signal before its destination: prefill may run now.
            mgr.update_status(self.bootstrap_room, KVPoll.WaitingForInput)

    def _register_prefill_dp_rank(self) -> None:
        self.kv_mgr.register_prefill_dp_rank_signed(self.bootstrap_server_url, self.bootstrap_room)

    def get_transfer_metric(self) -> KVTransferMetric:
        """SGLang's transfer metric with kvhandoff's own numbers: the bytes this rank's stage
        moved (what its segments carried, state and aux rows included), and the time from
        SGLang's first send to the stage's last segment committed on the decode."""
        metric = super().get_transfer_metric()
        room = self.bootstrap_room
        # SGLang reads this after `clear()`, which forgets the room: then its snapshot.
        moved, excused = self._at_clear or (self.kv_mgr.moved(room), self.kv_mgr.excused(room))
        if excused:  # moved nothing: no sample of SGLang's transfer speed (it skips a None)
            metric.transfer_total_bytes = metric.transfer_latency_s = None
            return metric
        if moved is not None:
            nbytes, ended = moved
            metric.transfer_total_bytes = nbytes
            if ended is not None and self._transfer_start_time is not None:
                metric.transfer_latency_s = max(0.0, ended - self._transfer_start_time)
        return metric

    def abort(self) -> None:
        super().abort()
        mgr, room = self.kv_mgr, self.bootstrap_room
        if mgr.is_dummy_cp_rank:
            return  # a CP rank that sends nothing has no handoff to give up
        if mgr.excused(room):
            # Nothing to give up, but a withdrawal may still be queued: SGLang frees the source
            # pages next, so wait for the worker to have run it.
            mgr.submit(room, "abort", lambda: None).result()
            return
        # Waited for (after any queued stage signal): SGLang frees the source pages next. Every
        # copy of a fanned-out room is stopped too.
        stop = mgr.submit(room, "abort", lambda: mgr.abort_room(room, "aborted by SGLang"))
        stop.result()

    def clear(self) -> None:
        room = self.bootstrap_room
        self._at_clear = (self.kv_mgr.moved(room), self.kv_mgr.excused(room))
        super().clear()
        self.kv_mgr.close_room(room)


class KVHandoffReceiver(CommonKVReceiver):
    """Decode side of one request on one rank (see the module doc for the call order)."""

    kv_mgr: KVHandoffManager
    conclude_state: int | None  # SGLang's, set by CommonKVReceiver

    def __init__(
        self, mgr: KVHandoffManager, bootstrap_addr: str, bootstrap_room: int | None = None
    ) -> None:
        # The handoff this rank receives: named after the prefill TP rank that sends it, which
        # `init` learns (SGLang's `target_tp_rank`); this rank's own until then.
        self._hid = handoff_id(bootstrap_room or 0, mgr.tp_rank_for_handoffs)
        # How many decode ranks take the sending prefill rank's bytes (`init`: an MLA decode of
        # k times the prefill's attention TP), this one included.
        self._fan_out = 1
        if bootstrap_room is not None:
            mgr.open_room(bootstrap_room, self._hid)
            mgr.decode_rooms.open(bootstrap_room, self._hid)
        self._forgot_prefill = False
        super().__init__(mgr, bootstrap_addr, bootstrap_room)

    def poll(self) -> KVPoll:
        state = super().poll()
        room = self.bootstrap_room
        if (
            state == KVPoll.Failed
            and not self._forgot_prefill
            and self.kv_mgr.prefill_unreachable(room)
        ):
            # SGLang keeps a prefill's bootstrap rows (its ranks' kvhandoff URLs) for every later
            # request; a rank that could not be reached may be gone or started again on another
            # port. The next request fetches them anew, as SGLang's own backends do after a
            # failed send, so no failure sticks to a prefill that has come back. (Other failures
            # keep them: a client's abort says nothing about the prefill.)
            self._forgot_prefill = True
            self.invalidate_cached_bootstrap_infos()
        return state

    def init(self, prefill_dp_rank: int) -> None:
        super().init(prefill_dp_rank)
        if self.conclude_state == KVPoll.Failed or not hasattr(self, "prefill_info"):
            return
        mgr, room = self.kv_mgr, self.bootstrap_room
        if not mgr.check_pairing(room, self.prefill_info):
            self.conclude_state = KVPoll.Failed
            return
        sender = self.prefill_info.target_tp_rank
        # A decode of k times the prefill's attention TP (MLA): SGLang has decode ranks
        # k*p .. k*p + k - 1 take prefill rank p's bytes, each a copy of its own.
        prefill_tp, decode_tp = int(self.prefill_info.attn_tp_size), int(mgr.attn_tp_size)
        self._fan_out = decode_tp // prefill_tp if decode_tp > prefill_tp else 1
        copy = (int(mgr.kv_args.engine_rank) % decode_tp) % self._fan_out
        if sender is not None and handoff_id(room, sender, copy) != self._hid:
            mgr.close_room(room, self._hid)
            mgr.decode_rooms.close(self._hid)  # never asked for: nothing leased
            self._hid = mgr.open_room(room, handoff_id(room, sender, copy))
            mgr.decode_rooms.open(room, self._hid)
        self._excuse_dummy_ranks()

    def _excuse_dummy_ranks(self) -> None:
        """Tell each prefill rank SGLang made dummy for this request (an MLA prefill of larger
        TP: `excusal.py`) that it moves nothing, over SGLang's channel to the rank; a rank that
        cannot be told fails the request, as SGLang's own metadata send does."""
        mgr, room = self.kv_mgr, self.bootstrap_room
        for info in self.bootstrap_infos or []:
            if not info.get("is_dummy"):
                continue
            url = info.get(URL_FIELD)
            if not url:
                mgr.fail(
                    room,
                    f"the dummy prefill rank {info.get('rank_ip')}:"
                    f"{info.get('rank_port')} registered no kvhandoff service",
                )
                self.conclude_state = KVPoll.Failed
                return
            message = excusal.excusal(mgr.secret, room, url)
            if not self._send_bootstrap_message(
                bootstrap_info=info, message=message, operation="send_metadata"
            ):
                return

    def _register_kv_args(self) -> bool:
        return self.bootstrap_infos is not None  # kvhandoff services exchange layouts themselves

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        decode_prefix_len: int | None = None,
        destination: KVTransferDestination = KVTransferDestination.DEVICE,
        device_kv_indices: Any = None,
    ) -> None:
        mgr, room = self.kv_mgr, self.bootstrap_room
        if getattr(self, "conclude_state", None) == KVPoll.Failed:
            return
        if getattr(self, "bootstrap_infos", None) is None:
            mgr.fail(room, f"Could not fetch prefill parallel info from {self.bootstrap_addr}")
            return
        if destination != KVTransferDestination.DEVICE:
            # Refused as the other unsupported features are: this request fails with the
            # reason, the scheduler goes on (an exception here would take it down).
            mgr.fail(
                room,
                f"kvhandoff: KV destination {destination.name} is not supported "
                "(device destinations only)",
            )
            return
        # Tokens the decode holds already (its radix cache): whole pages, which the prefill's
        # service skips; `kv_indices` are the pages after them.
        prefix_tokens, page_size = int(decode_prefix_len or 0), int(mgr.kv_args.page_size)
        if prefix_tokens % page_size:
            mgr.fail(
                room,
                f"kvhandoff: decode_prefix_len = {prefix_tokens} is not a whole number of "
                f"{page_size}-token pages",
            )
            return
        slots, refused = component_slots(mgr.state_types, state_indices)
        if refused:
            mgr.fail(room, f"kvhandoff: {refused}")
            return
        urls = sorted(
            {i[URL_FIELD] for i in self.bootstrap_infos if i.get(URL_FIELD) and not i["is_dummy"]}
        )
        if not urls:
            mgr.fail(
                room,
                f"the bootstrap server at {self.bootstrap_addr} named no kvhandoff "
                "service (a prefill of another backend?)",
            )
            return
        request = HandoffRequest(
            id=self._hid,
            prefill=urls,
            dst_pages=[int(p) for p in np.asarray(kv_indices).tolist()],
            prefix_pages=prefix_tokens // page_size,
            fan_out=self._fan_out,
            dst_slots=slots,
            dst_aux=int(aux_index) if (mgr.rank.has_aux and aux_index is not None) else None,
        )

        hid, rooms = self._hid, mgr.decode_rooms
        if not rooms.creating(hid):
            return  # SGLang gave the request up already: nothing to create

        def create() -> None:
            try:
                mgr.service.expect_handoff(request)
            except (KVHandoffError, ValueError, TimeoutError) as exc:
                rooms.refused(hid)  # refused or cut short before anything was leased
                log.info("create of %s (room %s) refused: %s", hid, room, exc)
                raise
            if rooms.created(hid):  # given up while the create was queued or ran: stopped now
                mgr.abort_decode(room, hid)

        mgr.submit(room, "create", create)
        self.init_time = time.time()

    def _send_abort_notification(self, *, force_arm: bool = False) -> None:
        """SGLang's abort, its waiting timeout, and (with its deferred release) every Failed
        it sees, kvhandoff's own failures included: the handoff is stopped on the abort
        threads, and SGLang holds the pages until `is_abort_release_safe` says released."""
        self.kv_mgr.abort_decode(self.bootstrap_room, self._hid)

    def is_abort_release_safe(self) -> bool:
        """True once the room's handoffs are released: no write of them can land any more."""
        return self.kv_mgr.is_abort_release_safe(self.bootstrap_room)

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.close_room(self.bootstrap_room, self._hid)
        self.kv_mgr.decode_rooms.close(self._hid)

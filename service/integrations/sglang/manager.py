"""The kvhandoff transfer backend's manager for SGLang: one per scheduler rank.

SGLang's schedulers construct it through `get_kv_class` (see `plugin.py`) and reach into
`CommonKVManager` beyond the `Base*` ABCs, so it subclasses it: SGLang's own code keeps the
request table (`request_status`, monotone: `update_status` takes the max and keeps Failed), the
failure records, the PP consensus store (prefill PP rank 0 polls the minimum over the stages),
the bootstrap look-ups and the timeouts. What moves bytes and decides outcomes is kvhandoff:

- every scheduler rank runs one embedded kvhandoff service (`kvhandoff.service.embedded`) over the
  engine's own buffers (layouts from `KVArgs`, `layouts.py`), with its own Mooncake engine, free
  port and locked state directory; prefill ranks register its URL with the bootstrap server,
  signed (`bootstrap.py`);
- one handoff per request and sending prefill attention-TP rank (`ids.py`); with attention CP
  on the prefill, CP rank 0 sends it and the other CP ranks, SGLang's dummy participants, move
  nothing (SGLang's `CommonKVSender.send` ends them at their last send). An MLA prefill of k
  times the decode's attention TP sends from the first of each decode rank's k prefill ranks;
  the decode rank excuses the other k - 1 per request, signed (`excusal.py`), and they reach
  Success at their last send. An MLA decode of k times the prefill's attention TP takes a copy
  on each of the k decode ranks of a prefill rank, a handoff each, whose destination says k
  (`fan_out`); the prefill rank signals every range to all of them and reaches Success once
  all have their bytes (`prefill_rank.py`);
- decode `send_metadata` creates the handoff on the decode service (`receiver.py`); each
  prefill `send` signals its chunk's pages ready at once, as a page range of the stage (the
  slots and aux row with the last), so the chunk's segments travel while the next chunk is
  prefilled;
- the rooms are state machines (`kvhandoff.service.integrations.rooms`: one record per prefill
request
  and per decode handoff, changed only through its transition table); the service's events
  drive them and `update_status` / `record_failure` on its own thread, through the neutral
  outcome each event means (`rooms.outcomes`, mapped to SGLang's `KVPoll` by `STATUS`), so
  `poll()` only reads SGLang's table (a snapshot) and never waits; engine-facing calls that
  wait (create, stage ready, a prefill's abort) run on one worker thread per rank, in order,
  and a decode's aborts on threads of their own, never behind a create;
- the boundary (DESIGN.md): the decode declares SGLang's deferred release, so SGLang frees a
  failed request's pages only once `is_abort_release_safe` says every handoff of the room is
  released (`DecodeRooms.release_safe`); the prefill stops every handoff of a room before
  SGLang's table says Failed (`PrefillRank.stop_then_fail`).

Called by: SGLang's prefill scheduler (`prefill.py`, through the sender: `sender.py`) and
decode scheduler (`decode.py`: `try_ensure_parallel_info`, the receiver: `receiver.py`, then
the manager's `is_abort_release_safe(room, required_acks)` each pass until it frees the pages).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import requests
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVManager
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs
from sglang.srt.runtime_context import get_parallel

from kvhandoff.pipelines.errors import KVHandoffError, PeerUnreachable
from kvhandoff.pipelines.events import DestinationReceived, Event, HandoffReleased
from kvhandoff.service.embedded import EmbeddedService
from kvhandoff.service.integrations.rooms.decode import DecodeRooms
from kvhandoff.service.integrations.rooms.outcomes import Outcome, outcome
from kvhandoff.service.integrations.sglang import excusal
from kvhandoff.service.integrations.sglang.bootstrap import (
    MAX_SKEW_S,
    SIGNATURE_HEADER,
    URL_FIELD,
    sign,
)
from kvhandoff.service.integrations.sglang.layouts import (
    RankLayout,
    Unsupported,
    pool_device,
    rank_layout,
    refuse_unsupported,
    state_types,
)
from kvhandoff.service.integrations.sglang.prefill_rank import PrefillRank
from kvhandoff.service.integrations.sglang.refusals import (
    refuse_context_parallel,
    refuse_decode_prefix_reuse,
    refuse_early_release,
    refuse_rust_registry,
    tp_pairing_refusal,
)
from kvhandoff.service.integrations.sglang.settings import rank_config
from kvhandoff.service.runtime.stages import EngineStage

log = logging.getLogger("kvhandoff.sglang")
ABORT_THREADS = 4
#: The neutral outcomes as SGLang's status table says them (TRANSFERRED is SUCCESS only once
#: every handoff of the room has its bytes: `PrefillRank.transferred`).
STATUS = {
    Outcome.TRANSFERRING: KVPoll.Transferring,
    Outcome.SUCCESS: KVPoll.Success,
    Outcome.FAILED: KVPoll.Failed,
}


def _refuse_unsupported(
    args: Any, server_args: Any, parallel: Any, *, device: str, prefill: bool
) -> None:
    """Unsupported naming the first SGLang setting this rank cannot run with kvhandoff."""
    refuse_unsupported(
        args, device=device, custom_mem_pool=envs.SGLANG_MOONCAKE_CUSTOM_MEM_POOL.get()
    )
    refuse_context_parallel(parallel, args, prefill=prefill)
    refuse_decode_prefix_reuse(server_args, prefill=prefill)
    refuse_rust_registry(prefill=prefill, attn_dp_size=int(parallel.attn_dp_size))
    if parallel.attn_dcp_size > 1:
        raise Unsupported("decode context parallelism (--dcp-size > 1) with kvhandoff")
    if parallel.enable_kv_cache_sharding:
        raise Unsupported("--enable-kv-cache-sharding with kvhandoff")


def _rank_name(parallel: Any, role: str, pp_rank: int) -> str:
    """The rank's name (its state directory under `server.state_dir`)."""
    name = f"sglang-{role}-dp{parallel.attn_dp_rank}-pp{pp_rank}-tp{parallel.attn_tp_rank}"
    if parallel.attn_cp_size > 1:  # CP ranks share their TP rank: each its own state dir
        name += f"-cp{parallel.attn_cp_rank}"
    return name


class KVHandoffManager(CommonKVManager):
    """One scheduler rank's side of the backend: its embedded service, its rooms (a prefill
    rank's in `prefill`, a decode rank's handoffs in `decode_rooms`), SGLang's status table."""

    # SGLang holds a failed request's decode pages until `is_abort_release_safe` says kvhandoff
    # released them (its deferred release), instead of freeing them at Failed.
    supports_deferred_decode_kv_release = True

    # prefill: reads the excusals decode ranks send (SGLang's MLA dummy ranks).
    _listener: excusal.Listener | None
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
        prefill = disaggregation_mode == DisaggregationMode.PREFILL
        _refuse_unsupported(args, server_args, parallel, device=device, prefill=prefill)
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
        num_pages = min((e.num_items for e in self.rank.layout.kv), default=1)
        stage = {"pp_rank": pp_rank, "pp_size": pp_size, "num_pages": num_pages}
        npu = int(getattr(args, "gpu_id", 0) or 0) if device == "npu" else None
        name = _rank_name(parallel, role, pp_rank)
        self.kv_config = rank_config(os.environ, role=role, stage=stage, rank_name=name, npu=npu)
        if not prefill:
            refuse_early_release(self.kv_config.handoff)
        # A prefill CP rank other than 0 is SGLang's dummy participant (the modes where every CP
        # rank sends are refused above): it moves nothing, so it runs no service (no Mooncake
        # engine, no port) and registers no URL.
        self.dummy_cp = prefill and parallel.attn_cp_size > 1 and parallel.attn_cp_rank != 0
        self._service = None if self.dummy_cp else self._start_service(pp_rank)
        self.service_url = None if self._service is None else self._service.url
        # The peer secrets: the current one signs; any of them verifies (a rotation).
        self.secrets = tuple(k.encode() for k in self.kv_config.secrets("peer"))
        self.secret = self.secrets[0]
        self._prefill_role = prefill
        self._init_rooms(self._excusal_keep_s())
        try:
            if self._service is not None:
                self._service.add_listener(self._on_event)
            super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
            self._check_sglang_agrees(parallel, prefill)
            # SGLang's metric multiplies its byte count by this; kvhandoff reports the bytes
            # its handoffs moved instead, every copy of a fanned-out room included
            # (`get_transfer_metric`), so the factor stays 1 and SGLang need not learn it.
            self._kv_replica_factor = 1
            if prefill and self.service_url is not None:
                self._listener = excusal.Listener(
                    self.server_socket, self.secrets, self.service_url, self.prefill.excuse
                ).start()
        except BaseException:
            self._abandon_start()
            raise

    def _abandon_start(self) -> None:
        """A rank that did not come up leaves no thread running and nothing registered."""
        self._calls.shutdown(wait=False)
        self._aborts.shutdown(wait=False)
        if self._service is not None:
            self._service.stop()

    def _start_service(self, pp_rank: int) -> EmbeddedService:
        """The rank's kvhandoff service, embedded, on SGLang's own KV and state buffers."""
        stage = EngineStage(self.rank.layout, self.rank.tensors())
        return EmbeddedService(self.kv_config, buffers={pp_rank: stage}).start()

    def _excusal_keep_s(self) -> float:
        """How long an excusal that comes before its request is kept: as long as a decode may
        still wait on the room — SGLang's bootstrap and waiting timeouts (the decode excuses at
        `init`, before its handoff's deadline starts), or the handoff deadline — and the skew."""
        wait_s = max(
            envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get()
            + envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get(),
            self.kv_config.handoff.default_deadline_s,
        )
        return float(wait_s + MAX_SKEW_S)

    def _check_sglang_agrees(self, parallel: Any, prefill: bool) -> None:
        """SGLang's own verdicts on context parallelism, should a condition of theirs not be
        named by `_refuse_unsupported`."""
        if prefill and self.attn_cp_size > 1 and self.enable_all_cp_ranks_for_transfer:
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

    @property
    def service(self) -> EmbeddedService:
        """The rank's kvhandoff service: every rank that moves bytes runs one."""
        if self._service is None:
            raise RuntimeError("a dummy CP rank of the prefill runs no kvhandoff service")
        return self._service

    def _init_rooms(self, excusal_ttl_s: float) -> None:
        """The rank's rooms, locks and threads (all a room's bookkeeping reads)."""
        # prefill: one record per request (`prefill_rank.py`); decode: one per handoff, until
        # released (SGLang asks `is_abort_release_safe` after it cleared the receiver): what
        # SGLang's deferred release waits for (`kvhandoff.service.integrations.rooms.decode`).
        self.prefill = PrefillRank(self, excusal_ttl_s)
        self.decode_rooms = DecodeRooms()
        # SGLang's update_status reads, then writes: two threads (the scheduler's and the
        # service's) interleaving there could move a room backwards. One writer at a time.
        self._status_lock = threading.RLock()
        self._listener = None
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
        return self.prefill.own(room)

    def fail(self, room: int, reason: str, *, unreachable: bool = False) -> bool:
        """Fail the room with `reason`, unless it failed already (SGLang's abort, say: its
        reason stands, not that of the handoff's abort event that follows it); `unreachable`:
        a prefill rank could not be reached (noted before the status moves, so a poll that sees
        Failed sees the note too). False, changing nothing, for a room this rank is excused
        from: nothing of it can fail."""
        if self._prefill_role:
            if not self.prefill.failing(room, unreachable=unreachable):
                return False
        elif unreachable:
            self.decode_rooms.note_unreachable(room)
        with self._status_lock:  # checked and written as one: the first reason stands
            if self.request_status.get(int(room)) == KVPoll.Failed:
                return True  # failed already (SGLang's abort, or an earlier failure of ours)
            self.record_failure(room, reason)
            self.update_status(room, KVPoll.Failed)
        return True

    def prefill_unreachable(self, room: int) -> bool:
        """Whether the room failed because a prefill rank could not be reached."""
        if self._prefill_role:
            return self.prefill.unreachable(room)
        return self.decode_rooms.unreachable(room)

    def submit(
        self, room: int, what: str, call: Callable[[], Any]
    ) -> concurrent.futures.Future[Any]:
        """Run `call` on the rank's worker thread; an error fails the room naming `what` (a
        prefill's once every handoff of it is stopped: `PrefillRank.stop_then_fail`). Nobody
        reads the call's result, so any error counts: an unexpected one (a CUDA error while
        waiting for SGLang's forward) is logged with its traceback and fails the room the same
        way."""

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
                elif not self.prefill.claim_stop(room):
                    # Excused (nothing of it can fail), or stopped already (failing, failed or
                    # aborted): its first reason stands.
                    log.warning("kvhandoff %s of stopped room %s: %s", what, room, exc)
                else:
                    if not expected:
                        log.exception("kvhandoff %s of room %s failed", what, room)
                    self.prefill.stop_then_fail(room, reason, unreachable=unreachable)
                return None

        return self._calls.submit(run)

    # ------------------------------------------------------------------ decode rooms

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

    # ------------------------------------------------------------------ events -> status

    def _on_event(self, event: Event) -> None:
        """On the service's thread: the rooms take releases and destinations, and SGLang's
        status table follows each handoff's outcome (monotone; `rooms.outcomes`)."""
        if isinstance(event, DestinationReceived):
            if event.role == "prefill" and self._prefill_role:
                self.prefill.destination(event)
            return
        if isinstance(event, HandoffReleased):
            if event.role == "decode":
                self.decode_rooms.released(event.handoff_id)
            return
        prefill, hid = self._prefill_role, event.handoff_id
        room = self.prefill.room_of(hid) if prefill else self.decode_rooms.room_of(hid)
        step = None if room is None else outcome(event, prefill=prefill, stage_rank=self.stage_rank)
        if room is None or step is None:
            return
        match step.outcome:
            case Outcome.FAILED if prefill:  # every handoff of it stops before SGLang hears
                self.prefill.stop(room, step.reason, unreachable=step.unreachable, ended=step.ended)
            case Outcome.FAILED:  # SGLang holds the decode's pages until `handoff.released`
                self.fail(room, step.reason, unreachable=step.unreachable)
            case Outcome.TRANSFERRED:  # a fanned-out room: once every copy has all its bytes
                if self.prefill.transferred(room, hid, step.nbytes, final=step.final):
                    self.update_status(room, KVPoll.Success)
            case _:
                self.update_status(room, STATUS[step.outcome])

    # ------------------------------------------------------------------ prefill

    def open_room(self, room: int) -> str:
        """SGLang opened a prefill request (`PrefillRank.open`); the id of its own handoff."""
        return self.prefill.open(room)

    def close_room(self, room: int) -> None:
        self.prefill.close(room)

    def excused(self, room: int) -> bool:
        return self.prefill.excused(room)

    def moved(self, room: int) -> tuple[int, float | None] | None:
        return self.prefill.moved(room)

    # ------------------------------------------------------------------ bootstrap (signed)

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
        self.prefill.send(
            int(bootstrap_room),
            kv_indices,
            index_slice,
            is_last_chunk,
            aux_index,
            state_indices,
            wait_event,
            indices_event,
        )

    def register_prefill_dp_rank_signed(self, bootstrap_addr: str, room: int) -> None:
        """Tell the bootstrap server which DP rank prefills `room` (signed), on the rank's worker
        thread: the scheduler goes on, and a decode asking before it is there asks again, as
        it does for SGLang's own backends. Refused or unreachable, the request fails with why."""
        url = f"http://{bootstrap_addr}/register_dp_rank"
        body = {"bootstrap_room": int(room), "dp_rank": int(self.attn_dp_rank)}

        def register() -> None:
            why = self._signed("POST", url, body)
            if why is not None:
                self.prefill.stop(
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
        if self._listener is not None:
            self._listener.stop()
        self._calls.shutdown(wait=True)
        self._aborts.shutdown(wait=True)
        if self._service is not None:
            self._service.stop()

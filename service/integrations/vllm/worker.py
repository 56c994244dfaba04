"""The connector's worker half: one embedded kvhandoff service per vLLM worker, over vLLM's own
KV caches, and the handoffs of that worker's requests.

Called by vLLM's model runner (one per TP rank and PP stage): `register` at start-up (the
layout from `register_kv_caches`, `layouts.py`; the service starts on its own thread), `step`
with each step's `StepMeta` (`start_load_kv`), `results` at each step's end
(`get_transfer_results`), `stop` at shutdown. The service's events arrive on its thread
(`_on_event`) and only record outcomes; whatever waits (a stage ready, a create, an abort)
runs on the worker's own threads, never on vLLM's.

One handoff per request and TP rank (`rank_handoff_id`): the prefill's rank r sends to the
decode's rank r (equal TP; each PP stage of the prefill signals its own stage of it).

The boundary rule (DESIGN.md), enforced here:

- decode: a request's blocks stay with vLLM's load (it holds them while the request waits for
  remote KV, or after an abort until the load is reported) until `handoff.released` says no
  write of its handoff can land any more (`DecodeRooms`); only then is the request reported
  received (`finished_recving`), with its failure, if any (`failed_recving`: vLLM recomputes or
  fails it, by its `kv_load_failure_policy`). A request vLLM gives up while it loads has its
  handoff aborted, and is reported once released;
- prefill: a request's blocks are reported free (`finished_sending`) once its stage has all its
  bytes on the decode, or once the stage was stopped (`abort_prefill` returns when no byte of
  it is read any more) after a failure.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
from collections.abc import Mapping
from typing import Any

from kvhandoff.pipelines.decode.views import HandoffRequest
from kvhandoff.pipelines.errors import KVHandoffError
from kvhandoff.pipelines.events import (
    Event,
    HandoffAborted,
    HandoffFailed,
    HandoffReleased,
    StageTransferred,
)
from kvhandoff.service.embedded import EmbeddedService
from kvhandoff.service.integrations.rooms.decode import DecodeRooms
from kvhandoff.service.integrations.rooms.prefill import PrefillRooms
from kvhandoff.service.integrations.sglang.layouts import RankLayout
from kvhandoff.service.integrations.vllm.layouts import rank_layout
from kvhandoff.service.integrations.vllm.metadata import Recv, Send, ServiceHandshake, StepMeta
from kvhandoff.service.integrations.vllm.metadata import rank_handoff_id as handoff_id
from kvhandoff.service.integrations.vllm.settings import ConnectorSettings, rank_config
from kvhandoff.service.runtime.stages import EngineStage

log = logging.getLogger("kvhandoff.vllm")
ABORT_THREADS = 4


class WorkerHalf:
    """One vLLM worker's service and the handoffs of its requests."""

    def __init__(
        self,
        settings: ConnectorSettings,
        kv_cache_config: Any,
        *,
        role: str,
        tp_rank: int,
        tp_size: int,
        pp_rank: int,
        pp_size: int,
        env: Mapping[str, str],
    ) -> None:
        self.settings = settings
        self.kv_cache_config = kv_cache_config
        self.role = role  # "prefill" or "decode"
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.env = dict(env)  # what the service's settings read (`KVHANDOFF_*`)
        self.rank: RankLayout | None = None
        #: vLLM's KV cache is registered with Mooncake (direct mode), not only read and
        #: written in process (landed mode): set by `register`.
        self.direct = False
        self._service: EmbeddedService | None = None
        self._lock = threading.Lock()
        self._rooms = itertools.count(1)
        # Engine calls that wait run here: stage ready and create in order on one thread,
        # aborts on threads of their own (never behind a create).
        self._calls = concurrent.futures.ThreadPoolExecutor(1, "kvhandoff-vllm-calls")
        self._aborts = concurrent.futures.ThreadPoolExecutor(ABORT_THREADS, "kvhandoff-vllm-abort")
        # prefill: handoff id -> (request, room); requests whose blocks may be freed
        self.prefill_rooms = PrefillRooms(early_kept=0)
        self._sending: dict[str, tuple[str, int]] = {}
        self._sent: set[str] = set()
        self._sending_reqs: set[str] = set()  # requests signalled here, until reported
        self._finished_seen: set[str] = set()  # of those, the ones vLLM said finished
        # decode: handoff id -> (request, room); request -> handoff id while it loads
        self.decode_rooms = DecodeRooms()
        self._loading: dict[str, tuple[str, int]] = {}
        self._hid_of: dict[str, str] = {}
        self._received: set[str] = set()
        self._failed: set[str] = set()

    # ------------------------------------------------------------------ start-up

    def register(self, kv_caches: Mapping[str, Any]) -> None:
        """Build the layout over vLLM's caches and start the worker's service on them."""
        device = str(next(iter(kv_caches.values())).device) if kv_caches else "cpu"
        rank = rank_layout(
            kv_caches,
            self.kv_cache_config,
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
            device=device,
        )
        num_pages = min((e.num_items for e in rank.layout.kv), default=1)
        stage = {"pp_rank": self.pp_rank, "pp_size": self.pp_size, "num_pages": num_pages}
        config = rank_config(
            self.settings,
            self.env,
            role=self.role,
            stage=stage,
            rank_name=f"vllm-{self.role}-pp{self.pp_rank}-tp{self.tp_rank}",
        )
        self.direct = config.transfer.mode == "direct"
        service = EmbeddedService(
            config, buffers={self.pp_rank: EngineStage(rank.layout, rank.tensors())}
        ).start()
        try:
            self.attach(service)
        except BaseException:
            service.stop()  # a worker that did not come up leaves nothing registered
            raise
        self.rank = rank
        log.info("kvhandoff %s service of worker pp%d tp%d at %s", self.role,
                 self.pp_rank, self.tp_rank, service.url)  # fmt: skip

    def attach(self, service: EmbeddedService) -> None:
        """Run this worker's handoffs on `service` (started; `register` builds it over vLLM's
        caches) and follow its events."""
        service.add_listener(self._on_event)
        self._service = service

    @property
    def service(self) -> EmbeddedService:
        if self._service is None:
            raise RuntimeError("register_kv_caches has not run on this worker")
        return self._service

    def handshake(self) -> ServiceHandshake | None:
        return None if self._service is None else ServiceHandshake(self._service.url)

    # ------------------------------------------------------------------ each step

    def step(self, meta: StepMeta) -> None:
        """This step's new work: prefilled requests to signal, decode loads to create."""
        for send in meta.sends:
            self._send(send)
        for recv in meta.recvs:
            self._recv(recv)

    def results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call. A
        request vLLM finished while its handoff loads is aborted here (reported once
        released)."""
        aborts: list[str] = []
        with self._lock:
            self._finished_seen |= finished_req_ids & self._sending_reqs
            for req_id in finished_req_ids:
                hid = self._hid_of.get(req_id)
                if hid is not None and self.decode_rooms.cancel(hid):
                    aborts.append(hid)
            # vLLM takes a sent request only once it reported it finished.
            sending = self._sent & self._finished_seen
            self._sent -= sending
            self._finished_seen -= sending
            self._sending_reqs -= sending
            received, failed = self._received, self._failed
            self._received, self._failed = set(), set()
        for hid in aborts:
            self._abort_load(hid)
        return sending, received, failed

    # ------------------------------------------------------------------ prefill

    def _send(self, send: Send) -> None:
        hid = handoff_id(send.handoff, self.tp_rank)
        with self._lock:
            room = next(self._rooms)
            self.prefill_rooms.open(room, hid)
            rec = self.prefill_rooms.get(room)
            assert rec is not None
            self.prefill_rooms.chunk(rec, len(send.pages), is_last=True, waiting=[])
            self._sending[hid] = (send.req_id, room)
            self._sending_reqs.add(send.req_id)

        def ready() -> None:
            try:
                self.service.stage_ready(hid, self.pp_rank, send.pages, src_slots=send.slots)
            except (KVHandoffError, ValueError, TimeoutError) as exc:
                log.warning("stage ready of %s refused: %s", hid, exc)
                self._stop_send(hid, f"stage ready refused: {exc}")

        self._calls.submit(ready)

    def _send_done(self, hid: str) -> None:
        """The request's stage reads none of its blocks any more: vLLM may free them."""
        with self._lock:
            entry = self._sending.pop(hid, None)
            if entry is None:
                return
            req_id, room = entry
            self.prefill_rooms.close(room)
            self._sent.add(req_id)

    def _stop_send(self, hid: str, reason: str) -> None:
        """Stop the stage (returns once it reads nothing), then report the blocks free."""
        with self._lock:
            entry = self._sending.get(hid)
            rec = None if entry is None else self.prefill_rooms.get(entry[1])
            if rec is None or not self.prefill_rooms.stop(rec):
                return  # stopped already, or ended

        def stop() -> None:
            try:
                self.service.abort_prefill(hid, reason)
            except (KVHandoffError, ValueError, TimeoutError) as exc:
                # Not reported free: a stage that may still read keeps its blocks.
                log.error("could not stop %s; its blocks stay held: %s", hid, exc)
                return
            self._send_done(hid)

        self._aborts.submit(stop)

    # ------------------------------------------------------------------ decode

    def _recv(self, recv: Recv) -> None:
        hid = handoff_id(recv.params.id, self.tp_rank)
        with self._lock:
            room = next(self._rooms)
            self.decode_rooms.open(room, hid)
            self._loading[hid] = (recv.req_id, room)
            self._hid_of[recv.req_id] = hid
        services = recv.params.services
        if len(services) != self.tp_size:
            self._refused(hid, f"the prefill has TP {len(services)}, this decode {self.tp_size}")
            return
        request = HandoffRequest(
            id=hid,
            prefill=list(services[self.tp_rank]),
            dst_pages=recv.pages,
            prefix_pages=recv.prefix_pages,
            dst_slots=recv.slots,
        )

        def create() -> None:
            if not self.decode_rooms.creating(hid):
                self._refused(hid, "given up before its create")
                return
            try:
                self.service.expect_handoff(request)
            except (KVHandoffError, ValueError, TimeoutError) as exc:
                self._refused(hid, f"create refused: {exc}")
                return
            if self.decode_rooms.created(hid):  # vLLM gave it up while it was created
                self._abort_load(hid)

        self._calls.submit(create)

    def _refused(self, hid: str, reason: str) -> None:
        """Nothing was leased (the create never ran or was refused): failed at once."""
        log.warning("decode handoff %s: %s", hid, reason)
        self.decode_rooms.refused(hid)
        self._load_ended(hid, ok=False)

    def _load_ended(self, hid: str, *, ok: bool) -> None:
        """No write of `hid` can land any more: vLLM may use (or free) the blocks."""
        with self._lock:
            entry = self._loading.pop(hid, None)
            if entry is None:
                return
            req_id, _ = entry
            self._hid_of.pop(req_id, None)
            self.decode_rooms.close(hid)
            self._received.add(req_id)
            if not ok:
                self._failed.add(req_id)

    def _abort_load(self, hid: str) -> None:
        def abort() -> None:
            try:
                self.service.abort(hid)  # returns once released; the event reports it
            except (KVHandoffError, ValueError, TimeoutError) as exc:
                log.error("abort of %s: %s (its blocks stay held until released)", hid, exc)

        self._aborts.submit(abort)

    # ------------------------------------------------------------------ events

    def _on_event(self, event: Event) -> None:
        """On the service's thread: outcomes only; whatever waits goes to a worker thread."""
        match event:
            case HandoffReleased(role="decode"):
                self.decode_rooms.released(event.handoff_id)
                self._load_ended(event.handoff_id, ok=event.outcome == "completed")
            case StageTransferred(role="prefill", final=True) if event.pp_rank == self.pp_rank:
                self._send_done(event.handoff_id)
            case HandoffFailed(role="prefill") | HandoffAborted(role="prefill"):
                self._stop_send(event.handoff_id, event.reason)
            case _:
                pass

    # ------------------------------------------------------------------ shutdown

    def stop(self) -> None:
        """Abort live handoffs and return once no write can land in vLLM's caches."""
        self._calls.shutdown(wait=False, cancel_futures=True)
        self._aborts.shutdown(wait=False, cancel_futures=True)
        if self._service is not None:
            self._service.stop()

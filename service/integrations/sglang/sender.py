"""The prefill side of one request on one scheduler rank, as SGLang's prefill scheduler calls
it (`prefill.py`): `__init__` (the room opens), `init`, `send` per chunk (SGLang's
`CommonKVSender.send` calls the manager's `add_transfer_request`), `poll` /
`poll_pp_consensus`, `failure_exception`, `abort`, `clear` (the room closes), and
`get_transfer_metric` after it. The room's bookkeeping is the manager's (`prefill_rank.py`).
"""

from __future__ import annotations

from sglang.srt.disaggregation.base.conn import KVPoll, KVTransferMetric
from sglang.srt.disaggregation.common.conn import CommonKVSender

from kvhandoff.service.integrations.sglang.manager import KVHandoffManager


class KVHandoffSender(CommonKVSender):
    """Prefill side of one request on one rank (see the module doc)."""

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

    def _owns_room(self) -> bool:
        """False for a second sender of a room SGLang's deferred bootstrap refused (a duplicate
        request id): the room, its handoffs and its record are the first sender's."""
        return getattr(self.kv_mgr, "deferred_bootstrap", None) is None or bool(
            self._owns_bootstrap_room
        )

    def abort(self) -> None:
        super().abort()
        mgr, room = self.kv_mgr, self.bootstrap_room
        if mgr.is_dummy_cp_rank or not self._owns_room():
            return  # a CP rank that sends nothing, or a duplicate: no handoff to give up
        if mgr.excused(room):
            # Nothing to give up, but a withdrawal may still be queued: SGLang frees the source
            # pages next, so wait for the worker to have run it.
            mgr.submit(room, "abort", lambda: None).result()
            return
        # Waited for (after any queued stage signal): SGLang frees the source pages next. Every
        # copy of a fanned-out room is stopped too.
        stop = mgr.submit(room, "abort", lambda: mgr.prefill.abort_room(room, "aborted by SGLang"))
        stop.result()

    def clear(self) -> None:
        """SGLang is done with the request. Without a Success it frees the source pages next
        (`failure_exception` clears, then SGLang releases them), whoever failed it: every
        handoff of the room is stopped first (`PrefillRank.before_release`)."""
        mgr, room = self.kv_mgr, self.bootstrap_room
        if not self._owns_room():
            self._at_clear = (None, False)
            super().clear()
            return
        succeeded = KVPoll.Success in (self.conclude_state, mgr.request_status.get(room))
        if not succeeded and not mgr.is_dummy_cp_rank:
            mgr.prefill.before_release(room, "the request failed or was cleared by SGLang")
        self._at_clear = (mgr.moved(room), mgr.excused(room))
        super().clear()
        mgr.close_room(room)

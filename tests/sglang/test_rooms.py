"""A prefill rank's room bookkeeping: its excusals (`excusal.Excusals`) and the manager's send
path around them, on SGLang's own status table, without processes."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import KVTransferError
from sglang.srt.observability.trace import TraceNullContext

from kvhandoff.pipelines.events import (
    DestinationReceived,
    HandoffAborted,
    HandoffCreated,
    HandoffFailed,
    HandoffReleased,
    StageTransferred,
)
from kvhandoff.service.integrations.sglang import excusal
from kvhandoff.service.integrations.sglang.manager import KVHandoffManager
from kvhandoff.service.integrations.sglang.sender import KVHandoffSender
from tests.fakes import Clock

TTL = 100.0


def test_an_excusal_for_an_open_room_holds_until_the_room_clears() -> None:
    clock = Clock()
    rooms = excusal.Excusals(TTL, cap=4, clock=clock)
    assert rooms.excuse(7, opened=True)
    clock.now += 10 * TTL  # no age ends it while its sender is open
    assert 7 in rooms and not rooms.excuse(7, opened=True)  # a repeat
    rooms.close(7)
    assert 7 not in rooms and len(rooms) == 0


def test_an_early_excusal_binds_to_a_sender_within_its_time_and_not_after() -> None:
    clock = Clock()
    rooms = excusal.Excusals(TTL, cap=4, clock=clock)
    assert rooms.excuse(1, opened=False) and 1 not in rooms  # no sender yet
    assert not rooms.excuse(1, opened=False)  # a repeat within its time
    clock.now += TTL - 1
    assert rooms.open(1) and 1 in rooms  # the request came: bound to its sender
    assert rooms.excuse(2, opened=False)
    clock.now += TTL + 1
    assert not rooms.open(2) and 2 not in rooms  # too late: an earlier request's
    assert not rooms.open(3)  # never excused


def test_the_cap_and_the_time_evict_early_excusals_only() -> None:
    clock = Clock()
    rooms = excusal.Excusals(TTL, cap=2, clock=clock)
    assert rooms.excuse(9, opened=True)  # bound: never evicted
    for room in (1, 2, 3):
        assert rooms.excuse(room, opened=False)
        clock.now += 1
    assert not rooms.open(1)  # the oldest early one went when a third came
    assert rooms.open(2) and 9 in rooms
    clock.now += TTL + 1
    assert rooms.excuse(4, opened=False)  # evicts 3, now stale, from the front
    assert len(rooms) == 3 and not rooms.open(3)  # 9 and 2 bound, 4 early


def rank() -> KVHandoffManager:
    """A prefill rank's manager with its rooms (`_init_rooms`, as every rank's) and SGLang's
    status table, no service: what the send path, `excuse` and `open_room` use."""
    mgr = object.__new__(KVHandoffManager)
    mgr._init_rooms(TTL)
    mgr.__dict__.update(
        _service=None,
        state_types=[],
        rank=SimpleNamespace(layout=SimpleNamespace(components=()), has_aux=False),
        tp_rank_for_handoffs=1,
        stage_rank=0,
        _prefill_role=True,
        request_status={},
        failure_records={},
        failure_lock=threading.Lock(),
        deferred_bootstrap=None,
    )
    return mgr


def settled(mgr: KVHandoffManager) -> None:
    mgr._calls.submit(lambda: None).result(timeout=5)


def test_an_excused_room_moves_nothing_and_succeeds_at_its_last_send() -> None:
    mgr = rank()
    mgr.prefill.excuse(5)  # the decode paired before the request reached this rank
    mgr.open_room(5)
    mgr.request_status[5] = KVPoll.WaitingForInput
    mgr.add_transfer_request(5, np.array([3, 4]), slice(0, 2), False)
    assert mgr.request_status[5] == KVPoll.WaitingForInput
    mgr.add_transfer_request(5, np.array([8]), slice(2, 3), True)
    settled(mgr)
    assert mgr.request_status[5] == KVPoll.Success
    rec = mgr.prefill.rooms.get(5)  # no range was signalled, no event routes to it
    assert rec is not None and rec.excused and rec.sent == 0
    assert mgr.prefill.room_of("sglang-5-tp1") is None
    assert not mgr.fail(5, "a failure of this rank") and 5 not in mgr.failure_records


def test_a_send_refused_under_the_rank_s_lock_fails_its_room_without_waiting_on_itself() -> None:
    # A send after the room's last chunk is refused inside the send's critical section, and
    # failing the room reads the excusals under the same lock: re-entered, not waited on.
    mgr = rank()
    # A service that takes the first send (without one, its signal would fail the room on the
    # worker thread, racing the refusal below for the room's reason).
    given_up: list[str] = []
    mgr.__dict__["_service"] = SimpleNamespace(
        stage_ready=lambda *args, **kw: None,
        # SGLang's status when the handoff is given up: the room fails only once it stopped.
        abort_prefill=lambda hid, reason: given_up.append(f"{hid} {mgr.request_status[6]}"),
    )
    mgr.open_room(6)
    mgr.request_status[6] = KVPoll.WaitingForInput
    mgr.add_transfer_request(6, np.array([1]), slice(0, 1), True)
    settled(mgr)

    sent = threading.Thread(
        target=mgr.add_transfer_request, args=(6, np.array([2]), slice(1, 2), True)
    )
    sent.start()
    sent.join(timeout=5)
    assert not sent.is_alive(), "the refused send waits on its own lock"
    settled(mgr)
    assert mgr.request_status[6] == KVPoll.Failed
    assert "1 pages sent after the last chunk" in mgr.failure_records[6]
    # Its handoff was given up first, while SGLang still saw the room waiting.
    assert given_up == [f"sglang-6-tp1 {KVPoll.WaitingForInput}"]


def test_an_early_sent_prefix_is_signalled_only_once_its_forward_has_run() -> None:
    # SGLang's early cached-prefix send comes with an event on the forward stream that may
    # still be writing those pages: the range reaches the service only after it completed.
    mgr = rank()
    order: list[str] = []
    released = threading.Event()

    class ForwardEvent:  # torch.cuda.Event's one method used here
        def synchronize(self) -> None:
            assert released.wait(5), "never released"
            order.append("forward done")

    class Service:
        def stage_ready(self, hid: str, rank: int, pages: object, **kw: object) -> None:
            order.append(f"signalled {hid} {np.asarray(pages).tolist()}")

    mgr.__dict__["_service"] = Service()
    mgr.open_room(7)
    mgr.request_status[7] = KVPoll.WaitingForInput
    mgr.add_transfer_request(7, np.array([3, 4]), slice(0, 2), False, wait_event=ForwardEvent())
    assert order == []  # the scheduler went on; the worker waits, nothing was signalled
    released.set()
    settled(mgr)
    assert order == ["forward done", "signalled sglang-7-tp1 [3, 4]"]


def test_a_device_error_while_waiting_for_the_forward_fails_the_room_and_gives_it_up() -> None:
    mgr = rank()
    given_up: list[tuple[str, str]] = []

    class BrokenEvent:
        def synchronize(self) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    class Service:
        def stage_ready(self, *args: object, **kw: object) -> None:
            raise AssertionError("signalled although its forward never completed")

        def abort_prefill(self, hid: str, reason: str) -> None:
            given_up.append((hid, reason))

    mgr.__dict__["_service"] = Service()
    mgr.open_room(8)
    mgr.request_status[8] = KVPoll.WaitingForInput
    mgr.add_transfer_request(8, np.array([1]), slice(0, 1), False, wait_event=BrokenEvent())
    settled(mgr)
    assert mgr.request_status[8] == KVPoll.Failed
    assert "stage ready failed: CUDA error" in mgr.failure_records[8]
    assert given_up == [("sglang-8-tp1", mgr.failure_records[8])]


# ------------------------------------------------------------ fan-out (an MLA decode of larger TP)


class Recorder:
    """The rank's service, as far as the send path uses it: what was signalled and given up,
    with the room's SGLang status at that moment."""

    def __init__(self, mgr: KVHandoffManager, room: int) -> None:
        self.mgr, self.room = mgr, room
        self.calls: list[str] = []

    def stage_ready(self, hid: str, rank: int, pages: object, **kw: object) -> None:
        self.calls.append(f"signalled {hid} {np.asarray(pages).tolist()} last={kw['last_pages']}")

    def abort_prefill(self, hid: str, reason: str) -> None:
        names = {int(v): k for k, v in vars(KVPoll).items() if k[0].isupper()}
        status = names[int(self.mgr.request_status[self.room])]
        self.calls.append(f"gave up {hid} while {status}")


def fanned(room: int) -> tuple[KVHandoffManager, Recorder]:
    mgr = rank()
    mgr.__dict__["_prefill_role"] = True
    service = Recorder(mgr, room)
    mgr.__dict__["_service"] = service
    mgr.open_room(room)
    mgr.request_status[room] = KVPoll.WaitingForInput
    return mgr, service


def destination(hid: str, fan_out: int) -> DestinationReceived:
    return DestinationReceived(
        handoff_id=hid, role="prefill", pp_ranks=[0], decode_url="d", num_pages=3, fan_out=fan_out
    )


def transferred(hid: str) -> StageTransferred:
    return StageTransferred(
        handoff_id=hid,
        role="prefill",
        pp_rank=0,
        blocks=1,
        bytes=10,
        batches=1,
        seconds=0.0,
        final=True,
    )


def test_a_copy_gets_a_range_only_once_the_own_handoff_did_after_its_forward() -> None:
    mgr, service = fanned(9)
    mgr._on_event(destination("sglang-9-tp1", 2))  # the fan-out is known before any send
    released = threading.Event()

    class ForwardEvent:
        def synchronize(self) -> None:
            assert released.wait(5), "never released"
            service.calls.append("forward done")

    mgr.add_transfer_request(9, np.array([3, 4]), slice(0, 2), False, wait_event=ForwardEvent())
    mgr.add_transfer_request(9, np.array([5]), slice(2, 3), True)
    assert service.calls == []  # both wait behind the forward: no copy went ahead of it
    released.set()
    settled(mgr)
    assert service.calls == [
        "forward done",
        "signalled sglang-9-tp1 [3, 4] last=False",
        "signalled sglang-9-tp1-r1 [3, 4] last=False",
        "signalled sglang-9-tp1 [5] last=True",
        "signalled sglang-9-tp1-r1 [5] last=True",
    ]


def test_a_fan_out_learned_late_replays_every_range_to_each_copy_in_order() -> None:
    # A copy's destination (rank 2's) is the first this rank hears of the fan-out.
    mgr, service = fanned(10)
    mgr.add_transfer_request(10, np.array([1, 2]), slice(0, 2), False)
    mgr.add_transfer_request(10, np.array([3]), slice(2, 3), True)
    settled(mgr)
    mgr._on_event(destination("sglang-10-tp1-r2", 3))
    settled(mgr)
    for hid in ("sglang-10-tp1", "sglang-10-tp1-r1", "sglang-10-tp1-r2"):
        assert [c for c in service.calls if c.split()[1] == hid] == [
            f"signalled {hid} [1, 2] last=False",
            f"signalled {hid} [3] last=True",
        ]
    assert len(service.calls) == 6


def test_a_fanned_out_room_succeeds_only_once_every_copy_has_all_its_bytes() -> None:
    mgr, _ = fanned(11)
    mgr._on_event(destination("sglang-11-tp1", 3))
    mgr._on_event(transferred("sglang-11-tp1"))
    mgr._on_event(transferred("sglang-11-tp1-r2"))
    assert mgr.request_status[11] != KVPoll.Success
    mgr._on_event(transferred("sglang-11-tp1-r1"))
    assert mgr.request_status[11] == KVPoll.Success
    assert mgr.moved(11) is not None and mgr.moved(11)[0] == 30  # every copy's bytes


def test_a_failed_copy_stops_the_others_before_the_room_fails() -> None:
    # SGLang frees the source pages once it sees Failed: every other handoff of the room is
    # given up (each returns once none of its writes can land) while the room still waits.
    mgr, service = fanned(12)
    mgr._on_event(destination("sglang-12-tp1", 3))
    mgr._on_event(HandoffAborted(handoff_id="sglang-12-tp1-r1", role="prefill", reason="gone"))
    settled(mgr)
    assert service.calls == [
        "gave up sglang-12-tp1 while WaitingForInput",
        "gave up sglang-12-tp1-r2 while WaitingForInput",
    ]
    assert mgr.request_status[12] == KVPoll.Failed
    assert "sglang-12-tp1-r1 aborted: gone" in mgr.failure_records[12]
    # The give-ups' own failure events change nothing: the first reason stands.
    mgr._on_event(HandoffAborted(handoff_id="sglang-12-tp1", role="prefill", reason="given up"))
    settled(mgr)
    assert "sglang-12-tp1-r1 aborted: gone" in mgr.failure_records[12]


def test_a_refused_send_in_a_fanned_out_room_stops_every_copy_before_it_fails() -> None:
    # A send after the last chunk is refused: the own handoff and both copies are given up
    # while SGLang still waits, and the refusal is the reason.
    mgr, service = fanned(13)
    mgr._on_event(destination("sglang-13-tp1", 3))
    mgr.add_transfer_request(13, np.array([1]), slice(0, 1), True)
    settled(mgr)
    service.calls.clear()
    mgr.add_transfer_request(13, np.array([2]), slice(1, 2), True)
    settled(mgr)
    assert service.calls == [
        f"gave up {hid} while WaitingForInput"
        for hid in ("sglang-13-tp1", "sglang-13-tp1-r1", "sglang-13-tp1-r2")
    ]
    assert mgr.request_status[13] == KVPoll.Failed
    assert "1 pages sent after the last chunk" in mgr.failure_records[13]


def test_a_signal_refused_once_the_room_stopped_keeps_the_first_reason() -> None:
    mgr, service = fanned(14)
    mgr._on_event(destination("sglang-14-tp1", 2))
    mgr._on_event(HandoffAborted(handoff_id="sglang-14-tp1-r1", role="prefill", reason="gone"))

    def refused(hid: str, rank: int, pages: object, **kw: object) -> None:
        raise ValueError(f"handoff {hid!r} already failed")

    service.stage_ready = refused  # type: ignore[method-assign]
    mgr.add_transfer_request(14, np.array([1]), slice(0, 1), True)
    settled(mgr)
    assert mgr.request_status[14] == KVPoll.Failed
    assert "sglang-14-tp1-r1 aborted: gone" in mgr.failure_records[14]
    mgr.close_room(14)
    assert len(mgr.prefill.rooms) == 0  # the room, its fan-out and its ranges are gone
    assert mgr.prefill.room_of("sglang-14-tp1") is None
    assert mgr.prefill.room_of("sglang-14-tp1-r1") is None
    mgr.fail(14, "a late failure of a closed room")
    assert len(mgr.prefill.rooms) == 0  # nothing left behind


def test_sglang_s_abort_stops_every_copy_even_when_one_abort_fails() -> None:
    mgr, service = fanned(15)
    mgr._on_event(destination("sglang-15-tp1", 3))
    tried: list[str] = []

    def abort_prefill(hid: str, reason: str) -> None:
        tried.append(hid)
        if hid == "sglang-15-tp1":
            raise TimeoutError("the service did not answer")

    service.abort_prefill = abort_prefill  # type: ignore[method-assign]
    done = mgr._calls.submit(mgr.prefill.abort_room, 15, "aborted by SGLang")
    with pytest.raises(TimeoutError, match="did not answer"):  # raised once all were tried
        done.result(timeout=5)
    assert tried == ["sglang-15-tp1", "sglang-15-tp1-r1", "sglang-15-tp1-r2"]


def test_a_handoff_that_failed_on_the_prefill_is_stopped_before_sglang_hears_failed() -> None:
    # kvhandoff's own failure (here a lost decode) may be published while a segment of the
    # stage still gathers: the handoff is given up (which returns once none does) first.
    mgr, service = fanned(16)
    failed = HandoffFailed(
        handoff_id="sglang-16-tp1", role="prefill", code="peer_unreachable", reason="silent"
    )
    mgr._on_event(failed)
    settled(mgr)
    assert service.calls == ["gave up sglang-16-tp1 while WaitingForInput"]
    assert mgr.request_status[16] == KVPoll.Failed and mgr.prefill_unreachable(16)
    assert "failed (peer_unreachable): silent" in mgr.failure_records[16]
    mgr._on_event(failed)  # the give-up's own failure event: the first reason stands
    settled(mgr)
    assert len(service.calls) == 1


def test_a_room_that_failed_already_keeps_its_first_reason() -> None:
    # SGLang's abort records its reason and fails the room; the handoff's abort event that
    # follows it (on the service's thread) must not replace that reason.
    mgr = rank()
    mgr.__dict__["_prefill_role"] = False  # a decode rank
    mgr.request_status[17] = KVPoll.Transferring
    mgr.record_failure(17, "Aborted by AbortReq.")
    mgr.update_status(17, KVPoll.Failed)
    assert mgr.fail(17, "kvhandoff handoff sglang-17-tp0 aborted: aborted by request")
    assert mgr.failure_records[17] == "Aborted by AbortReq."
    assert mgr.request_status[17] == KVPoll.Failed


def test_a_decode_room_follows_its_handoff_s_outcome_and_is_freed_only_at_its_release() -> None:
    # The neutral outcomes on SGLang's table: created -> Transferring, a lost prefill ->
    # Failed with the note that has the receiver fetch the prefill's rows again; and the pages
    # are safe to free only at `handoff.released`, after the receiver was cleared.
    mgr = rank()
    mgr.__dict__["_prefill_role"] = False
    mgr.decode_rooms.open(18, "sglang-18-tp0")
    mgr.request_status[18] = KVPoll.WaitingForInput
    assert mgr.decode_rooms.creating("sglang-18-tp0")
    assert not mgr.decode_rooms.created("sglang-18-tp0")
    mgr._on_event(HandoffCreated(handoff_id="sglang-18-tp0", role="decode", num_pages=1, pp_size=1))
    assert mgr.request_status[18] == KVPoll.Transferring
    failed = HandoffFailed(
        handoff_id="sglang-18-tp0", role="decode", code="peer_unreachable", reason="silent"
    )
    mgr._on_event(failed)
    assert mgr.request_status[18] == KVPoll.Failed and mgr.prefill_unreachable(18)
    assert "failed (peer_unreachable): silent" in mgr.failure_records[18]
    mgr.decode_rooms.close("sglang-18-tp0")  # SGLang clears the receiver, then asks
    assert not mgr.is_abort_release_safe(18)
    released = HandoffReleased(
        handoff_id="sglang-18-tp0",
        role="decode",
        outcome="failed",
        confirmed=True,
        seconds_after_outcome=0.1,
    )
    mgr._on_event(released)
    assert mgr.is_abort_release_safe(18) and len(mgr.decode_rooms) == 0


# ------------------------------------------------------------ a room SGLang opens twice or fails


def test_a_second_open_of_a_live_room_keeps_its_position_fan_out_and_copies() -> None:
    # SGLang opens a sender per request before its deferred bootstrap refuses a duplicate room:
    # the live room's record stands, so its next chunk goes on at its position, to its copy,
    # and a failure still gives up every handoff of it before SGLang hears Failed.
    mgr, service = fanned(19)
    mgr._on_event(destination("sglang-19-tp1", 2))
    mgr.add_transfer_request(19, np.array([1, 2]), slice(0, 2), False)
    settled(mgr)
    mgr.open_room(19)
    mgr.add_transfer_request(19, np.array([3]), slice(2, 3), False)
    settled(mgr)
    failed = HandoffFailed(handoff_id="sglang-19-tp1", role="prefill", code="x", reason="y")
    mgr._on_event(failed)
    settled(mgr)
    assert service.calls == [
        "signalled sglang-19-tp1 [1, 2] last=False",
        "signalled sglang-19-tp1-r1 [1, 2] last=False",
        "signalled sglang-19-tp1 [3] last=False",
        "signalled sglang-19-tp1-r1 [3] last=False",
        "gave up sglang-19-tp1 while WaitingForInput",
        "gave up sglang-19-tp1-r1 while WaitingForInput",
    ]
    assert mgr.request_status[19] == KVPoll.Failed


def test_a_stopped_room_opened_again_signals_nothing() -> None:
    mgr, service = fanned(20)
    mgr._on_event(HandoffFailed(handoff_id="sglang-20-tp1", role="prefill", code="x", reason="y"))
    settled(mgr)
    service.calls.clear()
    mgr.open_room(20)
    mgr.add_transfer_request(20, np.array([7]), slice(0, 1), True)
    settled(mgr)
    assert service.calls == [] and mgr.request_status[20] == KVPoll.Failed


def sender_of(mgr: KVHandoffManager, room: int, *, owns: bool = True) -> KVHandoffSender:
    """SGLang's sender of `room` as its `__init__` leaves it, over the manager's tables that
    SGLang's `clear` reads (`owns`: False for a duplicate its deferred bootstrap refused)."""
    mgr.__dict__.update(
        is_dummy_cp_rank=False,
        req_to_decode_prefix_len={},
        transfer_infos={},
        _staging_outstanding={},
        _deferred_ack_poisoned_rooms=set(),
        _deferred_ack_targets={},
        _staging_ctx=None,
    )
    if not owns:
        mgr.__dict__["deferred_bootstrap"] = SimpleNamespace()  # SGLang's, never reached
    sender = object.__new__(KVHandoffSender)
    sender.__dict__.update(
        kv_mgr=mgr,
        bootstrap_room=room,
        conclude_state=None,
        _owns_bootstrap_room=owns,
        trace_ctx=TraceNullContext(),
        _at_clear=None,
    )
    return sender


def test_a_duplicate_sender_s_clear_and_abort_leave_the_live_room_alone() -> None:
    mgr, service = fanned(23)
    mgr.add_transfer_request(23, np.array([1]), slice(0, 1), False)
    settled(mgr)
    duplicate = sender_of(mgr, 23, owns=False)
    duplicate.abort()  # SGLang's abort of a sender that does not own the room: nothing
    duplicate.clear()
    mgr.add_transfer_request(23, np.array([2]), slice(1, 2), True)
    settled(mgr)
    assert service.calls == [
        "signalled sglang-23-tp1 [1] last=False",
        "signalled sglang-23-tp1 [2] last=True",
    ]


def test_sglang_s_own_failure_stops_every_handoff_before_it_frees_the_source_pages() -> None:
    # Another rank failed the request (SGLang's MIN consensus), so this rank's table never said
    # Failed: SGLang's `failure_exception` clears the sender, then frees the source pages. Each
    # handoff of the room is given up before `failure_exception` returns.
    mgr, service = fanned(22)
    mgr._on_event(destination("sglang-22-tp1", 2))
    mgr.add_transfer_request(22, np.array([1]), slice(0, 1), False)
    settled(mgr)
    service.calls.clear()
    with pytest.raises(KVTransferError, match="another rank"):
        sender_of(mgr, 22).failure_exception()
    assert service.calls == [
        "gave up sglang-22-tp1 while WaitingForInput",
        "gave up sglang-22-tp1-r1 while WaitingForInput",
    ]
    assert len(mgr.prefill.rooms) == 0


def test_a_room_that_succeeded_is_cleared_without_a_stop() -> None:
    mgr, service = fanned(24)
    mgr.add_transfer_request(24, np.array([1]), slice(0, 1), True)
    mgr._on_event(transferred("sglang-24-tp1"))
    settled(mgr)
    assert mgr.request_status[24] == KVPoll.Success
    sender = sender_of(mgr, 24)
    sender.conclude_state = KVPoll.Success
    sender.clear()
    assert service.calls == ["signalled sglang-24-tp1 [1] last=True"]  # nothing given up
    assert len(mgr.prefill.rooms) == 0


def test_a_zero_byte_segment_still_counts_as_moved() -> None:
    mgr, _ = fanned(21)
    mgr._on_event(
        StageTransferred(
            handoff_id="sglang-21-tp1",
            role="prefill",
            pp_rank=0,
            blocks=0,
            bytes=0,
            batches=1,
            seconds=0.0,
            final=False,
        )
    )
    assert mgr.moved(21) == (0, None)

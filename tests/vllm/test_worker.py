"""The connector's worker half between vLLM's step hooks and its worker's kvhandoff service
(a `RecordingService`: the calls and events the real one makes, `tests/fakes.py`): what it
asks of the service for each step's metadata, and when it tells vLLM a request's blocks are
done with. The boundary rule is checked here call by call: a decode request is reported only
at `handoff.released` (whatever the outcome came before), a prefill request only once its
stage has all its bytes or was stopped, and only after vLLM said the request finished."""

from __future__ import annotations

from typing import Any

import pytest

from kvhandoff.pipelines.decode.views import HandoffRequest
from kvhandoff.pipelines.errors import PeerUnreachable
from kvhandoff.pipelines.events import (
    HandoffAborted,
    HandoffCompleted,
    HandoffFailed,
    HandoffReleased,
    StageTransferred,
)
from kvhandoff.service.integrations.vllm.metadata import (
    PARAMS_VERSION,
    HandoffParams,
    Recv,
    Send,
    StepMeta,
)
from kvhandoff.service.integrations.vllm.settings import ConnectorSettings
from kvhandoff.service.integrations.vllm.worker import WorkerHalf
from tests.fakes import RecordingService, wait_until

BASE = "vllm-engine-req"
SERVICES = [["http://p0:1"], ["http://p1:1"]]  # [tp][pp]


def worker(
    role: str, *, tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1
) -> tuple[WorkerHalf, RecordingService]:
    half = WorkerHalf(
        ConnectorSettings(), None, role=role, tp_rank=tp_rank, tp_size=tp_size,
        pp_rank=pp_rank, pp_size=pp_size, env={},
    )  # fmt: skip
    service = RecordingService()
    half.attach(service)  # type: ignore[arg-type]
    return half, service


def recv(tp_size: int = 1, **kw: Any) -> Recv:
    params = HandoffParams(version=PARAMS_VERSION, id=BASE, services=SERVICES[:tp_size], tokens=37)
    return Recv("d-1", params, [5, 6], 0, {"mamba.g1": 9}, **kw)


def released(hid: str, outcome: str) -> HandoffReleased:
    return HandoffReleased(
        handoff_id=hid, role="decode", outcome=outcome, confirmed=True, seconds_after_outcome=0.0
    )


def created(service: RecordingService, n: int = 1) -> HandoffRequest:
    wait_until(lambda: len(service.named("expect_handoff")) >= n, what="the create")
    request = service.named("expect_handoff")[n - 1][0][0]
    assert isinstance(request, HandoffRequest)
    return request


def test_decode_reports_a_load_only_once_released() -> None:
    half, service = worker("decode")
    half.step(StepMeta(recvs=[recv()]))
    request = created(service)
    assert (request.id, request.prefill, request.dst_pages) == (f"{BASE}-tp0", SERVICES[0], [5, 6])
    assert request.dst_slots == {"mamba.g1": 9} and request.prefix_pages == 0
    assert half.results(set()) == (set(), set(), set())
    service.emit(HandoffCompleted(handoff_id=request.id, role="decode", bytes=1, seconds=0.1,
                                  verified=True))  # fmt: skip
    assert half.results(set()) == (set(), set(), set())  # an outcome is not a release
    service.emit(released(request.id, "completed"))
    assert half.results(set()) == (set(), {"d-1"}, set())
    assert half.results(set()) == (set(), set(), set())  # once


def test_a_failed_load_is_reported_failed_at_its_release() -> None:
    half, service = worker("decode")
    half.step(StepMeta(recvs=[recv()]))
    request = created(service)
    service.emit(HandoffFailed(handoff_id=request.id, role="decode", code="x", reason="y"))
    assert half.results(set()) == (set(), set(), set())  # a writer may still land
    service.emit(released(request.id, "failed"))
    assert half.results(set()) == (set(), {"d-1"}, {"d-1"})


def test_a_request_vllm_finishes_while_it_loads_is_aborted_and_reported_once_released() -> None:
    half, service = worker("decode")
    half.step(StepMeta(recvs=[recv()]))
    request = created(service)
    assert half.results({"d-1"}) == (set(), set(), set())
    wait_until(lambda: service.named("abort") == [((request.id,), {})], what="the abort")
    service.emit(released(request.id, "aborted"))
    assert half.results(set()) == (set(), {"d-1"}, {"d-1"})


def test_a_refused_create_fails_the_load_at_once() -> None:
    half, service = worker("decode")
    service.fail("expect_handoff", PeerUnreachable("no prefill"))
    half.step(StepMeta(recvs=[recv()]))
    created(service)
    wait_until(lambda: half.results(set())[2] == {"d-1"}, what="the failure")


def test_each_tp_rank_takes_its_own_handoff_from_its_own_prefill_rank() -> None:
    half, service = worker("decode", tp_rank=1, tp_size=2)
    half.step(StepMeta(recvs=[recv(tp_size=2)]))
    request = created(service)
    assert (request.id, request.prefill) == (f"{BASE}-tp1", SERVICES[1])


def test_a_prefill_of_another_tp_size_fails_the_load_without_a_create() -> None:
    half, service = worker("decode", tp_rank=0, tp_size=2)
    half.step(StepMeta(recvs=[recv(tp_size=1)]))
    assert half.results(set()) == (set(), {"d-1"}, {"d-1"})
    assert service.named("expect_handoff") == []


def transferred(hid: str, final: bool = True, pp_rank: int = 0) -> StageTransferred:
    return StageTransferred(
        handoff_id=hid, role="prefill", pp_rank=pp_rank, blocks=1, bytes=8, batches=1,
        seconds=0.1, final=final,
    )  # fmt: skip


def sent(half: WorkerHalf, service: RecordingService) -> str:
    half.step(StepMeta(sends=[Send("p-1", BASE, [3, 4], {"mamba.g1": 2})]))
    wait_until(lambda: bool(service.named("stage_ready")), what="the ready signal")
    [(args, kw)] = service.named("stage_ready")
    hid = f"{BASE}-tp{half.tp_rank}"
    assert args == (hid, half.pp_rank, [3, 4]) and kw == {"src_slots": {"mamba.g1": 2}}
    return hid


def test_prefill_frees_the_blocks_once_the_stage_has_all_its_bytes() -> None:
    half, service = worker("prefill")
    hid = sent(half, service)
    service.emit(transferred(hid, final=False))
    assert half.results({"p-1"}) == (set(), set(), set())
    service.emit(transferred(hid))
    assert half.results(set()) == ({"p-1"}, set(), set())


def test_a_pp_stage_signals_and_reports_its_own_stage() -> None:
    """A PP prefill: each stage's worker signals its own stage of the rank's handoff (its
    layers, paired with the decode's by global id) and frees on its own stage's bytes."""
    half, service = worker("prefill", tp_rank=1, tp_size=2, pp_rank=1, pp_size=2)
    hid = sent(half, service)
    assert hid == f"{BASE}-tp1"
    service.emit(transferred(hid, pp_rank=0))  # another stage's (another process's) event
    assert half.results({"p-1"}) == (set(), set(), set())
    service.emit(transferred(hid, pp_rank=1))
    assert half.results(set()) == ({"p-1"}, set(), set())


def test_prefill_reports_only_a_request_vllm_said_finished() -> None:
    half, service = worker("prefill")
    service.emit(transferred(sent(half, service)))
    assert half.results(set()) == (set(), set(), set())
    assert half.results({"p-1"}) == ({"p-1"}, set(), set())


@pytest.mark.parametrize("stops", [True, False])
def test_a_failed_prefill_frees_the_blocks_only_once_its_stage_stopped(stops: bool) -> None:
    half, service = worker("prefill")
    if not stops:
        service.fail("abort_prefill", TimeoutError("the stage did not stop"))
    hid = sent(half, service)
    service.emit(HandoffFailed(handoff_id=hid, role="prefill", code="deadline", reason="late"))
    service.emit(HandoffAborted(handoff_id=hid, role="prefill", reason="again"))
    wait_until(lambda: bool(service.named("abort_prefill")), what="the stop")
    assert len(service.named("abort_prefill")) == 1
    if stops:
        wait_until(lambda: half.results({"p-1"})[0] == {"p-1"}, what="the report")
    else:
        assert half.results({"p-1"}) == (set(), set(), set())  # may still read: held

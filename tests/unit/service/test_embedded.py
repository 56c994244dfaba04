"""EmbeddedService: a prefill and a decode service embedded in this process, each on its own thread
and loop, over tensors the test allocates as the engine would; the local transport links them."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from kvhandoff.pipelines.decode.views import HandoffRequest
from kvhandoff.pipelines.errors import (
    ConflictError,
    InvalidInput,
    KVHandoffError,
    NotFoundError,
    PlanError,
)
from kvhandoff.pipelines.states import HandoffState
from kvhandoff.service.config import Config, ConfigError, load_config
from kvhandoff.service.embedded import EmbeddedService, WrongRole, embedded_layout
from kvhandoff.service.http.problems import NotReady, error_problem
from kvhandoff.service.runtime.persistence import PERSISTENCE
from tests.fakes import local_config

MODEL = {"preset": "hybrid-npu-mla", "scale": 64, "num_layers": 8, "page_size": 4}
Tensors = dict[int, list[torch.Tensor]]


def make_config(tmp_path: Path, role: str, **overrides: Any) -> Config:
    stages = (
        [{"num_pages": 32, "num_slots": 4}]
        if role == "decode"
        else [{"pp_rank": r, "pp_size": 2, "num_pages": 16, "num_slots": 4} for r in (0, 1)]
    )
    settings = {"model": MODEL, "handoff.default_deadline_s": 10.0, **overrides}
    return local_config(role, stages, tmp_path, **settings)


def allocate(config: Config, *, seed: int | None = None) -> Tensors:
    """One uint8 tensor per layout entry of every stage, as an engine would: zeros, or random."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    out: Tensors = {}
    for stage in config.stages:
        sizes = embedded_layout(config, stage.pp_rank).region_sizes
        out[stage.pp_rank] = [
            torch.zeros(n, dtype=torch.uint8)
            if gen is None
            else torch.randint(1, 255, (n,), dtype=torch.uint8, generator=gen)
            for n in sizes
        ]
    return out


def service_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvhandoff-embedded")]


@dataclass
class Pair:
    prefill: EmbeddedService
    decode: EmbeddedService
    prefill_config: Config
    decode_config: Config
    src: Tensors
    dst: Tensors


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    p_config = make_config(tmp_path, "prefill")
    src = allocate(p_config, seed=7)
    with EmbeddedService(p_config, buffers=src) as prefill:
        d_config = make_config(tmp_path, "decode", **{"peers.prefill": [prefill.url]})
        dst = allocate(d_config)
        with EmbeddedService(d_config, buffers=dst) as decode:
            yield Pair(prefill, decode, p_config, d_config, src, dst)


def http(method: str, url: str, body: Any = None) -> tuple[int, Any]:
    """A plain blocking request, as any client of an embedded service would make."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        with err:
            return err.code, json.loads(err.read())


def rows(tensor: torch.Tensor, item_len: int, num_items: int) -> np.ndarray[Any, Any]:
    return tensor.numpy()[: item_len * num_items].reshape(num_items, item_len)


# ------------------------------------------------------------------------------------ handoffs


def test_full_handoff_lands_every_byte_in_the_engines_tensors(pair: Pair) -> None:
    src_pages, dst_pages, src_slot, dst_slot = [3, 4, 9], [10, 11, 2], 2, 1
    # The engine signals before the router asks, with arrays it reuses right after the call.
    for rank, layers in ((1, [7]), (1, None), (0, None)):
        pages = np.array(src_pages, dtype=np.int64)
        pair.prefill.stage_ready("r1", rank, pages, src_slot, layers=layers)
        pages[:] = 0
    request = HandoffRequest(id="r1", dst_pages=dst_pages, dst_slot=dst_slot, verify=True)
    view = pair.decode.expect_handoff(request)
    assert view.id == "r1" and [s.pp_rank for s in view.stages] == [0, 1]
    assert pair.decode.expect_handoff(request).created_at == view.created_at  # idempotent

    done = pair.decode.wait("r1", 15.0)
    assert done.state == HandoffState.COMPLETED, done.error
    assert pair.decode.get("r1").state == HandoffState.COMPLETED
    # What an engine waits for before it reuses the pages: every stage arrived, so at once.
    assert pair.decode.released("r1", 5.0)
    assert pair.decode.wait("r1", 5.0, released=True).released_at is not None

    dec = embedded_layout(pair.decode_config, 0)
    dst = pair.dst[0]
    kv_index = {(e.layer_id, e.group): i for i, e in enumerate(dec.kv)}
    state_index = {(s.layer_id, s.kind): len(dec.kv) + j for j, s in enumerate(dec.state)}
    seen = set()
    for rank, tensors in pair.src.items():
        lay = embedded_layout(pair.prefill_config, rank)
        for i, e in enumerate(lay.kv):
            j = kv_index[(e.layer_id, e.group)]
            seen.add(j)
            landed = rows(dst[j], e.item_len, dec.kv[j].num_items)
            assert np.array_equal(
                rows(tensors[i], e.item_len, e.num_items)[src_pages], landed[dst_pages]
            )
            untouched = np.delete(landed, dst_pages, axis=0)
            assert not untouched.any(), (
                f"bytes outside dst_pages in layer {e.layer_id} group {e.group}"
            )
        for i, s in enumerate(lay.state):
            j = state_index[(s.layer_id, s.kind)]
            seen.add(j)
            sent = rows(tensors[len(lay.kv) + i], s.item_len, s.num_slots)[src_slot]
            landed = rows(dst[j], s.item_len, s.num_slots)
            assert np.array_equal(sent, landed[dst_slot])
            assert not np.delete(landed, [dst_slot], axis=0).any()
    assert seen == set(range(len(dst)))  # every decode entry had a source


def test_stage_ready_validates_like_the_http_route(pair: Pair) -> None:
    svc = pair.prefill
    with pytest.raises(PlanError) as err:
        svc.stage_ready("r2", 0, [1, 99], 0)
    assert err.value.context["field"] == "src_pages[1]"
    status, body = http(
        "POST", f"{svc.url}/v1/handoffs/r2/stages/0/ready", {"src_pages": [1, 99], "src_slot": 0}
    )
    assert (status, body["field"]) == (422, "src_pages[1]")

    cases: list[tuple[dict[str, Any], type[KVHandoffError], str]] = [
        ({"src_pages": [[1, 2]]}, PlanError, "src_pages"),
        ({"src_pages": [1.5]}, PlanError, "src_pages"),
        ({"src_pages": None}, InvalidInput, "src_pages"),
        ({"src_slot": -1}, InvalidInput, "src_slot"),
        ({"src_slot": None}, PlanError, "src_slot"),  # hybrid model: the slot is required
        ({"src_slot": 4}, PlanError, "src_slot"),
        ({"layers": [7]}, InvalidInput, "layers"),  # layer 7 lives on stage 1
        ({"layers": [True]}, InvalidInput, "layers[0]"),
        ({"pp_rank": 2}, NotFoundError, "pp_rank"),
        ({"pp_rank": -1}, InvalidInput, "pp_rank"),
        ({"handoff_id": "no spaces"}, InvalidInput, "handoff_id"),
    ]
    for change, error, field in cases:
        args = {"handoff_id": "r2", "pp_rank": 0, "src_pages": [1, 2], "src_slot": 0, **change}
        with pytest.raises(error) as caught:
            svc.stage_ready(**args)
        assert caught.value.context["field"] == field, change

    svc.stage_ready("r2", 0, [1, 2], 0)
    with pytest.raises(ConflictError):  # a stage's pages are fixed by its first signal
        svc.stage_ready("r2", 0, [1, 3], 0)


def test_page_ranges_validate_like_the_http_route_and_land_every_byte(pair: Pair) -> None:
    svc = pair.prefill
    url = f"{svc.url}/v1/handoffs/r6/stages/0/ready"
    svc.stage_ready("r6", 0, [3], pages_from=0, last_pages=False)
    for body, field in (
        ({"src_pages": [4], "pages_from": 2, "last_pages": False}, "pages_from"),  # a gap
        ({"src_pages": [4], "pages_from": 1}, "last_pages"),
        ({"src_pages": [4], "last_pages": True, "src_slot": 2}, "pages_from"),
        ({"src_pages": [4], "pages_from": -1, "last_pages": False}, "pages_from"),
        ({"src_pages": [4], "pages_from": 1, "last_pages": "yes"}, "last_pages"),
        ({"src_pages": [4], "pages_from": 1, "last_pages": False, "src_slot": 2}, "src_slot"),
    ):
        status, problem = http("POST", url, body)
        assert (status, problem["field"]) == (422, field), (body, problem)
    for kwargs, field in (
        ({"pages_from": -1, "last_pages": False}, "pages_from"),
        ({"pages_from": 1, "last_pages": 1}, "last_pages"),
        ({"pages_from": 0, "last_pages": False}, "pages_from"),  # overlaps the first range
    ):
        with pytest.raises(InvalidInput) as caught:
            svc.stage_ready("r6", 0, [4], **kwargs)  # type: ignore[arg-type]
        assert caught.value.context["field"] == field, kwargs
    # The ranges that follow still land the request: HTTP and embedded alike.
    status, ack = http("POST", url, {"src_pages": [4, 9], "pages_from": 1, "last_pages": False})
    assert (status, ack["pages_from"], ack["last_pages"]) == (202, 1, False)
    svc.stage_ready("r6", 0, [], 2, pages_from=3, last_pages=True)
    svc.stage_ready("r6", 1, np.array([3, 4]), pages_from=0, last_pages=False)
    svc.stage_ready("r6", 1, [9], 2, pages_from=2, last_pages=True)
    src_pages, dst_pages, src_slot, dst_slot = [3, 4, 9], [10, 11, 2], 2, 1
    pair.decode.expect_handoff(HandoffRequest(id="r6", dst_pages=dst_pages, dst_slot=dst_slot))
    done = pair.decode.wait("r6", 15.0, released=True)
    assert done.state == HandoffState.COMPLETED, done.error
    dec = embedded_layout(pair.decode_config, 0)
    kv_index = {(e.layer_id, e.group): i for i, e in enumerate(dec.kv)}
    state_index = {(s.layer_id, s.kind): len(dec.kv) + j for j, s in enumerate(dec.state)}
    for rank, tensors in pair.src.items():
        lay = embedded_layout(pair.prefill_config, rank)
        for i, e in enumerate(lay.kv):
            j = kv_index[(e.layer_id, e.group)]
            landed = rows(pair.dst[0][j], e.item_len, dec.kv[j].num_items)
            sent = rows(tensors[i], e.item_len, e.num_items)[src_pages]
            assert np.array_equal(sent, landed[dst_pages]), (e.layer_id, e.group)
        for i, st in enumerate(lay.state):
            j = state_index[(st.layer_id, st.kind)]
            sent = rows(tensors[len(lay.kv) + i], st.item_len, st.num_slots)[src_slot]
            assert np.array_equal(sent, rows(pair.dst[0][j], st.item_len, st.num_slots)[dst_slot])


def test_expect_handoff_validates_like_the_http_route(pair: Pair) -> None:
    svc = pair.decode
    bad = {"id": "r3", "dst_pages": [1, -1], "dst_slot": 0}
    with pytest.raises(InvalidInput) as err:
        svc.expect_handoff(HandoffRequest(**bad))  # type: ignore[arg-type]
    status, body = http("POST", f"{svc.url}/v1/handoffs", bad)
    assert (status, body["field"]) == (422, err.value.context["field"]) == (422, "dst_pages[1]")
    with pytest.raises(PlanError) as err:
        svc.expect_handoff(HandoffRequest(id="r3", dst_pages=[1, 99], dst_slot=0))
    assert err.value.context["field"] == "dst_pages[1]"
    with pytest.raises(InvalidInput) as err:
        svc.expect_handoff(HandoffRequest(id="a b", dst_pages=[1], dst_slot=0))
    assert err.value.context["field"] == "id"
    with pytest.raises(NotFoundError):
        svc.get("r3")  # nothing was created
    with pytest.raises(InvalidInput):
        svc.wait("r3", -1.0)


def test_a_call_of_the_other_role_is_refused(pair: Pair) -> None:
    with pytest.raises(WrongRole, match=r"stage_ready\(\) is a prefill-role call"):
        pair.decode.stage_ready("r4", 0, [1], 0)
    with pytest.raises(WrongRole, match="this service is prefill"):
        pair.prefill.expect_handoff(HandoffRequest(id="r4", dst_pages=[1], dst_slot=0))
    for call in (pair.prefill.get, pair.prefill.abort):
        with pytest.raises(WrongRole):
            call("r4")


def test_abort_and_stop_abort_live_handoffs(pair: Pair) -> None:
    pair.decode.expect_handoff(HandoffRequest(id="r5", dst_pages=[1], dst_slot=0))
    aborted = pair.decode.abort("r5")
    assert aborted.state == HandoffState.ABORTED and aborted.released  # answers once released
    with pytest.raises(ConflictError, match="already aborted"):
        pair.prefill.stage_ready("r5", 0, [1], 0)

    pair.decode.expect_handoff(HandoffRequest(id="r6", dst_pages=[2], dst_slot=1))
    pair.decode.stop()  # the handoff is live: stop aborts it on the prefill side first
    with pytest.raises(ConflictError, match="already aborted"):
        pair.prefill.stage_ready("r6", 0, [2], 1)
    with pytest.raises(NotReady):
        pair.decode.get("r6")


# ------------------------------------------------------------------------------------ lifecycle


def test_http_api_answers_and_publishes_no_address_of_the_engines_buffers(pair: Pair) -> None:
    """A landed prefill registers only its staging buffer: the engine's KV and state buffers
    are not reachable through the transport, and their addresses are not published (issue 31;
    the handoff tests here show the bytes still move from exactly those buffers)."""
    svc = pair.prefill
    status, health = http("GET", f"{svc.url}/healthz")
    assert (status, health["status"], health["role"]) == (200, "ok", "prefill")
    status, layout = http("GET", f"{svc.url}/v1/layout")
    assert status == 200
    assert layout == json.loads(msgspec.json.encode(svc.layout()))
    assert layout["mode"] == "landed"
    for stage in layout["stages"]:
        bases = [e["base"] for e in stage["layout"]["kv"]] + [
            s["base"] for s in stage["layout"]["state"]
        ]
        rank = stage["layout"]["pp_rank"]
        assert len(bases) == len(pair.src[rank]) and set(bases) == {0}


def test_stop_is_idempotent_and_ends_the_thread(tmp_path: Path) -> None:
    config = make_config(tmp_path, "decode")
    EmbeddedService(config).stop()  # never started: nothing to do
    svc = EmbeddedService(config).start()  # no buffers: the configured torch:cpu pool
    url = svc.url
    assert service_threads() == ["kvhandoff-embedded-decode"]
    svc.stop()
    svc.stop()
    assert service_threads() == []
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{url}/healthz", timeout=5)
    with pytest.raises(NotReady):
        _ = svc.url
    with pytest.raises(RuntimeError, match="starts once"):
        svc.start()


def test_a_stall_of_the_service_loop_is_on_its_metrics(tmp_path: Path) -> None:
    """The loop-stall probe runs on the embedded loop: a second the loop could not run (here a
    blocking call on it) shows on `/metrics`, as an operator reads it."""
    svc = EmbeddedService(make_config(tmp_path, "decode")).start()
    try:
        assert svc._loop is not None and svc.stalls is not None
        svc._loop.call_soon_threadsafe(time.sleep, 1.0)
        deadline = time.monotonic() + 10
        while svc.stalls.longest_s < 0.9 and time.monotonic() < deadline:
            time.sleep(0.05)
        with urllib.request.urlopen(f"{svc.url}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        (line,) = [
            x for x in text.splitlines() if x.startswith("kvhandoff_embedded_loop_stall_max")
        ]
        assert 0.9 <= float(line.split()[-1]) < 5.0
        assert 'kvhandoff_embedded_loop_stall_seconds_bucket{le="0.5"}' in text
    finally:
        svc.stop()


def test_wrong_buffers_fail_at_start_naming_stage_and_entry(tmp_path: Path) -> None:
    config = make_config(tmp_path, "prefill")
    buffers = allocate(config)
    sizes = embedded_layout(config, 1).region_sizes

    short = {**buffers, 1: buffers[1][:-1]}
    with pytest.raises(ConfigError, match=f"stage 1 needs {len(sizes)} buffers") as err:
        EmbeddedService(config, buffers=short).start()
    assert err.value.context["field"] == "buffers[1]"

    small = {**buffers, 1: [*buffers[1][:3], torch.zeros(8, dtype=torch.uint8), *buffers[1][4:]]}
    with pytest.raises(
        ConfigError,
        match=rf"stage 1 entry 3 \(conv state of layer 5\) needs {sizes[3]} bytes, "
        "the buffer holds 8",
    ) as err:
        EmbeddedService(config, buffers=small).start()
    assert err.value.context["field"] == "buffers[1][3]"

    with pytest.raises(ConfigError, match=r"given for stages \[0\]"):
        EmbeddedService(config, buffers={0: buffers[0]}).start()
    assert service_threads() == []


def test_a_start_up_error_in_the_service_thread_is_raised_in_the_caller(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        config = make_config(tmp_path, "decode", **{"server.port": taken.getsockname()[1]})
        with pytest.raises(OSError, match="address already in use"):
            EmbeddedService(config).start()
    assert service_threads() == []


def test_an_expect_handoff_that_times_out_was_not_created(tmp_path: Path) -> None:
    # A "prefill" that accepts connections and never answers: the create waits on its layout.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    config = make_config(tmp_path, "decode", **{"peers.request_timeout_s": 30.0})
    try:
        with EmbeddedService(config, buffers=allocate(config), call_timeout_s=0.3) as decode:
            with pytest.raises(TimeoutError, match="was not created"):
                decode.expect_handoff(
                    HandoffRequest(id="late", prefill=[url], dst_pages=[1], dst_slot=0)
                )
            with pytest.raises(NotFoundError):
                decode.get("late")  # and never will be: the create was cut on the loop
    finally:
        silent.close()


# ------------------------------------------------------------------------------------ admission

#: One create body every case below changes one thing of; each change is refused before the
#: create reaches a prefill (none runs here).
ADMITTED = {"id": "adm", "prefill": ["http://127.0.0.1:9"], "dst_pages": [1], "dst_slot": None}


@pytest.fixture(scope="module")
def dense_decode(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedService]:
    """A decode service of a model without state (so a state-only create has nothing to move),
    records on, no webhooks.callback_secret."""
    config = load_config(
        None,
        {},
        {
            "role": "decode",
            "model": {"preset": "dense-mha", "num_layers": 4, "scale": 64, "page_size": 4},
            "stages": [{"num_pages": 8}],
            "server.port": 0,
            "server.state_dir": str(tmp_path_factory.mktemp("dense")),
            "transport.backend": "local",
            "handoff.max_metadata_bytes": 1024,
        },
    )
    with EmbeddedService(config) as svc:
        yield svc


@pytest.mark.parametrize(
    ("change", "field"),
    [
        pytest.param({"prefill": ["ftp://p"]}, "prefill[0]", id="prefill-url-syntax"),
        pytest.param({"prefill": ["http://u:p@p:1"]}, "prefill[0]", id="prefill-url-credentials"),
        pytest.param({"dst_pages": [2**63]}, "dst_pages[0]", id="page-beyond-int64"),
        pytest.param({"dst_slot": 2**63}, "dst_slot", id="slot-beyond-int64"),
        pytest.param({"dst_pages": []}, "dst_pages", id="state-only-without-state"),
        pytest.param({"metadata": {"note": "x" * 2000}}, "metadata", id="metadata-too-large"),
        pytest.param(
            {"callback_url": "https://router.example/cb"}, "callback_url", id="callback-no-secret"
        ),
        pytest.param({}, None, id="records-not-writable"),
    ],
)
def test_the_embedded_api_refuses_what_http_refuses(
    dense_decode: EmbeddedService, change: dict[str, Any], field: str | None
) -> None:
    svc = dense_decode
    body = {**ADMITTED, **change}
    persistence = svc._running_server().app[PERSISTENCE]
    if field is None:
        persistence.broken = "OperationalError: disk I/O error (test)"
    try:
        status, problem = http("POST", f"{svc.url}/v1/handoffs", body)
        with pytest.raises(KVHandoffError) as caught:
            svc.expect_handoff(HandoffRequest(**body))
    finally:
        persistence.broken = None
    embedded_status, embedded = error_problem(caught.value, "/v1/handoffs")
    assert status in (409, 422, 503), problem
    assert (embedded_status, embedded["code"], embedded.get("field")) == (
        status,
        problem["code"],
        problem.get("field"),
    )
    if field is not None:
        assert problem["field"] == field
    else:
        assert (status, problem["not_ready"]) == (503, ["records"])
    with pytest.raises(NotFoundError):
        svc.get("adm")  # neither door created it


def test_an_embedded_create_whose_record_fails_to_write_is_not_accepted(pair: Pair) -> None:
    """Issue 18: only what is recorded is accepted, at the embedded door too (a handoff without
    its record would be gone after a crash: no outcome, no webhook, no fence)."""
    svc = pair.decode

    def read_only(on: bool) -> None:
        def run(runtime: Any) -> None:
            runtime.persistence.db.conn.execute(f"PRAGMA query_only = {'ON' if on else 'OFF'}")

        svc._call_sync(run)

    read_only(True)  # every write now fails, like a full disk
    try:
        with pytest.raises(NotReady) as refused:
            svc.expect_handoff(HandoffRequest(id="unrecorded", dst_pages=[5], dst_slot=1))
        assert refused.value.context["not_ready"] == ["records"]
        # Undone, not left running: aborted, its pages released (no write of it can land).
        view = svc.get("unrecorded")
        assert view.state == HandoffState.ABORTED and view.released
        with pytest.raises(NotReady):  # and nothing more is accepted until a restart
            svc.expect_handoff(HandoffRequest(id="next", dst_pages=[6], dst_slot=2))
    finally:
        read_only(False)


def test_released_waits_for_an_earlier_lifes_fence_after_a_restart(tmp_path: Path) -> None:
    """Issue 18 B: after a restart the embedded `released()` answered False at once for a
    handoff whose pages the previous life's writers may still touch. It waits for the fence to
    lift (False if its timeout comes first), then True."""
    import time

    from kvhandoff.service.records.handoffs import HandoffRecords
    from kvhandoff.service.storage import FILE_NAME, Database

    # The fence must still hold once the service answers: start-up takes well under a second
    # idle, several on a busy machine.
    grace_s, left_s = 20.0, 6.0
    now = time.time()
    db = Database(tmp_path / FILE_NAME)  # what a killed process left: a handoff in flight
    request = HandoffRequest(id="old", prefill=["http://p"], dst_pages=[5, 6], dst_slot=2)
    with db.transaction() as tx:
        HandoffRecords(db, grace_s=grace_s).accepted(tx, request, now - 10, now - grace_s + left_s)
    db.close()
    config = make_config(tmp_path, "decode", **{"handoff.max_grace_s": grace_s})
    with EmbeddedService(config, buffers=allocate(config)) as decode:
        assert decode.get("old").state == HandoffState.FAILED
        assert decode.released("old", 0.0) is False  # fenced: its old writers may still write
        assert decode.released("old", 30.0) is True  # it waited for the fence to lift
        assert decode.get("old").released

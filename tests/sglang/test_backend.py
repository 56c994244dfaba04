"""The backend against SGLang's own classes, in separate processes: a prefill of two PP stages
(one process per stage, as SGLang runs them) and a decode, replaying the call order of SGLang's
prefill.py / decode.py (engine_proc.py), with our bootstrap server in this process and real
Mooncake over TCP on 127.0.0.1 between the ranks' embedded services."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import zmq
from sglang.srt.disaggregation.base.conn import KVPoll

from kvhandoff.service.integrations.sglang import excusal
from kvhandoff.service.integrations.sglang.bootstrap import (
    SIGNATURE_HEADER,
    KVHandoffBootstrapServer,
    sign,
)
from tests.sglang import engine_proc as ep

ROOT = Path(__file__).resolve().parents[2]
SECRET = "sglang-test-peer-secret"
pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serving(port: int) -> None:
    """Wait for a bootstrap server started on its own thread (as SGLang starts it)."""
    for _ in range(200):
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except requests.ConnectionError:
            time.sleep(0.05)
    raise AssertionError(f"no bootstrap server on port {port}")


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[str]
    hello: dict[str, Any] = field(default_factory=dict)  # its first answer, once started

    def ask(self, cmd: dict[str, Any]) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(json.dumps(cmd) + "\n")
        self.popen.stdin.flush()

    def answer(self) -> dict[str, Any]:
        assert self.popen.stdout is not None
        line = self.popen.stdout.readline()
        assert line, f"{self.name} exited ({self.popen.poll()}) without answering"
        return json.loads(line)


@dataclass
class Deployment:
    port: int
    server: KVHandoffBootstrapServer
    prefill: list[Proc]
    decode: Proc
    tmp: Path
    #: Another rank process: (role, pp_rank, variant of engine_proc's memory, its state dir).
    start: Callable[[str, int, dict[str, Any], str], Proc]
    decodes: list[Proc]  # every decode rank (`decode` is the first)
    mode: str  # transfer.mode of every rank


@contextlib.contextmanager
def deploy(
    tmp: Path,
    prefill: list[tuple[int, dict[str, Any]]],
    decode: list[dict[str, Any]],
    pp_size: int,
    *,
    mode: str = "landed",
) -> Iterator[Deployment]:
    """A bootstrap server of its own and one process per rank: the prefill ranks `(pp_rank,
    variant)` of a prefill of `pp_size` stages, then the decode ranks (their variants), all in
    transfer `mode`."""
    (tmp / "model").mkdir()
    (tmp / "model" / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "num_hidden_layers": 8,
                "intermediate_size": 128,
                "vocab_size": 256,
                "max_position_embeddings": 512,
            }
        )
    )

    def write_config(state: str) -> Path:
        path = tmp / f"kvhandoff-{state}.toml"
        path.write_text(
            f'[server]\nstate_dir = "{tmp / state}"\n[auth]\npeer = "{SECRET}"\n'
            f'[transfer]\nmode = "{mode}"\nlanding_bytes = 4194304\nwindow_bytes = 1048576\n'
            "staging_bytes = 4194304\n[handoff]\ndefault_deadline_s = 10.0\n"
            # Deadline + grace within SGLang's deferred release timeout (30 s by default).
            "max_grace_s = 20.0\nheartbeat_interval_s = 0.5\npeer_timeout_s = 2.0\n"
        )
        return path

    config = write_config("state")
    os.environ["SGLANG_KVHANDOFF_CONFIG"] = str(config)  # this process's bootstrap server
    port, dist_port = free_port(), free_port()
    server = KVHandoffBootstrapServer("127.0.0.1", port)
    serving(port)
    started: list[Proc] = []

    def start(
        role: str, pp_rank: int, variant: dict[str, Any] | None = None, state: str = "state"
    ) -> Proc:
        env = {
            **os.environ,
            "SGLANG_KVHANDOFF_CONFIG": str(write_config(state)),
            "HF_HUB_OFFLINE": "1",
        }
        argv = [
            sys.executable,
            "-m",
            "tests.sglang.engine_proc",
            role,
            str(pp_rank),
            str(pp_size),
            str(port),
            str(dist_port),
            str(tmp / "model"),
            json.dumps(variant or {}),
        ]
        v = variant or {}
        name = f"{role}{pp_rank}-tp{v.get('tp_rank', 0)}-cp{v.get('cp_rank', 0)}-{state}"
        log = open(tmp / f"{name}.log", "w")  # noqa: SIM115  -- closed with the process
        popen = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        proc = Proc(name, popen)
        started.append(proc)
        return proc

    prefills = [start("prefill", rank, variant) for rank, variant in prefill]
    decodes = [start("decode", 0, variant) for variant in decode]
    try:
        for p in [*prefills, *decodes]:
            p.hello = p.answer()
            assert p.hello["ready"] and p.hello["manager"] == "KVHandoffManager", p.hello
        yield Deployment(port, server, prefills, decodes[0], tmp, start, decodes, mode)
    finally:
        for p in started:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        for p in started:
            try:
                p.popen.wait(20)
            except subprocess.TimeoutExpired:
                p.popen.kill()
        server.close()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """A prefill of two PP stages (TP 1) and a decode."""
    with deploy(tmp_path_factory.mktemp("sglang"), [(0, {}), (1, {})], [{}], 2) as d:
        yield d


def run(
    d: Deployment,
    room: int,
    src: list[int],
    dst: list[int],
    src_aux: int,
    dst_aux: int,
    chunks: list[int],
    **extra: Any,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    dump = d.tmp / f"decode-{room}.npz"
    d.decode.ask(
        {
            "op": "request",
            "room": room,
            "pages": dst,
            "aux": dst_aux,
            "dump": str(dump),
            **extra.get("decode", {}),
        }
    )
    for p in d.prefill:
        p.ask(
            {
                "op": "request",
                "room": room,
                "pages": src,
                "aux": src_aux,
                "chunks": chunks,
                **extra.get("prefill", {}),
            }
        )
    prefill = [p.answer() for p in d.prefill]
    consensus = prefill[0]["final"]  # PP rank 0 decides for every stage (prefill.py)
    for p, answer in zip(d.prefill[1:], prefill[1:]):
        p.ask({"op": "clear", "room": room, "failed": consensus == KVPoll.Failed})
        cleared = p.answer()
        assert cleared["cleared"] == room
        answer["error"] = cleared["error"]
    return d.decode.answer(), prefill


def monotone(polls: list[int]) -> bool:
    return polls == sorted(polls) or (
        polls[-1] == KVPoll.Failed and polls[:-1] == sorted(polls[:-1])
    )


def verify(
    d: Deployment,
    room: int,
    src: list[int],
    dst: list[int],
    src_aux: int,
    dst_aux: int,
    mamba: tuple[int, int] | None = None,
) -> None:
    """Every decode byte: the pages (target and draft layers), Mamba slot and aux row of this
    request from their source, zeros everywhere else. `mamba`: (source, destination) slot,
    else engine_proc's default."""
    src_mamba, dst_mamba = mamba or (
        ep.mamba_slot({"aux": src_aux}),
        ep.mamba_slot({"aux": dst_aux}),
    )
    landed = list(np.load(d.tmp / f"decode-{room}.npz").values())
    dec_kv = ep.kv_entries("decode", 0)
    n = len(dec_kv)  # the decode's KV buffers, its Mamba buffers after them
    dec_linear = ep.mamba_layers("decode", 0)
    for rank in (0, 1):
        kv, state, aux = ep.tensors("prefill", rank)
        linear = ep.mamba_layers("prefill", rank)
        for t, item in enumerate(ep.MAMBA_ITEMS):  # tensor-major over each side's layers
            for layer in linear:
                sent = state[t * len(linear) + linear.index(layer)].numpy().reshape(-1, item)
                got = landed[n + t * len(dec_linear) + dec_linear.index(layer)]
                got = got.reshape(-1, item)
                assert np.array_equal(got[dst_mamba], sent[src_mamba]), f"mamba {t} {layer}"
                assert not np.delete(got, [dst_mamba], axis=0).any(), f"mamba {t} {layer}"
        for i, (layer, group) in enumerate(ep.kv_entries("prefill", rank)):
            j = dec_kv.index((layer, group))  # the draft layer too: by its id in SGLang's band
            sent = kv[i].numpy().reshape(ep.PREFILL_PAGES, ep.KV_ITEM)[src]
            got = landed[j].reshape(ep.DECODE_PAGES, ep.KV_ITEM)
            assert np.array_equal(got[dst], sent), f"layer {layer} group {group}"
            assert not np.delete(got, dst, axis=0).any(), f"layer {layer} group {group}"
    _, _, aux = ep.tensors("prefill", 1)  # the last stage's aux rows; the room row it wrote
    first_aux = n + len(ep.MAMBA_ITEMS) * len(dec_linear)
    for k, item in enumerate(ep.AUX_ITEMS):
        got = landed[first_aux + k].reshape(ep.AUX_ROWS, item)
        want = aux[k].numpy().reshape(ep.AUX_ROWS, item)[src_aux].copy()
        if k == 2:
            want = np.frombuffer(np.int64(room).tobytes(), dtype=np.uint8)
        assert np.array_equal(got[dst_aux], want), f"aux buffer {k}"
        assert not np.delete(got, [dst_aux], axis=0).any(), f"aux buffer {k}"


def test_chunked_pp2_handoff_lands_every_byte(deployment: Deployment) -> None:
    d = deployment
    for room, src, dst, chunks, (sa, da), mamba in (
        (7001, [3, 4, 9, 10, 11, 20], [7, 8, 1, 2, 40, 41], [2, 3, 1], (2, 5), (4, 1)),
        # An empty last chunk (it brings the slots and the aux row alone).
        (7002, [30, 1, 2, 5, 6, 7], [0, 46, 47, 10, 11, 12], [4, 2, 0], (6, 0), (0, 5)),
    ):
        extra = {"prefill": {"mamba": mamba[0]}, "decode": {"mamba": mamba[1]}}
        decode, prefill = run(d, room, src, dst, sa, da, chunks, **extra)
        assert decode["final"] == KVPoll.Success, decode
        assert all(p["final"] == KVPoll.Success for p in prefill), prefill
        # SGLang's transfer metric is kvhandoff's: each stage's bytes (its KV pages, its Mamba
        # slot, the last stage's aux row) and the time to its last commit, within the request.
        for rank, p in enumerate(prefill):
            state = len(ep.mamba_layers("prefill", rank)) * sum(ep.MAMBA_ITEMS)
            kv = len(ep.kv_entries("prefill", rank)) * len(src) * ep.KV_ITEM
            aux = sum(ep.AUX_ITEMS) if rank == 1 else 0
            assert p["metric"]["bytes"] == kv + state + aux, (rank, p["metric"])
            assert 0 < p["metric"]["latency_s"] < p["seconds"], (rank, p)
        for answer in [decode, *prefill]:
            assert monotone(answer["polls"]), answer
        assert decode["released"]
        verify(d, room, src, dst, sa, da, mamba)


def test_a_decode_holding_a_cached_prefix_receives_the_pages_after_it_only(
    deployment: Deployment,
) -> None:
    # SGLang's decode radix cache holds the request's first 3 pages (`decode_prefix_len`, in
    # tokens) and gives pages for the other 3; the prefill, which never learns of it, sends
    # all 6 in chunks, the first inside the prefix, the second across its end. Only the pages
    # after the prefix move, into the decode's pages; nothing else of the decode changes.
    d = deployment
    room, src, dst, (sa, da) = 7011, [3, 4, 9, 10, 11, 20], [7, 8, 1], (2, 5)
    extra = {"decode": {"prefix_len": 3 * ep.PAGE_SIZE}}
    decode, prefill = run(d, room, src, dst, sa, da, [2, 3, 1], **extra)
    assert decode["final"] == KVPoll.Success, decode
    assert all(p["final"] == KVPoll.Success for p in prefill), prefill
    for rank, p in enumerate(prefill):  # each stage moved the suffix's pages only
        state = len(ep.mamba_layers("prefill", rank)) * sum(ep.MAMBA_ITEMS)
        kv = len(ep.kv_entries("prefill", rank)) * len(dst) * ep.KV_ITEM
        aux = sum(ep.AUX_ITEMS) if rank == 1 else 0
        assert p["metric"]["bytes"] == kv + state + aux, (rank, p["metric"])
    verify(d, room, src[3:], dst, sa, da)
    # A prefix that ends inside a page: the request fails naming it, the scheduler goes on.
    d.decode.ask({"op": "request", "room": 7012, "pages": [3], "aux": 1, "prefix_len": 5})
    failed = d.decode.answer()
    assert failed["final"] == KVPoll.Failed, failed
    assert "decode_prefix_len = 5 is not a whole number of 4-token pages" in failed["error"]


def test_each_send_moves_its_own_pages_before_the_last_chunk_is_sent(
    deployment: Deployment,
) -> None:
    # Each chunk is signalled as it is sent: with a slow last chunk, both stages' earlier
    # chunks are committed in the decode's pages before it (SGLang's chunked prefill overlaps
    # the transfer). Accumulating the chunks until the last one committed none by then.
    d = deployment
    room, src, dst, (sa, da) = 7003, [3, 4, 9, 10, 11, 20], [7, 8, 1, 2, 40, 41], (2, 5)
    extra = {"prefill": {"commit_before_last_s": 10.0}}
    decode, prefill = run(d, room, src, dst, sa, da, [2, 3, 1], **extra)
    assert decode["final"] == KVPoll.Success, decode
    assert all(p["final"] == KVPoll.Success for p in prefill), prefill
    assert all(p["committed_before_last"] >= 1 for p in prefill), prefill
    verify(d, room, src, dst, sa, da)


def test_a_host_destination_fails_its_request_by_name_and_the_scheduler_goes_on(
    deployment: Deployment,
) -> None:
    # SGLang's host-offload destinations are not supported: the request fails with the reason
    # (no exception into the decode scheduler), and the next request lands as usual.
    d = deployment
    d.decode.ask({"op": "request", "room": 7401, "pages": [3], "aux": 1, "destination": "host"})
    decode = d.decode.answer()
    assert decode["final"] == KVPoll.Failed, decode
    assert "KV destination HOST is not supported" in decode["error"], decode
    room, src, dst, (sa, da) = 7402, [5, 6], [12, 13], (3, 4)
    decode, prefill = run(d, room, src, dst, sa, da, [2])
    assert decode["final"] == KVPoll.Success, decode
    assert all(p["final"] == KVPoll.Success for p in prefill), prefill
    verify(d, room, src, dst, sa, da)


def test_decode_abort_fails_both_sides_with_the_reason(deployment: Deployment) -> None:
    d = deployment
    decode, prefill = run(
        d,
        7101,
        [1, 2, 3],
        [4, 5, 6],
        1,
        1,
        [3],
        decode={"abort_after_s": 0.3},
        prefill={"delay_s": 1.0, "timeout_s": 15.0},
    )
    assert decode["final"] == KVPoll.Failed and "Aborted" in decode["error"], decode
    assert decode["released"], decode  # pages free: no write of it can land any more
    assert prefill[0]["final"] == KVPoll.Failed, prefill  # the consensus of both stages
    for p in prefill:
        assert p["error"] and "sglang-7101-tp0" in p["error"], p
        assert monotone(p["polls"]), p


def test_a_prefill_abort_mid_chunks_fails_the_decode_naming_the_stage(
    deployment: Deployment,
) -> None:
    d = deployment
    d.decode.ask({"op": "request", "room": 7151, "pages": [9, 10, 11], "aux": 2})
    d.prefill[0].ask(
        {
            "op": "request",
            "room": 7151,
            "pages": [1, 2, 3],
            "aux": 2,
            "chunks": [2, 1],
            "abort_before_chunk": 1,
            "delay_s": 0.5,
        }
    )
    d.prefill[1].ask(
        {
            "op": "request",
            "room": 7151,
            "pages": [1, 2, 3],
            "aux": 2,
            "chunks": [2, 1],
            "timeout_s": 15.0,
        }
    )
    prefill = [p.answer() for p in d.prefill]
    d.prefill[1].ask({"op": "clear", "room": 7151, "failed": True})
    assert d.prefill[1].answer()["cleared"] == 7151
    decode = d.decode.answer()
    # SGLang's own reason stands on the rank it aborted (the give-up's events change nothing).
    assert prefill[0]["final"] == KVPoll.Failed, prefill
    assert "Aborted by AbortReq" in prefill[0]["error"], prefill
    assert decode["final"] == KVPoll.Failed, decode
    assert "stage 0" in decode["error"] and "sglang-7151-tp0" in decode["error"], decode
    assert decode["after_metadata_s"] < 8.0, decode  # told, not timed out (deadline 10 s)
    assert decode["released"], decode


def test_a_prefill_send_the_service_refuses_fails_the_decode_at_once(
    deployment: Deployment,
) -> None:
    # Stage 0's second chunk names a page outside its pool: the embedded service refuses the
    # ready signal. The request fails on that prefill rank, and its handoff is given up, so
    # the decode is told now, naming the stage and the refusal; before, only the prefill
    # learned of it and the decode waited for its deadline (10 s).
    d = deployment
    d.decode.ask({"op": "request", "room": 7161, "pages": [9, 10, 11], "aux": 2})
    d.prefill[0].ask(
        {
            "op": "request",
            "room": 7161,
            "pages": [1, 2, 3],
            "aux": 2,
            "chunks": [2, 1],
            "bad_page_at_chunk": 1,
        }
    )
    d.prefill[1].ask(
        {"op": "request", "room": 7161, "pages": [1, 2, 3], "aux": 2, "chunks": [2, 1]}
    )
    prefill = [p.answer() for p in d.prefill]
    failed = prefill[1]["final"] != KVPoll.Success
    d.prefill[1].ask({"op": "clear", "room": 7161, "failed": failed})
    assert d.prefill[1].answer()["cleared"] == 7161
    decode = d.decode.answer()
    assert prefill[0]["final"] == KVPoll.Failed, prefill
    assert "stage ready refused" in prefill[0]["error"], prefill
    # The stage was stopped before SGLang's table said Failed (SGLang frees the source pages
    # then): no segment still gathers from them.
    assert prefill[0]["stopped_first"] is True, prefill
    assert decode["final"] == KVPoll.Failed, decode
    # Told with the refusal, or (its destination came after the give-up) by the destination's
    # refusal: either way now, naming the stage.
    assert "stage 0" in decode["error"], decode
    assert any(why in decode["error"] for why in ("stage ready refused", "already failed")), decode
    assert decode["after_metadata_s"] < 8.0, decode  # told, not timed out (deadline 10 s)
    assert decode["released"], decode


def bootstrap_row(**fields: Any) -> dict[str, Any]:
    """A prefill rank's registration as SGLang's `register_to_bootstrap` makes it: one stage, TP
    1, no CP or DP, unless `fields` say otherwise."""
    row: dict[str, Any] = {
        "attn_tp_size": 1,
        "attn_tp_rank": 0,
        "attn_cp_size": 1,
        "attn_cp_rank": 0,
        "attn_dp_size": 1,
        "attn_dp_rank": 0,
        "pp_size": 1,
        "pp_rank": 0,
        "system_dp_size": 1,
        "system_dp_rank": 0,
        "rank_ip": "127.0.0.1",
        "rank_port": 9,
        "page_size": ep.PAGE_SIZE,
        "kv_cache_dtype": "bfloat16",
        "kvhandoff_url": "http://127.0.0.1:9",
    }
    return {**row, **fields}


def test_a_registration_without_the_peer_secret_is_refused(deployment: Deployment) -> None:
    url = f"http://127.0.0.1:{deployment.port}/route"
    row = bootstrap_row(
        pp_size=2,
        pp_rank=1,
        rank_ip="198.51.100.7",
        rank_port=1,
        page_size=4,
        kvhandoff_url="http://198.51.100.7:1",
    )
    body = json.dumps(row).encode()
    assert requests.put(url, data=body, timeout=5).status_code == 401
    forged = sign(b"another secret", "PUT", "/route", body)
    assert (
        requests.put(url, data=body, headers={SIGNATURE_HEADER: forged}, timeout=5).status_code
        == 401
    )
    good = requests.get(
        f"{url}?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=1", timeout=5
    ).json()
    assert good["rank_ip"] != "198.51.100.7" and good["kvhandoff_url"].startswith("http://127.")
    # A room's DP rank likewise: an unsigned claim would send the decode to another DP rank.
    base = f"http://127.0.0.1:{deployment.port}"
    claim = json.dumps({"bootstrap_room": 4242, "dp_rank": 1}).encode()
    assert requests.post(f"{base}/register_dp_rank", data=claim, timeout=5).status_code == 401
    rooms = {"bootstrap_rooms": [4242]}
    assert requests.post(f"{base}/query_dp_ranks", json=rooms, timeout=5).json() == {}


def test_only_a_dummy_cp_rank_registers_without_a_kvhandoff_url(deployment: Deployment) -> None:
    # Signed registrations of an attention-CP prefill with its own bootstrap server: CP rank 1
    # (SGLang's dummy participant, which runs no service) is taken without a URL; CP rank 0,
    # the one a decode pairs with, is not.
    port = free_port()
    other = KVHandoffBootstrapServer("127.0.0.1", port)
    try:
        serving(port)
        statuses = []
        for cp_rank in (1, 0):
            row = bootstrap_row(attn_cp_size=2, attn_cp_rank=cp_rank, kvhandoff_url=None)
            body = json.dumps(row).encode()
            headers = {SIGNATURE_HEADER: sign(SECRET.encode(), "PUT", "/route", body)}
            reply = requests.put(
                f"http://127.0.0.1:{port}/route", data=body, headers=headers, timeout=5
            )
            statuses.append((reply.status_code, reply.text))
    finally:
        other.close()
    assert statuses[0][0] == 200, statuses
    assert statuses[1][0] == 400 and "must carry kvhandoff_url" in statuses[1][1], statuses


def test_a_prefill_of_another_tp_size_is_refused_naming_both(deployment: Deployment) -> None:
    # A second prefill instance, TP 2, registered (signed) with its own bootstrap server.
    port = free_port()
    other = KVHandoffBootstrapServer("127.0.0.1", port)
    try:
        serving(port)
        for tp_rank in (0, 1):
            row = bootstrap_row(attn_tp_size=2, attn_tp_rank=tp_rank)
            body = json.dumps(row).encode()
            headers = {SIGNATURE_HEADER: sign(SECRET.encode(), "PUT", "/route", body)}
            reply = requests.put(
                f"http://127.0.0.1:{port}/route", data=body, headers=headers, timeout=5
            )
            assert reply.status_code == 200, reply.text
        d = deployment
        d.decode.ask(
            {
                "op": "request",
                "room": 7171,
                "pages": [1],
                "aux": 1,
                "bootstrap": f"127.0.0.1:{port}",
                "timeout_s": 5.0,
            }
        )
        decode = d.decode.answer()
    finally:
        other.close()
    assert decode["final"] == KVPoll.Failed, decode
    assert (
        "unequal TP for MLA models only" in decode["error"]
        and "prefill attention TP 2, decode 1" in (decode["error"])
    ), decode
    # Named once at SGLang's first contact with that prefill, in the decode rank's log.
    log = (d.tmp / f"{d.decode.name}.log").read_text()
    said = [line for line in log.splitlines() if "cannot serve this decode rank" in line]
    assert len(said) == 1 and f"127.0.0.1:{port}" in said[0] and "TP 2, decode 1" in said[0], said


def test_a_decode_whose_aux_rows_differ_fails_the_request_naming_the_aux_entry(
    deployment: Deployment,
) -> None:
    # A second decode instance whose logprobs rows are wider than the prefill's: refused when
    # the handoff is created (pairing), naming the aux entry and both sizes; nothing moves.
    d = deployment
    wide = [ep.AUX_ITEMS[0], 64, ep.AUX_ITEMS[2]]
    other = d.start("decode", 0, {"aux_items": wide}, "state-wide-aux")
    try:
        hello = other.answer()
        assert hello["ready"], hello
        other.ask({"op": "request", "room": 7501, "pages": [1, 2], "aux": 1, "timeout_s": 5.0})
        decode = other.answer()
    finally:
        other.ask({"op": "exit"})
        other.popen.wait(20)
    assert decode["final"] == KVPoll.Failed, decode
    assert "aux entry 1" in decode["error"], decode
    assert "source 32 bytes, destination 64" in decode["error"], decode
    assert decode["seconds"] < 5.0, decode  # refused at once, not timed out
    assert decode["released"], decode  # nothing was leased: SGLang may free the pages now


def test_a_decode_whose_mamba_slots_differ_fails_naming_the_layer_and_kind(
    deployment: Deployment,
) -> None:
    # The Mamba slot-size guard: a decode whose temporal state is larger than the prefill's.
    d = deployment
    other = d.start("decode", 0, {"mamba_items": [ep.MAMBA_ITEMS[0], 48]}, "state-wide-mamba")
    try:
        assert other.answer()["ready"]
        other.ask({"op": "request", "room": 7502, "pages": [1, 2], "aux": 1, "timeout_s": 5.0})
        decode = other.answer()
    finally:
        other.ask({"op": "exit"})
        other.popen.wait(20)
    assert decode["final"] == KVPoll.Failed, decode
    # Named by layer (a Mamba layer of the stage paired first) and kind (the temporal tensor).
    assert "state slot size differs for layer" in decode["error"], decode
    assert "kind 'mamba.1'" in decode["error"], decode
    assert "source 40 bytes, destination 48" in decode["error"], decode
    assert decode["released"], decode


# Last in this module: it kills a prefill stage of the shared deployment.
def test_a_killed_prefill_stage_fails_the_decode_within_the_heartbeat_window(
    deployment: Deployment,
) -> None:
    d = deployment
    d.decode.ask({"op": "request", "room": 7201, "pages": [1, 2], "aux": 3, "timeout_s": 20.0})
    d.prefill[0].ask(
        {"op": "request", "room": 7201, "pages": [5, 6], "aux": 3, "chunks": [2], "timeout_s": 6.0}
    )
    time.sleep(0.5)  # the decode has created the handoff and reached both stages
    d.prefill[1].popen.kill()
    d.prefill[1].popen.wait(10)
    decode = d.decode.answer()
    assert decode["final"] == KVPoll.Failed, decode
    print("decode failure:", decode["error"])
    assert "sglang-7201-tp0" in decode["error"] and "stage 1" in decode["error"], decode
    # Heartbeats every 0.5 s, a peer silent for 2 s is lost: well inside 8 s of the metadata.
    assert decode["after_metadata_s"] < 8.0, decode
    # PP rank 0 never reports Success without its dead peer stage (SGLang's consensus waits on
    # every stage; a dead PP rank takes the prefill instance down in SGLang itself).
    assert d.prefill[0].answer()["final"] != KVPoll.Success


def verify_whole_rank(
    dump: Path,
    room: int,
    pages: tuple[list[int], list[int]],
    aux: tuple[int, int],
    mamba: tuple[int, int],
    tp_rank: int,
    dp_rank: int = 0,
    mla: bool = False,
    mamba_items: list[int] = ep.MAMBA_ITEMS,
) -> None:
    """Every byte of one decode TP rank against TP rank `tp_rank` (of DP-attention rank
    `dp_rank`) of a one-stage prefill (its entries in the decode's order): the request's rows
    from their source, zeros elsewhere."""
    landed = list(np.load(dump).values())
    kv, state, rows = ep.tensors(
        "prefill", 0, mamba_items=mamba_items, pp_size=1, tp_rank=tp_rank, dp_rank=dp_rank, mla=mla
    )
    linear = ep.mamba_layers("decode", 0)
    items = [ep.KV_ITEM] * len(kv) + [i for i in mamba_items for _ in linear] + ep.AUX_ITEMS
    at = [pages] * len(kv) + [([mamba[0]], [mamba[1]])] * len(state)
    at += [([aux[0]], [aux[1]])] * len(rows)
    for k, (sent, got, item, (src, dst)) in enumerate(zip([*kv, *state, *rows], landed, items, at)):
        want = sent.numpy().reshape(-1, item)[src].copy()
        if k == len(landed) - 1:  # the bootstrap_room row this rank's last stage wrote
            want = np.frombuffer(np.int64(room).tobytes(), dtype=np.uint8)[None, :]
        got = got.reshape(-1, item)
        assert np.array_equal(got[dst], want), f"tp rank {tp_rank}: region {k}"
        assert not np.delete(got, dst, axis=0).any(), f"tp rank {tp_rank}: region {k}"


def request_on_ranks(
    decodes: list[tuple[Proc, Path]],
    prefills: list[Proc],
    room: int,
    pages: tuple[list[int], list[int]],
    aux: tuple[int, int],
    mamba: tuple[int, int],
    *,
    prefill_first: bool = False,
    between: Callable[[], None] = lambda: None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One request on every rank given: each decode rank (dumping its memory to its path) asks
    first, as SGLang's decode does, then each prefill rank sends it in chunks of 2 and 1 pages
    (`prefill_first`: the prefill ranks first), `between` the two. Returns (prefill answers,
    decode answers). `pages`, `aux`, `mamba`: (source, destination)."""

    def decode() -> None:
        for p, dump in decodes:
            p.ask(
                {
                    "op": "request",
                    "room": room,
                    "pages": pages[1],
                    "aux": aux[1],
                    "mamba": mamba[1],
                    "dump": str(dump),
                }
            )

    if not prefill_first:
        decode()
        between()
    for p in prefills:
        p.ask(
            {
                "op": "request",
                "room": room,
                "pages": pages[0],
                "aux": aux[0],
                "mamba": mamba[0],
                "chunks": [2, 1],
            }
        )
    if prefill_first:
        between()
        decode()
    return [p.answer() for p in prefills], [p.answer() for p, _ in decodes]


def test_equal_tp_moves_one_handoff_per_request_and_tp_rank(tmp_path: Path) -> None:
    # A prefill of TP 2 and a decode of TP 2, one process per rank: each decode TP rank pairs
    # with the prefill TP rank of its own rank (handoff `sglang-<room>-tp<rank>`, one per rank)
    # and lands that rank's own bytes (distinct per rank: each holds its own heads).
    tp = [{"tp_size": 2, "tp_rank": r} for r in (0, 1)]
    room, src, dst, aux, mamba = 7601, [3, 4, 9], [7, 8, 1], (2, 5), (4, 1)
    dumps = [tmp_path / f"decode-tp{r}.npz" for r in (0, 1)]
    with deploy(tmp_path, [(0, v) for v in tp], tp, 1) as d:
        prefill, decode = request_on_ranks(
            list(zip(d.decodes, dumps)), d.prefill, room, (src, dst), aux, mamba
        )
    assert all(a["final"] == KVPoll.Success for a in [*prefill, *decode]), (prefill, decode)
    assert all(monotone(a["polls"]) for a in [*prefill, *decode])
    assert all(a["released"] for a in decode)
    for r in (0, 1):
        verify_whole_rank(dumps[r], room, (src, dst), aux, mamba, r)


def test_an_mla_decode_of_larger_tp_takes_a_copy_on_each_rank_once_all_have_it(
    tmp_path: Path,
) -> None:
    # An MLA model without state, a prefill of attention TP 1 and a decode of TP 2: SGLang has
    # both decode ranks take prefill rank 0's bytes. Each decode rank creates a handoff of its
    # own (rank 1's `sglang-<room>-tp0-r1`) saying the bytes go to 2; the prefill rank signals
    # its ranges to both (rank 1's replayed once it learns of it) and reports Success only once
    # both copies are committed. Rank 1 asks a while after rank 0 (a TP rank slower to
    # allocate): the prefill waits for it. Then rank 1 aborts another request: the prefill
    # stops rank 0's copy first and fails the request, naming rank 1's.
    mla = {"mla": True, "mamba_items": []}
    prefills = [(0, {**mla, "tp_size": 1, "tp_rank": 0})]
    decodes = [{**mla, "tp_size": 2, "tp_rank": r} for r in (0, 1)]
    room, src, dst, aux = 7681, [5, 1, 12], [4, 20, 6], (3, 2)
    dumps = [tmp_path / f"decode-tp{r}.npz" for r in (0, 1)]
    late_s = 1.5

    def ask(decode: Proc, r: int, dump: Path | None = None, **extra: Any) -> None:
        body = {"op": "request", "room": r, "pages": dst, "aux": aux[1], "mamba": 0, **extra}
        decode.ask({**body, "dump": str(dump)} if dump else body)

    with deploy(tmp_path, prefills, decodes, 1) as d:
        prefill_rank = d.prefill[0]
        ask(d.decodes[0], room, dumps[0])
        prefill_rank.ask(
            {"op": "request", "room": room, "pages": src, "aux": aux[0], "chunks": [2, 1]}
        )
        time.sleep(late_s)
        ask(d.decodes[1], room, dumps[1])
        prefill = prefill_rank.answer()
        decode = [p.answer() for p in d.decodes]
        assert all(a["final"] == KVPoll.Success for a in [prefill, *decode]), (prefill, decode)
        assert all(monotone(a["polls"]) for a in [prefill, *decode])
        assert all(a["released"] for a in decode)
        assert prefill["seconds"] > late_s, prefill  # it waited for rank 1's copy
        one_copy = len(ep.kv_entries("prefill", 0, 1, mla=True)) * len(src) * ep.KV_ITEM
        assert prefill["metric"]["bytes"] == 2 * (one_copy + sum(ep.AUX_ITEMS)), prefill
        for k in (0, 1):  # both ranks hold prefill rank 0's bytes
            verify_whole_rank(dumps[k], room, (src, dst), aux, (0, 0), 0, mla=True, mamba_items=[])

        ask(d.decodes[0], room + 1)
        ask(d.decodes[1], room + 1, abort_after_s=0.2)
        prefill_rank.ask(
            {
                "op": "request",
                "room": room + 1,
                "pages": src,
                "aux": aux[0],
                "chunks": [2, 1],
                "delay_s": 1.0,
            }
        )
        prefill = prefill_rank.answer()
        decode = [p.answer() for p in d.decodes]
        assert prefill["final"] == KVPoll.Failed, prefill
        assert f"sglang-{room + 1}-tp0-r1" in prefill["error"], prefill
        assert all(a["final"] == KVPoll.Failed for a in decode), decode
        assert all(a["released"] for a in decode), decode


def test_attention_cp_sends_from_cp_rank_0_alone(tmp_path: Path) -> None:
    # A prefill of attention CP 2 (TP 1) and a decode: SGLang pairs the decode with CP rank 0,
    # which holds every page and sends; CP rank 1 is SGLang's dummy participant, reaching
    # Success at its last send without a handoff, and runs no kvhandoff service (no Mooncake
    # engine, no port). Its bytes differ from rank 0's (engine_proc seeds by CP rank),
    # so the decode's bytes show that rank 0's landed and rank 1's did not.
    cp = [{"cp_size": 2, "cp_rank": r} for r in (0, 1)]
    room, src, dst, aux, mamba = 7701, [6, 2, 11], [9, 3, 5], (4, 1), (2, 3)
    dump = tmp_path / "decode.npz"
    with deploy(tmp_path, [(0, v) for v in cp], [{}], 1) as d:
        assert d.prefill[0].hello["url"] and d.prefill[1].hello["url"] is None
        prefill, [decode] = request_on_ranks(
            [(d.decode, dump)], d.prefill, room, (src, dst), aux, mamba
        )
    assert all(a["final"] == KVPoll.Success for a in [*prefill, decode]), (prefill, decode)
    assert all(monotone(a["polls"]) for a in [*prefill, decode])
    assert decode["released"]
    # Rank 0's segments were committed; rank 1 has no service to send from (its URL is None,
    # above), and the decode's bytes are rank 0's alone.
    assert prefill[0]["transferred"] >= 1, prefill
    verify_whole_rank(dump, room, (src, dst), aux, mamba, 0)


def logged(proc: Proc, tmp: Path, *lines: str, timeout_s: float = 20.0) -> None:
    """Wait until `proc`'s log holds every line fragment given."""
    log = tmp / f"{proc.name}.log"
    end = time.monotonic() + timeout_s
    while not all(line in log.read_text() for line in lines):
        assert time.monotonic() < end, f"{proc.name} never logged {lines}"
        time.sleep(0.05)


def test_an_mla_prefill_of_larger_tp_sends_from_one_rank_and_excuses_the_others(
    tmp_path: Path,
) -> None:
    # An MLA model without state (DeepSeek's latent KV, whole on every TP rank), a prefill of
    # attention TP 4 and a decode of TP 2: SGLang pairs decode rank d with prefill rank 2d and
    # makes rank 2d + 1 a dummy for each request. Each decode rank receives the handoff of its
    # sending rank (decode rank 1 that of prefill rank 2, `sglang-<room>-tp2`) and excuses its
    # dummy, signed, over SGLang's ZMQ channel to it: the dummy reaches Success at its last send
    # having moved nothing, and the sending rank's bytes land (engine_proc seeds each TP rank
    # apart, so each decode rank's bytes show which rank sent). Excusals sent to rank 0 first,
    # one without the secret and one signed for rank 1, are refused and change nothing. The
    # first request's excusals reach the dummies before the request does; the second reaches
    # the prefill first, and its excusals come once the dummies signalled every page, which
    # they then withdraw (aborted: no failure on any side).
    mla = {"mla": True, "mamba_items": []}
    prefills = [(0, {**mla, "tp_size": 4, "tp_rank": r}) for r in range(4)]
    decodes = [{**mla, "tp_size": 2, "tp_rank": r} for r in (0, 1)]
    room, src, dst, aux = 7651, [5, 1, 12], [4, 20, 6], (3, 2)
    dumps = [tmp_path / f"decode-tp{r}.npz" for r in (0, 1)]
    with deploy(tmp_path, prefills, decodes, 1) as d:
        dummies = [d.prefill[1], d.prefill[3]]
        ip, port = d.prefill[0].hello["zmq"]
        with zmq.Context() as ctx, ctx.socket(zmq.PUSH) as push:
            push.setsockopt(zmq.LINGER, 0)
            push.connect(f"tcp://{ip}:{port}")
            push.send_multipart(excusal.excusal(b"not-the-secret", room, d.prefill[0].hello["url"]))
            push.send_multipart(excusal.excusal(SECRET.encode(), room, d.prefill[1].hello["url"]))
            logged(d.prefill[0], tmp_path, "bad signature", "signed for the rank at")

        def excused(r: int) -> Callable[[], None]:
            def wait() -> None:  # both dummies took the room's excusal
                for p in dummies:
                    logged(p, tmp_path, f"room {r} excused")

            return wait

        def signalled(r: int) -> Callable[[], None]:
            def wait() -> None:  # both dummies signalled every page of the room
                for p, t in zip(dummies, (1, 3)):
                    logged(p, tmp_path, f"signalled sglang-{r}-tp{t} last=True")

            return wait

        for r, first, between in ((room, False, excused), (room + 1, True, signalled)):
            prefill, decode = request_on_ranks(
                list(zip(d.decodes, dumps)),
                d.prefill,
                r,
                (src, dst),
                aux,
                (0, 0),
                prefill_first=first,
                between=between(r),
            )
            assert all(a["final"] == KVPoll.Success for a in [*prefill, *decode]), (prefill, decode)
            assert all(monotone(a["polls"]) for a in [*prefill, *decode])
            assert all(a["released"] for a in decode)
            moved = [a["transferred"] for a in prefill]
            assert moved[0] >= 1 and moved[2] >= 1 and moved[1] == moved[3] == 0, prefill
            # SGLang's transfer metric (read after `clear()`): the senders' bytes; none of the
            # dummies', so SGLang records no transfer speed for what they never sent.
            sent = [a["metric"]["bytes"] for a in prefill]
            assert sent[0] == sent[2] and sent[0] > 0 and sent[1] is sent[3] is None, prefill
            for k in (0, 1):
                verify_whole_rank(
                    dumps[k], r, (src, dst), aux, (0, 0), 2 * k, mla=True, mamba_items=[]
                )
        logs = [(tmp_path / f"{p.name}.log").read_text() for p in d.prefill]
    refused = [line for line in logs[0].splitlines() if "refused an excusal" in line]
    assert len(refused) == 2, refused
    for senders, dummy in ((logs[0], logs[1]), (logs[2], logs[3])):
        for r in (room, room + 1):
            assert f"room {r} excused" not in senders and f"room {r} excused" in dummy
        assert "handoff.failed" not in dummy and "giving up" not in dummy
    # The first room's dummies never signalled it; the second's withdrew what they had.
    assert f"signalled sglang-{room}-" not in logs[1] + logs[3]
    assert f"handoff.aborted prefill sglang-{room + 1}-tp1" in logs[1]
    assert f"handoff.aborted prefill sglang-{room + 1}-tp3" in logs[3]


def one_request(
    prefill: Proc, decode: Proc, room: int, dump: str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A request of a one-stage prefill (source pages 2, 3 and aux row 1; destination pages
    and aux row from the room), the decode asking first as SGLang's decode does."""
    decode.ask(
        {
            "op": "request",
            "room": room,
            "pages": [room % 40, room % 40 + 1],
            "aux": room % ep.AUX_ROWS,
            "dump": dump,
        }
    )
    prefill.ask({"op": "request", "room": room, "pages": [2, 3], "aux": 1, "chunks": [1, 1]})
    return prefill.answer(), decode.answer()


def test_killed_and_restarted_ranks_fail_fast_and_the_next_request_lands(
    tmp_path: Path,
) -> None:
    # A one-stage prefill and a decode, each killed (SIGKILL) and started again on its state
    # dir: a request that needed the dead rank fails on the living side within the heartbeat
    # window (not SGLang's minutes), and the next request, through the same bootstrap server,
    # reaches the new rank (its new URL and life) and lands every byte: no failed session
    # sticks to a rank that is gone.
    with deploy(tmp_path, [(0, {})], [{}], 1) as d:
        prefill, decode = d.prefill[0], d.decode
        dump = str(tmp_path / "decode.npz")

        def lands(room: int) -> None:
            p, dec = one_request(prefill, decode, room, dump)
            assert p["final"] == dec["final"] == KVPoll.Success, (p, dec)
            pages = ([2, 3], [room % 40, room % 40 + 1])
            aux = (1, room % ep.AUX_ROWS)
            mamba = (ep.mamba_slot({"aux": aux[0]}), ep.mamba_slot({"aux": aux[1]}))
            verify_whole_rank(Path(dump), room, pages, aux, mamba, 0)

        lands(7801)
        prefill.popen.kill()
        prefill.popen.wait(10)
        decode.ask({"op": "request", "room": 7802, "pages": [5], "aux": 2, "timeout_s": 20.0})
        lost = decode.answer()
        assert lost["final"] == KVPoll.Failed and lost["seconds"] < 8.0, lost

        prefill = d.start("prefill", 0, {})
        assert prefill.answer()["ready"]
        lands(7803)

        # The decode dies once the prefill holds the destination, before the prefill sends.
        decode.ask({"op": "request", "room": 7804, "pages": [6], "aux": 3})
        prefill.ask(
            {"op": "request", "room": 7804, "pages": [4], "aux": 1, "chunks": [1], "delay_s": 1.0}
        )
        time.sleep(0.5)
        decode.popen.kill()
        decode.popen.wait(10)
        orphaned = prefill.answer()
        assert orphaned["final"] == KVPoll.Failed and orphaned["seconds"] < 8.0, orphaned
        assert "sglang-7804-tp0" in orphaned["error"] and "decode http://" in orphaned["error"]

        decode = d.start("decode", 0, {})
        assert decode.answer()["ready"]
        lands(7805)


@pytest.mark.parametrize(
    ("balance", "mla"), [("follow_bootstrap_room", True), ("round_robin", False)]
)
def test_dp_attention_pairs_each_room_with_its_prefill_dp_rank(
    tmp_path: Path, balance: str, mla: bool
) -> None:
    # DP attention on both sides (TP 2 = DP 2 x attention TP 1, as SGLang's DeepSeek PD
    # deployments run): a room is prefilled by the prefill DP rank SGLang routes it to and
    # decoded by whichever decode DP rank the router picked. With `follow_bootstrap_room` (the
    # default) the decode derives the prefill DP rank from the room; with another balancing the
    # prefill rank registers it with the bootstrap server (signed) and the decode asks there.
    # Each DP rank runs its own service; every byte comes from the right one (engine_proc seeds
    # each DP rank's memory apart). The first case is an MLA model's (one latent KV buffer per
    # layer), as DeepSeek's PD deployments run with DP attention.
    dp = [{"dp_size": 2, "dp_rank": r, "load_balance": balance, "mla": mla} for r in (0, 1)]
    with deploy(tmp_path, [(0, v) for v in dp], dp, 1) as d:
        # Room 7901 is prefilled by DP rank 1 and decoded by DP rank 0; room 7902 the other way.
        plan = [(7901, d.decodes[0], d.prefill[1]), (7902, d.decodes[1], d.prefill[0])]
        for room, decode, _ in plan:
            dump = str(tmp_path / f"decode-{room}.npz")
            decode.ask({"op": "request", "room": room, "pages": [5, 9], "aux": 2, "dump": dump})
        for room, _, prefill in plan:
            prefill.ask(
                {"op": "request", "room": room, "pages": [1, 4], "aux": 6, "chunks": [1, 1]}
            )
        answers = [(p.answer(), dec.answer()) for _, dec, p in plan]
    for (room, _, _), (p, dec) in zip(plan, answers):
        assert p["final"] == dec["final"] == KVPoll.Success, (p, dec)
        assert monotone(p["polls"]) and monotone(dec["polls"]) and dec["released"]
        mamba = (ep.mamba_slot({"aux": 6}), ep.mamba_slot({"aux": 2}))
        dump = tmp_path / f"decode-{room}.npz"
        pages = ([1, 4], [5, 9])
        verify_whole_rank(dump, room, pages, (6, 2), mamba, 0, dp_rank=room % 2, mla=mla)

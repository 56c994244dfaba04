"""Forgeries against real processes (decode + PP=2 prefill, Mooncake TCP, shm pools), as a
router or an engine holding its own credential would try them (issue 10): each ends in
401/403/409, and the decode pool is unchanged byte for byte — then a real handoff still lands.

The test plays three parties: the router (router token), the engine (engine token) and, where a
forgery needs it, a holder of the peer secret who claims to be another service.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import msgspec
import pytest

from kvhandoff.pipelines.messages import LayoutInfo
from kvhandoff.service.http.peer_signing import Signer
from kvhandoff.service.testing.deployment import LocalDeployment
from tests.channels import OpenedByHand
from tests.integration.handoff_checks import (
    Moved,
    create,
    decode_bytes,
    fill_sources,
    finished,
    landed,
    ready,
    reset_decode,
)

pytestmark = pytest.mark.integration

ROUTER, ENGINE, PEER = "router-secret", "engine-secret", "peer-secret"
AUTH_ENV = {
    "KVHANDOFF_AUTH__ROUTER": ROUTER,
    "KVHANDOFF_AUTH__ENGINE": ENGINE,
    "KVHANDOFF_AUTH__PEER": PEER,
}
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def dep() -> Iterator[LocalDeployment]:
    with LocalDeployment(
        preset="hybrid-npu-mla",
        model={"scale": 64, "page_size": 16, "num_layers": 16},
        pp_size=2,
        num_pages=64,
        num_slots=8,
        env=AUTH_ENV,
    ) as deployment:
        yield deployment


@pytest.fixture
def fresh(dep: LocalDeployment) -> LocalDeployment:
    fill_sources(dep, seed=int(time.monotonic_ns() % 1000))
    reset_decode(dep)
    return dep


@pytest.fixture
async def sessions() -> AsyncIterator[dict[str, aiohttp.ClientSession]]:
    """One session per bearer credential (and one with none)."""
    async with (
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {ROUTER}"}) as router,
        aiohttp.ClientSession(headers={"Authorization": f"bearer {ENGINE}"}) as engine,
        aiohttp.ClientSession() as anonymous,
    ):
        yield {"router": router, "engine": engine, "anonymous": anonymous}


async def signed_post(
    http: aiohttp.ClientSession, url: str, path: str, body: Any, *, secret: str, sender: str
) -> tuple[int, Any]:
    raw = json.dumps(body).encode()
    headers = {**JSON, **Signer(secret, sender).headers("POST", path, raw, recipient=url)}
    async with http.post(url + path, data=raw, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


async def decode_layout(http: aiohttp.ClientSession, dep: LocalDeployment) -> LayoutInfo:
    return await layout_of(http, dep.decode_url, dep.prefill_urls[0])


async def layout_of(
    http: aiohttp.ClientSession, url: str, signer_url: str, secret: str = PEER
) -> LayoutInfo:
    """A service's layout (and incarnation), read as a peer would: what a forger who holds the
    peer secret knows, so the forged messages below are well-formed down to the incarnations."""
    headers = Signer(secret, signer_url).headers("GET", "/v1/layout", b"", recipient=url)
    async with http.get(url + "/v1/layout", headers=headers) as resp:
        assert resp.status == 200
        return msgspec.json.decode(await resp.read(), type=LayoutInfo)


def forged_destination(
    dep: LocalDeployment,
    handoff_id: str,
    pp_rank: int,
    decode: LayoutInfo,
    stage: LayoutInfo,
    moved: Moved,
) -> dict[str, Any]:
    """A destination for `moved` that no handoff leases, well-formed down to the incarnations
    (read from the layouts a peer-secret holder can fetch): only the trust checks can refuse it."""
    return {
        "handoff_id": handoff_id,
        "decode_url": dep.decode_url,
        "decode_incarnation": decode.incarnation,
        "prefill_incarnation": stage.incarnation,
        "decode_target": decode.target,
        "decode_layout": msgspec.to_builtins(decode.stages[0].layout),
        "mode": decode.mode,
        "arena": msgspec.to_builtins(decode.arena),
        "pp_ranks": [pp_rank],
        "dst_pages": moved.dst_pages,
        "dst_slot": moved.dst_slot,
        "deadline_in_s": 30.0,
    }


async def attempts(
    sessions: dict[str, aiohttp.ClientSession], url: str, path: str, body: Any
) -> dict[str, int]:
    """The same forged message as each credential an attacker might hold, but the peer secret."""
    out = {}
    raw = json.dumps(body).encode()
    for name in ("router", "engine", "anonymous"):
        async with sessions[name].post(url + path, data=raw, headers=JSON) as resp:
            out[name] = resp.status
            problem = await resp.json(content_type=None)
            assert resp.content_type == "application/problem+json", problem
    for key in (ROUTER, ENGINE):  # a bearer secret used as the signing key
        status, _ = await signed_post(
            sessions["anonymous"], url, path, body, secret=key, sender=url
        )
        out[f"signed with {key}"] = status
    return out


async def delivered(http: aiohttp.ClientSession, dep: LocalDeployment, hid: str) -> None:
    """Until every prefill service acknowledged the handoff's destination (its state leaves
    pending), so a check that depends on the prefill side knowing it is deterministic."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        async with http.get(f"{dep.decode_url}/v1/handoffs/{hid}") as resp:
            if (await resp.json())["state"] != "pending":
                return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{hid}: destinations not delivered within 10 s")


REFUSED = {
    "router": 403,
    "engine": 403,
    "anonymous": 401,
    f"signed with {ROUTER}": 401,
    f"signed with {ENGINE}": 401,
}


async def test_forged_destination_writes_nothing(
    fresh: LocalDeployment, sessions: dict[str, aiohttp.ClientSession]
) -> None:
    dep = fresh
    before = decode_bytes(dep)
    layout = await decode_layout(sessions["anonymous"], dep)
    forged = Moved(src_pages=[1, 2, 3], dst_pages=[10, 11, 12], src_slot=0, dst_slot=3)
    for r in range(dep.pp_size):  # the engine's half is real: the stages wait for a destination
        assert (await ready(sessions["engine"], dep, "forged-dest", r, forged))[0] == 202
    for r in range(dep.pp_size):
        stage = await layout_of(sessions["anonymous"], dep.url_of_stage(r), dep.decode_url)
        msg = forged_destination(dep, "forged-dest", r, layout, stage, forged)
        url = dep.url_of_stage(r)
        assert await attempts(sessions, url, "/v1/peer/destinations", [msg]) == REFUSED
        # A peer-secret holder speaking for the decode service it is not: refused per item.
        status, outcomes = await signed_post(
            sessions["anonymous"],
            url,
            "/v1/peer/destinations",
            [msg],
            secret=PEER,
            sender=dep.url_of_stage(1 - r),
        )
        assert status == 200 and outcomes[0]["status"] == 403, outcomes
        assert outcomes[0]["problem"]["field"] == "decode_url"
    # A real handoff through the same stages completes: they processed everything sent before.
    real = Moved(src_pages=[4, 5], dst_pages=[30, 31], src_slot=1, dst_slot=2)
    assert (await create(sessions["router"], dep, "real-after-dest", real))[0] == 201
    for r in range(dep.pp_size):
        assert (await ready(sessions["engine"], dep, "real-after-dest", r, real))[0] == 202
    view = await finished(sessions["router"], dep, "real-after-dest")
    assert view["state"] == "completed", view
    assert landed(dep, [real]) == []  # and nothing outside its pages changed
    assert before != decode_bytes(dep)


async def test_forged_arrivals_and_failures_change_nothing(
    fresh: LocalDeployment, sessions: dict[str, aiohttp.ClientSession]
) -> None:
    dep = fresh
    before = decode_bytes(dep)
    m = Moved(src_pages=[6, 7], dst_pages=[40, 41], src_slot=2, dst_slot=4)
    assert (await create(sessions["router"], dep, "victim", m))[0] == 201
    layout = await decode_layout(sessions["anonymous"], dep)
    for r in range(dep.pp_size):
        stage = await layout_of(sessions["anonymous"], dep.url_of_stage(r), dep.decode_url)
        sender = {
            "sender_url": dep.url_of_stage(r),  # claims to be the stage's own service
            "sender_incarnation": stage.incarnation,
            "decode_incarnation": layout.incarnation,
        }
        arrival = {"handoff_id": "victim", "pp_rank": r, "bytes": 0, "blocks": 0, **sender}
        failure = {"handoff_id": "victim", "pp_rank": r, "code": "x", "reason": "forged", **sender}
        for path, msg in (("/v1/peer/arrivals", arrival), ("/v1/peer/stage-failures", failure)):
            assert await attempts(sessions, dep.decode_url, path, [msg]) == REFUSED
            # Signed, but by the other stage's service: only a stage's own peer reports on it.
            other = next(u for u in dep.prefill_urls if u != dep.url_of_stage(r))
            status, outcomes = await signed_post(
                sessions["anonymous"], dep.decode_url, path, [msg], secret=PEER, sender=other
            )
            assert status == 200 and outcomes[0]["status"] == 403, outcomes
        # Signed by the stage's own service (a peer-secret holder): a landed handoff (the
        # default) takes no bare arrival at all, its stages arrive with their last segment...
        status, outcomes = await signed_post(
            sessions["anonymous"],
            dep.decode_url,
            "/v1/peer/arrivals",
            [arrival],
            secret=PEER,
            sender=dep.url_of_stage(r),
        )
        assert status == 200 and outcomes[0]["status"] == 409, outcomes
        # ... and a last segment that commits none of the bytes the stage owes is refused too.
        last = {
            **sender,
            "handoff_id": "victim",
            "pp_rank": r,
            "grant_id": 0,
            "rows": [],
            "starts": [],
            "ends": [],
            "bytes": 0,
            "blocks": 0,
            "digest": "",
            "last": True,
        }
        status, outcomes = await signed_post(
            sessions["anonymous"],
            dep.decode_url,
            "/v1/peer/segments",
            [last],
            secret=PEER,
            sender=dep.url_of_stage(r),
        )
        problem = outcomes[0]["problem"]
        assert status == 200 and outcomes[0]["status"] == 422, outcomes
        assert problem["field"] == "last", problem
    async with sessions["router"].get(f"{dep.decode_url}/v1/handoffs/victim") as resp:
        view = await resp.json()
    assert view["state"] in ("pending", "transferring"), view  # destinations delivered
    assert [s["state"] for s in view["stages"]] == ["waiting"] * dep.pp_size
    assert view["bytes"] == 0 and "error" not in view
    assert decode_bytes(dep) == before
    await delivered(sessions["router"], dep, "victim")
    # Nor may anyone but its decode service stop it on a stage: ids are scoped by decode, so a
    # peer's signed abort of "victim" names its own handoff of that id (none: nothing stops).
    for r in range(dep.pp_size):
        abort = {
            "handoff_id": "victim",
            "reason": "forged",
            "decode_incarnation": layout.incarnation,
        }
        assert await attempts(sessions, dep.url_of_stage(r), "/v1/peer/aborts", abort) == REFUSED
        status, problem = await signed_post(
            sessions["anonymous"],
            dep.url_of_stage(r),
            "/v1/peer/aborts",
            abort,
            secret=PEER,
            sender=dep.url_of_stage(1 - r),
        )
        assert (status, problem["stages"]) == (200, []), problem
    for r in range(dep.pp_size):  # the victim is intact: its real stages complete it
        assert (await ready(sessions["engine"], dep, "victim", r, m))[0] == 202
    assert (await finished(sessions["router"], dep, "victim"))["state"] == "completed"
    assert landed(dep, [m]) == []


async def test_replayed_and_stale_peer_messages_are_refused(
    fresh: LocalDeployment, sessions: dict[str, aiohttp.ClientSession]
) -> None:
    dep = fresh
    before = decode_bytes(dep)
    http = sessions["anonymous"]
    url = dep.url_of_stage(0)
    path = "/v1/peer/heartbeats"
    layout = await decode_layout(http, dep)
    raw = json.dumps(
        {"sender_url": dep.decode_url, "sender_incarnation": layout.incarnation, "role": "decode"}
    ).encode()
    headers = {**JSON, **Signer(PEER, dep.decode_url).headers("POST", path, raw, recipient=url)}
    async with http.post(url + path, data=raw, headers=headers) as resp:
        assert resp.status == 200
    async with http.post(url + path, data=raw, headers=headers) as resp:
        problem = await resp.json()
        assert (resp.status, problem["code"]) == (409, "replayed"), problem
    stale = Signer(PEER, dep.decode_url, clock=lambda: time.time() - 120)
    headers = {**JSON, **stale.headers("POST", path, raw, recipient=url)}
    async with http.post(url + path, data=raw, headers=headers) as resp:
        assert resp.status == 401
    # A heartbeat claiming to be another service than the signer's: 403.
    signer = Signer(PEER, dep.prefill_urls[-1])
    headers = {**JSON, **signer.headers("POST", path, raw, recipient=url)}
    async with http.post(url + path, data=raw, headers=headers) as resp:
        assert (resp.status, (await resp.json())["field"]) == (403, "sender_url")
    assert decode_bytes(dep) == before


async def test_router_credential_is_refused_on_every_peer_route(
    fresh: LocalDeployment, sessions: dict[str, aiohttp.ClientSession]
) -> None:
    dep = fresh
    before = decode_bytes(dep)
    routes = [
        (dep.decode_url, "GET", "/v1/layout"),
        (dep.decode_url, "POST", "/v1/peer/arrivals"),
        (dep.decode_url, "POST", "/v1/peer/stage-failures"),
        (dep.decode_url, "POST", "/v1/peer/heartbeats"),
        (dep.prefill_urls[0], "GET", "/v1/layout"),
        (dep.prefill_urls[0], "POST", "/v1/peer/destinations"),
        (dep.prefill_urls[0], "POST", "/v1/peer/aborts"),
    ]
    for base, method, path in routes:
        for name, status in (("router", 403), ("engine", 403), ("anonymous", 401)):
            async with sessions[name].request(method, base + path, json=[]) as resp:
                assert resp.status == status, (name, path, await resp.text())
    # ... while each credential works where it belongs.
    async with sessions["router"].get(f"{dep.decode_url}/v1/handoffs") as resp:
        assert resp.status == 200
    async with sessions["engine"].get(f"{dep.decode_url}/v1/handoffs") as resp:
        assert resp.status == 403
    assert decode_bytes(dep) == before


class Listener:
    """The attacker's service of issue 18 A: a URL a router credential can name as a prefill.
    It keeps every signed request it receives (to replay later) and, by `mode`, relays it to the
    real stage service and hands back that service's answer (`relay`), answers it itself with
    the real stage's layout and a signature copied from a genuine answer of that stage
    (`forge`), or redirects it there (`redirect`)."""

    def __init__(self, upstream: str, genuine: tuple[bytes, dict[str, str]], life: str) -> None:
        self.upstream = upstream
        self.genuine = genuine  # a real layout answer of the stage, signed for someone else
        self.life = life  # the stage's incarnation (what a forged ack would need)
        self.mode = "relay"
        self.kept: list[tuple[str, str, dict[str, str], bytes]] = []
        self.upstream_answers: list[tuple[int, bytes]] = []
        self.url = ""
        self._runner: aiohttp.web.AppRunner | None = None

    async def start(self, http: aiohttp.ClientSession) -> None:
        from aiohttp import web

        self._http = http
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: Any) -> Any:
        from aiohttp import web

        body = await request.read()
        signed = {k: v for k, v in request.headers.items() if k.lower().startswith("kvhandoff-")}
        signed["Content-Type"] = request.headers.get("Content-Type", "application/json")
        self.kept.append((request.method, request.path_qs, signed, body))
        if self.mode == "redirect":
            return web.Response(status=307, headers={"Location": self.upstream + request.path_qs})
        if self.mode == "relay":
            async with self._http.request(
                request.method, self.upstream + request.path_qs, data=body, headers=signed
            ) as resp:
                raw = await resp.read()
                self.upstream_answers.append((resp.status, raw))
                headers = {k: v for k, v in resp.headers.items() if k.lower().startswith("kvh")}
                return web.Response(
                    status=resp.status, body=raw, headers=headers, content_type=resp.content_type
                )
        raw, headers = self.genuine  # forge
        if request.path.startswith("/v1/layout"):
            forged = json.loads(raw)
            forged["url"] = self.url
            return web.json_response(forged, headers=headers)
        if request.path == "/v1/peer/aborts":
            ack = {"handoff_id": json.loads(body)["handoff_id"], "quiesced": True, "stages": []}
            return web.json_response({**ack, "incarnation": self.life}, headers=headers)
        return web.json_response([{"status": 204}], headers=headers)


async def test_a_router_credential_cannot_relay_the_decodes_signed_calls(
    fresh: LocalDeployment, sessions: dict[str, aiohttp.ClientSession]
) -> None:
    """Issue 18 A, the whole chain: with only the router token, an attacker names its own
    listener as the prefill hosting stage 0 and (1) relays the decode's signed layout request
    to the real stage, (2) answers it with the real stage's layout under a genuine signature
    copied from another answer, (3) redirects the call to the real stage; then (4) an honest
    handoff takes the same pages and completes, and (5) the attacker replays every signed
    request it kept to every service while the real engine signals its handoff ready. Each step
    is refused and the honest pages end untouched."""
    dep = fresh
    http = sessions["anonymous"]
    stage0 = dep.url_of_stage(0)
    # What the attacker could know at best: a genuine answer of stage 0 and its incarnation.
    headers = Signer(PEER, dep.decode_url).headers("GET", "/v1/layout", b"", recipient=stage0)
    async with http.get(stage0 + "/v1/layout", headers=headers) as resp:
        raw = await resp.read()
        genuine = {k: v for k, v in resp.headers.items() if k.lower().startswith("kvhandoff-")}
    assert set(genuine) >= {"KVHandoff-Responder", "KVHandoff-Answer-Signature"}
    life = msgspec.json.decode(raw, type=LayoutInfo).incarnation
    listener = Listener(stage0, (raw, genuine), life)
    await listener.start(http)
    pages = Moved(src_pages=[8, 9, 10], dst_pages=[20, 21, 22], src_slot=1, dst_slot=5)
    prefill = [listener.url, dep.url_of_stage(1)]
    try:
        for mode in ("relay", "forge", "redirect"):
            listener.mode = mode
            status, problem = await create(
                sessions["router"], dep, f"attack-{mode}", pages, prefill=prefill
            )
            assert status == 502 and problem["field"] == "prefill[0]", (mode, problem)
            assert problem["code"] in ("unauthenticated_answer", "peer_error"), problem
        # (1) the real stage refused the relayed request: it was signed for the listener
        assert listener.upstream_answers, "the relay never reached the stage"
        for status, answer in listener.upstream_answers:
            assert status == 401 and b"was signed for" in answer, answer
        # (4) nothing was leased: an honest handoff takes the same pages and completes
        assert (await create(sessions["router"], dep, "honest", pages))[0] == 201
        for r in range(dep.pp_size):
            assert (await ready(sessions["engine"], dep, "honest", r, pages))[0] == 202
        assert (await finished(sessions["router"], dep, "honest"))["state"] == "completed"
        assert landed(dep, [pages]) == []
        after = decode_bytes(dep)
        # (5) every request the decode signed for the listener, replayed to every service
        assert listener.kept
        for method, path_qs, signed, body in listener.kept:
            for url in [*dep.prefill_urls, dep.decode_url]:
                async with http.request(method, url + path_qs, data=body, headers=signed) as resp:
                    assert resp.status == 401, (url, path_qs, await resp.text())
        for r in range(dep.pp_size):  # the real engine's half of the attacker's handoff
            assert (await ready(sessions["engine"], dep, "attack-relay", r, pages))[0] == 202
        await asyncio.sleep(1.0)
        async with sessions["router"].get(f"{dep.decode_url}/v1/handoffs/attack-relay") as resp:
            assert resp.status == 404  # never accepted, so never anything to release
        assert decode_bytes(dep) == after
        assert landed(dep, [pages]) == []
    finally:
        await listener.close()


async def test_peer_messages_naming_ids_the_public_routes_refuse_are_refused(
    fresh: LocalDeployment, sessions: dict[str, aiohttp.ClientSession]
) -> None:
    """Issue 18 B: a prefill accepted destinations (and aborts) for handoff ids no router or
    engine could name (`""`, `a/b`, 300 characters): each is a 422 naming `handoff_id`, even
    signed by the decode service itself, and changes nothing."""
    dep = fresh
    before = decode_bytes(dep)
    http = sessions["anonymous"]
    layout = await decode_layout(http, dep)
    stage = await layout_of(http, dep.url_of_stage(0), dep.decode_url)
    m = Moved(src_pages=[1], dst_pages=[50], src_slot=0, dst_slot=6)
    for bad in ("", "a/b", "x" * 300, "..", "h\u00e9"):
        msg = forged_destination(dep, bad, 0, layout, stage, m)
        status, outcomes = await signed_post(
            http,
            dep.url_of_stage(0),
            "/v1/peer/destinations",
            [msg],
            secret=PEER,
            sender=dep.decode_url,
        )
        assert status == 200 and outcomes[0]["status"] == 422, (bad, outcomes)
        assert outcomes[0]["problem"]["field"] == "handoff_id"
        abort = {"handoff_id": bad, "reason": "r", "decode_incarnation": layout.incarnation}
        status, problem = await signed_post(
            http, dep.url_of_stage(0), "/v1/peer/aborts", abort, secret=PEER, sender=dep.decode_url
        )
        assert (status, problem["field"]) == (422, "handoff_id"), (bad, problem)
    assert decode_bytes(dep) == before


async def test_a_destination_carrying_an_invalid_layout_is_refused_naming_the_field(
    fresh: LocalDeployment, sessions: dict[str, aiohttp.ClientSession]
) -> None:
    """The layout a destination carries is decoded by the prefill (once per decode life, when
    its bytes are new): one that is malformed or inconsistent in itself is a 422 naming the
    field within `decode_layout`, even signed by the decode service itself, and changes
    nothing; the batch's other items are answered alone."""
    dep = fresh
    before = decode_bytes(dep)
    http = sessions["anonymous"]
    layout = await decode_layout(http, dep)
    stage = await layout_of(http, dep.url_of_stage(0), dep.decode_url)
    m = Moved(src_pages=[1], dst_pages=[50], src_slot=0, dst_slot=6)
    good = msgspec.to_builtins(layout.stages[0].layout)
    bad = {
        "decode_layout.pp_rank": {**good, "pp_rank": good["pp_size"]},
        "decode_layout.kv": {**good, "kv": 3},
        "decode_layout.dtype": {k: v for k, v in good.items() if k != "dtype"},
    }
    batch = [
        {**forged_destination(dep, f"bad-layout-{i}", 0, layout, stage, m), "decode_layout": b}
        for i, b in enumerate(bad.values())
    ]
    status, outcomes = await signed_post(
        http,
        dep.url_of_stage(0),
        "/v1/peer/destinations",
        batch,
        secret=PEER,
        sender=dep.decode_url,
    )
    assert status == 200, outcomes
    assert [(o["status"], o["problem"]["field"]) for o in outcomes] == [(422, f) for f in bad]
    assert decode_bytes(dep) == before


async def opened(
    http: aiohttp.ClientSession, url: str, life: str, *, sender: str, to: str | None = None
) -> OpenedByHand:
    """A channel as a holder of the peer secret speaking for `sender` would open it."""
    return await OpenedByHand.open(http, url, life, secret=PEER, sender=sender, to=to)


async def test_peer_channel_frames_cannot_be_replayed_moved_or_outlive_the_recipients_life(
    fresh: LocalDeployment, sessions: dict[str, aiohttp.ClientSession]
) -> None:
    """The relay-proof properties of signed calls, on the channel, against real processes: a
    frame sent again on its own channel or on another one (to the same or another recipient)
    is refused with the channel; a handshake signed for another recipient, or a life of the
    recipient before its restart, is refused; the victim handoff is untouched throughout, and
    handoffs complete over the channels of the restarted stage's new life."""
    dep = fresh
    http = sessions["anonymous"]
    before = decode_bytes(dep)
    m = Moved(src_pages=[3, 4], dst_pages=[44, 45], src_slot=3, dst_slot=1)
    assert (await create(sessions["router"], dep, "victim-ch", m))[0] == 201
    decode = await decode_layout(http, dep)
    stage0 = dep.url_of_stage(0)
    arrival = {
        "handoff_id": "victim-ch",
        "pp_rank": 0,
        "bytes": 0,
        "blocks": 0,
        "sender_url": stage0,
        "sender_incarnation": (await layout_of(http, stage0, dep.decode_url)).incarnation,
        "decode_incarnation": decode.incarnation,
    }
    # A channel as stage 0's service: a landed handoff takes no bare arrival (as over HTTP).
    first = await opened(http, dep.decode_url, decode.incarnation, sender=stage0)
    frame = first.frame("/v1/peer/arrivals", [arrival])
    await first.ws.send_bytes(frame)
    [answer] = await first.answers()
    assert answer["status"] == 200 and answer["body"][0]["status"] == 409, answer
    second = await opened(http, dep.decode_url, decode.incarnation, sender=stage0)
    await second.ws.send_bytes(frame)  # the first channel's frame on the second
    await second.refused()
    await first.ws.send_bytes(frame)  # and again on its own
    await first.refused()
    # Another recipient: a frame sealed for the decode, on a channel to a prefill service.
    stage1 = dep.url_of_stage(1)
    life1 = (await layout_of(http, stage1, dep.decode_url)).incarnation
    other = await opened(http, stage1, life1, sender=dep.decode_url)
    await other.ws.send_bytes(frame)
    await other.refused()
    # A handshake signed for another service, relayed to this one.
    with pytest.raises(aiohttp.WSServerHandshakeError) as relayed:
        await opened(http, stage1, life1, sender=dep.decode_url, to=stage0)
    assert relayed.value.status == 401
    async with sessions["router"].get(f"{dep.decode_url}/v1/handoffs/victim-ch") as resp:
        view = await resp.json()
    assert view["bytes"] == 0 and "error" not in view, view
    assert decode_bytes(dep) == before
    # After the stage's restart, its old life's handshake is refused, its old channels are gone.
    kept = await opened(http, stage1, life1, sender=dep.decode_url)
    async with sessions["router"].delete(f"{dep.decode_url}/v1/handoffs/victim-ch") as resp:
        assert resp.status in (200, 202), await resp.text()
    await finished(sessions["router"], dep, "victim-ch")
    dep.kill(1, signal.SIGTERM)
    dep.restart(dep._stage_process(1).name)
    assert (await kept.ws.receive()).type in (
        aiohttp.WSMsgType.CLOSE,
        aiohttp.WSMsgType.CLOSED,
        aiohttp.WSMsgType.ERROR,
    )
    with pytest.raises(aiohttp.WSServerHandshakeError) as stale:
        await opened(http, stage1, life1, sender=dep.decode_url)
    assert stale.value.status == 409
    after = Moved(src_pages=[5], dst_pages=[46], src_slot=4, dst_slot=2)
    for attempt in range(50):  # until the decode has heard of the stage's new life
        status, _ = await create(sessions["router"], dep, f"after-restart-{attempt}", after)
        if status == 201:
            break
        await asyncio.sleep(0.2)
    for r in range(dep.pp_size):
        assert (await ready(sessions["engine"], dep, f"after-restart-{attempt}", r, after))[
            0
        ] == 202
    view = await finished(sessions["router"], dep, f"after-restart-{attempt}")
    assert view["state"] == "completed", view
    assert landed(dep, [after]) == []

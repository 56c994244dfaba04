"""The table of peer calls (`kvhandoff.pipelines.peer_calls`) against both ends of every call: each
entry has a sender (the HTTP client, the in-process link, the sending role's peer protocol) and a
receiver (a route taking and answering the table's wire types; for a call a peer channel
carries, the channel's handler of it, which is the route's own), and every peer route has an
entry."""

from __future__ import annotations

import inspect

import pytest

from kvhandoff.pipelines.decode.delivery import PrefillPeer
from kvhandoff.pipelines.inprocess import InProcessLink
from kvhandoff.pipelines.peer_calls import CHANNEL, CHANNEL_PATHS, PEER_CALLS, PeerCall
from kvhandoff.pipelines.prefill.handoff import DecodePeer
from kvhandoff.service.api.peer import (
    CARRIED,
    common_routes,
    decode_peer_routes,
    prefill_peer_routes,
)
from kvhandoff.service.http.peer_channel import PeerChannels
from kvhandoff.service.http.routing import Route, RouteTable
from kvhandoff.service.peers.protocol import HttpPeers

#: Who receives a call of each direction: the receiving role's routes and the common ones.
RECEIVERS: dict[str, list[RouteTable]] = {
    "decode->prefill": [prefill_peer_routes, common_routes],
    "prefill->decode": [decode_peer_routes, common_routes],
    "either": [common_routes],
}
SENDERS: dict[str, list[type]] = {
    "decode->prefill": [PrefillPeer],
    "prefill->decode": [DecodePeer],
    "either": [],
}


def _route(call: PeerCall) -> Route | None:
    for table in RECEIVERS[call.direction]:
        for route in table:
            if (route.method, route.path) == (call.method, call.path):
                return route
    return None


def _sends(owner: type, name: str) -> bool:
    return inspect.iscoroutinefunction(getattr(owner, name, None))


@pytest.mark.parametrize("call", PEER_CALLS, ids=lambda c: c.name)
def test_every_call_has_a_sender(call: PeerCall) -> None:
    if call is CHANNEL:  # opened by the client of the calls it carries
        assert _sends(PeerChannels, call.name), f"PeerChannels has no {call.name}()"
        return
    assert _sends(HttpPeers, call.name), f"HttpPeers has no {call.name}()"
    if call.in_process:
        assert _sends(InProcessLink, call.name), f"InProcessLink has no {call.name}()"
        for protocol in SENDERS[call.direction]:
            assert hasattr(protocol, call.name), f"{protocol.__name__} declares no {call.name}()"


@pytest.mark.parametrize("call", PEER_CALLS, ids=lambda c: c.name)
def test_every_call_has_a_receiver_with_its_wire_types(call: PeerCall) -> None:
    route = _route(call)
    assert route is not None, f"no route receives {call.method} {call.path}"
    assert route.auth_role == "peer", f"{call.path} must take a peer's signature"
    assert route.request == (None if call.request is None else call.body)
    assert route.response == (None if call.answer is None else call.reply)


@pytest.mark.parametrize("call", [c for c in PEER_CALLS if c.channel], ids=lambda c: c.name)
def test_every_call_a_channel_carries_has_its_handler(call: PeerCall) -> None:
    """A channel frame names its call by path alone (no method), and reaches the same handler
    as the HTTP route (`kvhandoff.service.api.peer.channel` dispatches through `CARRIED`)."""
    route = _route(call)
    assert route is not None and call.method == "POST"
    assert route.handler in CARRIED, f"{call.path}'s route has no handler a channel can call"
    assert call.path in CHANNEL_PATHS


def test_only_the_tabled_calls_are_carried() -> None:
    carried = {
        route.path
        for table in (common_routes, decode_peer_routes, prefill_peer_routes)
        for route in table
        if route.handler in CARRIED
    }
    assert carried == CHANNEL_PATHS


def test_every_peer_route_is_in_the_table() -> None:
    tabled = {(c.method, c.path) for c in PEER_CALLS}
    for table in (common_routes, decode_peer_routes, prefill_peer_routes):
        for route in table:
            if route.auth_role == "peer":
                assert (route.method, route.path) in tabled, f"{route.path} is in no table entry"


def test_calls_are_named_and_routed_once() -> None:
    assert len({c.name for c in PEER_CALLS}) == len(PEER_CALLS)
    assert len({(c.method, c.path) for c in PEER_CALLS}) == len(PEER_CALLS)

"""What a running service holds for handoffs, under one app key (`RUNTIME`).

Built by `service.handoffs_ext` when the app starts; read by the route modules. Exactly one of
`decode` / `prefill` is set, by the configured role.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from pipelines.decode import DecodePipeline
from pipelines.errors import InvalidInput
from pipelines.events import EventBus
from pipelines.messages import PEER_PROTOCOL_VERSION, LayoutInfo
from pipelines.prefill import PrefillPipeline
from service.heartbeat import Heartbeats
from service.http_peers import HttpPeers
from service.stages import HostedMemory


@dataclass
class Runtime:
    role: str
    url: str
    target: str
    bus: EventBus
    hosted: list[HostedMemory]
    heartbeats: Heartbeats
    peers: HttpPeers
    decode: DecodePipeline | None = None
    prefill: PrefillPipeline | None = None

    def layout_info(self) -> LayoutInfo:
        return LayoutInfo(
            version=PEER_PROTOCOL_VERSION,
            role=self.role,
            url=self.url,
            target=self.target,
            stages=[h.info() for h in self.hosted],
        )


RUNTIME = web.AppKey("handoff_runtime", Runtime)


def decode_of(request: web.Request) -> DecodePipeline:
    pipeline = request.app[RUNTIME].decode
    assert pipeline is not None, "decode routes are installed on the decode role only"
    return pipeline


def prefill_of(request: web.Request) -> PrefillPipeline:
    pipeline = request.app[RUNTIME].prefill
    assert pipeline is not None, "prefill routes are installed on the prefill role only"
    return pipeline


def check_version(version: int) -> None:
    """Refuse a peer message of another protocol version instead of guessing at it."""
    if version != PEER_PROTOCOL_VERSION:
        raise InvalidInput(
            f"peer protocol version {version} is not supported (this service speaks "
            f"{PEER_PROTOCOL_VERSION}); upgrade the older side",
            field="version",
        )

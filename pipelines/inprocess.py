"""An in-process link between one decode pipeline and prefill pipelines in the same event loop.

Used when an engine embeds kvhandoff and hosts both roles' pipelines in one process (and by the
demo's single-process mode and the tests): each peer call is a direct method call instead of an
HTTP request, with the same messages and the same error tree. Its methods are the calls of
`kvhandoff.pipelines.peer_calls` that the link carries (`PeerCall.in_process`), by the same names;
`tests/unit/pipelines/test_peer_calls.py` fails when one is missing.
"""

from __future__ import annotations

from kvhandoff.pipelines.decode import DecodePipeline
from kvhandoff.pipelines.errors import NotFoundError
from kvhandoff.pipelines.messages import (
    PEER_PROTOCOL_VERSION,
    AbortAck,
    AbortMsg,
    ArrivalMsg,
    DestinationMsg,
    LayoutInfo,
    SegmentAck,
    SegmentMsg,
    StageFailedMsg,
    StageInfo,
    WindowAnswer,
    WindowRequest,
)
from kvhandoff.pipelines.prefill import PrefillPipeline


class InProcessLink:
    """Implements both `prefill.DecodePeer` and `decode.PrefillPeer` by direct calls."""

    def __init__(self) -> None:
        self.decode: DecodePipeline | None = None
        self.prefill: dict[str, tuple[PrefillPipeline, str]] = {}  # url -> (pipeline, target)

    def add_prefill(self, url: str, pipeline: PrefillPipeline, target: str) -> None:
        """Link `pipeline` under `url` (which becomes the sender URL of its notices)."""
        pipeline.url = url
        self.prefill[url] = (pipeline, target)

    def _prefill(self, url: str) -> tuple[PrefillPipeline, str]:
        try:
            return self.prefill[url]
        except KeyError:
            raise NotFoundError(f"no prefill service at {url}", field="prefill") from None

    def _decode(self, url: str) -> DecodePipeline:
        if self.decode is None or self.decode.url != url:
            raise NotFoundError(f"no decode service at {url}", field="decode_url")
        return self.decode

    # decode -> prefill
    async def layout(self, url: str) -> LayoutInfo:
        pipeline, target = self._prefill(url)
        stages = [
            StageInfo(layout=s.layout, fingerprint=s.layout.fingerprint)
            for _, s in sorted(pipeline.stages.items())
        ]
        return LayoutInfo(
            version=PEER_PROTOCOL_VERSION,
            role="prefill",
            url=url,
            target=target,
            stages=stages,
            incarnation=pipeline.incarnation,
            max_call_s=pipeline.max_call_s,
        )

    async def deliver(self, url: str, msg: DestinationMsg) -> None:
        self._prefill(url)[0].deliver(msg)

    async def abort(self, url: str, msg: AbortMsg) -> AbortAck:
        return await self._prefill(url)[0].abort(msg.handoff_id, msg.reason, msg.decode_incarnation)

    # prefill -> decode
    async def arrived(self, decode_url: str, msg: ArrivalMsg) -> None:
        self._decode(decode_url).arrived(msg)

    async def stage_failed(self, decode_url: str, msg: StageFailedMsg) -> None:
        self._decode(decode_url).stage_failed(msg)

    async def window(self, decode_url: str, msg: WindowRequest) -> WindowAnswer:
        return await self._decode(decode_url).window(msg)

    async def segment(self, decode_url: str, msg: SegmentMsg) -> SegmentAck:
        return await self._decode(decode_url).segment(msg)

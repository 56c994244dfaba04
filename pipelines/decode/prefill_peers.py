"""What the decode side knows of its prefill peers: their layouts, which are lost, and which
stages a handoff's list of prefill services resolves to.

Called by the decode pipeline: `stages_of` when a handoff is created (every check runs before
anything is leased or sent, so a rejected handoff changes nothing), `forget` when a peer may have
restarted (a new process registers memory at new addresses), `mark_lost` / `mark_back` from its
heartbeats. Per-peer state is bounded (`PeerCache`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvhandoff.pipelines.errors import InvalidInput, KVHandoffError, PairingError
from kvhandoff.pipelines.layout import StageLayout
from kvhandoff.pipelines.messages import LayoutInfo
from kvhandoff.pipelines.pairing import PairingCache
from kvhandoff.pipelines.pairing_report import pairing_report
from kvhandoff.pipelines.peercache import MAX_PEERS, PeerCache

#: Per PP rank: the prefill URL hosting it, that service's layout answer, the stage's layout.
Stages = dict[int, tuple[str, LayoutInfo, StageLayout]]


class PrefillLayouts(Protocol):
    """The decode → prefill call that fetches a prefill service's layouts."""

    async def layout(self, url: str) -> LayoutInfo: ...


class PrefillDirectory:
    def __init__(
        self,
        layout: StageLayout,
        prefill: PrefillLayouts,
        cache: PairingCache,
        *,
        max_grace_s: float,
        clock: Callable[[], float],
    ) -> None:
        self._layout = layout  # this decode's
        self._prefill = prefill
        self._cache = cache
        self._max_grace_s = max_grace_s
        self._clock = clock
        self._layouts: PeerCache[LayoutInfo] = PeerCache(MAX_PEERS)
        self._lost: PeerCache[float] = PeerCache(MAX_PEERS)  # url -> when declared lost
        self._covered: set[tuple[tuple[int, str, str], ...]] = set()

    def mark_lost(self, url: str) -> None:
        self._lost.put(url, self._clock())
        self.forget(url)

    def hosted(self) -> dict[str, list[int]]:
        """The PP ranks each prefill service with a cached layout hosts."""
        return {
            url: sorted(s.layout.pp_rank for s in info.stages)
            for url, info in self._layouts.snapshot().items()
        }

    def mark_back(self, url: str) -> None:
        self._lost.pop(url)

    def is_lost(self, url: str) -> bool:
        return url in self._lost

    def forget(self, url: str) -> None:
        """Fetch `url`'s layouts afresh next time (it may have restarted with other stages)."""
        self._layouts.pop(url)

    async def stages_of(self, urls: list[str]) -> Stages:
        """Fetch (cached) layouts of the prefill peers, check they form one PP instance and
        pair with this decode layout. Raises before anything is leased or sent."""
        stages: Stages = {}
        index: dict[str, int] = {}  # each URL once, with the position it is first named at
        for i, url in enumerate(urls):
            index.setdefault(url, i)
        for url, i in index.items():
            info = await self._info(url, f"prefill[{i}]")
            for st in info.stages:
                rank = st.layout.pp_rank
                if rank in stages:
                    raise InvalidInput(
                        f"stage {rank} is hosted by both {stages[rank][0]} and {url}",
                        field=f"prefill[{i}]",
                        pp_rank=rank,
                    )
                stages[rank] = (url, info, st.layout)
        sizes = {layout.pp_size for _, _, layout in stages.values()}
        if len(sizes) != 1 or sorted(stages) != list(range(next(iter(sizes)))):
            size = max(sizes) if sizes else 0
            missing = sorted(set(range(size)) - set(stages))
            raise InvalidInput(
                f"the prefill services host stages {sorted(stages)} of pp_size {sorted(sizes)}; "
                f"missing stages {missing}",
                field="prefill",
                pp_rank=missing[0] if missing else None,
            )
        for _, _, layout in stages.values():
            self._cache.get(layout, self._layout)  # PairingError names layer, group or kind
        self._check_coverage([layout for _, _, layout in stages.values()])
        return stages

    async def _info(self, url: str, field: str) -> LayoutInfo:
        """`url`'s layout answer (cached), checked to be a prefill whose declared engine bound
        this decode will wait out (SAFETY.md I5)."""
        info = self._layouts.get(url)
        if info is None:
            try:
                info = await self._prefill.layout(url)
            except KVHandoffError as exc:
                exc.context.setdefault("field", field)
                raise
            self._layouts.put(url, info)
            self._lost.pop(url)  # it answered: no longer lost
        if info.role != "prefill":
            raise InvalidInput(f"{url} is a {info.role} service", field=field)
        if info.max_call_s > self._max_grace_s:
            raise InvalidInput(
                f"{url} declares engine calls of up to {info.max_call_s:g} s, more than this "
                f"decode waits for a silent writer (handoff.max_grace_s = "
                f"{self._max_grace_s:g})",
                field=field,
            )
        return info

    def _check_coverage(self, layouts: list[StageLayout]) -> None:
        """Together the stages must write every decode entry exactly once (cached per set)."""
        key = tuple(sorted((x.pp_rank, x.fingerprint, x.address_key) for x in layouts))
        if key in self._covered:
            return
        report = pairing_report(layouts, self._layout)
        if not report.ok:
            raise PairingError(list(report.problems))
        self._covered.add(key)

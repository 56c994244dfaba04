"""EmbeddedService over an engine's own layouts (`EngineStage`): no [model] table, the layout
built from flat pointer lists as SGLang publishes them, raw (addr, length) buffers."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvhandoff.pipelines.decode.views import HandoffRequest
from kvhandoff.pipelines.errors import ConflictError
from kvhandoff.pipelines.events import (
    Event,
    HandoffAborted,
    HandoffCompleted,
    HandoffFailed,
    StageTransferred,
)
from kvhandoff.pipelines.layout import layout_from_flat_lists
from kvhandoff.pipelines.states import HandoffState
from kvhandoff.service.config import Config, ConfigError
from kvhandoff.service.embedded import EmbeddedService
from kvhandoff.service.runtime.stages import EngineStage
from tests.fakes import local_config

ITEM = 64  # bytes of one page of one buffer


def config(tmp_path: Path, role: str, **overrides: Any) -> Config:
    stages = (
        [{"num_pages": 16}]
        if role == "decode"
        else [{"pp_rank": r, "pp_size": 2, "num_pages": 8} for r in (0, 1)]
    )
    return local_config(role, stages, tmp_path / role, **overrides)


def engine_stage(
    layer_ids: list[int], pp_rank: int, pp_size: int, pages: int, gen: torch.Generator | None
) -> tuple[EngineStage, list[torch.Tensor]]:
    # K then V of every layer: the group-major flat list, ids repeated once per group.
    tensors = [
        torch.randint(1, 255, (pages * ITEM,), dtype=torch.uint8, generator=gen)
        if gen is not None
        else torch.zeros(pages * ITEM, dtype=torch.uint8)
        for _ in range(2 * len(layer_ids))
    ]
    layout = layout_from_flat_lists(
        pp_rank=pp_rank,
        pp_size=pp_size,
        page_size=4,
        dtype="bfloat16",
        kv_data_ptrs=[t.data_ptr() for t in tensors],
        kv_data_lens=[t.numel() for t in tensors],
        kv_item_lens=[ITEM] * len(tensors),
        kv_layer_ids=layer_ids * 2,
    )
    return EngineStage(layout, [(t.data_ptr(), t.numel()) for t in tensors]), tensors


def test_a_config_without_a_model_needs_the_engine_s_layouts(tmp_path: Path) -> None:
    cfg = config(tmp_path, "decode")
    assert cfg.model is None
    with pytest.raises(ConfigError) as err:
        cfg.model_spec()
    assert err.value.context["field"] == "model"


def test_a_handoff_between_engine_layouts_lands_in_the_engine_s_memory(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    # A hybrid model: full attention only on layers 1, 3 (stage 0) and 5 (stage 1).
    s0, t0 = engine_stage([1, 3], 0, 2, 8, gen)
    s1, t1 = engine_stage([5], 1, 2, 8, gen)
    with EmbeddedService(config(tmp_path, "prefill"), buffers={0: s0, 1: s1}) as prefill:
        d, td = engine_stage([1, 3, 5], 0, 1, 16, None)
        dcfg = config(tmp_path, "decode", **{"peers.prefill": [prefill.url]})
        with EmbeddedService(dcfg, buffers={0: d}) as decode:
            for rank in (0, 1):
                prefill.stage_ready("h1", rank, [2, 5, 6])
            decode.expect_handoff(HandoffRequest(id="h1", dst_pages=[9, 0, 11]))
            view = decode.wait("h1", 15.0)
            assert view.state == HandoffState.COMPLETED, view.error
            assert decode.released("h1", 5.0)
    # Decode entry order: K1 K3 K5 V1 V3 V5; source: stage 0 K1 K3 V1 V3, stage 1 K5 V5.
    sources = [t0[0], t0[1], t1[0], t0[2], t0[3], t1[1]]
    for src, dst in zip(sources, td):
        sent = src.numpy().reshape(8, ITEM)[[2, 5, 6]]
        landed = dst.numpy().reshape(16, ITEM)
        assert np.array_equal(landed[[9, 0, 11]], sent)
        assert not np.delete(landed, [9, 0, 11], axis=0).any()


def test_an_engine_layout_for_another_stage_is_refused(tmp_path: Path) -> None:
    s1, _ = engine_stage([5], 1, 2, 8, None)
    with pytest.raises(ConfigError) as err:
        EmbeddedService(config(tmp_path, "prefill"), buffers={0: s1, 1: s1}).start()
    assert "stage 1 of 2" in err.value.message


def test_a_prefill_that_gives_up_fails_the_handoff_on_the_decode(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(5)
    s0, _ = engine_stage([1, 3], 0, 2, 8, gen)
    s1, _ = engine_stage([5], 1, 2, 8, gen)
    with EmbeddedService(config(tmp_path, "prefill"), buffers={0: s0, 1: s1}) as prefill:
        d, _alive = engine_stage([1, 3, 5], 0, 1, 16, None)  # raw addresses: keep the tensors
        dcfg = config(tmp_path, "decode", **{"peers.prefill": [prefill.url]})
        with EmbeddedService(dcfg, buffers={0: d}) as decode:
            prefill.stage_ready("h2", 0, [2, 5])  # stage 1 never comes: its client went away
            decode.expect_handoff(HandoffRequest(id="h2", dst_pages=[9, 0]))
            prefill.abort_prefill("h2", "client disconnected")
            start = time.monotonic()
            view = decode.wait("h2", 15.0)
            # Told, not timed out (stage 1 never comes; the deadline is 30 s): the stages fail
            # with the engine's reason, or, when the give-up beat the destination's delivery,
            # the delivery is refused (the handoff is finished there).
            assert view.state == HandoffState.FAILED and time.monotonic() - start < 5.0, view
            assert view.error is not None and view.error.code in ("engine_aborted", "conflict")
            assert decode.released("h2", 5.0)
            # Given up before any signal: a later one is refused, nothing waits for it.
            prefill.abort_prefill("h3", "client disconnected")
            with pytest.raises(ConflictError):
                prefill.stage_ready("h3", 0, [1])


def test_a_withdrawn_handoff_ends_aborted_here_and_one_a_decode_holds_is_kept(
    tmp_path: Path,
) -> None:
    gen = torch.Generator().manual_seed(7)
    s0, _ = engine_stage([1, 3], 0, 2, 8, gen)
    s1, _ = engine_stage([5], 1, 2, 8, gen)
    events: list[Event] = []
    with EmbeddedService(config(tmp_path, "prefill"), buffers={0: s0, 1: s1}) as prefill:
        prefill.add_listener(events.append)
        # Signalled early (a first page range), then another rank turned out to send it: no
        # decode holds it.
        prefill.stage_ready("w1", 0, [1, 2], pages_from=0, last_pages=False)
        assert prefill.withdraw_prefill("w1", "another rank sends it")
        # Withdrawn before any signal: the signal that comes later is refused.
        assert prefill.withdraw_prefill("w0", "another rank sends it")
        with pytest.raises(ConflictError):
            prefill.stage_ready("w0", 0, [1], pages_from=0, last_pages=True)
        d, _alive = engine_stage([1, 3, 5], 0, 1, 16, None)  # raw addresses: keep the tensors
        dcfg = config(tmp_path, "decode", **{"peers.prefill": [prefill.url]})
        with EmbeddedService(dcfg, buffers={0: d}) as decode:
            # A decode holds w2 (its stage 0 moved; stage 1 is still to come): not withdrawn.
            decode.expect_handoff(HandoffRequest(id="w2", dst_pages=[4, 7]))
            prefill.stage_ready("w2", 0, [3, 6])
            end = time.monotonic() + 10.0
            while time.monotonic() < end and not any(
                isinstance(e, StageTransferred) and e.handoff_id == "w2" for e in events
            ):
                time.sleep(0.02)
            assert not prefill.withdraw_prefill("w2", "another rank sends it")
            prefill.stage_ready("w2", 1, [3, 6])
            assert decode.wait("w2", 15.0).state == HandoffState.COMPLETED
            # A decode asking for w1 after all is refused by the prefill: nothing lands.
            decode.expect_handoff(HandoffRequest(id="w1", dst_pages=[0, 1]))
            assert decode.wait("w1", 15.0).state == HandoffState.FAILED
    terminal = (HandoffAborted, HandoffFailed, HandoffCompleted)
    ended = [(type(e).__name__, e.handoff_id) for e in events if isinstance(e, terminal)]
    assert ended[0] == ("HandoffAborted", "w1"), ended
    assert ("HandoffFailed", "w1") not in ended and ("HandoffAborted", "w2") not in ended
    aborted = next(e for e in events if isinstance(e, HandoffAborted))
    assert aborted.reason == "another rank sends it"

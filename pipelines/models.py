"""Model descriptions, PP partitions and the stage layouts they imply.

A `ModelSpec` says which layers are full attention (own KV pages, one buffer per group), which
are linear attention (own one state slot per request per state kind, each kind of a state
component with a slot of its own) and what per-request metadata rows (aux entries) the last
stage writes. `partition_layers` splits
the layers over PP stages; `stage_layout` / `decode_layout` turn both into unplaced layouts (all
bases 0) whose `region_sizes` a pool allocates before `StageLayout.with_bases` places them.

Presets cover the cases kvhandoff is built for, each with a `scale` that shrinks item sizes for CPU
tests and demos while keeping the layer pattern.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Annotated

from msgspec import Meta, Struct

from kvhandoff.pipelines.errors import LayoutError
from kvhandoff.pipelines.layout import DEFAULT_COMPONENT, AuxEntry, KVEntry, StageLayout, StateEntry

Positive = Annotated[int, Meta(gt=0)]
NonNeg = Annotated[int, Meta(ge=0)]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "float8_e4m3": 1}


class AttentionKind(StrEnum):
    MHA = "mha"  # groups: K, V
    MLA = "mla"  # one latent buffer (c_kv and k_rope side by side)
    NPU_MLA = "npu_mla"  # groups: c_kv, k_rope, optionally indexer keys


class KVGroup(Struct, frozen=True):
    """One buffer group of every full-attention layer."""

    name: str
    bytes_per_token: Positive


class StateKind(Struct, frozen=True):
    """One linear-attention state tensor kind of every linear layer; kinds of one component
    share a request's slot."""

    kind: str
    slot_bytes: Positive
    component: str = DEFAULT_COMPONENT


class ModelSpec(Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    num_layers: Positive
    full_attention_layers: tuple[NonNeg, ...]
    attention: AttentionKind
    kv_groups: tuple[KVGroup, ...]
    state_kinds: tuple[StateKind, ...] = ()
    page_size: Positive = 16
    dtype: str = "bfloat16"
    # Speculative-decoding draft layers (MTP / EAGLE): full attention, hosted by the last PP stage,
    # ids in a reserved band starting at `num_layers` so they pair like any other layer.
    num_draft_layers: NonNeg = 0
    # Per-request metadata rows the last PP stage writes (an engine's output ids, logprobs...):
    # bytes of one row of each aux entry.
    aux_row_bytes: tuple[Positive, ...] = ()

    def __post_init__(self) -> None:
        bad = [i for i in self.full_attention_layers if i >= self.num_layers]
        if bad:
            raise LayoutError(
                f"full-attention layer {bad[0]} is outside the model's {self.num_layers} layers",
                field="full_attention_layers",
                layer_id=bad[0],
            )
        if len(set(self.full_attention_layers)) != len(self.full_attention_layers):
            raise LayoutError(
                "full_attention_layers lists a layer twice", field="full_attention_layers"
            )
        if not self.kv_groups:
            raise LayoutError("a model needs at least one KV group", field="kv_groups")

    @property
    def linear_layers(self) -> list[int]:
        full = set(self.full_attention_layers)
        return [i for i in range(self.num_layers) if i not in full] if self.state_kinds else []

    @property
    def draft_layers(self) -> list[int]:
        return list(range(self.num_layers, self.num_layers + self.num_draft_layers))

    def item_len(self, group: int) -> int:
        """Bytes of one page of one group's buffer."""
        return self.page_size * self.kv_groups[group].bytes_per_token


def every_nth(num_layers: int, interval: int, offset: int | None = None) -> tuple[int, ...]:
    """Full-attention layers at a fixed interval: with interval 4, layers 3, 7, 11, ... (3:1)."""
    if interval <= 0:
        raise LayoutError("interval must be positive", field="interval")
    start = interval - 1 if offset is None else offset
    return tuple(range(start, num_layers, interval))


# ---------------------------------------------------------------------------------------------
# PP partition


class Partition(Struct, frozen=True):
    """Layer ranges per PP stage: stage k owns layers [bounds[k], bounds[k + 1])."""

    bounds: tuple[int, ...]

    @property
    def pp_size(self) -> int:
        return len(self.bounds) - 1

    def layers(self, pp_rank: int) -> range:
        return range(self.bounds[pp_rank], self.bounds[pp_rank + 1])


def partition_layers(
    num_layers: int,
    pp_size: int,
    *,
    counts: Sequence[int] | None = None,
    boundaries: Sequence[int] | None = None,
) -> Partition:
    """Split layers over PP stages: evenly (the last stages take the remainder, as vLLM does),
    by explicit per-stage `counts`, or by explicit interior `boundaries`."""
    if pp_size <= 0:
        raise LayoutError("pp_size must be positive", field="pp_size")
    if counts is not None and boundaries is not None:
        raise LayoutError("give counts or boundaries, not both", field="counts")
    if boundaries is not None:
        bounds = (0, *boundaries, num_layers)
    else:
        if counts is None:
            base, extra = divmod(num_layers, pp_size)
            counts = [base + (1 if k >= pp_size - extra else 0) for k in range(pp_size)]
        if len(counts) != pp_size or sum(counts) != num_layers:
            raise LayoutError(
                f"layer counts {list(counts)} do not add up to {num_layers} layers "
                f"over {pp_size} stages",
                field="counts",
            )
        acc, out = 0, [0]
        for c in counts:
            acc += c
            out.append(acc)
        bounds = tuple(out)
    if len(bounds) != pp_size + 1 or any(b >= a for a, b in zip(bounds[1:], bounds)):
        # strictly increasing: every stage owns at least one layer
        raise LayoutError(
            f"boundaries {list(bounds)} do not split {num_layers} layers into {pp_size} "
            "non-empty stages",
            field="boundaries",
        )
    if bounds[-1] != num_layers:
        raise LayoutError("boundaries must end at num_layers", field="boundaries")
    return Partition(bounds=bounds)


# ---------------------------------------------------------------------------------------------
# Layouts from a model


def _layout(
    model: ModelSpec,
    kv_layers: Sequence[int],
    state_layers: Sequence[int],
    *,
    pp_rank: int,
    pp_size: int,
    num_pages: int,
    num_slots: int,
    with_aux: bool,
) -> StageLayout:
    kv = tuple(
        KVEntry(layer_id=layer, group=g, item_len=model.item_len(g), num_items=num_pages, base=0)
        for g in range(len(model.kv_groups))  # group-major: the layer-id contract's order
        for layer in kv_layers
    )
    state = tuple(
        StateEntry(
            layer_id=layer,
            kind=s.kind,
            item_len=s.slot_bytes,
            num_slots=num_slots,
            base=0,
            component=s.component,
        )
        for s in model.state_kinds
        for layer in state_layers
    )
    if with_aux and model.aux_row_bytes and num_slots <= 0:
        raise LayoutError(
            f"model {model.name} has aux entries: num_slots (their rows) must be positive",
            field="num_slots",
        )
    # One aux row per request in flight, as many as state slots.
    aux = tuple(AuxEntry(b, num_slots, 0) for b in model.aux_row_bytes) if with_aux else ()
    return StageLayout(
        pp_rank=pp_rank,
        pp_size=pp_size,
        page_size=model.page_size,
        dtype=model.dtype,
        kv=kv,
        state=state,
        aux=aux,
    )


def stage_layout(
    model: ModelSpec,
    partition: Partition,
    pp_rank: int,
    *,
    num_pages: int,
    num_slots: int,
) -> StageLayout:
    """The unplaced layout of one prefill PP stage: only its own layers (and drafts and aux
    entries if last). `num_slots` sizes the state pools and the aux entries' rows."""
    owned = set(partition.layers(pp_rank))
    kv_layers = [i for i in model.full_attention_layers if i in owned]
    if pp_rank == partition.pp_size - 1:
        kv_layers += model.draft_layers
    state_layers = [i for i in model.linear_layers if i in owned]
    return _layout(
        model,
        kv_layers,
        state_layers,
        pp_rank=pp_rank,
        pp_size=partition.pp_size,
        num_pages=num_pages,
        num_slots=num_slots,
        with_aux=pp_rank == partition.pp_size - 1,
    )


def decode_layout(model: ModelSpec, *, num_pages: int, num_slots: int) -> StageLayout:
    """The unplaced layout of a decode instance (PP = 1): every layer of the model."""
    kv_layers = [*model.full_attention_layers, *model.draft_layers]
    return _layout(
        model,
        kv_layers,
        model.linear_layers,
        pp_rank=0,
        pp_size=1,
        num_pages=num_pages,
        num_slots=num_slots,
        with_aux=True,
    )


# ---------------------------------------------------------------------------------------------
# Presets. Sizes follow real models at scale=1; `scale` divides per-token and per-slot bytes.


def _scaled(value: int, scale: int) -> int:
    return max(1, value // scale)


def dense_mha(*, num_layers: int = 32, scale: int = 1, page_size: int = 16) -> ModelSpec:
    """Llama-style dense MHA/GQA: 8 KV heads x 128 dims, bf16; K and V groups."""
    per_token = _scaled(8 * 128 * 2, scale)
    return ModelSpec(
        name="dense-mha",
        num_layers=num_layers,
        full_attention_layers=tuple(range(num_layers)),
        attention=AttentionKind.MHA,
        kv_groups=(KVGroup("k", per_token), KVGroup("v", per_token)),
        page_size=page_size,
    )


def dense_mla(*, num_layers: int = 61, scale: int = 1, page_size: int = 64) -> ModelSpec:
    """DeepSeek-style dense MLA: one latent buffer of 512 + 64 dims, bf16; one MTP draft layer."""
    return ModelSpec(
        name="dense-mla",
        num_layers=num_layers,
        full_attention_layers=tuple(range(num_layers)),
        attention=AttentionKind.MLA,
        kv_groups=(KVGroup("latent", _scaled((512 + 64) * 2, scale)),),
        page_size=page_size,
        num_draft_layers=1,
    )


def hybrid_mha(*, num_layers: int = 48, scale: int = 1, page_size: int = 16) -> ModelSpec:
    """Qwen3-Next-style hybrid: 3 linear (gated delta net) : 1 full-attention MHA layer, with
    conv and temporal (recurrent) state per linear layer."""
    per_token = _scaled(2 * 256 * 2, scale)
    return ModelSpec(
        name="hybrid-mha",
        num_layers=num_layers,
        full_attention_layers=every_nth(num_layers, 4),
        attention=AttentionKind.MHA,
        kv_groups=(KVGroup("k", per_token), KVGroup("v", per_token)),
        state_kinds=(
            StateKind("conv", _scaled(3 * 8192 * 2, scale)),
            StateKind("temporal", _scaled(32 * 128 * 128 * 2, scale)),
        ),
        page_size=page_size,
    )


def hybrid_npu_mla(
    *, num_layers: int = 48, scale: int = 1, page_size: int = 128, indexer: bool = False
) -> ModelSpec:
    """Hybrid 3:1 model with MLA full attention as laid out on Ascend NPU: separate c_kv (512)
    and k_rope (64) buffers of different item length, optionally an indexer-key group (128)."""
    groups = [KVGroup("c_kv", _scaled(512 * 2, scale)), KVGroup("k_rope", _scaled(64 * 2, scale))]
    if indexer:
        groups.append(KVGroup("indexer", _scaled(128 * 2, scale)))
    return ModelSpec(
        name="hybrid-npu-mla" + ("-indexer" if indexer else ""),
        num_layers=num_layers,
        full_attention_layers=every_nth(num_layers, 4),
        attention=AttentionKind.NPU_MLA,
        kv_groups=tuple(groups),
        state_kinds=(
            StateKind("conv", _scaled(3 * 8192 * 2, scale)),
            StateKind("temporal", _scaled(32 * 128 * 128 * 2, scale)),
        ),
        page_size=page_size,
    )


PRESETS = {
    "dense-mha": dense_mha,
    "dense-mla": dense_mla,
    "hybrid-mha": hybrid_mha,
    "hybrid-npu-mla": hybrid_npu_mla,
}


def preset(name: str, **kwargs: int | bool) -> ModelSpec:
    """A preset by name (see PRESETS), with keyword overrides such as `scale=64`."""
    try:
        factory = PRESETS[name]
    except KeyError:
        raise LayoutError(
            f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}", field="model"
        ) from None
    return factory(**kwargs)

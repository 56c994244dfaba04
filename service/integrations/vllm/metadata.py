"""What the connector's halves and its two engines tell each other.

- `HandoffParams`: the prefill's `kv_transfer_params` (under `PARAMS_KEY`, beside vLLM's own
  `do_remote_prefill` / `do_remote_decode`), which vLLM's proxy carries to the decode
  unchanged: the handoff's base id, every prefill worker's service URL by TP rank and PP
  stage, and the prompt length the pages hold. Versioned: a decode refuses params of another
  version by name instead of misreading them.
- `StepMeta`: scheduler half -> worker half, once per engine step (`build_connector_meta`):
  the prefill requests whose blocks are ready to send, the decode requests whose blocks were
  allocated for a load.
- `ServiceHandshake`: worker half -> scheduler half, once at start-up (vLLM's handshake
  metadata): the worker's service URL, which the prefill's scheduler puts into the params.

The scheduler and the workers may be different processes (vLLM pickles these), so they hold
plain values only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

#: The key of the connector's own part of `kv_transfer_params`.
PARAMS_KEY = "kvhandoff"
#: Bump when `HandoffParams` changes incompatibly. 1: first version.
PARAMS_VERSION = 1


class HandoffParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The prefill's part of `kv_transfer_params`: enough for a decode to create the handoff."""

    version: int
    id: str  # the base handoff id; TP rank r's handoff is `rank_handoff_id(id, r)`
    services: list[list[str]]  # [tp_rank][pp_rank] -> the service URL of that prefill worker
    tokens: int  # prompt tokens whose KV the prefill's pages hold


def rank_handoff_id(base: str, tp_rank: int) -> str:
    """The handoff TP rank `tp_rank` of the prefill sends to the decode's rank of that index."""
    return f"{base}-tp{int(tp_rank)}"


def params_of(kv_transfer_params: dict[str, Any] | None) -> HandoffParams | None:
    """The connector's params in a request's `kv_transfer_params`, or None when it has none;
    ValueError naming the field when they do not fit this version."""
    raw = (kv_transfer_params or {}).get(PARAMS_KEY)
    if raw is None:
        return None
    try:
        params = msgspec.convert(raw, HandoffParams)
    except msgspec.ValidationError as exc:
        raise ValueError(f"kv_transfer_params.{PARAMS_KEY}: {exc}") from None
    if params.version != PARAMS_VERSION:
        raise ValueError(
            f"kv_transfer_params.{PARAMS_KEY}.version = {params.version}: this connector "
            f"reads version {PARAMS_VERSION}"
        )
    return params


@dataclass(frozen=True)
class Send:
    """Prefill: request `req_id` finished; its first `pages` hold its prompt's KV."""

    req_id: str
    handoff: str  # base id
    pages: list[int]
    slots: dict[str, int] = field(default_factory=dict)  # per Mamba component, its block


@dataclass(frozen=True)
class Recv:
    """Decode: load request `req_id`'s prompt into `pages` (after the `prefix_pages` it holds)."""

    req_id: str
    params: HandoffParams
    pages: list[int]
    prefix_pages: int
    slots: dict[str, int] = field(default_factory=dict)  # per Mamba component, its block


@dataclass
class StepMeta(KVConnectorMetadata):
    sends: list[Send] = field(default_factory=list)
    recvs: list[Recv] = field(default_factory=list)


@dataclass(frozen=True)
class ServiceHandshake(KVConnectorHandshakeMetadata):
    url: str

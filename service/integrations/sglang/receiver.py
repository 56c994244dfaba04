"""The decode side of one request on one scheduler rank, as SGLang's decode scheduler calls it
(`decode.py`): `__init__`, `init` (pairs with the prefill, takes the handoff its sending
prefill rank is named for, excuses SGLang's dummy prefill ranks), `send_metadata` (creates the
handoff: destination pages, a slot per state component, the aux row; with SGLang's decode radix
cache, the pages of the prefix it holds, which the prefill's service then skips), `poll`,
`failure_exception`, `abort` / `ensure_abort_notified` (every Failed), `clear`, then
`is_abort_release_safe` until SGLang frees the pages. The handoff's record is the manager's
`decode_rooms` (`kvhandoff.service.integrations.rooms.decode`): SGLang frees the pages only once it
is released.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll, KVTransferDestination
from sglang.srt.disaggregation.common.conn import CommonKVReceiver

from kvhandoff.pipelines.decode.views import HandoffRequest
from kvhandoff.pipelines.errors import KVHandoffError
from kvhandoff.service.integrations.sglang import excusal
from kvhandoff.service.integrations.sglang.bootstrap import URL_FIELD
from kvhandoff.service.integrations.sglang.ids import handoff_id
from kvhandoff.service.integrations.sglang.layouts import component_slots
from kvhandoff.service.integrations.sglang.manager import KVHandoffManager

log = logging.getLogger("kvhandoff.sglang")


class KVHandoffReceiver(CommonKVReceiver):
    """Decode side of one request on one rank (see the module doc)."""

    kv_mgr: KVHandoffManager
    conclude_state: int | None  # SGLang's, set by CommonKVReceiver

    def __init__(
        self, mgr: KVHandoffManager, bootstrap_addr: str, bootstrap_room: int | None = None
    ) -> None:
        # The handoff this rank receives: named after the prefill TP rank that sends it, which
        # `init` learns (SGLang's `target_tp_rank`); this rank's own until then.
        self._hid = handoff_id(bootstrap_room or 0, mgr.tp_rank_for_handoffs)
        # How many decode ranks take the sending prefill rank's bytes (`init`: an MLA decode of
        # k times the prefill's attention TP), this one included.
        self._fan_out = 1
        if bootstrap_room is not None:
            mgr.decode_rooms.open(bootstrap_room, self._hid)
        self._forgot_prefill = False
        super().__init__(mgr, bootstrap_addr, bootstrap_room)

    def poll(self) -> KVPoll:
        state = super().poll()
        room = self.bootstrap_room
        if (
            state == KVPoll.Failed
            and not self._forgot_prefill
            and self.kv_mgr.prefill_unreachable(room)
        ):
            # SGLang keeps a prefill's bootstrap rows (its ranks' kvhandoff URLs) for every later
            # request; a rank that could not be reached may be gone or started again on another
            # port. The next request fetches them anew, as SGLang's own backends do after a
            # failed send, so no failure sticks to a prefill that has come back. (Other failures
            # keep them: a client's abort says nothing about the prefill.)
            self._forgot_prefill = True
            self.invalidate_cached_bootstrap_infos()
        return state

    def init(self, prefill_dp_rank: int) -> None:
        super().init(prefill_dp_rank)
        if self.conclude_state == KVPoll.Failed or not hasattr(self, "prefill_info"):
            return
        mgr, room = self.kv_mgr, self.bootstrap_room
        if not mgr.check_pairing(room, self.prefill_info):
            self.conclude_state = KVPoll.Failed
            return
        sender = self.prefill_info.target_tp_rank
        # A decode of k times the prefill's attention TP (MLA): SGLang has decode ranks
        # k*p .. k*p + k - 1 take prefill rank p's bytes, each a copy of its own.
        prefill_tp, decode_tp = int(self.prefill_info.attn_tp_size), int(mgr.attn_tp_size)
        self._fan_out = decode_tp // prefill_tp if decode_tp > prefill_tp else 1
        copy = (int(mgr.kv_args.engine_rank) % decode_tp) % self._fan_out
        if sender is not None and handoff_id(room, sender, copy) != self._hid:
            mgr.decode_rooms.close(self._hid)  # never asked for: nothing leased
            self._hid = handoff_id(room, sender, copy)
            mgr.decode_rooms.open(room, self._hid)
        self._excuse_dummy_ranks()

    def _excuse_dummy_ranks(self) -> None:
        """Tell each prefill rank SGLang made dummy for this request (an MLA prefill of larger
        TP: `excusal.py`) that it moves nothing, over SGLang's channel to the rank; a rank that
        cannot be told fails the request, as SGLang's own metadata send does."""
        mgr, room = self.kv_mgr, self.bootstrap_room
        for info in self.bootstrap_infos or []:
            if not info.get("is_dummy"):
                continue
            url = info.get(URL_FIELD)
            if not url:
                mgr.fail(
                    room,
                    f"the dummy prefill rank {info.get('rank_ip')}:"
                    f"{info.get('rank_port')} registered no kvhandoff service",
                )
                self.conclude_state = KVPoll.Failed
                return
            message = excusal.excusal(mgr.secret, room, url)
            if not self._send_bootstrap_message(
                bootstrap_info=info, message=message, operation="send_metadata"
            ):
                return

    def _register_kv_args(self) -> bool:
        return self.bootstrap_infos is not None  # kvhandoff services exchange layouts themselves

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        decode_prefix_len: int | None = None,
        destination: KVTransferDestination = KVTransferDestination.DEVICE,
        device_kv_indices: Any = None,
    ) -> None:
        mgr, room = self.kv_mgr, self.bootstrap_room
        if getattr(self, "conclude_state", None) == KVPoll.Failed:
            return
        built = self._handoff_request(
            kv_indices, aux_index, state_indices, decode_prefix_len, destination
        )
        if isinstance(built, str):
            # Refused as the other unsupported features are: this request fails with the
            # reason, the scheduler goes on (an exception here would take it down).
            mgr.fail(room, built)
            return
        if self._submit_create(built):
            self.init_time = time.time()

    def _handoff_request(
        self,
        kv_indices: Any,
        aux_index: int | None,
        state_indices: list[Any] | None,
        decode_prefix_len: int | None,
        destination: KVTransferDestination,
    ) -> HandoffRequest | str:
        """The handoff SGLang's metadata describes, or why this request cannot have one."""
        mgr = self.kv_mgr
        if getattr(self, "bootstrap_infos", None) is None:
            return f"Could not fetch prefill parallel info from {self.bootstrap_addr}"
        if destination != KVTransferDestination.DEVICE:
            return (
                f"kvhandoff: KV destination {destination.name} is not supported "
                "(device destinations only)"
            )
        # Tokens the decode holds already (its radix cache): whole pages, which the prefill's
        # service skips; `kv_indices` are the pages after them.
        prefix_tokens, page_size = int(decode_prefix_len or 0), int(mgr.kv_args.page_size)
        if prefix_tokens % page_size:
            return (
                f"kvhandoff: decode_prefix_len = {prefix_tokens} is not a whole number of "
                f"{page_size}-token pages"
            )
        slots, refused = component_slots(mgr.state_types, state_indices)
        if refused:
            return f"kvhandoff: {refused}"
        urls = sorted(
            {i[URL_FIELD] for i in self.bootstrap_infos if i.get(URL_FIELD) and not i["is_dummy"]}
        )
        if not urls:
            return (
                f"the bootstrap server at {self.bootstrap_addr} named no kvhandoff "
                "service (a prefill of another backend?)"
            )
        return HandoffRequest(
            id=self._hid,
            prefill=urls,
            dst_pages=[int(p) for p in np.asarray(kv_indices).tolist()],
            prefix_pages=prefix_tokens // page_size,
            fan_out=self._fan_out,
            dst_slots=slots,
            dst_aux=int(aux_index) if (mgr.rank.has_aux and aux_index is not None) else None,
        )

    def _submit_create(self, request: HandoffRequest) -> bool:
        """Create the handoff on the manager's call threads; False when SGLang gave the
        request up already (nothing to create)."""
        mgr, room = self.kv_mgr, self.bootstrap_room
        hid, rooms = self._hid, mgr.decode_rooms
        if not rooms.creating(hid):
            return False

        def create() -> None:
            try:
                mgr.service.expect_handoff(request)
            except (KVHandoffError, ValueError, TimeoutError) as exc:
                rooms.refused(hid)  # refused or cut short before anything was leased
                log.info("create of %s (room %s) refused: %s", hid, room, exc)
                raise
            if rooms.created(hid):  # given up while the create was queued or ran: stopped now
                mgr.abort_decode(room, hid)

        mgr.submit(room, "create", create)
        return True

    def _send_abort_notification(self, *, force_arm: bool = False) -> None:
        """SGLang's abort, its waiting timeout, and (with its deferred release) every Failed
        it sees, kvhandoff's own failures included: the handoff is stopped on the abort
        threads, and SGLang holds the pages until `is_abort_release_safe` says released."""
        self.kv_mgr.abort_decode(self.bootstrap_room, self._hid)

    def is_abort_release_safe(self) -> bool:
        """True once the room's handoffs are released: no write of them can land any more."""
        return self.kv_mgr.is_abort_release_safe(self.bootstrap_room)

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.decode_rooms.close(self._hid)

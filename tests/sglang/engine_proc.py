"""One SGLang scheduler rank's disaggregation calls, replayed in its own process.

Started by `test_backend.py` as `python -m tests.sglang.engine_proc <role> <pp_rank> <pp_size>
<bootstrap_port> <dist_port> <model_dir> <variant>`. The variant is a JSON object:
`aux_items` replaces the aux buffers' row sizes, `mamba_items` the Mamba tensors' slot sizes,
to make a rank whose memory differs from its peers' (`[]`: a model without state, as
DeepSeek's); `tp_size` and `tp_rank` place it in an attention TP group, `cp_size` and
`cp_rank` in a prefill's attention CP group, `dp_size` and `dp_rank` in a DP-attention group;
`load_balance` is SGLang's `--load-balance-method`; `mla` makes it an MLA model's rank. It
publishes SGLang's runtime context as a scheduler does, builds `KVArgs` over CPU tensors
(their `data_ptr()`s), gets the manager, sender and receiver classes through SGLang's
`get_kv_class`, and makes the calls SGLang's `prefill.py` / `decode.py` make, in their order,
for each command read from stdin (one JSON object a line); it answers one JSON line each. PP
ranks of the prefill share a gloo group, as SGLang's pp_group.

The memory: a hybrid model of 8 layers, full attention on 1, 3 (stage 0) and 5, 7 (stage 1),
K and V buffers, pages of 4 tokens, and a speculative-decoding draft layer (MTP: K and V, id 8,
appended as SGLang appends `num_draft_entries`) on the last stage and the decode; SGLang's
MAMBA state component on the linear layers 0, 2 (stage 0) and 4, 6 (stage 1), a conv and a
temporal tensor per layer listed tensor-major with their global layer ids (as SGLang's
`HybridLinearKVPool.get_state_layer_ids`), one slot per request (its `state_indices`:
`[array([slot])]`); three aux buffers (output ids, logprobs, bootstrap room) with one row per
request. `tensors()` makes the same bytes in the test, from the same seed. A request's Mamba
slot is its command's `mamba`, else `(aux + 1) % MAMBA_SLOTS`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

import numpy as np
import torch

MODEL_LAYERS = 8
FULL_ATTENTION = {0: [1, 3], 1: [5, 7]}  # per prefill PP stage (layers 0-3, 4-7)
PAGE_SIZE = 4
KV_ITEM = PAGE_SIZE * 16  # bytes of one page of one buffer
AUX_ITEMS = [16, 32, 8]  # output ids, logprobs, bootstrap_room (int64)
PREFILL_PAGES, DECODE_PAGES, AUX_ROWS = 32, 48, 8
LINEAR = {0: [0, 2], 1: [4, 6]}  # Mamba layers per prefill PP stage
MAMBA_ITEMS = [24, 40]  # bytes of one slot of the conv and the temporal tensor
MAMBA_SLOTS = 6
DRAFT_LAYER = MODEL_LAYERS  # SGLang's id of the first draft layer (`build_kv_layer_ids`)


def mamba_layers(role: str, pp_rank: int, pp_size: int = 2) -> list[int]:
    return LINEAR[pp_rank] if role == "prefill" and pp_size > 1 else LINEAR[0] + LINEAR[1]


def mamba_slot(cmd: dict[str, Any]) -> int:
    return int(cmd.get("mamba", (int(cmd["aux"]) + 1) % MAMBA_SLOTS))


def has_draft(role: str, pp_rank: int, pp_size: int = 2) -> bool:
    """The draft model's KV (one MTP layer) lives on the last prefill stage and the decode."""
    return role == "decode" or pp_rank == pp_size - 1


def kv_entries(
    role: str, pp_rank: int, pp_size: int = 2, *, mla: bool = False
) -> list[tuple[int, int]]:
    """(layer id, group) of each KV buffer in SGLang's order: the target's K then V, then the
    draft's K and V with SGLang's draft id (the band above the target's layers). MLA: one
    latent buffer per layer, no V."""
    groups = [0] if mla else [0, 1]
    ids = layer_ids(role, pp_rank, pp_size)
    draft = [(DRAFT_LAYER, g) for g in groups] if has_draft(role, pp_rank, pp_size) else []
    return [(i, g) for g in groups for i in ids] + draft


def layer_ids(role: str, pp_rank: int, pp_size: int = 2) -> list[int]:
    """The full-attention layers of a rank: its stage's (a prefill of two PP stages) or all."""
    if role == "prefill" and pp_size > 1:
        return FULL_ATTENTION[pp_rank]
    return FULL_ATTENTION[0] + FULL_ATTENTION[1]


Tensors = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]


def tensors(
    role: str,
    pp_rank: int,
    aux_items: list[int] = AUX_ITEMS,
    mamba_items: list[int] = MAMBA_ITEMS,
    *,
    pp_size: int = 2,
    tp_rank: int = 0,
    cp_rank: int = 0,
    dp_rank: int = 0,
    mla: bool = False,
) -> Tensors:
    """(KV buffers group-major: K of each layer then V; Mamba buffers tensor-major: conv of
    each linear layer, then temporal; aux buffers): random on the prefill (seeded by stage, TP,
    CP and DP rank: each TP rank holds its own heads, and a CP or DP rank's bytes differ from
    the others' so a decode shows which one sent), zeros on the decode."""
    pages = PREFILL_PAGES if role == "prefill" else DECODE_PAGES
    n = len(kv_entries(role, pp_rank, pp_size, mla=mla))
    linear = mamba_layers(role, pp_rank, pp_size)
    state_sizes = [MAMBA_SLOTS * item for item in mamba_items for _ in linear]
    sizes = [pages * KV_ITEM] * n + state_sizes + [AUX_ROWS * item for item in aux_items]
    if role == "decode":
        made = [torch.zeros(size, dtype=torch.uint8) for size in sizes]
    else:
        seed = 1000 + pp_rank + 100 * tp_rank + 10000 * cp_rank + 20000 * dp_rank
        gen = torch.Generator().manual_seed(seed)
        made = [torch.randint(1, 255, (size,), dtype=torch.uint8, generator=gen) for size in sizes]
    m = len(state_sizes)
    return made[:n], made[n : n + m], made[n + m :]


def kv_args(
    role: str,
    pp_rank: int,
    memory: Tensors,
    aux_items: list[int] = AUX_ITEMS,
    mamba_items: list[int] = MAMBA_ITEMS,
    *,
    pp_size: int = 2,
    tp_rank: int = 0,
    mla: bool = False,
) -> Any:
    from sglang.srt.disaggregation.base.conn import KVArgs, StateType
    from sglang.srt.disaggregation.utils import append_state_component

    kv, state, aux = memory

    args = KVArgs()
    entries = kv_entries(role, pp_rank, pp_size, mla=mla)
    args.engine_rank = tp_rank
    args.kv_data_ptrs = [t.data_ptr() for t in kv]
    args.kv_data_lens = [t.numel() for t in kv]
    args.kv_item_lens = [KV_ITEM] * len(kv)
    args.kv_layer_ids = [layer for layer, _ in entries]  # one global id per buffer
    args.kv_cache_dtype_str = "bfloat16"
    args.aux_data_ptrs = [t.data_ptr() for t in aux]
    args.aux_data_lens = [t.numel() for t in aux]
    args.aux_item_lens = list(aux_items)
    args.state_types, args.state_data_ptrs, args.state_data_lens = [], [], []
    args.state_item_lens, args.state_layer_ids = [], []
    args.state_dim_per_tensor, args.state_slice_outer_counts = [], []
    args.state_conv_shard_groups = []
    linear = mamba_layers(role, pp_rank, pp_size)
    if mamba_items:  # as SGLang's setup_state_kv_args does for a hybrid linear pool
        append_state_component(
            args,
            StateType.MAMBA,
            [t.data_ptr() for t in state],
            [t.numel() for t in state],
            [item for item in mamba_items for _ in linear],
            layer_ids=linear * len(mamba_items),
        )
    args.is_hybrid_mla_backend = False
    args.swa_kv_cache_layout = None
    args.ib_device, args.gpu_id = "", 0
    args.kv_head_num = args.total_kv_head_num = 1
    args.page_size = PAGE_SIZE
    args.system_dp_rank = 0
    args.rust_http_port = None
    args.pp_rank = pp_rank
    staged = role == "prefill" and pp_size > 1
    args.prefill_start_layer = 4 * pp_rank if staged else 0
    args.prefill_end_layer = 4 * pp_rank + 4 if staged else MODEL_LAYERS
    args.mla_compression_ratios = None
    args.kv_buf_groups, args.hidden_kv_layers, args.draft_kv_layers = 1 if mla else 2, 0, 0
    args.num_draft_entries = sum(layer == DRAFT_LAYER for layer, _ in entries)
    return args


def prefill_dp_rank(info: Any, addr: str, room: int) -> int:
    """The prefill DP rank of `room`, as decode.py resolves it (`_resolve_prefill_dp_rank`,
    then the pending queue's `query_prefill_dp_ranks`): the one DP rank; the room's under the
    prefill's `follow_bootstrap_room` balancing; else what the prefill rank registered with
    the bootstrap server, asked for again until it is there."""
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    if info.dp_size == 1:
        return 0
    if info.follow_bootstrap_room:
        return room % int(info.dp_size)
    end = time.monotonic() + 20.0
    while time.monotonic() < end:
        found = CommonKVReceiver.query_prefill_dp_ranks(addr, [room])
        if str(room) in found:
            return int(found[str(room)])
        time.sleep(0.05)
    raise RuntimeError(f"no prefill DP rank registered for room {room}")


class OneRankGroup:
    """SGLang's pp_group of a prefill of one PP stage: broadcasting to itself."""

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj


class GlooGroup:
    """SGLang's pp_group as the PP consensus store uses it (broadcast_object), over gloo."""

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=src)
        return box[0]


def answer(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    role, pp_rank, pp_size, port, dist_port, model = sys.argv[1:7]
    variant = json.loads(sys.argv[7]) if len(sys.argv) > 7 else {}
    aux_items = [int(n) for n in variant.get("aux_items", AUX_ITEMS)]
    mamba_items = [int(n) for n in variant.get("mamba_items", MAMBA_ITEMS)]
    tp_size, tp_rank = int(variant.get("tp_size", 1)), int(variant.get("tp_rank", 0))
    cp_size, cp_rank = int(variant.get("cp_size", 1)), int(variant.get("cp_rank", 0))
    dp_size, dp_rank = int(variant.get("dp_size", 1)), int(variant.get("dp_rank", 0))
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("kvhandoff").setLevel(logging.INFO)
    pp_rank_i, pp_size_i, port_i = int(pp_rank), int(pp_size), int(port)

    from sglang.srt.plugins import load_plugins

    load_plugins()  # as every SGLang process does first: the entry point registers kvhandoff
    from sglang.srt.disaggregation.base.conn import KVPoll, KVTransferDestination
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode,
        KVClassType,
        TransferBackend,
        get_kv_class,
    )
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    from kvhandoff.pipelines.events import event_tag

    server_args = ServerArgs(
        model_path=model,
        skip_tokenizer_init=True,
        device="cpu",
        page_size=PAGE_SIZE,
        host="127.0.0.1",
        pp_size=pp_size_i if role == "prefill" else 1,
        # SGLang's attention TP is tp_size / attn_cp_size (/ dp_size with DP attention)
        tp_size=tp_size * cp_size * dp_size,
        attn_cp_size=cp_size,
        dp_size=dp_size,
        enable_dp_attention=dp_size > 1,
        load_balance_method=variant.get("load_balance", "auto"),
        disaggregation_mode=role,
        disaggregation_transfer_backend="kvhandoff",
        disaggregation_bootstrap_port=port_i,
    )
    # TP ranks innermost, then CP ranks, then DP-attention ranks, then PP stages, as SGLang
    # places them (`runtime_context`: tp_rank = (dp * cp_size + cp) * attn_tp_size + tp).
    group_rank = (dp_rank * cp_size + cp_rank) * tp_size + tp_rank
    world_rank = pp_rank_i * tp_size * cp_size * dp_size + group_rank
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=world_rank))
    if role == "prefill" and pp_size_i > 1:
        torch.distributed.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{dist_port}",
            rank=pp_rank_i,
            world_size=pp_size_i,
        )
        get_parallel().override_permanently(pp_group=GlooGroup())
    elif role == "prefill":
        get_parallel().override_permanently(pp_group=OneRankGroup())

    backend = TransferBackend(server_args.disaggregation_transfer_backend)
    mla = bool(variant.get("mla", False))  # a latent-KV model: SGLang's `is_mla_backend`
    shape = {"pp_size": pp_size_i, "tp_rank": tp_rank, "mla": mla}
    memory = tensors(
        role, pp_rank_i, aux_items, mamba_items, **shape, cp_rank=cp_rank, dp_rank=dp_rank
    )
    kv, state, aux = memory
    args = kv_args(role, pp_rank_i, memory, aux_items, mamba_items, **shape)
    args.engine_rank = group_rank  # SGLang's rank in its TP group, CP and DP included
    mode = DisaggregationMode(role)
    manager = get_kv_class(backend, KVClassType.MANAGER)(args, mode, server_args, mla)
    bootstrap_addr = f"127.0.0.1:{port_i}"
    answer(
        {
            "ready": True,
            "url": manager.service_url,
            "manager": type(manager).__name__,
            "zmq": [manager.local_ip, manager.rank_port],  # SGLang's channel to this rank
        }
    )

    def state_indices(cmd: dict[str, Any]) -> list[Any] | None:
        """SGLang's per-component indices of a request: its MAMBA slot (None: no state)."""
        return [np.array([mamba_slot(cmd)], dtype=np.int32)] if mamba_items else None

    def poll(poller: Any) -> int:
        # PP rank 0 polls the consensus of all stages (prefill.py with pp_size > 1).
        if role == "prefill" and pp_size_i > 1 and pp_rank_i == 0:
            return int(poller.poll_pp_consensus())
        return int(poller.poll())

    def until(poller: Any, done: set[int], timeout_s: float, seen: list[int]) -> int:
        end = time.monotonic() + timeout_s
        while True:
            state = poll(poller)
            if not seen or seen[-1] != state:
                seen.append(state)
            if state in done or time.monotonic() > end:
                return state
            time.sleep(0.01)

    def failure(poller: Any) -> str | None:
        try:
            poller.failure_exception()
        except Exception as exc:  # noqa: BLE001  -- SGLang's KVTransferError, reported as text
            return f"{type(exc).__name__}: {exc}"
        return None

    terminal = {int(KVPoll.Success), int(KVPoll.Failed)}
    # Segments of this rank's stage the decode committed, per handoff id: the prefill publishes
    # `stage.transferred` only once the decode's commit answered (landed mode).
    committed: dict[str, int] = {}
    # Prefill: the handoffs whose stage was stopped (given up or aborted: the prefill publishes
    # that once no segment of it runs), and per room, whether its own was when SGLang's status
    # table first said Failed (what SGLang frees the source pages at).
    stopped: set[str] = set()
    stopped_first: dict[int, bool] = {}
    if role == "prefill" and manager.service_url is not None:  # a dummy CP rank runs none
        said = logging.getLogger("engine_proc")
        said.setLevel(logging.INFO)

        def on_event(event: Any) -> None:
            if event_tag(event) == "stage.transferred":
                committed[event.handoff_id] = committed.get(event.handoff_id, 0) + 1
            elif event_tag(event) == "stage.ready":  # what a test can wait for in the log
                said.info("signalled %s last=%s", event.handoff_id, event.last_pages)
            elif event_tag(event) == "handoff.aborted" or (
                event_tag(event) == "handoff.failed" and event.code == "engine_aborted"
            ):
                stopped.add(event.handoff_id)

        manager.service.add_listener(on_event)
        sglang_update_status = manager.update_status

        def update_status(room: int, status: int) -> None:
            if status == KVPoll.Failed and room not in stopped_first:
                stopped_first[room] = manager.own_handoff(room) in stopped
            sglang_update_status(room, status)

        manager.update_status = update_status
    held: dict[int, Any] = {}  # PP ranks > 0: senders kept until PP rank 0's consensus decided
    boundary = None  # decode: SGLang's transfer queue (`transfer_queue.py`), once asked for
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            manager.close()
            answer({"bye": True})
            return
        if cmd["op"] == "boundary":  # a request fails; SGLang's own queue frees its pages
            from tests.sglang.transfer_queue import Boundary

            boundary = boundary or Boundary(manager, DECODE_PAGES, PAGE_SIZE)
            while not manager.try_ensure_parallel_info(bootstrap_addr):
                time.sleep(0.05)
            receiver = get_kv_class(backend, KVClassType.RECEIVER)(
                manager, bootstrap_addr, int(cmd["room"])
            )
            receiver.init(prefill_dp_rank(manager.prefill_info_table[bootstrap_addr], "", 0))
            cmd["state"] = state_indices(cmd)
            answer(boundary.run(receiver, cmd, kv, KV_ITEM))
            continue
        if cmd["op"] == "clear":  # every rank acts on PP rank 0's consensus, then releases
            sender = held.pop(int(cmd["room"]))
            error = failure(sender) if cmd.get("failed") else None
            sender.clear()
            answer({"cleared": cmd["room"], "error": error})
            continue
        room, pages, aux_index = int(cmd["room"]), cmd["pages"], cmd["aux"]
        seen: list[int] = []
        start = time.monotonic()
        if role == "prefill":
            if pp_rank_i == pp_size_i - 1:  # the last stage writes the request's metadata row
                aux[2].view(torch.int64)[aux_index] = room
            sender = get_kv_class(backend, KVClassType.SENDER)(manager, bootstrap_addr, room)
            sender.pop_decode_prefix_len()
            sender.init(len(pages), aux_index)
            until(sender, terminal | {int(KVPoll.WaitingForInput)}, 10.0, seen)
            time.sleep(cmd.get("delay_s", 0.0))
            at = 0
            hid = manager.own_handoff(room)
            before_last = 0  # segments committed before the last chunk was sent
            for k, n in enumerate(cmd["chunks"]):  # one send per chunk, the next pages each
                if k == cmd.get("abort_before_chunk"):  # the client went away mid-prefill
                    sender.abort()
                    break
                if k == len(cmd["chunks"]) - 1 and cmd.get("commit_before_last_s"):
                    # A slow last chunk: the earlier chunks' segments may land meanwhile.
                    end = time.monotonic() + cmd["commit_before_last_s"]
                    while not committed.get(hid) and time.monotonic() < end:
                        time.sleep(0.01)
                    before_last = committed.get(hid, 0)
                last = k == len(cmd["chunks"]) - 1  # SGLang sends the state with the last
                chunk = np.array(pages[at : at + n], dtype=np.int32)
                if k == cmd.get("bad_page_at_chunk"):  # a page outside the pool: refused
                    chunk[0] = 1 << 20
                sender.send(chunk, state_indices(cmd) if last else None)
                at += n
                poll(sender)
            final = until(sender, terminal, cmd.get("timeout_s", 20.0), seen)
            error = None
            if pp_rank_i == 0:
                error = failure(sender) if final == KVPoll.Failed else None
                sender.clear()
            else:
                held[room] = sender
            # What prefill.py reads once a room is done: after `clear()` on PP rank 0, as there.
            metric = sender.get_transfer_metric()
            answer(
                {
                    "room": room,
                    "polls": seen,
                    "final": final,
                    "error": error,
                    "seconds": time.monotonic() - start,
                    "committed_before_last": before_last,
                    "transferred": committed.get(hid, 0),  # this stage's segments committed
                    "stopped_first": stopped_first.get(room),
                    "metric": {
                        "bytes": metric.transfer_total_bytes,
                        "latency_s": metric.transfer_latency_s,
                    },
                }
            )
            continue
        addr = cmd.get("bootstrap", bootstrap_addr)  # another prefill instance's server
        while not manager.try_ensure_parallel_info(addr):
            time.sleep(0.05)
        receiver = get_kv_class(backend, KVClassType.RECEIVER)(manager, addr, room)
        receiver.init(prefill_dp_rank(manager.prefill_info_table[addr], addr, room))
        destination = KVTransferDestination(cmd.get("destination", "device"))
        receiver.send_metadata(
            np.array(pages, dtype=np.int32),
            aux_index,
            state_indices(cmd),
            decode_prefix_len=cmd.get("prefix_len"),  # tokens its radix cache holds
            destination=destination,
        )
        if cmd.get("abort_after_s") is not None:
            until(receiver, terminal, cmd["abort_after_s"], seen)
            receiver.abort()
        sent = time.monotonic()
        final = until(receiver, terminal, cmd.get("timeout_s", 20.0), seen)
        error = failure(receiver) if final == KVPoll.Failed else None
        released_end = time.monotonic() + 10.0
        while not receiver.is_abort_release_safe() and time.monotonic() < released_end:
            time.sleep(0.01)
        released = receiver.is_abort_release_safe()
        receiver.clear()
        dump = cmd.get("dump")
        if dump:
            np.savez(dump, *[t.numpy() for t in (*kv, *state, *aux)])
        for t in (*kv, *state, *aux):  # the next request's check sees only its own bytes
            t.zero_()
        answer(
            {
                "room": room,
                "polls": seen,
                "final": final,
                "error": error,
                "released": released,
                "seconds": time.monotonic() - start,
                "after_metadata_s": time.monotonic() - sent,
            }
        )


if __name__ == "__main__":
    main()

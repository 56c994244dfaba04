"""What the kvhandoff backend refuses of an SGLang deployment, by name, before anything starts
(or, for a prefill a decode rank cannot pair with, at each request's `init`): each a check of
SGLang's settings against what kvhandoff carries, raising `layouts.Unsupported` or returning
why not.

Called by the manager's `__init__` (every rank, once) and its `pairing_refusal` (a decode rank,
per prefill it meets). What a rank's layout cannot carry is refused in `layouts.py`.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.environ import envs

from kvhandoff.service.integrations.sglang.layouts import Unsupported


def tp_pairing_refusal(
    prefill_tp: int, decode_tp: int, *, mla: bool, hybrid_mla: bool, state: bool
) -> str | None:
    """Why a decode rank of attention TP `decode_tp` cannot pair with a prefill of `prefill_tp`
    as kvhandoff pairs them (one sending prefill rank per decode rank), or None. Equal TP pairs
    rank with rank. Unequal TP pairs only an MLA model's KV, which every TP rank holds whole,
    and only with no state component (its heads are split over TP ranks): with a larger
    prefill TP, the first of the decode rank's prefill ranks sends and the others are excused
    (`excusal.py`); with a larger decode TP, each prefill rank sends a copy to each of its
    decode ranks, a handoff each (`handoff_id`'s `copy`)."""
    if prefill_tp == decode_tp:
        return None
    sizes = f"prefill attention TP {prefill_tp}, decode {decode_tp}"
    if not mla or hybrid_mla:
        return (
            f"kvhandoff pairs unequal TP for MLA models only ({sizes}): another model's KV "
            "heads are split over TP ranks, and kvhandoff does not slice them"
        )
    if prefill_tp < decode_tp and decode_tp % prefill_tp:
        return f"the decode's attention TP is not a multiple of the prefill's ({sizes})"
    if prefill_tp > decode_tp and prefill_tp % decode_tp:
        return f"the prefill's attention TP is not a multiple of the decode's ({sizes})"
    if state:
        return (
            f"kvhandoff pairs unequal TP for MLA models without state components only "
            f"({sizes}): a state component's heads are split over TP ranks"
        )
    return None


def refuse_rust_registry(*, prefill: bool, attn_dp_size: int) -> None:
    """With `SGLANG_RUST_SERVER` and DP attention, SGLang gathers every rank's registration and
    has the rank that owns a Rust listener register them all, unsigned, with that listener:
    each row would carry the wrong rank's kvhandoff URL, in a registry kvhandoff does not run.
    Refused at start-up by name."""
    if prefill and attn_dp_size > 1 and envs.SGLANG_RUST_SERVER.get():
        raise Unsupported(
            "SGLANG_RUST_SERVER with DP attention is not supported by kvhandoff: SGLang then "
            "registers every rank's row from one rank with the Rust registry, not with "
            "kvhandoff's signed bootstrap server"
        )


def refuse_early_release(handoff: Any) -> None:
    """SGLang frees a failed request's decode pages when kvhandoff says they are released
    (`is_abort_release_safe`), or when its own release timeout passes, whichever comes first.
    kvhandoff releases a handoff's pages at the latest its deadline plus `max_grace_s` after
    the create (the longest a prefill writer it cannot hear from may still write); SGLang's
    clock starts later, at Failed. A timeout shorter than that bound, or SGLang's deferred
    release turned off (it then frees the pages at Failed), could free pages a commit still
    writes: refused at start-up by name."""
    if not envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get():
        raise Unsupported(
            "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=0 with kvhandoff: SGLang would "
            "free a failed request's decode pages before kvhandoff released them"
        )
    bound_s = float(handoff.default_deadline_s) + float(handoff.max_grace_s)
    timeout_s = float(envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.get())
    if timeout_s < bound_s:
        raise Unsupported(
            f"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT = {timeout_s:g} s is "
            f"shorter than the longest kvhandoff may hold a failed request's pages "
            f"(handoff.default_deadline_s {handoff.default_deadline_s:g} s + "
            f"handoff.max_grace_s {handoff.max_grace_s:g} s = {bound_s:g} s): raise it, or "
            "lower those"
        )


def refuse_decode_prefix_reuse(server_args: Any, *, prefill: bool) -> None:
    """A decode with SGLang's radix cache holds a prefix of some requests and takes the rest
    only (`decode_prefix_len`): kvhandoff skips the prefix on the prefill's side
    (`HandoffRequest.prefix_pages`), which SGLang's prefill never learns (its sends start
    before the decode's metadata comes). SGLang's own KV checksum would then digest the whole
    request on the prefill and the suffix on the decode, failing every request that hits the
    cache: that pair is refused at start-up by name (kvhandoff digests every segment itself)."""
    if prefill or not getattr(server_args, "disaggregation_decode_enable_radix_cache", False):
        return
    if getattr(server_args, "disaggregation_enable_kv_checksum", False):
        raise Unsupported(
            "--disaggregation-enable-kv-checksum with --disaggregation-decode-enable-radix-cache "
            "is not supported by kvhandoff: SGLang's prefill would digest a request's whole KV, "
            "its decode only the pages after the prefix it cached (kvhandoff checks each "
            "segment's digest itself)"
        )


def refuse_context_parallel(parallel: Any, kv_args: Any, *, prefill: bool) -> None:
    """Attention CP as kvhandoff carries it: on the prefill only, where SGLang's CP rank 0
    holds every page of a request and sends alone, the other CP ranks being SGLang's "dummy"
    participants (they report Success at their last send and move nothing). The modes where
    each CP rank sends its own share of the pages, or a CP rank stands in for a TP rank, are
    refused by name before anything starts."""
    if parallel.attn_cp_size <= 1:
        return
    if not prefill:
        raise Unsupported("attention context parallelism on the decode (attn_cp_size > 1)")
    shared: list[str] = []
    if envs.SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER.get():
        shared.append("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER")
    if getattr(kv_args, "is_hybrid_mla_backend", False):
        shared.append("a hybrid MLA model (SGLang shards its KV over CP ranks)")
    if parallel.enable_dsa_cache_layer_split:
        shared.append("DSA cache layer split")
    if parallel.enable_cp_tp_group_sharing:
        shared.append("CP-TP group sharing (each CP rank transfers as a TP rank)")
    if shared:
        raise Unsupported(
            f"attention CP where every CP rank sends ({', '.join(shared)}) is not supported by "
            "kvhandoff: it pairs each decode rank with CP rank 0 of its prefill TP rank"
        )

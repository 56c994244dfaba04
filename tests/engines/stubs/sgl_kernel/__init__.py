"""A stand-in for the few `sgl_kernel` CPU helpers SGLang 0.5.23 imports on its CPU path.

Why it exists: with `SGLANG_USE_CPU_ENGINE=1` SGLang imports `sgl_kernel`'s CPU helpers at
module level (KV page copies, the request-to-token table, speculative decoding's bookkeeping),
and the `sgl-kernel` / `sglang-kernel` wheels on the package index are CUDA builds, so the
servers of `tests/engines` could not start. It replaces, for those servers only (it is on their
PYTHONPATH, never installed), the helpers below with plain torch doing what SGLang's Triton
kernels next to each call do. The model's own compute does not come through here: on a CPU
without AMX SGLang routes RMSNorm, SiLU, RoPE and attention to torch-native code itself.
"""

from __future__ import annotations

import ctypes

import torch


def _rows(ptr: int, stride_bytes: int, nrows: int) -> torch.Tensor:
    """`nrows` rows of `stride_bytes` bytes at address `ptr`, as a uint8 tensor (no copy)."""
    buf = (ctypes.c_uint8 * (stride_bytes * nrows)).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8).view(nrows, stride_bytes)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """In every buffer (`data_ptrs[b]`, rows of `strides[b]` bytes) copy row `src_loc[i]` to
    row `tgt_loc[i]` (`copy_all_layer_kv_cache_tiled`: safe when the two overlap)."""
    if src_loc.numel() == 0:
        return
    src, tgt = src_loc.long(), tgt_loc.long()
    nrows = int(max(int(src.max()), int(tgt.max()))) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = _rows(int(ptr), int(stride), nrows)
        rows[tgt] = rows[src].clone()


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Request i's token slots `start_offset[i]:end_offset[i]` take the next `end - start`
    entries of `out_cache_loc` (`assign_req_to_token_pool`)."""
    del pool_len  # the row length of `req_to_token`, which torch knows
    at = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        n = int(end) - int(start)
        req_to_token[int(row), int(start) : int(end)] = out_cache_loc[at : at + n].to(
            req_to_token.dtype
        )
        at += n


def _speculative(name: str) -> object:
    def refuse(*_: object, **__: object) -> None:
        raise NotImplementedError(
            f"sgl_kernel.{name}: speculative decoding is not part of the engine tests' stand-in"
        )

    refuse.__name__ = name
    return refuse


# Imported at module level by SGLang's speculative decoding (EAGLE, multi-layer EAGLE, tree
# verification); the engine tests run none, so a call is an error, never a silent no-op.
assign_draft_cache_locs_contiguous_cpu = _speculative("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _speculative("assign_extend_cache_locs_cpu")
build_tree_kernel_efficient_cpu = _speculative("build_tree_kernel_efficient_cpu")
fill_accept_out_cache_loc_cpu = _speculative("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _speculative("fill_bonus_tokens_cpu")
rotate_input_ids_cpu = _speculative("rotate_input_ids_cpu")
verify_tree_greedy_cpu = _speculative("verify_tree_greedy_cpu")

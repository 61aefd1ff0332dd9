"""The Triton kernel of `specdec::advance_draft_step` (contract: ops/draft_step.py), launched from Python.

Elementwise: the additions are in int64, then clamped and narrowed to each output's dtype.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .._library import register_cuda
from ..ops.draft_step import check_inputs, empty_outputs
from .geometry import ADVANCE_DRAFT_STEP
from .launch import CachedLaunch


@triton.jit(
    do_not_specialize=["n", "max_model_len"],
    do_not_specialize_on_alignment=["sampled_ptr", "positions_ptr", "seq_lens_ptr", "out_ids_ptr",
                                    "out_positions_ptr", "out_seq_lens_ptr"],
)
def advance_draft_step_kernel(
    sampled_ptr,  # [n] int32/int64
    positions_ptr,  # [n] int32/int64
    seq_lens_ptr,  # [n] int32/int64
    out_ids_ptr,  # [n] int32
    out_positions_ptr,  # [n] dtype of positions
    out_seq_lens_ptr,  # [n] dtype of seq_lens
    n, max_model_len,
    BLOCK: tl.constexpr,
):
    """Program p advances entries [p * BLOCK, (p + 1) * BLOCK)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    sampled = tl.load(sampled_ptr + i, mask=live, other=0)
    position = tl.load(positions_ptr + i, mask=live, other=0).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + i, mask=live, other=0).to(tl.int64)
    tl.store(out_ids_ptr + i, sampled.to(tl.int32), mask=live)
    next_position = tl.minimum(position + 1, max_model_len - 1)
    tl.store(out_positions_ptr + i, next_position.to(out_positions_ptr.dtype.element_ty), mask=live)
    next_seq_len = tl.minimum(seq_len + 1, max_model_len)
    tl.store(out_seq_lens_ptr + i, next_seq_len.to(out_seq_lens_ptr.dtype.element_ty), mask=live)

_launch_kernel = CachedLaunch(advance_draft_step_kernel)


def advance_draft_step_triton(sampled_token_ids, positions, seq_lens, max_model_len):
    """The op's CUDA kernel: checks, allocates and launches from Python (kernels/launch.py says why)."""
    check_inputs(sampled_token_ids, positions, seq_lens, max_model_len)
    outputs = empty_outputs(sampled_token_ids, positions, seq_lens)
    n = sampled_token_ids.shape[0]
    if n > 0:
        block = ADVANCE_DRAFT_STEP["block"]
        _launch_kernel((triton.cdiv(n, block),),
                       (sampled_token_ids, positions, seq_lens, *outputs, n, max_model_len), (block,),
                       num_warps=ADVANCE_DRAFT_STEP["num_warps"])
    return outputs


register_cuda("advance_draft_step", advance_draft_step_triton)

"""The Triton kernel of `specdec::create_output` (contract: ops/output.py), launched from C++.

One program per BLOCK_ROWS rows. Every load depends only on the program id, so the kernel's latency is one round
trip to memory; the .counted statistics are summed per program and added with one atomic. The CUDA kernel of the
op is the C++ launcher in csrc/create_output.cpp (kernels/launch.py says why); `create_output_triton` launches the
same kernel from Python.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..ops.output import check_inputs, empty_output_row
from .counters import add_counters_tl
from .geometry import CREATE_OUTPUT
from .launch import CachedLaunch, expose_to_cpp


@triton.jit(
    do_not_specialize=["batch", "k", "accepted_row_stride", "substitute_row_stride", "draft_row_stride",
                       "bonus_row_stride"],
    do_not_specialize_on_alignment=["accepted_ptr", "substitute_ptr", "draft_ptr", "bonus_ptr", "out_ptr",
                                    "counters_ptr"],
)
def create_output_kernel(
    accepted_ptr,  # [B, k] bool or int, row stride accepted_row_stride
    substitute_ptr,  # [B, k] int32/int64, row stride substitute_row_stride
    draft_ptr,  # [B, k] int32/int64, row stride draft_row_stride
    bonus_ptr,  # [B] int32/int64, stride bonus_row_stride
    out_ptr,  # [B, k+1] dtype of draft, contiguous
    counters_ptr,  # [3] int64 (COUNT), else any valid pointer
    batch, k,
    accepted_row_stride, substitute_row_stride, draft_row_stride, bonus_row_stride,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, COUNT: tl.constexpr,
):
    """Program p formats rows [p * BLOCK_ROWS, (p + 1) * BLOCK_ROWS) of the output; BLOCK_COLS >= k + 1."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    row_ok = rows < batch
    rows64 = rows.to(tl.int64)
    in_draft = row_ok[:, None] & (cols[None, :] < k)

    # Every load depends only on the program id, so they all issue at once: the
    # latency of this kernel is one round trip to memory, not a chain of them.
    is_accepted = tl.load(accepted_ptr + rows64[:, None] * accepted_row_stride + cols[None, :],
                          mask=in_draft, other=0) != 0
    draft = tl.load(draft_ptr + rows64[:, None] * draft_row_stride + cols[None, :], mask=in_draft,
                    other=-1).to(tl.int64)
    substitute = tl.load(substitute_ptr + rows64[:, None] * substitute_row_stride + cols[None, :],
                         mask=in_draft, other=-1).to(tl.int64)
    bonus = tl.load(bonus_ptr + rows64 * bonus_row_stride, mask=row_ok, other=-1).to(tl.int64)
    # Loaded again on its own rather than picked out of `draft` by a reduction, which
    # would stand between the loads and the store.
    last_draft = tl.load(draft_ptr + rows64 * draft_row_stride + (k - 1), mask=row_ok, other=-1)

    rejected_at = tl.where(in_draft & ~is_accepted, cols[None, :], k)
    first_rejected = tl.min(rejected_at, axis=1)
    emit_bonus = row_ok & (first_rejected == k) & (last_draft != -1)
    bonus = tl.where(emit_bonus, bonus, -1)
    substitute = tl.where(cols[None, :] == first_rejected[:, None], substitute, -1)
    out = tl.where(cols[None, :] < first_rejected[:, None], draft, substitute)
    out = tl.where(cols[None, :] == k, bonus[:, None], out)
    in_out = row_ok[:, None] & (cols[None, :] <= k)
    tl.store(out_ptr + rows64[:, None] * (k + 1) + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=in_out)

    if COUNT:
        # Both sums in one reduction (each below 2**32, packed in an int64): every
        # cross-warp reduction adds barriers before the atomic that ends the program.
        packed = is_accepted.to(tl.int64) + ((in_out & (out != -1)).to(tl.int64) << 32)
        sums = tl.sum(tl.sum(packed, axis=1), axis=0)
        num_rows = tl.minimum(batch - pid * BLOCK_ROWS, BLOCK_ROWS).to(tl.int64)
        add_counters_tl(counters_ptr, sums & 0xFFFFFFFF, sums >> 32, num_rows * k)


_launch_kernel = CachedLaunch(create_output_kernel)
expose_to_cpp("create_output", create_output_kernel)


def launch(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids, counters=None):
    """One launch of the Triton kernel from Python (inputs already validated): the TRITON_INTERPRET path of the
    tests, and a second path to compare the C++ launcher with. Returns the [B, k+1] output."""
    batch, k = draft_token_ids.shape
    out = empty_output_row(draft_token_ids)
    if batch == 0:
        return out
    block_rows = CREATE_OUTPUT["block_rows"]
    grid = (triton.cdiv(batch, block_rows),)
    _launch_kernel(
        grid,
        (accepted, substitute_token_ids, draft_token_ids, bonus_token_ids, out, out if counters is None else counters,
         batch, k,
         accepted.stride(0), substitute_token_ids.stride(0), draft_token_ids.stride(0), bonus_token_ids.stride(0)),
        (block_rows, triton.next_power_of_2(k + 1), counters is not None),
        num_warps=CREATE_OUTPUT["num_warps"],
    )
    return out


def create_output_triton(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids, counters=None):
    """The op's Triton entry from Python, for both overloads (counters given: .counted). Its CUDA kernel is the C++
    launcher of the same Triton kernel, so this is not registered: the tests call it under TRITON_INTERPRET."""
    check_inputs(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids, counters)
    return launch(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids, counters)

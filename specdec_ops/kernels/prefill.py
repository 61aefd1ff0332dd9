"""The Triton kernel of `specdec::prepare_prefill` and `prepare_prefill_into` (contract: ops/prefill.py),
launched from C++.

A program handles a tile of ROWS requests x SLOTS slots, which holds all of a decode round (query_len + 1 = k + 2
slots per request); the rest of a longer query (a prompt) follows, one request at a time, LONG_SLOTS slots per step
(kernels/geometry.py). The op's CUDA kernel is the C++ launcher in csrc/prepare_prefill.cpp (kernels/launch.py says
why); `prepare_prefill_triton` launches the same kernel from Python.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..ops.prefill import _OP, check_buffers, check_inputs, empty_outputs, resolve_max_num_reqs
from .geometry import PREPARE_PREFILL
from .launch import CachedLaunch, expose_to_cpp


@triton.jit
def _write_slots(
    input_ids_ptr,  # [num_tokens] int32/int64
    out_ids_ptr,  # [>= total] int32/int64
    out_positions_ptr,  # [>= total] int64
    s, live, out_start, q_start, query_len, num_valid, correction, start_pos, total, max_model_len,
):
    """Slots `s` of the requests whose values are given (broadcast against s)."""
    j = out_start + s
    # (a select, not `live & ...`: Triton 3.9's interpreter types a 0-d bool tensor & a
    # bool tensor as int32, which tl.load rejects as a mask)
    in_slot = tl.where(live, (s <= query_len) & (j >= 0) & (j < total), False)
    accepted = in_slot & (s < num_valid)
    token = tl.load(input_ids_ptr + q_start + s, mask=accepted, other=0).to(tl.int64)
    token = tl.where(s == num_valid, correction, token)
    position = tl.minimum(start_pos + s, max_model_len - 1)
    tl.store(out_ids_ptr + j, token.to(out_ids_ptr.dtype.element_ty), mask=in_slot)
    tl.store(out_positions_ptr + j, position, mask=in_slot)

@triton.jit
def _pick(values, pick):
    """The entry of the 1-D `values` where `pick` is true (exactly one)."""
    return tl.sum(tl.where(pick, values, 0), axis=0)

@triton.jit(
    do_not_specialize=["num_tokens", "num_reqs", "num_slots", "max_num_reqs", "max_model_len"],
    do_not_specialize_on_alignment=[
        "input_ids_ptr", "positions_ptr", "query_start_loc_ptr", "seq_lens_ptr", "idx_mapping_ptr",
        "last_sampled_ptr", "num_rejected_ptr", "out_ids_ptr", "out_positions_ptr", "out_last_ptr",
        "out_qsl_ptr", "out_seq_lens_ptr",
    ],
)
def prepare_prefill_kernel(
    input_ids_ptr,  # [num_tokens] int32/int64
    positions_ptr,  # [num_tokens] int32/int64
    query_start_loc_ptr,  # [num_reqs + 1] int32/int64
    seq_lens_ptr,  # [num_reqs] int32/int64
    idx_mapping_ptr,  # [num_reqs] int32/int64
    last_sampled_ptr,  # [num_slots] int32/int64
    num_rejected_ptr,  # [num_reqs] int32/int64
    out_ids_ptr,  # [>= num_tokens + num_reqs] int32/int64
    out_positions_ptr,  # [>= num_tokens + num_reqs] int64
    out_last_ptr,  # [max_num_reqs] int64
    out_qsl_ptr,  # [max_num_reqs + 1] int32
    out_seq_lens_ptr,  # [max_num_reqs] int32
    num_tokens, num_reqs, num_slots, max_num_reqs, max_model_len,
    ROWS: tl.constexpr, SLOTS: tl.constexpr, LONG_SLOTS: tl.constexpr,
):
    # Program p owns rows [p * ROWS, (p + 1) * ROWS): their slots and per-request
    # entries, or padding entries for rows >= num_reqs. The kernel's time is its
    # chain of memory round trips, so every load of the common path is issued
    # before its first store (a load after a store may not move above it: the
    # pointers may alias), and no load waits on more than one earlier round trip.
    tl.static_assert(ROWS < 32, "long_rows below is a bit mask of the tile's rows")
    pid = tl.program_id(0)
    total = num_tokens + num_reqs
    rows = pid * ROWS + tl.arange(0, ROWS)
    live = rows < num_reqs
    raw_start = tl.load(query_start_loc_ptr + rows, mask=live, other=0).to(tl.int32)
    raw_end = tl.load(query_start_loc_ptr + rows + 1, mask=live, other=0).to(tl.int32)
    rejected = tl.load(num_rejected_ptr + rows, mask=live, other=0).to(tl.int32)
    slot = tl.load(idx_mapping_ptr + rows, mask=live, other=0)
    seq_len = tl.load(seq_lens_ptr + rows, mask=live, other=0).to(tl.int64)
    tail_start = tl.load(query_start_loc_ptr + num_reqs).to(tl.int32) + num_reqs

    q_start = tl.minimum(tl.maximum(raw_start, 0), num_tokens)
    query_len = tl.minimum(tl.maximum(raw_end, q_start), num_tokens) - q_start
    num_valid = query_len - tl.minimum(tl.maximum(rejected, 0), query_len)
    slot = tl.minimum(tl.maximum(slot, 0), num_slots - 1)
    correction = tl.load(last_sampled_ptr + slot, mask=live, other=0).to(tl.int64)
    start_pos = tl.load(positions_ptr + q_start, mask=live & (query_len > 0), other=0).to(tl.int64)
    out_start = raw_start + rows

    # Slots [0, SLOTS) of the tile's requests: all of a decode round.
    _write_slots(input_ids_ptr, out_ids_ptr, out_positions_ptr, tl.arange(0, SLOTS)[None, :], live[:, None],
                 out_start[:, None], q_start[:, None], query_len[:, None], num_valid[:, None],
                 correction[:, None], start_pos[:, None], total, max_model_len)
    tl.store(out_last_ptr + rows, tl.where(live, out_start + num_valid, 0).to(tl.int64), mask=rows < max_num_reqs)
    tl.store(out_qsl_ptr + rows, tl.where(live, out_start, total), mask=rows <= max_num_reqs)
    new_seq_len = tl.minimum(seq_len + 1, max_model_len).to(tl.int32)
    tl.store(out_seq_lens_ptr + rows, tl.where(live, new_seq_len, 0), mask=rows < max_num_reqs)

    # Slots past query_start_loc[num_reqs] + num_reqs (a padded token batch): the
    # grid has enough programs that these chunks cover them all.
    tail_start = tl.minimum(tl.maximum(tail_start, 0), total)
    j = tail_start + pid * (ROWS * SLOTS) + tl.arange(0, ROWS * SLOTS)
    in_tail = j < total
    tl.store(out_ids_ptr + j, tl.zeros([ROWS * SLOTS], dtype=out_ids_ptr.dtype.element_ty), mask=in_tail)
    tl.store(out_positions_ptr + j, tl.zeros([ROWS * SLOTS], dtype=tl.int64), mask=in_tail)

    # The rest of requests with more slots (a prompt's draft prefill), one request
    # at a time, LONG_SLOTS slots per step. The request's values are picked out of
    # the tile's vectors by reductions: using the vectors in a wider tile instead
    # would make Triton build them (loads included) in another layout as well, in
    # front of the common path.
    long_rows = tl.sum(tl.where(live & (query_len >= SLOTS), 1 << tl.arange(0, ROWS), 0), axis=0)
    if long_rows != 0:
        for r in range(ROWS):
            if (long_rows >> r) & 1:
                pick = tl.arange(0, ROWS) == r
                row_start = _pick(out_start, pick)
                row_q_start = _pick(q_start, pick)
                row_len = _pick(query_len, pick)
                row_valid = _pick(num_valid, pick)
                row_correction = _pick(correction, pick)
                row_pos = _pick(start_pos, pick)
                for first in range(SLOTS, row_len + 1, LONG_SLOTS):
                    _write_slots(input_ids_ptr, out_ids_ptr, out_positions_ptr, first + tl.arange(0, LONG_SLOTS),
                                 True, row_start, row_q_start, row_len, row_valid, row_correction, row_pos, total,
                                 max_model_len)

_launch_kernel = CachedLaunch(prepare_prefill_kernel)
expose_to_cpp("prepare_prefill", prepare_prefill_kernel)


def grid(num_tokens: int, num_reqs: int, max_num_reqs: int) -> tuple[int]:
    """The kernel's grid, as the C++ launcher computes it: a program per tile of rows (padding rows included), and
    enough programs that their tail chunks cover the token slots."""
    rows, slots = PREPARE_PREFILL["rows"], PREPARE_PREFILL["slots"]
    return (max((max_num_reqs + rows) // rows, (num_tokens + num_reqs + rows * slots - 1) // (rows * slots)),)


def launch(input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled, num_rejected,
           max_model_len, out_ids, out_positions, out_last, out_qsl, out_seq_lens) -> None:
    """One launch of the Triton kernel from Python (inputs already validated): the TRITON_INTERPRET path of the
    tests, and a second path to compare the C++ launcher with."""
    num_tokens = input_ids.shape[0]
    num_reqs = query_start_loc.shape[0] - 1
    max_num_reqs = out_last.shape[0]
    _launch_kernel(
        grid(num_tokens, num_reqs, max_num_reqs),
        (input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled, num_rejected,
         out_ids, out_positions, out_last, out_qsl, out_seq_lens,
         num_tokens, num_reqs, max(last_sampled.shape[0], 1), max_num_reqs, max_model_len),
        (PREPARE_PREFILL["rows"], PREPARE_PREFILL["slots"], PREPARE_PREFILL["long_slots"]),
        num_warps=PREPARE_PREFILL["num_warps"],
    )


def prepare_prefill_triton(input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled,
                           num_rejected, max_model_len, max_num_reqs=None):
    """The Triton entry of prepare_prefill from Python (not registered: its CUDA kernel is the C++ launcher of the
    same kernel; the tests call this under TRITON_INTERPRET)."""
    num_reqs = check_inputs(_OP, input_ids, positions, query_start_loc, seq_lens, idx_mapping,
                            last_sampled, num_rejected, max_model_len)
    outputs = empty_outputs(input_ids, num_reqs, resolve_max_num_reqs(num_reqs, max_num_reqs))
    launch(input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled, num_rejected,
           max_model_len, *outputs)
    return outputs


def prepare_prefill_into_triton(input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled,
                                num_rejected, max_model_len, *buffers):
    """The Triton entry of prepare_prefill_into from Python, as prepare_prefill_triton."""
    num_reqs = check_inputs("prepare_prefill_into", input_ids, positions, query_start_loc, seq_lens,
                            idx_mapping, last_sampled, num_rejected, max_model_len)
    check_buffers(input_ids, num_reqs, *buffers)
    launch(input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled, num_rejected,
           max_model_len, *buffers)


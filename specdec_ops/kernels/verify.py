"""The Triton kernel of `specdec::greedy_verify` and `specdec::typical_acceptance` (contract: ops/verify.py),
launched from Python.

One launch of B * (k+1) * C programs: program (b, i, c) streams chunk c of row i of request b, writes its partial
(max, argmax, entropy) to per-call buffers, and takes the request's last-program ticket (kernels/ticket.py); the
last program combines the partials in a fixed order, decides, writes the output row and adds the counters.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._library import register_cuda
from ..ops.output import empty_output_row
from ..ops.verify import GREEDY, TYPICAL, check_inputs, check_typical_params
from .constants import ENTROPY_EPS, NO_INDEX
from .counters import add_counters_tl
from .geometry import VERIFY
from .output_row import store_output_row_tl
from .scratch import sm_count, zeroed_scratch
from .ticket import reset_ticket_tl, take_ticket_tl


@triton.jit
def verify_kernel(
    target_ptr,  # [B, k+1, V] float16/bfloat16/float32, strides (target_batch_stride, target_row_stride, 1)
    draft_ptr,  # [B, k] int32/int64, row stride draft_row_stride
    out_ptr,  # [B, k+1] dtype of draft, contiguous
    counters_ptr,  # [3] int64 (COUNT), else any valid pointer
    part_max_ptr,  # [B * (k+1) * num_chunks] float32: each program's chunk maximum
    part_argmax_ptr,  # [B * (k+1) * num_chunks] int32: its index
    part_entropy_ptr,  # [B * (k+1) * num_chunks] float32 (TYPICAL): its sum of p log(p + eps)
    tickets_ptr,  # [B] int64, zero on entry and on exit (kernels/scratch.py)
    k, vocab, target_batch_stride, target_row_stride, draft_row_stride,
    chunk_len, num_chunks, posterior_threshold, posterior_alpha,
    TYPICAL: tl.constexpr, COUNT: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_CHUNKS: tl.constexpr,
):
    # Program pid = (b * (k+1) + row) * num_chunks + chunk, which is also
    # its slot in the scratch buffers.
    pid = tl.program_id(0)
    per_request = (k + 1) * num_chunks
    b = pid // per_request
    row = (pid % per_request) // num_chunks
    chunk = pid % num_chunks
    request_ptr = target_ptr + b.to(tl.int64) * target_batch_stride
    row_ptr = request_ptr + row.to(tl.int64) * target_row_stride

    # Stream the chunk. Each lane keeps the first NaN it sees, else its
    # largest value at the lowest index (strict >, indices only grow);
    # lanes start at their first index so an all -inf chunk yields its
    # first index, like torch.argmax.
    start = chunk * chunk_len
    end = tl.minimum(start + chunk_len, vocab)
    lanes = tl.arange(0, BLOCK_V)
    lane_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_argmax = start + lanes
    lane_entropy = tl.zeros([BLOCK_V], tl.float32)
    for offset in range(start, end, BLOCK_V):
        idx = offset + lanes
        in_chunk = idx < end
        x = tl.load(row_ptr + idx, mask=in_chunk, other=float("-inf")).to(tl.float32)
        take = (x > lane_max) | ((x != x) & (lane_max == lane_max))
        lane_max = tl.where(take, x, lane_max)
        lane_argmax = tl.where(take, idx, lane_argmax)
        if TYPICAL:
            p = tl.where(in_chunk, x, 0.0)
            lane_entropy += p * tl.log(p + ENTROPY_EPS)

    # Lanes -> chunk result (NaN wins, at its lowest index).
    lane_nan = lane_max != lane_max
    first_nan = tl.min(tl.where(lane_nan, lane_argmax, NO_INDEX), axis=0)
    chunk_max = tl.max(tl.where(lane_nan, float("-inf"), lane_max), axis=0)
    chunk_argmax = tl.min(tl.where(lane_max == chunk_max, lane_argmax, NO_INDEX), axis=0)
    has_nan = first_nan < NO_INDEX
    tl.store(part_max_ptr + pid, tl.where(has_nan, float("nan"), chunk_max))
    tl.store(part_argmax_ptr + pid, tl.where(has_nan, first_nan, chunk_argmax))
    if TYPICAL:
        tl.store(part_entropy_ptr + pid, tl.sum(lane_entropy, axis=0))

    # Publish the partials (barrier: all threads' stores precede the
    # release), then take a ticket; the last of the request's programs
    # combines them.
    tl.debug_barrier()
    if take_ticket_tl(tickets_ptr + b) == per_request - 1:
        reset_ticket_tl(tickets_ptr + b)  # ready for the next call / graph replay

        rows = tl.arange(0, BLOCK_ROWS)
        chunks = tl.arange(0, BLOCK_CHUNKS)
        live = (rows[:, None] <= k) & (chunks[None, :] < num_chunks)
        slots = b * per_request + rows[:, None] * num_chunks + chunks[None, :]
        # .cg: read from L2, where the other programs' writes are visible.
        part_max = tl.load(part_max_ptr + slots, mask=live, other=float("-inf"), cache_modifier=".cg")
        part_argmax = tl.load(part_argmax_ptr + slots, mask=live, other=NO_INDEX, cache_modifier=".cg")
        # Chunks are in index order, so the lowest index wins ties again.
        part_nan = part_max != part_max
        row_first_nan = tl.min(tl.where(part_nan, part_argmax, NO_INDEX), axis=1)
        row_max = tl.max(tl.where(part_nan, float("-inf"), part_max), axis=1)
        row_argmax = tl.min(tl.where(part_max == row_max[:, None], part_argmax, NO_INDEX), axis=1)
        argmax = tl.where(row_first_nan < NO_INDEX, row_first_nan, row_argmax).to(tl.int64)

        is_draft = rows < k
        draft = tl.load(draft_ptr + b.to(tl.int64) * draft_row_stride + rows, mask=is_draft, other=-1)
        draft = draft.to(tl.int64)
        in_vocab = is_draft & (draft >= 0) & (draft < vocab)
        if TYPICAL:
            part_entropy = tl.load(part_entropy_ptr + slots, mask=live, other=0.0, cache_modifier=".cg")
            neg_entropy = tl.sum(part_entropy, axis=1)  # sum p log(p + eps) = -H
            safe_draft = tl.where(in_vocab, draft, 0)
            draft_prob = tl.load(request_ptr + rows.to(tl.int64) * target_row_stride + safe_draft,
                                 mask=in_vocab, other=0.0).to(tl.float32)
            posterior = posterior_alpha * tl.exp(neg_entropy)
            # min(threshold, posterior), NaN if either is NaN (torch.minimum).
            limit = tl.where(posterior < posterior_threshold, posterior, posterior_threshold)
            not_nan = (posterior == posterior) & (posterior_threshold == posterior_threshold)
            accepted = in_vocab & not_nan & (draft_prob > limit)
        else:
            accepted = in_vocab & (draft == argmax)

        first_rejected = tl.min(tl.where(is_draft & (accepted == 0), rows, k), axis=0)
        out = tl.where(rows < first_rejected, draft, tl.where(rows == first_rejected, argmax, -1))
        store_output_row_tl(out_ptr, b.to(tl.int64), rows, k, out)
        if COUNT:
            # Every emitted entry is a valid id (>= 0): first_rejected + 1 of them.
            add_counters_tl(counters_ptr, tl.sum(accepted.to(tl.int64), axis=0), first_rejected + 1,
                            tl.sum(is_draft.to(tl.int64), axis=0))


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return VERIFY["interpreter_sms"]
    return sm_count(device)


def plan(batch: int, k: int, vocab: int, device: torch.device, block_v=None, num_chunks=None):
    """(BLOCK_V, chunk_len, num_chunks): split rows into chunks until the GPU has enough programs."""
    if block_v is None:
        block_v = min(VERIFY["max_block_v"], max(16, triton.next_power_of_2(vocab)))
    if num_chunks is None:
        wanted = triton.cdiv(VERIFY["programs_per_sm"] * _sm_count(device), batch * (k + 1))
        num_chunks = max(1, min(wanted, triton.cdiv(vocab, VERIFY["min_chunk"])))
    chunk_len = triton.cdiv(triton.cdiv(vocab, num_chunks), block_v) * block_v
    return block_v, chunk_len, triton.cdiv(vocab, chunk_len)


def launch(target, draft_token_ids, counters, typical, posterior_threshold=0.0, posterior_alpha=0.0,
           block_v=None, num_chunks=None):
    """One launch of the verification kernel (inputs already validated)."""
    batch, k = draft_token_ids.shape
    vocab = target.shape[2]
    device = draft_token_ids.device
    out = empty_output_row(draft_token_ids)
    if batch == 0:
        return out
    block_v, chunk_len, num_chunks = plan(batch, k, vocab, device, block_v, num_chunks)
    num_programs = batch * (k + 1) * num_chunks
    part_max = torch.empty(num_programs, dtype=torch.float32, device=device)
    part_argmax = torch.empty(num_programs, dtype=torch.int32, device=device)
    part_entropy = torch.empty(num_programs, dtype=torch.float32, device=device) if typical else part_max
    verify_kernel[(num_programs,)](
        target, draft_token_ids, out, out if counters is None else counters,
        part_max, part_argmax, part_entropy, zeroed_scratch(device, batch),
        k, vocab, target.stride(0), target.stride(1), draft_token_ids.stride(0),
        chunk_len, num_chunks, float(posterior_threshold), float(posterior_alpha),
        TYPICAL=typical, COUNT=counters is not None,
        BLOCK_V=block_v, BLOCK_ROWS=triton.next_power_of_2(k + 1),
        BLOCK_CHUNKS=max(2, triton.next_power_of_2(num_chunks)),
        num_warps=VERIFY["wide_num_warps"] if block_v >= VERIFY["wide_block_v"] else VERIFY["num_warps"],
    )
    return out


def greedy_verify_triton(target_logits, draft_token_ids, counters=None):
    """The CUDA kernel of both overloads of greedy_verify (counters given: .counted), launched from Python."""
    check_inputs(GREEDY, "target_logits", target_logits, draft_token_ids, counters)
    return launch(target_logits, draft_token_ids, counters, typical=False)


def typical_acceptance_triton(target_probs, draft_token_ids, posterior_threshold=0.09, posterior_alpha=0.3,
                              counters=None):
    """The CUDA kernel of both overloads of typical_acceptance (counters given: .counted), launched from Python."""
    check_inputs(TYPICAL, "target_probs", target_probs, draft_token_ids, counters)
    check_typical_params(posterior_threshold, posterior_alpha)
    return launch(target_probs, draft_token_ids, counters, True, posterior_threshold, posterior_alpha)


register_cuda(GREEDY, greedy_verify_triton, ("default", "counted"))
register_cuda(TYPICAL, typical_acceptance_triton, ("default", "counted"))

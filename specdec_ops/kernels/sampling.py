"""The Triton kernels of `specdec::rejection_sample` and `specdec::sample_draft` (contract: ops/sampling.py),
launched from Python.

rejection_sample's kernel is a grid of (B, chunks): every
program evaluates the k accept tests (they only need p(x), q(x), one uniform),
races the segments of its chunk of V at the rejected/bonus position (a
segment is one 16-byte vector of one thread; each lane keeps its best
segment's total, E, index and weights, and walks down the winner's tree once,
after the loop),
and folds its winner (key bits, V-1-token) into a per-row slot with an int64
atomic max; an atomic ticket elects the last program of the row, which
writes the output row and the counters. The slot and ticket (kernels/ticket.py) live in the
persistent zeroed scratch of kernels/scratch.py, which the last program
resets, so a call is one launch with no memset (two streams must not run
these kernels on one device at the same time); it is used only when V is
split. The number of chunks depends only on B, V and the SM count: chunks of
at most 8192 tokens, more when needed for one program per SM; each program
pipelines its chunk's loads (Triton's async copies). A row whose residual has
no positive key is redrawn from p_j by the last program alone (a slow path: it
needs p_j <= q_j everywhere, i.e. p_j == q_j up to rounding, and a rejection
there needs q_j(x_j) == 0 or rounding). sample_draft's kernel is one program
per row that streams the row twice: the race and an online softmax
normalizer, then (with probs) the normalized probabilities.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._library import register_cuda
from ..ops.output import empty_output_row
from ..ops.sampling import check_draft_inputs, check_rejection_inputs
from .constants import ACCEPT, BONUS, DRAFT, RESIDUAL, SEGMENT
from .counter_hash import draw_bits_tl, exponential_tl, log_tl, row_state_tl, uniform_tl
from .counters import add_counters_tl
from .geometry import REJECTION_SAMPLE, SAMPLE_DRAFT
from .output_row import store_output_row_tl
from .scratch import sm_count, zeroed_scratch
from .ticket import reset_ticket_tl, take_ticket_tl


@triton.jit
def _pair_halves(x, WIDTH: tl.constexpr):
    """x [S, 2 * WIDTH] -> (x[:, 0::2], x[:, 1::2]), each [S, WIDTH]."""
    return tl.split(tl.reshape(x, [x.shape[0], WIDTH, 2]))

@triton.jit
def _column(x, index, WIDTH: tl.constexpr):
    """x[s, index[s]] for x [S, WIDTH]."""
    return tl.sum(tl.where(tl.arange(0, WIDTH)[None, :] == index[:, None], x, 0.0), axis=1)

@triton.jit
def _descend(left, right, threshold, node):
    """One level down the sum tree: the child whose share of the parent holds the threshold."""
    go_right = (left == 0) | ((right > 0) & (threshold >= left))
    return tl.where(go_right, threshold - left, threshold), 2 * node + go_right.to(tl.int32)

@triton.jit
def _segment_race_tl(weights, segment, state, best_total, best_exp, best_segment, best_weights,
                     FAST_LOG: tl.constexpr):
    """Folds a block of segments into the lanes' best: weights [S, 4] (>= 0), segment [S] int32 (indices).

    A segment's 4 entries are one 16-byte vector of one thread, so its sums stay in that thread's registers.
    Keys total / E are compared by cross-multiplying, so no segment needs a division. A lane starts at
    (total 0, E 1): only a positive key replaces it, and visiting segments in increasing order keeps the
    lowest on ties. E is > 0 but may be +inf: 0 * inf = NaN compares false, so such a segment never wins."""
    w_even, w_odd = _pair_halves(weights, 2)
    pair_0, pair_1 = tl.split(w_even + w_odd)
    total = pair_0 + pair_1
    exponential = exponential_tl(draw_bits_tl(state, 2 * segment), FAST_LOG)
    better = total * best_exp > best_total * exponential
    return (tl.where(better, total, best_total), tl.where(better, exponential, best_exp),
            tl.where(better, segment, best_segment), tl.where(better[:, None], weights, best_weights))

@triton.jit
def _segment_race_start_tl(BLOCK_V: tl.constexpr):
    """The lanes' best before any segment: (total 0, E 1, segment 0, weights 0), a key of 0 that never wins."""
    return (tl.zeros([BLOCK_V // SEGMENT], tl.float32), tl.full([BLOCK_V // SEGMENT], 1.0, tl.float32),
            tl.zeros([BLOCK_V // SEGMENT], tl.int32), tl.zeros([BLOCK_V // SEGMENT, SEGMENT], tl.float32))

@triton.jit
def _segment_block_tl(v0, BLOCK_V: tl.constexpr):
    """The segments of the block starting at v0 and their entries: (segment [S], v [S, 4])."""
    segment = v0 // SEGMENT + tl.arange(0, BLOCK_V // SEGMENT)
    return segment, v0 + tl.arange(0, BLOCK_V // SEGMENT)[:, None] * SEGMENT + tl.arange(0, SEGMENT)[None, :]

@triton.jit
def _segment_pick_tl(weights, segment, state):
    """The token each segment's race picks within it: down its pair tree, with the uniform of draw 2s+1."""
    w_even, w_odd = _pair_halves(weights, 2)
    pair_0, pair_1 = tl.split(w_even + w_odd)
    u = uniform_tl(draw_bits_tl(state, 2 * segment + 1))
    threshold, node = _descend(pair_0, pair_1, u * (pair_0 + pair_1), tl.zeros_like(segment))
    threshold, node = _descend(_column(w_even, node, 2), _column(w_odd, node, 2), threshold, node)
    return segment * SEGMENT + node

@triton.jit
def rejection_sample_kernel(
    p_ptr,  # [B, k+1, V] float32/float16/bfloat16, strides (p_stride_b, p_stride_i, 1)
    draft_ptr,  # [B, k] int32/int64, row stride draft_stride_b
    q_ptr,  # [B, k, V] float32/float16/bfloat16, strides (q_stride_b, q_stride_i, 1) (HAS_Q), else unused
    seed_ptr,  # [B] int64, stride seed_stride
    offset_ptr,  # [B] int64, stride offset_stride
    bonus_ptr,  # [B] int32/int64, stride bonus_stride (HAS_BONUS), else unused
    out_ptr,  # [B, k+1] dtype of draft, contiguous
    counters_ptr,  # [3] int64 (COUNT), else unused
    workspace_ptr,  # [B, 2] int64 (SPLIT): per row, the packed race maximum and the ticket; zero on entry and exit
    k, vocab, chunk_len,
    p_stride_b, p_stride_i, draft_stride_b, q_stride_b, q_stride_i,
    seed_stride, offset_stride, bonus_stride,
    HAS_Q: tl.constexpr, HAS_BONUS: tl.constexpr, COUNT: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, NUM_STAGES: tl.constexpr, FAST_LOG: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    seed = tl.load(seed_ptr + row * seed_stride)
    offset = tl.load(offset_ptr + row * offset_stride)
    p_row = p_ptr + row * p_stride_b

    # Accept tests at all k positions: only p(x), q(x) and one uniform each.
    i = tl.arange(0, BLOCK_K)
    in_k = i < k
    draft = tl.load(draft_ptr + row * draft_stride_b + i, mask=in_k, other=-1).to(tl.int64)
    valid = in_k & (draft >= 0) & (draft < vocab)
    safe = tl.where(valid, draft, 0)
    i64 = i.to(tl.int64)  # position offsets in int64: a large stride times k must not wrap
    p_x = tl.load(p_row + i64 * p_stride_i + safe, mask=valid, other=0.0).to(tl.float32)
    if HAS_Q:
        q_x = tl.load(q_ptr + row * q_stride_b + i64 * q_stride_i + safe, mask=valid, other=0.0).to(tl.float32)
    else:
        q_x = tl.full([BLOCK_K], 1.0, tl.float32)
    accept_bits = draw_bits_tl(row_state_tl(seed, offset + i, i * 0 + ACCEPT), i * 0)  # index 0
    u = uniform_tl(accept_bits)
    accepted = valid & (u * q_x < p_x)
    first_rejected = tl.min(tl.where(in_k & (~accepted), i, k))

    # Race at the first rejected position (residual) or at position k (bonus). The race state of every
    # candidate position is hashed while the loads above are in flight; j only selects one.
    race_states = row_state_tl(seed, offset + i, tl.where(i < k, RESIDUAL, BONUS))
    j = first_rejected
    race_state = tl.max(tl.where(i == j, race_states, 0))
    # The one-hot q's token as int32 (so the race compares 32-bit indices); -1 at the bonus position and
    # for an out-of-range id, whose q the contract makes 0: it matches no token.
    draft_j = tl.max(tl.where((i == j) & valid, draft, -1)).to(tl.int32)
    p_race = p_row + j.to(tl.int64) * p_stride_i
    q_race = q_ptr + row * q_stride_b + j.to(tl.int64) * q_stride_i
    if HAS_BONUS:
        need_race = j < k
    else:
        need_race = j <= k
    # Each lane keeps its best segment (total, E, index, weights); the token within it is picked once, after
    # the loop.
    best_total, best_exp, best_segment, best_weights = _segment_race_start_tl(BLOCK_V)
    if need_race:
        start = chunk * chunk_len
        end = tl.minimum(start + chunk_len, vocab)
        # NUM_STAGES > 1: Triton copies the next blocks in asynchronously while this one is raced.
        for v0 in tl.range(start, end, BLOCK_V, num_stages=NUM_STAGES):
            segment, v = _segment_block_tl(tl.multiple_of(v0, BLOCK_V), BLOCK_V)  # chunks start at multiples
            in_chunk = v < end
            p = tl.load(p_race + v, mask=in_chunk, other=0.0).to(tl.float32)
            if HAS_Q:
                q = tl.load(q_race + v, mask=in_chunk & (v * 0 + j < k), other=0.0).to(tl.float32)  # bonus: q = 0
            else:
                q = tl.where(v == draft_j, 1.0, 0.0)
            best_total, best_exp, best_segment, best_weights = _segment_race_tl(
                tl.maximum(p - q, 0.0), segment, race_state, best_total, best_exp, best_segment, best_weights,
                FAST_LOG)
    best_key = best_total / best_exp
    best_token = tl.where(best_key > 0, _segment_pick_tl(best_weights, best_segment, race_state), vocab)
    # Packed so that int64 max = larger key, then lower token: one reduction over the lanes, and the same
    # order for the atomic max across chunks. A lane without a positive key packs to -1 (key 0, token V),
    # and the row's slot starts at 0, so a high word <= 0 means no positive key: the fallback below.
    packed = tl.max((best_key.to(tl.int32, bitcast=True).to(tl.int64) << 32)
                    | (vocab - 1 - best_token).to(tl.int64))

    if SPLIT:
        # The ticket's release orders this program's max before it; the last
        # program's acquire sees every max. It reads the row's final maximum
        # and leaves both slots at 0 for the next call. Every other atomic is
        # relaxed: an acq_rel one would first wait for all earlier memory
        # operations of the program (a fence), a round trip each.
        tl.atomic_max(workspace_ptr + row * 2, packed, sem="relaxed")
        is_last = take_ticket_tl(workspace_ptr + row * 2 + 1) == tl.num_programs(1) - 1
        if is_last:
            packed = tl.atomic_xchg(workspace_ptr + row * 2, 0, sem="relaxed")
            reset_ticket_tl(workspace_ptr + row * 2 + 1)
    else:
        is_last = True

    if is_last:
        token = vocab - 1 - (packed & 0xFFFFFFFF)
        if need_race:
            if (packed >> 32) <= 0:
                # No positive residual key: draw from p_j itself, same random numbers.
                fb_total, fb_exp, fb_segment, fb_weights = _segment_race_start_tl(BLOCK_V)
                for v0 in range(0, vocab, BLOCK_V):
                    segment, v = _segment_block_tl(v0, BLOCK_V)
                    p = tl.load(p_race + v, mask=v < vocab, other=0.0).to(tl.float32)
                    fb_total, fb_exp, fb_segment, fb_weights = _segment_race_tl(
                        p, segment, race_state, fb_total, fb_exp, fb_segment, fb_weights, FAST_LOG)
                fb_key = fb_total / fb_exp
                fb_token = _segment_pick_tl(fb_weights, fb_segment, race_state)
                top = tl.max(fb_key)
                token = tl.where(top > 0, tl.min(tl.where(fb_key == top, fb_token, vocab)), 0).to(tl.int64)
            token = tl.minimum(tl.maximum(token, 0), vocab - 1)  # non-finite rows: stay in [0, V)
        if HAS_BONUS:
            bonus = tl.load(bonus_ptr + row * bonus_stride).to(tl.int64)
        else:
            bonus = token
        out = tl.where(i < j, draft, -1)
        out = tl.where((i == j) & (j < k), token, out)
        out = tl.where((i == k) & (j == k), bonus, out)
        store_output_row_tl(out_ptr, row, i, k, out)
        if COUNT:
            add_counters_tl(counters_ptr, tl.sum(accepted.to(tl.int64), axis=0),
                            tl.sum(((i <= k) & (out != -1)).to(tl.int64), axis=0), k)

@triton.jit
def sample_draft_kernel(
    logits_ptr,  # [n, V] float16/bfloat16/float32/float64, row stride logits_stride
    temperature_ptr,  # [n] float32, stride temperature_stride
    seed_ptr,  # [n] int64, stride seed_stride
    position_ptr,  # [n] int64, stride position_stride
    out_ptr,  # [n] int64
    probs_ptr,  # [n, V] float32, row stride probs_stride (WITH_PROBS), else unused
    vocab, logits_stride, temperature_stride, seed_stride, position_stride, probs_stride,
    WITH_PROBS: tl.constexpr, BLOCK_V: tl.constexpr, FAST_LOG: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperature_ptr + row * temperature_stride)
    is_random = temperature > 0
    state = row_state_tl(tl.load(seed_ptr + row * seed_stride), tl.load(position_ptr + row * position_stride),
                          tl.zeros([], tl.int32) + DRAFT)
    logits_row = logits_ptr + row * logits_stride
    # Pass 1: the race (Gumbel keys) or the argmax, and an online softmax
    # normalizer of logits / T: a running max per lane and the lane's sum
    # of exp(z - max), rescaled when the max grows.
    best_key = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK_V], 0, tl.int32) + vocab
    lane_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK_V], tl.float32)
    lane_nan = tl.zeros([BLOCK_V], tl.int1)  # the GPU's max drops NaN; softmax must not
    for v0 in range(0, vocab, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)
        in_row = v < vocab
        x = tl.load(logits_row + v, mask=in_row, other=float("-inf")).to(tl.float32)
        if is_random:
            z = x / temperature
            key = z - log_tl(exponential_tl(draw_bits_tl(state, v), FAST_LOG), FAST_LOG)
        else:
            z = x
            key = x
        # Ties (-inf keys included) go to the lower index; a lane visits indices in increasing order. A NaN key
        # counts as the largest, first NaN winning, as torch.argmax (the reference) has it.
        better = in_row & (best_key == best_key) & ((key != key) | (key > best_key) |
                                                    ((key == best_key) & (v < best_idx)))
        best_key = tl.where(better, key, best_key)
        best_idx = tl.where(better, v, best_idx)
        if WITH_PROBS:
            new_max = tl.maximum(lane_max, z)
            finite = new_max > float("-inf")  # exp(-inf - -inf) would be NaN
            lane_sum = tl.where(finite, lane_sum * tl.exp(lane_max - new_max) + tl.exp(z - new_max), 0.0)
            lane_max = new_max
            lane_nan = lane_nan | (z != z)
    lane_best_nan = best_key != best_key
    nan_token = tl.min(tl.where(lane_best_nan, best_idx, vocab))
    top = tl.max(tl.where(lane_best_nan, float("-inf"), best_key))
    token = tl.min(tl.where(best_key == top, best_idx, vocab))
    token = tl.where(nan_token < vocab, nan_token, token)
    token = tl.minimum(token, vocab - 1)
    tl.store(out_ptr + row, token.to(tl.int64))

    if WITH_PROBS:
        probs_row = probs_ptr + row * probs_stride
        if is_random:
            # Pass 2: the lanes' sums, rescaled to the row max, normalize exp(z - max).
            m = tl.max(lane_max)
            total = tl.sum(tl.where(lane_max > float("-inf"), lane_sum * tl.exp(lane_max - m), 0.0))
            has_nan = tl.max(lane_nan.to(tl.int32)) > 0
            inv_total = tl.where(has_nan, float("nan"), 1.0 / total)  # a NaN logit: a NaN row, as softmax
            for v0 in range(0, vocab, BLOCK_V):
                v = v0 + tl.arange(0, BLOCK_V)
                in_row = v < vocab
                x = tl.load(logits_row + v, mask=in_row, other=float("-inf")).to(tl.float32)
                tl.store(probs_row + v, tl.exp(x / temperature - m) * inv_total, mask=in_row)
        else:
            for v0 in range(0, vocab, BLOCK_V):
                v = v0 + tl.arange(0, BLOCK_V)
                tl.store(probs_row + v, tl.where(v == token, 1.0, 0.0), mask=v < vocab)


def plan_rejection(batch: int, vocab: int, device: torch.device, num_chunks=None, block_v=None):
    """(BLOCK_V, chunk_len, num_chunks): a row's V is split into chunks of at most max_chunk entries, and into
    more when the batch is too small to give every SM programs_per_sm programs (chunks of >= BLOCK_V)."""
    block_v = block_v or min(REJECTION_SAMPLE["block_v"], max(16, triton.next_power_of_2(vocab)))
    if num_chunks is None:
        if device.type != "cuda":
            num_chunks = 1
        else:
            wanted = max(triton.cdiv(REJECTION_SAMPLE["programs_per_sm"] * sm_count(device), batch),
                         triton.cdiv(vocab, REJECTION_SAMPLE["max_chunk"]))
            num_chunks = max(1, min(wanted, triton.cdiv(vocab, block_v)))
    chunk_len = triton.cdiv(triton.cdiv(vocab, num_chunks), block_v) * block_v
    return block_v, chunk_len, triton.cdiv(vocab, chunk_len)


def launch_rejection(target_probs, draft_token_ids, draft_probs, seeds, offsets, bonus_token_ids, counters,
                      num_chunks=None, block_v=None):
    batch, k = draft_token_ids.shape
    vocab = target_probs.shape[2]
    out = empty_output_row(draft_token_ids)
    if batch == 0:
        return out
    block_v, chunk_len, num_chunks = plan_rejection(batch, vocab, out.device, num_chunks, block_v)
    split = num_chunks > 1
    # Per row: [max packed race winner, arrival ticket], zero between calls.
    workspace = zeroed_scratch(out.device, 2 * batch) if split else out
    has_q = draft_probs is not None
    has_bonus = bonus_token_ids is not None
    rejection_sample_kernel[(batch, num_chunks)](
        target_probs, draft_token_ids, draft_probs if has_q else target_probs, seeds, offsets,
        bonus_token_ids if has_bonus else seeds, out, out if counters is None else counters, workspace,
        k, vocab, chunk_len,
        target_probs.stride(0), target_probs.stride(1), draft_token_ids.stride(0),
        draft_probs.stride(0) if has_q else 0, draft_probs.stride(1) if has_q else 0,
        seeds.stride(0), offsets.stride(0), bonus_token_ids.stride(0) if has_bonus else 0,
        HAS_Q=has_q, HAS_BONUS=has_bonus, COUNT=counters is not None, SPLIT=split,
        BLOCK_K=triton.next_power_of_2(k + 1), BLOCK_V=block_v, NUM_STAGES=REJECTION_SAMPLE["num_stages"],
        FAST_LOG=out.is_cuda,
        num_warps=REJECTION_SAMPLE["num_warps"],
    )
    return out


def rejection_sample_triton(target_probs, draft_token_ids, draft_probs, seeds, offsets, bonus_token_ids=None,
                            counters=None):
    """The CUDA kernel of both overloads of rejection_sample (counters given: .counted), launched from Python."""
    check_rejection_inputs(target_probs, draft_token_ids, draft_probs, seeds, offsets, bonus_token_ids, counters)
    return launch_rejection(target_probs, draft_token_ids, draft_probs, seeds, offsets, bonus_token_ids, counters)


def launch_draft(logits, temperature, seeds, positions, probs, block_v=None):
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    with_probs = probs is not None
    sample_draft_kernel[(rows,)](
        logits, temperature, seeds, positions, out, probs if with_probs else out,
        vocab, logits.stride(0), temperature.stride(0), seeds.stride(0), positions.stride(0),
        probs.stride(0) if with_probs else 0,
        WITH_PROBS=with_probs, BLOCK_V=block_v or min(SAMPLE_DRAFT["block_v"], max(16, triton.next_power_of_2(vocab))),
        FAST_LOG=out.is_cuda, num_warps=SAMPLE_DRAFT["num_warps"],
    )
    return out


def sample_draft_triton(logits, temperature, seeds, positions, probs=None):
    """The CUDA kernel of both overloads of sample_draft (probs given: .with_probs), launched from Python."""
    check_draft_inputs(logits, temperature, seeds, positions, probs)
    return launch_draft(logits, temperature, seeds, positions, probs)


register_cuda("rejection_sample", rejection_sample_triton, ("default", "counted"))
register_cuda("sample_draft", sample_draft_triton, ("default", "with_probs"))

"""Triton CUDA kernels of `specdec::rejection_sample_logits` and `specdec::sample_draft_filtered`.

The contract is specdec_ops/ops/logits_sampling.py. No probability tensor is written: per logit row the kernels
keep four numbers, the max m of z = x / T, the threshold tau of the kept set (an order key of z, below), the kept
mass S and the argmax, and recompute a probability exp(z - m) / S where they need one.

Row statistics (`_row_stats_tl`). Pass 1 streams the row once: the argmax of x, the max of z and an online sum of
exp(z - m) (the mass S when no filter is active). With a filter active, the thresholds are found by a search over
the order keys of z (float32 bits mapped to int32 so that integer order is float order, -0.0 with +0.0). top-k's
threshold is the largest key t with count(>= t) >= top_k, top-p's the largest t >= tau_k with mass(>= t) >=
top_p * mass(>= tau_k); both are entry keys, so ties at the cut-off are kept, as the contract says. A search pass
evaluates NUM_PROBES candidate thresholds at once (the count and the mass of the entries at or above each), keeps
the sub-interval where the condition flips and shrinks it to the smallest and largest entry keys inside it. The
first pass of a search puts its probes at z = m - delta (delta geometric, 2**-3 to 2**4.5), where thresholds of
real logits lie; later passes split the key interval evenly (at most 8 passes of 16 probes for 32-bit keys). A
search stops as soon as at most CAP (1024) entries are at or above its lower bound: one more pass copies their z
to a per-row scratch, and the exact thresholds and the kept mass come from sorting them in registers (tl.sort,
tl.cumsum), with no further pass. So top-k + top-p on typical logits costs pass 1, one probe pass and the gather;
a kept set larger than CAP (top-p over a flat distribution) takes the full search and a last pass that sums S.
min-p needs no search (its test is e >= min_p).

rejection_sample_logits is two launches: `_row_stats_kernel`, one program per row of the target (k+1 per request)
and of the draft logits (k more when given), writes the statistics to an int32 [B, rows, 4] buffer (floats as
their bits); then `_verify_kernel`, one program per request, evaluates the accept tests at all k positions (p(x)
and q(x) from the statistics and one logit each), block verification's residual masses when asked (a pass over
row i for the i it needs, from k-1 down to the first that may stop), and the segmented race of
specdec_ops/ops/sampling.py over the one rejected/bonus row, then writes the output row, the logprobs and the
counters. sample_draft_filtered is one program per row: the statistics, then the Gumbel race over the kept
entries and the probabilities.

On CUDA, exp and log come from the GPU's libraries and the sums are float32 in this kernel's order, so results
equal the reference except at near-ties (the contract's "Float rounding").
"""
from __future__ import annotations

import torch

import triton
import triton.language as tl

from .._library import register_cuda
from ..ops.logits_sampling import check_draft_inputs, check_rejection_inputs

# Rows are streamed in blocks of BLOCK_V entries (segments of 4 for the race); the threshold search compares
# SEARCH_BLOCK entries with NUM_PROBES thresholds per step. Not tuned on a GPU yet.
_BLOCK_V = 1024
_SEARCH_BLOCK = 256
_NUM_PROBES = 16
_NUM_WARPS = 8
# A search stops once at most this many entries are at or above its lower bound; they are then copied to a per-row
# scratch and sorted in registers, which gives the thresholds exactly.
_GATHER_CAP = 1024

from .counter_hash import draw_bits_tl as _draw_bits_tl
from .counter_hash import exponential_tl as _exponential_tl
from .counter_hash import log_tl as _log_tl
from .counter_hash import row_state_tl as _row_state_tl
from .counters import add_counters_tl
from .sampling import _segment_block_tl, _segment_pick_tl, _segment_race_start_tl, _segment_race_tl

@triton.jit
def _order_key_tl(z):
    """int32 key with key(a) < key(b) iff a < b for non-NaN floats (-0.0 and +0.0 share key 0)."""
    bits = z.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return tl.where(key == -1, 0, key)

@triton.jit
def _key_to_float_tl(key):
    """The float32 whose order key is key (int32): the inverse of _order_key_tl."""
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)

@triton.jit
def _search_pass_tl(row_ptr, vocab, temperature, m, lo, hi, top_k, target,
                    USE_MASS: tl.constexpr, VALUE_PROBES: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
                    NUM_PROBES: tl.constexpr):
    """One pass of the threshold search in [lo, hi] (int64 keys, cond(lo) true): the new (lo, hi), the mass
    and the count at or above the new lo when a probe moved it, and whether a probe moved lo.

    The probes are increasing keys in (lo, hi]: spread evenly over the keys, or (VALUE_PROBES, a search's
    first pass) at z = m - delta for delta from 2**4.5 down to 2**-3 by factors of sqrt(2), where the
    thresholds of typical logits lie: one such pass often leaves few candidates."""
    p = tl.arange(0, NUM_PROBES).to(tl.int64)
    if VALUE_PROBES:
        delta = tl.exp2((NUM_PROBES - 1 - p).to(tl.float32) * 0.5 - 3.0)
        probes64 = tl.minimum(tl.maximum(_order_key_tl(m - delta).to(tl.int64), lo + 1), hi)
    else:
        width = hi - lo
        probes64 = lo + ((p + 1) * width + NUM_PROBES - 1) // NUM_PROBES  # the last one is hi
    probes = probes64.to(tl.int32)
    counts = tl.zeros([NUM_PROBES], tl.int32)
    masses = tl.zeros([NUM_PROBES], tl.float32)
    key_min = tl.full([SEARCH_BLOCK], 2147483647, tl.int32)
    key_max = tl.full([SEARCH_BLOCK], -2147483648, tl.int32)
    lo32 = lo.to(tl.int32)
    hi32 = hi.to(tl.int32)
    for v0 in range(0, vocab, SEARCH_BLOCK):
        v = v0 + tl.arange(0, SEARCH_BLOCK)
        in_row = v < vocab
        z = tl.load(row_ptr + v, mask=in_row, other=0.0).to(tl.float32) / temperature
        key = tl.where(in_row, _order_key_tl(z), -2147483648)
        e = tl.where(in_row, tl.exp(z - m), 0.0)
        at_or_above = key[:, None] >= probes[None, :]
        counts += tl.sum(at_or_above.to(tl.int32), axis=0)
        masses += tl.sum(tl.where(at_or_above, e[:, None], 0.0), axis=0)
        inside = in_row & (key >= lo32) & (key <= hi32)
        key_min = tl.minimum(key_min, tl.where(inside, key, 2147483647))
        key_max = tl.maximum(key_max, tl.where(inside, key, -2147483648))
    if USE_MASS:
        ok = masses >= target
    else:
        ok = counts >= top_k
    num_ok = tl.sum(ok.to(tl.int32), axis=0)
    new_lo = tl.max(tl.where(ok, probes64, lo), axis=0)
    at_new_lo = ok & (probes64 == new_lo)
    new_lo_mass = tl.max(tl.where(at_new_lo, masses, -1.0), axis=0)
    new_lo_count = tl.max(tl.where(at_new_lo, counts, -1), axis=0)
    new_hi = tl.where(num_ok < NUM_PROBES, tl.min(tl.where(ok, hi + 1, probes64), axis=0) - 1, hi)
    # No entry between the old lo and the smallest entry key inside: the condition holds there too.
    new_lo = tl.maximum(new_lo, tl.min(key_min, axis=0).to(tl.int64))
    new_hi = tl.minimum(new_hi, tl.max(key_max, axis=0).to(tl.int64))
    return new_lo, new_hi, new_lo_mass, new_lo_count, num_ok > 0

@triton.jit
def _search_tl(row_ptr, vocab, temperature, m, lo, hi, lo_mass, lo_count, top_k, target,
               USE_MASS: tl.constexpr, SEARCH_BLOCK: tl.constexpr, NUM_PROBES: tl.constexpr,
               CAP: tl.constexpr):
    """Raises lo (cond(lo) true, lo_count entries at or above it) toward the largest key with cond: returns
    (lo, mass at or above lo, count at or above lo). Either lo is that key, or at most CAP entries are at or
    above lo and the search stopped early (the gather finishes it exactly)."""
    if (lo < hi) & (lo_count > CAP):
        lo, hi, new_mass, new_count, moved = _search_pass_tl(row_ptr, vocab, temperature, m, lo, hi, top_k,
                                                             target, USE_MASS, True, SEARCH_BLOCK, NUM_PROBES)
        lo_mass = tl.where(moved, new_mass, lo_mass)
        lo_count = tl.where(moved, new_count, lo_count)
    passes = tl.zeros([], tl.int32)
    # A finite row converges in at most 8 passes of 16 probes; 40 bounds rows of NaN.
    while (lo < hi) & (lo_count > CAP) & (passes < 40):
        lo, hi, new_mass, new_count, moved = _search_pass_tl(row_ptr, vocab, temperature, m, lo, hi, top_k,
                                                             target, USE_MASS, False, SEARCH_BLOCK, NUM_PROBES)
        lo_mass = tl.where(moved, new_mass, lo_mass)
        lo_count = tl.where(moved, new_count, lo_count)
        passes += 1
    return lo, lo_mass, lo_count

@triton.jit
def _gather_finish_tl(row_ptr, scratch_ptr, vocab, temperature, m, lo, k_pending, top_k, tau_k_z, mass_k,
                      p_on, top_p, min_e, SEARCH_BLOCK: tl.constexpr, CAP: tl.constexpr):
    """The exact thresholds and kept mass from the (at most CAP) entries with key >= lo, which hold every kept
    entry: one pass copies their z into the row's scratch, then they are sorted in registers. k_pending: the
    top-k threshold is still to find (else tau_k_z and mass_k are given). Returns (tau key int64, S)."""
    lo32 = lo.to(tl.int32)
    count = tl.zeros([], tl.int32)
    for v0 in range(0, vocab, SEARCH_BLOCK):
        v = v0 + tl.arange(0, SEARCH_BLOCK)
        in_row = v < vocab
        z = tl.load(row_ptr + v, mask=in_row, other=float("-inf")).to(tl.float32) / temperature
        candidate = in_row & (_order_key_tl(z) >= lo32)
        position = count + tl.cumsum(candidate.to(tl.int32), axis=0) - 1
        tl.store(scratch_ptr + position, z, mask=candidate & (position < CAP))
        count += tl.sum(candidate.to(tl.int32), axis=0)
    tl.debug_barrier()  # the stores of every thread are visible to the loads below
    count = tl.minimum(count, CAP)
    index = tl.arange(0, CAP)
    sorted_z = tl.sort(tl.load(scratch_ptr + index, mask=index < count, other=float("-inf")), descending=True)
    e = tl.exp(sorted_z - m)  # 0 for the -inf padding
    if k_pending:
        tau_k_z = tl.max(tl.where(index == top_k - 1, sorted_z, float("-inf")), axis=0)
        mass_k = tl.sum(tl.where(sorted_z >= tau_k_z, e, 0.0), axis=0)
    tau_z = tau_k_z
    if p_on:
        # The first sorted position whose cumulative mass reaches top_p * M_k; its value is tau_p.
        first = tl.sum((tl.cumsum(e, axis=0) < top_p * mass_k).to(tl.int32), axis=0)
        first = tl.minimum(first, count - 1)
        tau_z = tl.maximum(tau_z, tl.max(tl.where(index == first, sorted_z, float("-inf")), axis=0))
    mass = tl.sum(tl.where((sorted_z >= tau_z) & (e >= min_e), e, 0.0), axis=0)
    return _order_key_tl(tau_z).to(tl.int64), mass

@triton.jit
def _row_stats_tl(row_ptr, scratch_ptr, vocab, temperature, top_k, top_p, min_e,
                  BLOCK_V: tl.constexpr, SEARCH_BLOCK: tl.constexpr, NUM_PROBES: tl.constexpr,
                  CAP: tl.constexpr):
    """(m, tau key, S, argmax) of one logit row; m, tau and S only matter for a positive temperature."""
    is_random = temperature > 0
    t = tl.where(is_random, temperature, 1.0)
    best_x = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK_V], 0, tl.int32) + vocab
    lane_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, vocab, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)
        in_row = v < vocab
        x = tl.load(row_ptr + v, mask=in_row, other=float("-inf")).to(tl.float32)
        # A lane visits increasing indices: its first entry, then only strictly larger ones (first index on
        # ties, as torch.argmax).
        better = in_row & ((x > best_x) | (best_i == vocab))
        best_x = tl.where(better, x, best_x)
        best_i = tl.where(better, v, best_i)
        z = x / t
        new_max = tl.maximum(lane_max, z)
        finite = new_max > float("-inf")  # exp(-inf - -inf) would be NaN
        lane_sum = tl.where(finite, lane_sum * tl.exp(lane_max - new_max) + tl.exp(z - new_max), 0.0)
        lane_max = new_max
    top = tl.max(best_x, axis=0)
    argmax = tl.min(tl.where(best_x == top, best_i, vocab), axis=0)
    argmax = tl.minimum(argmax, vocab - 1)
    m = tl.max(lane_max, axis=0)
    mass = tl.sum(tl.where(lane_max > float("-inf"), lane_sum * tl.exp(lane_max - m), 0.0), axis=0)
    tau = tl.full([], -2139095041, tl.int64)  # the order key of -inf: every non-NaN entry is at or above
    k_on = (top_k > 0) & (top_k < vocab)
    p_on = top_p < 1.0
    if is_random & (k_on | p_on | (min_e > 0)):
        key_m = _order_key_tl(m).to(tl.int64)
        lo = tau
        lo_mass = mass
        lo_count = tl.zeros([], tl.int32) + vocab
        if k_on:
            lo, lo_mass, lo_count = _search_tl(row_ptr, vocab, t, m, lo, key_m, lo_mass, lo_count,
                                               top_k.to(tl.int32), 0.0, False, SEARCH_BLOCK, NUM_PROBES, CAP)
        final_pass = (lo_count > CAP).to(tl.int32)
        if lo_count <= CAP:
            # The top-k set (or, top-k off, the whole row) is at most CAP entries: finish in registers.
            # With top-k off, tau_k is -inf (lo's value) and M_k the row's mass (lo_mass).
            tau, mass = _gather_finish_tl(row_ptr, scratch_ptr, vocab, t, m, lo, k_on, top_k,
                                          _key_to_float_tl(lo.to(tl.int32)), lo_mass, p_on, top_p, min_e,
                                          SEARCH_BLOCK, CAP)
        else:
            tau = lo  # tau_k exactly (the search converged), or -inf's key with top-k off
            if p_on:
                mass_k = lo_mass
                tau_k_z = _key_to_float_tl(lo.to(tl.int32))
                lo, p_mass, lo_count = _search_tl(row_ptr, vocab, t, m, lo, key_m, lo_mass, lo_count, 0,
                                                  top_p * mass_k, True, SEARCH_BLOCK, NUM_PROBES, CAP)
                tau = lo
                if lo_count <= CAP:
                    tau, mass = _gather_finish_tl(row_ptr, scratch_ptr, vocab, t, m, lo, False, top_k, tau_k_z,
                                                  mass_k, True, top_p, min_e, SEARCH_BLOCK, CAP)
                    final_pass = final_pass * 0
        if final_pass != 0:
            tau32 = tau.to(tl.int32)
            kept_mass = tl.zeros([BLOCK_V], tl.float32)
            for v0 in range(0, vocab, BLOCK_V):
                v = v0 + tl.arange(0, BLOCK_V)
                in_row = v < vocab
                z = tl.load(row_ptr + v, mask=in_row, other=float("-inf")).to(tl.float32) / t
                e = tl.exp(z - m)
                kept = in_row & (_order_key_tl(z) >= tau32) & (e >= min_e)
                kept_mass += tl.where(kept, e, 0.0)
            mass = tl.sum(kept_mass, axis=0)
    return m, tau.to(tl.int32), mass, argmax

@triton.jit
def _store_stats_tl(stats_ptr, m, tau, mass, argmax):
    # An int32 buffer: the floats travel as their bits, which no load or store changes.
    which = tl.arange(0, 4)
    values = tl.where(which == 0, m.to(tl.int32, bitcast=True),
                      tl.where(which == 1, tau, tl.where(which == 2, mass.to(tl.int32, bitcast=True), argmax)))
    tl.store(stats_ptr + which, values)

@triton.jit
def _min_e_tl(min_p):
    """min-p's threshold on e = exp(z - m): min(min_p, 1) when positive, else 0 (NaN: 0)."""
    return tl.where(min_p > 0, tl.minimum(min_p, 1.0), 0.0)

@triton.jit
def _row_stats_kernel(
    target_ptr, draft_logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, stats_ptr, scratch_ptr,
    k, vocab, t_stride_b, t_stride_i, d_stride_b, d_stride_i,
    temperature_stride, top_k_stride, top_p_stride, min_p_stride,
    HAS_DRAFT_LOGITS: tl.constexpr, BLOCK_V: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
    NUM_PROBES: tl.constexpr, CAP: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1)
    temperature = tl.load(temperature_ptr + b * temperature_stride)
    top_k = tl.load(top_k_ptr + b * top_k_stride).to(tl.int64)
    top_p = tl.load(top_p_ptr + b * top_p_stride)
    min_e = _min_e_tl(tl.load(min_p_ptr + b * min_p_stride))
    num_rows = tl.num_programs(1)
    out = stats_ptr + (b * num_rows + r) * 4
    scratch = scratch_ptr + (b * num_rows + r) * CAP
    if r <= k:
        m, tau, mass, argmax = _row_stats_tl(target_ptr + b * t_stride_b + r.to(tl.int64) * t_stride_i, scratch,
                                             vocab, temperature, top_k, top_p, min_e, BLOCK_V, SEARCH_BLOCK,
                                             NUM_PROBES, CAP)
        _store_stats_tl(out, m, tau, mass, argmax)
    if HAS_DRAFT_LOGITS:
        if r > k:
            row = (r - k - 1).to(tl.int64)
            m, tau, mass, argmax = _row_stats_tl(draft_logits_ptr + b * d_stride_b + row * d_stride_i, scratch,
                                                 vocab, temperature, top_k, top_p, min_e, BLOCK_V, SEARCH_BLOCK,
                                                 NUM_PROBES, CAP)
            _store_stats_tl(out, m, tau, mass, argmax)

@triton.jit
def _prob_tl(x, t, m, tau, mass, min_e):
    """Processed probability of logits x (any shape) given a row's statistics."""
    z = x / t
    e = tl.exp(z - m)
    kept = (_order_key_tl(z) >= tau) & (e >= min_e)
    return tl.where(kept, e / mass, 0.0)

@triton.jit
def _q_block_tl(q_ptr, v, mask, draft_j, t, qm, qtau, qmass, min_e,
                HAS_DRAFT_PROBS: tl.constexpr, HAS_DRAFT_LOGITS: tl.constexpr):
    """q at entries v of a draft row (0 where mask is off): given, processed from logits, or one-hot."""
    if HAS_DRAFT_PROBS:
        q = tl.load(q_ptr + v, mask=mask, other=0.0).to(tl.float32)
    elif HAS_DRAFT_LOGITS:
        x = tl.load(q_ptr + v, mask=mask, other=float("-inf")).to(tl.float32)
        q = tl.where(mask, _prob_tl(x, t, qm, qtau, qmass, min_e), 0.0)
    else:
        q = tl.where(mask & (v == draft_j), 1.0, 0.0)
    return q

@triton.jit
def _pick_tl(vec, i, index):
    """vec[index] of a [BLOCK_K] vector (index a scalar)."""
    return tl.sum(tl.where(i == index, vec, 0), axis=0)

@triton.jit
def _verify_kernel(
    target_ptr, draft_ptr, q_ptr, temperature_ptr, min_p_ptr, seed_ptr, offset_ptr, stats_ptr,
    out_ptr, logprobs_ptr, counters_ptr,
    k, vocab, num_rows,
    t_stride_b, t_stride_i, draft_stride_b, q_stride_b, q_stride_i,
    temperature_stride, min_p_stride, seed_stride, offset_stride,
    HAS_DRAFT_PROBS: tl.constexpr, HAS_DRAFT_LOGITS: tl.constexpr, BLOCK: tl.constexpr,
    WITH_LOGPROBS: tl.constexpr, COUNT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    FAST_LOG: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperature_ptr + b * temperature_stride)
    greedy = ~(temperature > 0)
    t = tl.where(greedy, 1.0, temperature)
    min_e = _min_e_tl(tl.load(min_p_ptr + b * min_p_stride))
    seed = tl.load(seed_ptr + b * seed_stride)
    offset = tl.load(offset_ptr + b * offset_stride)
    i = tl.arange(0, BLOCK_K)
    i64 = i.to(tl.int64)
    in_k = i < k
    in_rows = i <= k
    stats = stats_ptr + b * num_rows * 4
    m = tl.load(stats + i * 4, mask=in_rows, other=0).to(tl.float32, bitcast=True)
    tau = tl.load(stats + i * 4 + 1, mask=in_rows, other=0)
    mass = tl.load(stats + i * 4 + 2, mask=in_rows, other=0x3F800000).to(tl.float32, bitcast=True)  # 1.0
    argmax = tl.load(stats + i * 4 + 3, mask=in_rows, other=0)
    draft = tl.load(draft_ptr + b * draft_stride_b + i, mask=in_k, other=-1).to(tl.int64)
    valid = in_k & (draft >= 0) & (draft < vocab)
    safe = tl.where(valid, draft, 0)
    t_row = target_ptr + b * t_stride_b
    q_row = q_ptr + b * q_stride_b
    x_at = tl.load(t_row + i64 * t_stride_i + safe, mask=valid, other=0.0).to(tl.float32)
    p_x = tl.where(valid, _prob_tl(x_at, t, m, tau, mass, min_e), 0.0)
    if HAS_DRAFT_LOGITS:
        qm = tl.load(stats + (k + 1 + i) * 4, mask=in_k, other=0).to(tl.float32, bitcast=True)
        qtau = tl.load(stats + (k + 1 + i) * 4 + 1, mask=in_k, other=0)
        qmass = tl.load(stats + (k + 1 + i) * 4 + 2, mask=in_k, other=0x3F800000).to(tl.float32, bitcast=True)
    else:
        qm = m
        qtau = tau
        qmass = mass
    q_x = _q_block_tl(q_row + i64 * q_stride_i, safe, valid, safe, t, qm, qtau, qmass, min_e,
                      HAS_DRAFT_PROBS, HAS_DRAFT_LOGITS)
    u = (_draw_bits_tl(_row_state_tl(seed, offset + i, i * 0 + 2), i * 0) >> 8).to(tl.float32) \
        * 5.960464477539063e-08  # ACCEPT stream
    matches = valid & (draft == argmax.to(tl.int64))
    first_mismatch = tl.min(tl.where(in_k & ~matches, i, k), axis=0)

    weights = tl.full([BLOCK_K], 1.0, tl.float32)
    if BLOCK:
        w = tl.full([], 1.0, tl.float32)
        for s in range(1, k + 1):
            px = _pick_tl(p_x, i, s - 1)
            qx = _pick_tl(q_x, i, s - 1)
            vx = _pick_tl(valid.to(tl.int32), i, s - 1)
            scaled = w * px
            # The divisor only matters where qx > scaled >= 0; qx <= 0 is never divided by (NaN stays NaN).
            ratio = tl.where(qx <= scaled, 1.0, scaled / tl.where(qx <= 0, 1.0, qx))
            # A weight that reached 0 stays 0 (qx == 0 would otherwise compare 0 <= 0 and revive it).
            w = tl.where((w == 0) | (px == 0) | (vx == 0), 0.0, ratio)
            weights = tl.where(i == s, w, weights)
        u_last = _pick_tl(u, i, k - 1)
        stop = tl.where(u_last < w, k, 0)
        if ~greedy:
            for s in range(1, k):
                row = (k - s).to(tl.int64)
                w_row = _pick_tl(weights, i, row)
                if (stop == 0) & (w_row > 0):  # no stop where the weight is 0 (or NaN)
                    rm = _pick_tl(m, i, row)
                    rtau = _pick_tl(tau, i, row)
                    rmass = _pick_tl(mass, i, row)
                    if HAS_DRAFT_LOGITS:
                        rqm = _pick_tl(qm, i, row)
                        rqtau = _pick_tl(qtau, i, row)
                        rqmass = _pick_tl(qmass, i, row)
                    else:
                        rqm = rm
                        rqtau = rtau
                        rqmass = rmass
                    draft_row = _pick_tl(draft, i, row)
                    residual = tl.zeros([BLOCK_V], tl.float32)
                    for v0 in range(0, vocab, BLOCK_V):
                        v = v0 + tl.arange(0, BLOCK_V)
                        in_row = v < vocab
                        x = tl.load(t_row + row * t_stride_i + v, mask=in_row, other=float("-inf"))
                        p = tl.where(in_row, _prob_tl(x.to(tl.float32), t, rm, rtau, rmass, min_e), 0.0)
                        q = _q_block_tl(q_row + row * q_stride_i, v, in_row, draft_row, t, rqm, rqtau, rqmass,
                                        min_e, HAS_DRAFT_PROBS, HAS_DRAFT_LOGITS)
                        residual += tl.maximum(w_row * p - q, 0.0)
                    r_mass = tl.sum(residual, axis=0)
                    u_row = _pick_tl(u, i, row - 1)
                    if u_row * (r_mass + (1.0 - w_row)) < r_mass:
                        stop = row.to(tl.int32)
        j = tl.where(greedy, first_mismatch, stop)
        accepted = i < j
        num_accepted = j.to(tl.int64)
    else:
        accepted = tl.where(greedy, matches, valid & (u * q_x < p_x))
        j = tl.min(tl.where(in_k & ~accepted, i, k), axis=0)
        num_accepted = tl.sum(accepted.to(tl.int64), axis=0)

    token = _pick_tl(argmax, i, j).to(tl.int64)
    if ~greedy:
        # Race at row j (residual, or the bonus at k with q = 0) over max(w_j * p - q, 0).
        w_j = _pick_tl(weights, i, j)
        jm = _pick_tl(m, i, j)
        jtau = _pick_tl(tau, i, j)
        jmass = _pick_tl(mass, i, j)
        if HAS_DRAFT_LOGITS:
            jqm = _pick_tl(qm, i, j)
            jqtau = _pick_tl(qtau, i, j)
            jqmass = _pick_tl(qmass, i, j)
        else:
            jqm = jm
            jqtau = jtau
            jqmass = jmass
        draft_j = tl.max(tl.where((i == j) & valid, draft, -1), axis=0).to(tl.int32)
        has_q = j < k
        state = _row_state_tl(seed, offset + j, tl.where(has_q, 3, 4))  # RESIDUAL or BONUS
        p_race = t_row + j.to(tl.int64) * t_stride_i
        q_race = q_row + j.to(tl.int64) * q_stride_i
        best_total, best_exp, best_segment, best_weights = _segment_race_start_tl(BLOCK_V)
        for v0 in range(0, vocab, BLOCK_V):
            segment, v = _segment_block_tl(tl.multiple_of(v0, BLOCK_V), BLOCK_V)
            in_row = v < vocab
            x = tl.load(p_race + v, mask=in_row, other=float("-inf")).to(tl.float32)
            p = tl.where(in_row, _prob_tl(x, t, jm, jtau, jmass, min_e), 0.0)
            q = _q_block_tl(q_race, v, in_row & (v * 0 + j < k), draft_j, t, jqm, jqtau, jqmass, min_e,
                            HAS_DRAFT_PROBS, HAS_DRAFT_LOGITS)
            best_total, best_exp, best_segment, best_weights = _segment_race_tl(
                tl.maximum(w_j * p - q, 0.0), segment, state, best_total, best_exp, best_segment, best_weights,
                FAST_LOG)
        best_key = best_total / best_exp
        top = tl.max(best_key, axis=0)
        if top > 0:
            race_token = _segment_pick_tl(best_weights, best_segment, state)
            token = tl.min(tl.where(best_key == top, race_token, vocab), axis=0).to(tl.int64)
        else:
            # No positive residual key: draw from p_j itself, same random numbers.
            fb_total, fb_exp, fb_segment, fb_weights = _segment_race_start_tl(BLOCK_V)
            for v0 in range(0, vocab, BLOCK_V):
                segment, v = _segment_block_tl(tl.multiple_of(v0, BLOCK_V), BLOCK_V)
                in_row = v < vocab
                x = tl.load(p_race + v, mask=in_row, other=float("-inf")).to(tl.float32)
                p = tl.where(in_row, _prob_tl(x, t, jm, jtau, jmass, min_e), 0.0)
                fb_total, fb_exp, fb_segment, fb_weights = _segment_race_tl(
                    p, segment, state, fb_total, fb_exp, fb_segment, fb_weights, FAST_LOG)
            fb_key = fb_total / fb_exp
            fb_top = tl.max(fb_key, axis=0)
            fb_token = _segment_pick_tl(fb_weights, fb_segment, state)
            token = tl.where(fb_top > 0, tl.min(tl.where(fb_key == fb_top, fb_token, vocab), axis=0), 0)
            token = token.to(tl.int64)
        token = tl.minimum(tl.maximum(token, 0), vocab - 1)  # non-finite rows: stay in [0, V)

    out = tl.where(i < j, draft, -1)
    out = tl.where(i == j, token, out)
    tl.store(out_ptr + b * (k + 1) + i, out.to(out_ptr.dtype.element_ty), mask=in_rows)
    if WITH_LOGPROBS:
        emitted = in_rows & (out != -1)
        safe_out = tl.minimum(tl.maximum(tl.where(emitted, out, 0), 0), vocab - 1)  # never read out of bounds
        x_out = tl.load(t_row + i64 * t_stride_i + safe_out, mask=emitted, other=0.0).to(tl.float32)
        z_out = x_out / t
        e_out = tl.exp(z_out - m)
        kept = (_order_key_tl(z_out) >= tau) & (e_out >= min_e)
        logprob = tl.where(kept, (z_out - m) - tl.log(mass), float("-inf"))
        logprob = tl.where(greedy, 0.0, logprob)
        tl.store(logprobs_ptr + b * (k + 1) + i, tl.where(emitted, logprob, 0.0), mask=in_rows)
    if COUNT:
        add_counters_tl(counters_ptr, num_accepted, (j + 1).to(tl.int64), k)

@triton.jit
def _draft_kernel(
    logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, position_ptr, out_ptr, probs_ptr,
    scratch_ptr, vocab, logits_stride, temperature_stride, top_k_stride, top_p_stride, min_p_stride, seed_stride,
    position_stride, probs_stride,
    WITH_PROBS: tl.constexpr, BLOCK_V: tl.constexpr, SEARCH_BLOCK: tl.constexpr, NUM_PROBES: tl.constexpr,
    CAP: tl.constexpr, FAST_LOG: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperature_ptr + r * temperature_stride)
    greedy = ~(temperature > 0)
    t = tl.where(greedy, 1.0, temperature)
    top_k = tl.load(top_k_ptr + r * top_k_stride).to(tl.int64)
    top_p = tl.load(top_p_ptr + r * top_p_stride)
    min_e = _min_e_tl(tl.load(min_p_ptr + r * min_p_stride))
    row = logits_ptr + r * logits_stride
    m, tau, mass, argmax = _row_stats_tl(row, scratch_ptr + r * CAP, vocab, temperature, top_k, top_p, min_e,
                                         BLOCK_V, SEARCH_BLOCK, NUM_PROBES, CAP)
    state = _row_state_tl(tl.load(seed_ptr + r * seed_stride), tl.load(position_ptr + r * position_stride),
                          tl.zeros([], tl.int32) + 1)  # purpose DRAFT
    token = argmax.to(tl.int64)
    probs_row = probs_ptr + r * probs_stride
    if ~greedy:
        best_key = tl.full([BLOCK_V], float("-inf"), tl.float32)
        best_idx = tl.full([BLOCK_V], 0, tl.int32) + vocab
        for v0 in range(0, vocab, BLOCK_V):
            v = v0 + tl.arange(0, BLOCK_V)
            in_row = v < vocab
            z = tl.load(row + v, mask=in_row, other=float("-inf")).to(tl.float32) / t
            e = tl.exp(z - m)
            kept = in_row & (_order_key_tl(z) >= tau) & (e >= min_e)
            key = z - _log_tl(_exponential_tl(_draw_bits_tl(state, v), FAST_LOG), FAST_LOG)
            better = kept & ((key > best_key) | (best_idx == vocab))
            best_key = tl.where(better, key, best_key)
            best_idx = tl.where(better, v, best_idx)
            if WITH_PROBS:
                tl.store(probs_row + v, tl.where(kept, e / mass, 0.0), mask=in_row)
        top = tl.max(best_key, axis=0)
        token = tl.min(tl.where((best_key == top) & (best_idx < vocab), best_idx, vocab), axis=0).to(tl.int64)
        token = tl.where(token < vocab, token, 0)
    else:
        if WITH_PROBS:
            for v0 in range(0, vocab, BLOCK_V):
                v = v0 + tl.arange(0, BLOCK_V)
                tl.store(probs_row + v, tl.where(v == token, 1.0, 0.0), mask=v < vocab)
    tl.store(out_ptr + r, token)


def _gather_cap(device, gather_cap):
    # The interpreter's sort is slow; its small cap also makes the CPU tests run both the gather and the full search.
    return gather_cap or (_GATHER_CAP if device.type == "cuda" else 32)


def _launch_rejection(target_logits, draft_token_ids, draft_probs, draft_logits, temperature, top_k, top_p, min_p,
                      seeds, offsets, block_verification, counters, with_logprobs, block_v=None, gather_cap=None):
    batch, k = draft_token_ids.shape
    vocab = target_logits.shape[2]
    device = target_logits.device
    out = torch.empty((batch, k + 1), dtype=draft_token_ids.dtype, device=device)
    logprobs = torch.empty((batch, k + 1), dtype=torch.float32, device=device) if with_logprobs else None
    if batch == 0:
        return out, logprobs
    block_v = block_v or min(_BLOCK_V, max(16, triton.next_power_of_2(vocab)))
    search_block = min(_SEARCH_BLOCK, block_v)
    has_logits = draft_logits is not None
    has_probs = draft_probs is not None
    num_rows = k + 1 + (k if has_logits else 0)
    stats = torch.empty((batch, num_rows, 4), dtype=torch.int32, device=device)
    cap = _gather_cap(device, gather_cap)
    scratch = torch.empty((batch * num_rows, cap), dtype=torch.float32, device=device)
    _row_stats_kernel[(batch, num_rows)](
        target_logits, draft_logits if has_logits else target_logits, temperature, top_k, top_p, min_p, stats,
        scratch,
        k, vocab, target_logits.stride(0), target_logits.stride(1),
        draft_logits.stride(0) if has_logits else 0, draft_logits.stride(1) if has_logits else 0,
        temperature.stride(0), top_k.stride(0), top_p.stride(0), min_p.stride(0),
        HAS_DRAFT_LOGITS=has_logits, BLOCK_V=block_v, SEARCH_BLOCK=search_block, NUM_PROBES=_NUM_PROBES,
        CAP=cap, num_warps=_NUM_WARPS,
    )
    q = draft_probs if has_probs else (draft_logits if has_logits else target_logits)
    _verify_kernel[(batch,)](
        target_logits, draft_token_ids, q, temperature, min_p, seeds, offsets, stats,
        out, logprobs if with_logprobs else stats, counters if counters is not None else out,
        k, vocab, num_rows,
        target_logits.stride(0), target_logits.stride(1), draft_token_ids.stride(0),
        q.stride(0) if (has_probs or has_logits) else 0, q.stride(1) if (has_probs or has_logits) else 0,
        temperature.stride(0), min_p.stride(0), seeds.stride(0), offsets.stride(0),
        HAS_DRAFT_PROBS=has_probs, HAS_DRAFT_LOGITS=has_logits, BLOCK=bool(block_verification),
        WITH_LOGPROBS=with_logprobs, COUNT=counters is not None, BLOCK_K=triton.next_power_of_2(k + 1),
        BLOCK_V=block_v, FAST_LOG=out.is_cuda, num_warps=_NUM_WARPS,
    )
    return out, logprobs


def _rejection_triton(target_logits, draft_token_ids, draft_probs, draft_logits, temperature, top_k, top_p, min_p,
                      seeds, offsets, block_verification=False):
    check_rejection_inputs(target_logits, draft_token_ids, draft_probs, draft_logits, temperature, top_k, top_p,
                           min_p, seeds, offsets)
    return _launch_rejection(target_logits, draft_token_ids, draft_probs, draft_logits, temperature, top_k, top_p,
                             min_p, seeds, offsets, block_verification, None, False)[0]


def _rejection_counted_triton(target_logits, draft_token_ids, draft_probs, draft_logits, temperature, top_k, top_p,
                              min_p, seeds, offsets, block_verification, counters):
    check_rejection_inputs(target_logits, draft_token_ids, draft_probs, draft_logits, temperature, top_k, top_p,
                           min_p, seeds, offsets, counters)
    return _launch_rejection(target_logits, draft_token_ids, draft_probs, draft_logits, temperature, top_k, top_p,
                             min_p, seeds, offsets, block_verification, counters, False)[0]


def _rejection_logprobs_triton(target_logits, draft_token_ids, draft_probs, draft_logits, temperature, top_k, top_p,
                               min_p, seeds, offsets, block_verification=False):
    check_rejection_inputs(target_logits, draft_token_ids, draft_probs, draft_logits, temperature, top_k, top_p,
                           min_p, seeds, offsets)
    return _launch_rejection(target_logits, draft_token_ids, draft_probs, draft_logits, temperature, top_k, top_p,
                             min_p, seeds, offsets, block_verification, None, True)


def _rejection_logprobs_counted_triton(target_logits, draft_token_ids, draft_probs, draft_logits, temperature, top_k,
                                       top_p, min_p, seeds, offsets, block_verification, counters):
    check_rejection_inputs(target_logits, draft_token_ids, draft_probs, draft_logits, temperature, top_k, top_p,
                           min_p, seeds, offsets, counters)
    return _launch_rejection(target_logits, draft_token_ids, draft_probs, draft_logits, temperature, top_k, top_p,
                             min_p, seeds, offsets, block_verification, counters, True)


def _launch_draft(logits, temperature, top_k, top_p, min_p, seeds, positions, probs, block_v=None, gather_cap=None):
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    block_v = block_v or min(_BLOCK_V, max(16, triton.next_power_of_2(vocab)))
    with_probs = probs is not None
    cap = _gather_cap(logits.device, gather_cap)
    scratch = torch.empty((rows, cap), dtype=torch.float32, device=logits.device)
    _draft_kernel[(rows,)](
        logits, temperature, top_k, top_p, min_p, seeds, positions, out, probs if with_probs else out, scratch,
        vocab, logits.stride(0), temperature.stride(0), top_k.stride(0), top_p.stride(0), min_p.stride(0),
        seeds.stride(0), positions.stride(0), probs.stride(0) if with_probs else 0,
        WITH_PROBS=with_probs, BLOCK_V=block_v, SEARCH_BLOCK=min(_SEARCH_BLOCK, block_v), NUM_PROBES=_NUM_PROBES,
        CAP=cap, FAST_LOG=out.is_cuda, num_warps=_NUM_WARPS,
    )
    return out


def _draft_triton(logits, temperature, top_k, top_p, min_p, seeds, positions):
    check_draft_inputs(logits, temperature, top_k, top_p, min_p, seeds, positions)
    return _launch_draft(logits, temperature, top_k, top_p, min_p, seeds, positions, None)


def _draft_with_probs_triton(logits, temperature, top_k, top_p, min_p, seeds, positions, probs):
    check_draft_inputs(logits, temperature, top_k, top_p, min_p, seeds, positions, probs)
    return _launch_draft(logits, temperature, top_k, top_p, min_p, seeds, positions, probs)


register_cuda("rejection_sample_logits", _rejection_triton)
register_cuda("rejection_sample_logits.counted", _rejection_counted_triton)
register_cuda("rejection_sample_logits.logprobs", _rejection_logprobs_triton)
register_cuda("rejection_sample_logits.logprobs_counted", _rejection_logprobs_counted_triton)
register_cuda("sample_draft_filtered", _draft_triton)
register_cuda("sample_draft_filtered.with_probs", _draft_with_probs_triton)

"""Triton CUDA kernels of `specdec::rejection_sample_logits` and `specdec::sample_draft_filtered`.

The contract is specdec_ops/ops/logits_sampling.py. No probability tensor is written: per logit row the kernels
keep four numbers, the max m of z = x / T, the threshold tau of the kept set (an order key of z: float32 bits mapped
to int32 so that integer order is float order, -0.0 with +0.0), the kept mass S and the argmax, and recompute a
probability exp(z - m) / S where they need one.

Every pass splits a row's V into chunks, a grid from the shapes and the SM count only (kernels/geometry.py
LOGITS_SAMPLING). The statistics and filter passes use chunks of a fixed length, each chunk's partial computed from
that chunk alone and the partials combined in chunk order, so a row's sums are the same whatever batch it is in
(batch invariance); a program takes several consecutive chunks when the batch alone fills the GPU (a grid of
(rows, programs per row)), which changes who computes a partial, not its value. The race passes, whose winners are
exact maxima, take more chunks when the batch is small (a grid of (rows, chunks)). The programs of a row meet
through its words in the persistent zeroed scratch (kernels/scratch.py): an atomic ticket (kernels/ticket.py)
elects the row's last program, which combines the others' results in chunk order and leaves the words at 0 (no
memset; graph-capturable, no host sync).

1. `_stats_kernel`: each chunk's max of x, its sum of exp((x - max) / T) (one exponential per entry) and its
   argmax (on the GPU's one-block chunks, the sum for a random row only and the argmax for a greedy row only:
   the pass is issue-bound); for a row with top-k or top-p on, also a histogram in bins of width 1 / bin_scale
   below its maximum (tl.histogram) of the maxima of its groups of hist_group consecutive x (counts at most the
   entries' own, so the bounds below stay bounds; 1 / hist_group of the histogram's work). On the GPU a chunk is one
   block, read once into registers (the histogram too), and the loop over a program's chunks is pipelined; a chunk
   of several blocks (as tests force) keeps an online sum and reads the chunk again for the histogram. The last
   program: m = max(x) / T (the division rounds monotonically), S, the argmax (lowest index on ties), and for a
   filtered row the lower bound of its candidates: the shallowest bin boundary at which the aligned histograms
   count top_k entries (top-k on), or at which a lower bound of the mass reaches top_p * S (top-p alone); tau
   holds the candidates' floor x_floor, just below that bound in x (float32 bits), until pass 2.
2. `_filter_kernel` (rows no filter touches return at once; run by the statistics pass's last program instead when
   one program covers a row, so that no launch is spent on unfiltered rows; neither runs when the call passes None
   for top_k, top_p and min_p, and with top_k and top_p both None the histograms are compiled out of pass 1): every
   program stores its chunks' logits x >= x_floor (no division per entry), in order by a scan per block (no
   atomics), in a segment of its own (at most CAP) and their count (with geometry sub_block, pass 1 also stores the
   maximum of each sub_block entries of a filtered row, and pass 2 lists the sub-blocks whose maximum reaches x_floor
   and reads only those: the same candidates in the same order); the last program reads the segments as one
   list, divides it, sorts it in registers (tl.sort, tl.cumsum; SMALL_CAP entries when there are that few, else
   CAP: the size is a function of the row alone, and the candidates' order does not matter) and finds tau_k, M_k,
   tau_p and S exactly, ties at the cut-off kept, as the contract says. x / t rounds monotonically in x (the GPU's
   div.full.f32 too: its operand scaling depends on t alone), so the candidates hold every entry whose z exceeds
   z_floor = x_floor / t. The bound is only a guess: the finish checks that the thresholds it found lie above
   z_floor and that the candidates hold the kept set (at least top_k of them, or a mass reaching top_p * M_k); a
   row that fails, or has more than CAP candidates (top-p over a flat distribution), takes the full threshold
   search in that program (`_search_fallback_tl`: passes of NUM_PROBES candidate thresholds over the row until the
   key is exact, then a pass for S). min-p alone needs no search: the chunks' kept masses are summed in chunk
   order.
3. Token-wise verification, `_race_verify_kernel` over (B, chunks): every program evaluates the k accept tests
   (p(x), q(x) from the statistics and one logit each), races its chunk of the rejected/bonus row j with the
   segmented race of specdec_ops/ops/sampling.py and folds its winner (key bits, V-1-token) into the request's
   int64 atomic max; the last program writes the output row, the logprobs and the counters (and redraws from p_j
   when the residual has no positive key, a slow path). With no filter pass the statistics are final in pass 1, so
   its last program of each row also stores p(x_i) (and q(x_i)) at the row's draft token (geometry
   accept_from_statistics): the race programs then read them beside the statistics, one dependent load fewer
   before they know j and can start reading. Block verification first runs `_block_residual_kernel`
   over (B, k - 1 residual rows, programs of several fixed-length chunks): the residual masses R_i as per-chunk
   partials, and the request's last program decides the stop point tau; then the same race kernel draws the token
   at tau from max(w_tau * p - q, 0).
   sample_draft_filtered: passes 1 and 2 over its rows, then `_draft_race_kernel` over (rows, chunks): the Gumbel
   race of each chunk's kept entries (and their probabilities) into the row's atomic max.

Sums are float32 in these kernels' orders, deterministic (chunk order, no float atomics) and independent of the
batch; exp, log and the float32 division (div.full.f32) come from the GPU, so results equal the reference except
at near-ties (the contract's "Float rounding")."""
from __future__ import annotations

import torch

import triton
import triton.language as tl

from .._library import register_cuda
from ..ops.logits_sampling import check_draft_inputs, check_rejection_inputs

from .counter_hash import draw_bits_tl as _draw_bits_tl
from .counter_hash import exponential_tl as _exponential_tl
from .counter_hash import log_tl as _log_tl
from .counter_hash import row_state_tl as _row_state_tl
from .counters import add_counters_tl
from .geometry import LOGITS_SAMPLING
from .sampling import _segment_block_tl, _segment_pick_tl, _segment_race_start_tl, _segment_race_tl
from .scratch import filter_off_values, sm_count, zeroed_scratch
from .ticket import reset_ticket_tl, take_ticket_tl

@triton.jit
def _order_key_tl(z):
    """int32 key with key(a) < key(b) iff a < b for non-NaN floats (-0.0 and +0.0 share key 0)."""
    bits = z.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return tl.where(key == -1, 0, key)

@triton.jit
def _key_value_tl(key):
    """The float32 whose order key is `key` (int32; key -1, which `_order_key_tl` never gives, is -0.0)."""
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
def _load_candidates_tl(segments_ptr, counts, SIZE: tl.constexpr, CAP: tl.constexpr, BLOCK_P: tl.constexpr):
    """The row's candidates as one list x [SIZE] (-inf past their total, which is at most SIZE): program s of the
    row stored counts[s] of them at segments_ptr [s, 0:counts[s]] (counts [BLOCK_P] int32, 0 past the row's
    programs); candidate j is entry j - start of the segment whose span [start, end) holds j. One [SIZE] vector per
    step (a [SIZE, BLOCK_P] comparison would hold SIZE * BLOCK_P values in registers)."""
    j = tl.arange(0, SIZE)
    each = tl.arange(0, BLOCK_P)
    segment = tl.zeros([SIZE], tl.int32)
    start = tl.zeros([SIZE], tl.int32)
    end = tl.zeros([], tl.int32)
    for s in tl.static_range(BLOCK_P):
        end += tl.sum(tl.where(each == s, counts, 0), axis=0)
        past = j >= end
        segment += past.to(tl.int32)
        start = tl.where(past, end, start)
    return tl.load(segments_ptr + segment.to(tl.int64) * CAP + (j - start), mask=j < end, other=float("-inf"),
                   cache_modifier=".cg")


@triton.jit
def _finish_sorted_tl(x, count, t, m, k_on, top_k, mass_all, p_on, top_p, min_e, x_floor, CAP: tl.constexpr):
    """The exact thresholds and kept mass from `count` (<= CAP) candidate logits x [CAP] (-inf past count), the
    row's x >= x_floor. Returns (tau key int32, S, whether the candidates hold the kept set). They hold every entry
    whose z = x / t exceeds z_floor = x_floor / t (x / t rounds monotonically in x), and some entries at z_floor:
    the thresholds found among them are exact when they lie above z_floor (or x_floor is -inf: every entry is a
    candidate) and the candidates reach the kept set's size (top_k of them with top-k on, else a mass of top_p *
    mass_all). mass_all: the row's mass (M_k with top-k off)."""
    index = tl.arange(0, CAP)
    # The padding is -inf in z (after the division: -inf / +inf would be NaN).
    z = tl.where(index < count, x / t, float("-inf"))
    sorted_z = tl.sort(z, descending=True)
    e = tl.exp(sorted_z - m)  # 0 for the -inf padding
    z_floor = x_floor / t
    every_entry = x_floor == float("-inf")
    tau_k_z = tl.full([], float("-inf"), tl.float32)
    mass_k = mass_all
    enough = count >= 1
    if k_on:
        tau_k_z = tl.max(tl.where(index == top_k - 1, sorted_z, float("-inf")), axis=0)
        mass_k = tl.sum(tl.where(sorted_z >= tau_k_z, e, 0.0), axis=0)
        enough = (count >= top_k) & ((tau_k_z > z_floor) | every_entry)
    tau_z = tau_k_z
    if p_on:
        # The first sorted position whose cumulative mass reaches top_p * M_k; its value is tau_p.
        cumulative = tl.cumsum(e, axis=0)
        first = tl.sum((cumulative < top_p * mass_k).to(tl.int32), axis=0)
        tau_p_z = tl.max(tl.where(index == tl.minimum(first, count - 1), sorted_z, float("-inf")), axis=0)
        # With top-k on, tau_p >= tau_k, which the check above placed above z_floor.
        enough = tl.where(k_on, enough, (first < count) & ((tau_p_z > z_floor) | every_entry))
        tau_z = tl.maximum(tau_z, tau_p_z)
    mass = tl.sum(tl.where((sorted_z >= tau_z) & (e >= min_e), e, 0.0), axis=0)
    return _order_key_tl(tau_z), mass, enough

@triton.jit
def _histogram_tl(x, top_bin, BLOCK_V: tl.constexpr, NUM_BINS: tl.constexpr, BIN_SCALE: tl.constexpr,
                  HIST_GROUP: tl.constexpr):
    """Counts [NUM_BINS] of a block x [BLOCK_V] (-inf past the chunk) in bins of width 1 / BIN_SCALE below top_bin,
    the last bin holding the rest. HIST_GROUP > 1 counts only the maximum of each HIST_GROUP consecutive entries:
    at every level at most the entries' own count, so the bounds built from the counts (lower bounds of the kept
    set's threshold) stay bounds, and near the top, where the cut-offs lie and few entries share a group, about as
    tight, for 1 / HIST_GROUP of the histogram's work."""
    if HIST_GROUP > 1:
        x = tl.max(tl.reshape(x, [BLOCK_V // HIST_GROUP, HIST_GROUP]), axis=1)
    depth = top_bin - tl.floor(x * BIN_SCALE)
    inside = (depth >= 0) & (depth < NUM_BINS - 1)  # NaN and -inf: outside
    return tl.histogram(tl.where(inside, depth, NUM_BINS - 1).to(tl.int32), NUM_BINS)

@triton.jit
def _store_sub_maxima_tl(submax_ptr, x, BLOCK_V: tl.constexpr, SUB_BLOCK: tl.constexpr):
    """The maximum of each SUB_BLOCK consecutive entries of a block x [BLOCK_V] (NaN ignored, -inf past the row) at
    submax_ptr [BLOCK_V / SUB_BLOCK]: the filter pass reads only the sub-blocks whose maximum reaches its floor."""
    tl.store(submax_ptr + tl.arange(0, BLOCK_V // SUB_BLOCK),
             tl.max(tl.reshape(x, [BLOCK_V // SUB_BLOCK, SUB_BLOCK]), axis=1))


@triton.jit
def _exp2_scale_tl(t):
    """s with exp(d / t) = exp2(d * s), at least 1e-30: at t = inf (or past 1e30) s would be 0, and a -inf entry's
    d * s NaN instead of -inf (exp2: 0); 1e-30 keeps every finite d * s at about 0 (exp2: 1), the uniform
    distribution that z = x / inf gives."""
    return tl.maximum(1.4426950408889634 / t, 1e-30)


@triton.jit
def _chunk_stats_tl(row_ptr, start, end, vocab, t, hist_ptr, submax_ptr, filtered,
                    BLOCK_V: tl.constexpr, NUM_STAGES: tl.constexpr, NUM_BINS: tl.constexpr,
                    BIN_SCALE: tl.constexpr, HIST_GROUP: tl.constexpr, SUB_BLOCK: tl.constexpr):
    """One chunk [start, end) of a logit row: (max x, sum of exp((x - max x) / t), argmax, the max's bin), and with
    `filtered` the chunk's histogram (`_histogram_tl`: of its groups' maxima, bins of width 1 / BIN_SCALE below the
    max's, the last bin holding the rest) stored at hist_ptr [NUM_BINS] int32."""
    scale = _exp2_scale_tl(t)
    best_x = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK_V], 0, tl.int32) + vocab
    lane_sum = tl.zeros([BLOCK_V], tl.float32)
    for v0 in tl.range(start, end, BLOCK_V, num_stages=NUM_STAGES):
        v = v0 + tl.arange(0, BLOCK_V)
        in_chunk = v < end
        x = tl.load(row_ptr + v, mask=in_chunk, other=float("-inf")).to(tl.float32)
        # The lane's max is its argmax's value, so one exponential per entry keeps the online sum: of the
        # entry below the max, or of the old max below a new one (then the sum is rescaled).
        up = x > best_x
        gap = tl.exp2(-tl.abs(x - best_x) * scale)
        lane_sum = tl.where(up, lane_sum * gap + 1.0, lane_sum + gap)
        lane_sum = tl.where(tl.maximum(best_x, x) > float("-inf"), lane_sum, 0.0)  # exp2(NaN) of -inf - -inf
        # A lane visits increasing indices: its first entry, then only strictly larger ones (first index on
        # ties, as torch.argmax).
        better = in_chunk & (up | (best_i == vocab))
        best_x = tl.where(better, x, best_x)
        best_i = tl.where(better, v, best_i)
    top = tl.max(best_x, axis=0)
    argmax = tl.min(tl.where(best_x == top, best_i, vocab), axis=0)
    total = tl.sum(tl.where(best_x > float("-inf"), lane_sum * tl.exp2((best_x - top) * scale), 0.0), axis=0)
    top_bin = tl.floor(top * BIN_SCALE)
    if filtered:
        hist = tl.zeros([NUM_BINS], tl.int32)
        for v0 in tl.range(start, end, BLOCK_V, num_stages=NUM_STAGES):
            v = v0 + tl.arange(0, BLOCK_V)
            x = tl.load(row_ptr + v, mask=v < end, other=float("-inf")).to(tl.float32)
            hist += _histogram_tl(x, top_bin, BLOCK_V, NUM_BINS, BIN_SCALE, HIST_GROUP)
            if SUB_BLOCK > 0:
                _store_sub_maxima_tl(submax_ptr + (v0 - start) // SUB_BLOCK, x, BLOCK_V, SUB_BLOCK)
        tl.store(hist_ptr + tl.arange(0, NUM_BINS), hist)
    return top, total, argmax, top_bin

@triton.jit
def _chunk_stats_block_tl(row_ptr, start, end, vocab, t, hist_ptr, submax_ptr, filtered, is_random,
                          BLOCK_V: tl.constexpr, NUM_BINS: tl.constexpr, BIN_SCALE: tl.constexpr,
                          HIST_GROUP: tl.constexpr, SUB_BLOCK: tl.constexpr, KEEP_IN_L2: tl.constexpr):
    """`_chunk_stats_tl` of a chunk that is one block (end - start <= BLOCK_V), read once: the max, the argmax and
    the sum from the block in registers, and with `filtered` the histogram from the same registers. The pass is
    issue-bound, so each row computes only what its mode reads: a random row the max and the sum (argmax 0), a
    greedy row the max and the argmax (sum 1)."""
    scale = _exp2_scale_tl(t)
    v = start + tl.arange(0, BLOCK_V)
    in_chunk = v < end
    if KEEP_IN_L2:
        # The race pass reads one of these rows again right after this pass: keep them in L2 ahead of other lines.
        x = tl.load(row_ptr + v, mask=in_chunk, other=float("-inf"), eviction_policy="evict_last").to(tl.float32)
    else:
        x = tl.load(row_ptr + v, mask=in_chunk, other=float("-inf")).to(tl.float32)
    top = tl.max(x, axis=0)
    if is_random:
        argmax = tl.zeros([], tl.int32)
        # -inf entries (padding included) give exp2(-inf) = 0 against a finite top; an all -inf chunk subtracts 0
        # instead, which keeps -inf - -inf (NaN) out without a select per entry. A NaN logit makes the sum NaN.
        total = tl.sum(tl.exp2((x - tl.where(top > float("-inf"), top, 0.0)) * scale), axis=0)
    else:
        argmax = tl.min(tl.where(in_chunk & (x == top), v, vocab), axis=0)  # the lowest index on ties
        total = tl.full([], 1.0, tl.float32)
    top_bin = tl.floor(top * BIN_SCALE)
    if filtered:
        tl.store(hist_ptr + tl.arange(0, NUM_BINS), _histogram_tl(x, top_bin, BLOCK_V, NUM_BINS, BIN_SCALE, HIST_GROUP))
        if SUB_BLOCK > 0:
            _store_sub_maxima_tl(submax_ptr, x, BLOCK_V, SUB_BLOCK)
    return top, total, argmax, top_bin


@triton.jit
def _sub_block_ptr_tl(ptr, entry, SUB_BLOCK: tl.constexpr):
    """The slot of the sub-block that holds `entry`, in an array of one slot per SUB_BLOCK entries (ptr itself
    without sub-blocks)."""
    if SUB_BLOCK > 0:
        return ptr + entry // SUB_BLOCK
    return ptr


@triton.jit
def _span_stats_tl(row_ptr, g, c_first, c_last, num_chunks, chunk_len, vocab, t, partial_ptr, hist_ptr,
                   submax_ptr, filtered, is_random, CHUNK_IS_BLOCK: tl.constexpr, BLOCK_V: tl.constexpr,
                   NUM_STAGES: tl.constexpr, NUM_BINS: tl.constexpr, BIN_SCALE: tl.constexpr,
                   HIST_GROUP: tl.constexpr, SUB_BLOCK: tl.constexpr, KEEP_IN_L2: tl.constexpr):
    """Chunks c_first .. c_last - 1 of row g: each chunk's statistics into partial [g, c, 4] (and its histogram
    into hist [g, c, NUM_BINS], with SUB_BLOCK its sub-block maxima into the row's submax_ptr [V / SUB_BLOCK]
    (rounded up to whole chunks)), computed from that chunk alone, so the same whichever program computes it."""
    if CHUNK_IS_BLOCK:
        # One block per chunk: the chunk loop itself is pipelined (the next chunks' loads in flight).
        for c in tl.range(c_first, c_last, num_stages=NUM_STAGES):
            start = c * chunk_len
            slot = g * num_chunks + c
            top, total, argmax, top_bin = _chunk_stats_block_tl(
                row_ptr, start, tl.minimum(start + chunk_len, vocab), vocab, t, hist_ptr + slot * NUM_BINS,
                _sub_block_ptr_tl(submax_ptr, start, SUB_BLOCK), filtered, is_random, BLOCK_V, NUM_BINS,
                BIN_SCALE, HIST_GROUP, SUB_BLOCK, KEEP_IN_L2)
            _store_partial_tl(partial_ptr + slot * 4, top, total, argmax, top_bin)
    else:
        for c in range(c_first, c_last):
            start = c * chunk_len
            slot = g * num_chunks + c
            top, total, argmax, top_bin = _chunk_stats_tl(
                row_ptr, start, tl.minimum(start + chunk_len, vocab), vocab, t, hist_ptr + slot * NUM_BINS,
                _sub_block_ptr_tl(submax_ptr, start, SUB_BLOCK), filtered, BLOCK_V, NUM_STAGES, NUM_BINS,
                BIN_SCALE, HIST_GROUP, SUB_BLOCK)
            _store_partial_tl(partial_ptr + slot * 4, top, total, argmax, top_bin)


@triton.jit
def _store_partial_tl(partial_ptr, top, total, argmax, top_bin):
    which = tl.arange(0, 4)
    partial = tl.where(which == 0, top.to(tl.int32, bitcast=True),
                       tl.where(which == 1, total.to(tl.int32, bitcast=True),
                                tl.where(which == 2, argmax, top_bin.to(tl.int32, bitcast=True))))
    tl.store(partial_ptr + which, partial)


@triton.jit
def _anchored_top_k_bound_tl(hist_ptr, bins, in_row, top_k, NUM_BINS: tl.constexpr, BLOCK_C: tl.constexpr):
    """A bin level at or below the top_k-th largest x of a row whose histogram aligned on its top bin does not
    reach top_k (an outlier maximum far above the rest, as a token's own tied embedding gives random weights):
    the histograms aligned instead on the q-th highest chunk top bin, q = 2, 4, .., 32. Counts are lower bounds
    (entries past a chunk's 63 bins are not counted), so a level whose count reaches top_k is at most the
    top_k-th largest; the highest such level, or -inf. hist_ptr: the row's [num_chunks, NUM_BINS] histograms;
    bins [BLOCK_C]: the chunks' top bins."""
    chunk = tl.arange(0, BLOCK_C)
    depth = tl.arange(0, NUM_BINS)
    finite = in_row & (bins > float("-inf")) & (bins < float("inf"))  # NaN compares false
    ordered = tl.sort(tl.where(finite, bins, float("-inf")), descending=True)
    rows = hist_ptr + chunk[:, None] * NUM_BINS
    best = tl.full([], float("-inf"), tl.float32)
    for a in tl.static_range(1, 6):
        anchor = tl.max(tl.where(chunk == (1 << a) - 1, ordered, float("-inf")), axis=0)
        # Chunk c's bin j holds level bins[c] - j = anchor - (j - shift[c]): above the anchor when j < shift[c],
        # at depth d below it when j = shift[c] + d.
        # (clamped: past NUM_BINS either way every bin is above the anchor, or none reaches it)
        shift = tl.minimum(tl.maximum(tl.where(finite, bins - anchor, 0.0), -NUM_BINS), NUM_BINS).to(tl.int32)
        source = depth[None, :] + shift[:, None]
        anchored = finite & (tl.zeros([BLOCK_C], tl.float32) + anchor > float("-inf"))  # a tensor & (interpreter)
        exact = anchored[:, None] & (depth[None, :] < NUM_BINS - 1)
        in_window = exact & (source >= 0) & (source < NUM_BINS - 1)
        at_depth = tl.sum(tl.load(rows + tl.where(in_window, source, 0), mask=in_window, other=0,
                                  cache_modifier=".cg"), axis=0)
        above = tl.sum(tl.sum(tl.load(rows + depth[None, :], mask=exact & (depth[None, :] < shift[:, None]), other=0,
                                      cache_modifier=".cg"), axis=1), axis=0)
        reached = above + tl.cumsum(at_depth, axis=0) >= top_k
        shallowest = tl.min(tl.where(reached, depth, NUM_BINS), axis=0)
        level = tl.where(shallowest < NUM_BINS, anchor - shallowest.to(tl.float32), float("-inf"))
        best = tl.maximum(best, level)
    return best


@triton.jit
def _stats_kernel(
    target_ptr, draft_logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, stats_ptr, partial_ptr, hist_ptr,
    ticket_ptr, candidates_ptr, counts_ptr, kept_mass_ptr, workspace_ptr,
    submax_ptr,  # [rows, num_chunks * chunk_len / SUB_BLOCK] float32: the sub-block maxima (SUB_BLOCK only)
    subs_ptr,  # [rows, num_chunks * chunk_len / SUB_BLOCK] int32: the filter pass's list of sub-blocks (SUB_BLOCK)
    draft_ids_ptr,  # [B, k] int32/int64, row stride draft_ids_stride (AT_DRAFT only)
    q_ptr,  # [B, k, V] float32 draft probabilities, strides (q_stride_b, q_stride_i, 1) (AT_DRAFT and HAS_DRAFT_PROBS)
    at_draft_ptr,  # [rows, 2] float32 out (AT_DRAFT): a row's processed probability at its position's draft token
    k, vocab, chunk_len, num_chunks,
    chunks_per_program, rows_per_request, t_stride_b, t_stride_i, d_stride_b, d_stride_i, temperature_stride,
    top_k_stride, top_p_stride, min_p_stride, draft_ids_stride, q_stride_b, q_stride_i,
    HAS_DRAFT_LOGITS: tl.constexpr, CHUNK_IS_BLOCK: tl.constexpr, BLOCK_V: tl.constexpr, NUM_STAGES: tl.constexpr,
    NUM_BINS: tl.constexpr, BIN_SCALE: tl.constexpr, HIST_GROUP: tl.constexpr, BLOCK_C: tl.constexpr,
    FUSED_FILTER: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr, NUM_PROBES: tl.constexpr, CAP: tl.constexpr, SMALL_CAP: tl.constexpr,
    GATHER_BLOCK: tl.constexpr, GATHER_RUN: tl.constexpr, FILTERS: tl.constexpr, SUB_BLOCK: tl.constexpr,
    KEEP_IN_L2: tl.constexpr, AT_DRAFT: tl.constexpr, HAS_DRAFT_PROBS: tl.constexpr,
):
    """Row g = b * rows_per_request + r (target row r <= k, else draft row r - k - 1), program p: the statistics of
    chunks p * chunks_per_program .. (p + 1) * chunks_per_program - 1 (of num_chunks, each chunk_len entries) into
    partial [g, c, 4] (and their histograms into hist [g, c, NUM_BINS] for a row that top-k or top-p filters); the
    row's last program combines them in chunk order into stats [g] = (m, tau, S, argmax): tau is -inf's key, or for
    a filtered row the filter pass's candidate floor in x (float32 bits), a lower bound of the kept set's logits;
    with one-block chunks S holds only for a random row and the argmax only for a greedy row, the one each reads.
    FUSED_FILTER: that program then runs the filter pass over the whole row itself (no `_filter_kernel` launch).
    FILTERS: top_k or top_p was given (else no row is filtered, and the histograms are compiled out). SUB_BLOCK > 0:
    a filtered row's maxima of its SUB_BLOCK-entry sub-blocks go to submax, and the filter pass reads only the
    sub-blocks whose maximum reaches its floor. AT_DRAFT (no filter pass: the statistics are final): the last
    program of target row i < k also stores p(x_i) (and q(x_i) read from q_ptr, HAS_DRAFT_PROBS) in at_draft [g],
    and that of draft row i stores q(x_i), the values the verification's accept tests read."""
    g = tl.program_id(0).to(tl.int64)
    num_programs = tl.num_programs(1)
    c_first = tl.program_id(1) * chunks_per_program
    c_last = tl.minimum(c_first + chunks_per_program, num_chunks)
    b = g // rows_per_request
    r = g % rows_per_request
    temperature = tl.load(temperature_ptr + b * temperature_stride)
    is_random = temperature > 0
    t = tl.where(is_random, temperature, 1.0)
    top_k = tl.load(top_k_ptr + b * top_k_stride).to(tl.int64)
    top_p = tl.load(top_p_ptr + b * top_p_stride)
    k_on = (top_k > 0) & (top_k < vocab)
    filtered = is_random & (k_on | (top_p < 1.0)) & FILTERS
    row_submax = _sub_block_ptr_tl(submax_ptr, g * num_chunks * chunk_len, SUB_BLOCK)
    if AT_DRAFT:
        # Every program loads the row's logit (and q) at its draft token before reading its chunks, so that whichever
        # program turns out last has them at hand: the loads overlap the chunks' instead of trailing the pass.
        position = tl.where(r <= k, r, r - k - 1)  # target row r, or draft row r - k - 1; k: the bonus row
        draft = tl.load(draft_ids_ptr + b * draft_ids_stride + position, mask=position < k, other=-1).to(tl.int64)
        valid = (draft >= 0) & (draft < vocab)
        safe = tl.where(valid, draft, 0)
        if r <= k:  # (the draft logits' dtype may differ from the target's)
            x_at = tl.load(target_ptr + b * t_stride_b + r * t_stride_i + safe, mask=valid, other=0.0).to(tl.float32)
        else:
            x_at = tl.load(draft_logits_ptr + b * d_stride_b + position * d_stride_i + safe, mask=valid,
                           other=0.0).to(tl.float32)
        q_x = tl.zeros([], tl.float32)
        if HAS_DRAFT_PROBS:
            q_x = tl.load(q_ptr + b * q_stride_b + position * q_stride_i + safe, mask=valid & (r < k),
                          other=0.0).to(tl.float32)
    if r <= k:
        _span_stats_tl(target_ptr + b * t_stride_b + r * t_stride_i, g, c_first, c_last, num_chunks, chunk_len, vocab,
                       t, partial_ptr, hist_ptr, row_submax, filtered, is_random, CHUNK_IS_BLOCK, BLOCK_V, NUM_STAGES,
                       NUM_BINS, BIN_SCALE, HIST_GROUP, SUB_BLOCK, KEEP_IN_L2)
    else:
        _span_stats_tl(draft_logits_ptr + b * d_stride_b + (r - k - 1) * d_stride_i, g, c_first, c_last, num_chunks,
                       chunk_len, vocab, t, partial_ptr, hist_ptr, row_submax, filtered, is_random, CHUNK_IS_BLOCK,
                       BLOCK_V, NUM_STAGES, NUM_BINS, BIN_SCALE, HIST_GROUP, SUB_BLOCK, KEEP_IN_L2)
    tl.debug_barrier()  # every thread's partials and histograms are stored before the ticket publishes them
    if take_ticket_tl(ticket_ptr + g) == num_programs - 1:
        reset_ticket_tl(ticket_ptr + g)
        chunk = tl.arange(0, BLOCK_C)
        in_row = chunk < num_chunks
        base = partial_ptr + (g * num_chunks + chunk) * 4
        tops = tl.load(base, mask=in_row, other=-8388608, cache_modifier=".cg").to(tl.float32, bitcast=True)
        totals = tl.load(base + 1, mask=in_row, other=0, cache_modifier=".cg").to(tl.float32, bitcast=True)
        argmaxes = tl.load(base + 2, mask=in_row, other=0, cache_modifier=".cg")
        top = tl.max(tops, axis=0)
        argmax = tl.minimum(tl.min(tl.where(in_row & (tops == top), argmaxes, vocab), axis=0), vocab - 1)
        scale = _exp2_scale_tl(t)
        mass = tl.sum(tl.where(tops > float("-inf"), totals * tl.exp2((tops - top) * scale), 0.0), axis=0)
        m = top / t  # max(x / t) = max(x) / t: the division rounds monotonically
        tau = tl.full([], -2139095041, tl.int32)  # the order key of -inf: every non-NaN entry is at or above
        if filtered:
            # The chunks' histograms, aligned on the row's top bin: counts of x >= (top bin - d) / BIN_SCALE
            # (lower bounds where a chunk's bins stop short). The candidates' bound is the shallowest depth
            # whose count reaches top_k (top-k on), or whose mass (bounded below) reaches top_p of the row's.
            bins = tl.load(base + 3, mask=in_row, other=-8388608, cache_modifier=".cg").to(tl.float32, bitcast=True)
            row_bin = tl.max(tl.where(bins == bins, bins, float("-inf")), axis=0)
            depth = tl.arange(0, NUM_BINS)
            source = depth[None, :] - (row_bin - bins)[:, None]
            aligned = in_row[:, None] & (source >= 0) & (source < NUM_BINS - 1) & (depth[None, :] < NUM_BINS - 1)
            counts = tl.sum(tl.load(hist_ptr + (g * num_chunks + chunk)[:, None] * NUM_BINS
                                    + tl.where(aligned, source, 0).to(tl.int64), mask=aligned, other=0,
                                    cache_modifier=".cg"), axis=0)
            if k_on:
                reached = tl.cumsum(counts, axis=0) >= top_k
            else:
                # An entry at depth d has e > exp(-(d + 1) / (BIN_SCALE * t)).
                floor_e = tl.exp2(-(depth + 1).to(tl.float32) * (scale / BIN_SCALE))
                reached = tl.cumsum(counts.to(tl.float32) * floor_e, axis=0) >= top_p * mass
            shallowest = tl.min(tl.where(reached, depth, NUM_BINS), axis=0)
            bound_x = (row_bin - shallowest.to(tl.float32)) / BIN_SCALE
            ok = (shallowest < NUM_BINS) & (row_bin > float("-inf")) & (row_bin < float("inf"))
            if BLOCK_C > 1:  # a row of one chunk has no other top bin to anchor on
                if k_on & ~ok:
                    bound_x = _anchored_top_k_bound_tl(hist_ptr + g * num_chunks * NUM_BINS, bins, in_row, top_k,
                                                       NUM_BINS, BLOCK_C) / BIN_SCALE
                    ok = bound_x > float("-inf")
            # The filter pass's floor in x, stored as float32 bits: just below the bound, so that entries at the
            # bound's own z (integer logits meet a bin boundary) are candidates and the cut-off lies above z_floor.
            x_floor = tl.where(ok, bound_x - (tl.abs(bound_x) * 9.5367431640625e-07 + 7.888609052210118e-31),
                               float("-inf"))  # 2^-20 of the bound, and 2^-100 at a bound of 0
            tau = x_floor.to(tl.int32, bitcast=True)
        _store_stats_tl(stats_ptr + g * 4, m, tau, mass, argmax)
        if AT_DRAFT:
            # As _accept_tests_tl computes them from the stored statistics, bit for bit (the bonus row stores none).
            p_x = tl.where(valid, _prob_tl(x_at, t, m, tau, mass,
                                           _min_e_tl(tl.load(min_p_ptr + b * min_p_stride))), 0.0)
            tl.store(at_draft_ptr + g * 2 + tl.arange(0, 2), tl.where(tl.arange(0, 2) == 0, p_x, q_x),
                     mask=tl.zeros([2], tl.int32) + position < k)
        if FUSED_FILTER:
            tl.debug_barrier()  # the statistics are stored before the filter pass reads them
            min_e = _min_e_tl(tl.load(min_p_ptr + b * min_p_stride))
            # As the row's one program: one segment per row (rows * CAP of the [rows, programs, CAP] candidates).
            _filter_row_tl(target_ptr, draft_logits_ptr, g, b, r, 0, 1, 0, num_chunks, num_chunks, chunk_len,
                           vocab, temperature, top_k, top_p, min_e, stats_ptr, candidates_ptr, counts_ptr,
                           kept_mass_ptr, workspace_ptr, submax_ptr, subs_ptr, k, t_stride_b, t_stride_i, d_stride_b,
                           d_stride_i, BLOCK_V, NUM_STAGES, SEARCH_BLOCK, NUM_PROBES, CAP, SMALL_CAP, BLOCK_C,
                           GATHER_BLOCK, GATHER_RUN, SUB_BLOCK)

@triton.jit
def _run_of_8_tl(x):
    """x [N] as 8 tensors [N / 8]: entry j of each run of 8 consecutive entries (tl.split keeps a split's halves in
    one thread, so each thread holds whole runs)."""
    pairs_0, pairs_1 = tl.split(x.reshape([x.shape[0] // 2, 2]))
    quads_0, quads_2 = tl.split(pairs_0.reshape([x.shape[0] // 4, 2]))
    quads_1, quads_3 = tl.split(pairs_1.reshape([x.shape[0] // 4, 2]))
    x0, x4 = tl.split(quads_0.reshape([x.shape[0] // 8, 2]))
    x2, x6 = tl.split(quads_2.reshape([x.shape[0] // 8, 2]))
    x1, x5 = tl.split(quads_1.reshape([x.shape[0] // 8, 2]))
    x3, x7 = tl.split(quads_3.reshape([x.shape[0] // 8, 2]))
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _store_candidate_tl(segment_ptr, x, candidate, position, CAP: tl.constexpr):
    tl.store(segment_ptr + position, x, mask=candidate & (position < CAP))


@triton.jit
def _gather_span_tl(row_ptr, start, end, x_floor, segment_ptr, CAP: tl.constexpr, GATHER_BLOCK: tl.constexpr,
                    GATHER_RUN: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Stores the logits x >= x_floor of [start, end) at segment_ptr [0:CAP], in order, and returns how many there
    are (those past CAP are counted, not stored). No atomics, no wait on memory inside the loop. GATHER_RUN 8: a
    thread holds runs of 8 consecutive entries, so an entry's position is its run's offset (one scan over the runs'
    counts) plus the candidates before it in its run (adds in registers); GATHER_RUN 1: one scan over the block."""
    count = tl.zeros([], tl.int32)
    for v0 in tl.range(start, end, GATHER_BLOCK, num_stages=NUM_STAGES):
        v = v0 + tl.arange(0, GATHER_BLOCK)
        # Padding loads as NaN, which compares false with any floor (-inf included); so does a NaN logit.
        x = tl.load(row_ptr + v, mask=v < end, other=float("nan")).to(tl.float32)
        if GATHER_RUN == 8:
            x0, x1, x2, x3, x4, x5, x6, x7 = _run_of_8_tl(x)
            c0 = x0 >= x_floor
            c1 = x1 >= x_floor
            c2 = x2 >= x_floor
            c3 = x3 >= x_floor
            c4 = x4 >= x_floor
            c5 = x5 >= x_floor
            c6 = x6 >= x_floor
            c7 = x7 >= x_floor
            p1 = c0.to(tl.int32)
            p2 = p1 + c1.to(tl.int32)
            p3 = p2 + c2.to(tl.int32)
            p4 = p3 + c3.to(tl.int32)
            p5 = p4 + c4.to(tl.int32)
            p6 = p5 + c5.to(tl.int32)
            p7 = p6 + c6.to(tl.int32)
            in_run = p7 + c7.to(tl.int32)
            base = count + tl.cumsum(in_run, axis=0) - in_run
            _store_candidate_tl(segment_ptr, x0, c0, base, CAP)
            _store_candidate_tl(segment_ptr, x1, c1, base + p1, CAP)
            _store_candidate_tl(segment_ptr, x2, c2, base + p2, CAP)
            _store_candidate_tl(segment_ptr, x3, c3, base + p3, CAP)
            _store_candidate_tl(segment_ptr, x4, c4, base + p4, CAP)
            _store_candidate_tl(segment_ptr, x5, c5, base + p5, CAP)
            _store_candidate_tl(segment_ptr, x6, c6, base + p6, CAP)
            _store_candidate_tl(segment_ptr, x7, c7, base + p7, CAP)
            count += tl.sum(in_run, axis=0)
        else:
            candidate = (x >= x_floor).to(tl.int32)
            position = count + tl.cumsum(candidate, axis=0) - candidate
            tl.store(segment_ptr + position, x, mask=(candidate > 0) & (position < CAP))
            count += tl.sum(candidate, axis=0)
    return count

@triton.jit
def _gather_sub_blocks_tl(row_ptr, submax_ptr, subs_ptr, start, end, x_floor, segment_ptr, CAP: tl.constexpr,
                          GATHER_BLOCK: tl.constexpr, SUB_BLOCK: tl.constexpr):
    """`_gather_span_tl` from the sub-block maxima: only the SUB_BLOCK-entry sub-blocks of [start, end) whose
    maximum (submax_ptr, one per sub-block of the row) reaches x_floor can hold a candidate, so their indices are
    listed first, in order, at subs_ptr (the same numbering; this span's slots only), and the logits are read from
    those sub-blocks alone, GATHER_BLOCK / SUB_BLOCK of them per step. Same candidates, same order, same count. A
    sub-block's maximum ignores NaN, so it is at least every entry that can compare >= x_floor."""
    first = start // SUB_BLOCK
    last = tl.cdiv(end, SUB_BLOCK)
    listed = tl.zeros([], tl.int32)
    for s0 in range(first, last, GATHER_BLOCK):
        sub = s0 + tl.arange(0, GATHER_BLOCK)
        # Past the span: NaN, which reaches no floor.
        # .cg: other programs of the row may have stored these (the fused filter), as for the partials.
        maxima = tl.load(submax_ptr + sub, mask=sub < last, other=float("nan"), cache_modifier=".cg")
        reaches = (maxima >= x_floor).to(tl.int32)
        tl.store(subs_ptr + first + listed + tl.cumsum(reaches, axis=0) - reaches, sub, mask=reaches > 0)
        listed += tl.sum(reaches, axis=0)
    tl.debug_barrier()  # the list is stored before any thread reads it
    count = tl.zeros([], tl.int32)
    for i0 in range(0, listed, GATHER_BLOCK // SUB_BLOCK):
        i = i0 + tl.arange(0, GATHER_BLOCK // SUB_BLOCK)
        sub = tl.load(subs_ptr + first + i, mask=i < listed, other=0)
        v = sub[:, None] * SUB_BLOCK + tl.arange(0, SUB_BLOCK)[None, :]
        # Padding loads as NaN, which compares false with any floor (-inf included); so does a NaN logit.
        x = tl.load(row_ptr + v, mask=(i < listed)[:, None] & (v < end), other=float("nan")).to(tl.float32)
        candidate = (x >= x_floor).to(tl.int32)
        in_sub = tl.sum(candidate, axis=1)
        position = (count + tl.cumsum(in_sub, axis=0) - in_sub)[:, None] + tl.cumsum(candidate, axis=1) - candidate
        tl.store(segment_ptr + position, x, mask=(candidate > 0) & (position < CAP))
        count += tl.sum(in_sub, axis=0)
    return count

@triton.jit
def _chunk_kept_mass_tl(row_ptr, start, end, t, m, min_e, BLOCK_V: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Sum of e = exp(z - m) >= min_e over the chunk (min-p alone)."""
    lane = tl.zeros([BLOCK_V], tl.float32)
    for v0 in tl.range(start, end, BLOCK_V, num_stages=NUM_STAGES):
        v = v0 + tl.arange(0, BLOCK_V)
        in_chunk = v < end
        z = tl.load(row_ptr + v, mask=in_chunk, other=float("-inf")).to(tl.float32) / t
        e = tl.exp(z - m)
        lane += tl.where(in_chunk & (e >= min_e), e, 0.0)
    return tl.sum(lane, axis=0)

@triton.jit
def _search_fallback_tl(row_ptr, vocab, t, m, mass_all, k_on, top_k, p_on, top_p, min_e,
                        BLOCK_V: tl.constexpr, SEARCH_BLOCK: tl.constexpr, NUM_PROBES: tl.constexpr):
    """(tau key int32, S) of a row whose kept set the candidates do not hold: the threshold searches run to the
    exact key (no sort, so this rare path stays small code), then one pass sums the kept mass."""
    lo = tl.full([], -2139095041, tl.int64)  # the order key of -inf
    key_m = _order_key_tl(m).to(tl.int64)
    lo_mass = mass_all
    lo_count = tl.zeros([], tl.int32) + vocab
    if k_on:
        lo, lo_mass, lo_count = _search_tl(row_ptr, vocab, t, m, lo, key_m, lo_mass, lo_count, top_k.to(tl.int32),
                                           0.0, False, SEARCH_BLOCK, NUM_PROBES, 0)
    if p_on:
        lo, _, _ = _search_tl(row_ptr, vocab, t, m, lo, key_m, lo_mass, lo_count, 0, top_p * lo_mass, True,
                              SEARCH_BLOCK, NUM_PROBES, 0)
    tau32 = lo.to(tl.int32)
    kept_mass = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, vocab, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)
        in_row = v < vocab
        z = tl.load(row_ptr + v, mask=in_row, other=float("-inf")).to(tl.float32) / t
        e = tl.exp(z - m)
        kept_mass += tl.where(in_row & (_order_key_tl(z) >= tau32) & (e >= min_e), e, 0.0)
    return tau32, tl.sum(kept_mass, axis=0)

@triton.jit
def _span_filter_tl(row_ptr, c_first, c_last, chunk_len, vocab, t, m, x_floor, min_e, searched, segment_ptr,
                    count_ptr, kept_mass_ptr, submax_ptr, subs_ptr, CAP: tl.constexpr, BLOCK_V: tl.constexpr,
                    NUM_STAGES: tl.constexpr, GATHER_BLOCK: tl.constexpr, GATHER_RUN: tl.constexpr,
                    SUB_BLOCK: tl.constexpr):
    """The filter pass over chunks c_first .. c_last - 1 of one row: with top-k or top-p on, their logits x >= x_floor
    into this program's segment of the candidates and their count into count_ptr; else (min-p alone) each chunk's
    kept mass into kept_mass_ptr [c], a sum over that chunk alone."""
    if searched:
        if SUB_BLOCK > 0:
            count = _gather_sub_blocks_tl(row_ptr, submax_ptr, subs_ptr, c_first * chunk_len,
                                          tl.minimum(c_last * chunk_len, vocab), x_floor, segment_ptr, CAP,
                                          GATHER_BLOCK, SUB_BLOCK)
        else:
            count = _gather_span_tl(row_ptr, c_first * chunk_len, tl.minimum(c_last * chunk_len, vocab), x_floor,
                                    segment_ptr, CAP, GATHER_BLOCK, GATHER_RUN, NUM_STAGES)
        tl.store(count_ptr, count)
    else:
        for c in range(c_first, c_last):
            start = c * chunk_len
            tl.store(kept_mass_ptr + c, _chunk_kept_mass_tl(row_ptr, start, tl.minimum(start + chunk_len, vocab), t,
                                                            m, min_e, BLOCK_V, NUM_STAGES))


@triton.jit
def _filter_row_tl(target_ptr, draft_logits_ptr, g, b, r, program, num_programs, c_first, c_last, num_chunks,
                   chunk_len, vocab, temperature, top_k, top_p, min_e, stats_ptr, candidates_ptr, counts_ptr,
                   partial_ptr, workspace_ptr, submax_ptr, subs_ptr, k, t_stride_b, t_stride_i, d_stride_b,
                   d_stride_i, BLOCK_V: tl.constexpr, NUM_STAGES: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
                   NUM_PROBES: tl.constexpr, CAP: tl.constexpr, SMALL_CAP: tl.constexpr, BLOCK_C: tl.constexpr,
                   GATHER_BLOCK: tl.constexpr, GATHER_RUN: tl.constexpr, SUB_BLOCK: tl.constexpr):
    """Chunks c_first .. c_last - 1 of row g's filter pass (program `program` of num_programs; see
    `_filter_kernel`)."""
    k_on = (top_k > 0) & (top_k < vocab)
    p_on = top_p < 1.0
    searched = k_on | p_on
    # The row's statistics load beside the filter parameters, before the branch that needs them.
    m = tl.load(stats_ptr + g * 4).to(tl.float32, bitcast=True)
    lo = tl.load(stats_ptr + g * 4 + 1)
    mass_all = tl.load(stats_ptr + g * 4 + 2).to(tl.float32, bitcast=True)
    if (temperature > 0) & (searched | (min_e > 0)):
        t = temperature
        x_floor = lo.to(tl.float32, bitcast=True)  # a searched row's slot holds the candidates' floor
        segments = candidates_ptr + g * num_programs * CAP
        counts = counts_ptr + g * num_programs
        row_start = g * num_chunks * chunk_len  # the row's first entry in the sub-block arrays' numbering
        row_submax = _sub_block_ptr_tl(submax_ptr, row_start, SUB_BLOCK)
        row_subs = _sub_block_ptr_tl(subs_ptr, row_start, SUB_BLOCK)
        if r <= k:
            _span_filter_tl(target_ptr + b * t_stride_b + r * t_stride_i, c_first, c_last, chunk_len, vocab, t, m,
                            x_floor, min_e, searched, segments + program * CAP, counts + program,
                            partial_ptr + g * num_chunks, row_submax, row_subs, CAP, BLOCK_V, NUM_STAGES,
                            GATHER_BLOCK, GATHER_RUN, SUB_BLOCK)
        else:
            _span_filter_tl(draft_logits_ptr + b * d_stride_b + (r - k - 1) * d_stride_i, c_first, c_last, chunk_len,
                            vocab, t, m, x_floor, min_e, searched, segments + program * CAP, counts + program,
                            partial_ptr + g * num_chunks, row_submax, row_subs, CAP, BLOCK_V, NUM_STAGES,
                            GATHER_BLOCK, GATHER_RUN, SUB_BLOCK)
        tl.debug_barrier()  # every thread's candidates and masses are stored before the ticket publishes them
        if take_ticket_tl(workspace_ptr + g) == num_programs - 1:
            reset_ticket_tl(workspace_ptr + g)
            if searched:
                each = tl.arange(0, BLOCK_C)
                row_counts = tl.load(counts + each, mask=each < num_programs, other=0, cache_modifier=".cg")
                count = tl.sum(row_counts, axis=0)
                # The sort's size follows the row's candidate count (a function of the row alone): few candidates,
                # as top-k over LLM-like rows gives, take the short sort. Past CAP the segments were not all stored.
                tau = lo
                mass = mass_all
                enough = count <= CAP
                if count <= SMALL_CAP:
                    tau, mass, enough = _finish_sorted_tl(_load_candidates_tl(segments, row_counts, SMALL_CAP, CAP,
                                                                              BLOCK_C),
                                                          count, t, m, k_on, top_k, mass_all, p_on, top_p, min_e,
                                                          x_floor, SMALL_CAP)
                elif enough:
                    tau, mass, enough = _finish_sorted_tl(_load_candidates_tl(segments, row_counts, CAP, CAP, BLOCK_C),
                                                          count, t, m, k_on, top_k, mass_all, p_on, top_p, min_e,
                                                          x_floor, CAP)
                if ~enough:
                    if r <= k:
                        tau, mass = _search_fallback_tl(target_ptr + b * t_stride_b + r * t_stride_i, vocab, t, m,
                                                        mass_all, k_on, top_k, p_on, top_p, min_e, BLOCK_V,
                                                        SEARCH_BLOCK, NUM_PROBES)
                    else:
                        tau, mass = _search_fallback_tl(draft_logits_ptr + b * d_stride_b + (r - k - 1) * d_stride_i,
                                                        vocab, t, m, mass_all, k_on, top_k, p_on, top_p, min_e,
                                                        BLOCK_V, SEARCH_BLOCK, NUM_PROBES)
            else:
                chunk = tl.arange(0, BLOCK_C)
                tau = lo
                mass = tl.sum(tl.load(partial_ptr + g * num_chunks + chunk, mask=chunk < num_chunks, other=0.0,
                                      cache_modifier=".cg"), axis=0)
            which = tl.arange(0, 2)
            tl.store(stats_ptr + g * 4 + 1 + which, tl.where(which == 0, tau, mass.to(tl.int32, bitcast=True)))


@triton.jit
def _filter_kernel(
    target_ptr, draft_logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, stats_ptr, candidates_ptr,
    counts_ptr, partial_ptr, workspace_ptr, submax_ptr, subs_ptr, k, vocab, chunk_len, num_chunks, chunks_per_program,
    rows_per_request,
    t_stride_b, t_stride_i, d_stride_b, d_stride_i, temperature_stride, top_k_stride, top_p_stride, min_p_stride,
    HAS_DRAFT_LOGITS: tl.constexpr, BLOCK_V: tl.constexpr, NUM_STAGES: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
    NUM_PROBES: tl.constexpr, CAP: tl.constexpr, SMALL_CAP: tl.constexpr, BLOCK_C: tl.constexpr,
    GATHER_BLOCK: tl.constexpr, GATHER_RUN: tl.constexpr, SUB_BLOCK: tl.constexpr,
):
    """The thresholds of the filtered rows (rows no filter touches return at once). Program p of row g covers
    chunks p * chunks_per_program .. (p + 1) * chunks_per_program - 1: with top-k or top-p on, their logits at or
    above the statistics pass's floor go, in order, to the program's segment candidates [g, p, CAP] and their count
    to counts [g, p]; with min-p alone each chunk's kept mass goes to partial [g, c]. The row's last program sorts
    the candidates and writes the exact tau and S into stats [g]. A row with more than CAP candidates, or whose
    candidates do not hold the kept set, takes the full threshold search in that program."""
    g = tl.program_id(0).to(tl.int64)
    program = tl.program_id(1)
    c_first = program * chunks_per_program
    b = g // rows_per_request
    r = g % rows_per_request
    temperature = tl.load(temperature_ptr + b * temperature_stride)
    top_k = tl.load(top_k_ptr + b * top_k_stride).to(tl.int64)
    top_p = tl.load(top_p_ptr + b * top_p_stride)
    min_e = _min_e_tl(tl.load(min_p_ptr + b * min_p_stride))
    _filter_row_tl(target_ptr, draft_logits_ptr, g, b, r, program, tl.num_programs(1), c_first,
                   tl.minimum(c_first + chunks_per_program, num_chunks), num_chunks, chunk_len, vocab, temperature,
                   top_k, top_p, min_e, stats_ptr, candidates_ptr, counts_ptr, partial_ptr, workspace_ptr,
                   submax_ptr, subs_ptr, k, t_stride_b, t_stride_i, d_stride_b, d_stride_i, BLOCK_V, NUM_STAGES,
                   SEARCH_BLOCK, NUM_PROBES, CAP, SMALL_CAP, BLOCK_C, GATHER_BLOCK, GATHER_RUN, SUB_BLOCK)

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
def _accept_tests_tl(b, target_ptr, draft_ptr, q_ptr, temperature_ptr, min_p_ptr, seed_ptr, offset_ptr, stats_ptr,
                     at_draft_ptr, k, vocab, num_rows, t_stride_b, t_stride_i, draft_stride_b, q_stride_b, q_stride_i,
                     temperature_stride, min_p_stride, seed_stride, offset_stride,
                     HAS_DRAFT_PROBS: tl.constexpr, HAS_DRAFT_LOGITS: tl.constexpr, BLOCK_K: tl.constexpr,
                     AT_DRAFT: tl.constexpr):
    """What both verifiers of request b read first: its sampling parameters and random stream, its rows'
    statistics (target rows 0..k; the draft rows' when HAS_DRAFT_LOGITS, else the target's), its drafts, and per
    position i < k the processed p(x_i), q(x_i), the ACCEPT uniform u_i and whether x_i is the target's argmax.
    Vectors are [BLOCK_K] over the positions i; a draft id outside [0, V) is not valid and reads entry 0.
    AT_DRAFT: p(x_i) and q(x_i) come from at_draft [rows, 2], where the statistics pass stored them (no filter pass),
    which saves a dependent load before the race can start."""
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
    if AT_DRAFT:
        p_x = tl.load(at_draft_ptr + (b * num_rows + i) * 2, mask=in_k, other=0.0)
    else:
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
    if AT_DRAFT & HAS_DRAFT_PROBS:
        q_x = tl.load(at_draft_ptr + (b * num_rows + i) * 2 + 1, mask=in_k, other=0.0)
    elif AT_DRAFT & HAS_DRAFT_LOGITS:
        q_x = tl.load(at_draft_ptr + (b * num_rows + k + 1 + i) * 2, mask=in_k, other=0.0)
    else:
        q_x = _q_block_tl(q_row + i64 * q_stride_i, safe, valid, safe, t, qm, qtau, qmass, min_e,
                          HAS_DRAFT_PROBS, HAS_DRAFT_LOGITS)
    u = (_draw_bits_tl(_row_state_tl(seed, offset + i, i * 0 + 2), i * 0) >> 8).to(tl.float32) \
        * 5.960464477539063e-08  # ACCEPT stream
    matches = valid & (draft == argmax.to(tl.int64))
    return (greedy, t, min_e, seed, offset, i, in_k, m, tau, mass, argmax, draft, valid, qm, qtau, qmass, p_x, q_x,
            u, matches)

@triton.jit
def _store_round_tl(out_ptr, logprobs_ptr, counters_ptr, b, i, k, j, draft, token, num_accepted, t_row, t_stride_i,
                    vocab, greedy, t, m, tau, mass, min_e, WITH_LOGPROBS: tl.constexpr, COUNT: tl.constexpr):
    """Request b's output row (drafts before position j, `token` at j, -1 after), the logprobs of its emitted
    tokens under the processed target rows (0 for a greedy request) and the counters. i, draft, m, tau, mass:
    [BLOCK_K] over the positions; t_row: the request's target logits."""
    in_rows = i <= k
    out = tl.where(i < j, draft, -1)
    out = tl.where(i == j, token, out)
    tl.store(out_ptr + b * (k + 1) + i, out.to(out_ptr.dtype.element_ty), mask=in_rows)
    if WITH_LOGPROBS:
        emitted = in_rows & (out != -1)
        safe_out = tl.minimum(tl.maximum(tl.where(emitted, out, 0), 0), vocab - 1)  # never read out of bounds
        x_out = tl.load(t_row + i.to(tl.int64) * t_stride_i + safe_out, mask=emitted, other=0.0).to(tl.float32)
        z_out = x_out / t
        kept = (_order_key_tl(z_out) >= tau) & (tl.exp(z_out - m) >= min_e)
        logprob = tl.where(kept, (z_out - m) - tl.log(mass), float("-inf"))
        logprob = tl.where(greedy, 0.0, logprob)
        tl.store(logprobs_ptr + b * (k + 1) + i, tl.where(emitted, logprob, 0.0), mask=in_rows)
    if COUNT:
        add_counters_tl(counters_ptr, num_accepted, (j + 1).to(tl.int64), k)

@triton.jit
def _race_row_tl(i, j, k, m, tau, mass, qm, qtau, qmass, draft, valid, seed, offset, t_row, q_row, t_stride_i,
                 q_stride_i):
    """What a race at row j needs: that row's target and draft statistics (picked from the [BLOCK_K] vectors), its
    draft id (-1 at the bonus row or an invalid id), its random stream (RESIDUAL, or BONUS at j == k) and the
    pointers to its target logits and draft row."""
    jm = _pick_tl(m, i, j)
    jtau = _pick_tl(tau, i, j)
    jmass = _pick_tl(mass, i, j)
    jqm = _pick_tl(qm, i, j)
    jqtau = _pick_tl(qtau, i, j)
    jqmass = _pick_tl(qmass, i, j)
    draft_j = tl.max(tl.where((i == j) & valid, draft, -1), axis=0).to(tl.int32)
    state = _row_state_tl(seed, offset + j, tl.where(j < k, 3, 4))  # RESIDUAL or BONUS
    p_race = t_row + j.to(tl.int64) * t_stride_i
    q_race = q_row + j.to(tl.int64) * q_stride_i
    return jm, jtau, jmass, jqm, jqtau, jqmass, draft_j, state, p_race, q_race

@triton.jit
def _draw_from_p_tl(p_race, vocab, t, jm, jtau, jmass, min_e, state, BLOCK_V: tl.constexpr, FAST_LOG: tl.constexpr):
    """A token drawn from the processed target row at p_race by the segmented race (int64; 0 if the row has no
    positive probability): the verifiers' slow path when the residual has no positive key."""
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
    return token.to(tl.int64)

@triton.jit
def _block_weights_tl(i, k, p_x, q_x, valid, BLOCK_K: tl.constexpr):
    """Block verification's weights w_0..w_k, a [BLOCK_K] vector over the positions (w_0 = 1; see the contract)."""
    weights = tl.full([BLOCK_K], 1.0, tl.float32)
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
    return weights

@triton.jit
def _residual_block_tl(p_base, q_base, v, mask, w, t, m, tau, mass, qm, qtau, qmass, draft_j, min_e,
                       HAS_DRAFT_PROBS: tl.constexpr, HAS_DRAFT_LOGITS: tl.constexpr):
    """max(w * p - q, 0) at entries v of a residual row (0 where mask is off)."""
    x = tl.load(p_base + v, mask=mask, other=float("-inf")).to(tl.float32)
    p = tl.where(mask, _prob_tl(x, t, m, tau, mass, min_e), 0.0)
    q = _q_block_tl(q_base, v, mask, draft_j, t, qm, qtau, qmass, min_e, HAS_DRAFT_PROBS, HAS_DRAFT_LOGITS)
    return tl.maximum(w * p - q, 0.0)

@triton.jit
def _block_residual_kernel(
    target_ptr, draft_ptr, q_ptr, temperature_ptr, min_p_ptr, seed_ptr, offset_ptr, stats_ptr,
    at_draft_ptr,  # [rows, 2] float32: p(x_i), q(x_i) from the statistics pass (AT_DRAFT only)
    partial_ptr,  # [B, k, num_chunks] float32: chunk c's share of R_row at [b, row, c] (rows 1..k-1)
    stop_ptr,  # [B] int32 out: the column j of each request's emitted token (tau; greedy: the first mismatch)
    workspace_ptr,  # [B] int64 zeroed scratch: the request's ticket
    k, vocab, num_rows, chunk_len, num_chunks, chunks_per_program,
    t_stride_b, t_stride_i, draft_stride_b, q_stride_b, q_stride_i,
    temperature_stride, min_p_stride, seed_stride, offset_stride,
    HAS_DRAFT_PROBS: tl.constexpr, HAS_DRAFT_LOGITS: tl.constexpr, CHUNK_IS_BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr, NUM_STAGES: tl.constexpr,
    AT_DRAFT: tl.constexpr,
):
    """Block verification of request b, first launch: program (b, row - 1, p) sums max(w_row * p_row - q_row, 0)
    over chunks [p * chunks_per_program, ...) of residual row `row` (1..k-1), one partial per fixed-length chunk;
    the request's last program (ticket) adds each row's partials and writes the stop point tau into stop [b].
    The chunks have a length from V and the device alone, so R and tau do not depend on the batch."""
    b = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1) + 1
    part = tl.program_id(2)
    num_programs = tl.num_programs(1) * tl.num_programs(2)
    (greedy, t, min_e, seed, offset, i, in_k, m, tau, mass, argmax, draft, valid, qm, qtau, qmass, p_x, q_x, u,
     matches) = _accept_tests_tl(b, target_ptr, draft_ptr, q_ptr, temperature_ptr, min_p_ptr, seed_ptr, offset_ptr,
                                 stats_ptr, at_draft_ptr, k, vocab, num_rows, t_stride_b, t_stride_i, draft_stride_b,
                                 q_stride_b, q_stride_i, temperature_stride, min_p_stride, seed_stride, offset_stride,
                                 HAS_DRAFT_PROBS, HAS_DRAFT_LOGITS, BLOCK_K, AT_DRAFT)
    weights = _block_weights_tl(i, k, p_x, q_x, valid, BLOCK_K)
    t_row = target_ptr + b * t_stride_b
    q_row = q_ptr + b * q_stride_b
    if (~greedy) & (row < k):
        w_row = _pick_tl(weights, i, row)
        # The row's statistics, draft id and pointers, as a race at that row reads them (its stream goes unused).
        (rm, rtau, rmass, rqm, rqtau, rqmass, draft_row, _, p_base, q_base) = _race_row_tl(
            i, row, k, m, tau, mass, qm, qtau, qmass, draft, valid, seed, offset, t_row, q_row, t_stride_i,
            q_stride_i)
        first = part * chunks_per_program
        last = tl.minimum(first + chunks_per_program, num_chunks)
        partial_row = partial_ptr + (b * k + row) * num_chunks
        if CHUNK_IS_BLOCK:
            # One block per chunk: the chunk loop itself is pipelined (the next chunks' loads in flight).
            for c in tl.range(first, last, num_stages=NUM_STAGES):
                start = c * chunk_len
                v = start + tl.arange(0, BLOCK_V)
                residual = _residual_block_tl(p_base, q_base, v, v < tl.minimum(start + chunk_len, vocab), w_row, t,
                                              rm, rtau, rmass, rqm, rqtau, rqmass, draft_row, min_e,
                                              HAS_DRAFT_PROBS, HAS_DRAFT_LOGITS)
                tl.store(partial_row + c, tl.sum(residual, axis=0))
        else:
            for c in range(first, last):
                start = c * chunk_len
                end = tl.minimum(start + chunk_len, vocab)
                residual = tl.zeros([BLOCK_V], tl.float32)
                for v0 in tl.range(start, end, BLOCK_V, num_stages=NUM_STAGES):
                    v = v0 + tl.arange(0, BLOCK_V)
                    residual += _residual_block_tl(p_base, q_base, v, v < end, w_row, t, rm, rtau, rmass, rqm, rqtau,
                                                   rqmass, draft_row, min_e, HAS_DRAFT_PROBS, HAS_DRAFT_LOGITS)
                tl.store(partial_row + c, tl.sum(residual, axis=0))
    tl.debug_barrier()  # every thread's partials are stored before the ticket publishes them
    if take_ticket_tl(workspace_ptr + b) == num_programs - 1:
        reset_ticket_tl(workspace_ptr + b)
        # tau: the largest position that may stop (k iff u_{k-1} < w_k; row < k iff w_row > 0 and
        # u_{row-1} * (R_row + 1 - w_row) < R_row), 0 if none.
        stop = tl.where(_pick_tl(u, i, k - 1) < _pick_tl(weights, i, k), k, 0)
        chunk = tl.arange(0, BLOCK_C)
        for s in range(1, k):
            check = (k - s).to(tl.int64)
            w_check = _pick_tl(weights, i, check)
            if (stop == 0) & (w_check > 0) & ~greedy:
                r_mass = tl.sum(tl.load(partial_ptr + (b * k + check) * num_chunks + chunk, mask=chunk < num_chunks,
                                        other=0.0, cache_modifier=".cg"), axis=0)
                if _pick_tl(u, i, check - 1) * (r_mass + (1.0 - w_check)) < r_mass:
                    stop = check.to(tl.int32)
        first_mismatch = tl.min(tl.where(in_k & ~matches, i, k), axis=0)
        tl.store(stop_ptr + b, tl.where(greedy, first_mismatch, stop).to(tl.int32))

@triton.jit
def _race_verify_kernel(
    target_ptr, draft_ptr, q_ptr, temperature_ptr, min_p_ptr, seed_ptr, offset_ptr, stats_ptr,
    at_draft_ptr,  # [rows, 2] float32: p(x_i), q(x_i) from the statistics pass (AT_DRAFT only)
    out_ptr, logprobs_ptr, counters_ptr, workspace_ptr,
    stop_ptr,  # [B] int32: block verification's column j per request (BLOCK only)
    k, vocab, num_rows, chunk_len,
    t_stride_b, t_stride_i, draft_stride_b, q_stride_b, q_stride_i,
    temperature_stride, min_p_stride, seed_stride, offset_stride,
    HAS_DRAFT_PROBS: tl.constexpr, HAS_DRAFT_LOGITS: tl.constexpr, BLOCK: tl.constexpr,
    WITH_LOGPROBS: tl.constexpr, COUNT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    NUM_STAGES: tl.constexpr, FAST_LOG: tl.constexpr, AT_DRAFT: tl.constexpr,
):
    """Verification of request b, chunk c: every program evaluates the k accept tests (from the row statistics and
    one logit each), or with BLOCK reads the stop point of `_block_residual_kernel` and the block weight w_j, and
    races its chunk of the rejected/bonus row j over max(w_j * p_j - q_j, 0) (w_j = 1 token-wise); the winners
    meet in the request's packed atomic maximum (key bits, V-1-token) and the last program (ticket) writes the
    output row, the logprobs and the counters."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    (greedy, t, min_e, seed, offset, i, in_k, m, tau, mass, argmax, draft, valid, qm, qtau, qmass, p_x, q_x, u,
     matches) = _accept_tests_tl(b, target_ptr, draft_ptr, q_ptr, temperature_ptr, min_p_ptr, seed_ptr, offset_ptr,
                                 stats_ptr, at_draft_ptr, k, vocab, num_rows, t_stride_b, t_stride_i, draft_stride_b,
                                 q_stride_b, q_stride_i, temperature_stride, min_p_stride, seed_stride, offset_stride,
                                 HAS_DRAFT_PROBS, HAS_DRAFT_LOGITS, BLOCK_K, AT_DRAFT)
    t_row = target_ptr + b * t_stride_b
    q_row = q_ptr + b * q_stride_b
    if BLOCK:
        j = tl.load(stop_ptr + b)
        w_j = _pick_tl(_block_weights_tl(i, k, p_x, q_x, valid, BLOCK_K), i, j)
        accepted = i < j
    else:
        accepted = tl.where(greedy, matches, valid & (u * q_x < p_x))
        j = tl.min(tl.where(in_k & ~accepted, i, k), axis=0)
        w_j = tl.full([], 1.0, tl.float32)

    (jm, jtau, jmass, jqm, jqtau, jqmass, draft_j, state, p_race, q_race) = _race_row_tl(
        i, j, k, m, tau, mass, qm, qtau, qmass, draft, valid, seed, offset, t_row, q_row, t_stride_i, q_stride_i)
    if ~greedy:
        # Race at row j (residual, or the bonus at k with q = 0) over max(w_j * p - q, 0), this program's chunk.
        best_total, best_exp, best_segment, best_weights = _segment_race_start_tl(BLOCK_V)
        start = c * chunk_len
        end = tl.minimum(start + chunk_len, vocab)
        for v0 in tl.range(start, end, BLOCK_V, num_stages=NUM_STAGES):
            segment, v = _segment_block_tl(tl.multiple_of(v0, BLOCK_V), BLOCK_V)  # chunks start at multiples
            in_chunk = v < end
            x = tl.load(p_race + v, mask=in_chunk, other=float("-inf")).to(tl.float32)
            p = tl.where(in_chunk, _prob_tl(x, t, jm, jtau, jmass, min_e), 0.0)
            q = _q_block_tl(q_race, v, in_chunk & (v * 0 + j < k), draft_j, t, jqm, jqtau, jqmass, min_e,
                            HAS_DRAFT_PROBS, HAS_DRAFT_LOGITS)
            best_total, best_exp, best_segment, best_weights = _segment_race_tl(
                tl.maximum(w_j * p - q, 0.0), segment, state, best_total, best_exp, best_segment, best_weights,
                FAST_LOG)
        best_key = best_total / best_exp
        best_token = tl.where(best_key > 0, _segment_pick_tl(best_weights, best_segment, state), vocab)
        # int64 max = larger key, then lower token; a lane without a positive key packs to -1, below the
        # slot's starting 0 (so a high word <= 0 after the maximum means no positive key anywhere).
        packed = tl.max((best_key.to(tl.int32, bitcast=True).to(tl.int64) << 32)
                        | (vocab - 1 - best_token).to(tl.int64), axis=0)
        tl.atomic_max(workspace_ptr + 2 * b, packed, sem="relaxed")
    if take_ticket_tl(workspace_ptr + 2 * b + 1) == num_chunks - 1:
        packed = tl.atomic_xchg(workspace_ptr + 2 * b, 0, sem="relaxed")
        reset_ticket_tl(workspace_ptr + 2 * b + 1)
        token = _pick_tl(argmax, i, j).to(tl.int64)
        if ~greedy:
            token = vocab - 1 - (packed & 0xFFFFFFFF)
            if (packed >> 32) <= 0:
                # No positive residual key: draw from p_j itself, same random numbers (the whole row).
                token = _draw_from_p_tl(p_race, vocab, t, jm, jtau, jmass, min_e, state, BLOCK_V, FAST_LOG)
            token = tl.minimum(tl.maximum(token, 0), vocab - 1)  # non-finite rows: stay in [0, V)
        num_accepted = tl.zeros([], tl.int64)
        if COUNT:
            # Block mode counts the accepted prefix tau; token-wise, the accept decisions at all k positions.
            num_accepted = tl.sum((accepted & in_k).to(tl.int64), axis=0)
        _store_round_tl(out_ptr, logprobs_ptr, counters_ptr, b, i, k, j, draft, token, num_accepted, t_row,
                        t_stride_i, vocab, greedy, t, m, tau, mass, min_e, WITH_LOGPROBS, COUNT)

@triton.jit
def _draft_race_kernel(
    logits_ptr, temperature_ptr, min_p_ptr, seed_ptr, position_ptr, stats_ptr, out_ptr, probs_ptr, workspace_ptr,
    vocab, chunk_len, logits_stride, temperature_stride, min_p_stride, seed_stride, position_stride, probs_stride,
    WITH_PROBS: tl.constexpr, BLOCK_V: tl.constexpr, NUM_STAGES: tl.constexpr, FAST_LOG: tl.constexpr,
):
    """sample_draft_filtered, row r, chunk c: the Gumbel race over the chunk's kept entries (and its processed
    probabilities); the winners meet in the row's atomic maximum of (key's order + 2^31, V-1-index), and the last
    program (ticket) stores the token."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    temperature = tl.load(temperature_ptr + r * temperature_stride)
    greedy = ~(temperature > 0)
    t = tl.where(greedy, 1.0, temperature)
    min_e = _min_e_tl(tl.load(min_p_ptr + r * min_p_stride))
    m = tl.load(stats_ptr + r * 4).to(tl.float32, bitcast=True)
    tau = tl.load(stats_ptr + r * 4 + 1)
    mass = tl.load(stats_ptr + r * 4 + 2).to(tl.float32, bitcast=True)
    argmax = tl.load(stats_ptr + r * 4 + 3)
    row = logits_ptr + r * logits_stride
    probs_row = probs_ptr + r * probs_stride
    start = c * chunk_len
    end = tl.minimum(start + chunk_len, vocab)
    if ~greedy:
        state = _row_state_tl(tl.load(seed_ptr + r * seed_stride), tl.load(position_ptr + r * position_stride),
                              tl.zeros([], tl.int32) + 1)  # purpose DRAFT
        best = tl.zeros([BLOCK_V], tl.int64)
        for v0 in tl.range(start, end, BLOCK_V, num_stages=NUM_STAGES):
            v = v0 + tl.arange(0, BLOCK_V)
            in_chunk = v < end
            z = tl.load(row + v, mask=in_chunk, other=float("-inf")).to(tl.float32) / t
            e = tl.exp(z - m)
            kept = in_chunk & (_order_key_tl(z) >= tau) & (e >= min_e)
            key = z - _log_tl(_exponential_tl(_draw_bits_tl(state, v), FAST_LOG), FAST_LOG)
            # Non-negative and ordered as (key, then lower index); 0 (no kept entry) is below every packing.
            packed = (((_order_key_tl(key).to(tl.int64) + 2147483648) << 31)
                      | (vocab - 1 - v).to(tl.int64))
            best = tl.maximum(best, tl.where(kept, packed, 0))
            if WITH_PROBS:
                tl.store(probs_row + v, tl.where(kept, e / mass, 0.0), mask=in_chunk)
        tl.atomic_max(workspace_ptr + 2 * r, tl.max(best, axis=0), sem="relaxed")
    else:
        if WITH_PROBS:
            for v0 in tl.range(start, end, BLOCK_V, num_stages=NUM_STAGES):
                v = v0 + tl.arange(0, BLOCK_V)
                tl.store(probs_row + v, tl.where(v == argmax, 1.0, 0.0), mask=v < end)
    if take_ticket_tl(workspace_ptr + 2 * r + 1) == num_chunks - 1:
        packed = tl.atomic_xchg(workspace_ptr + 2 * r, 0, sem="relaxed")
        reset_ticket_tl(workspace_ptr + 2 * r + 1)
        token = argmax.to(tl.int64)
        if ~greedy:
            token = tl.where(packed > 0, vocab - 1 - (packed & 0x7FFFFFFF), 0)
            token = tl.minimum(tl.maximum(token, 0), vocab - 1)
        tl.store(out_ptr + r, token)


def _plan(rows, vocab, device, block_v=None, num_chunks=None):
    """(BLOCK_V, chunk_len, num_chunks) of a race pass over `rows` logit rows: chunks of at most max_chunk entries,
    and more when the rows are too few to give every SM programs_per_sm programs (a chunk is at least one block).
    A race's winner is an exact maximum, so its result does not depend on the chunking."""
    geometry = LOGITS_SAMPLING
    block_v = block_v or min(geometry["block_v"], max(16, triton.next_power_of_2(vocab)))
    if num_chunks is None:
        sms = sm_count(device) if device.type == "cuda" else geometry["interpreter_sms"]
        wanted = max(triton.cdiv(geometry["programs_per_sm"] * sms, rows),
                     triton.cdiv(vocab, geometry["max_chunk"]))
        num_chunks = max(1, min(wanted, triton.cdiv(vocab, block_v)))
    chunk_len = triton.cdiv(triton.cdiv(vocab, num_chunks), block_v) * block_v
    return block_v, chunk_len, triton.cdiv(vocab, chunk_len)


def _statistics_plan(vocab, device, block_v=None, num_chunks=None):
    """(BLOCK_V, chunk_len, num_chunks) of the statistics and filter passes: chunks of a fixed length, from V and the
    device alone. A row's S and its filter path come from its chunks' partials, combined in chunk order, so a
    chunking that followed the batch size would make a row's results depend on the batch it is in."""
    geometry = LOGITS_SAMPLING
    on_gpu = device.type == "cuda"
    block_v = block_v or min(geometry["stats_block_v"] if on_gpu else geometry["block_v"],
                             max(16, triton.next_power_of_2(vocab)))
    if num_chunks is None:
        length = geometry["stats_chunk"] if on_gpu else geometry["interpreter_stats_chunk"]
        num_chunks = triton.cdiv(vocab, max(length, block_v))
    chunk_len = triton.cdiv(triton.cdiv(vocab, num_chunks), block_v) * block_v
    return block_v, chunk_len, triton.cdiv(vocab, chunk_len)


def _statistics_grid(rows, num_chunks, device, chunks_per_program=None):
    """(chunks_per_program, programs per row) of the statistics and filter passes: consecutive chunks per program,
    as many as leave about stats_programs_per_sm programs per SM. Only the work per program follows the batch;
    every chunk's partial is still computed from that chunk alone and combined in chunk order."""
    if chunks_per_program is None:
        geometry = LOGITS_SAMPLING
        sms = sm_count(device) if device.type == "cuda" else geometry["interpreter_sms"]
        programs = max(1, min(num_chunks, triton.cdiv(geometry["stats_programs_per_sm"] * sms, rows)))
        chunks_per_program = triton.cdiv(num_chunks, programs)
    chunks_per_program = max(1, min(chunks_per_program, num_chunks))
    return chunks_per_program, triton.cdiv(num_chunks, chunks_per_program)


def _register_limit(maxnreg: int) -> dict:
    """The launch option of a register limit from the geometry (0: none). Passed only when set: a backend without
    the option (ROCm's) rejects the keyword even as None."""
    return {"maxnreg": maxnreg} if maxnreg else {}


def _given_or_off(top_k, top_p, min_p, batch, device):
    """The filter tensors, one passed as None (off for the whole batch) replaced by its off value read with
    stride 0 (a persistent tensor: no launch)."""
    off = filter_off_values(device)
    return tuple(off[i].expand(batch) if t is None else t for i, t in enumerate((top_k, top_p, min_p)))


def _gather_cap(device, gather_cap):
    # The interpreter's sort is slow; its small cap also makes the CPU tests run both the gather and the full search.
    return gather_cap or (LOGITS_SAMPLING["cap"] if device.type == "cuda" else 32)


def _row_statistics(target, draft_logits, k, rows_per_request, temperature, top_k, top_p, min_p, block_v,
                    num_chunks, gather_cap, fused_filter=None, chunks_per_program=None, draft_ids=None,
                    draft_probs=None):
    """(stats, at_draft): stats int32 [rows, 4] = (m, tau, S, argmax) of every logit row: target [B, R, V] rows
    r <= k, then the draft logits [B, k, V] (or None) as rows k+1 .. 2k. The statistics pass, then the filter pass:
    a launch of its own, or run by each row's last statistics program (fused_filter True; by default,
    LOGITS_SAMPLING["fused_filter"]: 2 fuses when one program covers a row). A filter passed as None is off for every
    row; with all three None no filter pass runs, and given the draft ids [B, k] the statistics pass also stores
    at_draft float32 [rows, 2], the accept tests' p(x_i) and q(x_i) (see `_stats_kernel`); else at_draft is None."""
    geometry = LOGITS_SAMPLING
    batch, _, vocab = target.shape
    device = target.device
    rows = batch * rows_per_request
    block_v, chunk_len, num_chunks = _statistics_plan(vocab, device, block_v, num_chunks)
    chunks_per_program, programs = _statistics_grid(rows, num_chunks, device, chunks_per_program)
    cap = _gather_cap(device, gather_cap)
    has_logits = draft_logits is not None
    draft = draft_logits if has_logits else target
    strides = (target.stride(0), target.stride(1), draft.stride(0), draft.stride(1) if has_logits else 0)
    stats = torch.empty((rows, 4), dtype=torch.int32, device=device)
    partial = torch.empty((rows, num_chunks, 4), dtype=torch.int32, device=device)
    hist = torch.empty((rows, num_chunks, geometry["hist_bins"]), dtype=torch.int32, device=device)
    # Each program of a row stores its candidates in a segment of its own (up to CAP, so the row's capacity does not
    # depend on how many programs share it) and their count.
    candidates = torch.empty((rows, programs, cap), dtype=torch.float32, device=device)
    counts = torch.empty((rows, programs), dtype=torch.int32, device=device)
    kept_mass = torch.empty((rows, num_chunks), dtype=torch.float32, device=device)
    # The filter pass's tickets, then the statistics pass's: one per row each; zero between calls.
    workspace = zeroed_scratch(device, 2 * rows)
    block_c = triton.next_power_of_2(num_chunks)
    filters = top_k is not None or top_p is not None
    # No filter given: the statistics are final, and no filter pass runs (not even one that returns at once).
    filter_pass = filters or min_p is not None
    if fused_filter is None:
        fused_filter = geometry["fused_filter"] == 1 or (geometry["fused_filter"] == 2 and programs == 1)
    fused_filter = bool(fused_filter) and filter_pass
    at_draft_given = draft_ids is not None and not filter_pass and bool(geometry["accept_from_statistics"])
    at_draft = torch.empty((rows, 2), dtype=torch.float32, device=device) if at_draft_given else None
    draft_ids = draft_ids if at_draft_given else stats  # stand-ins of the pointers' types when unused
    q = draft_probs if at_draft_given and draft_probs is not None else target
    top_k, top_p, min_p = _given_or_off(top_k, top_p, min_p, batch, device)
    params = (temperature, top_k, top_p, min_p)
    param_strides = (temperature.stride(0), top_k.stride(0), top_p.stride(0), min_p.stride(0))
    # On CUDA the gather's block does not shrink with a narrow row: its scan keeps the shape the benchmarks time (one
    # run of 8 entries per thread with the default geometry's 4 warps), where a narrow row's block would leave the
    # scan's tensor smaller than the thread count, copied over threads. The interpreter keeps the row's block, so
    # that the CPU tests' short rows take several gather steps.
    gather_block = geometry["gather_block"] if device.type == "cuda" else min(geometry["gather_block"], block_v)
    # The filter pass reads only the sub-blocks whose maximum reaches its floor (0: every entry). A sub-block lies
    # in one statistics block and one gather step.
    sub_block = min(geometry["sub_block"], block_v, gather_block) if filters else 0
    if sub_block & (sub_block - 1):
        raise ValueError(f"LOGITS_SAMPLING['sub_block'] (specdec_ops/kernels/geometry.py) must be 0 or a power of 2, "
                         f"got {geometry['sub_block']}")
    if sub_block:
        submax = torch.empty((rows, num_chunks * chunk_len // sub_block), dtype=torch.float32, device=device)
        subs = torch.empty_like(submax, dtype=torch.int32)
    else:  # never read: stand-ins of the pointers' types, no allocation
        submax, subs = kept_mass, counts
    # The interpreter's cap is small (_gather_cap); a quarter of it keeps both sorts in the CPU tests.
    search = dict(SEARCH_BLOCK=min(geometry["search_block"], block_v), NUM_PROBES=geometry["num_probes"], CAP=cap,
                  SMALL_CAP=max(1, min(cap, geometry["small_cap"] if device.type == "cuda" else cap // 4)),
                  GATHER_BLOCK=gather_block, GATHER_RUN=8 if geometry["gather_run"] == 8 and gather_block >= 8 else 1,
                  SUB_BLOCK=sub_block)
    grid = (rows, programs)
    common = (k, vocab, chunk_len, num_chunks, chunks_per_program, rows_per_request, *strides, *param_strides)
    row_bytes = batch * vocab * (target.shape[1] * target.element_size()
                                 + (draft_logits.shape[1] * draft_logits.element_size() if has_logits else 0))
    keep_in_l2 = device.type == "cuda" and row_bytes <= geometry["stats_keep_in_l2_mb"] << 20
    _stats_kernel[grid](
        target, draft, *params, stats, partial, hist, workspace[rows:], candidates, counts, kept_mass, workspace,
        submax, subs, draft_ids, q, at_draft if at_draft_given else kept_mass, *common, draft_ids.stride(0),
        q.stride(0), q.stride(1),
        HAS_DRAFT_LOGITS=has_logits, CHUNK_IS_BLOCK=chunk_len == block_v, BLOCK_V=block_v,
        NUM_STAGES=geometry["stats_num_stages"], NUM_BINS=geometry["hist_bins"], BIN_SCALE=geometry["bin_scale"],
        HIST_GROUP=min(geometry["hist_group"], block_v), BLOCK_C=block_c, FUSED_FILTER=fused_filter, FILTERS=filters,
        KEEP_IN_L2=keep_in_l2, AT_DRAFT=at_draft_given, HAS_DRAFT_PROBS=at_draft_given and draft_probs is not None,
        **search,
        num_warps=geometry["stats_num_warps"],
        **_register_limit(geometry["filter_maxnreg" if fused_filter else "stats_maxnreg"]),  # fused: the filter's code
    )
    if filter_pass and not fused_filter:
        _filter_kernel[grid](
            target, draft, *params, stats, candidates, counts, kept_mass, workspace, submax, subs, *common,
            HAS_DRAFT_LOGITS=has_logits, BLOCK_V=block_v, NUM_STAGES=geometry["stats_num_stages"], BLOCK_C=block_c,
            **search, num_warps=geometry["stats_num_warps"], **_register_limit(geometry["filter_maxnreg"]),
        )
    return stats, at_draft


def _launch_rejection(target_logits, draft_token_ids, draft_probs, draft_logits, temperature, top_k, top_p, min_p,
                      seeds, offsets, block_verification, counters, with_logprobs, block_v=None, gather_cap=None,
                      num_chunks=None, fused_filter=None, chunks_per_program=None):
    batch, k = draft_token_ids.shape
    vocab = target_logits.shape[2]
    device = target_logits.device
    out = torch.empty((batch, k + 1), dtype=draft_token_ids.dtype, device=device)
    logprobs = torch.empty((batch, k + 1), dtype=torch.float32, device=device) if with_logprobs else None
    if batch == 0:
        return out, logprobs
    geometry = LOGITS_SAMPLING
    has_logits = draft_logits is not None
    has_probs = draft_probs is not None
    num_rows = k + 1 + (k if has_logits else 0)
    stats, at_draft = _row_statistics(target_logits, draft_logits, k, num_rows, temperature, top_k, top_p, min_p,
                                      block_v, num_chunks, gather_cap, fused_filter, chunks_per_program,
                                      draft_token_ids, draft_probs)
    min_p = _given_or_off(top_k, top_p, min_p, batch, device)[2]
    q = draft_probs if has_probs else (draft_logits if has_logits else target_logits)
    q_strides = (q.stride(0), q.stride(1)) if (has_probs or has_logits) else (0, 0)
    common = (k, vocab, num_rows)
    stop = stats  # a placeholder pointer token-wise
    if block_verification:
        stop = _block_stop(target_logits, draft_token_ids, q, q_strides, temperature, min_p, seeds, offsets, stats,
                           at_draft, k, num_rows, has_probs, has_logits, block_v, num_chunks, chunks_per_program)
    race_block_v, chunk_len, race_chunks = _plan(batch, vocab, device, block_v, num_chunks)
    workspace = zeroed_scratch(device, 2 * batch)  # per request: the packed race maximum and a ticket
    _race_verify_kernel[(batch, race_chunks)](
        target_logits, draft_token_ids, q, temperature, min_p, seeds, offsets, stats,
        stats if at_draft is None else at_draft, out, logprobs if with_logprobs else stats,
        counters if counters is not None else out, workspace, stop,
        *common, chunk_len,
        target_logits.stride(0), target_logits.stride(1), draft_token_ids.stride(0), *q_strides,
        temperature.stride(0), min_p.stride(0), seeds.stride(0), offsets.stride(0),
        HAS_DRAFT_PROBS=has_probs, HAS_DRAFT_LOGITS=has_logits, BLOCK=block_verification,
        WITH_LOGPROBS=with_logprobs, COUNT=counters is not None, BLOCK_K=triton.next_power_of_2(k + 1),
        BLOCK_V=race_block_v, NUM_STAGES=geometry["num_stages"], FAST_LOG=out.is_cuda, AT_DRAFT=at_draft is not None,
        num_warps=geometry["num_warps"],
    )
    return out, logprobs


def _block_stop(target_logits, draft_token_ids, q, q_strides, temperature, min_p, seeds, offsets, stats, at_draft, k,
                num_rows, has_probs, has_logits, block_v, num_chunks, chunks_per_program=None):
    """int32 [B]: block verification's column j per request (`_block_residual_kernel` over the k - 1 residual rows,
    fixed-length chunks; a request of k = 1 has no residual row, and its one program only decides)."""
    geometry = LOGITS_SAMPLING
    batch, _, vocab = target_logits.shape
    device = target_logits.device
    block_v, chunk_len, num_chunks = _statistics_plan(vocab, device, block_v, num_chunks)
    residual_rows = max(k - 1, 1)
    # Programs of several consecutive chunks, as the statistics pass; partials stay per chunk, so tau does not
    # depend on the grid.
    chunks_per_program, programs = _statistics_grid(batch * residual_rows, num_chunks, device, chunks_per_program)
    if k == 1:  # no residual row: one program per request takes the ticket and decides
        chunks_per_program, programs = num_chunks, 1
    stop = torch.empty((batch,), dtype=torch.int32, device=device)
    partial = torch.empty((batch, k, num_chunks), dtype=torch.float32, device=device)  # rows 1..k-1 (0 unused)
    _block_residual_kernel[(batch, residual_rows, programs)](
        target_logits, draft_token_ids, q, temperature, min_p, seeds, offsets, stats,
        stats if at_draft is None else at_draft, partial, stop,
        zeroed_scratch(device, batch), k, vocab, num_rows, chunk_len, num_chunks, chunks_per_program,
        target_logits.stride(0), target_logits.stride(1), draft_token_ids.stride(0), *q_strides,
        temperature.stride(0), min_p.stride(0), seeds.stride(0), offsets.stride(0),
        HAS_DRAFT_PROBS=has_probs, HAS_DRAFT_LOGITS=has_logits, CHUNK_IS_BLOCK=chunk_len == block_v,
        BLOCK_K=triton.next_power_of_2(k + 1), BLOCK_V=block_v, BLOCK_C=triton.next_power_of_2(num_chunks),
        NUM_STAGES=geometry["num_stages"], AT_DRAFT=at_draft is not None, num_warps=geometry["stats_num_warps"],
    )
    return stop


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


def _launch_draft(logits, temperature, top_k, top_p, min_p, seeds, positions, probs, block_v=None, gather_cap=None,
                  num_chunks=None, fused_filter=None, chunks_per_program=None):
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    geometry = LOGITS_SAMPLING
    with_probs = probs is not None
    stats = _row_statistics(logits[:, None], None, 0, 1, temperature, top_k, top_p, min_p, block_v, num_chunks,
                            gather_cap, fused_filter, chunks_per_program)[0]
    min_p = _given_or_off(top_k, top_p, min_p, rows, logits.device)[2]
    block_v, chunk_len, num_chunks = _plan(rows, vocab, logits.device, block_v, num_chunks)
    workspace = zeroed_scratch(logits.device, 2 * rows)  # per row: the packed race maximum and a ticket
    _draft_race_kernel[(rows, num_chunks)](
        logits, temperature, min_p, seeds, positions, stats, out, probs if with_probs else out, workspace,
        vocab, chunk_len, logits.stride(0), temperature.stride(0), min_p.stride(0), seeds.stride(0),
        positions.stride(0), probs.stride(0) if with_probs else 0,
        WITH_PROBS=with_probs, BLOCK_V=block_v, NUM_STAGES=geometry["num_stages"], FAST_LOG=out.is_cuda,
        num_warps=geometry["num_warps"],
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

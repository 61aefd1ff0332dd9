"""`specdec::rejection_sample` and `specdec::sample_draft`: lossless speculative sampling.

rejection_sample(target_probs, draft_token_ids, draft_probs, seeds, offsets, bonus_token_ids=None)
------------------------------------------------------------------------------------------------
Speculative sampling (Leviathan et al. 2023; Chen et al. 2023). For request b
with k draft tokens ``x_i = draft_token_ids[b, i]``, target distributions
``p_i = target_probs[b, i]`` (row k is the bonus position) and draft
distributions ``q_i = draft_probs[b, i]`` (``draft_probs=None``: the draft is
deterministic, q_i is one-hot at x_i):

- position i is *accepted* iff ``0 <= x_i < V`` and ``u_i * q_i(x_i) < p_i(x_i)``
  with u_i uniform in [0, 1) (accept with probability min(1, p/q); no division);
- at the first rejected position j a token is drawn from
  ``normalize(max(p_j - q_j, 0))`` (the residual) by a segmented race (below);
  if no segment of the residual gets a positive race key (it is zero
  everywhere, up to float underflow) the token is drawn from p_j instead, by
  the same race with the same random numbers (and is 0 if p_j has no positive
  key either);
- when all k are accepted, the bonus token is ``bonus_token_ids[b]`` if given,
  else a draw from p_k.

The emitted tokens are then distributed exactly as sampling from the target
alone. Output: [B, k+1], dtype of ``draft_token_ids``, in the create_output
layout (specdec_ops/output.py): accepted prefix, the residual token at column
j, -1 after it; the bonus in column k when all were accepted. The ``.counted``
overload adds to the int64 ``counters`` [3] exactly what create_output.counted
adds for the same output given the accept decisions at ALL k positions (each
is evaluated even after the first rejection): (#accepted positions, #output
entries != -1, B*k).

Inputs: ``target_probs`` [B, k+1, V] float32/float16/bfloat16 (read as float32),
``draft_token_ids`` [B, k] int32/int64 (k >= 1; ids outside [0, V) are
rejected and never dereferenced), ``draft_probs`` [B, k, V] float32/float16/
bfloat16 or None, ``seeds`` and ``offsets`` [B] int64, ``bonus_token_ids`` [B]
or [B, 1] int32/int64 or None. Any strides with a unit last stride; a batch
stride of 0 (an expanded tensor) is fine. Probability rows are expected to be
non-negative and finite; for other rows the token is unspecified (but always
in [0, V)).

sample_draft(logits, temperature, seeds, positions) and .with_probs(..., probs)
-------------------------------------------------------------------------------
Row r of ``logits`` [n, V] (float16/bfloat16/float32/float64, used as float32)
with ``temperature[r]`` (float32 [n]) > 0 samples a token from
``softmax(logits[r] / T)``; a temperature <= 0 (or NaN) is greedy: the argmax
of the float32 logits, lowest index on ties (for a row holding NaN the token is
unspecified but in [0, V): the CPU kernel picks the first NaN as torch.argmax
does, the CUDA kernel skips NaNs). Greedy and random rows mix in one
call. Returns int64 [n]. ``with_probs`` also writes ``softmax(logits / T)`` in
float32 into ``probs`` [n, V] (one-hot at the argmax for greedy rows): the q
that rejection_sample consumes. ``probs`` only needs a unit last stride, so a
column ``buf[:, step, :]`` of a [n, k, V] buffer works.

Randomness
----------
Every draw is a pure function of (seed, position, purpose, index); there is no
generator state, so the ops are graph-capturable, and a captured graph draws
fresh numbers when the caller advances ``offsets``/``positions`` or changes
``seeds``. A request's result does not depend on the other rows of the batch.
The 32 random bits of a draw are MurmurHash3_x86_32 (hash seed 0) of the six
32-bit words (seed lo, seed hi, position lo, position hi, purpose, index), where

- purpose DRAFT=1 (sample_draft; position = ``positions[r]``, index = vocab id),
- ACCEPT=2 (u_i; position = ``offsets[b] + i``, index 0),
- RESIDUAL=3 (race at the rejected position j; position = ``offsets[b] + j``,
  index 2s or 2s + 1 for segment s, below),
- BONUS=4 (race for the bonus; position = ``offsets[b] + k``, indices as RESIDUAL).

Purpose is hashed in, so the draft and verification streams are independent
for equal seed and position. Pass as offset the position of the first draft
token and advance it by at least the number of emitted tokens per round: the
positions whose draws decided a round's output are then never reused.

A uniform is ``(bits >> 8) * 2**-24`` (exact in float32, in [0, 1)). An
exponential is E = -log(1 - w) with ``w = float32(bits) * 2**-32 + 2**-33``;
for w < 2**-7 E is the series w(1 + w(1/2 + w(1/3 + w/4))) instead, so that
small E (the likely winners of a race) keep 32-bit resolution; w = 1 gives
E = inf.

Segmented race (rejection_sample's residual and bonus draws, and the
fallback). The weights r (>= 0, float32) are cut into segments of SEGMENT = 4
consecutive entries (the last one zero-padded). Segment s has the pair sums
``r[4s] + r[4s+1]`` and ``r[4s+2] + r[4s+3]`` and the total T_s = their sum
(exactly these additions, in this order, in every kernel), and the race key
T_s / E_s with E_s the exponential of draw ``2s``. The winning segment is the
argmax of the keys (lowest s on ties; a key must be > 0 to count). Within it,
with u the uniform of draw ``2s + 1`` and t = u * T_s, the token is found by
walking down the pair tree: at a node with children (a, b), go right if a == 0
or (b > 0 and t >= a), subtracting a from t; else go left. The winner is then a
draw from normalize(r): a segment wins with probability T_s / sum(T) (the
exponential race), and the walk picks an entry with probability r_v / T_s, up
to the 2**-24 grid of u: an entry below about 2**-24 of its pair's sum may
never be picked. A zero-weight entry is never picked. Per entry this costs a
subtraction, a max and an addition; the hash and the logarithm are paid once
per 4 entries. The race does not depend on the order in which segments are
visited, so chunked kernels agree with the reference. The Triton kernel ranks
the segments a lane visits by cross-multiplying (T1 * E2 > T2 * E1, no
division per segment), so of two exactly tied keys it may keep the later
segment; on CUDA it also takes log from the hardware lg2.approx (absolute
error ~2**-22 in log2, so E is off by up to ~1e-5 relative just above
w = 2**-7, far less elsewhere) and may fuse multiplies and adds (the
exponential's series, t - a). Its token can therefore differ from the
reference's only when two race keys, or a threshold and a pair sum, are that
close. The CUDA tests compare exactly with fixed seeds. sample_draft races
every entry: the Gumbel form argmax_v logits_v / T - log(E_v), E_v from draw v
(no softmax needed).

Kernels: the reference (`*_reference`) is vectorized PyTorch that
materializes the residual race at every position; the CPU kernel
(csrc/sampling.cpp) races only the one rejected/bonus row; the CUDA kernel is
one Triton launch. rejection_sample's kernel is a grid of (B, chunks): every
program evaluates the k accept tests (they only need p(x), q(x), one uniform),
races the segments of its chunk of V at the rejected/bonus position (a
segment is one 16-byte vector of one thread; each lane keeps its best
segment's total, E, index and weights, and walks down the winner's tree once,
after the loop),
and folds its winner (key bits, V-1-token) into a per-row slot with an int64
atomic max; an atomic ticket elects the last program of the row, which
writes the output row and the counters. The slot and ticket live in the
persistent zeroed scratch of `_launch.zeroed_scratch`, which the last program
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

from ._checks import INT_DTYPES, check_counters, check_size, check_tensor
from ._launch import sm_count, zeroed_scratch
from ._library import register_cuda, register_fake
from ._triton import HAS_TRITON, tl, triton
from .output import create_output_reference

PROB_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LOGIT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Purposes: which stream a draw belongs to (hashed into every draw).
DRAFT, ACCEPT, RESIDUAL, BONUS = 1, 2, 3, 4

_M32 = 0xFFFFFFFF
_C1, _C2, _C3 = 0xCC9E2D51, 0x1B873593, 0xE6546B64
_F1, _F2 = 0x85EBCA6B, 0xC2B2AE35
_THIRD = 0.3333333432674408  # float32(1/3), written exactly so every backend uses the same constant
_SERIES_BELOW = 0.0078125  # 2**-7
SEGMENT = 4  # vocabulary entries per race segment of rejection_sample (part of its random stream)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    bonus_token_ids: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Verifies k draft tokens per request by speculative sampling; returns [B, k+1].

    Pass ``counters`` (int64 [3]) to accumulate (accepted, emitted, proposed) in place.
    """
    if counters is None:
        return torch.ops.specdec.rejection_sample.default(
            target_probs, draft_token_ids, draft_probs, seeds, offsets, bonus_token_ids
        )
    return torch.ops.specdec.rejection_sample.counted(
        target_probs, draft_token_ids, draft_probs, seeds, offsets, bonus_token_ids, counters
    )


def sample_draft(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Samples one token per row (greedy where temperature <= 0); returns int64 [n].

    Pass ``probs`` (float32 [n, V], unit last stride) to also receive softmax(logits / T).
    """
    if probs is None:
        return torch.ops.specdec.sample_draft.default(logits, temperature, seeds, positions)
    return torch.ops.specdec.sample_draft.with_probs(logits, temperature, seeds, positions, probs)


# --- the random streams, in PyTorch (int64 tensors holding uint32 values) -----------------


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2**32 for a in [0, 2**32), split in 16-bit halves of c so int64 never overflows."""
    return (a * (c & 0xFFFF) + (((a * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _rotl32(a: torch.Tensor, r: int) -> torch.Tensor:
    return ((a << r) | (a >> (32 - r))) & _M32


def _mix_word(h: torch.Tensor, word: torch.Tensor) -> torch.Tensor:
    word = _mul32(_rotl32(_mul32(word, _C1), 15), _C2)
    return (_rotl32(h ^ word, 13) * 5 + _C3) & _M32


def random_bits(seed, position, purpose: int, index) -> torch.Tensor:
    """The 32 random bits (as int64) of draw (seed, position, purpose, index); broadcasts int64 tensors."""
    seed = torch.as_tensor(seed, dtype=torch.int64)
    position = torch.as_tensor(position, dtype=torch.int64)
    index = torch.as_tensor(index, dtype=torch.int64)
    h = torch.zeros((), dtype=torch.int64, device=seed.device)
    for word in (seed & _M32, (seed >> 32) & _M32, position & _M32, (position >> 32) & _M32,
                 torch.full_like(h, purpose), index & _M32):
        h = _mix_word(h, word)
    h = h ^ 24  # length in bytes
    h = h ^ (h >> 16)
    h = _mul32(h, _F1)
    h = h ^ (h >> 13)
    h = _mul32(h, _F2)
    return h ^ (h >> 16)


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    return (bits >> 8).to(torch.float32) * 2.0**-24


def exponential_from_bits(bits: torch.Tensor) -> torch.Tensor:
    w = bits.to(torch.float32) * 2.0**-32 + 2.0**-33
    series = w * (1.0 + w * (0.5 + w * (_THIRD + w * 0.25)))
    return torch.where(w < _SERIES_BELOW, series, -torch.log(1.0 - w))


# --- references -----------------------------------------------------------------------------


def _segment_levels(weights: torch.Tensor) -> list[torch.Tensor]:
    """The sum trees of the segments of the last dim: [w, pair sums, ..., totals], each [..., segments, width].

    The last dim is zero-padded to whole segments. Each level adds adjacent pairs of the one below
    (x[2m] + x[2m+1]), the one association every kernel uses, so the float sums agree bit for bit.
    """
    vocab = weights.shape[-1]
    padded = torch.nn.functional.pad(weights, (0, -vocab % SEGMENT))
    levels = [padded.unflatten(-1, (-1, SEGMENT))]
    while levels[-1].shape[-1] > 1:
        x = levels[-1]
        levels.append(x[..., 0::2] + x[..., 1::2])
    return levels


def _segment_race(weights, seeds, positions, purpose: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Segmented race over weights [B, V] (>= 0), seeds and positions [B, 1]: (token, whether a key is > 0)."""
    levels = _segment_levels(weights)
    totals = levels[-1][..., 0]  # [B, segments]
    segments = torch.arange(totals.shape[-1], device=weights.device)
    keys = totals / exponential_from_bits(random_bits(seeds, positions, purpose, 2 * segments))
    winner = keys.argmax(-1, keepdim=True)  # [B, 1], lowest segment on ties
    u = uniform_from_bits(random_bits(seeds, positions, purpose, 2 * winner + 1))[:, 0]
    threshold = u * totals.gather(-1, winner)[:, 0]
    node = torch.zeros_like(winner[:, 0])
    for level in levels[-2::-1]:  # widths 2, 4, ..., SEGMENT: descend from the total to a leaf
        children = level.gather(1, winner[:, :, None].expand(-1, 1, level.shape[-1]))[:, 0]
        left = children.gather(-1, 2 * node[:, None])[:, 0]
        right = children.gather(-1, 2 * node[:, None] + 1)[:, 0]
        go_right = (left == 0) | ((right > 0) & (threshold >= left))
        threshold = torch.where(go_right, threshold - left, threshold)
        node = 2 * node + go_right.long()
    return winner[:, 0] * SEGMENT + node, keys.amax(-1) > 0


def rejection_sample_reference(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    bonus_token_ids: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch statement of the contract: every position's residual race is materialized."""
    batch, k = draft_token_ids.shape
    vocab = target_probs.shape[-1]
    device = target_probs.device
    p = target_probs.float()
    draft = draft_token_ids.long()
    valid = (draft >= 0) & (draft < vocab)
    safe = torch.where(valid, draft, 0)
    one_hot = torch.nn.functional.one_hot(safe, vocab).float() * valid[..., None]
    q = one_hot if draft_probs is None else draft_probs.float()

    positions = offsets[:, None] + torch.arange(k + 1, device=device)  # [B, k+1]
    seeds2 = seeds[:, None]

    p_x = p[:, :k].gather(2, safe[..., None])[..., 0]
    q_x = q.gather(2, safe[..., None])[..., 0]
    u = uniform_from_bits(random_bits(seeds2, positions[:, :k], ACCEPT, 0))
    accepted = valid & (u * q_x < p_x)

    # Residual at every position i < k; the bonus race is position k with q = 0.
    q_full = torch.cat([q, torch.zeros_like(p[:, :1])], dim=1)
    residual = torch.clamp(p - q_full, min=0)
    tokens = []
    for i in range(k + 1):
        purpose = RESIDUAL if i < k else BONUS
        residual_token, has_residual = _segment_race(residual[:, i], seeds2, positions[:, i:i + 1], purpose)
        fallback_token, has_fallback = _segment_race(p[:, i], seeds2, positions[:, i:i + 1], purpose)
        token = torch.where(has_residual, residual_token, torch.where(has_fallback, fallback_token, 0))
        tokens.append(token.clamp(0, vocab - 1))
    token = torch.stack(tokens, dim=1)  # [B, k+1]

    bonus = token[:, k] if bonus_token_ids is None else bonus_token_ids.reshape(batch)
    return create_output_reference(accepted, token[:, :k].to(draft_token_ids.dtype), draft_token_ids,
                                   bonus.to(draft_token_ids.dtype), counters=counters)


def sample_draft_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch statement of the contract (writes ``probs`` when given)."""
    x = logits.float()
    vocab = x.shape[-1]
    random_row = temperature > 0
    z = x / torch.where(random_row, temperature, 1.0)[:, None]
    bits = random_bits(seeds[:, None], positions[:, None], DRAFT, torch.arange(vocab, device=x.device))
    gumbel_keys = z - torch.log(exponential_from_bits(bits))
    greedy_token = x.argmax(-1)
    token = torch.where(random_row, gumbel_keys.argmax(-1), greedy_token)
    if probs is not None:
        one_hot = torch.nn.functional.one_hot(greedy_token, vocab).float()
        probs.copy_(torch.where(random_row[:, None], torch.softmax(z, -1), one_hot))
    return token


# --- validation, shared by the fake kernels and the Triton launchers ---------------------------

_RS = "rejection_sample"
_SD = "sample_draft"


def _check_rejection_inputs(target_probs, draft_token_ids, draft_probs, seeds, offsets, bonus_token_ids,
                            counters=None) -> None:
    check_tensor(_RS, "target_probs", target_probs, ndim=3, dtypes=PROB_DTYPES)
    device = target_probs.device
    check_tensor(_RS, "draft_token_ids", draft_token_ids, ndim=2, dtypes=INT_DTYPES, device=device)
    batch, k_plus_1, vocab = target_probs.shape
    if k_plus_1 < 2:
        raise ValueError(f"{_RS}: argument 'target_probs' must have k+1 >= 2 positions in dimension 1, got "
                         f"shape {tuple(target_probs.shape)}")
    if vocab < 1:
        raise ValueError(f"{_RS}: argument 'target_probs' must have a vocabulary of V >= 1, got shape "
                         f"{tuple(target_probs.shape)}")
    check_size(_RS, "draft_token_ids", draft_token_ids, 0, batch, "B, rows of target_probs")
    check_size(_RS, "draft_token_ids", draft_token_ids, 1, k_plus_1 - 1, "k, target_probs has k+1 positions")
    if draft_probs is not None:
        check_tensor(_RS, "draft_probs", draft_probs, ndim=3, dtypes=PROB_DTYPES, device=device)
        check_size(_RS, "draft_probs", draft_probs, 0, batch, "B, rows of target_probs")
        check_size(_RS, "draft_probs", draft_probs, 1, k_plus_1 - 1, "k, target_probs has k+1 positions")
        check_size(_RS, "draft_probs", draft_probs, 2, vocab, "V, vocabulary of target_probs")
    for name, t in (("seeds", seeds), ("offsets", offsets)):
        check_tensor(_RS, name, t, ndim=1, dtypes=(torch.int64,), device=device, unit_stride=False)
        check_size(_RS, name, t, 0, batch, "B, rows of target_probs")
    if bonus_token_ids is not None:
        check_tensor(_RS, "bonus_token_ids", bonus_token_ids, dtypes=INT_DTYPES, device=device, unit_stride=False)
        if not (bonus_token_ids.dim() == 1 or (bonus_token_ids.dim() == 2 and bonus_token_ids.shape[1] == 1)):
            raise ValueError(f"{_RS}: argument 'bonus_token_ids' must have shape [B, 1] or [B], got shape "
                             f"{tuple(bonus_token_ids.shape)}")
        check_size(_RS, "bonus_token_ids", bonus_token_ids, 0, batch, "B, rows of target_probs")
    if counters is not None:
        check_counters(_RS, counters, device)


def _check_draft_inputs(logits, temperature, seeds, positions, probs=None) -> None:
    op = _SD if probs is None else "sample_draft.with_probs"
    check_tensor(op, "logits", logits, ndim=2, dtypes=LOGIT_DTYPES)
    device = logits.device
    rows, vocab = logits.shape
    if vocab < 1:
        raise ValueError(f"{op}: argument 'logits' must have a vocabulary of V >= 1, got shape "
                         f"{tuple(logits.shape)}")
    check_tensor(op, "temperature", temperature, ndim=1, dtypes=(torch.float32,), device=device,
                 unit_stride=False)
    check_size(op, "temperature", temperature, 0, rows, "n, rows of logits")
    for name, t in (("seeds", seeds), ("positions", positions)):
        check_tensor(op, name, t, ndim=1, dtypes=(torch.int64,), device=device, unit_stride=False)
        check_size(op, name, t, 0, rows, "n, rows of logits")
    if probs is not None:
        check_tensor(op, "probs", probs, ndim=2, dtypes=(torch.float32,), device=device)
        check_size(op, "probs", probs, 0, rows, "n, rows of logits")
        check_size(op, "probs", probs, 1, vocab, "V, columns of logits")


@register_fake("rejection_sample")
def _rejection_sample_fake(target_probs, draft_token_ids, draft_probs, seeds, offsets, bonus_token_ids=None):
    _check_rejection_inputs(target_probs, draft_token_ids, draft_probs, seeds, offsets, bonus_token_ids)
    batch, k = draft_token_ids.shape
    return draft_token_ids.new_empty((batch, k + 1))


@register_fake("rejection_sample.counted")
def _rejection_sample_counted_fake(target_probs, draft_token_ids, draft_probs, seeds, offsets, bonus_token_ids,
                                   counters):
    _check_rejection_inputs(target_probs, draft_token_ids, draft_probs, seeds, offsets, bonus_token_ids,
                            counters)
    batch, k = draft_token_ids.shape
    return draft_token_ids.new_empty((batch, k + 1))


@register_fake("sample_draft")
def _sample_draft_fake(logits, temperature, seeds, positions):
    _check_draft_inputs(logits, temperature, seeds, positions)
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


@register_fake("sample_draft.with_probs")
def _sample_draft_with_probs_fake(logits, temperature, seeds, positions, probs):
    _check_draft_inputs(logits, temperature, seeds, positions, probs)
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


# --- Triton kernels ---------------------------------------------------------------------------

# Chosen by a geometry sweep on the H200 (a throwaway probe; benchmarks/RESULTS.md says what it covered): 4 warps
# over 1024-entry blocks (two segments per thread), three pipeline stages, chunks of at most 8192 entries, and at
# least one program per SM when the batch is small.
_BLOCK_V = 1024
_NUM_WARPS = 4
_NUM_STAGES = 3
_MAX_CHUNK = 8192  # longer rows are split even when the batch alone fills the GPU
_PROGRAMS_PER_SM = 1
# sample_draft: one program per row, so wide blocks keep a row's passes short.
_DRAFT_BLOCK_V = 4096
_DRAFT_NUM_WARPS = 16

if HAS_TRITON:

    from .output import add_counters_tl

    @triton.jit
    def _mix_word_tl(h, word):
        word = word * 0xCC9E2D51
        word = (word << 15) | (word >> 17)
        word = word * 0x1B873593
        h = h ^ word
        h = (h << 13) | (h >> 19)
        return h * 5 + 0xE6546B64

    @triton.jit
    def _row_state_tl(seed, position, purpose):
        """Murmur state after the first five words; a draw then only hashes its index."""
        seed_lo = seed.to(tl.uint32)
        h = _mix_word_tl(seed_lo ^ seed_lo, seed_lo)
        h = _mix_word_tl(h, (seed >> 32).to(tl.uint32))
        h = _mix_word_tl(h, position.to(tl.uint32))
        h = _mix_word_tl(h, (position >> 32).to(tl.uint32))
        return _mix_word_tl(h, purpose.to(tl.uint32))

    @triton.jit
    def _draw_bits_tl(state, index):
        h = _mix_word_tl(state, index.to(tl.uint32))
        h = h ^ 24
        h = h ^ (h >> 16)
        h = h * 0x85EBCA6B
        h = h ^ (h >> 13)
        h = h * 0xC2B2AE35
        return h ^ (h >> 16)

    @triton.jit
    def _log_tl(x, FAST_LOG: tl.constexpr):
        """log(x); on the GPU through the hardware lg2.approx (a few ulps, far cheaper than libdevice logf)."""
        if FAST_LOG:
            # ftz: the inputs (1 - w, or E >= 2**-33) are never subnormal, so skip the subnormal fixup.
            log2 = tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                             is_pure=True, pack=1)
            return log2 * 0.6931471805599453
        else:
            return tl.log(x)

    @triton.jit
    def _exponential_tl(bits, FAST_LOG: tl.constexpr):
        w = bits.to(tl.float32) * 2.3283064365386963e-10 + 1.1641532182693481e-10
        series = w * (1.0 + w * (0.5 + w * (0.3333333432674408 + w * 0.25)))
        return tl.where(w < 0.0078125, series, -_log_tl(1.0 - w, FAST_LOG))

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
        exponential = _exponential_tl(_draw_bits_tl(state, 2 * segment), FAST_LOG)
        better = total * best_exp > best_total * exponential
        return (tl.where(better, total, best_total), tl.where(better, exponential, best_exp),
                tl.where(better, segment, best_segment), tl.where(better[:, None], weights, best_weights))

    @triton.jit
    def _segment_race_start_tl(BLOCK_V: tl.constexpr):
        """The lanes' best before any segment: (total 0, E 1, segment 0, weights 0), a key of 0 that never wins."""
        return (tl.zeros([BLOCK_V // 4], tl.float32), tl.full([BLOCK_V // 4], 1.0, tl.float32),
                tl.zeros([BLOCK_V // 4], tl.int32), tl.zeros([BLOCK_V // 4, 4], tl.float32))

    @triton.jit
    def _segment_block_tl(v0, BLOCK_V: tl.constexpr):
        """The segments of the block starting at v0 and their entries: (segment [S], v [S, 4])."""
        segment = v0 // 4 + tl.arange(0, BLOCK_V // 4)
        return segment, v0 + tl.arange(0, BLOCK_V // 4)[:, None] * 4 + tl.arange(0, 4)[None, :]

    @triton.jit
    def _segment_pick_tl(weights, segment, state):
        """The token each segment's race picks within it: down its pair tree, with the uniform of draw 2s+1."""
        w_even, w_odd = _pair_halves(weights, 2)
        pair_0, pair_1 = tl.split(w_even + w_odd)
        u = (_draw_bits_tl(state, 2 * segment + 1) >> 8).to(tl.float32) * 5.960464477539063e-08
        threshold, node = _descend(pair_0, pair_1, u * (pair_0 + pair_1), tl.zeros_like(segment))
        threshold, node = _descend(_column(w_even, node, 2), _column(w_odd, node, 2), threshold, node)
        return segment * 4 + node

    @triton.jit
    def _rejection_sample_kernel(
        p_ptr, draft_ptr, q_ptr, seed_ptr, offset_ptr, bonus_ptr, out_ptr, counters_ptr, workspace_ptr,
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
        accept_bits = _draw_bits_tl(_row_state_tl(seed, offset + i, i * 0 + 2), i * 0)  # purpose ACCEPT, index 0
        u = (accept_bits >> 8).to(tl.float32) * 5.960464477539063e-08
        accepted = valid & (u * q_x < p_x)
        first_rejected = tl.min(tl.where(in_k & (~accepted), i, k))

        # Race at the first rejected position (residual) or at position k (bonus). The race state of every
        # candidate position is hashed while the loads above are in flight; j only selects one.
        race_states = _row_state_tl(seed, offset + i, tl.where(i < k, 3, 4))  # RESIDUAL or BONUS
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
            ticket = tl.atomic_add(workspace_ptr + row * 2 + 1, 1, sem="acq_rel")
            is_last = ticket == tl.num_programs(1) - 1
            if is_last:
                packed = tl.atomic_xchg(workspace_ptr + row * 2, 0, sem="relaxed")
                tl.store(workspace_ptr + row * 2 + 1, 0)
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
            tl.store(out_ptr + row * (k + 1) + i, out.to(out_ptr.dtype.element_ty), mask=i <= k)
            if COUNT:
                add_counters_tl(counters_ptr, tl.sum(accepted.to(tl.int64), axis=0),
                                tl.sum(((i <= k) & (out != -1)).to(tl.int64), axis=0), k)

    @triton.jit
    def _sample_draft_kernel(
        logits_ptr, temperature_ptr, seed_ptr, position_ptr, out_ptr, probs_ptr,
        vocab, logits_stride, temperature_stride, seed_stride, position_stride, probs_stride,
        WITH_PROBS: tl.constexpr, BLOCK_V: tl.constexpr, FAST_LOG: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        temperature = tl.load(temperature_ptr + row * temperature_stride)
        is_random = temperature > 0
        state = _row_state_tl(tl.load(seed_ptr + row * seed_stride), tl.load(position_ptr + row * position_stride),
                              tl.zeros([], tl.int32) + 1)  # purpose DRAFT
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
                key = z - _log_tl(_exponential_tl(_draw_bits_tl(state, v), FAST_LOG), FAST_LOG)
            else:
                z = x
                key = x
            # Ties (-inf keys included) go to the lower index; a lane visits indices in increasing order.
            better = in_row & ((key > best_key) | ((key == best_key) & (v < best_idx)))
            best_key = tl.where(better, key, best_key)
            best_idx = tl.where(better, v, best_idx)
            if WITH_PROBS:
                new_max = tl.maximum(lane_max, z)
                finite = new_max > float("-inf")  # exp(-inf - -inf) would be NaN
                lane_sum = tl.where(finite, lane_sum * tl.exp(lane_max - new_max) + tl.exp(z - new_max), 0.0)
                lane_max = new_max
                lane_nan = lane_nan | (z != z)
        top = tl.max(best_key)
        token = tl.min(tl.where(best_key == top, best_idx, vocab))
        token = tl.minimum(token, vocab - 1)  # all-NaN rows: stay in range
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


def _plan_rejection(batch: int, vocab: int, device: torch.device, num_chunks=None, block_v=None):
    """(BLOCK_V, chunk_len, num_chunks): a row's V is split into chunks of at most _MAX_CHUNK entries, and into
    more when the batch is too small to give every SM _PROGRAMS_PER_SM programs (chunks of >= BLOCK_V)."""
    block_v = block_v or min(_BLOCK_V, max(16, triton.next_power_of_2(vocab)))
    if num_chunks is None:
        if device.type != "cuda":
            num_chunks = 1
        else:
            wanted = max(triton.cdiv(_PROGRAMS_PER_SM * sm_count(device), batch), triton.cdiv(vocab, _MAX_CHUNK))
            num_chunks = max(1, min(wanted, triton.cdiv(vocab, block_v)))
    chunk_len = triton.cdiv(triton.cdiv(vocab, num_chunks), block_v) * block_v
    return block_v, chunk_len, triton.cdiv(vocab, chunk_len)


def _launch_rejection(target_probs, draft_token_ids, draft_probs, seeds, offsets, bonus_token_ids, counters,
                      num_chunks=None, block_v=None):
    batch, k = draft_token_ids.shape
    vocab = target_probs.shape[2]
    out = torch.empty((batch, k + 1), dtype=draft_token_ids.dtype, device=draft_token_ids.device)
    if batch == 0:
        return out
    block_v, chunk_len, num_chunks = _plan_rejection(batch, vocab, out.device, num_chunks, block_v)
    split = num_chunks > 1
    # Per row: [max packed race winner, arrival ticket], zero between calls.
    workspace = zeroed_scratch(out.device, 2 * batch) if split else out
    has_q = draft_probs is not None
    has_bonus = bonus_token_ids is not None
    _rejection_sample_kernel[(batch, num_chunks)](
        target_probs, draft_token_ids, draft_probs if has_q else target_probs, seeds, offsets,
        bonus_token_ids if has_bonus else seeds, out, out if counters is None else counters, workspace,
        k, vocab, chunk_len,
        target_probs.stride(0), target_probs.stride(1), draft_token_ids.stride(0),
        draft_probs.stride(0) if has_q else 0, draft_probs.stride(1) if has_q else 0,
        seeds.stride(0), offsets.stride(0), bonus_token_ids.stride(0) if has_bonus else 0,
        HAS_Q=has_q, HAS_BONUS=has_bonus, COUNT=counters is not None, SPLIT=split,
        BLOCK_K=triton.next_power_of_2(k + 1), BLOCK_V=block_v, NUM_STAGES=_NUM_STAGES, FAST_LOG=out.is_cuda,
        num_warps=_NUM_WARPS,
    )
    return out


def _rejection_sample_triton(target_probs, draft_token_ids, draft_probs, seeds, offsets, bonus_token_ids=None):
    _check_rejection_inputs(target_probs, draft_token_ids, draft_probs, seeds, offsets, bonus_token_ids)
    return _launch_rejection(target_probs, draft_token_ids, draft_probs, seeds, offsets, bonus_token_ids, None)


def _rejection_sample_counted_triton(target_probs, draft_token_ids, draft_probs, seeds, offsets, bonus_token_ids,
                                     counters):
    _check_rejection_inputs(target_probs, draft_token_ids, draft_probs, seeds, offsets, bonus_token_ids, counters)
    return _launch_rejection(target_probs, draft_token_ids, draft_probs, seeds, offsets, bonus_token_ids, counters)


def _launch_draft(logits, temperature, seeds, positions, probs, block_v=None):
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    with_probs = probs is not None
    _sample_draft_kernel[(rows,)](
        logits, temperature, seeds, positions, out, probs if with_probs else out,
        vocab, logits.stride(0), temperature.stride(0), seeds.stride(0), positions.stride(0),
        probs.stride(0) if with_probs else 0,
        WITH_PROBS=with_probs, BLOCK_V=block_v or min(_DRAFT_BLOCK_V, max(16, triton.next_power_of_2(vocab))),
        FAST_LOG=out.is_cuda, num_warps=_DRAFT_NUM_WARPS,
    )
    return out


def _sample_draft_triton(logits, temperature, seeds, positions):
    _check_draft_inputs(logits, temperature, seeds, positions)
    return _launch_draft(logits, temperature, seeds, positions, None)


def _sample_draft_with_probs_triton(logits, temperature, seeds, positions, probs):
    _check_draft_inputs(logits, temperature, seeds, positions, probs)
    return _launch_draft(logits, temperature, seeds, positions, probs)


register_cuda("rejection_sample", _rejection_sample_triton)
register_cuda("rejection_sample.counted", _rejection_sample_counted_triton)
register_cuda("sample_draft", _sample_draft_triton)
register_cuda("sample_draft.with_probs", _sample_draft_with_probs_triton)

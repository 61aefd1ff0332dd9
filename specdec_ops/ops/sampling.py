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
layout (ops/output.py): accepted prefix, the residual token at column
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
of the float32 logits, lowest index on ties. A NaN logit counts as the largest
value, as in torch.argmax: a row holding NaN gives the index of its first NaN,
greedy or random, in the reference and both kernels. Greedy and random rows mix in one
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
32-bit words (seed lo, seed hi, position lo, position hi, purpose, index)
(ops/counter_hash.py), where

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
(csrc/sampling.cpp) races only the one rejected/bonus row; the CUDA kernel
(kernels/sampling.py, which describes it) is one Triton launch.
"""
from __future__ import annotations

import torch

from .._library import register_fake
from .checks import INT_DTYPES, check_counters, check_size, check_tensor
from .counter_hash import (  # noqa: F401  (the purposes and the hash are part of this contract)
    ACCEPT,
    BONUS,
    DRAFT,
    RESIDUAL,
    exponential_from_bits,
    random_bits,
    uniform_from_bits,
)
from .output import create_output_reference, empty_output_row

PROB_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LOGIT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
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
    """Verifies k draft tokens per request by speculative sampling; see the module docstring.

    Args:
        target_probs: [B, k+1, V], float32, float16 or bfloat16 (read as float32), unit last stride, k >= 1, V >= 1.
            The target's distributions p at the k draft positions and the bonus position.
        draft_token_ids: [B, k], int32 or int64, unit last stride. Ids outside [0, V) are rejected.
        draft_probs: [B, k, V], float32, float16 or bfloat16, unit last stride, or None (a deterministic draft: q is
            one-hot at the draft token).
        seeds: [B], int64, any stride. Each request's seed.
        offsets: [B], int64, any stride. The position of each request's first draft token in its random stream.
        bonus_token_ids: [B] or [B, 1], int32 or int64, or None (the bonus is drawn from p_k).
        counters: [3], int64, or None. When given (the ``.counted`` overload), (accepted, emitted, proposed) token
            counts are added to it in place.

    Returns:
        [B, k+1], dtype of ``draft_token_ids``: the create_output layout.
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
    *,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Samples one token per row (greedy where temperature <= 0); see the module docstring.

    Args:
        logits: [n, V], float16, bfloat16, float32 or float64 (used as float32), unit last stride, V >= 1.
        temperature: [n], float32, any stride. A row with temperature <= 0 (or NaN) is greedy.
        seeds: [n], int64, any stride. Each row's seed.
        positions: [n], int64, any stride. Each row's position in its random stream.
        probs: [n, V], float32, unit last stride, or None. When given (the ``.with_probs`` overload), it receives
            the distribution sampled from: softmax(logits / T) (one-hot at the argmax for greedy rows), or with
            filters the processed distribution; the q that rejection sampling takes.
        top_k: [n], int32 or int64, or None (off): keep each row's top_k most probable tokens (0 = off).
        top_p: [n], float32, or None (off): keep the most probable tokens up to this mass (1 = off).
        min_p: [n], float32, or None (off): keep tokens of at least min_p times the top probability (0 = off).
            With any of the three given, this is `sample_draft_filtered` (the ones not given are off): the
            processed distribution of `specdec_ops.ops.logits_sampling`, which rejection_sample_logits verifies
            against.

    Returns:
        [n], int64: the sampled tokens, each in [0, V).
    """
    if top_k is not None or top_p is not None or min_p is not None:
        from .logits_sampling import sample_draft_filtered

        return sample_draft_filtered(logits, temperature, top_k, top_p, min_p, seeds, positions, probs)
    if probs is None:
        return torch.ops.specdec.sample_draft.default(logits, temperature, seeds, positions)
    return torch.ops.specdec.sample_draft.with_probs(logits, temperature, seeds, positions, probs)


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
    """Plain PyTorch statement of the contract: every position's residual race is materialized. Arguments and
    result as `rejection_sample`'s."""
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
    """Plain PyTorch statement of the contract (writes ``probs`` when given). Arguments and result as
    `sample_draft`'s."""
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


def check_rejection_inputs(target_probs, draft_token_ids, draft_probs, seeds, offsets, bonus_token_ids,
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


def check_draft_inputs(logits, temperature, seeds, positions, probs=None) -> None:
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


@register_fake(_RS, ("default", "counted"))
def _rejection_sample_fake(target_probs, draft_token_ids, draft_probs, seeds, offsets, bonus_token_ids=None,
                           counters=None):
    check_rejection_inputs(target_probs, draft_token_ids, draft_probs, seeds, offsets, bonus_token_ids, counters)
    return empty_output_row(draft_token_ids)


@register_fake(_SD, ("default", "with_probs"))
def _sample_draft_fake(logits, temperature, seeds, positions, probs=None):
    check_draft_inputs(logits, temperature, seeds, positions, probs)
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)

"""Verification and draft sampling straight from logits, with per-request temperature, top-k, top-p and min-p.

Ops: ``specdec::rejection_sample_logits`` (overloads ``default``, ``counted``, ``logprobs``,
``logprobs_counted``) and ``specdec::sample_draft_filtered`` (``default``, ``with_probs``). This module is the
contract: semantics, typed wrappers, the plain-PyTorch references, input checks and the fake kernels. It never
imports triton; the CPU kernels are csrc/logits_sampling.cpp, the CUDA kernels specdec_ops/kernels/logits_sampling.py.

The processed distribution
--------------------------
Every request b has its sampling parameters: ``temperature[b]``, ``top_k[b]``, ``top_p[b]``, ``min_p[b]``; a filter
passed as None is off for every request (the same result as its off value in every row, and on the GPU no filter
pass runs when all three are None: engines pass None when no request of the batch sets a filter). A logit
row x (float32, whatever the input dtype) of that request is turned into the distribution that is sampled, for the
target and the draft alike:

1. A temperature <= 0 or NaN makes the row *greedy*: its distribution is one-hot at ``argmax(x)``, lowest index on
   ties (as ``torch.argmax``); the filters do not apply. Otherwise ``z = x / temperature`` (float32 division).
2. ``m = max(z)``, ``e_v = exp(z_v - m)`` (float32).
3. top-k: with ``0 < top_k < V``, ``tau_k`` is the top_k-th largest z (counting repeats); otherwise top-k is off and
   ``tau_k = min(z)``. The top-k set is ``{v : z_v >= tau_k}``: every token tied with the k-th largest is kept, so it
   may hold more than top_k tokens.
4. top-p, on the top-k distribution: with ``top_p < 1``, let ``M(t) = sum_{z_v >= t} e_v`` and ``M_k = M(tau_k)``;
   ``tau_p`` is the largest z value t with ``M(t) >= top_p * M_k``. Ties again stay together: the kept set is the
   smallest set of the form {z_v >= t} whose mass reaches top_p of the top-k mass. ``top_p <= 0`` keeps only the
   tokens tied with the maximum; ``top_p >= 1`` or NaN is off.
5. min-p, relative to the most probable token: with ``min_p > 0``, keep only ``e_v >= min(min_p, 1)`` (that is
   p_v >= min_p * p_max, which no renormalization changes). ``min_p <= 0`` or NaN is off; min_p > 1 acts as 1.
6. The kept set is ``{v : z_v >= max(tau_k, tau_p), e_v >= min_p}`` (all three filters are upper sets of z, so the
   order of steps 3-5 only matters through top-p's reference mass M_k). ``S = sum of e over the kept set`` and the
   processed distribution is ``p_v = e_v / S`` on the kept set, 0 elsewhere (float32 division). The maximum is always
   kept, so S >= 1.

No value of a parameter is an error and none is read on the host (that would be a sync): the clamps above are the
whole treatment (top_k < 0 is off like 0, top_k >= V is off). `check_sampling_params` raises ValueError for values
outside the documented ranges, for callers who want that and can afford a sync.

Float rounding: the threshold and the normalizer are sums of float exponentials. The reference sums in float64 along
the sorted order (``processed_distribution``), the CPU kernel the same way, the Triton kernel in float32 in its own
order, and torch.exp, glibc's expf and the GPU's exp may differ in the last bit (the GPU's float32 division
``x / T``, Triton's ``div.full.f32``, in the last two). So the kernels equal the reference exactly except where a
cumulative mass lies within rounding of ``top_p * M_k``, an ``e_v`` within rounding of ``min_p``, a probability
within rounding of an accept threshold, two race keys within rounding of each other, or two distinct logits whose
``x / T`` lie within rounding of each other at a cut-off; ties of *values* (equal logits) are exact everywhere. The
tests pick inputs where this does not happen, and compare logprobs within 2e-5.

rejection_sample_logits(target_logits, draft_token_ids, draft_probs, draft_logits, temperature, top_k, top_p,
min_p, seeds, offsets, block_verification=False)
----------------------------------------------------------------------------------------------------------------
``p_i`` is the processed distribution of ``target_logits[b, i]`` (row k is the bonus position). The draft's
distribution ``q_i`` is the processed distribution of ``draft_logits[b, i]`` with the same parameters, or
``draft_probs[b, i]`` read as given (e.g. what `sample_draft_filtered` wrote), or, with neither, one-hot at the
draft token (a deterministic drafter). Then exactly `specdec_ops.rejection_sample` on (p, q), with its random
streams (ACCEPT, RESIDUAL, BONUS; positions ``offsets[b] + i``) and segmented race, for the rows with a positive
temperature. Greedy rows are greedy verification: position i is accepted iff ``draft_token_ids[b, i]`` equals the
argmax of target row i, the token at the first mismatch (or the bonus) is that row's argmax. Mathematically this is
what speculative sampling does with a one-hot p; it is stated on its own so that an unnormalized draft_probs row
cannot change it. The emitted tokens are distributed exactly as tokens sampled from the processed target
distributions.

``block_verification=True`` replaces the token-wise rule by block verification (Sun et al. 2024, "Block
Verification Accelerates Speculative Decoding"), also lossless and, in expectation, accepting at least as many
tokens. With ``x_i`` the draft tokens and ``u_i`` the same ACCEPT uniforms (position offsets[b] + i):

- weights ``w_0 = 1`` and, for i = 1..k, ``w_i = 0`` if ``w_{i-1} == 0``, or ``p_{i-1}(x_{i-1}) == 0``, or
  x_{i-1} is outside [0, V); else ``1`` if ``q_{i-1}(x_{i-1}) <= w_{i-1} * p_{i-1}(x_{i-1})``, else
  ``(w_{i-1} * p_{i-1}(x_{i-1})) / q_{i-1}(x_{i-1})`` (float32). A weight that reached 0 stays 0 (without the first
  condition a next draft with ``q_{i-1}(x_{i-1}) == 0`` would compare 0 <= 0 and revive it to 1);
- for i = 1..k-1 the residual mass ``R_i = sum_v max(w_i * p_i(v) - q_i(v), 0)``; the block may stop at i iff
  ``w_i > 0`` and ``u_{i-1} * (R_i + (1 - w_i)) < R_i``; it may stop at k iff ``u_{k-1} < w_k``;
- tau = the largest i that may stop (0 if none): the first tau draft tokens are accepted, and the token at column
  tau is drawn by the segmented race from ``max(w_tau * p_tau - q_tau, 0)`` (RESIDUAL stream, position
  offsets[b] + tau; p_tau itself if that has no positive key) when tau < k, or from p_k (BONUS stream) when tau = k.

So every accepted draft is an id in [0, V) with ``p_i(x_i) > 0``, and no draft at or after the first invalid id
(or the first with target probability 0) is ever emitted. With a non-negative q, ``w_i = 0`` gives ``R_i = 0``, so
the ``w_i > 0`` condition only guards against draft_probs with negative entries. For tau = 0 and w = 1 this is the
token-wise residual. Greedy rows are greedy verification in both modes.

Random streams and ``offsets``: in token-wise mode advance ``offsets`` per round by (at least) the number of emitted
tokens, as `specdec_ops.rejection_sample` says. With ``block_verification=True`` advance it by k + 1 per round:
the stop point tau is the *largest* position that may stop, so the ACCEPT uniforms at positions after tau also
decided the round (each of them was found not to allow a stop), and reusing them in the next round, as advancing
by the emitted count tau + 1 would, makes that round depend on this one's outcome and breaks losslessness.

Output: [B, k+1] in the create_output layout (specdec_ops/ops/output.py), dtype of ``draft_token_ids``. The
``counted`` overloads add to the int64 ``counters`` [3]: (accepted, emitted, B*k), where accepted counts, as
rejection_sample does, the accept decisions at ALL k positions in token-wise mode (greedy rows: the matches), and
the accepted prefix length tau in block mode (per-position decisions do not exist there). The ``logprobs``
overloads also return float32 [B, k+1]: the log-probability of each emitted token under the processed target
distribution of its position, ``(z_t - m) - log(S)`` (0 for greedy rows, whose distribution is one-hot), and 0
where the output is -1, so that a row's sum is the log-probability of what it emitted.

Inputs: ``target_logits`` [B, k+1, V] float32/bfloat16/float16; ``draft_token_ids`` [B, k] int32/int64 (k >= 1;
ids outside [0, V) are rejected: never accepted nor emitted; every id is clamped into [0, V) before any load or
logprob computation, so that no input value reads out of bounds); ``draft_probs`` [B, k, V]
float32/bfloat16/float16 or None; ``draft_logits`` [B, k, V] float32/bfloat16/float16 or None (at most one of the
two); ``temperature`` [B] float32; ``top_k`` [B] int32/int64; ``top_p`` [B] float32; ``min_p`` [B] float32 (each
of the three filters, or None);
``seeds`` and ``offsets`` [B] int64. The
[B, ., V] tensors need a unit last stride (any other strides, a batch stride of 0 included); the [B] tensors may
have any stride. Rows with NaN or +inf logits, or all -inf, give unspecified tokens, always in [0, V).

sample_draft_filtered(logits, temperature, top_k, top_p, min_p, seeds, positions) and .with_probs(..., probs)
-------------------------------------------------------------------------------------------------------------
Row r of ``logits`` [n, V] (float32/bfloat16/float16) samples one token from its processed distribution (parameters
[n], dtypes as above): greedy rows take the argmax; other rows the Gumbel race of `specdec_ops.sample_draft`
restricted to the kept set, ``argmax_{v kept} z_v - log(E_v)`` with E_v from the DRAFT stream at (seed, position,
index v). With every filter off the token equals sample_draft's. Returns int64 [n]. ``with_probs`` writes the
processed distribution (float32, one-hot for greedy rows) into ``probs`` [n, V] (unit last stride, so a column
``buf[:, step, :]`` works): the q that rejection_sample_logits takes as draft_probs, so that the pair is lossless.
"""
from __future__ import annotations

import torch

from .checks import INT_DTYPES, check_counters, check_size, check_tensor
from .._library import register_fake
from .output import create_output_reference
from .sampling import (ACCEPT, BONUS, DRAFT, RESIDUAL, _segment_race, exponential_from_bits, random_bits,
                       uniform_from_bits)

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_RS = "rejection_sample_logits"
_SD = "sample_draft_filtered"


# --- typed wrappers -------------------------------------------------------------------------------------------


def rejection_sample_logits(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    *,
    draft_probs: torch.Tensor | None = None,
    draft_logits: torch.Tensor | None = None,
    block_verification: bool = False,
    counters: torch.Tensor | None = None,
    return_logprobs: bool = False,
):
    """Verifies k draft tokens per request from target logits and sampling parameters (see the module docstring).

    Args:
        target_logits: [B, k+1, V] float32/bfloat16/float16, unit last stride; row k is the bonus position.
        draft_token_ids: [B, k] int32/int64, unit last stride.
        temperature: [B] float32; <= 0 (or NaN) is a greedy request.
        top_k: [B] int32/int64; <= 0 or >= V is off. None: off for every request.
        top_p: [B] float32; >= 1 (or NaN) is off. None: off for every request.
        min_p: [B] float32; <= 0 (or NaN) is off. None: off for every request.
        seeds: [B] int64.
        offsets: [B] int64, the position of the first draft token in the random streams. Advance it every round:
            token-wise, by at least the number of emitted tokens (as rejection_sample); with block_verification,
            by k + 1, because every ACCEPT uniform u_0..u_{k-1} may take part in choosing the stop point (those
            after it were found not to stop), so advancing by the emitted count would reuse numbers that already
            decided a round and break losslessness.
        draft_probs: [B, k, V] float32/bfloat16/float16 or None: the draft's (already processed) distribution.
        draft_logits: [B, k, V] float32/bfloat16/float16 or None: the draft's logits, processed like the target's.
        block_verification: block verification instead of token-wise rejection sampling.
        counters: int64 [3] or None: (accepted, emitted, proposed) added in place.
        return_logprobs: also return the float32 [B, k+1] logprobs of the emitted tokens.

    Returns:
        [B, k+1] tokens (dtype of draft_token_ids), and with return_logprobs the [B, k+1] float32 logprobs.
    """
    args = (target_logits, draft_token_ids, draft_probs, draft_logits, temperature, top_k, top_p, min_p, seeds,
            offsets, block_verification)
    op = torch.ops.specdec.rejection_sample_logits
    if return_logprobs:
        if counters is None:
            return op.logprobs(*args)
        return op.logprobs_counted(*args, counters)
    if counters is None:
        return op.default(*args)
    return op.counted(*args, counters)


def sample_draft_filtered(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Samples one token per row from its processed distribution (module docstring); returns int64 [n], each in
    [0, V). `sample_draft(..., top_k=, top_p=, min_p=)` calls this.

    Args:
        logits: [n, V], float32, bfloat16 or float16, unit last stride.
        temperature: [n], float32. A row with temperature <= 0 is greedy (its argmax; filters ignored).
        top_k: [n], int32 or int64. Keep the top_k most probable tokens (0 = off; ties at the cut-off kept).
        top_p: [n], float32. Keep the most probable tokens up to this probability mass (1 = off).
        min_p: [n], float32. Keep tokens of probability >= min_p times the most probable one's (0 = off).
            Each of the three filters may be None: off for every row.
        seeds: [n], int64. Each row's seed.
        positions: [n], int64. Each row's position in its random stream (the random numbers of sample_draft at
            the same seed and position).
        probs: [n, V], float32, unit last stride, or None. Receives the processed distribution (one-hot for
            greedy rows): the q the drafts were drawn from.
    """
    if probs is None:
        return torch.ops.specdec.sample_draft_filtered.default(logits, temperature, top_k, top_p, min_p, seeds,
                                                               positions)
    return torch.ops.specdec.sample_draft_filtered.with_probs(logits, temperature, top_k, top_p, min_p, seeds,
                                                              positions, probs)


def check_sampling_params(temperature: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                          min_p: torch.Tensor | None, vocab: int | None = None) -> None:
    """Raises ValueError for parameter values outside their documented ranges (reads them: a host sync).

    The ops never raise for values (they clamp, see the module docstring); call this where a sync is affordable
    to reject a request instead: temperature must not be NaN, top_k >= 0 (and <= vocab when given), top_p in
    (0, 1], min_p in [0, 1]. A filter that is None passes.
    """
    if bool(torch.isnan(temperature).any()):
        raise ValueError("sampling parameters: temperature must not be NaN (<= 0 means greedy)")
    if top_k is not None and (bool((top_k < 0).any()) or (vocab is not None and bool((top_k > vocab).any()))):
        raise ValueError(f"sampling parameters: top_k must be in [0, {vocab if vocab is not None else 'V'}] "
                         f"(0 = off), got {top_k.tolist()}")
    if top_p is not None and not bool(((top_p > 0) & (top_p <= 1)).all()):
        raise ValueError(f"sampling parameters: top_p must be in (0, 1] (1 = off), got {top_p.tolist()}")
    if min_p is not None and not bool(((min_p >= 0) & (min_p <= 1)).all()):
        raise ValueError(f"sampling parameters: min_p must be in [0, 1] (0 = off), got {min_p.tolist()}")


# --- references ---------------------------------------------------------------------------------------------


class Processed:
    """The processed distribution of logit rows [B, R, V] (module docstring), with what the kernels keep per row.

    Attributes: greedy [B, 1] bool; argmax [B, R] int64; z, e [B, R, V] float32; m [B, R, 1] float32;
    keep [B, R, V] bool; mass [B, R, 1] float64 (S); probs [B, R, V] float32 (one-hot for greedy rows).
    """

    def __init__(self, logits, temperature, top_k, top_p, min_p):
        top_k, top_p, min_p = _filters_or_off(temperature, top_k, top_p, min_p)
        x = logits.float()
        vocab = x.shape[-1]
        t = temperature.float()[:, None]  # [B, 1]
        self.greedy = ~(t > 0)
        z = x / torch.where(self.greedy, 1.0, t)[..., None]
        m = z.amax(-1, keepdim=True)
        e = torch.exp(z - m)
        sorted_z, order = torch.sort(z, dim=-1, descending=True, stable=True)
        cumulative = e.gather(-1, order).double().cumsum(-1)  # M(sorted_z[j]) once j is the last of its ties
        k = top_k.long()[:, None, None]
        k_on = (k > 0) & (k < vocab)
        k_eff = torch.where(k_on, k, vocab).expand(*z.shape[:-1], 1)
        tau_k = sorted_z.gather(-1, k_eff - 1)
        count_k = (z >= tau_k).sum(-1, keepdim=True).clamp(min=1)  # 0 only in a NaN row
        mass_k = cumulative.gather(-1, count_k - 1)
        p = top_p.float()[:, None, None]
        target = p.double() * mass_k
        first = (cumulative < target).sum(-1, keepdim=True).clamp(max=vocab - 1)
        tau_p = sorted_z.gather(-1, first)
        tau = torch.where(p < 1, torch.maximum(tau_k, tau_p), tau_k)
        mp = min_p.float()[:, None, None]
        mp = torch.where(mp > 0, mp.clamp(max=1.0), 0.0)
        keep = (z >= tau) & (e >= mp)
        mass = torch.where(keep, e.double(), 0.0).sum(-1, keepdim=True)
        probs = torch.where(keep, e / mass.float(), 0.0)
        self.argmax = x.argmax(-1)
        one_hot = torch.nn.functional.one_hot(self.argmax, vocab).float()
        self.probs = torch.where(self.greedy[..., None], one_hot, probs)
        self.z, self.e, self.m, self.keep, self.mass = z, e, m, keep, mass

    def logprob(self, row: int, tokens: torch.Tensor) -> torch.Tensor:
        """float32 [B]: log of the processed probability of tokens [B] (in [0, V)) at row `row`."""
        t = tokens[:, None]
        z = self.z[:, row].gather(-1, t)[:, 0]
        kept = self.keep[:, row].gather(-1, t)[:, 0]
        value = (z - self.m[:, row, 0]).double() - torch.log(self.mass[:, row, 0])
        value = torch.where(kept, value, -torch.inf).float()
        return torch.where(self.greedy[:, 0], 0.0, value)


def _filters_or_off(temperature, top_k, top_p, min_p):
    """The three filter tensors, one given as None replaced by its off value for every request (the references'
    reading of None)."""
    batch, device = temperature.shape[0], temperature.device
    return (torch.zeros(batch, dtype=torch.int64, device=device) if top_k is None else top_k,
            torch.ones(batch, device=device) if top_p is None else top_p,
            torch.zeros(batch, device=device) if min_p is None else min_p)


def processed_distribution(logits, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """The processed distribution (module docstring) in plain PyTorch, float32 with the shape of logits.

    Args:
        logits: [B, V] or [B, R, V] float32/bfloat16/float16 (R rows per request share its parameters).
        temperature, top_p, min_p: [B] float32. top_k: [B] int32/int64. A filter may be None (off).
    """
    squeeze = logits.dim() == 2
    probs = Processed(logits[:, None] if squeeze else logits, temperature, top_k, top_p, min_p).probs
    return probs[:, 0] if squeeze else probs


def rejection_sample_logits_reference(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    *,
    draft_probs: torch.Tensor | None = None,
    draft_logits: torch.Tensor | None = None,
    block_verification: bool = False,
    counters: torch.Tensor | None = None,
    return_logprobs: bool = False,
):
    """Plain PyTorch statement of the contract: materializes p, q and every position's race.

    Arguments, shapes, dtypes and returns as `rejection_sample_logits`.
    """
    batch, k = draft_token_ids.shape
    vocab = target_logits.shape[-1]
    target = Processed(target_logits, temperature, top_k, top_p, min_p)
    p = target.probs
    draft = draft_token_ids.long()
    valid = (draft >= 0) & (draft < vocab)
    safe = torch.where(valid, draft, 0)
    if draft_logits is not None:
        q = Processed(draft_logits, temperature, top_k, top_p, min_p).probs
    elif draft_probs is not None:
        q = draft_probs.float()
    else:
        q = torch.nn.functional.one_hot(safe, vocab).float() * valid[..., None]
    greedy = target.greedy[:, 0]
    positions = offsets[:, None] + torch.arange(k + 1, device=draft.device)
    seeds2 = seeds[:, None]
    p_x = torch.where(valid, p[:, :k].gather(2, safe[..., None])[..., 0], 0.0)
    q_x = torch.where(valid, q.gather(2, safe[..., None])[..., 0], 0.0)
    u = uniform_from_bits(random_bits(seeds2, positions[:, :k], ACCEPT, 0))
    matches = valid & (draft == target.argmax[:, :k])

    weight = torch.ones(batch, k + 1)
    if block_verification:
        for i in range(1, k + 1):
            previous = weight[:, i - 1]
            scaled = previous * p_x[:, i - 1]
            ratio = torch.where(q_x[:, i - 1] <= scaled, 1.0, scaled / q_x[:, i - 1])
            # Once 0, a weight stays 0: q_{i-1}(x_{i-1}) == 0 must not turn 0 <= 0 into a weight of 1.
            dead = (previous == 0) | (p_x[:, i - 1] == 0) | ~valid[:, i - 1]
            weight[:, i] = torch.where(dead, 0.0, ratio)
        may_stop = torch.zeros(batch, k + 1, dtype=torch.bool)
        for i in range(1, k):
            residual = torch.clamp(weight[:, i, None] * p[:, i] - q[:, i], min=0)
            mass = residual.double().sum(-1).float()
            may_stop[:, i] = (weight[:, i] > 0) & (u[:, i - 1] * (mass + (1 - weight[:, i])) < mass)
        may_stop[:, k] = u[:, k - 1] < weight[:, k]
        stop = torch.where(may_stop.any(1), k - may_stop.flip(1).int().argmax(1), 0)  # the last that may stop
        first_mismatch = torch.where((~matches).any(1), (~matches).int().argmax(1), k)
        stop = torch.where(greedy, first_mismatch, stop)
        accepted = torch.arange(k) < stop[:, None]
    else:
        accepted = torch.where(greedy[:, None], matches, valid & (u * q_x < p_x))

    q_full = torch.cat([q, torch.zeros_like(p[:, :1])], dim=1)  # the bonus race is position k with q = 0
    tokens = []
    for i in range(k + 1):
        purpose = RESIDUAL if i < k else BONUS
        residual = torch.clamp(weight[:, i, None] * p[:, i] - q_full[:, i], min=0)
        residual_token, has_residual = _segment_race(residual, seeds2, positions[:, i:i + 1], purpose)
        fallback_token, has_fallback = _segment_race(p[:, i], seeds2, positions[:, i:i + 1], purpose)
        token = torch.where(has_residual, residual_token, torch.where(has_fallback, fallback_token, 0))
        token = torch.where(greedy, target.argmax[:, i], token.clamp(0, vocab - 1))
        tokens.append(token)
    token = torch.stack(tokens, dim=1)
    out = create_output_reference(accepted, token[:, :k].to(draft_token_ids.dtype), draft_token_ids,
                                  token[:, k].to(draft_token_ids.dtype), counters=counters)
    if not return_logprobs:
        return out
    emitted = out != -1
    safe_out = torch.where(emitted, out.long(), 0).clamp(0, vocab - 1)  # emitted ids are in [0, V); never read past
    logprobs = torch.stack([target.logprob(c, safe_out[:, c]) for c in range(k + 1)], dim=1)
    return out, torch.where(emitted, logprobs, 0.0)


def sample_draft_filtered_reference(logits, temperature, top_k, top_p, min_p, seeds, positions,
                                    probs: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch statement of the contract (writes ``probs`` when given); arguments as `sample_draft_filtered`."""
    d = Processed(logits[:, None], temperature, top_k, top_p, min_p)
    vocab = logits.shape[-1]
    bits = random_bits(seeds[:, None], positions[:, None], DRAFT, torch.arange(vocab, device=logits.device))
    keys = torch.where(d.keep[:, 0], d.z[:, 0] - torch.log(exponential_from_bits(bits)), -torch.inf)
    token = torch.where(d.greedy[:, 0], d.argmax[:, 0], keys.argmax(-1))
    if probs is not None:
        probs.copy_(d.probs[:, 0])
    return token


# --- validation, shared by the fake kernels and the Triton launchers -----------------------------------------


def _check_params(op, batch, device, temperature, top_k, top_p, min_p, meaning):
    for name, t, dtypes in (("temperature", temperature, (torch.float32,)), ("top_k", top_k, INT_DTYPES),
                            ("top_p", top_p, (torch.float32,)), ("min_p", min_p, (torch.float32,))):
        if t is None and name != "temperature":  # a filter given as None is off
            continue
        check_tensor(op, name, t, ndim=1, dtypes=dtypes, device=device, unit_stride=False)
        check_size(op, name, t, 0, batch, meaning)


def check_rejection_inputs(target_logits, draft_token_ids, draft_probs, draft_logits, temperature, top_k, top_p,
                           min_p, seeds, offsets, counters=None) -> None:
    op = _RS
    check_tensor(op, "target_logits", target_logits, ndim=3, dtypes=LOGIT_DTYPES)
    device = target_logits.device
    batch, k_plus_1, vocab = target_logits.shape
    if k_plus_1 < 2:
        raise ValueError(f"{op}: argument 'target_logits' must have k+1 >= 2 positions in dimension 1, got shape "
                         f"{tuple(target_logits.shape)}")
    if vocab < 1:
        raise ValueError(f"{op}: argument 'target_logits' must have a vocabulary of V >= 1, got shape "
                         f"{tuple(target_logits.shape)}")
    check_tensor(op, "draft_token_ids", draft_token_ids, ndim=2, dtypes=INT_DTYPES, device=device)
    check_size(op, "draft_token_ids", draft_token_ids, 0, batch, "B, rows of target_logits")
    check_size(op, "draft_token_ids", draft_token_ids, 1, k_plus_1 - 1, "k, target_logits has k+1 positions")
    if draft_probs is not None and draft_logits is not None:
        raise ValueError(f"{op}: pass at most one of 'draft_probs' and 'draft_logits', got both")
    for name, t in (("draft_probs", draft_probs), ("draft_logits", draft_logits)):
        if t is None:
            continue
        check_tensor(op, name, t, ndim=3, dtypes=LOGIT_DTYPES, device=device)
        check_size(op, name, t, 0, batch, "B, rows of target_logits")
        check_size(op, name, t, 1, k_plus_1 - 1, "k, target_logits has k+1 positions")
        check_size(op, name, t, 2, vocab, "V, vocabulary of target_logits")
    _check_params(op, batch, device, temperature, top_k, top_p, min_p, "B, rows of target_logits")
    for name, t in (("seeds", seeds), ("offsets", offsets)):
        check_tensor(op, name, t, ndim=1, dtypes=(torch.int64,), device=device, unit_stride=False)
        check_size(op, name, t, 0, batch, "B, rows of target_logits")
    if counters is not None:
        check_counters(op, counters, device)


def check_draft_inputs(logits, temperature, top_k, top_p, min_p, seeds, positions, probs=None) -> None:
    op = _SD if probs is None else f"{_SD}.with_probs"
    check_tensor(op, "logits", logits, ndim=2, dtypes=LOGIT_DTYPES)
    device = logits.device
    rows, vocab = logits.shape
    if vocab < 1:
        raise ValueError(f"{op}: argument 'logits' must have a vocabulary of V >= 1, got shape {tuple(logits.shape)}")
    _check_params(op, rows, device, temperature, top_k, top_p, min_p, "n, rows of logits")
    for name, t in (("seeds", seeds), ("positions", positions)):
        check_tensor(op, name, t, ndim=1, dtypes=(torch.int64,), device=device, unit_stride=False)
        check_size(op, name, t, 0, rows, "n, rows of logits")
    if probs is not None:
        check_tensor(op, "probs", probs, ndim=2, dtypes=(torch.float32,), device=device)
        check_size(op, "probs", probs, 0, rows, "n, rows of logits")
        check_size(op, "probs", probs, 1, vocab, "V, columns of logits")


def _new_output(target_logits, draft_token_ids):
    batch, k = draft_token_ids.shape
    return draft_token_ids.new_empty((batch, k + 1))


@register_fake(_RS)
def _rejection_fake(target_logits, draft_token_ids, draft_probs, draft_logits, temperature, top_k, top_p, min_p,
                    seeds, offsets, block_verification=False):
    check_rejection_inputs(target_logits, draft_token_ids, draft_probs, draft_logits, temperature, top_k, top_p,
                           min_p, seeds, offsets)
    return _new_output(target_logits, draft_token_ids)


@register_fake(f"{_RS}.counted")
def _rejection_counted_fake(target_logits, draft_token_ids, draft_probs, draft_logits, temperature, top_k, top_p,
                            min_p, seeds, offsets, block_verification, counters):
    check_rejection_inputs(target_logits, draft_token_ids, draft_probs, draft_logits, temperature, top_k, top_p,
                           min_p, seeds, offsets, counters)
    return _new_output(target_logits, draft_token_ids)


@register_fake(f"{_RS}.logprobs")
def _rejection_logprobs_fake(target_logits, draft_token_ids, draft_probs, draft_logits, temperature, top_k, top_p,
                             min_p, seeds, offsets, block_verification=False):
    check_rejection_inputs(target_logits, draft_token_ids, draft_probs, draft_logits, temperature, top_k, top_p,
                           min_p, seeds, offsets)
    out = _new_output(target_logits, draft_token_ids)
    return out, out.new_empty(out.shape, dtype=torch.float32)


@register_fake(f"{_RS}.logprobs_counted")
def _rejection_logprobs_counted_fake(target_logits, draft_token_ids, draft_probs, draft_logits, temperature, top_k,
                                     top_p, min_p, seeds, offsets, block_verification, counters):
    check_rejection_inputs(target_logits, draft_token_ids, draft_probs, draft_logits, temperature, top_k, top_p,
                           min_p, seeds, offsets, counters)
    out = _new_output(target_logits, draft_token_ids)
    return out, out.new_empty(out.shape, dtype=torch.float32)


@register_fake(_SD)
def _draft_fake(logits, temperature, top_k, top_p, min_p, seeds, positions):
    check_draft_inputs(logits, temperature, top_k, top_p, min_p, seeds, positions)
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


@register_fake(f"{_SD}.with_probs")
def _draft_with_probs_fake(logits, temperature, top_k, top_p, min_p, seeds, positions, probs):
    check_draft_inputs(logits, temperature, top_k, top_p, min_p, seeds, positions, probs)
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)

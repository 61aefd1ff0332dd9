"""Sample inputs of the op tests, one maker per op family, seeded and deterministic.

Every maker returns CPU tensors (make_batch and make_step take a device) in the argument order of the op's wrapper.
"""
from __future__ import annotations

import math
import random

import torch

from specdec_ops.ops import verify


def make_batch(seed, num_reqs, *, max_query_len=9, long_query=False, max_model_len=4096, num_slots=None,
               ids_dtype=torch.int32, pos_dtype=torch.int64, qsl_dtype=torch.int32, misc_dtype=torch.int32,
               last_dtype=torch.int64, rejected_dtype=torch.int32, num_tokens=None, query_lens=None, device="cpu"):
    """A random target batch: query lengths, rejections, slot permutation, positions near max_model_len.

    With num_tokens, the token batch is padded to that length past the last request; query_lens, when given,
    sets the num_reqs query lengths.
    """
    gen = random.Random(seed)
    if query_lens is None:
        query_lens = [gen.randint(1, max_query_len) for _ in range(num_reqs)]
    query_lens = list(query_lens)
    if long_query and num_reqs:
        query_lens[gen.randrange(num_reqs)] = gen.randint(1000, 3000)  # a whole prompt as draft prefill
    pad_tokens = 0 if num_tokens is None else num_tokens - sum(query_lens)
    assert pad_tokens >= 0
    num_tokens = sum(query_lens)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    num_slots = num_slots or num_reqs + gen.randint(0, 5)
    idx_mapping = gen.sample(range(max(num_slots, 1)), num_reqs)
    positions, seq_lens = [], []
    for q in query_lens:
        # Some requests run into max_model_len so that clamping is exercised.
        start = gen.choice([0, gen.randint(0, max_model_len - 1), max_model_len - gen.randint(1, q + 2)])
        start = max(start, 0)
        positions.extend(range(start, start + q))
        seq_lens.append(start + q)
    num_rejected = [gen.randint(0, q) for q in query_lens]
    def t(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)
    return dict(
        input_ids=t([gen.randint(0, 50000) for _ in range(num_tokens + pad_tokens)], ids_dtype),
        positions=t(positions + [0] * pad_tokens, pos_dtype),
        query_start_loc=t(qsl, qsl_dtype),
        seq_lens=t(seq_lens, misc_dtype),
        idx_mapping=t(idx_mapping, misc_dtype),
        last_sampled=t([gen.randint(0, 50000) for _ in range(max(num_slots, 1))], last_dtype),
        num_rejected=t(num_rejected, rejected_dtype),
        max_model_len=max_model_len,
    )


def make_verified(seed, batch, k, *, token_dtype=torch.int64, substitute_dtype=None, accepted_dtype=torch.bool,
                  bonus_2d=True, pattern="random"):
    gen = torch.Generator().manual_seed(seed)
    if pattern == "random":  # non-causal: True after a False must be ignored
        accepted = torch.rand(batch, k, generator=gen) < 0.7
    elif pattern == "all":
        accepted = torch.ones(batch, k, dtype=torch.bool)
    elif pattern == "none":
        accepted = torch.zeros(batch, k, dtype=torch.bool)
    else:  # causal prefix of random length
        lengths = torch.randint(0, k + 1, (batch, 1), generator=gen)
        accepted = torch.arange(k)[None] < lengths
    if accepted_dtype != torch.bool:
        # nonzero means accepted: use values other than 1 as well, among them the sign bit
        # alone, whose low bits are all zero (a narrowing conversion would read it as 0)
        sign_bit = 128 if accepted_dtype == torch.uint8 else torch.iinfo(accepted_dtype).min
        values = torch.tensor([1, 2, sign_bit], dtype=accepted_dtype)
        accepted = accepted.to(accepted_dtype) * values[torch.randint(0, 3, (batch, k), generator=gen)]
    draft = torch.randint(0, 32000, (batch, k), generator=gen, dtype=torch.int64).to(token_dtype)
    substitute = torch.randint(0, 32000, (batch, k), generator=gen, dtype=torch.int64)
    substitute = substitute.to(substitute_dtype or token_dtype)
    bonus = torch.randint(0, 32000, (batch, 1) if bonus_2d else (batch,), generator=gen, dtype=torch.int64)
    return accepted, substitute, draft, bonus.to(token_dtype)


def make_step(seed, n, *, max_model_len=64, ids_dtype=torch.int64, pos_dtype=torch.int64,
              lens_dtype=torch.int32, device="cpu"):
    """Random step inputs; about a third of the rows sit at or past the max_model_len clamp."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 32000, (n,), generator=gen)
    positions = torch.randint(0, max_model_len + 3, (n,), generator=gen)
    # Keep the usual invariant seq_len = position + 1 on most rows, break it on some.
    seq_lens = torch.where(torch.rand(n, generator=gen) < 0.7, positions + 1,
                           torch.randint(0, max_model_len + 3, (n,), generator=gen))
    return (ids.to(ids_dtype).to(device), positions.to(pos_dtype).to(device),
            seq_lens.to(lens_dtype).to(device), max_model_len)


def normalized(t):
    return t / t.sum(-1, keepdim=True)


def make_case(seed, batch, k, vocab, *, has_q=True, has_bonus=False, token_dtype=torch.int64,
              prob_dtype=torch.float32, invalid_ids=True):
    """Random verification inputs; drafts mostly drawn from q so that some rows accept several tokens."""
    gen = torch.Generator().manual_seed(seed)
    p = normalized(torch.rand(batch, k + 1, vocab, generator=gen) ** 3)
    q = normalized(torch.rand(batch, k, vocab, generator=gen) ** 3)
    # Mix q into p so acceptance rates are high enough to reach the bonus column.
    p[:, :k] = normalized(p[:, :k] * 0.3 + q * 0.7)
    draft = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, k)
    if invalid_ids:
        bad = torch.rand(batch, k, generator=gen) < 0.1
        draft = torch.where(bad, torch.tensor([-1, vocab, 10**9, -7])[torch.randint(0, 4, (batch, k), generator=gen)],
                            draft)
    seeds = torch.randint(-2**62, 2**62, (batch,), generator=gen)
    offsets = torch.randint(0, 2**40, (batch,), generator=gen)
    bonus = torch.randint(0, vocab, (batch, 1), generator=gen).to(token_dtype) if has_bonus else None
    return (p.to(prob_dtype), draft.to(token_dtype), q.to(prob_dtype) if has_q else None, seeds, offsets, bonus)


def make_logits(seed, rows, vocab, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    temperature = torch.tensor([0.0, 0.7, 1.0, 2.5, 0.0, 1.3, 0.0, 0.01] * rows)[:rows]
    seeds = torch.randint(-2**62, 2**62, (rows,), generator=gen)
    positions = torch.randint(0, 2**20, (rows,), generator=gen)
    return logits, temperature, seeds, positions


def make_greedy(seed, batch, k, vocab, dtype=torch.float32, draft_dtype=torch.int64, match=0.75):
    """Random logits; each draft id equals the row argmax with probability `match`, else is uniform."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, k + 1, vocab, generator=gen) * 3).to(dtype)
    argmax = logits.argmax(-1)[:, :k]
    guess = torch.randint(0, vocab, (batch, k), generator=gen)
    draft = torch.where(torch.rand(batch, k, generator=gen) < match, argmax, guess)
    return logits, draft.to(draft_dtype)


def typical_margin(probs, draft, threshold=0.09, alpha=0.3):
    """Relative distance of each in-vocab draft probability from its acceptance threshold (float64)."""
    k = draft.shape[1]
    p = probs[:, :k].double()
    entropy = -(p * torch.log(p + verify.ENTROPY_EPS)).sum(-1)
    limit = torch.minimum(torch.full_like(entropy, threshold), alpha * torch.exp(-entropy))
    valid = (draft >= 0) & (draft < probs.shape[-1])
    draft_p = p.gather(-1, draft.clamp(0, probs.shape[-1] - 1).long()[..., None]).squeeze(-1)
    margin = (draft_p - limit).abs() / limit.abs().clamp_min(1e-30)
    return torch.where(valid, margin, torch.full_like(margin, math.inf))


def make_typical(seed, batch, k, vocab, dtype=torch.float32, draft_dtype=torch.int64, threshold=0.09, alpha=0.3):
    """Softmax rows from sharp to flat; drafts mix the argmax, samples of p and uniform ids.

    Draft ids within 1e-3 (relative) of the acceptance threshold are replaced by the
    argmax, and the result is asserted to be off the boundary, so float32 and
    float64 entropies must agree.
    """
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(batch, k + 1, 1, generator=gen) * 6
    probs = torch.softmax(torch.randn(batch, k + 1, vocab, generator=gen) * scale, dim=-1).to(dtype)
    flat = probs[:, :k].float().reshape(-1, vocab)
    sampled = torch.multinomial(flat, 1, generator=gen).reshape(batch, k) if batch else flat.new_zeros(0, k).long()
    choice = torch.randint(0, 3, (batch, k), generator=gen)
    draft = torch.where(choice == 0, probs.argmax(-1)[:, :k],
                        torch.where(choice == 1, sampled, torch.randint(0, vocab, (batch, k), generator=gen)))
    near = typical_margin(probs, draft, threshold, alpha) < 1e-3
    draft = torch.where(near, probs.argmax(-1)[:, :k], draft).to(draft_dtype)
    assert bool((typical_margin(probs, draft, threshold, alpha) > 1e-3).all()), "inputs on the boundary"
    return probs, draft

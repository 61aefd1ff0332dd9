"""Distribution tests of rejection_sample_logits (token-wise and block verification) and sample_draft_filtered.

Each case fixes target logits [k+1, V] and draft logits [k, V] (the same for every trial: batch stride 0) and
sampling parameters with filters on. Per trial the draft tokens are drawn by sample_draft_filtered (which writes
the q it sampled from), then verified through the CPU kernel. Per output column a chi-square test against the
*processed* target distribution must not reject at p < 1e-4, and for block verification, which couples positions,
so must a test of the (column 0, column 1) pairs against the product distribution, where a column 1 that was
not emitted is completed by a fresh draw from p_1 (lossless means exactly that: the output followed by target
sampling is target sampling). The mean accepted length of
each mode must match its exact expectation (token-wise: sum_i prod_{j<=i} alpha_j; block: an enumeration over
all draft blocks, below), and block verification's must be at least token-wise's on the same trials. Seeds are
fixed, so the outcome is deterministic; negative controls show the statistic rejects a wrong target and a
verifier told the wrong q.
"""
import itertools
import math

import pytest
import torch

import specdec_ops

from test_sampling_stats import P_THRESHOLD, chi_square_pvalue

pytestmark = pytest.mark.slow

TRIALS = 60_000


def make_case(name):
    """(target logits [k+1, V], draft logits [k, V], (temperature, top_k, top_p, min_p))."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    if name == "all_filters":
        k, vocab, params = 3, 40, (0.8, 12, 0.85, 0.02)
    elif name == "top_k_ties":  # a coarse grid: the top-k cut falls inside a run of equal logits
        k, vocab, params = 2, 30, (1.0, 5, 1.0, 0.0)
    elif name == "top_p_only":
        k, vocab, params = 3, 50, (1.3, 0, 0.6, 0.0)
    elif name == "min_p_only":
        k, vocab, params = 2, 40, (1.0, 0, 1.0, 0.1)
    elif name == "draft_elsewhere":  # the draft's kept sets miss the target's: every token is a residual draw
        k, vocab, params = 2, 24, (0.7, 6, 0.9, 0.0)
    elif name == "small_vocab_pairs":  # small enough for the pair test and an exact block expectation
        k, vocab, params = 3, 6, (1.0, 4, 0.9, 0.05)
    else:
        raise KeyError(name)
    target = torch.randn(k + 1, vocab, generator=gen) * 2
    if name == "top_k_ties":
        target = torch.round(target)
    draft = target[:k] + torch.randn(k, vocab, generator=gen) * 0.8
    if name == "draft_elsewhere":
        draft = target[:k] * 0.3 + torch.randn(k, vocab, generator=gen) * 2
    return target, draft, params


def processed(logits, params):
    t, top_k, top_p, min_p = params
    rows = logits.shape[0]
    return specdec_ops.processed_distribution(logits, torch.full((rows,), t), torch.full((rows,), top_k),
                                              torch.full((rows,), top_p), torch.full((rows,), min_p))


def run_trials(target, draft_logits, params, *, seed, block, draft_mode="probs", verifier_q=None):
    """Drafts by sample_draft_filtered, then verification: the [TRIALS, k+1] outputs (CPU kernels)."""
    k, vocab = draft_logits.shape
    gen = torch.Generator().manual_seed(seed)
    seeds = torch.randint(-2**62, 2**62, (TRIALS,), generator=gen)
    offsets = torch.randint(0, 2**40, (TRIALS,), generator=gen)
    t, top_k, top_p, min_p = (torch.full((TRIALS,), v) for v in params)
    q = torch.empty(TRIALS, k, vocab)
    tokens = [specdec_ops.sample_draft_filtered(draft_logits[step][None].expand(TRIALS, -1), t, top_k, top_p, min_p,
                                                seeds, offsets + step, probs=q[:, step]) for step in range(k)]
    draft = torch.stack(tokens, dim=1)
    if draft_mode == "probs":
        kwargs = dict(draft_probs=q)
    else:
        kwargs = dict(draft_logits=draft_logits[None].expand(TRIALS, -1, -1))
    if verifier_q is not None:
        kwargs = dict(draft_probs=verifier_q[None].expand(TRIALS, -1, -1))
    return specdec_ops.rejection_sample_logits(target[None].expand(TRIALS, -1, -1), draft, t, top_k, top_p, min_p,
                                               seeds, offsets, block_verification=block, **kwargs)


def column_pvalues(out, p):
    pvalues = []
    for col in range(out.shape[1]):
        emitted = out[:, col] != -1
        if emitted.sum() >= 1000:
            pvalues.append(chi_square_pvalue(out[emitted, col], p[col]))
    return pvalues


def accepted_length(out):
    k = out.shape[1] - 1
    return ((out != -1).sum(1) - 1).double().clamp(max=k)


def tokenwise_expected_length(p, q):
    alpha = torch.minimum(p[:-1].double(), q.double()).sum(-1)
    return alpha.cumprod(0).sum().item()


def block_expected_length(p, q):
    """E[tau] of block verification by enumerating every draft block (context-independent p_i, q_i), stated
    independently of the kernels: P(tau = t) = h_t prod_{i > t} (1 - h_i), with the contract's w_i and h_i."""
    p, q = p.double(), q.double()
    k, vocab = q.shape
    total = 0.0
    for xs in itertools.product(range(vocab), repeat=k):
        prob = math.prod(float(q[i, xs[i]]) for i in range(k))
        if prob == 0:
            continue
        w = [1.0]
        for i in range(1, k + 1):
            px, qx = float(p[i - 1, xs[i - 1]]), float(q[i - 1, xs[i - 1]])
            w.append(0.0 if px == 0 else (1.0 if qx <= w[-1] * px else w[-1] * px / qx))
        h = [0.0]
        for i in range(1, k):
            residual = float(torch.clamp(w[i] * p[i] - q[i], min=0).sum())
            h.append(residual / (residual + 1 - w[i]) if residual > 0 else 0.0)
        h.append(w[k])
        for t in range(1, k + 1):
            total += prob * t * h[t] * math.prod(1 - h[i] for i in range(t + 1, k + 1))
    return total


def check_length(out, expected):
    length = accepted_length(out)
    standard_error = length.std().item() / math.sqrt(length.numel())
    assert abs(length.mean().item() - expected) <= 5 * standard_error + 1e-6, (length.mean().item(), expected)


CASES = ["all_filters", "top_k_ties", "top_p_only", "min_p_only", "draft_elsewhere", "small_vocab_pairs"]


@pytest.mark.parametrize("name", CASES)
def test_both_modes_follow_the_processed_target(name, capsys):
    target, draft, params = make_case(name)
    p = processed(target, params)
    q = processed(draft, params)
    outs = {}
    for block in (False, True):
        out = run_trials(target, draft, params, seed=CASES.index(name), block=block)
        pvalues = column_pvalues(out, p)
        assert len(pvalues) >= (1 if name == "draft_elsewhere" else 2), pvalues  # that one: mostly residual draws
        assert min(pvalues) > P_THRESHOLD, (block, pvalues)
        outs[block] = out
    check_length(outs[False], tokenwise_expected_length(p, q))
    if q.shape[1] ** q.shape[0] <= 50_000:
        check_length(outs[True], block_expected_length(p, q))
    # Same trials (seeds, offsets, drafts): block verification accepts at least as much on average.
    difference = accepted_length(outs[True]) - accepted_length(outs[False])
    standard_error = difference.std().item() / math.sqrt(difference.numel())
    assert difference.mean().item() >= -3 * standard_error, difference.mean().item()
    with capsys.disabled():
        print(f"\n{name}: mean accepted length token-wise {accepted_length(outs[False]).mean():.4f}, "
              f"block {accepted_length(outs[True]).mean():.4f} (k = {q.shape[0]}, {TRIALS} trials)")


def pair_pvalue(out, p, seed=0):
    """Chi-square of (column 0, column 1) over all trials, against p_0 x p_1, column 1 completed from p_1 where it
    was not emitted (test-side torch sampling)."""
    fresh = torch.multinomial(p[1], out.shape[0], replacement=True, generator=torch.Generator().manual_seed(seed))
    second = torch.where(out[:, 1] == -1, fresh, out[:, 1])
    vocab = p.shape[1]
    return chi_square_pvalue(out[:, 0] * vocab + second, (p[0][:, None] * p[1][None, :]).reshape(-1))


def test_block_verification_pairs_follow_the_product():
    target, draft, params = make_case("small_vocab_pairs")
    p = processed(target, params)
    for block in (False, True):
        out = run_trials(target, draft, params, seed=77, block=block)
        assert pair_pvalue(out, p) > P_THRESHOLD
        # Negative control: the pairs of the trials that emitted both columns are biased (column 0 is then an
        # accepted draft token), so the completion is what makes the test right, and the test can fail.
        both = (out[:, 0] != -1) & (out[:, 1] != -1)
        assert pair_pvalue(out[both], p) < 1e-6


@pytest.mark.parametrize("block", [False, True])
def test_draft_logits_mode_follows_the_target(block):
    """The verifier processes the draft logits itself (no q tensor): the same q, the same law."""
    target, draft, params = make_case("all_filters")
    out = run_trials(target, draft, params, seed=11, block=block, draft_mode="logits")
    pvalues = column_pvalues(out, processed(target, params))
    assert len(pvalues) >= 2 and min(pvalues) > P_THRESHOLD, pvalues


def test_sample_draft_filtered_follows_the_processed_distribution():
    target, _, params = make_case("all_filters")
    logits = target[0]
    gen = torch.Generator().manual_seed(3)
    t, top_k, top_p, min_p = (torch.full((TRIALS,), v) for v in params)
    tokens = specdec_ops.sample_draft_filtered(logits[None].expand(TRIALS, -1), t, top_k, top_p, min_p,
                                               torch.randint(-2**62, 2**62, (TRIALS,), generator=gen),
                                               torch.randint(0, 2**40, (TRIALS,), generator=gen))
    p = processed(logits[None], params)[0]
    assert chi_square_pvalue(tokens, p) > P_THRESHOLD
    assert chi_square_pvalue(tokens, torch.softmax(logits / params[0], -1)) < 1e-30  # the filters did act


# --- negative controls ---------------------------------------------------------------------------------------


def test_negative_control_unfiltered_target():
    """The op's output does not fit the unfiltered softmax: the test sees the filters."""
    target, draft, params = make_case("top_p_only")
    out = run_trials(target, draft, params, seed=5, block=False)
    assert chi_square_pvalue(out[:, 0], torch.softmax(target[0] / params[0], -1)) < 1e-30


@pytest.mark.parametrize("block", [False, True])
def test_negative_control_verifier_told_the_wrong_q(block):
    """Drafts sampled from the filtered q but verified against the unfiltered one: the emitted tokens are biased."""
    target, draft, params = make_case("all_filters")
    wrong_q = torch.softmax(draft / params[0], -1)
    out = run_trials(target, draft, params, seed=6, block=block, verifier_q=wrong_q)
    assert min(column_pvalues(out, processed(target, params))) < 1e-6


def test_negative_control_accepted_length():
    """The length check fails when the expectation is the other mode's (block verification accepts more here)."""
    target, draft, params = make_case("small_vocab_pairs")
    p, q = processed(target, params), processed(draft, params)
    out = run_trials(target, draft, params, seed=8, block=True)
    assert block_expected_length(p, q) > tokenwise_expected_length(p, q) + 0.02
    check_length(out, block_expected_length(p, q))
    with pytest.raises(AssertionError):
        check_length(out, tokenwise_expected_length(p, q))

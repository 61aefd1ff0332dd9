"""Distribution tests: rejection_sample emits target-distributed tokens; sample_draft samples softmax(logits/T).

Each case runs >= 1e5 independent trials through the CPU kernel, with one
distribution broadcast over all rows (batch stride 0) and draft tokens drawn
from q by a torch.Generator (test side only). Per output column, a chi-square
goodness-of-fit test against the target distribution must not reject at
p < 1e-4. Seeds are fixed, so the outcome is deterministic; negative controls
show the same statistic rejects biased samplers.
"""
import math

import pytest
import torch
from scipy import stats

import specdec_ops

from samples import normalized

# Statistical: many trials each. Marked so that `-m "not slow"` skips them locally; CI runs them (.ci/run runs the
# whole suite, no marker deselected).
pytestmark = pytest.mark.slow

P_THRESHOLD = 1e-4
TRIALS = 100_000


def chi_square_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of integer samples to probs; bins with expected count < 5 are merged."""
    probs = probs.double() / probs.double().sum()
    observed = torch.bincount(tokens, minlength=probs.numel()).double()
    assert observed.numel() == probs.numel(), "a sample fell outside the vocabulary"
    expected = probs * tokens.numel()
    small = expected < 5
    # Samples in zero-probability bins make the test fail outright.
    if (observed[probs == 0] > 0).any():
        return 0.0
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    if obs.numel() < 2:
        return 1.0
    return float(stats.chisquare(obs.numpy(), exp.numpy()).pvalue)


def run_trials(p, q, *, draft_one_hot=False, draft_dist=None, trials=TRIALS, seed=0):
    """Runs `trials` independent verifications of one (p [k+1, V], q [k, V]) case through the CPU kernel."""
    k, vocab = q.shape
    gen = torch.Generator().manual_seed(seed)
    source = q if draft_dist is None else draft_dist
    draft = torch.stack([torch.multinomial(source[i], trials, replacement=True, generator=gen) for i in range(k)],
                        dim=1)
    seeds = torch.randint(-2**62, 2**62, (trials,), generator=gen)
    offsets = torch.randint(0, 2**40, (trials,), generator=gen)
    target = p[None].expand(trials, -1, -1)
    draft_probs = None if draft_one_hot else q[None].expand(trials, -1, -1)
    out = specdec_ops.rejection_sample(target, draft, draft_probs, seeds, offsets)
    return out


def column_pvalues(out, p):
    """p-value per column, over the trials that emitted a token there (the prefix before it was accepted)."""
    pvalues = []
    for col in range(out.shape[1]):
        emitted = out[:, col] != -1
        if emitted.sum() < 1000:
            continue  # too few to say anything; other cases cover this column
        pvalues.append(chi_square_pvalue(out[emitted, col], p[col]))
    return pvalues


def check_accepted_length(out, p, q):
    """Mean accepted-prefix length == sum_i prod_{j<=i} alpha_j within 5 standard errors."""
    k = q.shape[0]
    alpha = torch.minimum(p[:k].double(), q.double()).sum(-1)
    expected = alpha.cumprod(0).sum().item()
    length = ((out[:, :k] != -1).sum(1) - (out[:, k] == -1).long()).double()
    standard_error = length.std().item() / math.sqrt(length.numel())
    assert abs(length.mean().item() - expected) <= 5 * standard_error + 1e-6, (length.mean().item(), expected)


def random_dist(gen, shape, power=2.0, zeros=0.0):
    d = torch.rand(shape, generator=gen) ** power
    if zeros:
        d = d * (torch.rand(shape, generator=gen) >= zeros)
        d[..., 0] += 1e-3  # keep every row non-empty
    return normalized(d)


def make_case(name):
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    if name == "p_equals_q":
        q = random_dist(gen, (4, 1000))
        return torch.cat([q, random_dist(gen, (1, 1000))]), q
    if name == "disjoint_supports":
        p = torch.zeros(3, 10)
        p[:, :5] = random_dist(gen, (3, 5))
        q = torch.zeros(2, 10)
        q[:, 5:] = random_dist(gen, (2, 5))
        return p, q
    if name == "q_zero_where_p_is_not":
        p = random_dist(gen, (4, 20))
        q = random_dist(gen, (3, 20))
        q[:, :8] = 0
        return p, normalized(q)
    if name == "p_one_hot":
        p = torch.zeros(3, 12)
        p[0, 3] = p[1, 7] = p[2, 0] = 1
        return p, random_dist(gen, (2, 12))
    if name == "k1_v2":
        return torch.tensor([[0.8, 0.2], [0.35, 0.65]]), torch.tensor([[0.3, 0.7]])
    if name == "k8_v1000":
        return random_dist(gen, (9, 1000), power=4, zeros=0.5), random_dist(gen, (8, 1000), power=4, zeros=0.5)
    if name == "k8_v2":
        return random_dist(gen, (9, 2)), random_dist(gen, (8, 2))
    raise KeyError(name)


CASES = ["p_equals_q", "disjoint_supports", "q_zero_where_p_is_not", "p_one_hot", "k1_v2", "k8_v1000", "k8_v2"]


@pytest.mark.parametrize("name", CASES)
def test_emitted_tokens_follow_the_target(name):
    p, q = make_case(name)
    out = run_trials(p, q, seed=CASES.index(name))
    pvalues = column_pvalues(out, p)
    assert len(pvalues) >= 1
    assert min(pvalues) > P_THRESHOLD, pvalues
    check_accepted_length(out, p, q)


@pytest.mark.parametrize("vocab", [2, 1000])
def test_deterministic_draft_follows_the_target(vocab):
    """draft_probs=None: q is one-hot at the draft token, whichever way the draft token was chosen."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=gen) * 3
    p = torch.softmax(logits, -1)
    proposer = torch.softmax(logits[:3] * 1.5, -1)  # how the (greedy/n-gram) drafter happens to choose
    out = run_trials(p, proposer, draft_one_hot=True, seed=vocab)
    pvalues = column_pvalues(out, p)
    assert len(pvalues) >= 2
    assert min(pvalues) > P_THRESHOLD, pvalues
    # Acceptance of a one-hot draft at a token x is p(x): alpha_i = sum_x proposer_i(x) p_i(x).
    alpha = (proposer.double() * p[:3].double()).sum(-1)
    length = ((out[:, :3] != -1).sum(1) - (out[:, 3] == -1).long()).double()
    standard_error = length.std().item() / math.sqrt(length.numel())
    assert abs(length.mean().item() - alpha.cumprod(0).sum().item()) <= 5 * standard_error + 1e-6


def test_bonus_column_follows_p_k():
    """All accepted (p == q): the bonus column is drawn from p_k, the row after the drafts."""
    gen = torch.Generator().manual_seed(5)
    q = random_dist(gen, (2, 50))
    p = torch.cat([q, random_dist(gen, (1, 50), power=4)])
    out = run_trials(p, q, seed=99)
    assert (out[:, 2] != -1).all()
    assert chi_square_pvalue(out[:, 2], p[2]) > P_THRESHOLD


def test_segmented_race_within_and_across_segments():
    """The residual race on its own: an invalid draft id is rejected with q = 0, so the token is a draw from p_0.
    Segments of 4: one with four distinct weights (both levels of the walk matter), one with zeros (never drawn)
    and a tiny entry, and V = 11 (a zero-padded last segment)."""
    p0 = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0, 0.5, 0.0, 1e-3, 0.25, 0.05, 0.6])
    p = torch.stack([p0 / p0.sum(), torch.full((11,), 1 / 11)])
    gen = torch.Generator().manual_seed(17)
    seeds = torch.randint(-2**62, 2**62, (TRIALS,), generator=gen)
    offsets = torch.randint(0, 2**40, (TRIALS,), generator=gen)
    draft = torch.full((TRIALS, 1), -1)
    out = specdec_ops.rejection_sample(p[None].expand(TRIALS, -1, -1), draft, None, seeds, offsets)
    assert (out[:, 1] == -1).all()
    assert chi_square_pvalue(out[:, 0], p[0]) > P_THRESHOLD


# --- negative controls: the statistic can fail ----------------------------------------------------


def test_negative_control_always_emitting_the_draft_token():
    p, q = make_case("q_zero_where_p_is_not")
    gen = torch.Generator().manual_seed(3)
    draft = torch.multinomial(q[0], TRIALS, replacement=True, generator=gen)
    assert chi_square_pvalue(draft, p[0]) < 1e-30


def test_negative_control_resampling_from_p_instead_of_the_residual():
    """The classic bug: on rejection, draw from p rather than normalize(max(p - q, 0))."""
    gen = torch.Generator().manual_seed(4)
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.3, 0.5])
    draft = torch.multinomial(q, TRIALS, replacement=True, generator=gen)
    accept = torch.rand(TRIALS, generator=gen) * q[draft] < p[draft]
    resampled = torch.multinomial(p, TRIALS, replacement=True, generator=gen)
    biased = torch.where(accept, draft, resampled)
    assert chi_square_pvalue(biased, p) < 1e-30
    # The same case through the op passes.
    out = run_trials(torch.stack([p, p]), q[None], seed=4)
    assert chi_square_pvalue(out[:, 0], p) > P_THRESHOLD


def test_negative_control_accepted_length():
    """The accepted-length check fails when the prediction is wrong (alpha of another q)."""
    p, q = make_case("p_one_hot")
    out = run_trials(p, q, seed=8)
    check_accepted_length(out, p, q)
    with pytest.raises(AssertionError):
        check_accepted_length(out, p, normalized(q + p[:2]))


# --- sample_draft -------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.6, 1.0, 2.0])
def test_sample_draft_follows_softmax(temperature):
    gen = torch.Generator().manual_seed(int(temperature * 10))
    vocab = 200
    logits = torch.randn(vocab, generator=gen) * 2
    logits[:20] = float("-inf")  # masked tokens are never drawn
    rows = TRIALS
    tokens = specdec_ops.sample_draft(logits[None].expand(rows, -1), torch.full((rows,), temperature),
                                      torch.randint(-2**62, 2**62, (rows,), generator=gen),
                                      torch.randint(0, 2**40, (rows,), generator=gen))
    target = torch.softmax(logits / temperature, -1)
    assert chi_square_pvalue(tokens, target) > P_THRESHOLD
    # Negative control: the same tokens do not fit a slightly different temperature.
    assert chi_square_pvalue(tokens, torch.softmax(logits / (temperature * 1.15), -1)) < P_THRESHOLD


def test_sample_draft_mixed_batch():
    """Greedy and random rows in one call: greedy rows are the argmax, random rows follow softmax."""
    gen = torch.Generator().manual_seed(12)
    vocab = 30
    logits = torch.randn(vocab, generator=gen)
    rows = TRIALS
    temperature = torch.where(torch.arange(rows) % 4 == 0, 0.0, 1.0)
    tokens = specdec_ops.sample_draft(logits[None].expand(rows, -1), temperature,
                                      torch.full((rows,), 3, dtype=torch.int64), torch.arange(rows))
    greedy = temperature == 0
    assert (tokens[greedy] == logits.argmax()).all()
    assert chi_square_pvalue(tokens[~greedy], torch.softmax(logits, -1)) > P_THRESHOLD

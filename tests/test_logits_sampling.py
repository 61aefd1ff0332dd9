"""specdec::rejection_sample_logits and specdec::sample_draft_filtered: semantics, kernels vs reference, validation,
opcheck, compile, CUDA graphs.

The distribution tests (chi-square, block verification's accepted length) are in test_logits_sampling_stats.py.
"""
import math

import pytest
import torch

import specdec_ops
from specdec_ops.kernels import logits_sampling as kernels
from specdec_ops.ops import logits_sampling as contract
from specdec_ops._triton import HAS_TRITON

if HAS_TRITON:
    # At module level: the compiler looks up a nested kernel's names in the module's globals and the kernel's
    # closure, and a kernel that names tl only in its annotations has no closure for it (the interpreter does not
    # compile, so only CUDA runs failed).
    import triton
    import triton.language as tl

from conftest import HAS_CUDA, sync_forbidden

NEG_INF = float("-inf")


# --- inputs --------------------------------------------------------------------------------------------------


def make_params(batch, kind, vocab, gen):
    """(temperature, top_k, top_p, min_p) [B]: 'mixed' draws every filter on and off across rows (greedy included)."""
    if kind == "off":
        return (torch.rand(batch, generator=gen) + 0.5, torch.zeros(batch, dtype=torch.int64), torch.ones(batch),
                torch.zeros(batch))
    if kind == "greedy":
        return (torch.zeros(batch), torch.randint(0, vocab, (batch,), generator=gen), torch.rand(batch, generator=gen),
                torch.rand(batch, generator=gen) * 0.2)
    temperature = torch.rand(batch, generator=gen) * 1.5 + 0.3
    temperature[torch.rand(batch, generator=gen) < 0.2] = 0.0
    top_k = torch.randint(1, vocab + 1, (batch,), generator=gen)
    top_k[torch.rand(batch, generator=gen) < 0.4] = 0
    top_p = torch.rand(batch, generator=gen) * 0.9 + 0.05
    top_p[torch.rand(batch, generator=gen) < 0.4] = 1.0
    min_p = torch.rand(batch, generator=gen) * 0.3
    min_p[torch.rand(batch, generator=gen) < 0.5] = 0.0
    return temperature, top_k, top_p, min_p


def make_case(seed, batch, k, vocab, *, params="mixed", draft="logits", dtype=torch.float32, ties=True,
              masked=True, token_dtype=torch.int64):
    """Target and draft logits with repeated values and -inf entries; drafts drawn from the processed q (with some
    invalid ids). Returns the op's positional arguments (without block_verification)."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(batch, k + 1, vocab, generator=gen) * 2.5
    if ties:  # logits on a coarse grid: many exact ties, at the top-k / top-p cut-off too
        target = torch.round(target * 2) / 2
    if masked:
        target[torch.rand(batch, k + 1, vocab, generator=gen) < 0.15] = NEG_INF
        target[..., 0] = torch.where(torch.isinf(target[..., 0]), 0.0, target[..., 0])  # never an all -inf row
    draft_logits = target[:, :k] + torch.randn(batch, k, vocab, generator=gen)
    draft_logits = torch.where(torch.isinf(target[:, :k]), target[:, :k], draft_logits)
    temperature, top_k, top_p, min_p = make_params(batch, params, vocab, gen)
    q = contract.processed_distribution(draft_logits, temperature, top_k, top_p, min_p)
    draft_ids = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, k)
    bad = torch.rand(batch, k, generator=gen) < 0.08
    draft_ids = torch.where(bad, torch.tensor([-1, vocab, 10**9])[torch.randint(0, 3, (batch, k), generator=gen)],
                            draft_ids)
    seeds = torch.randint(-2**62, 2**62, (batch,), generator=gen)
    offsets = torch.randint(0, 2**40, (batch,), generator=gen)
    draft_probs = q.to(dtype) if draft == "probs" else None
    draft_logits = draft_logits.to(dtype) if draft == "logits" else None
    return (target.to(dtype), draft_ids.to(token_dtype), draft_probs, draft_logits, temperature, top_k, top_p, min_p,
            seeds, offsets)


def reference(args, block, counters=None, logprobs=False):
    target, ids, dp, dl, temperature, top_k, top_p, min_p, seeds, offsets = args
    return specdec_ops.rejection_sample_logits_reference(
        target, ids, temperature, top_k, top_p, min_p, seeds, offsets, draft_probs=dp, draft_logits=dl,
        block_verification=block, counters=counters, return_logprobs=logprobs)


def run_cpp(args, block, counters=None, logprobs=False, **_):
    target, ids, dp, dl, temperature, top_k, top_p, min_p, seeds, offsets = args
    return specdec_ops.rejection_sample_logits(target, ids, temperature, top_k, top_p, min_p, seeds, offsets,
                                               draft_probs=dp, draft_logits=dl, block_verification=block,
                                               counters=counters, return_logprobs=logprobs)


def run_triton(args, block, counters=None, logprobs=False, block_v=None, **launch):
    """The Triton kernels: through the op on CUDA, through the launcher under the interpreter (or a forced block,
    chunk count or cap: `launch` takes _launch_rejection's num_chunks and gather_cap)."""
    if HAS_CUDA:
        cuda_args = [None if a is None else a.cuda() for a in args]
        cuda_counters = None if counters is None else counters.cuda()
        if block_v is None and not launch:
            result = run_cpp(cuda_args, block, cuda_counters, logprobs)
        else:
            contract.check_rejection_inputs(*cuda_args, cuda_counters)
            result = kernels._launch_rejection(*cuda_args, block, cuda_counters, logprobs, block_v=block_v,
                                               **launch)
            result = result if logprobs else result[0]
        if counters is not None:
            counters.copy_(cuda_counters.cpu())
        return tuple(r.cpu() for r in result) if logprobs else result.cpu()
    contract.check_rejection_inputs(*args, counters)
    out, lp = kernels._launch_rejection(*args, block, counters, logprobs, block_v=block_v, **launch)
    return (out, lp) if logprobs else out


KERNELS = [pytest.param(run_cpp, id="cpp")]
if HAS_TRITON:
    KERNELS.append(pytest.param(run_triton, id="triton"))

LOGPROB_TOL = dict(rtol=2e-5, atol=2e-5)


def check_against_reference(kernel, args, block, **kwargs):
    """Every overload of the kernel equals the reference: tokens and counters exactly, logprobs within 2e-5."""
    expected_counters = torch.tensor([5, 6, 7])
    expected, expected_lp = reference(args, block, expected_counters, logprobs=True)
    counters = torch.tensor([5, 6, 7])
    got, got_lp = kernel(args, block, counters, logprobs=True, **kwargs)
    assert got.dtype == args[1].dtype and got_lp.dtype == torch.float32
    assert torch.equal(got, expected), (got, expected)
    assert torch.equal(counters, expected_counters)
    torch.testing.assert_close(got_lp, expected_lp, **LOGPROB_TOL)
    if kernel is run_cpp:  # the other overloads (the Triton launcher shares one path for all four)
        assert torch.equal(kernel(args, block, **kwargs), expected)
        counters = torch.tensor([5, 6, 7])
        assert torch.equal(kernel(args, block, counters, **kwargs), expected)
        assert torch.equal(counters, expected_counters)
        out, lp = kernel(args, block, logprobs=True, **kwargs)
        assert torch.equal(out, expected)
        torch.testing.assert_close(lp, expected_lp, **LOGPROB_TOL)
    return expected, expected_lp


def skip_bf16_in_interpreter(kernel, dtype):
    if dtype == torch.bfloat16 and kernel is run_triton and not HAS_CUDA:
        pytest.skip("no bfloat16 in the Triton interpreter")


# --- the processed distribution, stated independently -----------------------------------------------------------


def naive_processed(x, temperature, top_k, top_p, min_p):
    """One row in Python floats/float64, by the contract's steps, to check the vectorized reference against."""
    x = x.float()
    vocab = x.numel()
    if not temperature > 0:
        out = torch.zeros(vocab)
        out[int(x.argmax())] = 1
        return out
    z = x / temperature
    e = torch.exp(z - z.max())
    values = sorted(set(z.tolist()), reverse=True)
    tau = values[-1]
    if 0 < top_k < vocab:
        count = 0
        for value in values:  # the k-th largest, counting repeats
            count += int((z == value).sum())
            if count >= top_k:
                tau = value
                break
    if top_p < 1:
        mass_k = float(e[z >= tau].double().sum())
        for value in values:
            if float(e[z >= value].double().sum()) >= top_p * mass_k:
                tau = max(tau, value)
                break
    keep = (z >= tau) & (e >= (min(min_p, 1.0) if min_p > 0 else 0.0))
    return torch.where(keep, e / e[keep].double().sum().float(), 0.0)


def test_processed_distribution_by_hand():
    x = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, NEG_INF]])
    one = torch.ones(1)

    def kept(top_k=0, top_p=1.0, min_p=0.0, temperature=1.0):
        probs = specdec_ops.processed_distribution(x, one * temperature, torch.tensor([top_k]),
                                                   torch.tensor([top_p]), torch.tensor([min_p]))
        assert torch.allclose(probs.sum(-1), torch.ones(1))
        return (probs[0] > 0).nonzero()[:, 0].tolist()

    assert kept() == [0, 1, 2, 3, 4]  # -inf has probability 0 with every filter off
    assert kept(top_k=1) == [0]
    assert kept(top_k=2) == [0, 1, 2, 3]  # every token tied with the 2nd largest stays
    assert kept(top_k=4) == [0, 1, 2, 3]
    assert kept(top_k=6) == kept(top_k=0) == kept(top_k=-3) == [0, 1, 2, 3, 4]
    e = torch.exp(x[0] - 3)
    head = float(e[0] / e[:5].sum())
    assert kept(top_p=head * 0.999) == [0]
    assert kept(top_p=head * 1.001) == [0, 1, 2, 3]  # the tied block enters whole
    assert kept(top_p=1e-9) == kept(top_p=0.0) == kept(top_p=-1.0) == [0]
    assert kept(top_p=float("nan")) == [0, 1, 2, 3, 4]
    assert kept(min_p=float(e[1]) * 0.999) == [0, 1, 2, 3]  # p >= min_p * p_max
    assert kept(min_p=0.999) == kept(min_p=5.0) == [0]
    # top-p applies to the top-k distribution: 0.46 lies between token 0's share of all the mass and its share of
    # the top-k mass (token 4 is out of the top 2).
    assert head < 0.46 < float(e[0] / e[:4].sum())
    assert kept(top_k=2, top_p=0.46) == [0] and kept(top_p=0.46) == [0, 1, 2, 3]
    # A greedy row is one-hot at the first argmax whatever the filters say.
    probs = specdec_ops.processed_distribution(torch.tensor([[1.0, 5.0, 5.0]]), torch.zeros(1), torch.tensor([3]),
                                               torch.tensor([0.1]), torch.tensor([0.9]))
    assert probs.tolist() == [[0.0, 1.0, 0.0]]


def test_processed_distribution_matches_naive_statement():
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        vocab = int(torch.randint(1, 30, (1,), generator=gen))
        x = torch.round(torch.randn(vocab, generator=gen) * 4) / 2
        x[torch.rand(vocab, generator=gen) < 0.1] = NEG_INF
        x[0] = 1.0
        temperature = float(torch.rand(1, generator=gen)) + 0.2 if trial % 7 else 0.0
        top_k = int(torch.randint(-1, vocab + 2, (1,), generator=gen))
        top_p = float(torch.rand(1, generator=gen)) * 1.2 - 0.1
        min_p = float(torch.rand(1, generator=gen)) * 0.5 * (trial % 2)
        got = specdec_ops.processed_distribution(x[None], torch.tensor([temperature]), torch.tensor([top_k]),
                                                 torch.tensor([top_p]), torch.tensor([min_p]))[0]
        expected = naive_processed(x, temperature, top_k, top_p, min_p)
        assert torch.equal(got > 0, expected > 0), (x, temperature, top_k, top_p, min_p)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_filters_off_is_softmax_and_matches_the_probability_ops():
    """With every filter off: the processed distribution is softmax(x / T); sample_draft_filtered equals
    sample_draft; rejection_sample_logits with draft_probs equals rejection_sample on softmax(target / T)."""
    args = make_case(3, 12, 3, 90, params="off", draft="probs", ties=False)
    target, ids, dp, _, temperature, top_k, top_p, min_p, seeds, offsets = args
    p = torch.softmax(target / temperature[:, None, None], -1)
    torch.testing.assert_close(specdec_ops.processed_distribution(target, temperature, top_k, top_p, min_p), p,
                               rtol=1e-5, atol=1e-7)
    expected = specdec_ops.rejection_sample(p, ids, dp, seeds, offsets)
    assert torch.equal(run_cpp(args, False), expected)
    logits = target[:, 0].contiguous()
    probs, plain_probs = torch.empty_like(logits), torch.empty_like(logits)
    tokens = specdec_ops.sample_draft_filtered(logits, temperature, top_k, top_p, min_p, seeds, offsets, probs=probs)
    assert torch.equal(tokens, specdec_ops.sample_draft(logits, temperature, seeds, offsets, probs=plain_probs))
    torch.testing.assert_close(probs, plain_probs, rtol=1e-5, atol=1e-7)


def test_greedy_rows_are_greedy_verification():
    for block in (False, True):
        args = make_case(4, 16, 4, 40, params="greedy", draft="logits")
        target, ids = args[0], args[1]
        # Half the drafts are the argmax, so rows accept several tokens.
        ids = torch.where(torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)) < 0.7,
                          target[:, :4].argmax(-1), ids)
        args = (target, ids, *args[2:])
        out, lp = run_cpp(args, block, logprobs=True)
        assert torch.equal(out, specdec_ops.greedy_verify(target, ids))
        assert (out[:, 1:] != -1).any()
        assert torch.equal(lp, torch.zeros_like(lp))  # one-hot: log 1 (and 0 where the output is -1)


# --- kernels against the reference -------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("block", [False, True], ids=["tokenwise", "block"])
@pytest.mark.parametrize("draft", ["logits", "probs", "none"])
def test_matches_reference_mixed_batch(kernel, block, draft):
    """Mixed greedy and filtered rows, ties, -inf entries, invalid draft ids; V not a multiple of the block."""
    batch, vocab = (10, 37) if kernel is run_cpp or HAS_CUDA else (6, 37)
    args = make_case(100 + 7 * block + len(draft), batch, 3, vocab, draft=draft)
    out, _ = check_against_reference(kernel, args, block)
    assert ((out >= -1) & (out < vocab)).all()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_logits(kernel, dtype):
    skip_bf16_in_interpreter(kernel, dtype)
    args = make_case(8, 5, 2, 50, draft="logits", dtype=dtype, token_dtype=torch.int32)
    check_against_reference(kernel, args, False)


EDGES = {
    # name: (temperature, top_k, top_p, min_p) for every row
    "top_k_1": (1.0, 1, 1.0, 0.0),
    "top_k_V": (0.8, "V", 1.0, 0.0),
    "top_p_tiny": (1.2, 0, 1e-7, 0.0),
    "top_p_1": (1.0, 0, 1.0, 0.0),
    "min_p_near_1": (1.0, 0, 1.0, 0.999),
    "all_filters": (0.7, 5, 0.6, 0.05),
    "all_greedy": (0.0, 3, 0.5, 0.1),
}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", list(EDGES))
def test_edge_parameters(kernel, name):
    """Each edge alone over a batch; block verification on odd cases; ties and -inf entries throughout."""
    batch, k, vocab = 5, 2, 45
    args = list(make_case(200 + len(name), batch, k, vocab, draft="logits"))
    temperature, top_k, top_p, min_p = EDGES[name]
    args[4] = torch.full((batch,), temperature)
    args[5] = torch.full((batch,), vocab if top_k == "V" else top_k, dtype=torch.int32)
    args[6] = torch.full((batch,), top_p)
    args[7] = torch.full((batch,), min_p)
    out, lp = check_against_reference(kernel, tuple(args), block=len(name) % 2 == 1)
    if name in ("top_k_1", "top_p_tiny", "min_p_near_1"):
        # Only the tokens tied with the row max are kept; each coarse-grid row may have a few.
        probs = specdec_ops.processed_distribution(args[0], *args[4:8])
        assert ((probs > 0) == (args[0] == args[0].amax(-1, keepdim=True))).all()


@pytest.mark.parametrize("kernel", KERNELS)
def test_ties_at_the_cut_off(kernel):
    """Rows built so that the k-th largest and the top-p boundary fall inside runs of equal logits."""
    vocab, k = 24, 2
    row = torch.tensor([4.0] * 2 + [3.0] * 5 + [2.0] * 7 + [0.0] * 10)
    target = torch.stack([row[torch.randperm(vocab, generator=torch.Generator().manual_seed(s))]
                          for s in range(3 * (k + 1))]).reshape(3, k + 1, vocab)
    ids = target[:, :k].argmin(-1)  # tokens outside the kept set: rejected
    args = (target, ids, None, None, torch.ones(3), torch.tensor([3, 8, 0]), torch.tensor([1.0, 1.0, 0.5]),
            torch.zeros(3), torch.tensor([1, 2, 3]), torch.tensor([0, 10, 20]))
    out, _ = check_against_reference(kernel, args, False)
    probs = specdec_ops.processed_distribution(target, *args[4:8])
    assert ((probs[0] > 0).sum(-1) == 7).all() and ((probs[1] > 0).sum(-1) == 14).all()
    assert ((probs[2] > 0).sum(-1) == 7).all()  # 2 * e^4 / mass < 0.5 <= (2 e^4 + 5 e^3) / mass
    assert (out[:, 0] != -1).all() and (probs.gather(2, out[:, :1, None].clamp(min=0)) > 0).all()


def dead_weight_case(drafts, batch=8, token_dtype=torch.int64, negative_q=False):
    """The reviewer's repro: V = 8, k = 2, target p_0(3) = 0 (logit -inf) and draft q_1(5) = 0, every row the same
    drafts with its own seed. Block verification's weight dies at x_0 (p = 0, or an invalid id) and must stay 0:
    q_1(x_1) = 0 once compared 0 <= 0 and revived it to 1, emitting x_0 (p = 0, or out of the vocabulary) and x_1.
    negative_q: draft row 1 gets negative entries, so that R_1 > 0 although w_1 = 0 (the w_i > 0 guard)."""
    vocab, k = 8, 2
    gen = torch.Generator().manual_seed(5)
    target = torch.randn(1, k + 1, vocab, generator=gen).expand(batch, -1, -1).clone()
    target[:, 0, 3] = NEG_INF
    q = torch.rand(1, k, vocab, generator=gen) + 0.1
    q[0, 1, 5] = 0.0
    q = (q / q.sum(-1, keepdim=True)).expand(batch, -1, -1).clone()
    if negative_q:
        q[:, 1, :4] = -0.25
    ids = torch.tensor([drafts], dtype=token_dtype).expand(batch, -1).contiguous()
    return (target, ids, q, None, torch.ones(batch), torch.zeros(batch, dtype=torch.int64), torch.ones(batch),
            torch.zeros(batch), torch.arange(batch) * 7919 + 3, torch.arange(batch) * 3)


def assert_emits_only_supported_tokens(out, lp, args):
    """Every emitted token is in [0, V) with a positive processed target probability (a finite logprob)."""
    probs = specdec_ops.processed_distribution(args[0], *args[4:8])
    vocab = probs.shape[-1]
    emitted = out != -1
    assert ((out >= -1) & (out < vocab)).all(), out
    p_out = probs.gather(2, out.long().clamp(0, vocab - 1)[..., None])[..., 0]
    assert (p_out[emitted] > 0).all(), (out, p_out)
    assert torch.isfinite(lp).all(), lp
    for row in out:  # the create_output layout: an emitted prefix, then -1
        count = int((row != -1).sum())
        assert count >= 1 and (row[count:] == -1).all(), row


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("drafts", [[3, 5], [11, 5], [-1, 5], [1000000, 5], [8, 5], [3, 1000000], [-(2**31), 5]],
                         ids=lambda d: "_".join(map(str, d)))
@pytest.mark.parametrize("token_dtype", [torch.int64, torch.int32])
def test_block_weight_stays_zero_after_a_dead_draft(kernel, drafts, token_dtype):
    """The repro: no zero-probability or out-of-vocabulary token, no crash (the C++ logprob read of an emitted
    id 1000000 segfaulted), reference == CPU kernel == Triton, in both modes and every overload."""
    args = dead_weight_case(drafts, token_dtype=token_dtype)
    for block in (True, False):
        out, lp = check_against_reference(kernel, args, block)
        assert_emits_only_supported_tokens(out, lp, args)
        if drafts[0] in (3, 11, -1, 1000000, 8, -(2**31)):  # x_0 is dead: never emitted, nor x_1 after it
            assert (out[:, 1:] == -1).all(), out
            assert (out[:, 0] != drafts[0]).all(), out


@pytest.mark.parametrize("kernel", KERNELS)
def test_block_weight_zero_never_stops_with_negative_draft_probs(kernel):
    """draft_probs with negative entries (invalid input) give R_1 > 0 where w_1 = 0: the block still may not stop
    at 1, so the dead x_0 is never emitted."""
    args = dead_weight_case([3, 5], negative_q=True)
    out, lp = check_against_reference(kernel, args, True)
    assert (out[:, 0] != 3).all() and (out[:, 1:] == -1).all(), out


@pytest.mark.parametrize("kernel", KERNELS)
def test_block_dead_weights_random(kernel):
    """Random rows where drafts often have p = 0 (masked target logits, invalid ids) and q = 0 at later drafts:
    reference == kernel, and only supported tokens are emitted."""
    batch, k, vocab = (24, 4, 16) if kernel is run_cpp or HAS_CUDA else (8, 4, 16)
    gen = torch.Generator().manual_seed(77)
    args = list(make_case(61, batch, k, vocab, draft="probs", params="off"))
    target, ids, q = args[0].clone(), args[1].clone(), args[2].clone()
    dead = torch.rand(batch, k, generator=gen) < 0.4
    rows, cols = dead.nonzero(as_tuple=True)
    target[rows, cols, ids[rows, cols].clamp(0, vocab - 1)] = NEG_INF
    zero_q = torch.rand(batch, k, generator=gen) < 0.4
    rows, cols = zero_q.nonzero(as_tuple=True)
    q[rows, cols, ids[rows, cols].clamp(0, vocab - 1)] = 0.0
    q = q / q.sum(-1, keepdim=True)
    args[0], args[2] = target, q
    out, lp = check_against_reference(kernel, tuple(args), True)
    assert_emits_only_supported_tokens(out, lp, args)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("draft", ["logits", "probs", "none"])
def test_block_single_draft_matches_reference(kernel, draft):
    """k = 1 in block mode: no residual row, the stop point from u_0 < w_1 alone (mixed greedy and filtered rows,
    invalid ids)."""
    args = make_case(71 + len(draft), 6, 1, 40, draft=draft)
    out, lp = check_against_reference(kernel, args, True)
    assert_emits_only_supported_tokens(out, lp, args)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("block", [False, True])
def test_triton_multi_block_rows(block):
    """Rows spanning many blocks (block_v 16, V = 150): the online max, the search and the race across blocks."""
    args = make_case(31 + block, 4, 3, 150, draft="logits")
    check_against_reference(run_triton, args, block, block_v=16)


def peaked_logits(gen, shape):
    """LLM-like rows: a few strong candidates over a long low tail (a scaled Gumbel-ish spread), repeated values."""
    base = torch.randn(*shape, generator=gen) * 1.5
    lead = torch.rand(*shape, generator=gen) < 0.06
    return torch.round(torch.where(lead, base + 6.0, base) * 4) / 4


def split_vocab_case(seed, k, draft, params):
    """4 requests over V = 150 for the split-vocabulary tests: peaked rows, request 0 flat (a small cap overflows into
    the full search), params = (temperature, top_k, top_p, min_p) per request, and the draft's logits or its
    processed probabilities from the target's first k rows plus noise."""
    gen = torch.Generator().manual_seed(seed - 1)
    args = list(make_case(seed, 4, k, 150, draft=draft))
    args[0] = torch.where(torch.isinf(args[0]), args[0], peaked_logits(gen, args[0].shape))
    args[0][0] = torch.round(torch.randn(k + 1, 150, generator=gen) * 4) / 2  # request 0 flat
    args[4:8] = [torch.tensor(values) for values in params]
    noisy = args[0][:, :k] + torch.randn(4, k, 150, generator=gen) * 0.5
    if draft == "logits":
        args[3] = noisy.to(args[3].dtype)
    else:
        args[2] = contract.processed_distribution(noisy, *args[4:8])
    return tuple(args)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("num_chunks,cap,draft,fused", [(3, None, "logits", False), (5, 64, "probs", False),
                                                        (4, 64, "logits", True)])
def test_triton_split_vocab(num_chunks, cap, draft, fused):
    """V split into chunks across programs in every pass (statistics, filter, race; V = 150, blocks of 16): the
    partial statistics and histograms combined by each row's last program, the candidates gathered from all chunks,
    the race winners met in the atomic maximum; peaked rows (the histogram's bound finishes them by the sort) and
    flat ones (the cap of 32 or 64 overflows: the full search), both modes; `fused`: the filter pass run by each
    row's last statistics program instead of its own launch."""
    args = split_vocab_case(91 + num_chunks, 3, draft, ([0.9, 1.3, 0.7, 1.0], [5, 0, 40, 12], [0.9, 0.8, 1.0, 0.5],
                                                        [0.0, 0.0, 0.02, 0.0]))
    for block in (False, True):
        check_against_reference(run_triton, args, block, block_v=16, num_chunks=num_chunks,
                                gather_cap=cap, fused_filter=fused)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_split_vocab_min_p_and_greedy():
    """Split rows with min-p alone (the chunks' kept masses summed in order), greedy rows and filters off."""
    args = list(make_case(97, 4, 2, 100, draft="logits"))
    args[4] = torch.tensor([0.8, 0.0, 1.2, 1.0])
    args[5] = torch.tensor([0, 3, 0, 0])
    args[6] = torch.tensor([1.0, 0.5, 1.0, 1.0])
    args[7] = torch.tensor([0.1, 0.0, 0.3, 0.0])
    for fused in (False, True):
        check_against_reference(run_triton, tuple(args), False, block_v=16, num_chunks=4, fused_filter=fused)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_gather_cap_of_the_gpu():
    """The CUDA configuration's cap (1024 candidates sorted in registers) on CPU tensors: every row of V = 40 is
    finished by the gather at once, top-k, top-p and min-p alike (the interpreter's default cap of 32 makes most
    test rows search first)."""
    args = make_case(23, 1, 1, 40, draft="logits")
    args = (*args[:4], torch.ones(1), torch.tensor([6]), torch.tensor([0.9]), torch.tensor([0.05]), *args[8:])
    expected, expected_lp = reference(args, False, logprobs=True)
    if HAS_CUDA:
        return  # the CUDA tests run this cap through the op
    out, lp = kernels._launch_rejection(*args, False, None, True, gather_cap=kernels.LOGITS_SAMPLING["cap"])
    assert torch.equal(out, expected)
    torch.testing.assert_close(lp, expected_lp, **LOGPROB_TOL)


def outlier_case(top_k: list[int]):
    """Rows of V = 3000 whose maximum (entry 17) leads the rest by about 1300 logits, as a token's own tied
    embedding gives random weights: every other entry lies below the row's 63 histogram bins."""
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(len(top_k), 2, 3000, generator=gen) * 45
    target[:, :, 17] += 1300
    n = len(top_k)
    return target, (torch.ones(n), torch.tensor(top_k), torch.ones(n), torch.zeros(n))


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@pytest.mark.interpreter
def test_triton_outlier_maximum_keeps_a_tight_candidate_bound(monkeypatch):
    """The statistics pass's candidate bound for top-k on rows with an outlier maximum: anchored on the chunks' own
    top bins, it lies at or below the top_k-th largest entry (so the gather holds the kept set) and leaves few
    entries above it, where the row's top bin alone leaves every entry (and the whole-row search). 47 chunks of 64
    entries, as a 128256-entry row has 63 on the GPU."""
    target, params = outlier_case([5, 20, 40])
    monkeypatch.setattr(kernels, "_filter_kernel", _NoLaunch())  # the statistics pass's bound stays in stats
    stats = kernels._row_statistics(target, None, 1, 2, *params, 64, 47, None, fused_filter=False)[0]
    rows = target.reshape(-1, 3000)
    for g, row in enumerate(rows):
        top_k = int(params[1][g // 2])
        kth = row.sort(descending=True).values[top_k - 1]
        bound = stats[g, 1:2].view(torch.float32)  # the candidates' floor in x, as float32 bits
        above = int((row >= bound).sum())
        assert bound <= kth and above <= 2 * top_k + 16, (g, float(bound), float(kth), above)


# The gathers' floors: none, a few (ties included), many (past CAP), every finite one and, at -inf, the -inf entries
# too.
GATHER_FLOORS = (1e30, 2.0, 0.5, -1.0, -1e30, NEG_INF)


def gather_row(seed, vocab=301):
    """A logit row for the gather tests: a quarter grid (ties at the floors), about 5 % NaN and 5 % -inf."""
    gen = torch.Generator().manual_seed(seed)
    row = torch.round(torch.randn(vocab, generator=gen) * 8) / 4
    row[torch.rand(vocab, generator=gen) < 0.05] = float("nan")
    row[torch.rand(vocab, generator=gen) < 0.05] = NEG_INF
    return row


def check_gathered(count, segment, span, floor, cap, where):
    """The gather's count and segment [cap] (prefilled with 12345) hold the entries of span >= floor, in order: the
    count of all of them, the first cap stored, the rest of the segment untouched."""
    expected = span[span >= floor]  # NaN compares false
    assert count == expected.numel(), where
    stored = min(cap, expected.numel())
    assert torch.equal(segment[:stored].cpu(), expected[:stored]), where
    assert (segment[stored:].cpu() == 12345.0).all(), where


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("gather_run", [8, 1])
def test_triton_gather_stores_candidates_in_order(gather_run):
    """The filter pass's gather (`_gather_span_tl`, both scan forms): the logits x >= x_floor of [start, end), in
    order, at the segment's start, and their count, those past CAP counted but not stored; NaN logits and the
    padding past `end` are never candidates, even under a floor of -inf."""
    @triton.jit
    def gather_kernel(row_ptr, start, end, floor_ptr, segment_ptr, count_ptr, CAP: tl.constexpr,
                      GATHER_BLOCK: tl.constexpr, GATHER_RUN: tl.constexpr):
        i = tl.program_id(0)
        count = kernels._gather_span_tl(row_ptr, start, end, tl.load(floor_ptr + i), segment_ptr + i * CAP, CAP,
                                        GATHER_BLOCK, GATHER_RUN, 1)
        tl.store(count_ptr + i, count)

    device = "cuda" if HAS_CUDA else "cpu"
    vocab, block, cap = 301, 32, 40
    row = gather_row(11, vocab)
    for dtype in (torch.float32, torch.bfloat16):
        x = row.to(dtype)
        for start, end in ((0, vocab), (32, 290), (96, 100)):
            span = x[start:end].float()
            floors = torch.tensor(GATHER_FLOORS)
            segments = torch.full((len(floors), cap), 12345.0)
            counts = torch.full((len(floors),), -1, dtype=torch.int32)
            args = [t.to(device) for t in (x, floors, segments, counts)]
            gather_kernel[(len(floors),)](args[0], start, end, args[1], args[2], args[3], CAP=cap,
                                          GATHER_BLOCK=block, GATHER_RUN=gather_run)
            for i, floor in enumerate(floors.tolist()):
                check_gathered(args[3][i].item(), args[2][i], span, floor, cap, (dtype, start, end, floor))


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_finish_checks_the_floor():
    """The filter pass's finish accepts the thresholds it finds among the candidates (the logits x >= x_floor) only
    above z_floor = x_floor / t, where the candidates hold every entry (an entry just below x_floor may share the
    cut-off's z), unless x_floor is -inf; and only when the candidates reach the kept set (top_k of them, or top_p
    of the mass). Else the row takes the full search."""
    @triton.jit
    def finish_kernel(x_ptr, count_ptr, floor_ptr, t_ptr, top_k_ptr, top_p_ptr, rest_ptr, tau_ptr, enough_ptr):
        i = tl.program_id(0)
        index = tl.arange(0, 8)
        count = tl.load(count_ptr + i)
        x = tl.load(x_ptr + i * 8 + index, mask=index < count, other=float("-inf"))
        t = tl.load(t_ptr + i)
        top_k = tl.load(top_k_ptr + i)
        top_p = tl.load(top_p_ptr + i)
        m = tl.max(x, axis=0) / t
        mass_all = tl.sum(tl.exp(x / t - m), axis=0) + tl.load(rest_ptr + i)  # rest: the non-candidates' mass
        tau, _, enough = kernels._finish_sorted_tl(x, count, t, m, top_k > 0, top_k, mass_all, top_p < 1.0, top_p,
                                                   0.0, tl.load(floor_ptr + i), 8)
        tl.store(tau_ptr + i, kernels._key_value_tl(tau))
        tl.store(enough_ptr + i, enough.to(tl.int32))

    inf = float("inf")
    # (candidates, floor, t, top_k, top_p, the others' mass, the expected threshold in z or None: the search)
    cases = [([5, 4, 3, 2], 1.5, 1.0, 2, 1.0, 0.0, 4.0),     # tau_k above the floor
             ([5, 4], 4.0, 1.0, 2, 1.0, 0.0, None),          # tau_k at the floor: an entry below may tie with it
             ([5, 4, 3, 2], -inf, 1.0, 2, 1.0, 0.0, 4.0),    # every entry is a candidate
             ([5, 4, 3, 2], -inf, 2.0, 2, 1.0, 0.0, 2.0),    # ... in z = x / t
             ([5, 4], 3.5, 1.0, 3, 1.0, 0.0, None),          # fewer candidates than top_k
             ([5, 4, 3], 2.5, 1.0, 0, 0.8, 0.0, 4.0),        # tau_p above the floor
             ([5, 4], 4.0, 1.0, 0, 0.8, 0.0, None),          # tau_p at the floor
             ([5, 4], 3.5, 1.0, 0, 0.999, 1.0, None),        # the candidates' mass does not reach top_p
             ([5, 4, 3], 2.5, 1.0, 2, 0.5, 0.0, 5.0)]        # top-k then top-p
    x = torch.full((len(cases), 8), -inf)
    for i, case in enumerate(cases):
        x[i, :len(case[0])] = torch.tensor(case[0], dtype=torch.float32)
    device = "cuda" if HAS_CUDA else "cpu"
    args = [x, torch.tensor([len(c[0]) for c in cases], dtype=torch.int32),
            torch.tensor([c[1] for c in cases]), torch.tensor([c[2] for c in cases]),
            torch.tensor([c[3] for c in cases], dtype=torch.int32), torch.tensor([c[4] for c in cases]),
            torch.tensor([c[5] for c in cases])]
    tau = torch.empty(len(cases), device=device)
    enough = torch.empty(len(cases), dtype=torch.int32, device=device)
    finish_kernel[(len(cases),)](*(a.to(device) for a in args), tau, enough)
    for i, case in enumerate(cases):
        expected = case[-1]
        assert bool(enough[i]) == (expected is not None), (i, case)
        if expected is not None:
            assert float(tau[i]) == expected, (i, case, float(tau[i]))


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_outlier_maximum_matches_reference():
    target, params = outlier_case([5, 20, 40])
    gen = torch.Generator().manual_seed(1)
    drafts = torch.randint(0, 3000, (3, 1), generator=gen)
    drafts[0, 0] = 17
    args = (target, drafts, None, target[:, :1] + 0.5, *params, torch.tensor([1, 2, 3]), torch.tensor([0, 5, 9]))
    for block in (False, True):
        check_against_reference(run_triton, args, block, block_v=64, num_chunks=47)
    draft_args = (target[:, 1].contiguous(), *params, torch.tensor([4, 5, 6]), torch.tensor([1, 2, 3]))
    probs = torch.empty(3, 3000)
    want_probs = torch.empty(3, 3000)
    assert torch.equal(draft_triton(draft_args, probs, block_v=64, num_chunks=47),
                       specdec_ops.sample_draft_filtered_reference(*draft_args, probs=want_probs))
    torch.testing.assert_close(probs, want_probs, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kernel", KERNELS)
def test_batch_invariance_and_fresh_draws(kernel):
    args = make_case(41, 6, 2, 30, draft="probs")
    alone = kernel(args, False)
    for row in (0, 3, 5):
        one = tuple(None if a is None else a[row:row + 1] for a in args)
        assert torch.equal(kernel(one, False), alone[row:row + 1])
    moved = list(args)
    moved[9] = args[9] + 1000  # new offsets: new draws
    assert not torch.equal(kernel(tuple(moved), False), alone)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_row_sums_do_not_depend_on_the_batch():
    """A row's S, so its logprobs and the draft's probabilities, is combined from chunks of a fixed length: bit for
    bit the same alone as in a batch of 8, though the race passes split a small batch into more chunks (V = 300 in
    blocks of 16: several statistics chunks). A chunking that followed the batch size fails this for some rows.
    Block verification's residual masses are per-chunk partials too (in a batch of 8 one program adds several
    chunks, a request alone one chunk per program)."""
    args = make_case(43, 8, 3, 300, params="off", ties=False)
    out, logprobs = run_triton(args, False, logprobs=True, block_v=16)
    out_block, logprobs_block = run_triton(args, True, logprobs=True, block_v=16)
    draft_args = (args[0][:, 0].contiguous(), *args[4:10])
    probs = torch.empty(8, 300)
    draft_triton(draft_args, probs, block_v=16)
    for row in range(8):
        one = tuple(None if a is None else a[row:row + 1] for a in args)
        out_one, logprobs_one = run_triton(one, False, logprobs=True, block_v=16)
        assert torch.equal(out_one, out[row:row + 1])
        assert torch.equal(logprobs_one, logprobs[row:row + 1])
        out_one, logprobs_one = run_triton(one, True, logprobs=True, block_v=16)
        assert torch.equal(out_one, out_block[row:row + 1])
        assert torch.equal(logprobs_one, logprobs_block[row:row + 1])
        probs_one = torch.empty(1, 300)
        draft_triton(tuple(a[row:row + 1] for a in draft_args), probs_one, block_v=16)
        assert torch.equal(probs_one, probs[row:row + 1])


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("num_chunks", [5, 10], ids=["two_block_chunks", "one_block_chunks"])
def test_triton_chunks_per_program_do_not_change_results(num_chunks):
    """The statistics and filter passes give a program several consecutive chunks, as many as the batch size calls
    for: each chunk's partial is still its own and the row's last program combines them in chunk order, so logprobs
    (S) and tokens are bit for bit the same for 1, 2, 3 or all chunks per program, with the filter pass fused or not
    (filtered, min-p, plain and greedy rows), token-wise and block verification. V = 150 in blocks of 16: 5 chunks
    of two blocks (the online-sum loop), or 10 chunks of one block, the last one short (CHUNK_IS_BLOCK, the GPU's
    path, whose statistics compute the sum for random rows only and the argmax for greedy rows only)."""
    gen = torch.Generator().manual_seed(77)
    args = list(make_case(78, 4, 2, 150, draft="logits"))
    args[0] = torch.where(torch.isinf(args[0]), args[0], peaked_logits(gen, args[0].shape))
    args[4] = torch.tensor([0.9, 1.2, 0.8, 0.0])
    args[5] = torch.tensor([7, 0, 0, 5])
    args[6] = torch.tensor([0.8, 1.0, 1.0, 0.9])
    args[7] = torch.tensor([0.0, 0.1, 0.0, 0.0])
    launch = dict(block_v=16, num_chunks=num_chunks)
    assert kernels._statistics_plan(150, torch.device("cpu"), 16, num_chunks)[1] == 16 * (10 // num_chunks)
    for block in (False, True):  # block verification's residual pass takes the same grid
        expected, expected_lp = reference(tuple(args), block, logprobs=True)
        one_chunk, one_chunk_lp = run_triton(tuple(args), block, logprobs=True, chunks_per_program=1,
                                             fused_filter=False, **launch)
        assert torch.equal(one_chunk, expected)
        torch.testing.assert_close(one_chunk_lp, expected_lp, **LOGPROB_TOL)
        for chunks_per_program, fused in ((2, False), (num_chunks, True), (3, True)):
            out, lp = run_triton(tuple(args), block, logprobs=True, chunks_per_program=chunks_per_program,
                                 fused_filter=fused, **launch)
            assert torch.equal(out, one_chunk)
            assert torch.equal(lp, one_chunk_lp)
    if not HAS_CUDA:
        assert scratch_is_zeroed()


@pytest.mark.parametrize("kernel", KERNELS)
def test_infinite_temperature_is_uniform(kernel):
    """temperature = inf is a random row whose z = x / T is 0 everywhere: the uniform distribution over the row,
    whatever the filters (all of it ties at their cut-offs), as the reference has it; 3e38 (z about 1e-38, the
    kernels' exp2 scale below its floor of 1e-30) too. V = 100 in one-block chunks of 64, whose padding must not
    turn the sums into NaN."""
    args = list(make_case(57, 4, 2, 100, draft="logits", masked=False))
    args[4] = torch.tensor([math.inf, 3e38, math.inf, 0.7])
    args[5] = torch.tensor([0, 0, 10, 0])
    launch = dict(block_v=64) if kernel is run_triton else {}
    for block in (False, True):
        expected, expected_lp = check_against_reference(kernel, tuple(args), block, **launch)
        uniform = expected_lp[[0, 2]][expected[[0, 2]] >= 0]  # the emitted tokens of the rows at T = inf
        torch.testing.assert_close(uniform, torch.full_like(uniform, -math.log(100)))
    if kernel is run_triton:  # the rows' statistics themselves: S = V at T = inf, every row finite
        device = "cuda" if HAS_CUDA else "cpu"
        target, draft_logits = (args[0].to(device), args[3].to(device))
        stats = kernels._row_statistics(target, draft_logits, 2, 5, args[4].to(device), None, None, None, 64, None,
                                        None)[0].cpu()
        assert torch.equal(stats[:5, 2].view(torch.float32), torch.full((5,), 100.0)), stats


@pytest.mark.parametrize("params", ["off", "filters"])
def test_non_finite_rows_stay_in_range(params):
    """NaN, +inf and all -inf rows: tokens unspecified but in [0, V), with the searches bounded; the other rows as
    the reference."""
    args = list(make_case(51, 6, 2, 40, draft="logits", params="off"))
    if params == "filters":
        args[5] = torch.tensor([3, 0, 5, 2, 0, 7])
        args[6] = torch.tensor([0.5, 0.8, 1.0, 0.9, 0.3, 0.7])
        args[7] = torch.tensor([0.0, 0.1, 0.0, 0.05, 0.0, 0.0])
    target = args[0].clone()
    target[0] = float("nan")
    target[1, :, 3] = float("inf")
    target[2] = NEG_INF
    args[0] = target
    for kernel in [run_cpp] + ([run_triton] if HAS_TRITON else []):
        for block in (False, True):
            out = kernel(tuple(args), block)
            for row in out:
                emitted = int((row != -1).sum())
                assert emitted >= 1 and (row[emitted:] == -1).all()
                assert ((row[:emitted] >= 0) & (row[:emitted] < 40)).all(), row
            expected = reference(tuple(args), block)
            assert torch.equal(out[3:], expected[3:])


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_gather_from_sub_blocks_stores_candidates_in_order():
    """The filter pass's gather from sub-block maxima (`_gather_sub_blocks_tl`): the same candidates, order and count
    as the plain gather, while reading only the sub-blocks whose maximum reaches the floor: a sub-block whose
    maximum is poisoned below the floor is skipped (its entries never become candidates), which shows the gather
    trusts the maxima rather than reading everything."""
    @triton.jit
    def gather_kernel(row_ptr, submax_ptr, subs_ptr, num_subs, start, end, floor_ptr, segment_ptr, count_ptr,
                      CAP: tl.constexpr, GATHER_BLOCK: tl.constexpr, SUB_BLOCK: tl.constexpr):
        i = tl.program_id(0)
        count = kernels._gather_sub_blocks_tl(row_ptr, submax_ptr, subs_ptr + i * num_subs, start, end,
                                              tl.load(floor_ptr + i), segment_ptr + i * CAP, CAP, GATHER_BLOCK,
                                              SUB_BLOCK)
        tl.store(count_ptr + i, count)

    device = "cuda" if HAS_CUDA else "cpu"
    vocab, sub, cap = 301, 16, 40
    row = gather_row(12, vocab)
    row[160:176] = float("nan")  # a sub-block of NaN alone
    num_subs = -(-vocab // sub)
    for poisoned in (None, 3):
        for dtype in (torch.float32, torch.bfloat16):
            x = row.to(dtype)
            padded = torch.cat([x.float(), torch.full((num_subs * sub - vocab,), NEG_INF)]).view(num_subs, sub)
            maxima = torch.where(torch.isnan(padded), NEG_INF, padded).max(dim=1).values  # NaN ignored
            if poisoned is not None:
                maxima[poisoned] = -1e30  # below every floor but -1e30 and -inf
            for start, end in ((0, vocab), (32, 290), (96, 100)):
                for gather_block in (16, 64):
                    floors = torch.tensor(GATHER_FLOORS)
                    segments = torch.full((len(floors), cap), 12345.0)
                    counts = torch.full((len(floors),), -1, dtype=torch.int32)
                    subs = torch.full((len(floors), num_subs), -7, dtype=torch.int32)
                    args = [t.to(device) for t in (x, maxima, subs, floors, segments, counts)]
                    gather_kernel[(len(floors),)](args[0], args[1], args[2], num_subs, start, end, args[3], args[4],
                                                  args[5], CAP=cap, GATHER_BLOCK=gather_block, SUB_BLOCK=sub)
                    for i, floor in enumerate(floors.tolist()):
                        span = x.float().clone()
                        if poisoned is not None and floor > -1e30:  # float32: the floor is the maximum
                            span[poisoned * sub:(poisoned + 1) * sub] = float("nan")  # skipped
                        check_gathered(args[5][i].item(), args[4][i], span[start:end], floor, cap,
                                       (dtype, start, end, gather_block, poisoned, floor))


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("one_block", [True, False], ids=["one_block_chunk", "two_block_chunk"])
def test_triton_statistics_store_sub_block_maxima(one_block):
    """A filtered chunk's statistics store the maximum of each SUB_BLOCK entries (NaN ignored, -inf past the row's
    end), the bound the filter pass trusts to skip a sub-block: a chunk read as one block, and one read in two."""
    @triton.jit
    def stats_kernel(row_ptr, start, end, vocab, hist_ptr, submax_ptr, ONE_BLOCK: tl.constexpr,
                     BLOCK_V: tl.constexpr, SUB_BLOCK: tl.constexpr):
        if ONE_BLOCK:
            kernels._chunk_stats_block_tl(row_ptr, start, end, vocab, 1.0, hist_ptr, submax_ptr, True, True,
                                          BLOCK_V, 64, 1, 4, SUB_BLOCK, False)
        else:
            kernels._chunk_stats_tl(row_ptr, start, end, vocab, 1.0, hist_ptr, submax_ptr, True, BLOCK_V, 1, 64, 1,
                                    4, SUB_BLOCK)

    device = "cuda" if HAS_CUDA else "cpu"
    gen = torch.Generator().manual_seed(13)
    vocab, sub = 150, 8
    block = 32 if one_block else 16
    row = torch.randn(vocab, generator=gen) * 4
    row[torch.rand(vocab, generator=gen) < 0.1] = float("nan")
    row[torch.rand(vocab, generator=gen) < 0.1] = NEG_INF
    row[136:144] = float("nan")
    for start in (96, 128):  # a full chunk, and the row's last (22 entries, then padding)
        end = min(start + 32, vocab)
        submax = torch.full((32 // sub,), 12345.0)
        args = [t.to(device) for t in (row, torch.zeros(64, dtype=torch.int32), submax)]
        stats_kernel[(1,)](args[0], start, end, vocab, args[1], args[2], ONE_BLOCK=one_block, BLOCK_V=block,
                           SUB_BLOCK=sub)
        chunk = torch.cat([row[start:end], torch.full((start + 32 - end,), NEG_INF)]).view(-1, sub)
        expected = torch.where(torch.isnan(chunk), NEG_INF, chunk).max(dim=1).values
        got = args[2].cpu()
        # An all-NaN sub-block's maximum may be NaN or -inf: either reaches no floor above -inf.
        all_nan = torch.isnan(chunk).all(dim=1)
        assert torch.equal(got[~all_nan], expected[~all_nan]), (start, got, expected)
        assert (torch.isnan(got[all_nan]) | (got[all_nan] == NEG_INF)).all(), (start, got)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_sub_blocks_do_not_change_results(monkeypatch):
    """The filter pass reading only the sub-blocks whose maximum reaches its floor (geometry sub_block) gathers the
    same candidates in the same order, so tokens and logprobs are bit for bit those of the full read: draft logits
    in chunks of one block, several programs per row; draft probabilities in chunks of two blocks, the filter fused;
    token-wise and block verification; sample_draft_filtered with its probabilities; peaked and flat rows (the cap
    overflows into the full search), greedy, min-p and unfiltered rows."""
    params = ([0.9, 1.2, 0.0, 0.8], [7, 0, 3, 30], [0.8, 0.9, 1.0, 1.0], [0.0, 0.1, 0.0, 0.02])
    cases = [split_vocab_case(94, 2, draft, params) for draft in ("logits", "probs")]
    launches = [dict(num_chunks=10, chunks_per_program=3, fused_filter=False),
                dict(num_chunks=5, chunks_per_program=5, fused_filter=True, gather_cap=64)]
    draft_args = list(make_draft_case(74, 10, 120))
    gen = torch.Generator().manual_seed(95)
    draft_args[0] = torch.where(torch.isinf(draft_args[0]), draft_args[0], peaked_logits(gen, draft_args[0].shape))
    launched = []  # the statistics pass's SUB_BLOCK per launch: the sub-block path must run

    class RecordingLaunch:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(kwargs["SUB_BLOCK"])
                return self.kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(kernels, "_stats_kernel", RecordingLaunch(kernels._stats_kernel))
    for sub_block in (0, 8):
        monkeypatch.setitem(kernels.LOGITS_SAMPLING, "sub_block", sub_block)
        launched.clear()
        results = []
        for args, launch in zip(cases, launches):
            for block in (False, True):
                results.append(run_triton(args, block, logprobs=True, block_v=16, **launch))
        probs = torch.empty(10, 120)
        results.append((draft_triton(tuple(draft_args), probs, block_v=16, num_chunks=4), probs))
        assert set(launched) == {sub_block}, launched
        if sub_block == 0:
            full_read = results
            expected, expected_lp = reference(cases[0], False, logprobs=True)
            assert torch.equal(results[0][0], expected)
            torch.testing.assert_close(results[0][1], expected_lp, **LOGPROB_TOL)
            continue
        for (out, lp), (full_out, full_lp) in zip(results, full_read):
            assert torch.equal(out, full_out), sub_block
            assert torch.equal(lp, full_lp), sub_block
    if not HAS_CUDA:
        assert scratch_is_zeroed()


# --- sample_draft_filtered ---------------------------------------------------------------------------------------


def draft_cpp(args, probs=None, **_):
    return specdec_ops.sample_draft_filtered(*args, probs=probs)


def draft_triton(args, probs=None, block_v=None, **launch):
    if HAS_CUDA:
        cuda_probs = None if probs is None else torch.empty_like(probs, device="cuda")
        out = kernels._launch_draft(*(None if a is None else a.cuda() for a in args), cuda_probs, block_v=block_v,
                                    **launch).cpu()
        if probs is not None:
            probs.copy_(cuda_probs.cpu())
        return out
    contract.check_draft_inputs(*args, probs)
    return kernels._launch_draft(*args, probs, block_v=block_v, **launch)


DRAFT_KERNELS = [pytest.param(draft_cpp, id="cpp")]
if HAS_TRITON:
    DRAFT_KERNELS.append(pytest.param(draft_triton, id="triton"))


def make_draft_case(seed, rows, vocab, params="mixed", dtype=torch.float32):
    args = make_case(seed, rows, 1, vocab, params=params)
    return (args[0][:, 0].contiguous().to(dtype), *args[4:10])


@pytest.mark.parametrize("kernel", DRAFT_KERNELS)
@pytest.mark.parametrize("params", ["mixed", "greedy", "off"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sample_draft_filtered_matches_reference(kernel, params, dtype):
    skip_bf16_in_interpreter(kernel if kernel is draft_cpp else run_triton, dtype)
    args = make_draft_case(61 + len(params), 12, 70, params, dtype)
    expected_probs = torch.empty(12, 70)
    expected = specdec_ops.sample_draft_filtered_reference(*args, probs=expected_probs)
    assert torch.equal(kernel(args), expected)
    probs = torch.full((12, 70), -1.0)
    assert torch.equal(kernel(args, probs, block_v=16), expected)
    torch.testing.assert_close(probs, expected_probs, rtol=1e-5, atol=1e-7)
    assert (expected_probs.gather(1, expected[:, None]) > 0).all()  # the token is in the kept set


DRAFT_PROBS_TOL = dict(rtol=1e-5, atol=1e-7)  # the draft's q against the reference's, as in the tests above


def check_draft_against_reference(kernel, args):
    """Both overloads of sample_draft_filtered equal the reference: the default one (no probs) and .with_probs
    (probs=, a buffer prefilled with -1, so every entry must be written), the latter in blocks of 16 (V is not a
    multiple of 16 in the callers; the default overload takes the launcher's default block, larger than V).
    Tokens exactly, probs within DRAFT_PROBS_TOL; the token lies in the reference's kept set."""
    rows, vocab = args[0].shape
    expected_probs = torch.empty(rows, vocab)
    expected = specdec_ops.sample_draft_filtered_reference(*args, probs=expected_probs)
    got = kernel(args)
    assert got.dtype == torch.int64 and torch.equal(got, expected), (got, expected)
    probs = torch.full((rows, vocab), -1.0)
    got = kernel(args, probs, block_v=16)
    assert torch.equal(got, expected), (got, expected)
    torch.testing.assert_close(probs, expected_probs, **DRAFT_PROBS_TOL)
    assert (expected_probs.gather(1, expected[:, None]) > 0).all()
    return expected, expected_probs


@pytest.mark.parametrize("kernel", DRAFT_KERNELS)
def test_sample_draft_filtered_infinite_temperature(kernel):
    """temperature +inf (valid: only NaN is refused): z = x / T is 0 at every finite logit, so each row is uniform
    whatever top-k and top-p say (their cut-offs tie the whole row). q is finite and equals the reference's."""
    rows, vocab = 4, 20
    gen = torch.Generator().manual_seed(8)
    args = (torch.randn(rows, vocab, generator=gen) * 3, torch.full((rows,), float("inf")),
            torch.tensor([5, 0, 1, 19]), torch.tensor([1.0, 0.5, 0.9, 1.0]), torch.zeros(rows),
            torch.arange(rows) + 3, torch.arange(rows))
    _, probs = check_draft_against_reference(kernel, args)
    torch.testing.assert_close(probs, torch.full((rows, vocab), 1 / vocab))


@pytest.mark.parametrize("kernel", DRAFT_KERNELS)
@pytest.mark.parametrize("name", list(EDGES))
def test_sample_draft_filtered_edge_parameters(kernel, name):
    """sample_draft_filtered over each of EDGES alone (top_k of 1 and of V, top_p tiny and 1, min_p near 1, every
    filter, all-greedy): coarse-grid logits (ties) with -inf entries, V = 45 (not a multiple of the block), and
    row 0 all -inf but 3 entries (two of them tied at the max)."""
    rows, vocab = 6, 45
    args = list(make_draft_case(300 + len(name), rows, vocab))
    logits = args[0].clone()
    logits[0] = NEG_INF
    logits[0, [4, 30, 44]] = torch.tensor([1.5, 1.5, 0.5])
    args[0] = logits
    temperature, top_k, top_p, min_p = EDGES[name]
    args[1] = torch.full((rows,), temperature)
    args[2] = torch.full((rows,), vocab if top_k == "V" else top_k, dtype=torch.int32)
    args[3] = torch.full((rows,), top_p)
    args[4] = torch.full((rows,), min_p)
    assert (logits == NEG_INF).any(-1).all() and (logits == logits.amax(-1, keepdim=True)).sum(-1).max() > 1
    tokens, probs = check_draft_against_reference(kernel, tuple(args))
    at_max = logits == logits.amax(-1, keepdim=True)
    if name in ("top_k_1", "top_p_tiny", "min_p_near_1"):
        assert ((probs > 0) == at_max).all()  # only the tokens tied with the row max are kept
    if name == "all_greedy":
        assert torch.equal(tokens, logits.argmax(-1))  # the first argmax among ties
    assert (probs[torch.isinf(logits)] == 0).all()  # -inf entries have probability 0


@pytest.mark.parametrize("kernel", DRAFT_KERNELS)
def test_sample_draft_filtered_ties_at_the_cut_off(kernel):
    """The rows of test_ties_at_the_cut_off for the draft op: the k-th largest (top_k 3 and 8) and the top-p
    boundary (0.5) fall inside runs of equal logits, and a greedy row's max is tied; odd rows have -inf in place of
    the tail of zeros. V = 24 (not a multiple of the block), 4 rows per parameter set, each its own seed."""
    vocab, per = 24, 4
    gen = torch.Generator().manual_seed(0)
    rows = []
    for s in range(4 * per):
        tail = 0.0 if s % 2 == 0 else NEG_INF
        row = torch.tensor([4.0] * 2 + [3.0] * 5 + [2.0] * 7 + [tail] * 10)
        rows.append(row[torch.randperm(vocab, generator=gen)])
    logits = torch.stack(rows)
    n = logits.shape[0]
    repeat = lambda values, dtype=None: torch.tensor(values, dtype=dtype).repeat_interleave(per)  # noqa: E731
    args = (logits, repeat([1.0, 1.0, 1.0, 0.0]), repeat([3, 8, 0, 0], torch.int64), repeat([1.0, 1.0, 0.5, 1.0]),
            torch.zeros(n), torch.arange(n) * 7919 + 1, torch.arange(n) * 13)
    tokens, probs = check_draft_against_reference(kernel, args)
    kept = (probs > 0).sum(-1)
    assert kept.tolist() == [7] * per + [14] * per + [7] * per + [1] * per
    assert torch.equal(tokens[3 * per:], logits[3 * per:].argmax(-1))  # the first of the two tied maxima


FILTERS = ("top_k", "top_p", "min_p")
NONE_CASES = {"all": ("top_k", "top_p", "min_p"), "top_k": ("top_k",), "top_p": ("top_p",), "min_p": ("min_p",),
              "top_k_and_top_p": ("top_k", "top_p")}


def filters_as(args, names, as_none: bool, first: int = 5):
    """args with the named filters replaced by None, or by their off values in every row. first: the index of
    top_k (then top_p, min_p) in args: 5 in make_case's tuple, 2 in make_draft_case's."""
    args = list(args)
    batch = args[0].shape[0]
    off = {"top_k": torch.zeros(batch, dtype=torch.int32), "top_p": torch.ones(batch), "min_p": torch.zeros(batch)}
    for name in names:
        args[first + FILTERS.index(name)] = None if as_none else off[name]
    return tuple(args)


class _RefusedLaunch:
    def __getitem__(self, grid):
        raise AssertionError("the filter pass was launched although every filter is None")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", list(NONE_CASES))
def test_filters_given_as_none_are_off(kernel, case, monkeypatch):
    """A filter passed as None is off for every request: every overload gives the tokens, counters and logprobs of
    its off value in every row (top_k 0, top_p 1, min_p 0), token-wise and with block verification, the reference
    alike. The other filters stay on (mixed parameters, some rows filtered). The Triton kernels also run with rows
    of 3 chunks and the filter pass unfused (its own launch: min-p alone with the histograms compiled out); with all
    three None that launch must not happen."""
    if kernel is run_triton and case == "all":
        monkeypatch.setattr(kernels, "_filter_kernel", _RefusedLaunch())
    for draft in ("logits", "probs"):
        args = make_case(23 + len(case), 5, 3, 41, params="mixed", draft=draft)
        for block in (False, True):
            expected, expected_lp = reference(filters_as(args, NONE_CASES[case], False), block, logprobs=True)
            got, got_lp = check_against_reference(kernel, filters_as(args, NONE_CASES[case], True), block)
            assert torch.equal(got, expected)
            torch.testing.assert_close(got_lp, expected_lp, **LOGPROB_TOL)
            if kernel is run_triton:
                check_against_reference(kernel, filters_as(args, NONE_CASES[case], True), block, block_v=16,
                                        num_chunks=3, fused_filter=False)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("draft", ["logits", "probs", "none"])
def test_triton_accept_tests_from_the_statistics_pass(draft, monkeypatch):
    """With every filter None (no filter pass) the statistics pass stores p(x_i) and q(x_i) at the draft tokens and
    the verification kernels read them there (AT_DRAFT); with min_p given as zeros a filter pass runs and they
    compute both from the logits themselves. Tokens, logprobs and counters are bit for bit the same either way:
    mixed greedy and random rows, draft ids outside [0, V), token-wise and block verification, rows of one and of
    several chunks. (geometry accept_from_statistics turns the first form on.)"""
    monkeypatch.setitem(kernels.LOGITS_SAMPLING, "accept_from_statistics", 1)
    launched = []
    for name in ("_race_verify_kernel", "_block_residual_kernel"):
        kernel = getattr(kernels, name)

        class Spy:
            def __getitem__(self, grid, kernel=kernel, name=name):
                def launch(*args, **kwargs):
                    launched.append((name, kwargs["AT_DRAFT"]))
                    return kernel[grid](*args, **kwargs)
                return launch
        monkeypatch.setattr(kernels, name, Spy())
    args = list(make_case(61, 6, 3, 70, params="mixed", draft=draft))
    args[4] = torch.tensor([0.0, 0.8, 1.3, 0.0, 1.0, 0.6])  # greedy rows 0 and 3
    with_none = tuple(args[:5]) + (None, None, None) + tuple(args[8:])
    with_zero_min_p = tuple(args[:5]) + (None, None, torch.zeros(6)) + tuple(args[8:])
    for block in (False, True):
        for launch in ({}, dict(block_v=16, num_chunks=5)):
            launched.clear()
            counters = torch.zeros(3, dtype=torch.int64)
            got = run_triton(with_none, block, counters, logprobs=True, **launch)
            assert launched and all(at_draft for _, at_draft in launched), launched
            launched.clear()
            zero_counters = torch.zeros(3, dtype=torch.int64)
            expected = run_triton(with_zero_min_p, block, zero_counters, logprobs=True, **launch)
            assert launched and not any(at_draft for _, at_draft in launched), launched
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
            assert torch.equal(counters, zero_counters)
            assert torch.equal(got[0], reference(with_none, block))


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("draft,dtype,ids", [("logits", torch.float32, torch.int64),
                                             ("probs", torch.float32, torch.int64),
                                             ("none", torch.float32, torch.int32),
                                             ("logits", torch.float16, torch.int32)])
def test_triton_statistics_pass_stores_the_accept_tests_values(draft, dtype, ids, monkeypatch):
    """The p(x_i) and q(x_i) the statistics pass stores (AT_DRAFT) equal, bit for bit, what `_accept_tests_tl`
    computes from the row statistics and the logits at the draft tokens: both forms of the accept tests run on the
    same statistics. Greedy rows, invalid draft ids, int32 ids, float16 target logits beside float32 draft logits."""

    @triton.jit
    def accept_values(target_ptr, draft_ptr, q_ptr, temperature_ptr, min_p_ptr, seed_ptr, offset_ptr, stats_ptr,
                      at_draft_ptr, out_ptr, k, vocab, num_rows, t_stride_b, t_stride_i, draft_stride_b, q_stride_b,
                      q_stride_i, HAS_DRAFT_PROBS: tl.constexpr, HAS_DRAFT_LOGITS: tl.constexpr,
                      BLOCK_K: tl.constexpr, AT_DRAFT: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        (_, _, _, _, _, i, in_k, _, _, _, _, _, _, _, _, _, p_x, q_x, _, _) = kernels._accept_tests_tl(
            b, target_ptr, draft_ptr, q_ptr, temperature_ptr, min_p_ptr, seed_ptr, offset_ptr, stats_ptr,
            at_draft_ptr, k, vocab, num_rows, t_stride_b, t_stride_i, draft_stride_b, q_stride_b, q_stride_i, 1, 0,
            1, 1, HAS_DRAFT_PROBS, HAS_DRAFT_LOGITS, BLOCK_K, AT_DRAFT)
        tl.store(out_ptr + (b * BLOCK_K + i) * 2, p_x, mask=in_k)
        tl.store(out_ptr + (b * BLOCK_K + i) * 2 + 1, q_x, mask=in_k)

    monkeypatch.setitem(kernels.LOGITS_SAMPLING, "accept_from_statistics", 1)
    device = "cuda" if HAS_CUDA else "cpu"
    batch, k, vocab = 6, 3, 70
    args = list(make_case(67, batch, k, vocab, params="mixed", draft=draft, token_dtype=ids))
    args[4] = torch.tensor([0.0, 0.8, 1.3, 0.0, 1.0, 0.6])  # greedy rows 0 and 3
    target, draft_ids, draft_probs, draft_logits, temperature = (None if a is None else a.to(device)
                                                                  for a in args[:5])
    target = target.to(dtype)
    num_rows = k + 1 + (k if draft_logits is not None else 0)
    stats, at_draft = kernels._row_statistics(target, draft_logits, k, num_rows, temperature, None, None, None, 16,
                                              None, None, draft_ids=draft_ids, draft_probs=draft_probs)
    assert at_draft is not None
    q = draft_probs if draft_probs is not None else (draft_logits if draft_logits is not None else target)
    min_p = torch.zeros(batch, device=device)
    values = {}
    for from_statistics in (False, True):
        out = torch.full((batch, 4, 2), float("nan"), device=device)
        accept_values[(batch,)](target, draft_ids, q, temperature, min_p, args[8].to(device), args[9].to(device),
                                stats, at_draft, out, k, vocab, num_rows, target.stride(0), target.stride(1),
                                draft_ids.stride(0), q.stride(0), q.stride(1),
                                HAS_DRAFT_PROBS=draft_probs is not None, HAS_DRAFT_LOGITS=draft_logits is not None,
                                BLOCK_K=4, AT_DRAFT=from_statistics)
        values[from_statistics] = out[:, :k].cpu()
    assert torch.equal(values[True].view(torch.int32), values[False].view(torch.int32)), values
    assert (values[False][..., 0] > 0).any() and (values[False][..., 0] == 0).any()  # real and invalid positions


@pytest.mark.parametrize("kernel", DRAFT_KERNELS)
@pytest.mark.parametrize("case", list(NONE_CASES))
def test_sample_draft_filtered_filters_given_as_none_are_off(kernel, case):
    """sample_draft_filtered with filters passed as None: the tokens and q of their off values in every row."""
    rows, vocab = 9, 40
    args = make_draft_case(5 + len(case), rows, vocab)
    with_none = filters_as(args, NONE_CASES[case], True, first=2)
    with_off = filters_as(args, NONE_CASES[case], False, first=2)
    expected_probs = torch.empty(rows, vocab)
    expected = specdec_ops.sample_draft_filtered_reference(*with_off, probs=expected_probs)
    assert torch.equal(specdec_ops.sample_draft_filtered_reference(*with_none), expected)
    tokens, probs = check_draft_against_reference(kernel, tuple(with_none))
    assert torch.equal(tokens, expected)
    torch.testing.assert_close(probs, expected_probs, **DRAFT_PROBS_TOL)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_sample_draft_filtered_split_vocab():
    """sample_draft_filtered with V split into 4 chunks (blocks of 16): the chunks' Gumbel winners met in the row's
    atomic maximum, each chunk's probabilities; peaked and mixed rows, greedy ones included."""
    args = list(make_draft_case(73, 10, 120))
    gen = torch.Generator().manual_seed(5)
    args[0] = torch.where(torch.isinf(args[0]), args[0], peaked_logits(gen, args[0].shape))
    expected_probs = torch.empty(10, 120)
    expected = specdec_ops.sample_draft_filtered_reference(*args, probs=expected_probs)
    probs = torch.full((10, 120), -1.0)
    assert torch.equal(draft_triton(tuple(args), probs, block_v=16, num_chunks=4), expected)
    torch.testing.assert_close(probs, expected_probs, rtol=1e-5, atol=1e-7)
    assert torch.equal(draft_triton(tuple(args), block_v=16, num_chunks=4, gather_cap=64, fused_filter=True),
                       expected)


def scratch_is_zeroed():
    from specdec_ops.kernels import scratch
    return bool(scratch._scratch) and all(int(buf.count_nonzero()) == 0 for buf in scratch._scratch.values())


@pytest.mark.interpreter
def test_triton_split_vocab_in_reversed_program_order(monkeypatch):
    """On a GPU any program of a row may draw its last ticket; the interpreter runs them in grid order, so the last
    one is always the row's last chunk. Here every launch runs its programs in reverse (rows and chunks), so chunk 0
    finishes each row: the results must not depend on which chunk that is (no state of the finishing program's own
    chunk used after its ticket). Every path (sorted candidates, the cap's overflow into the full search, min-p
    alone, greedy rows, the fused filter, the draft race) must leave the persistent scratch zeroed."""
    from triton.runtime import interpreter
    builder = interpreter.interpreter_builder
    if not hasattr(builder, "set_grid_dim") or not hasattr(builder, "set_grid_idx"):
        pytest.skip("this Triton's interpreter has no set_grid_dim / set_grid_idx")
    in_grid_order = builder.set_grid_idx

    def reversed_order(x, y, z):
        nx, ny, nz = builder.grid_dim
        in_grid_order(nx - 1 - x, ny - 1 - y, nz - 1 - z)

    monkeypatch.setattr(builder, "set_grid_idx", reversed_order)
    gen = torch.Generator().manual_seed(95)
    args = list(make_case(96, 4, 3, 150, draft="probs"))
    args[0] = torch.where(torch.isinf(args[0]), args[0], peaked_logits(gen, args[0].shape))
    args[0][0] = torch.round(torch.randn(4, 150, generator=gen) * 4) / 2  # request 0 flat: the cap overflows
    args[4] = torch.tensor([0.9, 0.0, 0.7, 1.0])
    args[5] = torch.tensor([5, 3, 40, 0])
    args[6] = torch.tensor([0.9, 0.8, 1.0, 1.0])
    args[7] = torch.tensor([0.0, 0.0, 0.02, 0.1])
    args[2] = contract.processed_distribution(args[0][:, :3] + torch.randn(4, 3, 150, generator=gen) * 0.5, *args[4:8])
    check_against_reference(run_triton, tuple(args), False, block_v=16, num_chunks=5, gather_cap=64)
    assert scratch_is_zeroed()
    draft_args = list(make_draft_case(73, 10, 120))
    draft_args[0] = torch.where(torch.isinf(draft_args[0]), draft_args[0], peaked_logits(gen, draft_args[0].shape))
    expected_probs = torch.empty(10, 120)
    expected = specdec_ops.sample_draft_filtered_reference(*draft_args, probs=expected_probs)
    probs = torch.full((10, 120), -1.0)
    assert torch.equal(draft_triton(tuple(draft_args), probs, block_v=16, num_chunks=4, gather_cap=32,
                                    fused_filter=True), expected)
    torch.testing.assert_close(probs, expected_probs, rtol=1e-5, atol=1e-7)
    assert scratch_is_zeroed()


def test_sample_draft_with_filters_is_sample_draft_filtered():
    # sample_draft takes top_k / top_p / min_p too (the ones not given are off); without them it is the plain op,
    # which draws the same tokens as the filtered op with every filter off.
    gen = torch.Generator().manual_seed(4)
    n, vocab = 24, 300
    logits = 3 * torch.randn(n, vocab, generator=gen)
    temperature = torch.rand(n, generator=gen) + 0.3
    temperature[::5] = 0
    seeds = torch.randint(0, 2 ** 40, (n,), generator=gen)
    positions = torch.randint(0, 1000, (n,), generator=gen)
    top_k = torch.randint(0, 20, (n,), generator=gen)
    top_p = torch.rand(n, generator=gen) * 0.5 + 0.5
    off_k, off_p, off_min = torch.zeros(n, dtype=torch.int64), torch.ones(n), torch.zeros(n)
    for kwargs, filters in ((dict(top_k=top_k), (top_k, off_p, off_min)), (dict(top_p=top_p), (off_k, top_p, off_min)),
                            (dict(top_k=top_k, top_p=top_p, min_p=top_p / 4), (top_k, top_p, top_p / 4))):
        probs, want_probs = torch.empty(n, vocab), torch.empty(n, vocab)
        got = specdec_ops.sample_draft(logits, temperature, seeds, positions, probs, **kwargs)
        want = specdec_ops.sample_draft_filtered(logits, temperature, *filters, seeds, positions, want_probs)
        assert torch.equal(got, want) and torch.equal(probs, want_probs)
    plain = specdec_ops.sample_draft(logits, temperature, seeds, positions)
    assert torch.equal(plain, specdec_ops.sample_draft_filtered(logits, temperature, off_k, off_p, off_min, seeds,
                                                                positions))


def test_sample_draft_filtered_writes_a_strided_column():
    args = make_draft_case(71, 5, 33)
    buf = torch.full((5, 3, 33), 7.0)
    expected_probs = torch.empty(5, 33)
    expected = specdec_ops.sample_draft_filtered_reference(*args, probs=expected_probs)
    assert torch.equal(specdec_ops.sample_draft_filtered(*args, probs=buf[:, 1, :]), expected)
    torch.testing.assert_close(buf[:, 1], expected_probs)
    assert (buf[:, 0] == 7).all() and (buf[:, 2] == 7).all()


# --- validation ----------------------------------------------------------------------------------------------


def good_args():
    names = ["target_logits", "draft_token_ids", "draft_probs", "draft_logits", "temperature", "top_k", "top_p",
             "min_p", "seeds", "offsets"]
    return dict(zip(names, make_case(1, 2, 3, 10, draft="logits")))


BAD = [
    ("target_logits", lambda a: a["target_logits"].double(), "must have dtype"),
    ("target_logits", lambda a: a["target_logits"][0], "must be 3-D"),
    ("target_logits", lambda a: a["target_logits"][:, :1], "k\\+1 >= 2"),
    ("target_logits", lambda a: a["target_logits"].transpose(1, 2).contiguous().transpose(1, 2), "unit stride"),
    ("draft_token_ids", lambda a: a["draft_token_ids"].float(), "must have dtype"),
    ("draft_token_ids", lambda a: a["draft_token_ids"][:, :2], "size 2 in dimension 1"),
    ("draft_logits", lambda a: a["draft_logits"][..., :9], "size 9 in dimension 2"),
    ("draft_logits", lambda a: a["draft_logits"].long(), "must have dtype"),
    ("temperature", lambda a: a["temperature"].double(), "must have dtype float32"),
    ("temperature", lambda a: a["temperature"][:1], "size 1 in dimension 0"),
    ("top_k", lambda a: a["top_k"].float(), "must have dtype int32 or int64"),
    ("top_p", lambda a: a["top_p"][:, None], "must be 1-D"),
    ("min_p", lambda a: a["min_p"].half(), "must have dtype float32"),
    ("seeds", lambda a: a["seeds"].int(), "must have dtype int64"),
    ("offsets", lambda a: a["offsets"][:1], "size 1 in dimension 0"),
]


def call_op(args, counters=None):
    values = list(args.values())
    if counters is None:
        return torch.ops.specdec.rejection_sample_logits(*values, False)
    return torch.ops.specdec.rejection_sample_logits.counted(*values, True, counters)


@pytest.mark.parametrize("name,mutate,message", BAD)
def test_bad_inputs_raise_clear_errors(name, mutate, message):
    args = good_args()
    args[name] = mutate(args)
    pattern = f"rejection_sample_logits: argument '{name}'.*{message}"
    with pytest.raises(ValueError, match=pattern):  # eager, C++ kernel
        call_op(args)
    with pytest.raises(ValueError, match=pattern):  # fake kernel (trace time)
        with torch._subclasses.FakeTensorMode() as mode:
            call_op({n: None if t is None else mode.from_tensor(t) for n, t in args.items()})
    if HAS_TRITON:
        with pytest.raises(ValueError, match=pattern):  # the CUDA launcher validates too
            kernels._rejection_triton(*args.values())


def test_both_draft_distributions_is_an_error():
    args = good_args()
    args["draft_probs"] = torch.softmax(args["draft_logits"], -1)
    with pytest.raises(ValueError, match="at most one of 'draft_probs' and 'draft_logits'"):
        call_op(args)
    with pytest.raises(ValueError, match="at most one of 'draft_probs' and 'draft_logits'"):
        kernels._rejection_triton(*args.values())


def test_bad_counters_and_draft_inputs():
    with pytest.raises(ValueError, match="argument 'counters'.*dtype"):
        call_op(good_args(), torch.zeros(3, dtype=torch.int32))
    logits, *rest = make_draft_case(2, 4, 12)
    with pytest.raises(ValueError, match="sample_draft_filtered.with_probs: argument 'probs'.*size 5 in dimension 1"):
        specdec_ops.sample_draft_filtered(logits, *rest, probs=torch.empty(4, 5))
    with pytest.raises(ValueError, match="sample_draft_filtered: argument 'top_k'.*int32 or int64"):
        specdec_ops.sample_draft_filtered(logits, rest[0], rest[1].float(), *rest[2:])
    if HAS_TRITON:
        with pytest.raises(ValueError, match="sample_draft_filtered: argument 'positions'.*size 3"):
            kernels._draft_triton(logits, *rest[:-1], rest[-1][:3])


def test_check_sampling_params():
    ok = (torch.tensor([0.0, 1.0]), torch.tensor([0, 5]), torch.tensor([1.0, 0.5]), torch.tensor([0.0, 0.2]))
    specdec_ops.check_sampling_params(*ok, vocab=10)
    for index, bad, message in ((1, torch.tensor([-1, 0]), "top_k"), (1, torch.tensor([0, 11]), "top_k"),
                                (2, torch.tensor([0.0, 1.0]), "top_p"), (2, torch.tensor([1.5, 1.0]), "top_p"),
                                (3, torch.tensor([-0.1, 0.0]), "min_p"), (0, torch.tensor([math.nan, 1.0]),
                                                                          "temperature")):
        params = list(ok)
        params[index] = bad
        with pytest.raises(ValueError, match=message):
            specdec_ops.check_sampling_params(*params, vocab=10)


# --- opcheck and torch.compile -----------------------------------------------------------------------------------


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def on(device, args):
    return tuple(None if a is None else a.to(device) for a in args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("draft", ["logits", "probs", "none"])
@pytest.mark.parametrize("filters", ["given", "none"])
def test_opcheck_every_overload(device, draft, filters):
    """The C++ CPU kernel and, on CUDA, the Triton one, with the filters given and passed as None."""
    args = on(device, make_case(2, 3, 2, 16, draft=draft))
    if filters == "none":
        args = filters_as(args, NONE_CASES["all"], True)
    counters = torch.zeros(3, dtype=torch.int64, device=device)
    op = torch.ops.specdec.rejection_sample_logits
    torch.library.opcheck(op.default, (*args, False))
    torch.library.opcheck(op.counted, (*args, True, counters))
    torch.library.opcheck(op.logprobs, (*args, True))
    torch.library.opcheck(op.logprobs_counted, (*args, False, counters.clone()))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_sample_draft_filtered(device):
    args = on(device, make_draft_case(3, 4, 16))
    op = torch.ops.specdec.sample_draft_filtered
    for given in (args, (*args[:2], None, None, None, *args[5:])):
        torch.library.opcheck(op.default, given)
        torch.library.opcheck(op.with_probs, (*given, torch.empty(4, 16, device=device)))
        buf = torch.zeros(4, 3, 16, device=device)
        torch.library.opcheck(op.with_probs, (*given, buf[:, 1, :]))


def draft_then_verify(draft_logits, target_logits, temperature, top_k, top_p, min_p, seeds, positions, counters,
                      block):
    """Draft k tokens with the filters (each step writes its q column), then verify them from the target logits."""
    batch, k, vocab = draft_logits.shape
    q = torch.empty(batch, k, vocab, device=draft_logits.device)
    tokens = [specdec_ops.sample_draft_filtered(draft_logits[:, step], temperature, top_k, top_p, min_p, seeds,
                                                positions + step, probs=q[:, step, :]) for step in range(k)]
    draft = torch.stack(tokens, dim=1)
    out, logprobs = specdec_ops.rejection_sample_logits(
        target_logits, draft, temperature, top_k, top_p, min_p, seeds, positions, draft_probs=q,
        block_verification=block, counters=counters, return_logprobs=True)
    return out, logprobs, q


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("filters", ["given", "none"])
def test_compile_fullgraph_equals_eager(device, filters):
    args = on(device, make_case(9, 5, 3, 30))
    if filters == "none":
        args = filters_as(args, NONE_CASES["all"], True)
    target, _, _, draft_logits, temperature, top_k, top_p, min_p, seeds, offsets = args
    draft_logits = draft_logits.contiguous()
    torch._dynamo.reset()  # a fresh trace per parametrization
    for block in (False, True):
        eager_counters = torch.zeros(3, dtype=torch.int64, device=device)
        compiled_counters = torch.zeros(3, dtype=torch.int64, device=device)
        eager = draft_then_verify(draft_logits, target, temperature, top_k, top_p, min_p, seeds, offsets,
                                  eager_counters, block)
        compiled = torch.compile(draft_then_verify, fullgraph=True)(
            draft_logits, target, temperature, top_k, top_p, min_p, seeds, offsets, compiled_counters, block)
        assert torch.equal(compiled[0], eager[0])
        torch.testing.assert_close(compiled[1], eager[1])
        assert torch.equal(compiled[2], eager[2])
        assert torch.equal(compiled_counters, eager_counters) and int(eager_counters[2]) == 15


# --- CUDA --------------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("draft", ["logits", "probs", "none"])
@pytest.mark.parametrize("batch,vocab", [(1, 32000), (7, 129), (16, 128256)])
def test_cuda_matches_reference(draft, batch, vocab):
    for block in (False, True):
        # Logits on a coarse grid: cumulative masses step in large tied blocks, so float32 sums on the GPU and
        # float64 ones in the reference do not straddle a top-p boundary (see the contract's "Float rounding").
        args = make_case(batch + vocab, batch, 4, vocab, draft=draft)
        check_against_reference(run_triton, args, block)


@pytest.mark.cuda
def test_cuda_sample_draft_filtered_matches_reference():
    for dtype in (torch.float32, torch.bfloat16):
        args = make_draft_case(8, 16, 32000, dtype=dtype)
        expected_probs = torch.empty(16, 32000)
        expected = specdec_ops.sample_draft_filtered_reference(*args, probs=expected_probs)
        probs = torch.empty(16, 32000, device="cuda")
        got = specdec_ops.sample_draft_filtered(*(a.cuda() for a in args), probs=probs)
        assert torch.equal(got.cpu(), expected)
        torch.testing.assert_close(probs.cpu(), expected_probs, rtol=1e-4, atol=1e-6)


@pytest.mark.cuda
def test_cuda_graph_replay_with_new_seeds_and_parameters():
    """One capture of draft + verify (both modes); replays with new seeds, offsets and sampling parameters equal the
    reference, and nothing in a replay or an eager call syncs."""
    batch, k, vocab = 16, 4, 32000
    target, _, _, draft_logits, temperature, top_k, top_p, min_p, seeds, offsets = [
        None if a is None else a.cuda() for a in make_case(3, batch, k, vocab)]
    draft_logits = draft_logits.contiguous()
    counters = torch.zeros(3, dtype=torch.int64, device="cuda")

    def step():
        return [draft_then_verify(draft_logits, target, temperature, top_k, top_p, min_p, seeds, offsets, counters,
                                  block) for block in (False, True)]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        results = step()
    gen = torch.Generator().manual_seed(5)
    for replay in range(3):
        new = make_params(batch, "mixed", vocab, gen)
        for buf, value in zip((temperature, top_k, top_p, min_p), new):
            buf.copy_(value)
        seeds.copy_(torch.arange(batch, device="cuda") * 31 + replay)
        offsets.add_(k + 1)
        counters.zero_()
        with sync_forbidden():
            graph.replay()
        torch.cuda.synchronize()
        expected_counters = torch.zeros(3, dtype=torch.int64)
        for block, (out, logprobs, q) in zip((False, True), results):
            draft_ids = torch.stack([specdec_ops.sample_draft_filtered_reference(
                draft_logits[:, s].cpu(), temperature.cpu(), top_k.cpu(), top_p.cpu(), min_p.cpu(), seeds.cpu(),
                offsets.cpu() + s) for s in range(k)], dim=1)
            expected, expected_lp = specdec_ops.rejection_sample_logits_reference(
                target.cpu(), draft_ids, temperature.cpu(), top_k.cpu(), top_p.cpu(), min_p.cpu(), seeds.cpu(),
                offsets.cpu(), draft_probs=q.cpu(), block_verification=block, counters=expected_counters,
                return_logprobs=True)
            assert torch.equal(out.cpu(), expected)
            torch.testing.assert_close(logprobs.cpu(), expected_lp, rtol=1e-4, atol=1e-4)
        assert torch.equal(counters.cpu(), expected_counters)
    with sync_forbidden():  # the eager launchers never sync either
        step()


def test_mutating_overloads_bump_versions():
    """counters and probs are Tensor(a!): their version counters move, as for aten's in-place ops (csrc/ops.cpp)."""
    args = make_case(5, 3, 2, 11)
    op = torch.ops.specdec.rejection_sample_logits
    for overload in (op.counted, op.logprobs_counted):
        stats = torch.zeros(3, dtype=torch.int64)
        before = stats._version
        overload(*args, False, stats)
        assert stats._version == before + 1 and int(stats[2]) == 6
    draft_args = make_draft_case(5, 3, 11)
    probs = torch.zeros(3, 11)
    before = probs._version
    torch.ops.specdec.sample_draft_filtered.with_probs(*draft_args, probs)
    assert probs._version == before + 1


def test_device_mismatch_is_a_clear_error():
    """Every tensor must be on target_logits' device (a meta tensor stands in for another device here)."""
    for name in ("draft_token_ids", "draft_logits", "temperature", "top_k", "seeds"):
        args = good_args()
        args[name] = args[name].to("meta")
        with pytest.raises(ValueError, match=f"argument '{name}' is on meta, expected cpu"):
            contract.check_rejection_inputs(*args.values())
    logits, *rest = make_draft_case(2, 4, 12)
    with pytest.raises(ValueError, match="argument 'min_p' is on meta"):
        contract.check_draft_inputs(logits, rest[0], rest[1], rest[2], rest[3].to("meta"), *rest[4:])


def test_phase_profiler_patches_still_match():
    """scripts/profile_logits_phases.py instruments a copy of the kernels by text replacements, each of which must
    match logits_sampling.py exactly once: a kernel change that moves a patched line fails here, not on the next
    device call."""
    import importlib.util
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("profile_logits_phases", root / "scripts" / "profile_logits_phases.py")
    profiler = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profiler)
    source = (root / "specdec_ops" / "kernels" / "logits_sampling.py").read_text()
    instrumented = profiler.instrument(source)
    assert instrumented.count("stats_timer_ptr") > 1 and instrumented.count("timer_ptr=FILTER_TIMER") == 1


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernels_compile_for_sm90():
    """Every kernel variant goes through Triton's real compiler to a cubin for an H100/H200 target, on any machine:
    the interpreter runs the CPU tests but skips the compiler's type checks (scripts/compile_logits_sampling.py)."""
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, str(root / "scripts" / "compile_logits_sampling.py")], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(": ok (") == 38, result.stdout
    # Both forms of the filter pass's gather (the default geometry compiles one), and its gather from sub-block
    # maxima, compile and disassemble.
    result = subprocess.run([sys.executable, str(root / "scripts" / "compile_logits_sampling.py"), "--gather-loop"],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    for gather_run in (8, 1):
        assert f"gather_run={gather_run}: " in result.stdout and "SASS instructions" in result.stdout, result.stdout
    assert "sub_block=32: listing " in result.stdout, result.stdout
    # The row passes compile under register limits of 80 and 64 (the script's), and the compiler holds to them.
    result = subprocess.run([sys.executable, str(root / "scripts" / "compile_logits_sampling.py"), "--registers"],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    registers = [int(line.split()[0]) for line in result.stdout.splitlines() if "registers per thread" in line]
    assert len(registers) == 9, result.stdout
    assert max(registers[1::3]) <= 80 and max(registers[2::3]) <= 64, result.stdout


"""specdec::rejection_sample and specdec::sample_draft: kernels vs reference, streams, validation, compile.

The distribution tests (chi-square) are in test_sampling_stats.py.
"""
import pytest
import torch

import specdec_ops
from specdec_ops._triton import HAS_TRITON
from specdec_ops.ops import counter_hash, sampling

if HAS_TRITON:
    from specdec_ops.kernels import geometry, scratch
    from specdec_ops.kernels import sampling as sampling_kernels

from conftest import HAS_CUDA, sync_forbidden
from harness import Backend, capture_graph, check_bad_input
from samples import make_case, make_logits, normalized


def run(backend, args, counters=None, num_chunks=None, block_v=None):
    """rejection_sample on the backend; on the Triton backend a forced split (num_chunks, block_v) runs the
    launcher itself (the C++ kernel has no split)."""
    if backend.name == "cpp" or (num_chunks is None and block_v is None):
        return backend.rejection_sample(*args, counters=counters)
    device = "cuda" if HAS_CUDA else "cpu"
    on_device = [None if a is None else a.to(device) for a in args]
    device_counters = None if counters is None else counters.to(device)
    sampling.check_rejection_inputs(*on_device, device_counters)
    out = sampling_kernels.launch_rejection(*on_device, device_counters, num_chunks=num_chunks, block_v=block_v)
    if counters is not None:
        counters.copy_(device_counters.cpu())
    return out.cpu()


TRITON = Backend("triton")


def check_against_reference(backend, args, **kwargs):
    expected_counters = torch.tensor([5, 6, 7])
    expected = specdec_ops.rejection_sample_reference(*args, counters=expected_counters)
    counters = torch.tensor([5, 6, 7])
    got = run(backend, args, counters=counters, **kwargs)
    assert got.dtype == args[1].dtype
    assert torch.equal(got, expected)
    assert torch.equal(counters, expected_counters)
    assert torch.equal(run(backend, args, **kwargs), expected)  # the plain overload agrees
    return expected


# --- rejection_sample: exact agreement ----------------------------------------------------------


@pytest.mark.parametrize("has_q,has_bonus", [(True, False), (False, False), (True, True), (False, True)])
@pytest.mark.parametrize("batch,k,vocab", [(6, 3, 37), (5, 1, 2), (3, 5, 1500)])
def test_rejection_matches_reference(backend, has_q, has_bonus, batch, k, vocab):
    args = make_case(batch * 1000 + k * 10 + vocab, batch, k, vocab, has_q=has_q, has_bonus=has_bonus)
    out = check_against_reference(backend, args)
    emitted = out[:, :k] if has_bonus else out  # caller-given bonus ids are copied, not sampled
    assert ((emitted >= -1) & (emitted < vocab)).all()


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("num_chunks", [2, 3])
@pytest.mark.parametrize("has_q", [True, False])
def test_triton_split_vocab_matches_reference(num_chunks, has_q):
    """Several programs per row (atomic max + ticket) give the single-program answer."""
    args = make_case(7 + num_chunks, 4, 3, 2500, has_q=has_q)
    check_against_reference(TRITON, args, num_chunks=num_chunks)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_split_leaves_the_scratch_zeroed():
    """The last program of a row resets its max slot and ticket: the next call starts clean without a memset."""
    device = "cuda" if HAS_CUDA else "cpu"
    for seed in range(3):
        args = make_case(40 + seed, 5, 2, 700, has_q=seed != 1)
        expected = specdec_ops.rejection_sample_reference(*args)
        on_device = [None if a is None else a.to(device) for a in args]
        got = sampling_kernels.launch_rejection(*on_device, None, num_chunks=3, block_v=256)
        assert torch.equal(got.cpu(), expected)
        assert int(scratch._scratch[got.device].count_nonzero()) == 0


@pytest.mark.cuda
def test_cuda_scratch_allocated_in_a_graph_pool_is_not_kept(monkeypatch):
    """Scratch first allocated inside a private memory pool (as during cudagraph warmup) serves that call only."""
    if not hasattr(torch.cuda, "MemPool"):
        pytest.skip("torch.cuda.MemPool is missing")
    monkeypatch.setattr(scratch, "_scratch", {})
    device = torch.device("cuda", torch.cuda.current_device())
    with torch.cuda.use_mem_pool(torch.cuda.MemPool()):
        in_pool = scratch.zeroed_scratch(device, 10)
    assert device not in scratch._scratch and int(in_pool.count_nonzero()) == 0
    kept = scratch.zeroed_scratch(device, 10)
    assert scratch._scratch[device] is kept


def test_all_outcomes_occur():
    """The agreement tests above see rejections at every column, all-accepted rows and the bonus."""
    args = make_case(11, 64, 3, 37)
    out = specdec_ops.rejection_sample(*args)
    first_minus_one = torch.where((out == -1).any(1), (out == -1).int().argmax(1), 4)
    assert set(first_minus_one.tolist()) == {1, 2, 3, 4}


@pytest.mark.parametrize("token_dtype,prob_dtype", [(torch.int32, torch.float32), (torch.int64, torch.float16),
                                                    (torch.int32, torch.bfloat16)])
def test_rejection_dtypes(backend, token_dtype, prob_dtype):
    if prob_dtype == torch.bfloat16 and backend.name == "triton" and not HAS_CUDA:
        pytest.skip("no bfloat16 in the Triton interpreter")
    args = make_case(3, 5, 2, 40, has_bonus=True, token_dtype=token_dtype, prob_dtype=prob_dtype)
    check_against_reference(backend, args)


def test_rejection_strided_and_expanded_inputs(backend):
    """Batch stride 0 (one distribution broadcast over rows) and non-contiguous rows."""
    base = make_case(5, 1, 3, 30)
    batch = 9
    p = base[0].expand(batch, -1, -1)
    q = base[2].expand(batch, -1, -1)
    draft = torch.randint(0, 30, (batch, 6), generator=torch.Generator().manual_seed(1))[:, ::2]
    seeds = torch.arange(batch, dtype=torch.int64) * 3 + 1
    offsets = torch.arange(2 * batch, dtype=torch.int64)[::2]
    assert p.stride(0) == 0 and draft.stride(1) == 2
    if backend.name == "cpp" or not HAS_CUDA:  # .cuda() would make the strided ids contiguous
        with pytest.raises(ValueError, match="draft_token_ids"):
            run(backend, (p, draft, q, seeds, offsets, None))  # non-unit last stride is refused
    args = (p, draft.contiguous(), q, seeds, offsets, None)
    check_against_reference(backend, args)


@pytest.mark.cuda
def test_cuda_position_offsets_past_int32():
    """A dim-1 stride of 2**30 elements: position i's offset i * stride passes 2**31 and must not wrap."""
    k, vocab, stride = 3, 16, 2**30
    p, draft, q, seeds, offsets, _ = make_case(11, 1, k, vocab, invalid_ids=False, prob_dtype=torch.float16)

    def spread(t):  # same values, rows 2**30 elements apart (about 2 GiB of float16 per row)
        rows = t.shape[1]
        storage = torch.zeros((rows - 1) * stride + vocab, dtype=t.dtype, device="cuda")
        view = storage.as_strided(t.shape, (storage.numel(), stride, 1))
        view.copy_(t)
        return view

    cuda = [spread(p), draft.cuda(), spread(q), seeds.cuda()]
    assert cuda[0].stride(1) * k >= 2**31 and cuda[2].stride(1) * (k - 1) >= 2**31
    for shift in range(8):  # fresh draws: accept tests at every position, races at several
        expected = specdec_ops.rejection_sample_reference(p, draft, q, seeds, offsets + shift)
        assert torch.equal(specdec_ops.rejection_sample(*cuda, (offsets + shift).cuda()).cpu(), expected), shift
    del cuda
    torch.cuda.empty_cache()


def test_counted_adds_what_create_output_counted_adds():
    """counters == create_output.counted given the accept decisions at ALL k positions."""
    for has_q in (True, False):
        p, draft, q, seeds, offsets, _ = make_case(21, 40, 4, 25, has_q=has_q)
        counters = torch.tensor([1, 2, 3])
        out = specdec_ops.rejection_sample(p, draft, q, seeds, offsets, counters=counters)
        # Accept decisions from the public stream helpers, independently of the kernels.
        k = draft.shape[1]
        valid = (draft >= 0) & (draft < 25)
        safe = torch.where(valid, draft, 0)
        p_x = p[:, :k].gather(2, safe[..., None])[..., 0]
        q_x = q.gather(2, safe[..., None])[..., 0] if has_q else torch.ones_like(p_x)
        bits = counter_hash.random_bits(seeds[:, None], offsets[:, None] + torch.arange(k), counter_hash.ACCEPT, 0)
        accepted = valid & (counter_hash.uniform_from_bits(bits) * q_x < p_x)
        assert (accepted.int().diff(dim=1) > 0).any()  # an accept after a rejection is counted too
        expected_counters = torch.tensor([1, 2, 3])
        expected = specdec_ops.create_output(accepted, out[:, :k], draft, out[:, k], counters=expected_counters)
        assert torch.equal(out, expected)
        assert torch.equal(counters, expected_counters)


def test_out_of_range_draft_ids_are_rejected(backend):
    vocab = 8
    p = normalized(torch.ones(3, 3, vocab))
    draft = torch.tensor([[-1, 0], [vocab, 0], [2**40, 0]])
    args = (p, draft, None, torch.arange(3), torch.zeros(3, dtype=torch.int64), None)
    out = run(backend, args)
    assert (out[:, 0] >= 0).all() and (out[:, 0] < vocab).all()
    assert (out[:, 1:] == -1).all()
    check_against_reference(backend, args)


@pytest.mark.parametrize("num_chunks,block_v", [(None, None), (1, None), (3, 64)])
@pytest.mark.parametrize("has_q,has_bonus", [(True, False), (False, True)])
def test_non_finite_probabilities_give_tokens_in_range(backend, num_chunks, block_v, has_q, has_bonus):
    """Rows of NaN, inf, negative or zero probabilities have unspecified tokens, but never ones outside [0, V);
    the finite rows of the same batch, and every row's accept decisions, stay exactly as in the reference."""
    vocab, num_bad = 700, 7
    p, draft, q, seeds, offsets, bonus = make_case(3, num_bad + 3, 3, vocab, invalid_ids=False, has_bonus=has_bonus)
    nan, inf = float("nan"), float("inf")
    p[0] = nan
    q[1] = nan
    p[2, :, ::7] = inf
    p[3] = -1.0
    q[4] = inf
    p[5] = 0.0
    p[6, :, 1::2] = nan
    args = (p, draft, q if has_q else None, seeds, offsets, bonus)
    out = run(backend, args, num_chunks=num_chunks, block_v=block_v)
    expected = specdec_ops.rejection_sample_reference(*args)
    assert torch.equal(out[num_bad:], expected[num_bad:])
    assert torch.equal(out == -1, expected == -1)  # where each row stops is specified for every row
    for row in out:
        emitted = int((row != -1).sum())
        assert emitted >= 1 and (row[emitted:] == -1).all(), row
        assert ((row[:emitted] >= 0) & (row[:emitted] < vocab)).all(), row
    assert all(int(buf.count_nonzero()) == 0 for buf in scratch._scratch.values())


@pytest.mark.parametrize("num_chunks,block_v", [(None, None), (1, 16), (3, 16)])
def test_an_infinite_exponential_never_wins(backend, num_chunks, block_v):
    """w rounding to 1 gives E = +inf and a key of 0: a later segment of the same lane with any positive residual
    beats it, as in the reference. Seed 366847 at position 0 draws E = inf for segment 39 of the residual race
    (draw 78); `later` is in the same lane for blocks of 16 entries and, in one chunk, for the default block."""
    seed, segment = 366847, 39
    later = segment + geometry.REJECTION_SAMPLE["block_v"] // sampling.SEGMENT
    vocab = (later + 2) * sampling.SEGMENT
    exponential = counter_hash.exponential_from_bits(
        counter_hash.random_bits(torch.tensor(seed), torch.tensor(0), counter_hash.RESIDUAL, torch.tensor(2 * segment)))
    assert exponential == float("inf")
    p = torch.zeros(1, 2, vocab)
    p[0, 0, segment * sampling.SEGMENT + 1] = 0.9
    p[0, 0, later * sampling.SEGMENT + 2] = 1e-6
    p[0, 1] = 1.0 / vocab
    draft = torch.tensor([[0]])  # p(0) = 0: rejected at position 0, so position 0's residual is raced
    args = (p, draft, None, torch.tensor([seed]), torch.tensor([0]), None)
    out = run(backend, args, num_chunks=num_chunks, block_v=block_v)
    assert out.tolist() == [[later * sampling.SEGMENT + 2, -1]]
    assert torch.equal(out, specdec_ops.rejection_sample_reference(*args))


def test_known_cases(backend):
    vocab = 5
    # p == one-hot(draft) -> always accepted; bonus given.
    p = torch.zeros(2, 3, vocab)
    p[:, 0, 1] = 1
    p[:, 1, 3] = 1
    p[:, 2, 4] = 1
    draft = torch.tensor([[1, 3], [1, 2]])
    bonus = torch.tensor([7, 8])
    out = run(backend, (p, draft, None, torch.tensor([1, 2]), torch.tensor([0, 0]), bonus))
    # Row 1: token 2 has p = 0 -> rejected, the residual is p itself (one-hot at 3).
    assert out.tolist() == [[1, 3, 7], [1, 3, -1]]
    # No bonus ids: the bonus is drawn from p_k (one-hot at 4).
    out = run(backend, (p, draft, None, torch.tensor([1, 2]), torch.tensor([0, 0]), None))
    assert out.tolist() == [[1, 3, 4], [1, 3, -1]]
    # q == p everywhere but the draft token has q(x) = 0: rejected, residual is all zero -> falls back to p.
    q = p[:, :2].clone()
    draft = torch.tensor([[0, 3], [2, 3]])
    out = run(backend, (p, draft, q, torch.tensor([1, 2]), torch.tensor([0, 0]), None))
    assert out.tolist() == [[1, -1, -1], [1, -1, -1]]


def test_batch_invariance(backend):
    """A request's tokens do not depend on the other rows, their number or their position in the batch."""
    small = make_case(31, 3, 3, 300, has_q=True)
    others = make_case(32, 6, 3, 300, has_q=True)
    alone = run(backend, small)
    merged = tuple(None if a is None else torch.cat([o[:3], a, o[3:]]) for a, o in zip(small, others))
    together = run(backend, merged)
    assert torch.equal(together[3:6], alone)
    for row in range(3):
        one = tuple(None if a is None else a[row:row + 1] for a in small)
        assert torch.equal(run(backend, one), alone[row:row + 1])


def test_fresh_randomness_with_new_offsets_or_seeds():
    """Same seed and offset reproduce; a new offset or seed gives new draws."""
    vocab = 50
    p = normalized(torch.ones(1, 2, vocab)).expand(400, -1, -1)
    draft = torch.zeros(400, 1, dtype=torch.int64)  # p(x) = 1/50: nearly always rejected
    seeds = torch.full((400,), 1234)
    offsets = torch.arange(400)
    a = specdec_ops.rejection_sample(p, draft, None, seeds, offsets)
    assert torch.equal(a, specdec_ops.rejection_sample(p, draft, None, seeds, offsets))
    assert len(set(a[:, 0].tolist())) > 30  # each offset draws anew
    b = specdec_ops.rejection_sample(p, draft, None, seeds + 1, offsets)
    assert (a[:, 0] != b[:, 0]).float().mean() > 0.8


# --- random streams ------------------------------------------------------------------------------


@pytest.mark.slow
def test_streams_are_independent():
    """Same seed and position: the DRAFT, ACCEPT, RESIDUAL, BONUS streams give unrelated uniforms."""
    seeds = torch.arange(20000, dtype=torch.int64) * 7919 - 10**12
    positions = torch.arange(20000, dtype=torch.int64) % 97
    uniforms = {
        purpose: counter_hash.uniform_from_bits(counter_hash.random_bits(seeds, positions, purpose, 0)).double()
        for purpose in (counter_hash.DRAFT, counter_hash.ACCEPT, counter_hash.RESIDUAL, counter_hash.BONUS)
    }
    names = list(uniforms)
    for a in range(len(names)):
        u = uniforms[names[a]]
        assert abs(u.mean() - 0.5) < 0.01 and abs(u.var() - 1 / 12) < 0.005
        for b in range(a + 1, len(names)):
            v = uniforms[names[b]]
            assert (u != v).float().mean() > 0.999
            assert abs(torch.corrcoef(torch.stack([u, v]))[0, 1]) < 0.03  # ~4 standard errors
    # Consecutive indices of one row (the race) are uncorrelated as well.
    row = counter_hash.uniform_from_bits(counter_hash.random_bits(5, 9, counter_hash.RESIDUAL, torch.arange(20001))).double()
    assert abs(torch.corrcoef(torch.stack([row[:-1], row[1:]]))[0, 1]) < 0.03


def test_torch_hash_matches_plain_python_murmur3():
    """The int64 tensor arithmetic (16-bit split multiplies) equals MurmurHash3_x86_32 on Python ints."""

    def murmur3(words):
        mask = 0xFFFFFFFF
        h = 0
        for w in words:
            w = (w * 0xCC9E2D51) & mask
            w = ((w << 15) | (w >> 17)) & mask
            w = (w * 0x1B873593) & mask
            h ^= w
            h = ((h << 13) | (h >> 19)) & mask
            h = (h * 5 + 0xE6546B64) & mask
        h ^= 4 * len(words)
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & mask
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & mask
        return h ^ (h >> 16)

    for seed, pos, purpose, index in [(0, 0, 1, 0), (-1, 2**40 + 3, 2, 7), (2**62 + 5, -9, 4, 2**31 + 1)]:
        words = [seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, pos & 0xFFFFFFFF, (pos >> 32) & 0xFFFFFFFF,
                 purpose, index]
        assert int(counter_hash.random_bits(seed, pos, purpose, index)) == murmur3(words)


@pytest.mark.slow
def test_exponentials():
    bits = torch.tensor([0, 1, 2**20, 2**25 - 1, 2**31, 2**32 - 1], dtype=torch.int64)
    e = counter_hash.exponential_from_bits(bits).double()
    w = (bits.double() + 0.5) / 2**32
    assert torch.allclose(e[:-1], -torch.log1p(-w[:-1]), rtol=1e-6)
    assert e[-1] == float("inf")  # w rounds to 1: never wins a race
    many = counter_hash.exponential_from_bits(counter_hash.random_bits(3, 4, counter_hash.BONUS, torch.arange(200000))).double()
    assert abs(many.mean() - 1) < 0.01 and abs(many.var() - 1) < 0.03


# --- sample_draft --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("rows,vocab", [(8, 33), (5, 1500), (3, 1)])
def test_sample_draft_matches_reference(backend, dtype, rows, vocab):
    if dtype == torch.bfloat16 and backend.name == "triton" and not HAS_CUDA:
        pytest.skip("no bfloat16 in the Triton interpreter")
    args = make_logits(rows * 100 + vocab, rows, vocab, dtype)
    expected_probs = torch.full((rows, vocab), -1.0)
    expected = specdec_ops.sample_draft_reference(*args, probs=expected_probs)
    assert torch.equal(backend.sample_draft(*args), expected)
    probs = torch.full((rows, vocab), -1.0)
    assert torch.equal(backend.sample_draft(*args, probs=probs), expected)
    torch.testing.assert_close(probs, expected_probs, rtol=1e-5, atol=1e-6)
    greedy = args[1] <= 0
    assert torch.equal(expected[greedy], args[0].float()[greedy].argmax(-1))
    one_hot = torch.nn.functional.one_hot(expected[greedy], vocab).float()
    assert torch.equal(probs[greedy], one_hot)
    torch.testing.assert_close(probs[~greedy], torch.softmax(args[0].float()[~greedy] / args[1][~greedy, None], -1))


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_sample_draft_online_softmax_across_blocks():
    """Rows spanning many blocks: a running max that grows, -inf before and after finite logits, NaN."""
    vocab = 100
    inf, nan = float("inf"), float("nan")
    ramp = torch.linspace(-30.0, 30.0, vocab)
    rows = [ramp, ramp.flip(0), torch.randn(vocab) * 20]
    late = torch.full((vocab,), -inf)
    late[70:] = torch.randn(30)  # lanes start at -inf, then turn finite
    early = torch.full((vocab,), -inf)
    early[:20] = torch.randn(20)  # finite, then a tail of -inf
    rows += [late, early]
    with_nan = torch.randn(vocab)
    with_nan[3] = nan  # in the first block, while every lane's max is still -inf
    rows.append(with_nan)
    logits = torch.stack(rows)
    n = logits.shape[0]
    temperature = torch.tensor([0.7, 1.0, 2.0, 0.5, 1.3, 1.0])
    seeds, positions = torch.arange(n) * 11, torch.arange(n) + 100
    device = "cuda" if HAS_CUDA else "cpu"
    probs = torch.empty(n, vocab, device=device)
    args = [t.to(device) for t in (logits, temperature, seeds, positions)]
    tokens = sampling_kernels.launch_draft(*args, probs, block_v=16).cpu()
    expected_probs = torch.empty(n, vocab)
    expected = specdec_ops.sample_draft_reference(logits, temperature, seeds, positions, probs=expected_probs)
    assert torch.equal(tokens[:-1], expected[:-1])  # the NaN row's token is unspecified (but in range)
    assert 0 <= int(tokens[-1]) < vocab
    torch.testing.assert_close(probs.cpu(), expected_probs, rtol=1e-5, atol=1e-7, equal_nan=True)
    assert probs[-1].isnan().all()


def test_sample_draft_greedy_ties_take_lowest_index(backend):
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [float("-inf")] * 4, [2.0, 2.0, 2.0, 2.0]])
    args = (logits, torch.zeros(3), torch.arange(3), torch.arange(3))
    assert backend.sample_draft(*args).tolist() == [1, 0, 0]
    # A random row never picks a -inf logit.
    masked = torch.tensor([[float("-inf"), 0.0, float("-inf"), 0.0]]).expand(24, -1)
    out = backend.sample_draft(masked, torch.ones(24), torch.arange(24), torch.zeros(24, dtype=torch.int64))
    assert set(out.tolist()) == {1, 3}


def test_sample_draft_nan_or_negative_temperature_is_greedy(backend):
    logits, _, seeds, positions = make_logits(7, 4, 50)
    temperature = torch.tensor([float("nan"), -1.0, float("nan"), -0.5])
    assert torch.equal(backend.sample_draft(logits, temperature, seeds, positions), logits.argmax(-1))


def test_sample_draft_nan_logit_counts_as_the_largest(backend):
    # As torch.argmax: the first NaN's index, for greedy and random rows, with or without probs; one NaN
    # lane past the first block of the row too.
    logits = torch.tensor([[0.0, float("nan"), 5.0, 1.0], [float("nan"), 2.0, float("nan"), 9.0],
                           [3.0, 1.0, 2.0, float("nan")], [0.0, float("nan"), 5.0, 1.0]])
    wide = torch.randn(2, 3000)
    wide[0, 2049], wide[0, 2900], wide[1, 7] = float("nan"), float("nan"), float("nan")
    for rows in (logits, wide):
        n = rows.shape[0]
        for temperature in (torch.zeros(n), torch.full((n,), 0.7)):
            args = (rows, temperature, torch.arange(n), torch.arange(n))
            expected = specdec_ops.sample_draft_reference(*args)
            assert torch.equal(expected, rows.argmax(-1))
            assert torch.equal(backend.sample_draft(*args), expected)
            assert torch.equal(backend.sample_draft(*args, probs=torch.empty(rows.shape)), expected)


def test_sample_draft_writes_a_strided_column(backend):
    """probs may be buf[:, step, :] of an [n, k, V] buffer; other steps are left alone."""
    rows, k, vocab = 6, 3, 40
    args = make_logits(2, rows, vocab)
    buf = torch.full((rows, k, vocab), 7.0)
    expected_probs = torch.empty(rows, vocab)
    expected = specdec_ops.sample_draft_reference(*args, probs=expected_probs)
    assert torch.equal(backend.sample_draft(*args, probs=buf[:, 1, :]), expected)
    torch.testing.assert_close(buf[:, 1], expected_probs)
    assert (buf[:, 0] == 7).all() and (buf[:, 2] == 7).all()


def test_sample_draft_batch_invariance_and_fresh_positions():
    args = make_logits(4, 8, 100)
    alone = specdec_ops.sample_draft(*args)
    for row in range(8):
        assert specdec_ops.sample_draft(*(a[row:row + 1] for a in args)).item() == alone[row].item()
    logits = torch.zeros(1, 100).expand(500, -1)  # uniform
    ones, seeds = torch.ones(500), torch.full((500,), 77)
    tokens = specdec_ops.sample_draft(logits, ones, seeds, torch.arange(500))
    assert len(set(tokens.tolist())) > 80
    moved = specdec_ops.sample_draft(logits, ones, seeds, torch.arange(500) + 1)
    assert torch.equal(moved[:-1], tokens[1:])  # a draw is a function of (seed, position) only


# --- validation ------------------------------------------------------------------------------


def good_rejection_args():
    p, draft, q, seeds, offsets, bonus = make_case(1, 2, 3, 10, has_bonus=True)
    return dict(target_probs=p, draft_token_ids=draft, draft_probs=q, seeds=seeds, offsets=offsets,
                bonus_token_ids=bonus)


REJECTION_BAD = [
    ("target_probs", lambda a: a["target_probs"].double(), "must have dtype"),
    ("target_probs", lambda a: a["target_probs"][0], "must be 3-D"),
    ("target_probs", lambda a: a["target_probs"][:, :1], "k\\+1 >= 2"),
    ("target_probs", lambda a: a["target_probs"].transpose(1, 2).contiguous().transpose(1, 2), "unit stride"),
    ("draft_token_ids", lambda a: a["draft_token_ids"].float(), "must have dtype"),
    ("draft_token_ids", lambda a: a["draft_token_ids"][:, :2], "size 2 in dimension 1"),
    ("draft_token_ids", lambda a: a["draft_token_ids"][:1], "size 1 in dimension 0"),
    ("draft_probs", lambda a: a["draft_probs"][..., :9], "size 9 in dimension 2"),
    ("draft_probs", lambda a: a["draft_probs"][:, :2], "size 2 in dimension 1"),
    ("draft_probs", lambda a: a["draft_probs"].to(torch.int64), "must have dtype"),
    ("seeds", lambda a: a["seeds"].int(), "must have dtype int64"),
    ("seeds", lambda a: a["seeds"][:1], "size 1 in dimension 0"),
    ("offsets", lambda a: a["offsets"][:, None], "must be 1-D"),
    ("bonus_token_ids", lambda a: a["bonus_token_ids"].expand(2, 2), "shape \\[B, 1\\] or \\[B\\]"),
    ("bonus_token_ids", lambda a: a["bonus_token_ids"].float(), "must have dtype"),
]


@pytest.mark.parametrize("name,mutate,message", REJECTION_BAD)
def test_rejection_bad_inputs_raise_clear_errors(name, mutate, message):
    args = good_rejection_args()
    args[name] = mutate(args)
    check_bad_input("rejection_sample", list(args.values()), match=f"rejection_sample: argument '{name}'.*{message}")


@pytest.mark.parametrize("counters,message", [(torch.zeros(3, dtype=torch.int32), "dtype"),
                                              (torch.zeros(4, dtype=torch.int64), "shape|size 4")])
def test_rejection_bad_counters(counters, message):
    check_bad_input("rejection_sample", list(good_rejection_args().values()), {"counters": counters},
                    match=f"argument 'counters'.*({message})")


DRAFT_BAD = [
    ("logits", lambda a: a["logits"].int(), "must have dtype"),
    ("logits", lambda a: a["logits"][0], "must be 2-D"),
    ("logits", lambda a: a["logits"].t().contiguous().t(), "unit stride"),
    ("temperature", lambda a: a["temperature"].double(), "must have dtype float32"),
    ("temperature", lambda a: a["temperature"][:2], "size 2 in dimension 0"),
    ("seeds", lambda a: a["seeds"].int(), "must have dtype int64"),
    ("positions", lambda a: a["positions"][:2], "size 2 in dimension 0"),
    ("probs", lambda a: a["probs"].double(), "must have dtype float32"),
    ("probs", lambda a: a["probs"][:, :5], "size 5 in dimension 1"),
    ("probs", lambda a: a["probs"].t().contiguous().t(), "unit stride"),
]


@pytest.mark.parametrize("name,mutate,message", DRAFT_BAD)
def test_sample_draft_bad_inputs_raise_clear_errors(name, mutate, message):
    logits, temperature, seeds, positions = make_logits(0, 4, 12)
    args = dict(logits=logits, temperature=temperature, seeds=seeds, positions=positions, probs=torch.empty(4, 12))
    args[name] = mutate(args)
    check_bad_input("sample_draft", list(args.values()), match=f"sample_draft.with_probs: argument '{name}'.*{message}")


def test_compiled_bad_input_raises_value_error():
    args = good_rejection_args()
    args["seeds"] = args["seeds"].int()
    with pytest.raises(Exception, match="rejection_sample: argument 'seeds' must have dtype int64"):
        torch.compile(lambda a: specdec_ops.rejection_sample(*a.values()), fullgraph=True)(args)


# --- opcheck and torch.compile ------------------------------------------------------------------


@pytest.mark.parametrize("has_q,has_bonus", [(True, True), (False, False)])
def test_opcheck_rejection_sample(has_q, has_bonus):
    args = make_case(2, 3, 2, 16, has_q=has_q, has_bonus=has_bonus)
    torch.library.opcheck(torch.ops.specdec.rejection_sample.default, args)
    torch.library.opcheck(torch.ops.specdec.rejection_sample.counted, (*args, torch.zeros(3, dtype=torch.int64)))


def test_opcheck_sample_draft():
    args = make_logits(3, 4, 16)
    torch.library.opcheck(torch.ops.specdec.sample_draft.default, args)
    torch.library.opcheck(torch.ops.specdec.sample_draft.with_probs, (*args, torch.empty(4, 16)))
    buf = torch.zeros(4, 3, 16)
    torch.library.opcheck(torch.ops.specdec.sample_draft.with_probs, (*args, buf[:, 1, :]))


def draft_then_verify(draft_logits, target_probs, temperature, seeds, positions, counters):
    """Draft k tokens (each step writes its q column), then verify them: the pipeline the ops serve."""
    batch, k, vocab = draft_logits.shape
    q = torch.empty(batch, k, vocab)
    tokens = []
    for step in range(k):
        tokens.append(specdec_ops.sample_draft(draft_logits[:, step], temperature, seeds, positions + step,
                                               probs=q[:, step, :]))
    draft = torch.stack(tokens, dim=1)
    out = specdec_ops.rejection_sample(target_probs, draft, q, seeds, positions, counters=counters)
    return out, q


def test_compile_fullgraph_equals_eager():
    gen = torch.Generator().manual_seed(9)
    batch, k, vocab = 5, 3, 30
    draft_logits = torch.randn(batch, k, vocab, generator=gen)
    target_probs = normalized(torch.rand(batch, k + 1, vocab, generator=gen) ** 2)
    temperature = torch.tensor([1.0, 0.0, 0.5, 2.0, 1.0])
    seeds = torch.arange(batch, dtype=torch.int64) + 40
    positions = torch.arange(batch, dtype=torch.int64) * 10
    eager_counters, compiled_counters = torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    eager = draft_then_verify(draft_logits, target_probs, temperature, seeds, positions, eager_counters)
    compiled = torch.compile(draft_then_verify, fullgraph=True)(draft_logits, target_probs, temperature, seeds,
                                                               positions, compiled_counters)
    assert torch.equal(compiled[0], eager[0])
    assert torch.equal(compiled[1], eager[1])
    assert torch.equal(compiled_counters, eager_counters)
    assert eager_counters[2] == batch * k


# --- CUDA ------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("has_q,has_bonus", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("batch,vocab", [(1, 32000), (7, 129), (64, 32000), (3, 128256)])
def test_cuda_rejection_matches_reference(has_q, has_bonus, batch, vocab):
    args = make_case(batch + vocab, batch, 4, vocab, has_q=has_q, has_bonus=has_bonus)
    cuda_args = [None if a is None else a.cuda() for a in args]
    expected_counters = torch.zeros(3, dtype=torch.int64)
    expected = specdec_ops.rejection_sample_reference(*args, counters=expected_counters)
    counters = torch.zeros(3, dtype=torch.int64, device="cuda")
    got = specdec_ops.rejection_sample(*cuda_args, counters=counters).cpu()
    # Exact for fixed seeds; a mismatch would be a last-ulp log/div tie between CUDA and CPU libraries.
    assert torch.equal(got, expected)
    assert torch.equal(counters.cpu(), expected_counters)


@pytest.mark.cuda
def test_cuda_sample_draft_matches_reference():
    for dtype in (torch.float32, torch.bfloat16):
        args = make_logits(8, 16, 32000, dtype)
        expected_probs = torch.empty(16, 32000)
        expected = specdec_ops.sample_draft_reference(*args, probs=expected_probs)
        probs = torch.empty(16, 32000, device="cuda")
        got = specdec_ops.sample_draft(*(a.cuda() for a in args), probs=probs)
        assert torch.equal(got.cpu(), expected)
        torch.testing.assert_close(probs.cpu(), expected_probs, rtol=1e-4, atol=1e-6)


@pytest.mark.cuda
def test_cuda_graph_capture_replay_with_new_seeds_and_offsets():
    batch, k, vocab = 16, 4, 32000
    args = [None if a is None else a.cuda() for a in make_case(3, batch, k, vocab)]
    p, draft, q, seeds, offsets, _ = args
    logits = torch.randn(batch, vocab, device="cuda")
    temperature = torch.ones(batch, device="cuda")
    probs = torch.empty(batch, vocab, device="cuda")
    counters = torch.zeros(3, dtype=torch.int64, device="cuda")
    graph, (out, tokens) = capture_graph(lambda: (
        specdec_ops.rejection_sample(p, draft, q, seeds, offsets, counters=counters),
        specdec_ops.sample_draft(logits, temperature, seeds, offsets, probs=probs)))
    for step in range(3):
        seeds.copy_(torch.arange(batch, device="cuda") * 31 + step)
        offsets.add_(k + 1)
        counters.zero_()
        with sync_forbidden():
            graph.replay()
        cpu_args = [None if a is None else a.cpu() for a in (p, draft, q, seeds, offsets, None)]
        expected_counters = torch.zeros(3, dtype=torch.int64)
        assert torch.equal(out.cpu(), specdec_ops.rejection_sample_reference(*cpu_args, counters=expected_counters))
        assert torch.equal(counters.cpu(), expected_counters)
        expected_tokens = specdec_ops.sample_draft_reference(logits.cpu(), temperature.cpu(), seeds.cpu(),
                                                             offsets.cpu())
        assert torch.equal(tokens.cpu(), expected_tokens)


@pytest.mark.cuda
def test_cuda_reduce_overhead_has_no_cudagraph_skips():
    from torch._dynamo.utils import counters as dynamo_counters

    gen = torch.Generator().manual_seed(1)
    batch, k, vocab = 8, 3, 4096
    draft_logits = torch.randn(batch, k, vocab, generator=gen).cuda()
    target_probs = normalized(torch.rand(batch, k + 1, vocab, generator=gen)).cuda()
    temperature = torch.ones(batch, device="cuda")
    seeds = torch.arange(batch, device="cuda")
    positions = torch.zeros(batch, dtype=torch.int64, device="cuda")
    stats = torch.zeros(3, dtype=torch.int64, device="cuda")
    # A mutated graph input must have a static address for CUDA graphs (engines keep such buffers persistent).
    torch._dynamo.mark_static_address(stats)
    torch._dynamo.reset()
    dynamo_counters.clear()
    compiled = torch.compile(draft_then_verify_cuda, mode="reduce-overhead", fullgraph=True)
    for step in range(4):
        positions.fill_(step * 10)  # new values, same graph: fresh draws
        out, q = compiled(draft_logits, target_probs, temperature, seeds, positions, stats)
        eager, eager_q = draft_then_verify_cuda(draft_logits, target_probs, temperature, seeds, positions, None)
        assert torch.equal(out, eager)
        torch.testing.assert_close(q, eager_q)
    assert dynamo_counters["inductor"]["cudagraph_skips"] == 0
    assert int(stats[2]) == 4 * batch * k
    with sync_forbidden():  # the eager launchers never sync either
        draft_then_verify_cuda(draft_logits, target_probs, temperature, seeds, positions, stats)


def draft_then_verify_cuda(draft_logits, target_probs, temperature, seeds, positions, counters):
    batch, k, vocab = draft_logits.shape
    q = torch.empty(batch, k, vocab, device=draft_logits.device)
    tokens = [specdec_ops.sample_draft(draft_logits[:, step], temperature, seeds, positions + step,
                                       probs=q[:, step, :]) for step in range(k)]
    draft = torch.stack(tokens, dim=1)
    return specdec_ops.rejection_sample(target_probs, draft, q, seeds, positions, counters=counters), q

"""specdec::greedy_verify and specdec::typical_acceptance against their references."""
import math

import pytest
import torch

import specdec_ops
from specdec_ops._triton import HAS_TRITON

if HAS_TRITON:
    from specdec_ops.kernels import scratch
    from specdec_ops.kernels import verify as verify_kernels

from conftest import HAS_CUDA, sync_forbidden
from harness import Backend, capture_graph, check_bad_input
from samples import make_greedy, make_typical

# --- inputs ------------------------------------------------------------------------------


# --- kernels -----------------------------------------------------------------------------


def call_op(op, target, draft, counters=None, threshold=0.09, alpha=0.3):
    if op == "greedy":
        return specdec_ops.greedy_verify(target, draft, counters)
    return specdec_ops.typical_acceptance(target, draft, threshold, alpha, counters)


def reference(op, target, draft, counters=None, threshold=0.09, alpha=0.3):
    if op == "greedy":
        return specdec_ops.greedy_verify_reference(target, draft, counters)
    return specdec_ops.typical_acceptance_reference(target, draft, threshold, alpha, counters)


def run(backend, op, target, draft, counters=None, threshold=0.09, alpha=0.3, **plan):
    """The op on the backend; on the Triton backend `plan` (block_v, num_chunks) forces how rows are split across
    programs, through the launcher itself."""
    if not plan:
        if op == "greedy":
            return backend.greedy_verify(target, draft, counters)
        return backend.typical_acceptance(target, draft, threshold, alpha, counters)
    assert backend.name == "triton", "only the Triton kernel splits rows"
    device = "cuda" if HAS_CUDA else "cpu"
    t, d = target.to(device), draft.to(device)
    c = None if counters is None else counters.to(device)
    out = verify_kernels.launch(t, d, c, op == "typical", threshold, alpha, **plan)
    if counters is not None:
        counters.copy_(c.cpu())
    return out.cpu()


CPP, TRITON = Backend("cpp"), Backend("triton")
OPS = ["greedy", "typical"]
# The Triton interpreter has no bfloat16.
TRITON_DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if HAS_CUDA else [])


def make(op, seed, batch, k, vocab, **kw):
    return (make_greedy if op == "greedy" else make_typical)(seed, batch, k, vocab, **kw)


def check(backend, op, target, draft, threshold=0.09, alpha=0.3, **plan):
    """Kernel output and counters (starting from nonzero values) equal the reference's."""
    counters = torch.tensor([5, 7, 11], dtype=torch.int64)
    expected_counters = counters.clone()
    expected = reference(op, target, draft, expected_counters, threshold, alpha)
    actual = run(backend, op, target, draft, counters, threshold, alpha, **plan)
    assert actual.dtype == draft.dtype
    assert torch.equal(actual, expected), f"\n{actual}\n!=\n{expected}"
    assert torch.equal(counters, expected_counters), f"{counters} != {expected_counters}"
    assert torch.equal(run(backend, op, target, draft, None, threshold, alpha, **plan), expected)  # uncounted overload
    return actual


# --- the references themselves -----------------------------------------------------------


def naive(op, target, draft, threshold=0.09, alpha=0.3):
    """The issue's wording, one row at a time in Python floats: (output rows, accepted count)."""
    batch, k = draft.shape
    vocab = target.shape[-1]
    rows, num_accepted = [], 0
    for b in range(batch):
        argmax = []
        for i in range(k + 1):
            values = target[b, i].double().tolist()
            argmax.append(values.index(max(values)))
        accepts = []
        for i in range(k):
            x = int(draft[b, i])
            if not 0 <= x < vocab:
                accepts.append(False)
            elif op == "greedy":
                accepts.append(x == argmax[i])
            else:
                p = target[b, i].double().tolist()
                entropy = -sum(q * math.log(q + 1e-5) for q in p)
                accepts.append(p[x] > min(threshold, alpha * math.exp(-entropy)))
        num_accepted += sum(accepts)
        first = accepts.index(False) if False in accepts else k
        row = [int(draft[b, i]) for i in range(first)] + [argmax[first]] + [-1] * (k - first)
        rows.append(row)
    return rows, num_accepted


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("seed", range(3))
def test_reference_matches_the_issue_wording(op, seed):
    target, draft = make(op, seed, 5, 4, 23)
    draft[0, 1] = -1  # out of vocabulary: rejected
    counters = torch.zeros(3, dtype=torch.int64)
    out = reference(op, target, draft, counters)
    rows, num_accepted = naive(op, target, draft)
    assert out.tolist() == rows
    assert counters.tolist() == [num_accepted, sum(r != -1 for row in rows for r in row), 5 * 4]


def test_known_layout_and_counts_every_position():
    # Row 0: all accepted -> bonus. Row 1: rejected at 1, accepted again at 2 and 3 (counted, not emitted).
    # Row 2: draft id out of vocabulary at 0.
    logits = torch.full((3, 5, 6), -1.0)
    argmax = [[1, 2, 3, 4, 5], [0, 5, 2, 2, 0], [3, 3, 3, 3, 3]]
    for b, row in enumerate(argmax):
        for i, a in enumerate(row):
            logits[b, i, a] = 1.0
    draft = torch.tensor([[1, 2, 3, 4], [0, 4, 2, 2], [-1, 3, 3, 3]], dtype=torch.int32)
    counters = torch.zeros(3, dtype=torch.int64)
    expected = [[1, 2, 3, 4, 5], [0, 5, -1, -1, -1], [3, -1, -1, -1, -1]]
    for backend in [CPP] + ([TRITON] if HAS_TRITON else []):
        counters.zero_()
        out = run(backend, "greedy", logits, draft, counters)
        assert out.tolist() == expected
        assert counters.tolist() == [4 + 3 + 3, 5 + 2 + 1, 12]
    assert specdec_ops.greedy_verify_reference(logits, draft).tolist() == expected


# --- kernels against the reference ---------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("batch,k,vocab", [(1, 1, 2), (3, 4, 37), (2, 8, 19), (5, 2, 1), (4, 3, 2), (0, 4, 9)])
@pytest.mark.parametrize("draft_dtype", [torch.int32, torch.int64])
def test_matches_reference(backend, op, batch, k, vocab, draft_dtype):
    target, draft = make(op, batch * 100 + k * 10 + vocab, batch, k, vocab, draft_dtype=draft_dtype)
    check(backend, op, target, draft)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cpp_every_float_dtype(op, dtype):
    target, draft = make(op, 3, 7, 4, 301, dtype=dtype)
    check(CPP, op, target, draft)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
def test_triton_float_dtypes(op, dtype):
    target, draft = make(op, 4, 3, 4, 53, dtype=dtype)
    check(TRITON, op, target, draft)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("num_chunks", [2, 3, 5])
def test_triton_rows_split_into_chunks(op, num_chunks):
    # Several programs per row; their partials are combined by the request's last program.
    target, draft = make(op, 10 + num_chunks, 3, 4, 70)
    check(TRITON, op, target, draft, block_v=16, num_chunks=num_chunks)


@pytest.mark.parametrize("op", OPS)
def test_large_vocabulary(backend, op):
    # 5000 entries: several BLOCK_V steps per program (and many rows for at::parallel_for on CPU).
    batch = 9 if backend.name == "cpp" else 2
    target, draft = make(op, 77, batch, 4, 5000)
    plan = {} if backend.name == "cpp" else {"block_v": 1024, "num_chunks": 2}
    check(backend, op, target, draft, **plan)


# --- edge inputs ---------------------------------------------------------------------------


# Triton row splits that put equal values in one lane (index i and i + 16) and in different chunks.
TRITON_SPLITS = [dict(block_v=16, num_chunks=1), dict(block_v=16, num_chunks=3)]


def check_every_split(backend, op, target, draft, *args):
    out = check(backend, op, target, draft, *args)
    if backend.name == "triton":
        for plan in TRITON_SPLITS:
            check(backend, op, target, draft, *args, **plan)
    return out


@pytest.mark.parametrize("op", OPS)
def test_ties_pick_the_lowest_index(backend, op):
    vocab = 40
    target = torch.rand(2, 5, vocab) * 0.01
    ties = [[3, 19, 35], [0, 16], [22, 38], [5, 21, 37], [12, 13, 28]]
    for i, tied in enumerate(ties):
        target[:, i, tied] = 0.5
    target = target / target.sum(-1, keepdim=True) if op == "typical" else target
    # Request 0 drafts the lowest tied index (accepted); request 1 a later tied one (rejected).
    draft = torch.tensor([[t[0] for t in ties[:4]], [t[1] for t in ties[:4]]])
    out = check_every_split(backend, op, target, draft)
    if op == "greedy":
        assert out.tolist() == [[3, 0, 22, 5, 12], [3, -1, -1, -1, -1]]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("vocab", [1, 2, 31, 64])
def test_one_hot_and_uniform_rows(backend, op, vocab):
    batch, k = 3, 4
    target = torch.full((batch, k + 1, vocab), 1.0 / vocab)  # uniform: argmax 0, typical accepts for V < 2e5
    hot = torch.tensor([0, vocab - 1, vocab // 2, 1 % vocab, vocab - 1])
    target[1] = 0.0
    target[1, torch.arange(k + 1), hot] = 1.0  # one-hot rows
    draft = torch.tensor([[0, vocab - 1, 0, vocab - 1], hot[:k].tolist(), [vocab - 1] * k])
    out = check_every_split(backend, op, target, draft)
    assert out[1].tolist() == hot.tolist()  # the one-hot request accepts everything and gets the bonus


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("draft_dtype", [torch.int32, torch.int64])
def test_out_of_vocabulary_draft_ids_are_rejected(backend, op, draft_dtype):
    vocab = 10
    info = torch.iinfo(draft_dtype)
    bad = [-1, vocab, vocab + 1, info.min, info.max, -vocab]
    target = torch.full((len(bad), 3, vocab), 1.0 / vocab)
    target[:, :, 0] = 1.0  # argmax 0 everywhere, p(0) dominant
    target = target / target.sum(-1, keepdim=True)
    draft = torch.tensor([[0, x] for x in bad], dtype=draft_dtype)  # position 0 accepted, 1 out of range
    out = check(backend, op, target, draft)
    assert out.tolist() == [[0, 0, -1]] * len(bad)


def test_nan_and_infinite_logits_follow_torch_argmax(backend):
    logits = torch.randn(4, 3, 12)
    logits[0, 0, 5] = math.nan
    logits[0, 0, 9] = math.nan
    logits[0, 1] = -math.inf
    logits[1, 0, [2, 7]] = math.inf
    logits[1, 1, [3, 4]] = math.inf
    logits[1, 1, 8] = math.nan
    logits[2, :, :] = math.nan
    draft = torch.tensor([[5, 0], [2, 8], [0, 0], [1, 1]])
    check_every_split(backend, "greedy", logits, draft)


@pytest.mark.parametrize("threshold,alpha", [(0.0, 0.0), (1.0, 1.0), (0.5, 0.0)])
def test_typical_threshold_and_alpha(backend, threshold, alpha):
    # One-hot and two-point rows keep the draft probabilities far from every threshold here.
    target = torch.zeros(2, 3, 8)
    target[0, :, 3] = 1.0
    target[1, :, 1] = 0.75
    target[1, :, 6] = 0.25
    draft = torch.tensor([[3, 4], [6, -1]])
    out = check(backend, "typical", target, draft, threshold, alpha)
    # A zero limit accepts every in-vocabulary id with p > 0, never an out-of-vocabulary one.
    if threshold == 0 and alpha == 0:
        assert out.tolist() == [[3, 3, -1], [6, 1, -1]]


# --- Triton bookkeeping --------------------------------------------------------------------


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_tickets_are_left_zeroed():
    for seed, (batch, k, vocab, chunks) in enumerate([(3, 4, 37, 2), (6, 1, 5, 1)]):
        for op in OPS:
            target, draft = make(op, seed, batch, k, vocab)
            check(TRITON, op, target, draft, block_v=16, num_chunks=chunks)
            assert scratch._scratch and all(int(t.count_nonzero()) == 0 for t in scratch._scratch.values())


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_ticket_buffer_grows_and_keeps_the_old_one(monkeypatch):
    monkeypatch.setattr(scratch, "SCRATCH_CAPACITY", 2)
    monkeypatch.setattr(scratch, "_scratch", {})
    monkeypatch.setattr(scratch, "_outgrown_scratch", [])
    for batch in (2, 3):
        target, draft = make_greedy(30 + batch, batch, 2, 9)
        check(TRITON, "greedy", target, draft)
    (outgrown,), (current,) = scratch._outgrown_scratch, scratch._scratch.values()
    assert outgrown.numel() == 2 and current.numel() == 3


# --- errors ------------------------------------------------------------------------------


BAD_INPUTS = [
    ("target", lambda t, d, c: (t[0], d, c), "3-D"),
    ("target", lambda t, d, c: (t.double(), d, c), "float16 or bfloat16 or float32"),
    ("target", lambda t, d, c: (t.to(torch.int32), d, c), "dtype"),
    ("target", lambda t, d, c: (t[:-1], d, c), "B, rows of draft_token_ids"),
    ("target", lambda t, d, c: (t[:, :-1], d, c), "k \\+ 1"),
    ("target", lambda t, d, c: (t[:, :, :0], d, c), "V >= 1"),
    ("target", lambda t, d, c: (t.transpose(1, 2).contiguous().transpose(1, 2), d, c), "unit stride"),
    ("draft_token_ids", lambda t, d, c: (t, d.float(), c), "int32 or int64"),
    ("draft_token_ids", lambda t, d, c: (t, d.to(torch.int16), c), "int32 or int64"),
    ("draft_token_ids", lambda t, d, c: (t, d[0], c), "2-D"),
    ("draft_token_ids", lambda t, d, c: (t[:, :1], d[:, :0], c), "k >= 1"),
    ("draft_token_ids", lambda t, d, c: (t, d.t().contiguous().t(), c), "unit stride"),
    ("counters", lambda t, d, c: (t, d, c.int()), "int64"),
    ("counters", lambda t, d, c: (t, d, c[:2]), "accepted, emitted, proposed"),
    ("counters", lambda t, d, c: (t, d, c[None]), "1-D"),
]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name,mutate,message", BAD_INPUTS, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_INPUTS)])
def test_bad_inputs_raise_clear_errors(op, name, mutate, message):
    target, draft = make_greedy(1, 3, 4, 16)
    target_name = "target_logits" if op == "greedy" else "target_probs"
    name = target_name if name == "target" else name
    t, d, c = mutate(target, draft, torch.zeros(3, dtype=torch.int64))
    counted = name == "counters"
    pattern = f"{'greedy_verify' if op == 'greedy' else 'typical_acceptance'}: argument '{name}'.*{message}"

    check_bad_input("greedy_verify" if op == "greedy" else "typical_acceptance", (t, d),
                    {"counters": c} if counted else {}, match=pattern)


def test_compile_reports_bad_shapes_at_trace_time():
    compiled = torch.compile(lambda t, d: specdec_ops.typical_acceptance(t, d), fullgraph=True)
    # Dynamo wraps the fake kernel's ValueError, keeping its message.
    with pytest.raises(Exception, match="ValueError.*typical_acceptance: argument 'target_probs' has size 3"):
        compiled(torch.rand(2, 3, 5), torch.zeros(2, 3, dtype=torch.int64))  # needs k + 1 = 4 rows


@pytest.mark.parametrize("op", OPS)
def test_device_mix_is_rejected_by_the_fake_kernel(op):
    from torch._subclasses.fake_tensor import FakeTensorMode

    target, draft = make_greedy(2, 2, 3, 8)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_target = mode.from_tensor(target.to("meta"))
        fake_draft = mode.from_tensor(draft)
        with pytest.raises(ValueError, match="is on meta, expected cpu"):
            call_op(op, fake_target, fake_draft)
        with pytest.raises(ValueError, match="'counters' is on meta"):
            call_op(op, mode.from_tensor(target), fake_draft, mode.from_tensor(torch.zeros(3, dtype=torch.int64,
                                                                                             device="meta")))


# --- torch.library and torch.compile -----------------------------------------------------


@pytest.mark.parametrize("batch", [0, 3])
def test_opcheck(batch):
    logits, draft = make_greedy(5, batch, 4, 16)
    probs = logits.softmax(-1)
    counters = torch.zeros(3, dtype=torch.int64)
    ops = torch.ops.specdec
    torch.library.opcheck(ops.greedy_verify.default, (logits, draft))
    torch.library.opcheck(ops.greedy_verify.counted, (logits, draft, counters))
    torch.library.opcheck(ops.typical_acceptance.default, (probs, draft), {"posterior_threshold": 0.05})
    torch.library.opcheck(ops.typical_acceptance.counted, (probs, draft, 0.09, 0.3, counters))


def _verify_both(logits, probs, draft, counters):
    greedy = specdec_ops.greedy_verify(logits, draft, counters)
    typical = specdec_ops.typical_acceptance(probs, draft, 0.05, 0.2)
    typical_counted = specdec_ops.typical_acceptance(probs, draft, counters=counters)
    return greedy, typical, typical_counted, specdec_ops.greedy_verify(logits, draft)


def _compile_inputs(device):
    logits, draft = make_greedy(6, 5, 4, 64)
    probs, _ = make_typical(6, 5, 4, 64)
    return logits.to(device), probs.to(device), draft.to(device)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_compile_fullgraph_matches_eager(device):
    logits, probs, draft = _compile_inputs(device)
    eager_counters = torch.zeros(3, dtype=torch.int64, device=device)
    compiled_counters = torch.zeros(3, dtype=torch.int64, device=device)
    expected = _verify_both(logits, probs, draft, eager_counters)
    actual = torch.compile(_verify_both, fullgraph=True)(logits, probs, draft, compiled_counters)
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)
    assert torch.equal(compiled_counters, eager_counters)


# --- CUDA ------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch,vocab", [(1, 128256), (3, 32000), (64, 32000), (257, 1000), (1, 7)])
def test_cuda_matches_reference(op, dtype, batch, vocab):
    target, draft = make(op, batch + vocab, batch, 4, vocab, dtype=dtype)
    counters = torch.tensor([1, 2, 3], dtype=torch.int64)
    expected_counters = counters.clone()
    expected = reference(op, target, draft, expected_counters)
    c = counters.cuda()
    out = call_op(op, target.cuda(), draft.cuda(), c)
    assert torch.equal(out.cpu(), expected)
    assert torch.equal(c.cpu(), expected_counters)


@pytest.mark.cuda
def test_cuda_ticket_buffer_grows():
    batch = scratch.SCRATCH_CAPACITY + 3
    logits, draft = make_greedy(8, batch, 1, 3)
    out = specdec_ops.greedy_verify(logits.cuda(), draft.cuda())
    assert torch.equal(out.cpu(), specdec_ops.greedy_verify_reference(logits, draft))


@pytest.mark.cuda
def test_cuda_opcheck():
    logits, draft = make_greedy(9, 4, 3, 1000)
    logits, draft = logits.cuda(), draft.cuda()
    counters = torch.zeros(3, dtype=torch.int64, device="cuda")
    ops = torch.ops.specdec
    torch.library.opcheck(ops.greedy_verify.default, (logits, draft))
    torch.library.opcheck(ops.greedy_verify.counted, (logits, draft, counters))
    torch.library.opcheck(ops.typical_acceptance.default, (logits.softmax(-1), draft))
    torch.library.opcheck(ops.typical_acceptance.counted, (logits.softmax(-1), draft, 0.09, 0.3, counters))


@pytest.mark.cuda
@pytest.mark.parametrize("batch,vocab", [(2, 128256), (48, 32000)])
def test_cuda_graph_capture_and_replay(batch, vocab):
    k = 4
    logits, greedy_draft = (x.cuda() for x in make_greedy(20, batch, k, vocab))
    probs, typical_draft = (x.cuda() for x in make_typical(20, batch, k, vocab))
    counters = torch.zeros(3, dtype=torch.int64, device="cuda")
    graph, (greedy, typical) = capture_graph(lambda: (
        specdec_ops.greedy_verify(logits, greedy_draft, counters),
        specdec_ops.typical_acceptance(probs, typical_draft, counters=counters)))
    counters.zero_()
    expected_counters = torch.zeros(3, dtype=torch.int64)
    for seed in range(3):  # new values, same shapes; counters accumulate over replays
        new_logits, new_greedy_draft = make_greedy(21 + seed, batch, k, vocab)
        new_probs, new_typical_draft = make_typical(21 + seed, batch, k, vocab)
        for static, new in ((logits, new_logits), (greedy_draft, new_greedy_draft), (probs, new_probs),
                            (typical_draft, new_typical_draft)):
            static.copy_(new)
        with sync_forbidden():
            graph.replay()
        expected_greedy = specdec_ops.greedy_verify_reference(new_logits, new_greedy_draft, expected_counters)
        expected_typical = specdec_ops.typical_acceptance_reference(new_probs, new_typical_draft,
                                                                    counters=expected_counters)
        assert torch.equal(greedy.cpu(), expected_greedy)
        assert torch.equal(typical.cpu(), expected_typical)
        assert torch.equal(counters.cpu(), expected_counters)


@pytest.mark.cuda
def test_cuda_compile_reduce_overhead_has_no_cudagraph_skips():
    from torch._dynamo.utils import counters as dynamo_counters

    def verify_both(logits, probs, draft):
        return specdec_ops.greedy_verify(logits, draft), specdec_ops.typical_acceptance(probs, draft, 0.05, 0.2)

    torch._dynamo.reset()
    dynamo_counters.clear()
    logits, probs, draft = _compile_inputs("cuda")
    compiled = torch.compile(verify_both, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, record, replay
        actual = compiled(logits, probs, draft)
    expected = verify_both(logits, probs, draft)
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)
    assert dynamo_counters["inductor"]["cudagraph_skips"] == 0


@pytest.mark.cuda
def test_cuda_no_sync():
    logits, probs, draft = _compile_inputs("cuda")
    counters = torch.zeros(3, dtype=torch.int64, device="cuda")
    _verify_both(logits, probs, draft, counters)  # compile the kernels outside the check
    with sync_forbidden():
        _verify_both(logits, probs, draft, counters)


@pytest.mark.parametrize("name,value", [("posterior_threshold", -1.0), ("posterior_alpha", -0.1),
                                        ("posterior_threshold", float("nan"))])
def test_typical_acceptance_refuses_negative_parameters(name, value):
    # Refused always (strict mode or not), by the C++ kernel, the fake and the Triton entry alike.
    probs = torch.rand(2, 4, 9).softmax(-1)
    draft = torch.randint(0, 9, (2, 3))
    check_bad_input("typical_acceptance", (probs, draft), {name: value}, match=f"argument '{name}' must be >= 0")

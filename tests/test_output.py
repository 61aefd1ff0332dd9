"""specdec::create_output against the reference, and both seed ops under torch.compile."""
import pytest
import torch

import specdec_ops
from specdec_ops._triton import HAS_TRITON

if HAS_TRITON:
    from specdec_ops.kernels import output as output_kernels

from conftest import check_outputs_use_torchs_allocator, sync_forbidden
from harness import capture_graph, check_bad_input
from samples import make_batch, make_verified


def check(backend, args):
    expected_counters = torch.tensor([3, 5, 7])
    expected = specdec_ops.create_output_reference(*args, counters=expected_counters)
    counters = torch.tensor([3, 5, 7])
    actual = backend.create_output(*args, counters=counters)
    assert actual.dtype == args[2].dtype
    assert torch.equal(actual, expected), f"\n{actual}\n!=\n{expected}"
    assert torch.equal(counters, expected_counters)
    assert torch.equal(backend.create_output(*args), expected)


@pytest.mark.parametrize("batch", [0, 1, 7, 300])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 7, 8])
def test_matches_reference(backend, batch, k):
    for seed in range(3):
        check(backend, make_verified(seed * 7 + k, batch, k))


@pytest.mark.parametrize("pattern", ["all", "none", "causal"])
def test_accept_patterns(backend, pattern):
    check(backend, make_verified(1, 65, 5, pattern=pattern))


@pytest.mark.parametrize(
    "dtypes",
    [
        dict(token_dtype=torch.int32),
        dict(token_dtype=torch.int64, substitute_dtype=torch.int32),
        dict(token_dtype=torch.int32, accepted_dtype=torch.int64, bonus_2d=False),
        dict(token_dtype=torch.int64, accepted_dtype=torch.uint8),
        dict(token_dtype=torch.int64, accepted_dtype=torch.int32),
    ],
    ids=["int32", "int32-substitute", "int64-accepted", "uint8-accepted", "int32-accepted"],
)
def test_every_allowed_dtype(backend, dtypes):
    check(backend, make_verified(2, 33, 4, **dtypes))


def test_strided_inputs(backend):
    accepted, substitute, draft, bonus = make_verified(3, 20, 6)
    # Row-strided views, as slices of wider buffers are.
    wide = lambda t: torch.cat([t, t], dim=1)[:, : t.shape[1]]  # noqa: E731
    check(backend, (wide(accepted), wide(substitute), wide(draft), bonus))


def test_known_rows():
    accepted = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 1, 1], [1, 0, 1]], dtype=torch.bool)
    draft = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, -1]])
    substitute = draft + 100
    bonus = torch.tensor([50, 51, 52, 53])
    counters = torch.zeros(3, dtype=torch.int64)
    out = specdec_ops.create_output(accepted, substitute, draft, bonus, counters=counters)
    assert out.tolist() == [[1, 2, 103, -1], [4, 5, 6, 51], [107, -1, -1, -1], [10, 111, -1, -1]]
    assert counters.tolist() == [2 + 3 + 2 + 2, 3 + 4 + 1 + 2, 12]


def test_accepted_minus_one_draft_emits_no_bonus(backend):
    # As in the seed: the bonus goes out only when the last draft column holds a token other than -1.
    accepted = torch.ones(2, 2, dtype=torch.bool)
    draft = torch.tensor([[5, -1], [5, 6]])
    args = (accepted, draft + 1, draft, torch.tensor([[9], [9]]))
    check(backend, args)
    assert backend.create_output(*args).tolist() == [[5, -1, -1], [5, 6, 9]]


BAD_INPUTS = [
    ("accepted", lambda a: a.__setitem__(0, a[0].float()), "dtype"),
    ("accepted", lambda a: a.__setitem__(0, a[0][:, :-1]), "size"),
    ("substitute_token_ids", lambda a: a.__setitem__(1, a[1][:-1]), "size"),
    ("draft_token_ids", lambda a: a.__setitem__(2, a[2][0]), "2-D"),
    ("draft_token_ids", lambda a: a.__setitem__(2, a[2].to(torch.int16)), "dtype"),
    ("bonus_token_ids", lambda a: a.__setitem__(3, torch.zeros(5, 2, dtype=torch.int64)), r"\[B, 1\] or \[B\]"),
    ("bonus_token_ids", lambda a: a.__setitem__(3, a[3][:-1]), "size"),
]


@pytest.mark.parametrize("name,mutate,message", BAD_INPUTS, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_INPUTS)])
def test_bad_inputs_raise_clear_errors(name, mutate, message):
    args = list(make_verified(4, 5, 3))
    mutate(args)
    check_bad_input("create_output", args, match=f"'{name}'.*{message}")


def test_bad_counters_raise_clear_errors():
    args = make_verified(5, 5, 3)
    for counters in (torch.zeros(3, dtype=torch.int32), torch.zeros(4, dtype=torch.int64)):
        check_bad_input("create_output", args, {"counters": counters}, match="'counters'")


def test_zero_columns_rejected():
    args = make_verified(6, 3, 1)
    args = [a[:, :0] if a.dim() == 2 and i < 3 else a for i, a in enumerate(args)]
    with pytest.raises(ValueError, match="'draft_token_ids'.*k >= 1"):
        specdec_ops.create_output(*args)


@pytest.mark.parametrize("batch", [0, 6])
def test_opcheck(batch):
    args = make_verified(7, batch, 4)
    torch.library.opcheck(torch.ops.specdec.create_output.default, args)
    torch.library.opcheck(torch.ops.specdec.create_output.counted, (*args, torch.zeros(3, dtype=torch.int64)))


def seed_ops_pipeline(batch, verified, counters):
    """prepare_prefill -> create_output, chained as a draft/verify round would chain them."""
    prefill_out = specdec_ops.prepare_prefill(**batch, max_num_reqs=batch["seq_lens"].shape[0] + 2)
    accepted, substitute, draft, bonus = verified
    # Feed a prefill output into verification so the graph depends on both ops.
    draft = draft + prefill_out.last_token_indices[: draft.shape[0], None]
    tokens = specdec_ops.create_output(accepted, substitute, draft, bonus, counters=counters)
    return prefill_out, tokens


def test_compile_fullgraph_equals_eager():
    batch = make_batch(8, 6)
    verified = make_verified(8, 6, 4)
    eager_counters = torch.zeros(3, dtype=torch.int64)
    compiled_counters = torch.zeros(3, dtype=torch.int64)
    eager = seed_ops_pipeline(batch, verified, eager_counters)
    compiled = torch.compile(seed_ops_pipeline, fullgraph=True)(batch, verified, compiled_counters)
    for a, e in zip(compiled[0], eager[0]):
        assert torch.equal(a, e)
    assert torch.equal(compiled[1], eager[1])
    assert torch.equal(compiled_counters, eager_counters)
    assert int(eager_counters[2]) == 6 * 4


def prefill_into_pipeline(batch, buffers):
    specdec_ops.prepare_prefill_into(**batch, **buffers)
    return buffers["last_token_indices"] * 2


def test_compile_prepare_prefill_into_equals_eager():
    batch = make_batch(13, 5)
    total = batch["input_ids"].shape[0] + 5

    def fresh_buffers():
        return dict(
            expanded_input_ids=torch.full((total + 7,), -1, dtype=torch.int32),
            expanded_positions=torch.full((total + 7,), -1, dtype=torch.int64),
            last_token_indices=torch.full((8,), -1, dtype=torch.int64),
            expanded_query_start_loc=torch.full((9,), -1, dtype=torch.int32),
            expanded_seq_lens=torch.full((8,), -1, dtype=torch.int32),
        )

    eager_buffers, compiled_buffers = fresh_buffers(), fresh_buffers()
    eager = prefill_into_pipeline(batch, eager_buffers)
    compiled = torch.compile(prefill_into_pipeline, fullgraph=True)(batch, compiled_buffers)
    assert torch.equal(compiled, eager)
    for name in eager_buffers:
        assert torch.equal(compiled_buffers[name], eager_buffers[name]), name
    expected = specdec_ops.prepare_prefill_reference(**batch, max_num_reqs=8)
    assert torch.equal(compiled_buffers["expanded_positions"][:total], expected.expanded_positions)
    assert (compiled_buffers["expanded_positions"][total:] == -1).all()


# --- CUDA ------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("batch", [1, 64, 1024, 5000])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_cuda_matches_reference(batch, k):
    args = make_verified(batch + k, batch, k)
    cuda_counters = torch.zeros(3, dtype=torch.int64, device="cuda")
    out = specdec_ops.create_output(*[a.cuda() for a in args], counters=cuda_counters)
    expected_counters = torch.zeros(3, dtype=torch.int64)
    expected = specdec_ops.create_output_reference(*args, counters=expected_counters)
    assert torch.equal(out.cpu(), expected)
    assert torch.equal(cuda_counters.cpu(), expected_counters)


@pytest.mark.cuda
def test_cuda_output_comes_from_torchs_allocator():
    args = [a.cuda() for a in make_verified(6, 300, 5)]
    counters = torch.zeros(3, dtype=torch.int64, device="cuda")
    check_outputs_use_torchs_allocator(lambda: specdec_ops.create_output(*args, counters=counters))


@pytest.mark.cuda
def test_cuda_graph_capture_replay_and_no_sync():
    static = [a.cuda() for a in make_verified(9, 64, 4)]
    counters = torch.zeros(3, dtype=torch.int64, device="cuda")
    graph, out = capture_graph(lambda: specdec_ops.create_output(*static, counters=counters))
    counters.zero_()  # the warm-up call added to them
    expected_counters = torch.zeros(3, dtype=torch.int64)
    for seed in range(3):
        fresh = make_verified(10 + seed, 64, 4, pattern="random" if seed else "causal")
        for s, f in zip(static, fresh):
            s.copy_(f)
        with sync_forbidden():
            graph.replay()
        expected = specdec_ops.create_output_reference(*fresh, counters=expected_counters)
        assert torch.equal(out.cpu(), expected)
        assert torch.equal(counters.cpu(), expected_counters)


@pytest.mark.cuda
def test_cuda_reduce_overhead_has_no_cudagraph_skips():
    from torch._dynamo.utils import counters as dynamo_counters

    torch._dynamo.reset()
    dynamo_counters.clear()
    batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in make_batch(12, 6).items()}
    verified = [a.cuda() for a in make_verified(12, 6, 4)]
    stats = torch.zeros(3, dtype=torch.int64, device="cuda")
    # A mutated graph input must have a static address for CUDA graphs (engines keep such buffers persistent).
    torch._dynamo.mark_static_address(stats)
    compiled = torch.compile(seed_ops_pipeline, mode="reduce-overhead", fullgraph=True)
    for step in range(4):
        prefill_out, tokens = compiled(batch, verified, stats)
        eager_prefill, eager_tokens = seed_ops_pipeline(batch, verified, torch.zeros(3, dtype=torch.int64,
                                                                                      device="cuda"))
        assert torch.equal(tokens, eager_tokens)
        for a, e in zip(prefill_out, eager_prefill):
            assert torch.equal(a, e)
        verified[0].copy_(torch.rand(6, 4, device="cuda") < 0.5)  # new values, same graph
    assert dynamo_counters["inductor"]["cudagraph_skips"] == 0
    assert int(stats[2]) == 4 * 6 * 4


@pytest.mark.cuda
@pytest.mark.parametrize("counted", [False, True])
def test_cuda_cpp_launcher_matches_python_launcher(counted):
    """The op's CUDA kernel launches from C++; the Python launcher of the same Triton kernel must agree."""
    for seed, (batch, k, token_dtype, accepted_dtype) in enumerate(
            [(1, 1, torch.int64, torch.bool), (37, 5, torch.int32, torch.int8), (300, 8, torch.int64, torch.int32)]):
        args = [a.cuda() for a in make_verified(seed, batch, k, token_dtype=token_dtype,
                                                accepted_dtype=accepted_dtype)]
        if counted:
            from_cpp, from_python = (torch.tensor([1, 2, 3], device="cuda") for _ in range(2))
            out = torch.ops.specdec.create_output.counted(*args, from_cpp)
            assert torch.equal(out, output_kernels.create_output_triton(*args, from_python))
            assert torch.equal(from_cpp, from_python)
        else:
            assert torch.equal(torch.ops.specdec.create_output.default(*args), output_kernels.create_output_triton(*args))


@pytest.mark.parametrize("overload", ["default", "counted"])
def test_cuda_kernel_is_the_cpp_launcher(overload):
    """The CUDA kernel is registered by csrc/create_output.cpp (no Python on the eager path), on any build."""
    name = "specdec::create_output" + ("" if overload == "default" else ".counted")
    cuda_lines = [line for line in torch._C._dispatch_dump(name).splitlines() if line.startswith("CUDA:")]
    assert len(cuda_lines) == 1 and "create_output.cpp" in cuda_lines[0], cuda_lines


@pytest.mark.cuda
def test_cuda_call_from_a_fresh_thread():
    """A thread that never used CUDA gets the device's context before the C++ launch."""
    import threading

    args = [a.cuda() for a in make_verified(5, 33, 4)]
    expected = specdec_ops.create_output(*args)  # compiled and loaded on this thread
    results = []
    worker = threading.Thread(target=lambda: results.append(specdec_ops.create_output(*args)))
    worker.start()
    worker.join()
    assert len(results) == 1 and torch.equal(results[0], expected)

"""specdec::advance_draft_step against its reference: C++, Triton, fake kernel, compile, CUDA graphs."""
import pytest
import torch

import specdec_ops
from specdec_ops.ops import draft_step

from conftest import HAS_CUDA, sync_forbidden
from harness import capture_graph, check_bad_input
from samples import make_step

INT32_MAX = 2**31 - 1


def assert_same(actual, expected):
    for name, a, e in zip(("input_ids", "next_positions", "next_seq_lens"), actual, expected):
        assert a.dtype == e.dtype, f"{name}: {a.dtype} != {e.dtype}"
        assert a.shape == e.shape, name
        assert torch.equal(a, e), f"{name}:\n{a}\n!=\n{e}"


@pytest.mark.parametrize("n", [0, 1, 7, 1500])
@pytest.mark.parametrize("seed", range(2))
def test_matches_reference(backend, n, seed):
    args = make_step(seed + 10 * n, n)
    assert_same(backend.advance_draft_step(*args), draft_step.advance_draft_step_reference(*args))


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("lens_dtype", [torch.int32, torch.int64])
def test_every_int_dtype(backend, ids_dtype, pos_dtype, lens_dtype):
    args = make_step(3, 33, ids_dtype=ids_dtype, pos_dtype=pos_dtype, lens_dtype=lens_dtype)
    out = backend.advance_draft_step(*args)
    assert [o.dtype for o in out] == [torch.int32, pos_dtype, lens_dtype]
    assert_same(out, draft_step.advance_draft_step_reference(*args))


def test_known_values():
    ids = torch.tensor([11, 22, 33, 44])
    positions = torch.tensor([0, 8, 9, 12])
    seq_lens = torch.tensor([1, 9, 10, 3], dtype=torch.int32)
    input_ids, next_positions, next_seq_lens = specdec_ops.advance_draft_step(ids, positions, seq_lens, 10)
    assert input_ids.tolist() == [11, 22, 33, 44] and input_ids.dtype == torch.int32
    assert next_positions.tolist() == [1, 9, 9, 9]  # clamped to max_model_len - 1
    assert next_seq_lens.tolist() == [2, 10, 10, 4]  # clamped to max_model_len
    # Inputs are not modified, outputs are new tensors.
    assert positions.tolist() == [0, 8, 9, 12] and seq_lens.tolist() == [1, 9, 10, 3]
    assert input_ids.data_ptr() != ids.data_ptr()


def test_int32_maximum_clamps_instead_of_wrapping(backend):
    ids = torch.tensor([1, 2], dtype=torch.int32)
    positions = torch.tensor([INT32_MAX, INT32_MAX - 1], dtype=torch.int32)
    seq_lens = torch.tensor([INT32_MAX, 5], dtype=torch.int32)
    out = backend.advance_draft_step(ids, positions, seq_lens, INT32_MAX)
    assert out[1].tolist() == [INT32_MAX - 1, INT32_MAX - 1]
    assert out[2].tolist() == [INT32_MAX, 6]
    assert_same(out, draft_step.advance_draft_step_reference(ids, positions, seq_lens, INT32_MAX))


def test_max_model_len_one(backend):
    args = make_step(4, 9, max_model_len=1)
    out = backend.advance_draft_step(*args)
    assert out[1].eq(0).all() and out[2].le(1).all()
    assert_same(out, draft_step.advance_draft_step_reference(*args))


def test_strided_inputs_from_a_column_are_rejected_unless_contiguous(backend):
    # A column of a [n, k] draft-token buffer is strided; the op wants unit stride, so callers pass .contiguous().
    tokens = torch.arange(12).reshape(4, 3)
    positions = torch.arange(4)
    seq_lens = torch.arange(1, 5, dtype=torch.int32)
    if backend.name == "cpp" or not HAS_CUDA:  # .cuda() would make the column contiguous
        with pytest.raises(ValueError, match="'sampled_token_ids'.*unit stride"):
            backend.advance_draft_step(tokens[:, 1], positions, seq_lens, 100)
    out = backend.advance_draft_step(tokens[:, 1].contiguous(), positions, seq_lens, 100)
    assert out[0].tolist() == [1, 4, 7, 10]


# --- bad inputs ---------------------------------------------------------------------------

BAD_INPUTS = [
    ("sampled_token_ids", lambda a: a.update(ids=a["ids"].float()), "dtype int32 or int64"),
    ("sampled_token_ids", lambda a: a.update(ids=a["ids"][:, None]), "1-D"),
    ("positions", lambda a: a.update(positions=a["positions"][:-1]), "expected 5"),
    ("positions", lambda a: a.update(positions=a["positions"].to(torch.int16)), "dtype int32 or int64"),
    ("seq_lens", lambda a: a.update(seq_lens=a["seq_lens"][:, None]), "1-D"),
    ("seq_lens", lambda a: a.update(seq_lens=torch.zeros(6, dtype=torch.int32)), "expected 5"),
    ("max_model_len", lambda a: a.update(max_model_len=0), ">= 1"),
]


@pytest.mark.parametrize("name,mutate,message", BAD_INPUTS, ids=[f"{b[0]}{i}" for i, b in enumerate(BAD_INPUTS)])
def test_bad_inputs_raise_clear_errors(name, mutate, message):
    ids, positions, seq_lens, max_model_len = make_step(5, 5)
    a = dict(ids=ids, positions=positions, seq_lens=seq_lens, max_model_len=max_model_len)
    mutate(a)
    args = (a["ids"], a["positions"], a["seq_lens"], a["max_model_len"])
    pattern = f"advance_draft_step: argument '{name}'.*{message}"
    check_bad_input("advance_draft_step", args, match=pattern)


def test_device_mix_is_rejected_by_the_fake_kernel():
    from torch._subclasses.fake_tensor import FakeTensorMode

    ids, positions, seq_lens, max_model_len = make_step(6, 4)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_ids, fake_pos = mode.from_tensor(ids), mode.from_tensor(positions)
        fake_lens = mode.from_tensor(seq_lens.to("meta"))
        with pytest.raises(ValueError, match="'seq_lens' is on meta"):
            torch.ops.specdec.advance_draft_step(fake_ids, fake_pos, fake_lens, max_model_len)


def test_compile_error_surfaces_at_trace_time():
    ids, positions, seq_lens, max_model_len = make_step(7, 4)
    fn = torch.compile(lambda i, p, s: specdec_ops.advance_draft_step(i, p, s, 16), fullgraph=True,
                       backend="eager")
    with pytest.raises(Exception, match="'positions'"):
        fn(ids, positions[:3], seq_lens)


# --- torch.library and torch.compile -----------------------------------------------------


@pytest.mark.parametrize("n", [0, 6])
def test_opcheck(n):
    torch.library.opcheck(torch.ops.specdec.advance_draft_step.default, make_step(8, n))
    torch.library.opcheck(torch.ops.specdec.advance_draft_step.default,
                          make_step(9, n, ids_dtype=torch.int32, pos_dtype=torch.int32, lens_dtype=torch.int64))


def test_compiled_equals_eager():
    # Three chained steps, as the draft loop runs them, under inductor.
    def loop(ids, positions, seq_lens):
        outs = []
        for _ in range(3):
            ids, positions, seq_lens = specdec_ops.advance_draft_step(ids, positions, seq_lens, 40)
            outs.append((ids, positions, seq_lens))
            ids = ids * 2 + 1  # stands in for the next sampled token
        return outs

    compiled = torch.compile(loop, fullgraph=True)
    for seed in range(2):
        args = make_step(10 + seed, 17, max_model_len=40)[:3]
        for got, want in zip(compiled(*args), loop(*args)):
            assert_same(got, want)


# --- CUDA ------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("n", [0, 1, 255, 4097])
def test_cuda_matches_reference(n):
    args = make_step(20 + n, n, max_model_len=300)
    out = torch.ops.specdec.advance_draft_step(*[a.cuda() if isinstance(a, torch.Tensor) else a for a in args])
    assert all(o.is_cuda for o in out)
    assert_same(tuple(o.cpu() for o in out), draft_step.advance_draft_step_reference(*args))


@pytest.mark.cuda
def test_cuda_graph_capture_and_replay():
    ids, positions, seq_lens, max_model_len = make_step(30, 64, max_model_len=100, device="cuda")
    graph, out = capture_graph(lambda: specdec_ops.advance_draft_step(ids, positions, seq_lens, max_model_len))
    for seed in range(3):  # new values, same shapes
        fresh = make_step(31 + seed, 64, max_model_len=100, device="cuda")
        for static, new in zip((ids, positions, seq_lens), fresh):
            static.copy_(new)
        with sync_forbidden():
            graph.replay()
        expected = draft_step.advance_draft_step_reference(ids.cpu(), positions.cpu(), seq_lens.cpu(), max_model_len)
        assert_same(tuple(o.cpu() for o in out), expected)


@pytest.mark.cuda
def test_cuda_reduce_overhead_compile_has_no_cudagraph_skips():
    from torch._dynamo.utils import counters

    counters.clear()
    fn = torch.compile(lambda i, p, s: specdec_ops.advance_draft_step(i, p, s, 100), mode="reduce-overhead",
                       fullgraph=True)
    for seed in range(4):  # the first calls warm up and record, later ones replay
        args = make_step(40 + seed, 32, max_model_len=100, device="cuda")[:3]
        torch.cuda.set_sync_debug_mode("error" if seed >= 2 else 0)
        try:
            out = tuple(o.clone() for o in fn(*args))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        expected = draft_step.advance_draft_step_reference(*[a.cpu() for a in args], 100)
        assert_same(tuple(o.cpu() for o in out), expected)
    assert counters["inductor"]["cudagraph_skips"] == 0


@pytest.mark.cuda
def test_cuda_no_sync():
    args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in make_step(50, 16)]
    torch.ops.specdec.advance_draft_step(*args)  # compile outside the check
    with sync_forbidden():
        torch.ops.specdec.advance_draft_step(*args)

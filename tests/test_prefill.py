"""specdec::prepare_prefill and prepare_prefill_into against the reference."""

import pytest
import torch

import specdec_ops
from specdec_ops._triton import HAS_TRITON
from specdec_ops.ops import prefill

if HAS_TRITON:
    from specdec_ops.kernels import geometry
    from specdec_ops.kernels import prefill as prefill_kernels

from conftest import check_outputs_use_torchs_allocator, sync_forbidden
from harness import Backend, capture_graph, check_bad_input
from samples import make_batch


def to_cuda(batch):
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def run(backend, batch, max_num_reqs=None):
    return backend.prepare_prefill(**batch, max_num_reqs=max_num_reqs)


def assert_same(actual, expected):
    for name, a, e in zip(prefill.PrefillInputs._fields, actual, expected):
        assert a.dtype == e.dtype, name
        assert torch.equal(a, e), f"{name}:\n{a}\n!=\n{e}"


@pytest.mark.parametrize("num_reqs", [0, 1, 2, 7, 33])
@pytest.mark.parametrize("seed", range(4))
def test_matches_reference(backend, num_reqs, seed):
    batch = make_batch(seed * 100 + num_reqs, num_reqs)
    assert_same(run(backend, batch), specdec_ops.prepare_prefill_reference(**batch))


@pytest.mark.parametrize(
    "dtypes",
    [
        dict(ids_dtype=torch.int64, pos_dtype=torch.int32, qsl_dtype=torch.int64, misc_dtype=torch.int64,
             last_dtype=torch.int32, rejected_dtype=torch.int64),
        dict(ids_dtype=torch.int32, pos_dtype=torch.int64, qsl_dtype=torch.int32, misc_dtype=torch.int32,
             last_dtype=torch.int32, rejected_dtype=torch.int64),
    ],
    ids=["int64-mostly", "mixed"],
)
def test_every_int_dtype(backend, dtypes):
    batch = make_batch(5, 9, **dtypes)
    assert_same(run(backend, batch), specdec_ops.prepare_prefill_reference(**batch))


@pytest.mark.parametrize("max_num_reqs_extra", [1, 5, 300])
def test_padding_rows_past_num_reqs(backend, max_num_reqs_extra):
    batch = make_batch(11, 6)
    out = run(backend, batch, max_num_reqs=6 + max_num_reqs_extra)
    assert_same(out, specdec_ops.prepare_prefill_reference(**batch, max_num_reqs=6 + max_num_reqs_extra))
    total = batch["input_ids"].shape[0] + 6
    assert (out.expanded_query_start_loc[6:] == total).all()
    assert (out.expanded_seq_lens[6:] == 0).all() and (out.last_token_indices[6:] == 0).all()


def test_long_queries(backend):
    # Query lengths of 1000-3000 tokens: the draft prefill of a whole prompt.
    batch = make_batch(21, 5, long_query=True)
    assert_same(run(backend, batch), specdec_ops.prepare_prefill_reference(**batch))


def test_long_queries_at_tile_edges(backend):
    # A request with more slots than a tile's first column holds continues on its own, LONG_SLOTS
    # slots per step: several in one tile, at its first and last rows, in two tiles, and lengths
    # on either side of each boundary.
    rows, slots, long_slots = (geometry.PREPARE_PREFILL[name] for name in ("rows", "slots", "long_slots"))
    query_lens = [3] * (2 * rows + 3)
    for row, length in ((0, slots - 1), (1, slots), (5, slots + 1), (rows - 1, slots + long_slots),
                        (rows, slots + long_slots - 1), (rows + 2, 2500), (2 * rows + 2, slots + long_slots + 1)):
        query_lens[row] = length
    batch = make_batch(23, len(query_lens), query_lens=query_lens)
    assert_same(run(backend, batch), specdec_ops.prepare_prefill_reference(**batch))


def test_many_requests(backend):
    batch = make_batch(22, 1024, max_query_len=5)
    assert_same(run(backend, batch), specdec_ops.prepare_prefill_reference(**batch))


def test_token_batch_padded_past_requests(backend):
    # CUDA-graph engines pad the token batch: slots past the last request hold token 0 at position 0.
    batch = make_batch(23, 4, max_query_len=5, num_tokens=33)
    out = run(backend, batch)
    assert_same(out, specdec_ops.prepare_prefill_reference(**batch))
    used = int(batch["query_start_loc"][-1]) + 4
    assert used < 33 + 4
    assert (out.expanded_input_ids[used:] == 0).all() and (out.expanded_positions[used:] == 0).all()


def test_clamps_to_max_model_len(backend):
    batch = make_batch(24, 3, max_model_len=16, max_query_len=6)
    batch["positions"] = torch.arange(batch["positions"].shape[0]) + 10
    batch["seq_lens"] = torch.full((3,), 16, dtype=torch.int32)
    out = run(backend, batch)
    assert_same(out, specdec_ops.prepare_prefill_reference(**batch))
    assert int(out.expanded_positions.max()) == 15
    assert (out.expanded_seq_lens == 16).all()


def test_known_layout():
    # Two requests: 3 tokens with 1 rejected, 2 tokens with none rejected.
    out = specdec_ops.prepare_prefill(
        input_ids=torch.tensor([10, 11, 12, 20, 21], dtype=torch.int32),
        positions=torch.tensor([5, 6, 7, 0, 1]),
        query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32),
        seq_lens=torch.tensor([8, 2], dtype=torch.int32),
        idx_mapping=torch.tensor([1, 0], dtype=torch.int32),
        last_sampled=torch.tensor([100, 101]),
        num_rejected=torch.tensor([1, 0], dtype=torch.int32),
        max_model_len=64,
        max_num_reqs=3,
    )
    assert out.expanded_input_ids.tolist() == [10, 11, 101, 0, 20, 21, 100]
    assert out.expanded_positions.tolist() == [5, 6, 7, 8, 0, 1, 2]
    assert out.last_token_indices.tolist() == [2, 6, 0]
    assert out.expanded_query_start_loc.tolist() == [0, 4, 7, 7]
    assert out.expanded_seq_lens.tolist() == [9, 3, 0]


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_into_persistent_buffers(backend, ids_dtype):
    batch = make_batch(31, 5)
    max_num_reqs, max_tokens = 8, 200
    sentinel = -7
    buffers = dict(
        expanded_input_ids=torch.full((max_tokens,), sentinel, dtype=ids_dtype),
        expanded_positions=torch.full((max_tokens,), sentinel, dtype=torch.int64),
        last_token_indices=torch.full((max_num_reqs,), sentinel, dtype=torch.int64),
        expanded_query_start_loc=torch.full((max_num_reqs + 1,), sentinel, dtype=torch.int32),
        expanded_seq_lens=torch.full((max_num_reqs,), sentinel, dtype=torch.int32),
    )
    assert backend.prepare_prefill_into(**batch, **buffers) is None
    expected = specdec_ops.prepare_prefill_reference(**batch, max_num_reqs=max_num_reqs)
    total = expected.expanded_input_ids.shape[0]
    assert torch.equal(buffers["expanded_input_ids"][:total], expected.expanded_input_ids.to(ids_dtype))
    assert torch.equal(buffers["expanded_positions"][:total], expected.expanded_positions)
    assert (buffers["expanded_input_ids"][total:] == sentinel).all(), "wrote past num_tokens + num_reqs"
    assert (buffers["expanded_positions"][total:] == sentinel).all(), "wrote past num_tokens + num_reqs"
    assert torch.equal(buffers["last_token_indices"], expected.last_token_indices)
    assert torch.equal(buffers["expanded_query_start_loc"], expected.expanded_query_start_loc)
    assert torch.equal(buffers["expanded_seq_lens"], expected.expanded_seq_lens)


def out_of_range_batch(seed):
    batch = make_batch(seed, 6)
    batch["idx_mapping"] = torch.tensor([-5, 99999, 0, 1, 2**30, -1], dtype=torch.int32)
    batch["num_rejected"] = torch.tensor([-3, 100, 0, 1, 2**20, -(2**20)], dtype=torch.int32)
    return batch


def test_out_of_range_values_are_clamped(backend):
    # Values are not validated on the device; slots and rejection counts are clamped, never dereferenced.
    batch = out_of_range_batch(41)
    out = run(backend, batch)
    allowed = set(batch["input_ids"].tolist()) | set(batch["last_sampled"].tolist()) | {0}
    assert set(out.expanded_input_ids.tolist()) <= allowed
    assert 0 <= int(out.expanded_positions.min()) and int(out.expanded_positions.max()) < batch["max_model_len"]


def test_cpp_and_triton_agree_on_out_of_range_values():
    if not HAS_TRITON:
        pytest.skip("triton not installed")
    batch = out_of_range_batch(42)
    assert_same(run(Backend("cpp"), batch), run(Backend("triton"), batch))


def test_malformed_query_start_loc_stays_in_bounds(backend):
    # A non-monotone or out-of-range query_start_loc gives unspecified rows, but no out-of-bounds access.
    batch = out_of_range_batch(43)
    batch["query_start_loc"] = batch["query_start_loc"].clone()
    batch["query_start_loc"][3] = 10**6
    batch["query_start_loc"][4] = -10**6
    out = run(backend, batch)
    assert out.expanded_input_ids.shape == (batch["input_ids"].shape[0] + 6,)
    assert out.expanded_query_start_loc.shape == (7,)


# --- bad inputs -------------------------------------------------------------------------

BAD_INPUTS = [
    ("input_ids", lambda b: b.update(input_ids=b["input_ids"].float()), "dtype int32 or int64"),
    ("input_ids", lambda b: b.update(input_ids=b["input_ids"][None]), "1-D"),
    ("positions", lambda b: b.update(positions=b["positions"][:-1]), "positions"),
    ("seq_lens", lambda b: b.update(seq_lens=b["seq_lens"][:-1]), "seq_lens"),
    ("idx_mapping", lambda b: b.update(idx_mapping=b["idx_mapping"][:-1]), "idx_mapping"),
    ("num_rejected", lambda b: b.update(num_rejected=b["num_rejected"][:, None]), "num_rejected"),
    ("query_start_loc", lambda b: b.update(query_start_loc=b["query_start_loc"][:0]), "query_start_loc"),
    ("last_sampled", lambda b: b.update(last_sampled=b["last_sampled"].to(torch.int16)), "last_sampled"),
    ("max_model_len", lambda b: b.update(max_model_len=0), "max_model_len"),
]


@pytest.mark.parametrize("name,mutate,message", BAD_INPUTS, ids=[b[0] + str(i) for i, b in enumerate(BAD_INPUTS)])
def test_bad_inputs_raise_clear_errors(name, mutate, message):
    batch = make_batch(51, 3)
    mutate(batch)
    check_bad_input("prepare_prefill", (), batch, match=f"'{name}'.*{message}|{message}.*'{name}'|'{name}'")


def test_max_num_reqs_below_num_reqs_is_rejected():
    batch = make_batch(52, 4)
    check_bad_input("prepare_prefill", (), {**batch, "max_num_reqs": 3}, match="'max_num_reqs'")


def test_device_mix_is_rejected_by_the_fake_kernel():
    batch = make_batch(53, 3)
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        fake["seq_lens"] = mode.from_tensor(meta["seq_lens"])
        with pytest.raises(ValueError, match="'seq_lens' is on meta"):
            torch.ops.specdec.prepare_prefill(**fake)


def test_into_buffers_too_small_are_rejected():
    batch = make_batch(54, 4)
    total = batch["input_ids"].shape[0] + 4
    buffers = dict(
        expanded_input_ids=torch.zeros(total - 1, dtype=torch.int32),
        expanded_positions=torch.zeros(total, dtype=torch.int64),
        last_token_indices=torch.zeros(4, dtype=torch.int64),
        expanded_query_start_loc=torch.zeros(5, dtype=torch.int32),
        expanded_seq_lens=torch.zeros(4, dtype=torch.int32),
    )
    with pytest.raises(ValueError, match="'expanded_input_ids'.*at least"):
        torch.ops.specdec.prepare_prefill_into(**batch, **buffers)
    buffers["expanded_input_ids"] = torch.zeros(total, dtype=torch.int32)
    buffers["expanded_seq_lens"] = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="'expanded_seq_lens'"):
        torch.ops.specdec.prepare_prefill_into(**batch, **buffers)
    buffers["expanded_seq_lens"] = torch.zeros(4, dtype=torch.int32)
    buffers["expanded_positions"] = torch.zeros(total, dtype=torch.int32)
    with pytest.raises(ValueError, match="'expanded_positions'.*int64"):
        torch.ops.specdec.prepare_prefill_into(**batch, **buffers)


# --- torch.library and torch.compile -----------------------------------------------------


@pytest.mark.parametrize("num_reqs", [0, 3])
def test_opcheck(num_reqs):
    batch = make_batch(61, num_reqs)
    torch.library.opcheck(torch.ops.specdec.prepare_prefill.default, tuple(batch.values()), {"max_num_reqs": 5})
    total = batch["input_ids"].shape[0] + num_reqs
    buffers = (torch.zeros(total + 3, dtype=torch.int32), torch.zeros(total + 3, dtype=torch.int64),
               torch.zeros(6, dtype=torch.int64), torch.zeros(7, dtype=torch.int32), torch.zeros(6, dtype=torch.int32))
    torch.library.opcheck(torch.ops.specdec.prepare_prefill_into.default, tuple(batch.values()) + buffers)


# --- CUDA ------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("num_reqs", [0, 1, 64, 1024])
def test_cuda_matches_reference(seed, num_reqs):
    batch = make_batch(seed + 1000 * num_reqs, num_reqs, long_query=seed == 0)
    out = torch.ops.specdec.prepare_prefill(**to_cuda(batch), max_num_reqs=num_reqs + 3)
    assert_same(prefill.PrefillInputs(*(o.cpu() for o in out)), specdec_ops.prepare_prefill_reference(**batch, max_num_reqs=num_reqs + 3))


@pytest.mark.cuda
def test_cuda_graph_capture_and_replay():
    static = to_cuda(make_batch(71, 16, max_query_len=5, num_tokens=80, num_slots=20))
    max_num_reqs, total = 32, static["input_ids"].shape[0] + 16
    buffers = dict(
        expanded_input_ids=torch.zeros(total + 64, dtype=torch.int32, device="cuda"),
        expanded_positions=torch.zeros(total + 64, dtype=torch.int64, device="cuda"),
        last_token_indices=torch.zeros(max_num_reqs, dtype=torch.int64, device="cuda"),
        expanded_query_start_loc=torch.zeros(max_num_reqs + 1, dtype=torch.int32, device="cuda"),
        expanded_seq_lens=torch.zeros(max_num_reqs, dtype=torch.int32, device="cuda"),
    )
    def round_():
        specdec_ops.prepare_prefill_into(**static, **buffers)
        return specdec_ops.prepare_prefill(**static, max_num_reqs=max_num_reqs)

    graph, functional = capture_graph(round_)
    for seed in range(3):  # new values, same shapes
        fresh = make_batch(72 + seed, 16, max_query_len=5, num_tokens=80, num_slots=20)
        for k, v in fresh.items():
            if isinstance(v, torch.Tensor):
                static[k].copy_(v)
        with sync_forbidden():
            graph.replay()
        expected = specdec_ops.prepare_prefill_reference(**{k: v.cpu() if isinstance(v, torch.Tensor) else v
                                                           for k, v in static.items()}, max_num_reqs=max_num_reqs)
        assert_same(prefill.PrefillInputs(*(o.cpu() for o in functional)), expected)
        assert torch.equal(buffers["expanded_input_ids"][:total].cpu(), expected.expanded_input_ids)
        assert torch.equal(buffers["last_token_indices"].cpu(), expected.last_token_indices)


@pytest.mark.cuda
def test_cuda_no_sync():
    batch = to_cuda(make_batch(73, 8))
    torch.ops.specdec.prepare_prefill(**batch)  # compile outside the check
    with sync_forbidden():
        torch.ops.specdec.prepare_prefill(**batch, max_num_reqs=12)


@pytest.mark.cuda
def test_cuda_outputs_come_from_torchs_allocator():
    batch = make_batch(5, 300, device="cuda")
    outputs = torch.ops.specdec.prepare_prefill(**batch, max_num_reqs=1000)
    assert all(o.device == batch["input_ids"].device for o in outputs)
    check_outputs_use_torchs_allocator(lambda: torch.ops.specdec.prepare_prefill(**batch, max_num_reqs=1000))


@pytest.mark.cuda
def test_cuda_cpp_launcher_matches_python_launcher():
    """The op's CUDA kernel launches from C++; the Python launcher of the same Triton kernel must agree."""
    for seed, (num_reqs, kwargs) in enumerate([(0, {}), (1, {}), (40, dict(ids_dtype=torch.int64)),
                                                (17, dict(long_query=True, last_dtype=torch.int32))]):
        batch = make_batch(seed, num_reqs, device="cuda", **kwargs)
        from_cpp = torch.ops.specdec.prepare_prefill(**batch, max_num_reqs=num_reqs + 3)
        from_python = prefill_kernels.prepare_prefill_triton(**batch, max_num_reqs=num_reqs + 3)
        for got, want in zip(from_cpp, from_python):
            assert torch.equal(got, want)


@pytest.mark.parametrize("op", ["prepare_prefill", "prepare_prefill_into"])
def test_cuda_kernel_is_the_cpp_launcher(op):
    """The CUDA kernel is registered by csrc/prepare_prefill.cpp (no Python on the eager path), on any build."""
    cuda_lines = [line for line in torch._C._dispatch_dump(f"specdec::{op}").splitlines() if line.startswith("CUDA:")]
    assert len(cuda_lines) == 1 and "prepare_prefill.cpp" in cuda_lines[0], cuda_lines


@pytest.mark.cuda
def test_cuda_int64_scalar_arguments():
    """A max_model_len past 2**31 is passed to the kernel as i64 (its own compiled specialization)."""
    batch = make_batch(7, 9, device="cuda")
    batch["max_model_len"] = 2**40
    got = torch.ops.specdec.prepare_prefill(**batch)
    want = prefill.prepare_prefill_reference(**{k: v.cpu() if isinstance(v, torch.Tensor) else v
                                                for k, v in batch.items()})
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w)

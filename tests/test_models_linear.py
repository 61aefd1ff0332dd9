"""The models' small-batch projection kernel (specdec_ops/models/linear.py) equals F.linear.

The kernel where it runs (the GPU with CUDA, else the Triton interpreter): float32 to 1e-5, plain and fused, on
odd shapes; float16 within 2e-3 of a float32 product of the same inputs (outputs O(1)). In the interpreter only:
the fused kernel in float16 against the unfused model's roundings. On CUDA: bf16 at the 1B model's shapes within
bf16 rounding of a float32 product, through torch.compile(fullgraph=True) and a CUDA graph.
"""
import pytest
import torch

from conftest import sync_forbidden
from harness import capture_graph
from specdec_ops.models.linear import (MAX_ROWS, fused_linear_reference, launch_config, linear,
                                      small_batch_linear_triton)


def inputs(rows, n, k, dtype=torch.float32, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    return x.to(device, dtype), w.to(device, dtype)


@pytest.mark.parametrize("rows,n,k", [
    (1, 40, 2048),    # one row, K a multiple of the tile, N not a multiple of the column block
    (1, 7, 300),      # one row, K not a multiple of the tile (masked tail), fewer columns than a block
    (5, 70, 512),     # a verify batch of 5 rows, N not a multiple of 16
    (16, 33, 200),    # the most rows the kernel takes, ragged K
    (3, 1, 16),       # one output column
])
def test_matches_f_linear_float32(rows, n, k, kernel_device):
    x, w = inputs(rows, n, k, device=kernel_device)
    got = small_batch_linear_triton(x, w)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, x @ w.T, atol=1e-5, rtol=0)


@pytest.mark.parametrize("rows", [1, 4])
def test_half_precision_rounds_once(rows, kernel_device):
    x, w = inputs(rows, 24, 640, dtype=torch.float16, seed=1, device=kernel_device)
    got = small_batch_linear_triton(x, w)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), x.float() @ w.float().T, atol=2e-3, rtol=0)


def test_strided_inputs_and_empty_shapes(kernel_device):
    x, w = inputs(2, 24, 96, seed=2, device=kernel_device)
    # A transposed weight view and a row slice (copied to unit stride along K first).
    wt = w.T.contiguous().T
    torch.testing.assert_close(small_batch_linear_triton(x[:, :64], wt[:, :64]), x[:, :64] @ w[:, :64].T,
                               atol=1e-5, rtol=0)
    assert small_batch_linear_triton(x[:0], w).shape == (0, 24)
    assert (small_batch_linear_triton(x[:, :0], w[:, :0]) == 0).all()


def test_launch_config_covers_k():
    for rows, n, k in ((1, 3072, 2048), (5, 16384, 2048), (1, 49152, 576), (8, 2048, 8192), (1, 10, 8)):
        for gated, norm in ((False, False), (True, True), (False, True)):
            c = launch_config(rows, n, k, gated=gated, norm=norm)
            assert c["even_k"] == (k % c["block_k"] == 0) and c["one_row"] == (rows == 1)
            assert c["block_k"] >= 16 and (rows == 1 or c["block_n"] >= 16)


def test_bad_inputs_raise():
    x, w = inputs(2, 8, 32)
    with pytest.raises(ValueError, match="same K"):
        small_batch_linear_triton(x, w[:, :16])
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS}"):
        small_batch_linear_triton(torch.zeros(MAX_ROWS + 1, 32), w)
    with pytest.raises(ValueError, match="share dtype"):
        small_batch_linear_triton(x, w.double())
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        small_batch_linear_triton(x.double(), w.double())


def test_linear_off_cuda_is_f_linear():
    # CPU tensors (and float32 anywhere) take F.linear: bit-identical, bias included.
    x, w = inputs(3, 8, 32)
    bias = torch.randn(8)
    assert torch.equal(linear(x, w, bias), torch.nn.functional.linear(x, w, bias))
    assert torch.equal(torch.ops.specdec_models.small_batch_linear(x, w), torch.nn.functional.linear(x, w))


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 5])
def test_bf16_model_shapes_compiled_in_a_graph_on_cuda(rows):
    from torch._dynamo.utils import counters

    shapes = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048), (2816, 1024), (1000, 576)]
    weights = [inputs(rows, n, k, dtype=torch.bfloat16, seed=i, device="cuda")[1] for i, (n, k) in enumerate(shapes)]
    xs = [inputs(rows, n, k, dtype=torch.bfloat16, seed=10 + i, device="cuda")[0] for i, (n, k) in enumerate(shapes)]
    bias = torch.randn(shapes[0][0], device="cuda", dtype=torch.bfloat16)

    def step():
        return [linear(xs[0], weights[0], bias)] + [linear(x, w) for x, w in zip(xs[1:], weights[1:])]

    skips = counters["inductor"]["cudagraph_skips"]
    graph, outs = capture_graph(torch.compile(step, fullgraph=True, dynamic=False))
    with sync_forbidden():
        graph.replay()
    torch.cuda.synchronize()
    assert counters["inductor"]["cudagraph_skips"] == skips
    for i, (x, w, out) in enumerate(zip(xs, weights, outs)):
        want = x.float() @ w.float().T + (bias.float() if i == 0 else 0)
        # bf16 output rounding (8 bits of mantissa) of values up to about 5, plus the bias's own rounding.
        torch.testing.assert_close(out.float(), want, atol=6e-2, rtol=1e-2)


# --- Fused prologue / epilogue --------------------------------------------------------------------------------

def fused_inputs(rows, n, k, dtype=torch.float32, seed=0, device="cpu", gated=False):
    """x, weight ([2n, k] when gated), norm weight, bias, residual: O(1) activations, norm weights around 1."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * 3
    w = torch.randn(2 * n if gated else n, k, generator=gen) / k ** 0.5
    norm_w = 1 + 0.2 * torch.randn(k, generator=gen)
    bias = 0.1 * torch.randn(2 * n if gated else n, generator=gen)
    residual = torch.randn(rows, n, generator=gen)
    return [t.to(device, dtype) for t in (x, w, norm_w, bias, residual)]


FUSIONS = {
    "norm": dict(norm=True),                       # q/k/v: RMSNorm prologue
    "norm_bias": dict(norm=True, bias=True),       # Qwen2's q/k/v
    "norm_gated": dict(norm=True, gated=True),     # gate/up with silu(gate) * up
    "residual": dict(residual=True),               # o_proj and down_proj: + the residual stream
}


def run_fused(fn, x, w, norm_w, bias, residual, norm=False, bias_on=False, gated=False, residual_on=False,
              **kwargs):
    return fn(x, w, norm_weight=norm_w if norm else None, eps=1e-5, bias=bias if bias_on else None,
              residual=residual if residual_on else None, gated=gated, **kwargs)


def fusion_args(name):
    f = FUSIONS[name]
    return dict(norm=f.get("norm", False), bias_on=f.get("bias", False), gated=f.get("gated", False),
                residual_on=f.get("residual", False))


@pytest.mark.parametrize("name", sorted(FUSIONS))
@pytest.mark.parametrize("rows,n,k", [(1, 40, 2048), (1, 7, 300), (5, 70, 512), (16, 33, 200)])
def test_fused_matches_unfused_math_float32(name, rows, n, k, kernel_device):
    args = fusion_args(name)
    tensors = fused_inputs(rows, n, k, device=kernel_device, gated=args["gated"])
    got = run_fused(small_batch_linear_triton, *tensors, **args)
    want = run_fused(fused_linear_reference, *tensors, **args)
    assert got.shape == want.shape == (rows, n)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if kernel_device.type == "cuda":
        return
    # The op off CUDA is the reference math itself.
    op = torch.ops.specdec_models.small_batch_linear_fused
    x, w, norm_w, bias, residual = tensors
    assert torch.equal(op(x, w, norm_w if args["norm"] else None, 1e-5, bias if args["bias_on"] else None,
                          residual if args["residual_on"] else None, args["gated"]), want)


@pytest.mark.interpreter
@pytest.mark.parametrize("name", sorted(FUSIONS))
def test_fused_half_precision_rounds_like_the_model(name):
    # float16 (the interpreter's tl.dot mishandles bfloat16; the CUDA test covers it): the kernel rounds where the
    # unfused model stores an intermediate; what remains is the float32 accumulation order, which can flip one
    # rounding of an intermediate (an ulp, 2^-11 relative) and its effect downstream.
    args = fusion_args(name)
    tensors = fused_inputs(4, 24, 640, dtype=torch.float16, seed=1, gated=args["gated"])
    for rows in (1, 4):
        t = [tensors[0][:rows], tensors[1], tensors[2], tensors[3], tensors[4][:rows]]
        got = run_fused(small_batch_linear_triton, *t, **args).float()
        want = run_fused(fused_linear_reference, *t, **args).float()
        torch.testing.assert_close(got, want, atol=4e-3, rtol=4e-3)
        # Most entries bit for bit: without the intermediate roundings a quarter to three quarters differ.
        assert (got == want).float().mean() >= 0.95, (got == want).float().mean()


def test_fused_bad_inputs_raise():
    x, w, norm_w, bias, residual = fused_inputs(2, 8, 32)
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        small_batch_linear_triton(x, w, norm_weight=norm_w[:5])
    with pytest.raises(ValueError, match="residual must have shape"):
        small_batch_linear_triton(x, w, residual=residual[:1])
    with pytest.raises(ValueError, match="bias .* must share"):
        small_batch_linear_triton(x, w, bias=bias.double())
    with pytest.raises(ValueError, match="even count"):
        small_batch_linear_triton(x, w[:7], gated=True)
    with pytest.raises(ValueError, match="gated projection takes no bias"):
        small_batch_linear_triton(x, w, bias=bias, gated=True)


def test_fused_op_traces_and_its_fake_runs():
    x, w, norm_w, _, residual = fused_inputs(3, 8, 32, gated=True)
    torch.library.opcheck(torch.ops.specdec_models.small_batch_linear_fused,
                          (x, w, norm_w, 1e-5, None, residual[:, :8], True),
                          test_utils=("test_schema", "test_faketensor"))


def test_fused_op_output_is_contiguous_like_its_fake():
    # A strided residual: the CPU path's residual + y would take its layout; the op returns what its fake says
    # (contiguous), so a compiled graph's size/stride assertion holds.
    op = torch.ops.specdec_models.small_batch_linear_fused
    x, w, _, _, residual = fused_inputs(5, 8, 32)
    strided = residual.T.contiguous().T
    assert not strided.is_contiguous()
    eager = op(x, w, None, 1e-5, None, strided, False)
    assert eager.is_contiguous()
    compiled = torch.compile(lambda *a: op(*a), fullgraph=True, dynamic=False)(x, w, None, 1e-5, None, strided, False)
    torch.testing.assert_close(compiled, eager, atol=0, rtol=0)
    torch.testing.assert_close(eager, fused_linear_reference(x, w, residual=strided), atol=0, rtol=0)

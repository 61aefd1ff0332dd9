"""The model's projections for few tokens: a Triton matrix-vector kernel that streams the weight at close to the
memory bandwidth, where cuBLAS's kernels for one to sixteen rows fall short on the small matrices of a 1B model,
and that takes the neighbouring elementwise work of a decoder layer into its prologue and epilogue.

``out = x @ weight.T`` for x [M, K] and weight [N, K], accumulated in float32 and rounded once to x's dtype;
fused (`fused_linear_reference` states the math): the row's RMSNorm before the product, + bias, silu(gate) * up
(a [gate; up] weight) and + residual after it.

- `small_batch_linear_triton`: the kernel, on any device Triton runs on (CPU through the interpreter). One program
  owns BLOCK_N output columns and streams their weight rows over K once (gated: the gate and the up rows of its
  columns). With one row (a batch-1 decode step) it multiplies and accumulates elementwise in a
  [BLOCK_N, BLOCK_K] float32 tile and reduces once at the end (two columns per program: enough programs to fill
  the GPU even for N = 2048); with 2 to 16 rows it runs one tl.dot of the rows (padded to 16) against each
  weight tile. The norm: each program first sums the squares of its x row(s) (x is small and L2-resident), then
  normalizes each x tile as it loads it. Prologue and epilogue round where the unfused model stores an
  intermediate, so the two differ by float32 summation order only. The first pass costs little: applying 1 / rms
  to the accumulator instead measured no faster at one row and slower with tl.dot.
- Dependent launch (dependent_launch.py): on Hopper a one-row program loads its first weight tile before it
  waits for the previous kernel, so a projection's weight stream starts while the kernel before it finishes.
- `torch.ops.specdec_models.small_batch_linear` and `torch.ops.specdec_models.small_batch_linear_fused`: the ops
  models call; `torch.library.custom_op`s with fake kernels, so torch.compile(fullgraph=True) traces them as one
  node each and CUDA graphs capture their launches (a custom op, not a triton_op, so that the launch keeps its
  dependent-launch attribute). Off CUDA they are F.linear and the unfused math.
- `linear` and `fused_linear`: what the model calls: the ops for 1 to MAX_ROWS rows of a float16/bfloat16
  CUDA tensor (`takes_kernel`), F.linear and the unfused math otherwise (float32 models keep cuBLAS, whose
  results the CUDA tests compare exactly).

The tilings come from scripts/bench_linear_configs.py (the fused projections of the Llama-3.2-1B shape under
candidate tilings, H200); benchmarks/RESULTS.md has the figures, scripts/bench_model.py times the model.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import dependent_launch
from .dependent_launch import release_dependents, wait_for_producers

# Rows up to which `linear` takes the Triton kernel (the dot path pads the rows to 16).
MAX_ROWS = 16
HALF_DTYPES = (torch.float16, torch.bfloat16)


@triton.jit
def _round_to(v, dtype: tl.constexpr):
    """v (float32) rounded to dtype and back: what storing an intermediate in the model dtype does."""
    return v.to(dtype).to(tl.float32)


@triton.jit
def _load_x(x_ptrs, kk, row_mask, K, EVEN_K: tl.constexpr):
    """The x rows of row_mask at columns kk, in float32, zero past K."""
    if EVEN_K:
        return tl.load(x_ptrs, mask=row_mask, other=0.0).to(tl.float32)
    return tl.load(x_ptrs, mask=row_mask & (kk < K), other=0.0).to(tl.float32)


@triton.jit
def _load_k(ptrs, in_k, EVEN_K: tl.constexpr):
    """The entries at ptrs in their own dtype, 0 where in_k is off (columns past K); unmasked when K is a multiple
    of BLOCK_K."""
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=in_k, other=0.0)


@triton.jit
def _normalize(x, rstd, norm_w_ptr, kk, K, EVEN_K: tl.constexpr, DTYPE: tl.constexpr):
    """RMSNorm of an x tile as the model computes it: (x * rstd) rounded to the model dtype, times the norm
    weight, rounded again."""
    if EVEN_K:
        nw = tl.load(norm_w_ptr + kk).to(tl.float32)
    else:
        nw = tl.load(norm_w_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
    return _round_to(_round_to(x * rstd, DTYPE) * nw, DTYPE)


@triton.jit
def _finish(y, y_up, col, col_mask, out_offsets, res_offsets, out_mask, out_ptr, bias_ptr, res_ptr,
            DTYPE: tl.constexpr, BIAS: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr):
    """The epilogue, rounding where the unfused model stores an intermediate: + bias (into the float32 sum, as
    F.linear adds it), silu(gate) * up, + residual; then the store."""
    if BIAS:
        y = y + tl.load(bias_ptr + col, mask=col_mask, other=0.0).to(tl.float32)
    if GATED:
        gate = _round_to(y, DTYPE)
        y = _round_to(gate * tl.sigmoid(gate), DTYPE) * _round_to(y_up, DTYPE)
    if RESIDUAL:
        y = _round_to(y, DTYPE) + tl.load(res_ptr + res_offsets, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_offsets, y.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _weight_tile(w_rows, up_rows, kk, K, EVEN_K: tl.constexpr, GATED: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at columns kk (and, gated, the up rows' tile; else w again)."""
    w = _load_k(w_rows + kk[None, :], (kk < K)[None, :], EVEN_K)
    w_up = w
    if GATED:
        w_up = _load_k(up_rows + kk[None, :], (kk < K)[None, :], EVEN_K)
    return w, w_up


@triton.jit
def _one_row_step(acc, acc_up, w, w_up, x_ptr, norm_w_ptr, kk, K, rstd,
                  EVEN_K: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, DTYPE: tl.constexpr):
    """One K tile of the one-row product, elementwise into the float32 [BLOCK_N, BLOCK_K] accumulators."""
    x = _load_k(x_ptr + kk, kk < K, EVEN_K).to(tl.float32)
    if NORM:
        x = _normalize(x, rstd, norm_w_ptr, kk, K, EVEN_K, DTYPE)
    acc += w.to(tl.float32) * x[None, :]
    if GATED:
        acc_up += w_up.to(tl.float32) * x[None, :]
    return acc, acc_up


@triton.jit
def _small_batch_linear_kernel(x_ptr, w_ptr, out_ptr, norm_w_ptr, bias_ptr, res_ptr,
                               M, N, K, stride_xm, stride_wn, stride_om, stride_rm, up_offset, eps,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               EVEN_K: tl.constexpr, ONE_ROW: tl.constexpr, FP32: tl.constexpr,
                               NORM: tl.constexpr, BIAS: tl.constexpr, GATED: tl.constexpr,
                               RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr):
    release_dependents(USE_PDL)
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    w_rows = w_ptr + tl.where(n_mask, n, 0).to(tl.int64)[:, None] * stride_wn  # in bounds for every n
    # GATED: the weight is [gate; up], 2N rows; this program also streams the up rows of its columns.
    up_rows = w_rows + up_offset
    k = tl.arange(0, BLOCK_K)
    if ONE_ROW:
        # The first K tile of the weight is loaded before waiting for the previous kernels (with dependent launch
        # the launcher takes this path only for a weight no running kernel writes), so that this projection's
        # weight stream starts under them. The peeled tile costs registers (40 -> 48 for q/k/v) but measured no
        # slower with dependent launch off.
        w, w_up = _weight_tile(w_rows, up_rows, k, K, EVEN_K, GATED)
        wait_for_producers(USE_PDL)
        rstd = 1.0
        if NORM:
            squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                x = _load_k(x_ptr + k0 + k, k0 + k < K, EVEN_K).to(tl.float32)
                squares += x * x
            rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc, acc_up = _one_row_step(acc, acc_up, w, w_up, x_ptr, norm_w_ptr, k, K, rstd, EVEN_K, NORM, GATED, dtype)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            w, w_up = _weight_tile(w_rows, up_rows, k0 + k, K, EVEN_K, GATED)
            acc, acc_up = _one_row_step(acc, acc_up, w, w_up, x_ptr, norm_w_ptr, k0 + k, K, rstd, EVEN_K, NORM,
                                        GATED, dtype)
        y = tl.sum(acc, axis=1)
        y_up = tl.sum(acc_up, axis=1)
        _finish(y, y_up, n, n_mask, n, n, n_mask, out_ptr, bias_ptr, res_ptr, dtype, BIAS, GATED, RESIDUAL)
    else:
        wait_for_producers(USE_PDL)
        m = tl.arange(0, BLOCK_M)
        m_mask = m < M
        x_rows = x_ptr + tl.where(m_mask, m, 0).to(tl.int64)[:, None] * stride_xm
        rstd = tl.full((BLOCK_M, 1), 1.0, dtype=tl.float32)
        if NORM:
            squares = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                x = _load_x(x_rows + (k0 + k)[None, :], (k0 + k)[None, :], m_mask[:, None], K, EVEN_K)
                squares += x * x
            rstd = tl.rsqrt(tl.sum(squares, axis=1) / K + eps)[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + k
            w = _load_k(w_rows + kk[None, :], (kk < K)[None, :], EVEN_K)
            if NORM:
                x = _load_x(x_rows + kk[None, :], kk[None, :], m_mask[:, None], K, EVEN_K)
                x = _normalize(x, rstd, norm_w_ptr, kk[None, :], K, EVEN_K, dtype).to(dtype)
            elif EVEN_K:
                x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None], other=0.0)
            else:
                x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & (kk < K)[None, :], other=0.0)
            if FP32:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
            if GATED:
                w_up = _load_k(up_rows + kk[None, :], (kk < K)[None, :], EVEN_K)
                if FP32:
                    acc_up += tl.dot(x, tl.trans(w_up), input_precision="ieee")
                else:
                    acc_up += tl.dot(x, tl.trans(w_up))
        out_offsets = m.to(tl.int64)[:, None] * stride_om + n[None, :]
        res_offsets = m.to(tl.int64)[:, None] * stride_rm + n[None, :]
        _finish(acc, acc_up, n[None, :], n_mask[None, :], out_offsets, res_offsets,
                m_mask[:, None] & n_mask[None, :], out_ptr, bias_ptr, res_ptr, dtype, BIAS, GATED, RESIDUAL)


def launch_config(rows: int, n: int, k: int, gated: bool = False, norm: bool = False) -> dict:
    """Tiling of one launch, from shapes only (measured on the H200 for the 1B model's projections, fused as the
    model runs them: scripts/bench_linear_configs.py). n: output columns; gated: each column streams two weight
    rows (gate and up); norm: the RMSNorm prologue."""
    weight_rows = 2 * n if gated else n
    if rows == 1:
        # Two columns per program (enough programs to hide the memory latency); gated, eight columns (sixteen
        # weight rows) over shorter K tiles measured fastest.
        block_n, block_k, warps, stages = (8, 512, 4, 3) if gated else (2, 1024, 4, 3)
    elif gated or (norm and weight_rows <= 4096):
        # The prologue's pass over x is paid per program: fewer, wider programs.
        block_n, block_k, warps, stages = 32, 256, 4, 3
    elif weight_rows <= 4096:
        block_n, block_k, warps, stages = 16, 512, 4, 3
    else:
        block_n, block_k, warps, stages = 64, 128, 4, 4
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    return dict(block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages,
                even_k=k % block_k == 0, one_row=rows == 1)


def _check_inputs(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"small_batch_linear: x must be [M, K] and weight [N, K] with the same K, got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"small_batch_linear: x has {x.shape[0]} rows, at most {MAX_ROWS} expected")
    if x.dtype not in (*HALF_DTYPES, torch.float32):
        raise ValueError(f"small_batch_linear: x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dtype != weight.dtype or x.device != weight.device:
        raise ValueError(f"small_batch_linear: x ({x.dtype}, {x.device}) and weight ({weight.dtype}, "
                         f"{weight.device}) must share dtype and device")


def small_batch_linear_triton(x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
                              eps: float = 0.0, bias: torch.Tensor | None = None,
                              residual: torch.Tensor | None = None, gated: bool = False,
                              config: dict | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) @ weight [N, K].T through the Triton kernel; float16, bfloat16 or float32.
    Returns [M, N] in x's dtype (with gated, [M, N / 2]); the optional parts are those of
    `fused_linear_reference`. config: a `launch_config` dict to use instead of the shape's own (benchmarks).
    With dependent launch (one row, Hopper) the kernel reads the start of a contiguous weight before the kernels
    queued ahead of it finish: no kernel still running may write the weight (a model's weights never change
    during a step)."""
    _check_inputs(x, weight)
    _check_fused(x, weight, norm_weight, bias, residual, gated)
    rows, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    # The kernel reads all of them with unit stride along the last dimension. A weight copied here is written by
    # the kernel just before this one: that launch does not read it early (no dependent launch).
    weight_in_place = weight.is_contiguous()
    x, weight = x.contiguous(), weight.contiguous()
    norm_weight = None if norm_weight is None else norm_weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    residual = None if residual is None else residual.contiguous()
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out
    if k == 0:
        # Every product is 0: the epilogue alone.
        return fused_linear_reference(x, weight, norm_weight=norm_weight, eps=eps, bias=bias, residual=residual,
                                      gated=gated)
    config = config or launch_config(rows, n, k, gated=gated, norm=norm_weight is not None)
    _small_batch_linear_kernel[(triton.cdiv(n, config["block_n"]),)](
        x, weight, out, x if norm_weight is None else norm_weight, x if bias is None else bias,
        x if residual is None else residual,
        rows, n, k, x.stride(0), weight.stride(0), out.stride(0), 0 if residual is None else residual.stride(0),
        n * weight.stride(0), float(eps),
        BLOCK_M=16, BLOCK_N=config["block_n"], BLOCK_K=config["block_k"], EVEN_K=config["even_k"],
        ONE_ROW=config["one_row"], FP32=x.dtype == torch.float32, NORM=norm_weight is not None,
        BIAS=bias is not None, GATED=gated, RESIDUAL=residual is not None,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
        # The tl.dot path launches in stream order: with dependent launch a verify step measured 30 % slower.
        **dependent_launch.launch_options(x.device, dependent=config["one_row"] and weight_in_place))
    return out


def fused_linear_reference(x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
                           eps: float = 0.0, bias: torch.Tensor | None = None,
                           residual: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """The unfused math of one fused projection, as the model computes it (every intermediate in x's dtype):

        h = rms_norm(x) * norm_weight      (when norm_weight [K] is given; eps: the norm's epsilon)
        y = h @ weight.T (+ bias [N])
        y = silu(y[:, :N/2]) * y[:, N/2:]  (gated: weight is [gate; up], 2 * N/2 rows)
        y = residual + y                   (residual [M, N or N/2])

    x [M, K] float; weight [N, K]. Returns [M, N] (gated: [M, N/2]) in x's dtype.
    """
    if norm_weight is not None:
        x32 = x.float() if x.dtype in HALF_DTYPES else x
        x = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * norm_weight
    y = torch.nn.functional.linear(x, weight, bias)
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    return y if residual is None else residual + y


def _check_fused(x, weight, norm_weight, bias, residual, gated) -> None:
    rows, k = x.shape
    n = weight.shape[0]
    if gated and n % 2:
        raise ValueError(f"fused linear: a gated weight stacks gate and up rows, an even count expected, got {n}")
    n_out = n // 2 if gated else n
    for name, t, shape in (("norm_weight", norm_weight, (k,)), ("bias", bias, (n,)),
                           ("residual", residual, (rows, n_out))):
        if t is None:
            continue
        if tuple(t.shape) != shape:
            raise ValueError(f"fused linear: {name} must have shape {list(shape)}, got {list(t.shape)}")
        if t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"fused linear: {name} ({t.dtype}, {t.device}) must share x's dtype and device "
                             f"({x.dtype}, {x.device})")
    if gated and bias is not None:
        raise ValueError("fused linear: a gated projection takes no bias")


@torch.library.custom_op("specdec_models::small_batch_linear", mutates_args=())
def small_batch_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T: the Triton kernel on CUDA, F.linear elsewhere (arguments as
    `small_batch_linear_triton`)."""
    if x.device.type != "cuda":
        _check_inputs(x, weight)
        return torch.nn.functional.linear(x, weight)
    return small_batch_linear_triton(x, weight)


@small_batch_linear.register_fake
def _small_batch_linear_fake(x, weight):
    _check_inputs(x, weight)
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("specdec_models::small_batch_linear_fused", mutates_args=())
def small_batch_linear_fused(x: torch.Tensor, weight: torch.Tensor, norm_weight: Optional[torch.Tensor],
                             eps: float, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
                             gated: bool) -> torch.Tensor:
    """One projection with its neighbours fused (arguments as `fused_linear_reference`): the Triton kernel on
    CUDA, the reference math elsewhere."""
    if x.device.type != "cuda":
        _check_inputs(x, weight)
        _check_fused(x, weight, norm_weight, bias, residual, gated)
        # Contiguous, as the fake says (residual + y would take a strided residual's layout).
        return fused_linear_reference(x, weight, norm_weight=norm_weight, eps=eps, bias=bias, residual=residual,
                                      gated=gated).contiguous()
    return small_batch_linear_triton(x, weight, norm_weight=norm_weight, eps=eps, bias=bias, residual=residual,
                                     gated=gated)


@small_batch_linear_fused.register_fake
def _small_batch_linear_fused_fake(x, weight, norm_weight, eps, bias, residual, gated):
    _check_inputs(x, weight)
    _check_fused(x, weight, norm_weight, bias, residual, gated)
    return x.new_empty((x.shape[0], weight.shape[0] // 2 if gated else weight.shape[0]))


def takes_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` runs the Triton kernel for x (a float16/bfloat16 CUDA tensor of 1 to MAX_ROWS rows)."""
    return (x.device.type == "cuda" and x.dtype in HALF_DTYPES and weight.dtype == x.dtype and x.dim() == 2
            and 0 < x.shape[0] <= MAX_ROWS)


def fused_linear(x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
                 eps: float = 0.0, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                 gated: bool = False) -> torch.Tensor:
    """`fused_linear_reference`'s math (arguments as there): one Triton kernel when `takes_kernel`, the unfused
    math otherwise."""
    if takes_kernel(x, weight):
        return torch.ops.specdec_models.small_batch_linear_fused(x, weight, norm_weight, eps, bias, residual,
                                                                 gated)
    return fused_linear_reference(x, weight, norm_weight=norm_weight, eps=eps, bias=bias, residual=residual,
                                  gated=gated)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias [N]) in x's dtype: the Triton kernel for 1 to MAX_ROWS rows of a
    float16/bfloat16 CUDA tensor, F.linear otherwise."""
    if takes_kernel(x, weight):
        out = torch.ops.specdec_models.small_batch_linear(x, weight)
        return out if bias is None else out + bias
    return torch.nn.functional.linear(x, weight, bias)

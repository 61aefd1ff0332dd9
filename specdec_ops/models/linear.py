"""The model's projections for few tokens: a Triton matrix-vector kernel that streams the weight at close to the
memory bandwidth, where cuBLAS's kernels for one to sixteen rows fall short on the small matrices of a 1B model.

``out = x @ weight.T`` for x [M, K] and weight [N, K], accumulated in float32 and rounded once to x's dtype.

- `small_batch_linear_triton`: the kernel, on any device Triton runs on (CPU through the interpreter). One program
  owns BLOCK_N output columns and streams their weight rows over K once. With one row (a batch-1 decode step) it
  multiplies and accumulates elementwise in a [BLOCK_N, BLOCK_K] float32 tile and reduces once at the end (four
  columns per program: enough programs to fill the GPU even for N = 2048); with 2 to 16 rows it runs one
  tl.dot of the rows (padded to 16) against each weight tile.
- `torch.ops.specdec_models.small_batch_linear`: the op models call; a `torch.library.triton_op`, so
  torch.compile(fullgraph=True) traces into the kernel and CUDA graphs capture it. Off CUDA it is F.linear.
- `linear`: what the model calls for every projection: the op for 1 to MAX_ROWS rows of a float16/bfloat16
  CUDA tensor, F.linear otherwise (float32 models keep cuBLAS, whose results the CUDA tests compare exactly).

On the H200 (torch 2.11, bf16, weights not in L2, 2026-12-01), per projection of the Llama-3.2-1B shape at one
row: 3072x2048 5.2 us (cuBLAS 6.4), 2048x2048 4.3 (6.1), 16384x2048 17.2 (18.0), 2048x8192 10.5 (14.4, plus
cuBLAS's split-K reduction kernel), 128256x2048 115 (122); at five rows it equals cuBLAS and saves the split-K
reduction (scripts/bench_model.py measures the model).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

# Rows up to which `linear` takes the Triton kernel (the dot path pads the rows to 16).
MAX_ROWS = 16
HALF_DTYPES = (torch.float16, torch.bfloat16)


@triton.jit
def _round_to(v, dtype: tl.constexpr):
    """v (float32) rounded to dtype and back: what storing an intermediate in the model dtype does."""
    return v.to(dtype).to(tl.float32)


@triton.jit
def _load_tile(rows_ptr, kk, K, EVEN_K: tl.constexpr):
    """Elements kk (a [1, BLOCK_K] or [BLOCK_K] range) of the rows at rows_ptr, zero past K."""
    if EVEN_K:
        return tl.load(rows_ptr + kk)
    return tl.load(rows_ptr + kk, mask=kk < K, other=0.0)


@triton.jit
def _load_rows(rows_ptr, kk, row_mask, K, EVEN_K: tl.constexpr):
    """As `_load_tile`, reading only the rows of row_mask ([BLOCK_M, 1]), zero elsewhere."""
    if EVEN_K:
        return tl.load(rows_ptr + kk, mask=row_mask, other=0.0)
    return tl.load(rows_ptr + kk, mask=row_mask & (kk < K), other=0.0)


@triton.jit
def _norm_weight(norm_w_ptr, kk, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(norm_w_ptr + kk).to(tl.float32)
    return tl.load(norm_w_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)


@triton.jit
def _finish(y, y_up, col, col_mask, out_offsets, res_offsets, out_mask, out_ptr, bias_ptr, res_ptr,
            DTYPE: tl.constexpr, BIAS: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr):
    """The epilogue, rounding where the unfused model stores an intermediate: + bias, silu(gate) * up,
    + residual; then the store."""
    if BIAS:
        y = _round_to(y, DTYPE) + tl.load(bias_ptr + col, mask=col_mask, other=0.0).to(tl.float32)
    if GATED:
        gate = _round_to(y, DTYPE)
        y = _round_to(gate * tl.sigmoid(gate), DTYPE) * _round_to(y_up, DTYPE)
    if RESIDUAL:
        y = _round_to(y, DTYPE) + tl.load(res_ptr + res_offsets, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_offsets, y.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _small_batch_linear_kernel(x_ptr, w_ptr, out_ptr, norm_w_ptr, bias_ptr, res_ptr,
                               M, N, K, stride_xm, stride_wn, stride_om, stride_rm, up_offset, eps,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               EVEN_K: tl.constexpr, PATH: tl.constexpr, FP32: tl.constexpr,
                               NORM: tl.constexpr, BIAS: tl.constexpr, GATED: tl.constexpr,
                               RESIDUAL: tl.constexpr):
    # PATH 0: one row, elementwise products in a [BLOCK_N, BLOCK_K] tile, one reduction at the end.
    # PATH 1: rows padded to BLOCK_M = 16, one tl.dot per weight tile.
    # PATH 2: a few rows (BLOCK_M >= M, a power of two), elementwise products in a [BLOCK_M, BLOCK_N, BLOCK_K] tile.
    # NORM: the row's RMSNorm in one pass: x * norm_weight feeds the products while the sum of squares
    # accumulates; the statistic scales the accumulator at the end (a row scale commutes with the product).
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    w_rows = w_ptr + tl.where(n_mask, n, 0).to(tl.int64)[:, None] * stride_wn  # in bounds for every n
    # GATED: the weight is [gate; up], 2N rows; this program also streams the up rows of its columns.
    up_rows = w_rows + up_offset
    k = tl.arange(0, BLOCK_K)
    if PATH == 0:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + k
            w = _load_tile(w_rows, kk[None, :], K, EVEN_K)
            x = _load_tile(x_ptr, kk, K, EVEN_K).to(tl.float32)
            if NORM:
                squares += x * x
                x = x * _norm_weight(norm_w_ptr, kk, K, EVEN_K)
            acc += w.to(tl.float32) * x[None, :]
            if GATED:
                acc_up += _load_tile(up_rows, kk[None, :], K, EVEN_K).to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1)
        y_up = tl.sum(acc_up, axis=1)
        if NORM:
            # eps arrives as float64 from inductor: the statistic stays float32.
            rstd = tl.rsqrt((tl.sum(squares, axis=0) / K + eps).to(tl.float32))
            y = y * rstd
            y_up = y_up * rstd
        _finish(y, y_up, n, n_mask, n, n, n_mask, out_ptr, bias_ptr, res_ptr, dtype, BIAS, GATED, RESIDUAL)
    else:
        m = tl.arange(0, BLOCK_M)
        m_mask = m < M
        x_rows = x_ptr + tl.where(m_mask, m, 0).to(tl.int64)[:, None] * stride_xm
        squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if PATH == 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        else:
            acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
            acc3_up = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + k
            w = _load_tile(w_rows, kk[None, :], K, EVEN_K)
            x = _load_rows(x_rows, kk[None, :], m_mask[:, None], K, EVEN_K)
            if NORM:
                x = x.to(tl.float32)
                squares += tl.sum(x * x, axis=1)
                x = x * _norm_weight(norm_w_ptr, kk, K, EVEN_K)[None, :]
            if GATED:
                w_up = _load_tile(up_rows, kk[None, :], K, EVEN_K)
            if PATH == 1:
                x = x.to(dtype)
                if FP32:
                    acc += tl.dot(x, tl.trans(w), input_precision="ieee")
                    if GATED:
                        acc_up += tl.dot(x, tl.trans(w_up), input_precision="ieee")
                else:
                    acc += tl.dot(x, tl.trans(w))
                    if GATED:
                        acc_up += tl.dot(x, tl.trans(w_up))
            else:
                x3 = x.to(tl.float32)[:, None, :]
                acc3 += w.to(tl.float32)[None, :, :] * x3
                if GATED:
                    acc3_up += w_up.to(tl.float32)[None, :, :] * x3
        if PATH == 2:
            acc = tl.sum(acc3, axis=2)
            acc_up = tl.sum(acc3_up, axis=2)
        if NORM:
            rstd = tl.rsqrt((squares / K + eps).to(tl.float32))[:, None]
            acc = acc * rstd
            acc_up = acc_up * rstd
        out_offsets = m.to(tl.int64)[:, None] * stride_om + n[None, :]
        res_offsets = m.to(tl.int64)[:, None] * stride_rm + n[None, :]
        _finish(acc, acc_up, n[None, :], n_mask[None, :], out_offsets, res_offsets,
                m_mask[:, None] & n_mask[None, :], out_ptr, bias_ptr, res_ptr, dtype, BIAS, GATED, RESIDUAL)


def launch_config(rows: int, n: int, k: int, gated: bool = False) -> dict:
    """Tiling of one launch, from shapes only (measured on the H200 for the 1B model's projections, fused as the
    model runs them; scripts/bench_linear_configs.py). n: output columns; gated: each column streams two weight
    rows (gate and up). path: 0 one row, 1 tl.dot (rows padded to 16), 2 elementwise over a few rows."""
    weight_rows = 2 * n if gated else n
    if rows == 1:
        # Two columns (four weight rows when gated) per program: more programs in flight measured fastest.
        block_n, block_k, warps, stages, path = 2, 1024, 4, 3, 0
    elif gated:
        block_n, block_k, warps, stages, path = 32, 256, 4, 3, 1
    elif weight_rows <= 4096 and k >= 4096:
        # Few programs (one per 16 columns) over a long K: a deeper pipeline keeps more of the weight in flight.
        block_n, block_k, warps, stages, path = 16, 512, 4, 4, 1
    elif weight_rows <= 4096:
        block_n, block_k, warps, stages, path = 16, 512, 4, 3, 1
    else:
        block_n, block_k, warps, stages, path = 64, 128, 4, 4, 1
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    return dict(block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages,
                even_k=k % block_k == 0, path=path)


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
    `fused_linear_reference`. config: a `launch_config` dict to use instead of the shape's own (benchmarks)."""
    _check_inputs(x, weight)
    _check_fused(x, weight, norm_weight, bias, residual, gated)
    rows, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    # The kernel reads all of them with unit stride along the last dimension.
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
    config = config or launch_config(rows, n, k, gated=gated)
    wrap_triton(_small_batch_linear_kernel)[(triton.cdiv(n, config["block_n"]),)](
        x, weight, out, x if norm_weight is None else norm_weight, x if bias is None else bias,
        x if residual is None else residual,
        rows, n, k, x.stride(0), weight.stride(0), out.stride(0), 0 if residual is None else residual.stride(0),
        n * weight.stride(0), float(eps),
        BLOCK_M=16 if config["path"] == 1 else triton.next_power_of_2(rows), BLOCK_N=config["block_n"],
        BLOCK_K=config["block_k"], EVEN_K=config["even_k"], PATH=config["path"], FP32=x.dtype == torch.float32, NORM=norm_weight is not None,
        BIAS=bias is not None, GATED=gated, RESIDUAL=residual is not None,
        num_warps=config["num_warps"], num_stages=config["num_stages"])
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


@triton_op("specdec_models::small_batch_linear", mutates_args=())
def small_batch_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T: the Triton kernel on CUDA, F.linear elsewhere (arguments as
    `small_batch_linear_triton`)."""
    if x.device.type != "cuda":
        _check_inputs(x, weight)
        return torch.nn.functional.linear(x, weight)
    return small_batch_linear_triton(x, weight)


@triton_op("specdec_models::small_batch_linear_fused", mutates_args=())
def small_batch_linear_fused(x: torch.Tensor, weight: torch.Tensor, norm_weight: Optional[torch.Tensor],
                             eps: float, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
                             gated: bool) -> torch.Tensor:
    """One projection with its neighbours fused (arguments as `fused_linear_reference`): the Triton kernel on
    CUDA, the reference math elsewhere."""
    if x.device.type != "cuda":
        _check_inputs(x, weight)
        _check_fused(x, weight, norm_weight, bias, residual, gated)
        return fused_linear_reference(x, weight, norm_weight=norm_weight, eps=eps, bias=bias, residual=residual,
                                      gated=gated)
    return small_batch_linear_triton(x, weight, norm_weight=norm_weight, eps=eps, bias=bias, residual=residual,
                                     gated=gated)


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

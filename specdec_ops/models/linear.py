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

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

# Rows up to which `linear` takes the Triton kernel (the dot path pads the rows to 16).
MAX_ROWS = 16
HALF_DTYPES = (torch.float16, torch.bfloat16)


@triton.jit
def _small_batch_linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               EVEN_K: tl.constexpr, ONE_ROW: tl.constexpr, FP32: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    w_rows = w_ptr + tl.where(n_mask, n, 0).to(tl.int64)[:, None] * stride_wn  # in bounds for every n
    k = tl.arange(0, BLOCK_K)
    if ONE_ROW:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + k
            if EVEN_K:
                w = tl.load(w_rows + kk[None, :])
                x = tl.load(x_ptr + kk)
            else:
                w = tl.load(w_rows + kk[None, :], mask=(kk < K)[None, :], other=0.0)
                x = tl.load(x_ptr + kk, mask=kk < K, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        tl.store(out_ptr + n, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=n_mask)
    else:
        m = tl.arange(0, BLOCK_M)
        m_mask = m < M
        x_rows = x_ptr + tl.where(m_mask, m, 0).to(tl.int64)[:, None] * stride_xm
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + k
            if EVEN_K:
                w = tl.load(w_rows + kk[None, :])
                x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None], other=0.0)
            else:
                w = tl.load(w_rows + kk[None, :], mask=(kk < K)[None, :], other=0.0)
                x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & (kk < K)[None, :], other=0.0)
            if FP32:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        offsets = m.to(tl.int64)[:, None] * stride_om + n[None, :]
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def launch_config(rows: int, n: int, k: int) -> dict:
    """Tiling of one launch, from shapes only (measured on the H200 for the 1B model's projections)."""
    if rows == 1:
        block_n, block_k, warps, stages = 4, 1024, 4, 3
    elif n <= 4096:
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


def small_batch_linear_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) @ weight [N, K].T through the Triton kernel; float16, bfloat16 or float32.
    Returns [M, N] in x's dtype."""
    _check_inputs(x, weight)
    rows, k = x.shape
    n = weight.shape[0]
    # The kernel reads both with unit stride along K.
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    config = launch_config(rows, n, k)
    wrap_triton(_small_batch_linear_kernel)[(triton.cdiv(n, config["block_n"]),)](
        x, weight, out, rows, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=16, BLOCK_N=config["block_n"], BLOCK_K=config["block_k"], EVEN_K=config["even_k"],
        ONE_ROW=config["one_row"], FP32=x.dtype == torch.float32, num_warps=config["num_warps"], num_stages=config["num_stages"])
    return out


@triton_op("specdec_models::small_batch_linear", mutates_args=())
def small_batch_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T: the Triton kernel on CUDA, F.linear elsewhere (arguments as
    `small_batch_linear_triton`)."""
    if x.device.type != "cuda":
        _check_inputs(x, weight)
        return torch.nn.functional.linear(x, weight)
    return small_batch_linear_triton(x, weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias [N]) in x's dtype: the Triton kernel for 1 to MAX_ROWS rows of a
    float16/bfloat16 CUDA tensor, F.linear otherwise."""
    if (x.device.type == "cuda" and x.dtype in HALF_DTYPES and weight.dtype == x.dtype and x.dim() == 2
            and 0 < x.shape[0] <= MAX_ROWS):
        out = torch.ops.specdec_models.small_batch_linear(x, weight)
        return out if bias is None else out + bias
    return torch.nn.functional.linear(x, weight, bias)

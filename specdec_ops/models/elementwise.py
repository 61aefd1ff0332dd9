"""The elementwise work of a decoder layer over many tokens (a prompt prefill, or a round's verify or decode step
of more than 16 tokens): RMSNorm with the residual add before it, and silu(gate) * up, one Triton kernel each.

With more than `linear.MAX_ROWS` tokens a half-precision CUDA layer's projections are cuBLAS GEMMs. Between them
the plain PyTorch layer runs every norm as eight elementwise kernels (float32 copy, square, mean, + eps, rsqrt,
product, rounding, weight), each residual add and the silu and the product of the MLP as one kernel each. Here:

- `rms_norm`: ``rms_norm(x) * weight`` of each row, in one kernel.
- `add_rms_norm`: ``s = x + residual`` (rounded to x's dtype, as the plain code's ``x = x + ...`` stores it),
  then ``(rms_norm(s) * weight, s)``: the residual add after attention, and after the MLP (folded into the
  next layer's input norm, or into the final norm), costs no kernel of its own.
- `silu_mul`: ``silu(gate) * up`` of the [gate | up] output of the gate_up projection.

Both kernels round where the plain code stores an intermediate in the model dtype (the `*_reference` functions
are that code). The norm computes in float32 as `llama.RMSNorm` does; its sum of squares runs in another order,
so results may differ from the reference by one rounding of the model dtype now and then. silu on CUDA computes
PyTorch's CUDA formula, ``x / (1 + expf(-x))`` in float32, with libdevice's expf (the CUDA math library's) and a
correctly rounded division, so that it rounds as PyTorch does; the interpreter has numpy's exp instead.

`torch.ops.specdec_models.rms_norm`, `.add_rms_norm` and `.silu_mul` are `torch.library.custom_op`s with fake
kernels (torch.compile(fullgraph=True) traces each as one node, and CUDA graphs capture the launch): the Triton
kernels on CUDA for float32/float16/bfloat16, the references elsewhere. Each program waits for the kernel before
it (dependent launch on Hopper, dependent_launch.py), like the rotary + KV-write kernel it runs beside.

`runs_elementwise_kernels(x)` is where the model decides to run these (and, with a paged cache of the model's
dtype, `attention.rope_write_kv` for the rotary and the cache write) instead of the plain code: a float16/bfloat16
CUDA forward of more than `linear.MAX_ROWS` tokens, eager or compiled. Compiled, they are faster than inductor's
own fusion of the plain code: the 1B-shaped target's decode step at batch 32, context 4096, took 2.264 ms against
2.371, its verify step at batch 8 1.181 ms against 1.331 (H200, 2026-12-02, benchmarks/RESULTS.md). Fewer tokens
take `linear.py`'s fused projections; CPU, float32 and float64 models keep the plain code.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import dependent_launch
# What the kernels take (they compute in float32), as the attention kernel; other dtypes run the references.
from .attention import KERNEL_DTYPES
from .dependent_launch import release_and_wait
from .linear import HALF_DTYPES, MAX_ROWS

# silu_mul's columns per program.
SILU_MUL_BLOCK = 1024


def runs_elementwise_kernels(x: torch.Tensor) -> bool:
    """Whether a model forward whose hidden states are x [T, hidden] runs its norms, residual adds and
    silu(gate) * up through these kernels and its rotary + cache write through `attention.rope_write_kv`: a
    float16/bfloat16 CUDA tensor of more than MAX_ROWS rows (1 to MAX_ROWS rows take `linear.takes_kernel`'s
    fused projections), in an eager forward (the prompt prefill, which runs as a captured graph of the eager code)
    or a compiled one (the rounds' verify and decode steps of more than MAX_ROWS tokens)."""
    return x.device.type == "cuda" and x.dtype in HALF_DTYPES and x.dim() == 2 and x.shape[0] > MAX_ROWS


# --- RMSNorm ----------------------------------------------------------------------------------------------------


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as `llama.RMSNorm` computes it: x [T, H] float, weight [H] of x's dtype, eps the epsilon.
    Half dtypes compute in float32: ``x32 * rsqrt(mean(x32 ** 2) + eps)``, rounded to x's dtype, then times the
    weight in x's dtype. Returns [T, H] in x's dtype."""
    x32 = x.float() if x.dtype in HALF_DTYPES else x
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return x32.to(x.dtype) * weight


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the norm after it: x, residual [T, H] of one float dtype, weight [H], eps as
    `rms_norm_reference`. Returns (rms_norm_reference(s, weight, eps), s) with s = x + residual in x's dtype."""
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed


def _check_norm_inputs(name: str, x, weight, residual=None) -> None:
    """The norm ops' argument checks (every path): a ValueError naming the argument and what was expected."""
    if x.dim() != 2:
        raise ValueError(f"{name}: x must be [T, H], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name}: x must be a floating tensor, got {x.dtype}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"{name}: weight must be [{x.shape[1]}] (x's H), got {tuple(weight.shape)}")
    tensors = [("weight", weight)]
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"{name}: residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
        tensors.append(("residual", residual))
    for arg, t in tensors:
        if t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"{name}: {arg} ({t.dtype}, {t.device}) must share x's dtype and device "
                             f"({x.dtype}, {x.device})")


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, size, stride_x, stride_residual,
                     stride_out, stride_sum, eps,
                     BLOCK: tl.constexpr, RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr):
    # One program per row, the whole row in registers (BLOCK >= size, masked).
    release_and_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if RESIDUAL:
        r = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded once, as the plain x + residual
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / size + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    normed = (x32 * rstd).to(x.dtype)
    tl.store(out_ptr + row * stride_out + cols, (normed.to(tl.float32) * w.to(tl.float32)).to(x.dtype), mask=mask)


def _launch_rms_norm(x, residual, weight, eps):
    x, weight = x.contiguous(), weight.contiguous()
    residual = None if residual is None else residual.contiguous()
    tokens, size = x.shape
    out = torch.empty_like(x)
    if tokens == 0 or size == 0:
        return out, None if residual is None else x + residual  # empty: nothing to launch
    summed = None if residual is None else torch.empty_like(x)
    block = max(16, triton.next_power_of_2(size))
    _rms_norm_kernel[(tokens,)](
        x, x if residual is None else residual, weight, out, out if summed is None else summed, size,
        x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0),
        0 if summed is None else summed.stride(0), float(eps),
        BLOCK=block, RESIDUAL=residual is not None,
        # The Triton layer-norm tutorial's choice: one warp per 256 entries of the row, 1 to 8.
        num_warps=min(max(block // 256, 1), 8), **dependent_launch.launch_options(x.device))
    return out, summed


def _check_kernel_dtype(name: str, x) -> None:
    if x.dtype not in KERNEL_DTYPES:
        raise ValueError(f"{name}: the Triton kernel takes float32, float16 or bfloat16, got {x.dtype}")


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_reference` in one Triton kernel (arguments as there; x float32, float16 or bfloat16), on any
    device Triton runs on (CPU through the interpreter). Returns [T, H] contiguous, in x's dtype."""
    _check_norm_inputs("rms_norm", x, weight)
    _check_kernel_dtype("rms_norm", x)
    return _launch_rms_norm(x, None, weight, eps)[0]


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm_reference` in one Triton kernel (arguments as there; float32, float16 or bfloat16).
    Returns (normed, x + residual), both [T, H] contiguous in x's dtype."""
    _check_norm_inputs("add_rms_norm", x, weight, residual)
    _check_kernel_dtype("add_rms_norm", x)
    return _launch_rms_norm(x, residual, weight, eps)


@torch.library.custom_op("specdec_models::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row (arguments as `rms_norm_reference`): the Triton kernel on CUDA, the reference
    elsewhere. Returns [T, H] contiguous."""
    _check_norm_inputs("rms_norm", x, weight)
    if x.device.type != "cuda" or x.dtype not in KERNEL_DTYPES:
        return rms_norm_reference(x, weight, eps).contiguous()  # contiguous, as the fake says
    return rms_norm_triton(x, weight, eps)


@rms_norm.register_fake
def _rms_norm_fake(x, weight, eps):
    _check_norm_inputs("rms_norm", x, weight)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("specdec_models::add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the RMSNorm after it (arguments as `add_rms_norm_reference`): the Triton kernel on
    CUDA, the reference elsewhere. Returns (normed, x + residual), both [T, H] contiguous."""
    _check_norm_inputs("add_rms_norm", x, weight, residual)
    if x.device.type != "cuda" or x.dtype not in KERNEL_DTYPES:
        normed, summed = add_rms_norm_reference(x, residual, weight, eps)
        return normed.contiguous(), summed.contiguous()
    return add_rms_norm_triton(x, residual, weight, eps)


@add_rms_norm.register_fake
def _add_rms_norm_fake(x, residual, weight, eps):
    _check_norm_inputs("add_rms_norm", x, weight, residual)
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


# --- silu(gate) * up --------------------------------------------------------------------------------------------


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up as the plain MLP computes it: gate_up [T, 2 I] float (the gate_up projection's output,
    gate columns first); silu(gate) is rounded to gate_up's dtype, then the product again. Returns [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _check_silu_mul_inputs(gate_up) -> None:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul: gate_up must be [T, 2 * I] (gate columns, then up), got shape "
                         f"{tuple(gate_up.shape)}")
    if not gate_up.is_floating_point():
        raise ValueError(f"silu_mul: gate_up must be a floating tensor, got {gate_up.dtype}")


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, size, stride_in, stride_out,
                     BLOCK: tl.constexpr, LIBDEVICE_EXP: tl.constexpr, USE_PDL: tl.constexpr):
    # Program (row, j) writes columns [j * BLOCK, (j + 1) * BLOCK) of the row.
    release_and_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    src = gate_up_ptr + row * stride_in + cols
    gate = tl.load(src, mask=mask, other=0.0)
    up = tl.load(src + size, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # PyTorch's CUDA silu: x / (1 + expf(-x)) in float32, no fast math. tl.exp is the hardware's approximate
    # ex2; libdevice's expf is the CUDA math library's (the interpreter has no libdevice: numpy's exp there).
    if LIBDEVICE_EXP:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    silu = tl.math.div_rn(g, 1.0 + e).to(gate.dtype)
    tl.store(out_ptr + row * stride_out + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu_mul_reference` in one Triton kernel (gate_up float32, float16 or bfloat16), on any device Triton runs
    on. Returns [T, I] contiguous, in gate_up's dtype."""
    _check_silu_mul_inputs(gate_up)
    _check_kernel_dtype("silu_mul", gate_up)
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    tokens, size = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((tokens, size), dtype=gate_up.dtype, device=gate_up.device)
    if tokens == 0 or size == 0:
        return out
    block = min(SILU_MUL_BLOCK, max(16, triton.next_power_of_2(size)))
    _silu_mul_kernel[(tokens, triton.cdiv(size, block))](
        gate_up, out, size, gate_up.stride(0), out.stride(0),
        BLOCK=block, LIBDEVICE_EXP=gate_up.is_cuda, num_warps=4, **dependent_launch.launch_options(gate_up.device))
    return out


@torch.library.custom_op("specdec_models::silu_mul", mutates_args=())
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (arguments as `silu_mul_reference`): the Triton kernel on CUDA, the reference elsewhere.
    Returns [T, I] contiguous."""
    _check_silu_mul_inputs(gate_up)
    if gate_up.device.type != "cuda" or gate_up.dtype not in KERNEL_DTYPES:
        return silu_mul_reference(gate_up).contiguous()
    return silu_mul_triton(gate_up)


@silu_mul.register_fake
def _silu_mul_fake(gate_up):
    _check_silu_mul_inputs(gate_up)
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))

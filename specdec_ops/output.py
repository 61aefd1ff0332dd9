"""`specdec::create_output`: formats verified tokens into the [B, k+1] layout.

Given per-position accept decisions for k draft tokens, row b of the output is

- columns ``j < first_rejected``: ``draft_token_ids[b, j]`` (the accepted
  prefix; a True in ``accepted`` after the first False is ignored),
- column ``first_rejected`` (when < k): ``substitute_token_ids[b, j]``, the
  token the verifier sampled in place of the first rejected draft token,
- every later column: -1,
- column k: ``bonus_token_ids[b]`` when all k were accepted and the last draft
  token is not -1, else -1.

where ``first_rejected`` is the first column whose ``accepted`` entry is zero
(k if none). This is the output every verification op in the library
produces, so they all feed the same bookkeeping.

Inputs: ``accepted`` [B, k] bool or any integer dtype (nonzero = accepted);
``substitute_token_ids`` and ``draft_token_ids`` [B, k] int32 or int64;
``bonus_token_ids`` [B, 1] or [B] int32 or int64, any row stride; k >= 1.
The [B, k] inputs need a unit stride in their last dimension. The output has
the dtype of ``draft_token_ids``.

The ``.counted`` overload also adds, in place and on the device, to an int64
``counters`` tensor of shape [3]: the number of nonzero entries of
``accepted`` (every position, as acceptance-rate statistics count them), the
number of output entries that are not -1 (tokens emitted), and ``B * k``
(draft tokens proposed). The CUDA kernel is one Triton launch either way,
made from C++ (csrc/create_output.cpp); counters are summed per program and
added atomically, so no host sync is needed.
"""
from __future__ import annotations

import torch

from . import _C
from ._checks import INDEX_DTYPES, INT_DTYPES, check_counters, check_size, check_tensor
from ._launch import CachedLaunch, expose_to_cpp
from ._library import register_fake
from ._triton import HAS_TRITON, tl, triton

_OP = "create_output"


def create_output(
    accepted: torch.Tensor,
    substitute_token_ids: torch.Tensor,
    draft_token_ids: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Formats verified tokens into [B, k+1]; see the module docstring.

    Pass ``counters`` (int64, shape [3]) to accumulate (accepted, emitted,
    proposed) token counts in place.
    """
    if torch.compiler.is_compiling():
        return _create_output_ops(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids, counters)
    return _C.eager_create_output(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids, counters)


# The wrapper's torch.ops call: what torch.compile traces, and the eager entry's fallback (csrc/eager_entry.cpp).
def _create_output_ops(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids, counters):
    if counters is None:
        return torch.ops.specdec.create_output.default(accepted, substitute_token_ids, draft_token_ids,
                                                       bonus_token_ids)
    return torch.ops.specdec.create_output.counted(
        accepted, substitute_token_ids, draft_token_ids, bonus_token_ids, counters
    )


_C.register_eager("create_output", _create_output_ops)


def create_output_reference(
    accepted: torch.Tensor,
    substitute_token_ids: torch.Tensor,
    draft_token_ids: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-PyTorch statement of the contract (several small ops; the kernels fuse them)."""
    batch, k = draft_token_ids.shape
    rejected = accepted == 0
    first_rejected = torch.where(rejected.any(1), rejected.int().argmax(1), k)
    cols = torch.arange(k, device=accepted.device)
    before = cols < first_rejected[:, None]
    at = cols == first_rejected[:, None]
    minus_one = torch.full_like(draft_token_ids, -1)
    head = torch.where(before, draft_token_ids, torch.where(at, substitute_token_ids.to(draft_token_ids.dtype),
                                                            minus_one))
    bonus = bonus_token_ids.reshape(batch).to(draft_token_ids.dtype)
    emit_bonus = (first_rejected == k) & (draft_token_ids[:, k - 1] != -1)
    tail = torch.where(emit_bonus, bonus, torch.full_like(bonus, -1))
    out = torch.cat([head, tail[:, None]], dim=1)
    if counters is not None:
        counters[0] += (accepted != 0).sum()
        counters[1] += (out != -1).sum()
        counters[2] += batch * k
    return out


def _check_inputs(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids, counters=None):
    device = draft_token_ids.device
    check_tensor(_OP, "draft_token_ids", draft_token_ids, ndim=2, dtypes=INT_DTYPES)
    check_tensor(_OP, "accepted", accepted, ndim=2, dtypes=INDEX_DTYPES, device=device)
    check_tensor(_OP, "substitute_token_ids", substitute_token_ids, ndim=2, dtypes=INT_DTYPES, device=device)
    check_tensor(_OP, "bonus_token_ids", bonus_token_ids, dtypes=INT_DTYPES, device=device, unit_stride=False)
    batch, k = draft_token_ids.shape
    if k < 1:
        raise ValueError(f"{_OP}: argument 'draft_token_ids' must have k >= 1 columns, got shape "
                         f"{tuple(draft_token_ids.shape)}")
    if not (bonus_token_ids.dim() == 1 or (bonus_token_ids.dim() == 2 and bonus_token_ids.shape[1] == 1)):
        raise ValueError(f"{_OP}: argument 'bonus_token_ids' must have shape [B, 1] or [B], got shape "
                         f"{tuple(bonus_token_ids.shape)}")
    for name, t in (("accepted", accepted), ("substitute_token_ids", substitute_token_ids)):
        check_size(_OP, name, t, 0, batch, "B, rows of draft_token_ids")
        check_size(_OP, name, t, 1, k, "k, columns of draft_token_ids")
    check_size(_OP, "bonus_token_ids", bonus_token_ids, 0, batch, "B, rows of draft_token_ids")
    if counters is not None:
        check_counters(_OP, counters, device)


@register_fake("create_output")
def _create_output_fake(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids):
    _check_inputs(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids)
    batch, k = draft_token_ids.shape
    return draft_token_ids.new_empty((batch, k + 1))


@register_fake("create_output.counted")
def _create_output_counted_fake(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids, counters):
    _check_inputs(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids, counters)
    batch, k = draft_token_ids.shape
    return draft_token_ids.new_empty((batch, k + 1))


# The geometry is set in csrc/triton_launch.h, whose C++ launcher is the CUDA kernel of the op.
_GEOMETRY = _C._launch_geometry()["create_output"]

if HAS_TRITON:

    @triton.jit
    def add_counters_tl(counters_ptr, num_accepted, num_emitted, num_proposed):
        """Adds the three .counted statistics (every kernel with a .counted overload uses this): one vector
        atomic, relaxed because plain sums need no ordering with other memory (an acq_rel atomic would first
        wait for all of the program's earlier memory operations)."""
        which = tl.arange(0, 4)
        counts = tl.where(which == 0, num_accepted, tl.where(which == 1, num_emitted, num_proposed)).to(tl.int64)
        tl.atomic_add(counters_ptr + which, counts, mask=which < 3, sem="relaxed")

    @triton.jit(
        do_not_specialize=["batch", "k", "accepted_row_stride", "substitute_row_stride", "draft_row_stride",
                           "bonus_row_stride"],
        do_not_specialize_on_alignment=["accepted_ptr", "substitute_ptr", "draft_ptr", "bonus_ptr", "out_ptr",
                                        "counters_ptr"],
    )
    def _create_output_kernel(
        accepted_ptr, substitute_ptr, draft_ptr, bonus_ptr, out_ptr, counters_ptr,
        batch, k,
        accepted_row_stride, substitute_row_stride, draft_row_stride, bonus_row_stride,
        BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, COUNT: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.arange(0, BLOCK_COLS)
        row_ok = rows < batch
        rows64 = rows.to(tl.int64)
        in_draft = row_ok[:, None] & (cols[None, :] < k)

        # Every load depends only on the program id, so they all issue at once: the
        # latency of this kernel is one round trip to memory, not a chain of them.
        is_accepted = tl.load(accepted_ptr + rows64[:, None] * accepted_row_stride + cols[None, :],
                              mask=in_draft, other=0) != 0
        draft = tl.load(draft_ptr + rows64[:, None] * draft_row_stride + cols[None, :], mask=in_draft,
                        other=-1).to(tl.int64)
        substitute = tl.load(substitute_ptr + rows64[:, None] * substitute_row_stride + cols[None, :],
                             mask=in_draft, other=-1).to(tl.int64)
        bonus = tl.load(bonus_ptr + rows64 * bonus_row_stride, mask=row_ok, other=-1).to(tl.int64)
        # Loaded again on its own rather than picked out of `draft` by a reduction, which
        # would stand between the loads and the store.
        last_draft = tl.load(draft_ptr + rows64 * draft_row_stride + (k - 1), mask=row_ok, other=-1)

        rejected_at = tl.where(in_draft & ~is_accepted, cols[None, :], k)
        first_rejected = tl.min(rejected_at, axis=1)
        emit_bonus = row_ok & (first_rejected == k) & (last_draft != -1)
        bonus = tl.where(emit_bonus, bonus, -1)
        substitute = tl.where(cols[None, :] == first_rejected[:, None], substitute, -1)
        out = tl.where(cols[None, :] < first_rejected[:, None], draft, substitute)
        out = tl.where(cols[None, :] == k, bonus[:, None], out)
        in_out = row_ok[:, None] & (cols[None, :] <= k)
        tl.store(out_ptr + rows64[:, None] * (k + 1) + cols[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=in_out)

        if COUNT:
            # Both sums in one reduction (each below 2**32, packed in an int64): every
            # cross-warp reduction adds barriers before the atomic that ends the program.
            packed = is_accepted.to(tl.int64) + ((in_out & (out != -1)).to(tl.int64) << 32)
            sums = tl.sum(tl.sum(packed, axis=1), axis=0)
            num_rows = tl.minimum(batch - pid * BLOCK_ROWS, BLOCK_ROWS).to(tl.int64)
            add_counters_tl(counters_ptr, sums & 0xFFFFFFFF, sums >> 32, num_rows * k)

    _launch_kernel = CachedLaunch(_create_output_kernel)
    expose_to_cpp("create_output", _create_output_kernel)


def _launch(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids, counters):
    """One launch of the Triton kernel from Python (inputs already validated): the TRITON_INTERPRET path of the
    tests, and a second path to compare the C++ launcher with."""
    batch, k = draft_token_ids.shape
    out = torch.empty((batch, k + 1), dtype=draft_token_ids.dtype, device=draft_token_ids.device)
    if batch == 0:
        return out
    block_rows = _GEOMETRY["block_rows"]
    grid = (triton.cdiv(batch, block_rows),)
    _launch_kernel(
        grid,
        (accepted, substitute_token_ids, draft_token_ids, bonus_token_ids, out, out if counters is None else counters,
         batch, k,
         accepted.stride(0), substitute_token_ids.stride(0), draft_token_ids.stride(0), bonus_token_ids.stride(0)),
        (block_rows, triton.next_power_of_2(k + 1), counters is not None),
        num_warps=_GEOMETRY["num_warps"],
    )
    return out


def _create_output_triton(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids):
    _check_inputs(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids)
    return _launch(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids, None)


def _create_output_counted_triton(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids, counters):
    _check_inputs(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids, counters)
    return _launch(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids, counters)


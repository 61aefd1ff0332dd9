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
(draft tokens proposed). The CUDA kernel (kernels/output.py) is one Triton launch either way, made
from C++ (csrc/create_output.cpp); counters are summed per program and added
atomically, so no host sync is needed.
"""
from __future__ import annotations

import torch

from .. import _C
from .._library import register_fake
from .checks import INDEX_DTYPES, INT_DTYPES, check_counters, check_size, check_tensor

_OP = "create_output"


def create_output(
    accepted: torch.Tensor,
    substitute_token_ids: torch.Tensor,
    draft_token_ids: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Formats verified tokens into the [B, k+1] layout; see the module docstring.

    Args:
        accepted: [B, k], bool or any integer dtype, unit last stride. Nonzero = the draft token is accepted; only
            the entries before the first zero decide the output.
        substitute_token_ids: [B, k], int32 or int64, unit last stride. Column j is emitted when j is the first
            rejected position.
        draft_token_ids: [B, k], int32 or int64, unit last stride, k >= 1. The accepted prefix; its dtype is the
            output's.
        bonus_token_ids: [B, 1] or [B], int32 or int64, any row stride. Emitted in column k when all k are accepted
            and the last draft token is not -1.
        counters: [3], int64, or None. When given (the ``.counted`` overload), (accepted, emitted, proposed) token
            counts are added to it in place.

    Returns:
        [B, k+1], dtype of ``draft_token_ids``, on their device.
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
    """Plain-PyTorch statement of the contract (several small ops; the kernels fuse them). Arguments and result as
    `create_output`'s; the verifiers' references end with it."""
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


def check_inputs(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids, counters=None):
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


def empty_output_row(draft_token_ids: torch.Tensor) -> torch.Tensor:
    """An uninitialized [B, k+1] output of the layout, dtype and device of draft_token_ids [B, k]: what every
    verifier returns (fake kernels and launchers alike)."""
    batch, k = draft_token_ids.shape
    return torch.empty((batch, k + 1), dtype=draft_token_ids.dtype, device=draft_token_ids.device)


@register_fake(_OP, ("default", "counted"))
def _create_output_fake(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids, counters=None):
    check_inputs(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids, counters)
    return empty_output_row(draft_token_ids)

"""`specdec::prepare_prefill`: the draft model's step-0 input expansion.

After the target model verifies a round, each request's draft model must see
the tokens the target accepted plus the target's own next token (the
correction token) before it proposes again. This op lays them out in one
flattened, varlen batch with one extra slot per request.

Contract, for request i of num_reqs, with
``query_len = query_start_loc[i+1] - query_start_loc[i]``,
``num_valid = query_len - num_rejected[i]`` and
``out_start = query_start_loc[i] + i``:

- ``expanded_input_ids`` [num_tokens + num_reqs], dtype of ``input_ids``:
  slots ``out_start + s`` for ``s`` in ``[0, query_len]`` hold the accepted
  tokens ``input_ids[query_start_loc[i] + s]`` for ``s < num_valid``, the
  correction token ``last_sampled[idx_mapping[i]]`` at ``s == num_valid``, and
  0 in the ``num_rejected[i]`` rejected slots after it (the draft model still
  runs on them; their KV is overwritten in a later round).
- ``expanded_positions`` [num_tokens + num_reqs] int64: slot ``s`` of request i
  holds ``min(positions[query_start_loc[i]] + s, max_model_len - 1)`` (the
  start position is 0 for a request with an empty query).
- ``last_token_indices`` [max_num_reqs] int64: ``out_start + num_valid``, the
  correction token's slot, where the first draft token is sampled; 0 in rows
  ``>= num_reqs``.
- ``expanded_query_start_loc`` [max_num_reqs + 1] int32: ``out_start`` for
  each request; every entry from ``num_reqs`` on holds
  ``num_tokens + num_reqs``.
- ``expanded_seq_lens`` [max_num_reqs] int32:
  ``min(seq_lens[i] + 1, max_model_len)``; 0 in rows ``>= num_reqs``.

Slots past ``query_start_loc[num_reqs] + num_reqs`` (a token batch padded
beyond its requests, as CUDA-graph engines do) hold token 0 at position 0.
The padding entries of ``expanded_query_start_loc`` still hold
``num_tokens + num_reqs``, as specified, so with such a batch they count the
padding slots too; the per-request entries do not depend on it.

Inputs are 1-D with unit stride, int32 or int64 each: ``input_ids`` and
``positions`` [num_tokens], ``query_start_loc`` [num_reqs + 1], ``seq_lens``,
``idx_mapping`` (batch row -> request slot) and ``num_rejected`` [num_reqs],
``last_sampled`` [num_slots] (per request slot). ``max_num_reqs`` defaults to
num_reqs and must be at least num_reqs.

Values are not checked on the device (that would need a host sync);
``query_start_loc`` must start at 0 and be non-decreasing. An
out-of-range value (a slot past ``last_sampled``, ``num_rejected`` outside
``[0, query_len]``, a non-monotone ``query_start_loc``) is clamped so that no
kernel reads or writes out of bounds, and the affected rows are unspecified.

The CUDA kernel (kernels/prefill.py) is one Triton launch, made from C++
(csrc/prepare_prefill.cpp),
whose grid depends only on shapes: each program owns a tile of rows (up to
max_num_reqs) and writes their first slots at once (all of a decode round),
then the rest of any longer query one request at a time, and their per-request
or padding entries; every program also zeroes one chunk of the slots past the
last request. No host data, no sync: it can be captured in a CUDA graph.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import _C
from .._library import register_fake
from .checks import INT_DTYPES, check_size, check_tensor

_OP = "prepare_prefill"
_INPUT_NAMES = (
    "input_ids",
    "positions",
    "query_start_loc",
    "seq_lens",
    "idx_mapping",
    "last_sampled",
    "num_rejected",
)


class PrefillInputs(NamedTuple):
    """The outputs of `prepare_prefill`, named."""

    expanded_input_ids: torch.Tensor
    expanded_positions: torch.Tensor
    last_token_indices: torch.Tensor
    expanded_query_start_loc: torch.Tensor
    expanded_seq_lens: torch.Tensor


def prepare_prefill(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    idx_mapping: torch.Tensor,
    last_sampled: torch.Tensor,
    num_rejected: torch.Tensor,
    max_model_len: int,
    max_num_reqs: int | None = None,
) -> PrefillInputs:
    """Builds the draft model's step-0 batch; see the module docstring for the layout.

    Args:
        input_ids: [num_tokens], int32 or int64, unit stride. The verified round's tokens, request after request.
        positions: [num_tokens], int32 or int64, unit stride. Their positions.
        query_start_loc: [num_reqs + 1], int32 or int64, unit stride. Request i's tokens are
            [query_start_loc[i], query_start_loc[i + 1]); starts at 0, non-decreasing.
        seq_lens: [num_reqs], int32 or int64, unit stride. Each request's sequence length.
        idx_mapping: [num_reqs], int32 or int64, unit stride. Batch row -> request slot (a row of last_sampled).
        last_sampled: [num_slots], int32 or int64, unit stride. Each request slot's correction token.
        num_rejected: [num_reqs], int32 or int64, unit stride. Rejected draft tokens at the end of each query.
        max_model_len: int >= 1. Positions are clamped to max_model_len - 1, lengths to max_model_len.
        max_num_reqs: int >= num_reqs, or None (num_reqs). The padded request count of the per-request outputs.

    Returns:
        PrefillInputs: expanded_input_ids [num_tokens + num_reqs] (dtype of input_ids), expanded_positions
        [num_tokens + num_reqs] int64, last_token_indices [max_num_reqs] int64, expanded_query_start_loc
        [max_num_reqs + 1] int32, expanded_seq_lens [max_num_reqs] int32; all new, on the inputs' device.
    """
    if torch.compiler.is_compiling():
        return _prepare_prefill_ops(input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled,
                                    num_rejected, max_model_len, max_num_reqs)
    return _C.eager_prepare_prefill(input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled,
                                    num_rejected, max_model_len, max_num_reqs)


def prepare_prefill_into(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    idx_mapping: torch.Tensor,
    last_sampled: torch.Tensor,
    num_rejected: torch.Tensor,
    max_model_len: int,
    expanded_input_ids: torch.Tensor,
    expanded_positions: torch.Tensor,
    last_token_indices: torch.Tensor,
    expanded_query_start_loc: torch.Tensor,
    expanded_seq_lens: torch.Tensor,
) -> None:
    """`prepare_prefill` writing into caller-owned persistent buffers (for static CUDA graphs).

    Args:
        input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled, num_rejected, max_model_len:
            as `prepare_prefill`'s.
        expanded_input_ids: [>= num_tokens + num_reqs], int32 or int64, unit stride; written in place.
        expanded_positions: [>= num_tokens + num_reqs], int64, unit stride; written in place.
        last_token_indices: [max_num_reqs], int64, unit stride, max_num_reqs >= num_reqs; written in place.
        expanded_query_start_loc: [max_num_reqs + 1], int32, unit stride; written in place.
        expanded_seq_lens: [max_num_reqs], int32, unit stride; written in place.

    The token buffers may be longer than ``num_tokens + num_reqs``: entries past that are left untouched. Returns
    None.
    """
    if torch.compiler.is_compiling():
        return _prepare_prefill_into_ops(input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled,
                                         num_rejected, max_model_len, expanded_input_ids, expanded_positions,
                                         last_token_indices, expanded_query_start_loc, expanded_seq_lens)
    return _C.eager_prepare_prefill_into(input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled,
                                         num_rejected, max_model_len, expanded_input_ids, expanded_positions,
                                         last_token_indices, expanded_query_start_loc, expanded_seq_lens)


# The wrappers' torch.ops calls, with the wrappers' positional arguments: what torch.compile traces, and the
# eager entries' fallback (csrc/eager_entry.cpp).
def _prepare_prefill_ops(*args) -> PrefillInputs:
    return PrefillInputs(*torch.ops.specdec.prepare_prefill.default(*args))


def _prepare_prefill_into_ops(*args) -> None:
    torch.ops.specdec.prepare_prefill_into.default(*args)


_C.register_eager("prepare_prefill", _prepare_prefill_ops, PrefillInputs)
_C.register_eager("prepare_prefill_into", _prepare_prefill_into_ops)


def prepare_prefill_reference(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    idx_mapping: torch.Tensor,
    last_sampled: torch.Tensor,
    num_rejected: torch.Tensor,
    max_model_len: int,
    max_num_reqs: int | None = None,
) -> PrefillInputs:
    """Plain-PyTorch statement of the contract, one request at a time (valid inputs only); arguments and result as
    `prepare_prefill`'s."""
    num_tokens = input_ids.shape[0]
    num_reqs = query_start_loc.shape[0] - 1
    max_num_reqs = num_reqs if max_num_reqs is None else max_num_reqs
    total = num_tokens + num_reqs
    device = input_ids.device
    ids = torch.zeros(total, dtype=input_ids.dtype, device=device)
    pos = torch.zeros(total, dtype=torch.int64, device=device)
    last = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
    qsl = torch.full((max_num_reqs + 1,), total, dtype=torch.int32, device=device)
    lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
    for i in range(num_reqs):
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        query_len = end - start
        num_valid = query_len - int(num_rejected[i])
        out_start = start + i
        ids[out_start : out_start + num_valid] = input_ids[start : start + num_valid]
        ids[out_start + num_valid] = last_sampled[int(idx_mapping[i])].to(input_ids.dtype)
        start_pos = int(positions[start]) if query_len > 0 else 0
        slot_pos = start_pos + torch.arange(query_len + 1, device=device)
        pos[out_start : out_start + query_len + 1] = slot_pos.clamp(max=max_model_len - 1)
        last[i] = out_start + num_valid
        qsl[i] = out_start
        lens[i] = min(int(seq_lens[i]) + 1, max_model_len)
    return PrefillInputs(ids, pos, last, qsl, lens)


# --- validation, shared by the fake kernels and the CUDA launchers ---------------------


def check_inputs(op, input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled,
                 num_rejected, max_model_len) -> int:
    """Validates the inputs and returns num_reqs."""
    device = input_ids.device
    tensors = (input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled, num_rejected)
    for name, t in zip(_INPUT_NAMES, tensors):
        check_tensor(op, name, t, ndim=1, dtypes=INT_DTYPES, device=device)
    num_reqs = query_start_loc.shape[0] - 1
    if num_reqs < 0:
        raise ValueError(f"{op}: argument 'query_start_loc' must have num_reqs + 1 >= 1 entries, got 0")
    check_size(op, "positions", positions, 0, input_ids.shape[0], "num_tokens, the length of input_ids")
    for name, t in (("seq_lens", seq_lens), ("idx_mapping", idx_mapping), ("num_rejected", num_rejected)):
        check_size(op, name, t, 0, num_reqs, "num_reqs, len(query_start_loc) - 1")
    if num_reqs > 0 and last_sampled.shape[0] < 1:
        raise ValueError(f"{op}: argument 'last_sampled' must hold one token per request slot, got 0 entries")
    if max_model_len < 1:
        raise ValueError(f"{op}: argument 'max_model_len' must be >= 1, got {max_model_len}")
    return num_reqs


def check_buffers(input_ids, num_reqs, expanded_input_ids, expanded_positions, last_token_indices,
                   expanded_query_start_loc, expanded_seq_lens) -> None:
    op = "prepare_prefill_into"
    device = input_ids.device
    total = input_ids.shape[0] + num_reqs
    check_tensor(op, "expanded_input_ids", expanded_input_ids, ndim=1, dtypes=INT_DTYPES, device=device)
    check_tensor(op, "expanded_positions", expanded_positions, ndim=1, dtypes=(torch.int64,), device=device)
    check_tensor(op, "last_token_indices", last_token_indices, ndim=1, dtypes=(torch.int64,), device=device)
    check_tensor(op, "expanded_query_start_loc", expanded_query_start_loc, ndim=1, dtypes=(torch.int32,),
                 device=device)
    check_tensor(op, "expanded_seq_lens", expanded_seq_lens, ndim=1, dtypes=(torch.int32,), device=device)
    for name, t in (("expanded_input_ids", expanded_input_ids), ("expanded_positions", expanded_positions)):
        if t.shape[0] < total:
            raise ValueError(
                f"{op}: argument '{name}' has {t.shape[0]} entries, expected at least "
                f"num_tokens + num_reqs = {total}"
            )
    max_num_reqs = last_token_indices.shape[0]
    if max_num_reqs < num_reqs:
        raise ValueError(
            f"{op}: argument 'last_token_indices' has {max_num_reqs} entries (max_num_reqs), expected "
            f"at least num_reqs = {num_reqs}"
        )
    check_size(op, "expanded_seq_lens", expanded_seq_lens, 0, max_num_reqs,
               "max_num_reqs, the length of last_token_indices")
    check_size(op, "expanded_query_start_loc", expanded_query_start_loc, 0, max_num_reqs + 1,
               "max_num_reqs + 1")


def resolve_max_num_reqs(num_reqs: int, max_num_reqs: int | None) -> int:
    if max_num_reqs is None:
        return num_reqs
    if max_num_reqs < num_reqs:
        raise ValueError(f"{_OP}: argument 'max_num_reqs' must be >= num_reqs = {num_reqs}, got {max_num_reqs}")
    return max_num_reqs


def empty_outputs(input_ids, num_reqs, max_num_reqs):
    total = input_ids.shape[0] + num_reqs
    device = input_ids.device
    return (
        torch.empty(total, dtype=input_ids.dtype, device=device),
        torch.empty(total, dtype=torch.int64, device=device),
        torch.empty(max_num_reqs, dtype=torch.int64, device=device),
        torch.empty(max_num_reqs + 1, dtype=torch.int32, device=device),
        torch.empty(max_num_reqs, dtype=torch.int32, device=device),
    )


@register_fake(_OP)
def _prepare_prefill_fake(input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled,
                          num_rejected, max_model_len, max_num_reqs=None):
    num_reqs = check_inputs(_OP, input_ids, positions, query_start_loc, seq_lens, idx_mapping,
                            last_sampled, num_rejected, max_model_len)
    return empty_outputs(input_ids, num_reqs, resolve_max_num_reqs(num_reqs, max_num_reqs))


@register_fake("prepare_prefill_into")
def _prepare_prefill_into_fake(input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled,
                               num_rejected, max_model_len, *buffers):
    num_reqs = check_inputs("prepare_prefill_into", input_ids, positions, query_start_loc, seq_lens,
                            idx_mapping, last_sampled, num_rejected, max_model_len)
    check_buffers(input_ids, num_reqs, *buffers)

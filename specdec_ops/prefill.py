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

The CUDA kernel is one Triton launch, made from C++ (csrc/prepare_prefill.cpp),
whose grid depends only on shapes: each program owns a tile of rows (up to
max_num_reqs) and writes their first slots at once (all of a decode round),
then the rest of any longer query one request at a time, and their per-request
or padding entries; every program also zeroes one chunk of the slots past the
last request. No host data, no sync: it can be captured in a CUDA graph.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import _C
from ._checks import INT_DTYPES, check_size, check_tensor
from ._launch import CachedLaunch, expose_to_cpp
from ._library import register_fake
from ._triton import HAS_TRITON, tl, triton

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
    """Builds the draft model's step-0 batch; see the module docstring for the layout."""
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

    ``max_num_reqs`` is ``len(last_token_indices)``; ``expanded_seq_lens`` must
    have that length and ``expanded_query_start_loc`` one more. The token
    buffers (int32 or int64 ids, int64 positions) may be longer than
    ``num_tokens + num_reqs``: entries past that are left untouched.
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
    """Plain-PyTorch statement of the contract, one request at a time (valid inputs only)."""
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


def _check_inputs(op, input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled,
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


def _check_buffers(input_ids, num_reqs, expanded_input_ids, expanded_positions, last_token_indices,
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


def _resolve_max_num_reqs(num_reqs: int, max_num_reqs: int | None) -> int:
    if max_num_reqs is None:
        return num_reqs
    if max_num_reqs < num_reqs:
        raise ValueError(f"{_OP}: argument 'max_num_reqs' must be >= num_reqs = {num_reqs}, got {max_num_reqs}")
    return max_num_reqs


def _empty_outputs(input_ids, num_reqs, max_num_reqs):
    total = input_ids.shape[0] + num_reqs
    device = input_ids.device
    return (
        torch.empty(total, dtype=input_ids.dtype, device=device),
        torch.empty(total, dtype=torch.int64, device=device),
        torch.empty(max_num_reqs, dtype=torch.int64, device=device),
        torch.empty(max_num_reqs + 1, dtype=torch.int32, device=device),
        torch.empty(max_num_reqs, dtype=torch.int32, device=device),
    )


@register_fake("prepare_prefill")
def _prepare_prefill_fake(input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled,
                          num_rejected, max_model_len, max_num_reqs=None):
    num_reqs = _check_inputs(_OP, input_ids, positions, query_start_loc, seq_lens, idx_mapping,
                             last_sampled, num_rejected, max_model_len)
    return _empty_outputs(input_ids, num_reqs, _resolve_max_num_reqs(num_reqs, max_num_reqs))


@register_fake("prepare_prefill_into")
def _prepare_prefill_into_fake(input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled,
                               num_rejected, max_model_len, *buffers):
    num_reqs = _check_inputs("prepare_prefill_into", input_ids, positions, query_start_loc, seq_lens,
                             idx_mapping, last_sampled, num_rejected, max_model_len)
    _check_buffers(input_ids, num_reqs, *buffers)


# --- Triton kernel ----------------------------------------------------------------------

# A program handles a tile of ROWS requests x SLOTS slots, which holds all of a
# decode round (query_len + 1 = k + 2 slots per request); the rest of a longer
# query (a prompt) follows, one request at a time, LONG_SLOTS slots per step.
# The geometry is set in csrc/triton_launch.h, whose C++ launcher is the CUDA kernel of the op.
_GEOMETRY = _C._launch_geometry()["prepare_prefill"]

if HAS_TRITON:

    @triton.jit
    def _write_slots(input_ids_ptr, out_ids_ptr, out_positions_ptr, s, live, out_start, q_start, query_len,
                     num_valid, correction, start_pos, total, max_model_len):
        """Slots `s` of the requests whose values are given (broadcast against s)."""
        j = out_start + s
        # (a select, not `live & ...`: Triton 3.9's interpreter types a 0-d bool tensor & a
        # bool tensor as int32, which tl.load rejects as a mask)
        in_slot = tl.where(live, (s <= query_len) & (j >= 0) & (j < total), False)
        accepted = in_slot & (s < num_valid)
        token = tl.load(input_ids_ptr + q_start + s, mask=accepted, other=0).to(tl.int64)
        token = tl.where(s == num_valid, correction, token)
        position = tl.minimum(start_pos + s, max_model_len - 1)
        tl.store(out_ids_ptr + j, token.to(out_ids_ptr.dtype.element_ty), mask=in_slot)
        tl.store(out_positions_ptr + j, position, mask=in_slot)

    @triton.jit
    def _pick(values, pick):
        """The entry of the 1-D `values` where `pick` is true (exactly one)."""
        return tl.sum(tl.where(pick, values, 0), axis=0)

    @triton.jit(
        do_not_specialize=["num_tokens", "num_reqs", "num_slots", "max_num_reqs", "max_model_len"],
        do_not_specialize_on_alignment=[
            "input_ids_ptr", "positions_ptr", "query_start_loc_ptr", "seq_lens_ptr", "idx_mapping_ptr",
            "last_sampled_ptr", "num_rejected_ptr", "out_ids_ptr", "out_positions_ptr", "out_last_ptr",
            "out_qsl_ptr", "out_seq_lens_ptr",
        ],
    )
    def _prepare_prefill_kernel(
        input_ids_ptr, positions_ptr, query_start_loc_ptr, seq_lens_ptr, idx_mapping_ptr,
        last_sampled_ptr, num_rejected_ptr,
        out_ids_ptr, out_positions_ptr, out_last_ptr, out_qsl_ptr, out_seq_lens_ptr,
        num_tokens, num_reqs, num_slots, max_num_reqs, max_model_len,
        ROWS: tl.constexpr, SLOTS: tl.constexpr, LONG_SLOTS: tl.constexpr,
    ):
        # Program p owns rows [p * ROWS, (p + 1) * ROWS): their slots and per-request
        # entries, or padding entries for rows >= num_reqs. The kernel's time is its
        # chain of memory round trips, so every load of the common path is issued
        # before its first store (a load after a store may not move above it: the
        # pointers may alias), and no load waits on more than one earlier round trip.
        tl.static_assert(ROWS < 32, "long_rows below is a bit mask of the tile's rows")
        pid = tl.program_id(0)
        total = num_tokens + num_reqs
        rows = pid * ROWS + tl.arange(0, ROWS)
        live = rows < num_reqs
        raw_start = tl.load(query_start_loc_ptr + rows, mask=live, other=0).to(tl.int32)
        raw_end = tl.load(query_start_loc_ptr + rows + 1, mask=live, other=0).to(tl.int32)
        rejected = tl.load(num_rejected_ptr + rows, mask=live, other=0).to(tl.int32)
        slot = tl.load(idx_mapping_ptr + rows, mask=live, other=0)
        seq_len = tl.load(seq_lens_ptr + rows, mask=live, other=0).to(tl.int64)
        tail_start = tl.load(query_start_loc_ptr + num_reqs).to(tl.int32) + num_reqs

        q_start = tl.minimum(tl.maximum(raw_start, 0), num_tokens)
        query_len = tl.minimum(tl.maximum(raw_end, q_start), num_tokens) - q_start
        num_valid = query_len - tl.minimum(tl.maximum(rejected, 0), query_len)
        slot = tl.minimum(tl.maximum(slot, 0), num_slots - 1)
        correction = tl.load(last_sampled_ptr + slot, mask=live, other=0).to(tl.int64)
        start_pos = tl.load(positions_ptr + q_start, mask=live & (query_len > 0), other=0).to(tl.int64)
        out_start = raw_start + rows

        # Slots [0, SLOTS) of the tile's requests: all of a decode round.
        _write_slots(input_ids_ptr, out_ids_ptr, out_positions_ptr, tl.arange(0, SLOTS)[None, :], live[:, None],
                     out_start[:, None], q_start[:, None], query_len[:, None], num_valid[:, None],
                     correction[:, None], start_pos[:, None], total, max_model_len)
        tl.store(out_last_ptr + rows, tl.where(live, out_start + num_valid, 0).to(tl.int64), mask=rows < max_num_reqs)
        tl.store(out_qsl_ptr + rows, tl.where(live, out_start, total), mask=rows <= max_num_reqs)
        new_seq_len = tl.minimum(seq_len + 1, max_model_len).to(tl.int32)
        tl.store(out_seq_lens_ptr + rows, tl.where(live, new_seq_len, 0), mask=rows < max_num_reqs)

        # Slots past query_start_loc[num_reqs] + num_reqs (a padded token batch): the
        # grid has enough programs that these chunks cover them all.
        tail_start = tl.minimum(tl.maximum(tail_start, 0), total)
        j = tail_start + pid * (ROWS * SLOTS) + tl.arange(0, ROWS * SLOTS)
        in_tail = j < total
        tl.store(out_ids_ptr + j, tl.zeros([ROWS * SLOTS], dtype=out_ids_ptr.dtype.element_ty), mask=in_tail)
        tl.store(out_positions_ptr + j, tl.zeros([ROWS * SLOTS], dtype=tl.int64), mask=in_tail)

        # The rest of requests with more slots (a prompt's draft prefill), one request
        # at a time, LONG_SLOTS slots per step. The request's values are picked out of
        # the tile's vectors by reductions: using the vectors in a wider tile instead
        # would make Triton build them (loads included) in another layout as well, in
        # front of the common path.
        long_rows = tl.sum(tl.where(live & (query_len >= SLOTS), 1 << tl.arange(0, ROWS), 0), axis=0)
        if long_rows != 0:
            for r in range(ROWS):
                if (long_rows >> r) & 1:
                    pick = tl.arange(0, ROWS) == r
                    row_start = _pick(out_start, pick)
                    row_q_start = _pick(q_start, pick)
                    row_len = _pick(query_len, pick)
                    row_valid = _pick(num_valid, pick)
                    row_correction = _pick(correction, pick)
                    row_pos = _pick(start_pos, pick)
                    for first in range(SLOTS, row_len + 1, LONG_SLOTS):
                        _write_slots(input_ids_ptr, out_ids_ptr, out_positions_ptr, first + tl.arange(0, LONG_SLOTS),
                                     True, row_start, row_q_start, row_len, row_valid, row_correction, row_pos, total,
                                     max_model_len)

    _launch_kernel = CachedLaunch(_prepare_prefill_kernel)
    expose_to_cpp("prepare_prefill", _prepare_prefill_kernel)


def _grid(num_tokens: int, num_reqs: int, max_num_reqs: int) -> tuple[int]:
    """The kernel's grid, as the C++ launcher computes it: a program per tile of rows (padding rows included), and
    enough programs that their tail chunks cover the token slots."""
    rows, slots = _GEOMETRY["rows"], _GEOMETRY["slots"]
    return (max((max_num_reqs + rows) // rows, (num_tokens + num_reqs + rows * slots - 1) // (rows * slots)),)


def _launch(input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled, num_rejected,
            max_model_len, out_ids, out_positions, out_last, out_qsl, out_seq_lens) -> None:
    """One launch of the Triton kernel from Python (inputs already validated): the TRITON_INTERPRET path of the
    tests, and a second path to compare the C++ launcher with."""
    num_tokens = input_ids.shape[0]
    num_reqs = query_start_loc.shape[0] - 1
    max_num_reqs = out_last.shape[0]
    _launch_kernel(
        _grid(num_tokens, num_reqs, max_num_reqs),
        (input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled, num_rejected,
         out_ids, out_positions, out_last, out_qsl, out_seq_lens,
         num_tokens, num_reqs, max(last_sampled.shape[0], 1), max_num_reqs, max_model_len),
        (_GEOMETRY["rows"], _GEOMETRY["slots"], _GEOMETRY["long_slots"]),
        num_warps=_GEOMETRY["num_warps"],
    )


def _prepare_prefill_triton(input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled,
                            num_rejected, max_model_len, max_num_reqs=None):
    num_reqs = _check_inputs(_OP, input_ids, positions, query_start_loc, seq_lens, idx_mapping,
                             last_sampled, num_rejected, max_model_len)
    outputs = _empty_outputs(input_ids, num_reqs, _resolve_max_num_reqs(num_reqs, max_num_reqs))
    _launch(input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled, num_rejected,
            max_model_len, *outputs)
    return outputs


def _prepare_prefill_into_triton(input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled,
                                 num_rejected, max_model_len, *buffers):
    num_reqs = _check_inputs("prepare_prefill_into", input_ids, positions, query_start_loc, seq_lens,
                             idx_mapping, last_sampled, num_rejected, max_model_len)
    _check_buffers(input_ids, num_reqs, *buffers)
    _launch(input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled, num_rejected,
            max_model_len, *buffers)


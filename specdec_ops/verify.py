"""`specdec::greedy_verify` and `specdec::typical_acceptance`: deterministic verification.

Both take the target model's distribution over the k+1 positions of a
speculative round, ``target`` [B, k+1, V] (logits or probabilities for
greedy, probabilities for typical acceptance), and the k draft tokens,
``draft_token_ids`` [B, k]. For each request b and row i, ``argmax_i`` is the
index of the largest entry of ``target[b, i]``, as ``torch.argmax`` picks it:
the lowest index on ties, and the first NaN if the row holds one.

Accept decisions, at every position i < k, for ``x = draft_token_ids[b, i]``:

- ``greedy_verify``: accept iff ``x == argmax_i``.
- ``typical_acceptance``: accept iff ``p_i(x) > min(posterior_threshold,
  posterior_alpha * exp(-H(p_i)))``, where
  ``H(p) = -sum_v p[v] * log(p[v] + 1e-5)``; the min is NaN, and x rejected,
  when either side is NaN (as ``torch.minimum``). Defaults: threshold 0.09,
  alpha 0.3.

A draft id outside ``[0, V)`` (for example -1 padding) is always rejected and
is never used to index ``target``.

The output [B, k+1] is `create_output` (specdec_ops/output.py) applied to
those decisions with ``substitute_token_ids[b, i] = argmax_i`` and
``bonus_token_ids[b] = argmax_k``: the accepted draft prefix, the target
argmax at the first rejection, -1 after it, and the argmax of row k in column
k when all k were accepted. Its dtype is that of ``draft_token_ids``.

The ``.counted`` overloads also add, in place, exactly what
``create_output.counted`` adds: the number of accepted positions among ALL k
(accept decisions after the first rejection are counted too), the number of
output entries that are not -1, and ``B * k``.

Inputs: ``target`` float16, bfloat16 or float32, 3-D with V >= 1 and a unit
stride in its last dimension; ``draft_token_ids`` int32 or int64 with k >= 1
and a unit stride in its last dimension; ``counters`` int64 [3]. All on one
device. B may be 0.

Precision: argmax compares the input values exactly (float16/bfloat16 widen
to float32 without rounding). The entropy is accumulated in float64 by the
CPU kernel (as by `typical_acceptance_reference`) and in float32 by the CUDA
kernel: each lane of a program sums one term in every BLOCK_V, so a lane adds
at most V / BLOCK_V terms (32 for V = 128256), then the lanes and the chunk
partials are added as trees in a fixed order. That keeps the absolute error
of H near 1e-6 * H (about 1e-5 for a flat V = 128256 row), which is the
relative error of exp(-H), and makes the result run-to-run deterministic for
given shapes. Decisions agree with the reference except for inputs whose
draft probability lies within about that relative distance of the limit (the
CUDA kernel also rounds posterior_threshold and posterior_alpha to float32).

CUDA kernel (Triton): ONE launch of B * (k+1) * C programs. Program
(b, i, c) streams chunk c of row i of request b (BLOCK_V entries per step,
lane-wise running argmax and entropy terms), writes its chunk's (max, argmax,
entropy part) to a per-call scratch buffer, and takes a ticket from a
per-request atomic counter (acq_rel). The program that draws the last ticket
combines the (k+1) * C partials in a fixed order, decides acceptance, writes
the output row, adds the counters atomically and sets the ticket back to 0,
so every call (and every CUDA graph replay) starts from zeroed tickets with no
memset launch. C (chunks per row) depends only on shapes: more chunks when B
is small so the whole GPU reads V. The tickets live in one persistent buffer
per device (`_launch.zeroed_scratch`, shared with rejection_sample), so two
such calls running concurrently on different streams of one device would race
on them; serialise such calls (or give each stream its own process). No host
sync, no host-side data: graph-capturable.
"""
from __future__ import annotations

import torch

from ._checks import INT_DTYPES, check_counters, check_size, check_tensor
from ._launch import sm_count, zeroed_scratch
from ._library import register_cuda, register_fake
from ._triton import HAS_TRITON, tl, triton
from .output import create_output_reference

_GREEDY = "greedy_verify"
_TYPICAL = "typical_acceptance"
TARGET_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ENTROPY_EPS = 1e-5


def greedy_verify(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Greedy verification into the [B, k+1] layout; see the module docstring.

    Pass ``counters`` (int64, shape [3]) to accumulate (accepted, emitted,
    proposed) token counts in place.
    """
    if counters is None:
        return torch.ops.specdec.greedy_verify.default(target_logits, draft_token_ids)
    return torch.ops.specdec.greedy_verify.counted(target_logits, draft_token_ids, counters)


def typical_acceptance(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Typical-acceptance verification into the [B, k+1] layout; see the module docstring.

    Pass ``counters`` (int64, shape [3]) to accumulate (accepted, emitted,
    proposed) token counts in place.
    """
    if counters is None:
        return torch.ops.specdec.typical_acceptance.default(
            target_probs, draft_token_ids, posterior_threshold, posterior_alpha
        )
    return torch.ops.specdec.typical_acceptance.counted(
        target_probs, draft_token_ids, posterior_threshold, posterior_alpha, counters
    )


# --- reference ---------------------------------------------------------------------------


def _draft_in_vocab(draft_token_ids: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask of draft ids in [0, V), the ids clamped into range for safe indexing)."""
    valid = (draft_token_ids >= 0) & (draft_token_ids < vocab)
    return valid, draft_token_ids.clamp(0, vocab - 1).long()


def greedy_verify_decisions(target_logits: torch.Tensor, draft_token_ids: torch.Tensor):
    """Reference accept decisions [B, k] (bool) and row argmaxes [B, k+1] (int64)."""
    k = draft_token_ids.shape[1]
    argmax = target_logits.argmax(dim=-1)
    valid, _ = _draft_in_vocab(draft_token_ids, target_logits.shape[-1])
    return valid & (draft_token_ids.long() == argmax[:, :k]), argmax


def typical_acceptance_decisions(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
):
    """Reference accept decisions [B, k] (bool) and row argmaxes [B, k+1] (int64); float64 entropy."""
    k = draft_token_ids.shape[1]
    argmax = target_probs.argmax(dim=-1)
    probs = target_probs[:, :k].double()
    entropy = -(probs * torch.log(probs + ENTROPY_EPS)).sum(dim=-1)
    valid, safe_ids = _draft_in_vocab(draft_token_ids, target_probs.shape[-1])
    draft_prob = probs.gather(-1, safe_ids[..., None]).squeeze(-1)
    limit = torch.minimum(torch.full_like(entropy, posterior_threshold), posterior_alpha * torch.exp(-entropy))
    return valid & (draft_prob > limit), argmax


def greedy_verify_reference(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-PyTorch statement of the contract: argmax, compare, then `create_output`."""
    k = draft_token_ids.shape[1]
    accepted, argmax = greedy_verify_decisions(target_logits, draft_token_ids)
    return create_output_reference(accepted, argmax[:, :k], draft_token_ids, argmax[:, k], counters)


def typical_acceptance_reference(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-PyTorch statement of the contract (float64 entropy), then `create_output`."""
    k = draft_token_ids.shape[1]
    accepted, argmax = typical_acceptance_decisions(
        target_probs, draft_token_ids, posterior_threshold, posterior_alpha
    )
    return create_output_reference(accepted, argmax[:, :k], draft_token_ids, argmax[:, k], counters)


# --- validation, shared by the fake kernels and the CUDA launchers ---------------------


def _check_inputs(op, target_name, target, draft_token_ids, counters=None) -> None:
    device = draft_token_ids.device
    check_tensor(op, "draft_token_ids", draft_token_ids, ndim=2, dtypes=INT_DTYPES)
    check_tensor(op, target_name, target, ndim=3, dtypes=TARGET_DTYPES, device=device)
    batch, k = draft_token_ids.shape
    if k < 1:
        raise ValueError(f"{op}: argument 'draft_token_ids' must have k >= 1 columns, got shape "
                         f"{tuple(draft_token_ids.shape)}")
    check_size(op, target_name, target, 0, batch, "B, rows of draft_token_ids")
    check_size(op, target_name, target, 1, k + 1, "k + 1, one more than the columns of draft_token_ids")
    if target.shape[2] < 1:
        raise ValueError(f"{op}: argument '{target_name}' must have a vocabulary of V >= 1 entries, got shape "
                         f"{tuple(target.shape)}")
    if counters is not None:
        check_counters(op, counters, device)


def _output_like(draft_token_ids):
    batch, k = draft_token_ids.shape
    return draft_token_ids.new_empty((batch, k + 1))


@register_fake("greedy_verify")
def _greedy_verify_fake(target_logits, draft_token_ids):
    _check_inputs(_GREEDY, "target_logits", target_logits, draft_token_ids)
    return _output_like(draft_token_ids)


@register_fake("greedy_verify.counted")
def _greedy_verify_counted_fake(target_logits, draft_token_ids, counters):
    _check_inputs(_GREEDY, "target_logits", target_logits, draft_token_ids, counters)
    return _output_like(draft_token_ids)


@register_fake("typical_acceptance")
def _typical_acceptance_fake(target_probs, draft_token_ids, posterior_threshold=0.09, posterior_alpha=0.3):
    _check_inputs(_TYPICAL, "target_probs", target_probs, draft_token_ids)
    return _output_like(draft_token_ids)


@register_fake("typical_acceptance.counted")
def _typical_acceptance_counted_fake(target_probs, draft_token_ids, posterior_threshold, posterior_alpha,
                                     counters):
    _check_inputs(_TYPICAL, "target_probs", target_probs, draft_token_ids, counters)
    return _output_like(draft_token_ids)


# --- Triton kernel ----------------------------------------------------------------------

_MAX_BLOCK_V = 4096
_MIN_CHUNK = 8192  # a program reads at least this many entries of a row when V allows
_PROGRAMS_PER_SM = 4
_INTERPRETER_SMS = 4  # pretend SM count without CUDA (TRITON_INTERPRET), so small tests split rows

if HAS_TRITON:

    from .output import add_counters_tl

    @triton.jit
    def _verify_kernel(
        target_ptr, draft_ptr, out_ptr, counters_ptr,
        part_max_ptr, part_argmax_ptr, part_entropy_ptr, tickets_ptr,
        k, vocab, target_batch_stride, target_row_stride, draft_row_stride,
        chunk_len, num_chunks, posterior_threshold, posterior_alpha,
        TYPICAL: tl.constexpr, COUNT: tl.constexpr,
        BLOCK_V: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_CHUNKS: tl.constexpr,
    ):
        # Program pid = (b * (k+1) + row) * num_chunks + chunk, which is also
        # its slot in the scratch buffers.
        pid = tl.program_id(0)
        per_request = (k + 1) * num_chunks
        b = pid // per_request
        row = (pid % per_request) // num_chunks
        chunk = pid % num_chunks
        request_ptr = target_ptr + b.to(tl.int64) * target_batch_stride
        row_ptr = request_ptr + row.to(tl.int64) * target_row_stride

        # Stream the chunk. Each lane keeps the first NaN it sees, else its
        # largest value at the lowest index (strict >, indices only grow);
        # lanes start at their first index so an all -inf chunk yields its
        # first index, like torch.argmax.
        start = chunk * chunk_len
        end = tl.minimum(start + chunk_len, vocab)
        lanes = tl.arange(0, BLOCK_V)
        lane_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
        lane_argmax = start + lanes
        lane_entropy = tl.zeros([BLOCK_V], tl.float32)
        for offset in range(start, end, BLOCK_V):
            idx = offset + lanes
            in_chunk = idx < end
            x = tl.load(row_ptr + idx, mask=in_chunk, other=float("-inf")).to(tl.float32)
            take = (x > lane_max) | ((x != x) & (lane_max == lane_max))
            lane_max = tl.where(take, x, lane_max)
            lane_argmax = tl.where(take, idx, lane_argmax)
            if TYPICAL:
                p = tl.where(in_chunk, x, 0.0)
                lane_entropy += p * tl.log(p + 1e-5)

        # Lanes -> chunk result (NaN wins, at its lowest index).
        lane_nan = lane_max != lane_max
        first_nan = tl.min(tl.where(lane_nan, lane_argmax, 2147483647), axis=0)
        chunk_max = tl.max(tl.where(lane_nan, float("-inf"), lane_max), axis=0)
        chunk_argmax = tl.min(tl.where(lane_max == chunk_max, lane_argmax, 2147483647), axis=0)
        has_nan = first_nan < 2147483647
        tl.store(part_max_ptr + pid, tl.where(has_nan, float("nan"), chunk_max))
        tl.store(part_argmax_ptr + pid, tl.where(has_nan, first_nan, chunk_argmax))
        if TYPICAL:
            tl.store(part_entropy_ptr + pid, tl.sum(lane_entropy, axis=0))

        # Publish the partials (barrier: all threads' stores precede the
        # release), then take a ticket; the last of the request's programs
        # combines them.
        tl.debug_barrier()
        ticket = tl.atomic_add(tickets_ptr + b, 1, sem="acq_rel")
        if ticket == per_request - 1:
            tl.store(tickets_ptr + b, 0)  # ready for the next call / graph replay

            rows = tl.arange(0, BLOCK_ROWS)
            chunks = tl.arange(0, BLOCK_CHUNKS)
            live = (rows[:, None] <= k) & (chunks[None, :] < num_chunks)
            slots = b * per_request + rows[:, None] * num_chunks + chunks[None, :]
            # .cg: read from L2, where the other programs' writes are visible.
            part_max = tl.load(part_max_ptr + slots, mask=live, other=float("-inf"), cache_modifier=".cg")
            part_argmax = tl.load(part_argmax_ptr + slots, mask=live, other=2147483647, cache_modifier=".cg")
            # Chunks are in index order, so the lowest index wins ties again.
            part_nan = part_max != part_max
            row_first_nan = tl.min(tl.where(part_nan, part_argmax, 2147483647), axis=1)
            row_max = tl.max(tl.where(part_nan, float("-inf"), part_max), axis=1)
            row_argmax = tl.min(tl.where(part_max == row_max[:, None], part_argmax, 2147483647), axis=1)
            argmax = tl.where(row_first_nan < 2147483647, row_first_nan, row_argmax).to(tl.int64)

            is_draft = rows < k
            draft = tl.load(draft_ptr + b.to(tl.int64) * draft_row_stride + rows, mask=is_draft, other=-1)
            draft = draft.to(tl.int64)
            in_vocab = is_draft & (draft >= 0) & (draft < vocab)
            if TYPICAL:
                part_entropy = tl.load(part_entropy_ptr + slots, mask=live, other=0.0, cache_modifier=".cg")
                neg_entropy = tl.sum(part_entropy, axis=1)  # sum p log(p + eps) = -H
                safe_draft = tl.where(in_vocab, draft, 0)
                draft_prob = tl.load(request_ptr + rows.to(tl.int64) * target_row_stride + safe_draft,
                                     mask=in_vocab, other=0.0).to(tl.float32)
                posterior = posterior_alpha * tl.exp(neg_entropy)
                # min(threshold, posterior), NaN if either is NaN (torch.minimum).
                limit = tl.where(posterior < posterior_threshold, posterior, posterior_threshold)
                not_nan = (posterior == posterior) & (posterior_threshold == posterior_threshold)
                accepted = in_vocab & not_nan & (draft_prob > limit)
            else:
                accepted = in_vocab & (draft == argmax)

            first_rejected = tl.min(tl.where(is_draft & (accepted == 0), rows, k), axis=0)
            out = tl.where(rows < first_rejected, draft, tl.where(rows == first_rejected, argmax, -1))
            tl.store(out_ptr + b.to(tl.int64) * (k + 1) + rows, out.to(out_ptr.dtype.element_ty),
                     mask=rows <= k)
            if COUNT:
                # Every emitted entry is a valid id (>= 0): first_rejected + 1 of them.
                add_counters_tl(counters_ptr, tl.sum(accepted.to(tl.int64), axis=0), first_rejected + 1,
                                tl.sum(is_draft.to(tl.int64), axis=0))


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return sm_count(device)


def _plan(batch: int, k: int, vocab: int, device: torch.device, block_v=None, num_chunks=None):
    """(BLOCK_V, chunk_len, num_chunks): split rows into chunks until the GPU has enough programs."""
    if block_v is None:
        block_v = min(_MAX_BLOCK_V, max(16, triton.next_power_of_2(vocab)))
    if num_chunks is None:
        wanted = triton.cdiv(_PROGRAMS_PER_SM * _sm_count(device), batch * (k + 1))
        num_chunks = max(1, min(wanted, triton.cdiv(vocab, _MIN_CHUNK)))
    chunk_len = triton.cdiv(triton.cdiv(vocab, num_chunks), block_v) * block_v
    return block_v, chunk_len, triton.cdiv(vocab, chunk_len)


def _launch(target, draft_token_ids, counters, typical, posterior_threshold=0.0, posterior_alpha=0.0,
            block_v=None, num_chunks=None):
    """One launch of the verification kernel (inputs already validated)."""
    batch, k = draft_token_ids.shape
    vocab = target.shape[2]
    device = draft_token_ids.device
    out = torch.empty((batch, k + 1), dtype=draft_token_ids.dtype, device=device)
    if batch == 0:
        return out
    block_v, chunk_len, num_chunks = _plan(batch, k, vocab, device, block_v, num_chunks)
    num_programs = batch * (k + 1) * num_chunks
    part_max = torch.empty(num_programs, dtype=torch.float32, device=device)
    part_argmax = torch.empty(num_programs, dtype=torch.int32, device=device)
    part_entropy = torch.empty(num_programs, dtype=torch.float32, device=device) if typical else part_max
    _verify_kernel[(num_programs,)](
        target, draft_token_ids, out, out if counters is None else counters,
        part_max, part_argmax, part_entropy, zeroed_scratch(device, batch),
        k, vocab, target.stride(0), target.stride(1), draft_token_ids.stride(0),
        chunk_len, num_chunks, float(posterior_threshold), float(posterior_alpha),
        TYPICAL=typical, COUNT=counters is not None,
        BLOCK_V=block_v, BLOCK_ROWS=triton.next_power_of_2(k + 1),
        BLOCK_CHUNKS=max(2, triton.next_power_of_2(num_chunks)),
        num_warps=8 if block_v >= 2048 else 4,
    )
    return out


def _greedy_verify_triton(target_logits, draft_token_ids):
    _check_inputs(_GREEDY, "target_logits", target_logits, draft_token_ids)
    return _launch(target_logits, draft_token_ids, None, typical=False)


def _greedy_verify_counted_triton(target_logits, draft_token_ids, counters):
    _check_inputs(_GREEDY, "target_logits", target_logits, draft_token_ids, counters)
    return _launch(target_logits, draft_token_ids, counters, typical=False)


def _typical_acceptance_triton(target_probs, draft_token_ids, posterior_threshold=0.09, posterior_alpha=0.3):
    _check_inputs(_TYPICAL, "target_probs", target_probs, draft_token_ids)
    return _launch(target_probs, draft_token_ids, None, True, posterior_threshold, posterior_alpha)


def _typical_acceptance_counted_triton(target_probs, draft_token_ids, posterior_threshold, posterior_alpha,
                                       counters):
    _check_inputs(_TYPICAL, "target_probs", target_probs, draft_token_ids, counters)
    return _launch(target_probs, draft_token_ids, counters, True, posterior_threshold, posterior_alpha)


register_cuda("greedy_verify", _greedy_verify_triton)
register_cuda("greedy_verify.counted", _greedy_verify_counted_triton)
register_cuda("typical_acceptance", _typical_acceptance_triton)
register_cuda("typical_acceptance.counted", _typical_acceptance_counted_triton)

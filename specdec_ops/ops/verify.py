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

The output [B, k+1] is `create_output` (specdec_ops/ops/output.py) applied to
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

CUDA kernel (Triton, kernels/verify.py): ONE launch of B * (k+1) * C programs. Program
(b, i, c) streams chunk c of row i of request b (BLOCK_V entries per step,
lane-wise running argmax and entropy terms), writes its chunk's (max, argmax,
entropy part) to a per-call scratch buffer, and takes a ticket from a
per-request atomic counter (acq_rel). The program that draws the last ticket
combines the (k+1) * C partials in a fixed order, decides acceptance, writes
the output row, adds the counters atomically and sets the ticket back to 0,
so every call (and every CUDA graph replay) starts from zeroed tickets with no
memset launch. C (chunks per row) depends only on shapes: more chunks when B
is small so the whole GPU reads V. The tickets live in one persistent buffer
per device (`kernels/scratch.py`, shared with rejection_sample), so two
such calls running concurrently on different streams of one device would race
on them; serialise such calls (or give each stream its own process). No host
sync, no host-side data: graph-capturable.
"""
from __future__ import annotations

import torch

from .._library import register_fake
from .checks import INT_DTYPES, check_counters, check_size, check_tensor
from .output import create_output_reference, empty_output_row

GREEDY = "greedy_verify"
TYPICAL = "typical_acceptance"
TARGET_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ENTROPY_EPS = 1e-5


def greedy_verify(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Greedy verification into the [B, k+1] layout; see the module docstring.

    Args:
        target_logits: [B, k+1, V], float16, bfloat16 or float32, unit last stride, V >= 1. The target's logits
            (or probabilities) at the k draft positions and the bonus position.
        draft_token_ids: [B, k], int32 or int64, unit last stride, k >= 1. Ids outside [0, V) are rejected.
        counters: [3], int64, or None. When given (the ``.counted`` overload), (accepted, emitted, proposed) token
            counts are added to it in place.

    Returns:
        [B, k+1], dtype of ``draft_token_ids``: the create_output layout.
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

    Args:
        target_probs: [B, k+1, V], float16, bfloat16 or float32, unit last stride, V >= 1. The target's
            probabilities at the k draft positions and the bonus position.
        draft_token_ids: [B, k], int32 or int64, unit last stride, k >= 1. Ids outside [0, V) are rejected.
        posterior_threshold: float. The acceptance limit's upper bound.
        posterior_alpha: float. The limit's scale on exp(-entropy).
        counters: [3], int64, or None. When given (the ``.counted`` overload), (accepted, emitted, proposed) token
            counts are added to it in place.

    Returns:
        [B, k+1], dtype of ``draft_token_ids``: the create_output layout.
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


def check_inputs(op, target_name, target, draft_token_ids, counters=None) -> None:
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


def check_typical_params(posterior_threshold: float, posterior_alpha: float) -> None:
    """Refuses negative (or NaN) typical-acceptance parameters, strict mode or not."""
    for name, value in (("posterior_threshold", posterior_threshold), ("posterior_alpha", posterior_alpha)):
        if not value >= 0:
            raise ValueError(f"{TYPICAL}: argument '{name}' must be >= 0, got {value}")


@register_fake(GREEDY, ("default", "counted"))
def _greedy_verify_fake(target_logits, draft_token_ids, counters=None):
    check_inputs(GREEDY, "target_logits", target_logits, draft_token_ids, counters)
    return empty_output_row(draft_token_ids)


@register_fake(TYPICAL, ("default", "counted"))
def _typical_acceptance_fake(target_probs, draft_token_ids, posterior_threshold=0.09, posterior_alpha=0.3,
                             counters=None):
    check_inputs(TYPICAL, "target_probs", target_probs, draft_token_ids, counters)
    check_typical_params(posterior_threshold, posterior_alpha)
    return empty_output_row(draft_token_ids)

"""`specdec::advance_draft_step`: moves the draft loop one decode step forward.

Between two decode steps of the draft model every request feeds back the
token it just sampled, one position further on, with one more token of
context. This op does that bookkeeping for a whole batch in one launch:

- ``input_ids`` [n] int32: ``sampled_token_ids`` narrowed to int32, the
  draft model's next input. int32 is what the step-0 buffers and embedding
  lookups use, and every real vocabulary fits; an id outside the int32 range
  wraps (the model clamps ids before its embedding lookup anyway). It is a new
  tensor, so the model's input never aliases the sampler's output.
- ``next_positions`` [n], dtype of ``positions``:
  ``min(positions + 1, max_model_len - 1)``.
- ``next_seq_lens`` [n], dtype of ``seq_lens``:
  ``min(seq_lens + 1, max_model_len)``.

The additions are done in int64, so an int32 input at its maximum clamps
instead of wrapping (``max_model_len`` must fit the output dtype).

Inputs: ``sampled_token_ids``, ``positions`` and ``seq_lens`` are 1-D with the
same length n (n may be 0) and a unit stride, each int32 or int64, on one
device; ``max_model_len >= 1``. Only the upper bounds are clamped (the
contract above); values are not otherwise checked on the device, since that
would need a host sync, and no value can make the kernels access memory out of
bounds (every access is to element i of an n-element tensor).

As the draft loop of vLLM's PlainDraftModelSpeculator uses it: the first
decode step starts from the correction token's position and
``seq_lens - num_rejected + 1`` (clamped), and the sequence length is advanced
before each forward, so a step attends to the KV slot the previous step wrote.

The CUDA kernel (kernels/draft_step.py) is one Triton launch whose grid
depends only on n: no host data, no sync, capturable in a CUDA graph.
"""
from __future__ import annotations

import torch

from .._library import register_fake
from .checks import INT_DTYPES, check_size, check_tensor

_OP = "advance_draft_step"


def advance_draft_step(
    sampled_token_ids: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    max_model_len: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Moves the draft loop one decode step forward; see the module docstring.

    Args:
        sampled_token_ids: [n], int32 or int64, unit stride. The tokens the draft model just sampled.
        positions: [n], int32 or int64, unit stride. Their positions.
        seq_lens: [n], int32 or int64, unit stride. The requests' sequence lengths, the sampled tokens not included.
        max_model_len: int >= 1. Positions are clamped to max_model_len - 1, lengths to max_model_len.

    Returns:
        (input_ids [n] int32, next_positions [n] dtype of positions, next_seq_lens [n] dtype of seq_lens), new
        tensors on the inputs' device.
    """
    return torch.ops.specdec.advance_draft_step.default(sampled_token_ids, positions, seq_lens, max_model_len)


def advance_draft_step_reference(
    sampled_token_ids: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    max_model_len: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-PyTorch statement of the contract; arguments and result as `advance_draft_step`'s."""
    input_ids = sampled_token_ids.to(torch.int32)
    # Widen first so that an int32 value at its maximum does not wrap before the clamp.
    next_positions = torch.clamp(positions.long() + 1, max=max_model_len - 1).to(positions.dtype)
    next_seq_lens = torch.clamp(seq_lens.long() + 1, max=max_model_len).to(seq_lens.dtype)
    return input_ids, next_positions, next_seq_lens


def check_inputs(sampled_token_ids, positions, seq_lens, max_model_len) -> None:
    device = sampled_token_ids.device
    check_tensor(_OP, "sampled_token_ids", sampled_token_ids, ndim=1, dtypes=INT_DTYPES)
    check_tensor(_OP, "positions", positions, ndim=1, dtypes=INT_DTYPES, device=device)
    check_tensor(_OP, "seq_lens", seq_lens, ndim=1, dtypes=INT_DTYPES, device=device)
    n = sampled_token_ids.shape[0]
    check_size(_OP, "positions", positions, 0, n, "n, the length of sampled_token_ids")
    check_size(_OP, "seq_lens", seq_lens, 0, n, "n, the length of sampled_token_ids")
    if max_model_len < 1:
        raise ValueError(f"{_OP}: argument 'max_model_len' must be >= 1, got {max_model_len}")


def empty_outputs(sampled_token_ids, positions, seq_lens):
    return (
        torch.empty_like(sampled_token_ids, dtype=torch.int32),
        torch.empty_like(positions),
        torch.empty_like(seq_lens),
    )


@register_fake(_OP)
def _advance_draft_step_fake(sampled_token_ids, positions, seq_lens, max_model_len):
    check_inputs(sampled_token_ids, positions, seq_lens, max_model_len)
    return empty_outputs(sampled_token_ids, positions, seq_lens)

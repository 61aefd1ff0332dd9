"""specdec_ops: speculative-decoding building blocks as `torch.ops.specdec.*` custom ops.

Importing this package registers every op: schemas and CPU kernels from the
C++ extension, Triton CUDA kernels (when triton is installed) and fake
kernels for torch.compile. The functions below are thin typed wrappers; each
op's contract is documented in its own module.
"""
from . import _library  # noqa: F401  (loads the C++ extension first)
from .draft_step import advance_draft_step, advance_draft_step_reference
from .output import create_output, create_output_reference
from .runtime import BlockPool, DraftProposer, ProposerConfig
from .prefill import PrefillInputs, prepare_prefill, prepare_prefill_into, prepare_prefill_reference
from .ops.logits_sampling import (
    check_sampling_params,
    processed_distribution,
    rejection_sample_logits,
    rejection_sample_logits_reference,
    sample_draft_filtered,
    sample_draft_filtered_reference,
)
from .kernels import logits_sampling as _logits_sampling_kernels  # noqa: F401  (registers the CUDA kernels)
from .sampling import rejection_sample, rejection_sample_reference, sample_draft, sample_draft_reference
from .verify import greedy_verify, greedy_verify_reference, typical_acceptance, typical_acceptance_reference

__all__ = [
    "BlockPool",
    "DraftProposer",
    "ProposerConfig",
    "advance_draft_step",
    "advance_draft_step_reference",
    "PrefillInputs",
    "create_output",
    "create_output_reference",
    "prepare_prefill",
    "prepare_prefill_into",
    "prepare_prefill_reference",
    "check_sampling_params",
    "processed_distribution",
    "rejection_sample_logits",
    "rejection_sample_logits_reference",
    "sample_draft_filtered",
    "sample_draft_filtered_reference",
    "rejection_sample",
    "rejection_sample_reference",
    "sample_draft",
    "sample_draft_reference",
    "greedy_verify",
    "greedy_verify_reference",
    "typical_acceptance",
    "typical_acceptance_reference",
]

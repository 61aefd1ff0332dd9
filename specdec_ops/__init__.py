"""specdec_ops: speculative-decoding building blocks as `torch.ops.specdec.*` custom ops.

Importing this package registers every op: schemas and CPU kernels from the
C++ extension, fake kernels for torch.compile (ops/), and Triton CUDA kernels
(kernels/, when triton is installed). The functions below are thin typed
wrappers; each op's contract is documented in its module under ops/.
"""
from . import _library  # noqa: F401  (loads the C++ extension first)
from ._triton import HAS_TRITON
from .ops.draft_step import advance_draft_step, advance_draft_step_reference
from .ops.output import create_output, create_output_reference
from .ops.prefill import PrefillInputs, prepare_prefill, prepare_prefill_into, prepare_prefill_reference
from .ops.sampling import rejection_sample, rejection_sample_reference, sample_draft, sample_draft_reference
from . import strict as _strict
from .strict import strict_mode, strict_mode_enabled
from .ops.verify import greedy_verify, greedy_verify_reference, typical_acceptance, typical_acceptance_reference
from .runtime import BlockPool, DraftProposer, ProposerConfig
from .ops.logits_sampling import (
    check_sampling_params,
    processed_distribution,
    rejection_sample_logits,
    rejection_sample_logits_reference,
    sample_draft_filtered,
    sample_draft_filtered_reference,
)

if HAS_TRITON:
    from . import kernels  # noqa: F401  (registers the CUDA kernels)

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
    "strict_mode",
    "strict_mode_enabled",
]

# SPECDEC_STRICT=1 turns strict mode on for the importing thread (specdec_ops/strict.py).
_strict._enable_from_environment()

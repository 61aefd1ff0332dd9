"""specdec_ops: speculative-decoding building blocks as `torch.ops.specdec.*` custom ops.

Importing this package registers every op: schemas and CPU kernels from the
C++ extension, Triton CUDA kernels (when triton is installed) and fake
kernels for torch.compile. The functions below are thin typed wrappers; each
op's contract is documented in its own module.
"""
from . import _library  # noqa: F401  (loads the C++ extension first)
from .strict import strict_mode, strict_mode_enabled
from .draft_step import advance_draft_step, advance_draft_step_reference
from .output import create_output, create_output_reference
from .runtime import BlockPool, DraftProposer, ProposerConfig
from .prefill import PrefillInputs, prepare_prefill, prepare_prefill_into, prepare_prefill_reference
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
    "rejection_sample",
    "rejection_sample_reference",
    "sample_draft",
    "sample_draft_reference",
    "greedy_verify",
    "greedy_verify_reference",
    "typical_acceptance",
    "typical_acceptance_reference",
]
__all__ += ["strict_mode", "strict_mode_enabled"]

from .strict import _enable_from_environment  # noqa: E402

_enable_from_environment()

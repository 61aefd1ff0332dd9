"""specdec_ops: speculative-decoding building blocks as `torch.ops.specdec.*` custom ops.

Importing this package registers every op: schemas and CPU kernels from the
C++ extension, Triton CUDA kernels (when triton is installed) and fake
kernels for torch.compile. The functions below are thin typed wrappers; each
op's contract is documented in its own module.
"""
from . import _library  # noqa: F401  (loads the C++ extension first)
from .output import create_output, create_output_reference
from .prefill import PrefillInputs, prepare_prefill, prepare_prefill_into, prepare_prefill_reference

__all__ = [
    "PrefillInputs",
    "create_output",
    "create_output_reference",
    "prepare_prefill",
    "prepare_prefill_into",
    "prepare_prefill_reference",
]

"""Where the Python halves of the ops are registered.

Schemas and CPU kernels come from the C++ extension (csrc/), and so do the
CUDA kernels of prepare_prefill and create_output (C++ launches of their
Triton kernels, see _launch.py). Here the other op modules register their
Triton launchers as CUDA kernels, straight into the dispatcher (no
`torch.library.custom_op` wrapper, so a call costs the dispatch plus the
launch), and every module registers its fake kernel for tracing.
"""
import torch

from . import _C  # noqa: F401  (loads the schemas and the CPU kernels)
from ._triton import HAS_TRITON

_lib = torch.library.Library("specdec", "IMPL")


def register_cuda(name: str, fn) -> None:
    """Registers fn as the CUDA kernel of specdec::<name> when triton is available."""
    if HAS_TRITON:
        _lib.impl(name, fn, "CUDA")


def register_fake(name: str):
    """Decorator registering a fake (meta) kernel for specdec::<name>."""
    return torch.library.register_fake(f"specdec::{name}", lib=_lib)

"""Registration of the ops' Python halves into the `specdec` library.

Schemas and CPU kernels come from the C++ extension (csrc/), and so do the
CUDA kernels of prepare_prefill and create_output (C++ launches of their
Triton kernels, see kernels/launch.py). Each contract module (ops/) registers
one fake kernel per op for all its overloads; each kernel module (kernels/)
registers one Triton entry per op as the CUDA kernel of all its overloads,
straight into the dispatcher (no `torch.library.custom_op` wrapper, so a call
costs the dispatch plus the launch).
"""
from __future__ import annotations

import torch

from . import _C  # noqa: F401  (loads the schemas and the CPU kernels)

_lib = torch.library.Library("specdec", "IMPL")


def _qualified(op: str, overload: str) -> str:
    return op if overload == "default" else f"{op}.{overload}"


def register_fake(op: str, overloads: tuple[str, ...] = ("default",)):
    """Decorator registering one fake (meta) kernel for the given overloads of specdec::<op>.

    The function takes the longest overload's arguments, the extra ones defaulting to None, so that each overload's
    call binds to it.
    """
    def register(fn):
        for overload in overloads:
            torch.library.register_fake(f"specdec::{_qualified(op, overload)}", fn, lib=_lib)
        return fn

    return register


def register_cuda(op: str, fn, overloads: tuple[str, ...] = ("default",)) -> None:
    """Registers fn as the CUDA kernel of the given overloads of specdec::<op> (called by the kernel modules,
    which are imported only when triton is installed)."""
    for overload in overloads:
        _lib.impl(_qualified(op, overload), fn, "CUDA")

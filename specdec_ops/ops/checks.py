"""Input validation shared by the fake kernels and the Triton launchers.

Every failure is a ValueError that names the op, the argument and what was
expected. Fake kernels run these at trace time, so torch.compile reports bad
shapes and dtypes before anything runs. The C++ CPU kernels check the same
things with TORCH_CHECK_VALUE (csrc/checks.h).
"""
from __future__ import annotations

from typing import Sequence

import torch

INT_DTYPES = (torch.int32, torch.int64)
INDEX_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    op: str,
    name: str,
    t,
    *,
    ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
    unit_stride: bool = True,
) -> None:
    """Checks a tensor argument's type, rank, dtype, device and layout."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: argument '{name}' must be a Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(
            f"{op}: argument '{name}' must be {ndim}-D, got shape {tuple(t.shape)}"
        )
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(
            f"{op}: argument '{name}' must have dtype {_dtype_names(dtypes)}, got "
            f"{str(t.dtype).replace('torch.', '')}"
        )
    if device is not None and t.device != device:
        raise ValueError(
            f"{op}: argument '{name}' is on {t.device}, expected {device} like the other inputs"
        )
    if unit_stride and t.dim() > 0 and t.numel() > 1 and t.stride(-1) != 1:
        raise ValueError(f"{op}: argument '{name}' must have a unit stride in its last dimension")


def check_size(op: str, name: str, t: torch.Tensor, dim: int, expected: int, meaning: str) -> None:
    """Checks t.shape[dim] == expected, where `meaning` says where expected comes from."""
    if t.shape[dim] != expected:
        raise ValueError(
            f"{op}: argument '{name}' has size {t.shape[dim]} in dimension {dim}, expected "
            f"{expected} ({meaning}); shape {tuple(t.shape)}"
        )


def check_counters(op: str, counters: torch.Tensor, device: torch.device) -> None:
    """The int64 [3] (accepted, emitted, proposed) statistics of the .counted overloads."""
    check_tensor(op, "counters", counters, ndim=1, dtypes=(torch.int64,), device=device)
    check_size(op, "counters", counters, 0, 3, "accepted, emitted, proposed")

"""A lower-overhead launch path for the small Triton kernels.

`kernel[grid](...)` re-derives the kernel's specialization from every
argument on every call, which costs tens of microseconds of host time, more
than the tiny kernels themselves. Kernels launched through `CachedLaunch`
are declared with `do_not_specialize` (ints) and
`do_not_specialize_on_alignment` (pointers), so one compiled binary is valid
for every call with the same argument dtypes and constexprs; it is compiled
by the normal path on the first call and launched directly afterwards.
Under TRITON_INTERPRET there is no binary, and every call takes the normal
path.
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached: the query is slow for a hot path)."""
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


class CachedLaunch:
    def __init__(self, kernel):
        self.kernel = kernel
        self.binaries = {}

    def __call__(self, grid, args, constexprs=(), **options):
        """Launches kernel[grid](*args, *constexprs, **options); constexprs are the trailing parameters."""
        # Triton passes an int as i32 when it fits and as i64 otherwise: part of the key.
        key = (args[0].device.index, constexprs) + tuple(
            a.dtype if isinstance(a, torch.Tensor) else -(2**31) <= a < 2**31 for a in args
        )
        binary = self.binaries.get(key)
        if binary is not None:
            # A compiled kernel's runner reads all three grid dimensions.
            binary[(grid + (1, 1))[:3]](*args, *constexprs)
            return
        compiled = self.kernel[grid](*args, *constexprs, **options)
        if hasattr(compiled, "__getitem__") and hasattr(compiled, "run"):
            self.binaries[key] = compiled

"""How the ops' Triton kernels are launched: from C++ or from Python, and the rule for which.

The rule: an op launches from C++ when its eager call sits on an engine's per-round host path, so that host time
is the op's cost, and its kernel can run unspecialized (every int in do_not_specialize, every pointer in
do_not_specialize_on_alignment) with a grid that is a closed-form function of shapes and the tile geometry
(kernels/geometry.py): prepare_prefill and create_output. Their CUDA kernels are C++ (csrc/prepare_prefill.cpp,
csrc/create_output.cpp) that check, allocate and launch the binary compiled here, and their Python wrappers enter
the dispatcher from C++ too (csrc/eager_entry.cpp). Every other op launches from Python: the kernels that stream
the vocabulary (rejection_sample, sample_draft, greedy_verify, typical_acceptance) run long enough that host time
does not matter, gain from Triton's alignment specialization (vector loads), and plan their grid on the SM count
and a scratch buffer; advance_draft_step runs inside the captured propose graph, where no host launch remains.

`kernel[grid](...)` re-derives the kernel's specialization from every argument on every call, which costs tens of
microseconds of host time, more than the tiny kernels themselves. Kernels launched through `CachedLaunch` are
declared with `do_not_specialize` (ints) and `do_not_specialize_on_alignment` (pointers), so one compiled binary is
valid for every call with the same argument dtypes and constexprs; it is compiled by the normal path on the first
call and launched directly afterwards. Under TRITON_INTERPRET there is no binary, and every call takes the normal
path (the tests reach the C++-launched kernels that way too).
"""
from __future__ import annotations

import torch


class CachedLaunch:
    """A kernel launched from Python that keeps its compiled binaries, one per argument dtypes, int widths,
    constexprs and options (see the module docstring)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.binaries = {}

    def __call__(self, grid, args, constexprs=(), **options):
        """Launches kernel[grid](*args, *constexprs, **options); constexprs are the trailing parameters."""
        # Triton passes an int as i32 when it fits and as i64 otherwise: part of the key.
        key = (args[0].device.index, constexprs, *options.values()) + tuple(
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


# --- Launching from C++ -------------------------------------------------------------------
# The C++ CUDA kernels (csrc/triton_launch.cpp) check, allocate and launch without entering Python. The first launch
# of each specialization calls `_compile_for_cpp` to compile the Triton kernel and load it; C++ keeps the loaded
# function.

_KERNELS_FOR_CPP = {}
_LOADED_FOR_CPP = []  # the compiled kernels whose functions C++ holds: dropping one would unload its module


def expose_to_cpp(name: str, kernel) -> None:
    """Makes a Triton kernel launchable from C++ under `name`.

    C++ compiles one binary per argument dtypes, int widths and constexprs, and uses it for every value, so no
    runtime parameter may be specialized on its value or alignment.
    """
    params = getattr(kernel, "params", ())  # none under TRITON_INTERPRET, where nothing launches from C++
    loose = [p.name for p in params
             if not p.is_constexpr and not (p.do_not_specialize or p.do_not_specialize_on_alignment)]
    if loose:
        raise ValueError(f"{name}: parameters {loose} must be listed in do_not_specialize (ints) or "
                         f"do_not_specialize_on_alignment (pointers) to be launched from C++")
    _KERNELS_FOR_CPP[name] = kernel


def _compile_for_cpp(name: str, signature: tuple, num_warps: int) -> tuple[int, int, int]:
    """Compiles and loads one specialization; returns (CUfunction handle, dynamic shared memory bytes, warps).

    `signature` lists the kernel's parameters in order: a torch dtype name for a tensor, an int of the argument's
    width (0 for i32, 2**40 for i64) for a runtime int, the value for a constexpr.
    """
    args = [getattr(torch, a) if isinstance(a, str) else a for a in signature]
    compiled = _KERNELS_FOR_CPP[name].warmup(*args, grid=(1,), num_warps=num_warps)
    if compiled is None or not hasattr(compiled, "_init_handles"):
        raise RuntimeError(f"Triton returned no compiled kernel for {name} (TRITON_INTERPRET set, or a cache hook?)")
    compiled._init_handles()
    metadata = compiled.metadata
    needs = [what for what, used in (
        ("more than one CTA", getattr(metadata, "num_ctas", 1) != 1),
        ("global scratch memory", getattr(metadata, "global_scratch_size", 0)),
        ("profiler scratch memory", getattr(metadata, "profile_scratch_size", 0)),
        ("a cooperative launch", getattr(metadata, "launch_cooperative_grid", False)),
        ("programmatic dependent launch", getattr(metadata, "launch_pdl", False)),
        ("sanitizer parameters", "gsan" in str(getattr(metadata, "instrumentation_mode", "") or "")),
    ) if used]
    if needs:
        raise RuntimeError(f"Triton kernel {name} needs {', '.join(needs)}, which the C++ launcher does not set up")
    _LOADED_FOR_CPP.append(compiled)
    return int(compiled.function), int(metadata.shared), int(metadata.num_warps)


def register_provider() -> None:
    """Lets the C++ launchers compile and load Triton kernels through `_compile_for_cpp`."""
    from .. import _C

    _C._set_triton_provider(_compile_for_cpp)

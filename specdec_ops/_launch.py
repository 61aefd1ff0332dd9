"""Launch helpers: a cached Python launch path, the persistent scratch of the ticket kernels, and the Python side
of the C++ launcher.

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


SCRATCH_CAPACITY = 1 << 17  # int64 entries (1 MiB) per device
_scratch: dict[torch.device, torch.Tensor] = {}
_outgrown_scratch: list[torch.Tensor] = []  # kept alive: captured CUDA graphs may still point at them


def zeroed_scratch(device: torch.device, numel: int) -> torch.Tensor:
    """A persistent int64 buffer of at least `numel` zeros on `device`, shared by the ticket kernels.

    A kernel that combines its programs' results through it (atomic tickets and maxima) must set every entry it
    touched back to 0 before it finishes, so each call and each CUDA-graph replay starts from zeros without a
    memset. Calls are ordered by their stream: two streams running such kernels (rejection_sample, greedy_verify,
    typical_acceptance) at the same time on one device would share the buffer, which is not supported.
    """
    scratch = _scratch.get(device)
    if scratch is not None and scratch.numel() >= numel:
        return scratch
    grown = torch.zeros(max(numel, SCRATCH_CAPACITY), dtype=torch.int64, device=device)
    if device.type == "cuda" and (torch.cuda.is_current_stream_capturing() or not _in_default_pool(grown)):
        # Memory of a CUDA-graph pool (a capture, or torch.compile's cudagraph warmup) can be reclaimed by the
        # graph machinery behind a tensor it does not track: these zeros serve this call only (a captured graph
        # replays their memset), and a later call outside any pool allocates the persistent buffer.
        return grown
    if scratch is not None:
        _outgrown_scratch.append(scratch)
    _scratch[device] = grown
    return grown


def _in_default_pool(t: torch.Tensor) -> bool:
    """Whether t's memory is in the CUDA caching allocator's default pool (one snapshot: call rarely)."""
    address = t.data_ptr()
    for segment in torch.cuda.memory_snapshot():
        if segment["address"] <= address < segment["address"] + segment["total_size"]:
            return tuple(segment.get("segment_pool_id", (0, 0))) == (0, 0)
    return False


class CachedLaunch:
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


# --- Kernels launched from C++ ------------------------------------------------------------
# prepare_prefill and create_output have C++ CUDA kernels (csrc/triton_launch.cpp) that check, allocate and launch
# without entering Python. The first launch of each specialization calls `_compile_for_cpp` to compile the Triton
# kernel and load it; C++ keeps the loaded function.

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


def _register_provider() -> None:
    from . import _C
    from ._triton import HAS_TRITON

    if HAS_TRITON:
        _C._set_triton_provider(_compile_for_cpp)


_register_provider()

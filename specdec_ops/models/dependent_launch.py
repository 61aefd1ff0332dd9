"""Programmatic dependent launch (PDL) for the model's Triton kernels on Hopper and newer GPUs.

A decode step at batch 1 is about a hundred short kernels, each of which pays a fixed cost: the launch, the
first loads' latency and the tail of its last programs. With PDL a kernel may start while the kernel before it
in the stream is still running. The model's kernels use it in two steps:

- `release_dependents` at the start of every program lets the next kernel's programs be scheduled as soon as all
  of this kernel's programs have started (and there is room on the SMs). That next kernel releases its own
  dependents at once too, so several kernels can be in flight, all but the oldest waiting.
- `wait_for_producers` blocks until the previous kernel has finished and its stores are visible. Every program
  calls it before its first load of anything an earlier kernel wrote, and before its first store. The one-row
  projection kernels first issue the loads of their first weight tile, which nothing in a step writes, so the
  weight stream of one projection starts under the kernels before it (the launcher turns this off for a weight
  it had to copy first, see linear.py).

Every program waits, unconditionally: a kernel may finish only after its own producer has, so "the previous
kernel has finished" implies that every earlier kernel has too. This rests on every kernel launched with the
attribute waiting like ours: the other kernels of a step (inductor's, cuBLAS's, our tl.dot projections) launch
in ordinary stream order. Inductor's own PDL (TORCHINDUCTOR_ENABLE_PDL=1, off by default) waits only where a
kernel reads its predecessor's output and is not supported together with this. CUDA graphs keep the dependency
when they capture such a launch.

`launch_options(device)` is what the launch sites pass to a kernel call: USE_PDL=True and ``launch_pdl=True`` on
a CUDA device of compute capability 9.0 or newer (not ROCm), unless the environment sets SPECDEC_PDL=0;
USE_PDL=False elsewhere (the interpreter and older GPUs run the same kernels without it). The results do not
depend on it (tests/test_models_fused.py).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENV_VAR = "SPECDEC_PDL"


@functools.lru_cache(maxsize=None)
def _supports_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels launched on `device` use programmatic dependent launch."""
    if device.type != "cuda" or torch.version.hip is not None or os.environ.get(ENV_VAR, "1") == "0":
        return False
    return _supports_pdl(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device, dependent: bool = True) -> dict:
    """Keyword arguments for a Triton launch on `device`: the USE_PDL constexpr and, when on, launch_pdl.
    dependent=False: an ordinary launch in stream order."""
    if dependent and enabled(device):
        return dict(USE_PDL=True, launch_pdl=True)
    return dict(USE_PDL=False)


@triton.jit
def release_dependents(USE_PDL: tl.constexpr):
    """Lets the next kernel in the stream launch once every program of this one has called this (or finished)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_producers(USE_PDL: tl.constexpr):
    """Blocks until the previous kernel in the stream has finished and its memory is visible."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release_and_wait(USE_PDL: tl.constexpr):
    """The start of a program that reads nothing before the wait: `release_dependents`, then `wait_for_producers`."""
    release_dependents(USE_PDL)
    wait_for_producers(USE_PDL)

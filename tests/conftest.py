"""Test setup: on a machine without CUDA, Triton kernels run in the interpreter.

TRITON_INTERPRET must be set before triton is imported, so this runs first.
Kernel tests reach the Triton launchers directly (`_..._triton` functions)
with CPU tensors there; on a GPU they reach them through the dispatcher.
"""
import contextlib
import gc
import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import specdec_ops  # noqa: E402,F401


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device (run scripts/gpu_check.sh on the H200)")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)


@contextlib.contextmanager
def sync_forbidden():
    """Any host sync inside the block raises (torch's sync debug mode); the mode is reset on exit."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def check_outputs_use_torchs_allocator(call):
    """The C++ CUDA launchers allocate past at::empty's dispatch but from its allocator: the tensors call() returns
    must be counted in torch.cuda.memory_allocated and given back when dropped."""
    call()  # compiles the kernel first
    torch.cuda.synchronize()
    gc.collect()
    gc.disable()  # no unrelated CUDA tensor may be collected while the counts are compared
    try:
        before = torch.cuda.memory_allocated()
        outputs = call()
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        assert torch.cuda.memory_allocated() - before >= sum(o.untyped_storage().nbytes() for o in outputs)
        del outputs
        assert torch.cuda.memory_allocated() == before
    finally:
        gc.enable()

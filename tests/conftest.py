"""Test setup: on a machine without CUDA, Triton kernels run in the interpreter.

TRITON_INTERPRET must be set before triton is imported, so this runs first.
The `backend` fixture runs a test on the C++ kernel and on the Triton kernel
(tests/harness.py); the Triton kernels are reached through their kernel
modules' entries with CPU tensors without CUDA, through the dispatcher with it.
"""
import contextlib
import gc
import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_scalars_index_on_numpy_2_4():
    """Triton < 3.7's interpreter turns a scalar (a one-element 1-D array there) into an int with int(array), which
    numpy >= 2.4 refuses ("only 0-dimensional arrays can be converted"), so a kernel's range() over scalar bounds
    raises. Triton 3.7 squeezes the array first; do the same on the older releases."""
    try:
        import triton
        from triton.runtime import interpreter
    except ImportError:
        return
    if tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 7) or not hasattr(interpreter,
                                                                                       "_patch_lang_tensor"):
        return
    patch_lang_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_scalars_index_on_numpy_2_4()

import pytest  # noqa: E402

import specdec_ops  # noqa: E402,F401
from specdec_ops._triton import HAS_TRITON  # noqa: E402
from harness import BACKENDS, Backend  # noqa: E402

# Triton launches on CPU tensors only in the interpreter, which is off where CUDA is.
INTERPRETING = HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def kernel_device():
    """Where a test's Triton kernels run on its own tensors: the GPU where CUDA is, else the CPU through the
    interpreter (the test is skipped without triton or with TRITON_INTERPRET unset)."""
    if HAS_CUDA:
        return torch.device("cuda")
    if not INTERPRETING:
        pytest.skip("runs Triton kernels: needs CUDA, or triton with TRITON_INTERPRET=1")
    return torch.device("cpu")


@pytest.fixture(params=BACKENDS)
def backend(request):
    """The kernel under test: "cpp" (the CPU kernel) or "triton" (the Triton kernel; tests/harness.py)."""
    return Backend(request.param)


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device (run scripts/gpu_check.sh on the H200)")
    skip_interpreter = pytest.mark.skip(reason="runs a Triton kernel on CPU tensors: needs triton and "
                                               "TRITON_INTERPRET=1")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)
        if "interpreter" in item.keywords and not INTERPRETING:
            item.add_marker(skip_interpreter)


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

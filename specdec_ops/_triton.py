"""Whether triton is installed: CPU-only installs work without it.

Only the kernel modules (kernels/) import triton; the package imports them, and so registers the CUDA kernels,
only when HAS_TRITON.
"""
try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised on installs without triton
    HAS_TRITON = False

__all__ = ["HAS_TRITON"]

"""Optional Triton import: CPU-only installs work without triton.

Op modules define their kernels under `if HAS_TRITON:` and register their
CUDA implementations only then.
"""
try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised on installs without triton
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = ["triton", "tl", "HAS_TRITON"]

"""The ops' Triton kernels, one module per op family (imported, and so registered, only when triton is installed).

Each family's module holds its top-level @triton.jit kernels, its launcher and its registration: one Triton entry
per op, the CUDA kernel of all its overloads. Shared pieces: constants.py (named tl.constexpr values), geometry.py
(every tile size), counter_hash.py (the random stream), counters.py (the .counted statistics), output_row.py
(storing the [B, k+1] row), ticket.py (electing the last program of a row), scratch.py (the zeroed scratch those
tickets live in), launch.py (Python and C++ launch paths, and the rule for which an op uses).
"""
from . import draft_step, logits_sampling, output, prefill, sampling, verify  # noqa: F401  (registers the CUDA kernels)
from .launch import register_provider

register_provider()

"""Storing the [B, k+1] output row (ops/output.py's layout) that every verifier writes."""
import triton
import triton.language as tl


@triton.jit
def store_output_row_tl(out_ptr, row, cols, k, values):
    """Stores values (one per column) at columns `cols` <= k of row `row` of the [B, k+1] out_ptr, in its dtype.

    row: int64 scalar; cols: int32 [BLOCK] (a power of two >= k + 1); values: int64 [BLOCK].
    """
    tl.store(out_ptr + row * (k + 1) + cols, values.to(out_ptr.dtype.element_ty), mask=cols <= k)

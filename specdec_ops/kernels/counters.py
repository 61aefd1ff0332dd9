"""The .counted overloads' statistics in Triton: every kernel with a .counted overload adds through this."""
import triton
import triton.language as tl


@triton.jit
def add_counters_tl(counters_ptr, num_accepted, num_emitted, num_proposed):
    """Adds (accepted, emitted, proposed) to counters_ptr [3] int64: one vector atomic, relaxed because plain sums
    need no ordering with other memory (an acq_rel atomic would first wait for all of the program's earlier memory
    operations)."""
    which = tl.arange(0, 4)
    counts = tl.where(which == 0, num_accepted, tl.where(which == 1, num_emitted, num_proposed)).to(tl.int64)
    tl.atomic_add(counters_ptr + which, counts, mask=which < 3, sem="relaxed")

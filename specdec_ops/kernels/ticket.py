"""The last-program ticket: how the programs that share a row elect the one that combines their results.

Each program publishes its partial result, then takes a ticket from the row's counter in the zeroed scratch
(kernels/scratch.py) with an acq_rel atomic add: the release orders the program's publication before its ticket,
and the acquire of the program that draws the last ticket sees every publication. That program writes the row's
output and sets the counter back to 0 (`reset_ticket_tl`), so the next call, or CUDA-graph replay, starts from zero
without a memset.
"""
import triton
import triton.language as tl


@triton.jit
def take_ticket_tl(ticket_ptr):
    """Takes a ticket from the int64 counter at ticket_ptr: 0 for the first program to arrive, and num_programs - 1
    for the last. (The caller compares: it may compute num_programs after the atomic, off its latency.)"""
    return tl.atomic_add(ticket_ptr, 1, sem="acq_rel")


@triton.jit
def reset_ticket_tl(ticket_ptr):
    """Leaves the counter at 0 for the next call (the last program only)."""
    tl.store(ticket_ptr, 0)

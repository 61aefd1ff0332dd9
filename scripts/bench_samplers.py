"""Benchmark of the stochastic samplers (H200; needs CUDA).

rejection_sample for B in 1, 16, 64, 256, k = 4, V in 32000 and 128256,
float32: GPU time per call from replaying a CUDA graph that holds 100 calls
(CUDA events, median of the replays), the effective bandwidth 2*B*V*4 bytes /
time (one p row and one q row per request: the floor of the fused kernel,
which reads full rows only at the rejected/bonus position) and the ratio to
that floor at 4.3 TB/s. The comparison is a vectorized PyTorch sampler that
materializes the residual at every position (torch RNG, then argmax races and
create_output_reference).

Every call of that graph reads the same inputs, so rows that fit in the L2
cache (50 MB on the H200) may be served from it. The "cold" columns replay a
graph whose consecutive calls read different input sets, in turn, enough of
them that the bytes one turn reads add up to at least 4x the L2 size; the set
count divides the graph's call count, so every set is read once per that many
calls. Rows that would need more sets than the graph has calls get "-".

Rows are produced by the functions in BENCHES, each
``fn(batch, vocab, replays) -> list[Row]``; add a function to add rows.

    python scripts/bench_samplers.py [--quick]
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, NamedTuple

import torch

import specdec_ops
from _timing import CALLS_PER_GRAPH, graph_us  # noqa: E402  (scripts/ is on sys.path when run as a script)

K = 4
PEAK_BYTES_PER_S = 4.3e12


class Row(NamedTuple):
    op: str
    batch: int
    vocab: int
    kernel_us: float
    cold_us: float | None  # consecutive calls on different inputs
    floor_bytes: int  # bytes the op must read at least
    torch_us: float | None  # the PyTorch baseline, if any


# --- rejection_sample ------------------------------------------------------------------------------


def rejection_torch(p, draft, q):
    """Speculative sampling in plain vectorized torch ops: residual races at every position."""
    k = draft.shape[1]
    p_x = p[:, :k].gather(2, draft[..., None])[..., 0]
    q_x = q.gather(2, draft[..., None])[..., 0]
    accepted = torch.rand_like(p_x) * q_x < p_x
    residual = (p[:, :k] - q).clamp_(min=0)
    residual_tokens = (residual / torch.empty_like(residual).exponential_()).argmax(-1)
    bonus = (p[:, k] / torch.empty_like(p[:, k]).exponential_()).argmax(-1)
    return specdec_ops.create_output_reference(accepted, residual_tokens, draft, bonus)


def make_rejection_inputs(batch: int, vocab: int, device: str = "cuda", seed: int = 0):
    """A draft model close to the target (acceptance ~0.7), drafts drawn from q."""
    gen = torch.Generator(device=device).manual_seed(batch * 7 + vocab + 1000003 * seed)
    logits = torch.randn(batch, K + 1, vocab, generator=gen, device=device) * 3
    p = torch.softmax(logits, dim=-1)
    q = torch.softmax(logits[:, :K] + torch.randn(batch, K, vocab, generator=gen, device=device), dim=-1)
    draft = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, K)
    seeds = torch.randint(0, 2**62, (batch,), generator=gen, device=device)
    offsets = torch.randint(0, 2**40, (batch,), generator=gen, device=device)
    return p, draft, q, seeds, offsets


def cold_set_count(floor_bytes: int) -> int | None:
    """Input sets a cold graph cycles through: a divisor of CALLS_PER_GRAPH reading >= 4x L2; None if none does."""
    needed = -(-4 * torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size // floor_bytes)
    return next((n for n in range(needed, CALLS_PER_GRAPH + 1) if CALLS_PER_GRAPH % n == 0), None)


def rejection_sample_rows(batch: int, vocab: int, replays: int) -> list[Row]:
    p, draft, q, seeds, offsets = make_rejection_inputs(batch, vocab)
    counters = torch.zeros(3, dtype=torch.int64, device="cuda")
    if batch <= 16:  # the reference is slow (int64 hashing over [B, k+1, V]); spot-check small batches
        expected = specdec_ops.rejection_sample_reference(p, draft, q, seeds, offsets)
        if not torch.equal(specdec_ops.rejection_sample(p, draft, q, seeds, offsets), expected):
            print(f"note: B={batch} V={vocab}: kernel differs from the reference (a last-ulp race tie?)")
    floor = 2 * batch * vocab * 4
    torch_us = graph_us(lambda: rejection_torch(p, draft, q), replays)
    sets = [(p, draft, q, seeds, offsets)]
    rows = []
    for name, with_q, floor_bytes in (("rejection_sample", True, floor),
                                      # Deterministic draft (q one-hot): only p is read.
                                      ("rejection_sample (draft_probs=None)", False, floor // 2)):
        def call(inputs, with_q=with_q):
            p, draft, q, seeds, offsets = inputs
            return specdec_ops.rejection_sample(p, draft, q if with_q else None, seeds, offsets, counters=counters)

        num_sets = cold_set_count(floor_bytes)
        cold_us = None
        if num_sets is not None:
            sets += [make_rejection_inputs(batch, vocab, seed=s) for s in range(len(sets), num_sets)]
            turn = iter(range(10**9))  # warm-up and captured calls take the sets in turn
            cold_us = graph_us(lambda: call(sets[next(turn) % num_sets]), replays)
        rows.append(Row(name, batch, vocab, graph_us(lambda: call(sets[0]), replays), cold_us, floor_bytes,
                        torch_us if with_q else None))
    return rows


BENCHES: list[Callable[[int, int, int], list[Row]]] = [rejection_sample_rows]


def print_table(rows: list[Row]) -> None:
    print("| op | B | V | us/call | GB/s | x floor | cold us/call | cold x floor | torch us | speedup |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        floor_us = r.floor_bytes / PEAK_BYTES_PER_S * 1e6
        cold = f"{r.cold_us:.2f} | {r.cold_us / floor_us:.2f}" if r.cold_us is not None else "- | -"
        torch_cols = (f"{r.torch_us:.2f} | {r.torch_us / r.kernel_us:.1f}x" if r.torch_us is not None
                      else "- | -")
        print(f"| {r.op} | {r.batch} | {r.vocab} | {r.kernel_us:.2f} | {r.floor_bytes / r.kernel_us / 1e3:.0f} | "
              f"{r.kernel_us / floor_us:.2f} | {cold} | {torch_cols} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and replays (smoke run)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_samplers.py needs a CUDA device; nothing measured.")
        return 0
    batches = [1, 64] if args.quick else [1, 16, 64, 256]
    vocabs = [32000] if args.quick else [32000, 128256]
    replays = 5 if args.quick else 20
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | "
          f"triton {__import__('triton').__version__} | k = {K} | float32 | "
          f"GPU time per call from a CUDA graph of {CALLS_PER_GRAPH} calls; "
          f"x floor = time / (floor bytes at {PEAK_BYTES_PER_S / 1e12:.1f} TB/s)\n")
    rows = []
    for bench in BENCHES:
        for vocab in vocabs:
            for batch in batches:
                rows.extend(bench(batch, vocab, replays))
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark of the vocabulary-sized ops: rejection_sample, greedy_verify, typical_acceptance (H200).

For B in 1, 16, 64, 256, k = 4, V in 32000 and 128256, float32: GPU time per call from replaying a CUDA graph
that holds 100 calls (CUDA events, median of the replays; scripts/_timing.py), the effective bandwidth
floor bytes / time and the ratio to that floor at 4.3 TB/s, and a plain-PyTorch formulation of the op. The floor
bytes are what the op must read at least: for rejection_sample 2*B*V*4 (one p row and one q row per request: the
fused kernel reads full rows only at the rejected/bonus position; half that with draft_probs=None), for the
verifiers B*(k+1)*V*4 (every row). The PyTorch comparisons: a sampler that materializes the residual at every
position (torch RNG, then argmax races and create_output_reference), and torch argmax / entropy ops followed by
create_output_reference.

Every call of that graph reads the same inputs, so rows that fit in the L2
cache (50 MB on the H200) may be served from it. The "cold" columns replay a
graph whose consecutive calls read different input sets, in turn, enough of
them that the bytes one turn reads add up to at least 4x the L2 size; the set
count divides the graph's call count, so every set is read once per that many
calls. Rows that would need more sets than the graph has calls get "-".

The cold columns are measured for rejection_sample. Rows are produced by the functions in BENCHES, each
``fn(batch, vocab, timer) -> list[Row]``; add a function to add rows.

    python scripts/bench_vocab.py [--quick] [--device cpu]

``--device cpu`` is a smoke run of the script itself on the C++ kernels (tiny sizes, host wall time, no cold
columns); its figures mean nothing for the GPU.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable, NamedTuple

import torch

import specdec_ops
from _timing import CALLS_PER_GRAPH, graph_us  # noqa: E402  (scripts/ is on sys.path when run as a script)
from specdec_ops.ops.verify import ENTROPY_EPS

K = 4
PEAK_BYTES_PER_S = 4.3e12


class Timer(NamedTuple):
    device: str
    replays: int

    def us(self, fn) -> float:
        """Microseconds per call: CUDA-graph GPU time on CUDA, host wall time (median of 5) on CPU."""
        if self.device == "cuda":
            return graph_us(fn, self.replays)
        fn()
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e6)
        return statistics.median(samples)


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


def make_rejection_inputs(batch: int, vocab: int, device: str, seed: int = 0):
    """A draft model close to the target (acceptance ~0.7), drafts drawn from q."""
    gen = torch.Generator(device=device).manual_seed(batch * 7 + vocab + 1000003 * seed)
    logits = torch.randn(batch, K + 1, vocab, generator=gen, device=device) * 3
    p = torch.softmax(logits, dim=-1)
    q = torch.softmax(logits[:, :K] + torch.randn(batch, K, vocab, generator=gen, device=device), dim=-1)
    draft = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, K)
    seeds = torch.randint(0, 2**62, (batch,), generator=gen, device=device)
    offsets = torch.randint(0, 2**40, (batch,), generator=gen, device=device)
    return p, draft, q, seeds, offsets


def cold_set_count(floor_bytes: int, device: str) -> int | None:
    """Input sets a cold graph cycles through: a divisor of CALLS_PER_GRAPH reading >= 4x L2; None if none does
    (or off CUDA)."""
    if device != "cuda":
        return None
    needed = -(-4 * torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size // floor_bytes)
    return next((n for n in range(needed, CALLS_PER_GRAPH + 1) if CALLS_PER_GRAPH % n == 0), None)


def rejection_sample_rows(batch: int, vocab: int, timer: Timer) -> list[Row]:
    p, draft, q, seeds, offsets = make_rejection_inputs(batch, vocab, timer.device)
    counters = torch.zeros(3, dtype=torch.int64, device=timer.device)
    if batch <= 16:  # the reference is slow (int64 hashing over [B, k+1, V]); spot-check small batches
        expected = specdec_ops.rejection_sample_reference(p, draft, q, seeds, offsets)
        if not torch.equal(specdec_ops.rejection_sample(p, draft, q, seeds, offsets), expected):
            print(f"note: B={batch} V={vocab}: kernel differs from the reference (a last-ulp race tie?)")
    floor = 2 * batch * vocab * 4
    torch_us = timer.us(lambda: rejection_torch(p, draft, q))
    sets = [(p, draft, q, seeds, offsets)]
    rows = []
    for name, with_q, floor_bytes in (("rejection_sample", True, floor),
                                      # Deterministic draft (q one-hot): only p is read.
                                      ("rejection_sample (draft_probs=None)", False, floor // 2)):
        def call(inputs, with_q=with_q):
            p, draft, q, seeds, offsets = inputs
            return specdec_ops.rejection_sample(p, draft, q if with_q else None, seeds, offsets, counters=counters)

        num_sets = cold_set_count(floor_bytes, timer.device)
        cold_us = None
        if num_sets is not None:
            sets += [make_rejection_inputs(batch, vocab, timer.device, seed=s) for s in range(len(sets), num_sets)]
            turn = iter(range(10**9))  # warm-up and captured calls take the sets in turn
            cold_us = timer.us(lambda: call(sets[next(turn) % num_sets]))
        rows.append(Row(name, batch, vocab, timer.us(lambda: call(sets[0])), cold_us, floor_bytes,
                        torch_us if with_q else None))
    return rows


# --- greedy_verify, typical_acceptance -------------------------------------------------------------


def greedy_torch(logits, draft):
    """greedy_verify in torch ops: argmax of every row, compare, format."""
    k = draft.shape[1]
    argmax = logits.argmax(-1)
    accepted = draft == argmax[:, :k]
    return specdec_ops.create_output_reference(accepted, argmax[:, :k], draft, argmax[:, k])


def typical_torch(probs, draft, threshold=0.09, alpha=0.3):
    """typical_acceptance in torch ops (float32 entropy), then format."""
    k = draft.shape[1]
    argmax = probs.argmax(-1)
    entropy = -(probs[:, :k] * torch.log(probs[:, :k] + ENTROPY_EPS)).sum(-1)
    draft_prob = probs[:, :k].gather(-1, draft[..., None]).squeeze(-1)
    accepted = draft_prob > torch.clamp(alpha * torch.exp(-entropy), max=threshold)
    return specdec_ops.create_output_reference(accepted, argmax[:, :k], draft, argmax[:, k])


def make_verify_inputs(batch: int, vocab: int, device: str):
    """Target logits and probabilities; drafts mostly agree with the target, as a well-matched draft model's do."""
    gen = torch.Generator().manual_seed(batch * 7 + vocab)
    logits = torch.randn(batch, K + 1, vocab, generator=gen) * 3
    probs = torch.softmax(logits, dim=-1)
    guess = torch.randint(0, vocab, (batch, K), generator=gen)
    draft = torch.where(torch.rand(batch, K, generator=gen) < 0.8, logits.argmax(-1)[:, :K], guess)
    return logits.to(device), probs.to(device), draft.to(device)


def verify_rows(batch: int, vocab: int, timer: Timer) -> list[Row]:
    logits, probs, draft = make_verify_inputs(batch, vocab, timer.device)
    counters = torch.zeros(3, dtype=torch.int64, device=timer.device)
    cases = [
        ("greedy_verify", lambda: specdec_ops.greedy_verify(logits, draft, counters),
         lambda: greedy_torch(logits, draft)),
        ("typical_acceptance", lambda: specdec_ops.typical_acceptance(probs, draft, counters=counters),
         lambda: typical_torch(probs, draft)),
    ]
    assert torch.equal(cases[0][1](), cases[0][2]()), "greedy kernel disagrees with torch"
    if not torch.equal(cases[1][1](), specdec_ops.typical_acceptance_reference(probs, draft)):
        print("note: typical_acceptance differs from the float64 reference on this input (threshold tie)")
    floor_bytes = batch * (K + 1) * vocab * 4
    return [Row(name, batch, vocab, timer.us(kernel), None, floor_bytes, timer.us(baseline))
            for name, kernel, baseline in cases]


BENCHES: list[Callable[[int, int, Timer], list[Row]]] = [rejection_sample_rows, verify_rows]


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
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of the script")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_vocab.py needs a CUDA device (or --device cpu for a smoke run); nothing measured.")
        return 0
    if args.device == "cpu":
        batches, vocabs = [1, 4], [512]
        where = "CPU smoke run: host wall time of the C++ kernels"
    else:
        batches = [1, 64] if args.quick else [1, 16, 64, 256]
        vocabs = [32000] if args.quick else [32000, 128256]
        where = (f"{torch.cuda.get_device_name()} | triton {__import__('triton').__version__} | "
                 f"GPU time per call from a CUDA graph of {CALLS_PER_GRAPH} calls")
    timer = Timer(args.device, 5 if args.quick else 20)
    print(f"# {where} | torch {torch.__version__} | k = {K} | float32 | "
          f"x floor = time / (floor bytes at {PEAK_BYTES_PER_S / 1e12:.1f} TB/s)\n")
    rows = []
    for bench in BENCHES:
        for vocab in vocabs:
            for batch in batches:
                rows.extend(bench(batch, vocab, timer))
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

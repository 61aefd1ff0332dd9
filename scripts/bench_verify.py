"""Benchmark of greedy_verify and typical_acceptance (H200; needs CUDA).

For B in 1, 16, 64, 256, k = 4, V in 32000 and 128256, float32 target
tensors, reports the GPU time per call from replaying a CUDA graph that holds
100 calls (CUDA events, median of the replays), and the effective bandwidth
B * (k+1) * V * 4 bytes / time, for the Triton kernel and for a plain-PyTorch
formulation (torch argmax / entropy ops, then create_output_reference).

    python scripts/bench_verify.py [--quick]
"""
import argparse
import sys

import torch

import specdec_ops
from specdec_ops.ops.verify import ENTROPY_EPS
from _timing import CALLS_PER_GRAPH, graph_us  # noqa: E402  (scripts/ is on sys.path when run as a script)

K = 4


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


def make_inputs(batch, vocab, device):
    gen = torch.Generator().manual_seed(batch * 7 + vocab)
    logits = torch.randn(batch, K + 1, vocab, generator=gen) * 3
    probs = torch.softmax(logits, dim=-1)
    # Drafts mostly agree with the target, as in a well-matched draft model.
    guess = torch.randint(0, vocab, (batch, K), generator=gen)
    draft = torch.where(torch.rand(batch, K, generator=gen) < 0.8, logits.argmax(-1)[:, :K], guess)
    return logits.to(device), probs.to(device), draft.to(device)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and replays (smoke run)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_verify.py needs a CUDA device; nothing measured.")
        return 0
    batches = [1, 64] if args.quick else [1, 16, 64, 256]
    vocabs = [32000] if args.quick else [32000, 128256]
    replays = 5 if args.quick else 20
    device = "cuda"
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | "
          f"triton {__import__('triton').__version__} | k = {K} | float32 | "
          f"GPU time per call from a CUDA graph of {CALLS_PER_GRAPH} calls\n")
    print("| op | B | V | kernel us | kernel GB/s | torch us | torch GB/s | speedup |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for vocab in vocabs:
        for batch in batches:
            logits, probs, draft = make_inputs(batch, vocab, device)
            counters = torch.zeros(3, dtype=torch.int64, device=device)
            cases = [
                ("greedy_verify", lambda: specdec_ops.greedy_verify(logits, draft, counters),
                 lambda: greedy_torch(logits, draft)),
                ("typical_acceptance", lambda: specdec_ops.typical_acceptance(probs, draft, counters=counters),
                 lambda: typical_torch(probs, draft)),
            ]
            assert torch.equal(cases[0][1](), cases[0][2]()), "greedy kernel disagrees with torch"
            if not torch.equal(cases[1][1](), specdec_ops.typical_acceptance_reference(probs, draft)):
                print("note: typical_acceptance differs from the float64 reference on this input (threshold tie)")
            nbytes = batch * (K + 1) * vocab * 4
            for name, kernel, baseline in cases:
                kernel_us, torch_us = graph_us(kernel, replays), graph_us(baseline, replays)
                print(f"| {name} | {batch} | {vocab} | {kernel_us:.2f} | {nbytes / kernel_us / 1e3:.0f} | "
                      f"{torch_us:.2f} | {nbytes / torch_us / 1e3:.0f} | {torch_us / kernel_us:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

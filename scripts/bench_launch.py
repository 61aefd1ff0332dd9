"""Host overhead floor on this machine: an empty Triton launch and a one-op torch call (needs CUDA).

The eager columns of the other benchmarks are bounded by this, not by the kernels.

    python scripts/bench_launch.py
"""
import sys

import torch
from _timing import eager_us  # noqa: E402  (scripts/ is on sys.path when run as a script)


try:
    import triton
    import triton.language as tl

    @triton.jit
    def empty_kernel(a, b, c, d, e, f, g, h, i, j, k, l, n1, n2, n3, n4, n5, BLOCK: tl.constexpr):
        pass
except ImportError:  # the script then says it needs CUDA and exits
    triton = None


def main():
    if not torch.cuda.is_available() or triton is None:
        print("bench_launch.py needs a CUDA device and triton; nothing measured.")
        return 0
    import specdec_ops

    tensors = [torch.zeros(8, device="cuda") for _ in range(12)]
    x = torch.zeros(3, device="cuda", dtype=torch.long)
    print("| what | eager us per call |")
    print("|---|---:|")
    print(f"| empty Triton kernel, 17 args, kernel[grid](...) | "
          f"{eager_us(lambda: empty_kernel[(65,)](*tensors, 1, 2, 3, 4, 5, BLOCK=128, num_warps=1), 2000, warmup=50):.1f} |")
    print(f"| x.add_(1) on a CUDA tensor | {eager_us(lambda: x.add_(1), 2000, warmup=50):.1f} |")
    accepted = torch.rand(64, 4, device="cuda") < 0.7
    ids = torch.randint(0, 32000, (64, 4), device="cuda")
    bonus = torch.randint(0, 32000, (64, 1), device="cuda")
    counters = torch.zeros(3, dtype=torch.int64, device="cuda")
    print(f"| specdec_ops.create_output(B=64, counters), C++ entry and launch | "
          f"{eager_us(lambda: specdec_ops.create_output(accepted, ids, ids, bonus, counters=counters), 2000, warmup=50):.1f} |")
    print(f"| torch.empty(5, device='cuda') | {eager_us(lambda: torch.empty(5, device='cuda'), 2000, warmup=50):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU time of the models' small-batch projection kernel (specdec_ops/models/linear.py) under candidate tilings, at
the Llama-3.2-1B projections with the fusions the model uses, and of the paged attention under candidate tilings.

Each timing is a CUDA graph of CALLS launches cycling over enough weight copies (> 2x the H200's 50 MB L2) that
every launch streams its weight from HBM; GPU time per launch, median of 5 replays. Prints one line per
(projection, rows, tiling): microseconds and the weight's bandwidth in TB/s; for more than one row, first cuBLAS's
figures for the same projection (with the unfused math, and the GEMM alone). On Hopper the one-row launches use
dependent launch (models/dependent_launch.py), so consecutive launches overlap as they do in a model step; set
SPECDEC_PDL=0 for figures comparable with runs before it.

    python scripts/bench_linear_configs.py            # H200, bf16 (about a minute of kernel compiles)
    options: --rows 1 5 8 --attention --projections qkv+norm ...
"""
from __future__ import annotations

import argparse
import statistics

import torch

from specdec_ops.models import attention
from specdec_ops.models.linear import fused_linear_reference, launch_config, small_batch_linear_triton

CALLS = 40
L2_BYTES = 50 * 2 ** 20
# name: (weight rows, K, fusion): the 1B model's projections as the fused model runs them.
PROJECTIONS = {
    "qkv+norm": (3072, 2048, "norm"),
    "o+residual": (2048, 2048, "residual"),
    "gate_up+norm+silu": (16384, 2048, "norm_gated"),
    "down+residual": (2048, 8192, "residual"),
    "lm_head": (128256, 2048, ""),
}
# (block_n, block_k, warps, stages)
ONE_ROW_TILINGS = [(2, 1024, 4, 3), (4, 1024, 4, 3), (8, 512, 4, 3), (2, 2048, 4, 2), (8, 1024, 8, 3)]
DOT_TILINGS = [(16, 512, 4, 3), (16, 256, 4, 4), (32, 256, 4, 3), (32, 512, 8, 3), (64, 128, 4, 4),
               (16, 128, 4, 6), (32, 128, 4, 5), (16, 256, 2, 4), (32, 128, 2, 6)]


def graph_us(fn) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(2):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            fn(i)
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200_000)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / CALLS)
    return statistics.median(samples)


def sweep_linear(rows_list, names):
    dev = torch.device("cuda")
    for name in names:
        n_weight, k, fusion = PROJECTIONS[name]
        bytes_w = n_weight * k * 2
        copies = max(1, -(-3 * L2_BYTES // bytes_w))
        weights = [torch.randn(n_weight, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
        gated = "gated" in fusion
        n_out = n_weight // 2 if gated else n_weight
        norm_w = torch.ones(k, device=dev, dtype=torch.bfloat16) if "norm" in fusion else None
        for rows in rows_list:
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            residual = torch.randn(rows, n_out, device=dev, dtype=torch.bfloat16) if "residual" in fusion else None
            default = launch_config(rows, n_out, k, gated=gated, norm=norm_w is not None)
            tilings = ONE_ROW_TILINGS if rows == 1 else DOT_TILINGS
            results = []
            if rows > 1:
                # The alternative to the kernel: cuBLAS and the unfused elementwise math, eager, in the same graph
                # (a compiled model fuses the elementwise kernels but runs the same GEMM), and the GEMM alone, a
                # lower bound of that path.
                us = graph_us(lambda i: fused_linear_reference(
                    x, weights[i % copies], norm_weight=norm_w, eps=1e-5, residual=residual, gated=gated))
                print(f"  {name:18s} rows {rows:2d} cuBLAS + unfused math: {us:7.2f} us", flush=True)
                us = graph_us(lambda i: torch.nn.functional.linear(x, weights[i % copies]))
                print(f"  {name:18s} rows {rows:2d} cuBLAS GEMM alone:     {us:7.2f} us "
                      f"{bytes_w / us / 1e6:5.2f} TB/s", flush=True)
            for block_n, block_k, warps, stages in tilings:
                config = dict(block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages,
                              even_k=k % block_k == 0, one_row=rows == 1)
                try:
                    us = graph_us(lambda i: small_batch_linear_triton(
                        x, weights[i % copies], norm_weight=norm_w, eps=1e-5, residual=residual, gated=gated,
                        config=config))
                except Exception as e:  # a tiling that does not compile (shared memory) is reported, not fatal
                    print(f"  {name:18s} rows {rows:2d} {config} failed: {type(e).__name__}", flush=True)
                    continue
                mark = " (default)" if all(config[key] == default[key] for key in
                                           ("block_n", "block_k", "num_warps", "num_stages")) else ""
                results.append((us, block_n, block_k, warps, stages, mark))
            results.sort()
            for us, block_n, block_k, warps, stages, mark in results:
                print(f"  {name:18s} rows {rows:2d} bn {block_n:3d} bk {block_k:4d} w {warps} s {stages}: "
                      f"{us:7.2f} us {bytes_w / us / 1e6:5.2f} TB/s{mark}", flush=True)
        del weights


# (batch, query tokens per request, context): the model's decode and verify steps.
ATTENTION_SHAPES = [(1, 1, 512), (1, 5, 512), (8, 1, 512), (8, 5, 512), (32, 1, 4096), (32, 5, 4096),
                    (128, 1, 4096)]
# (block_n, num_stages, target_programs): context positions per loop step, pipelining depth, and the program count
# below which the context is split (attention.launch_plan's defaults: 64 and 3 for decode steps, 128 and 2 for
# verify steps, 512).
ATTENTION_TILINGS = [(64, 3, 512), (64, 4, 512), (64, 3, 1024), (64, 2, 2048), (128, 3, 512), (128, 4, 512),
                     (128, 3, 1024), (128, 2, 2048), (32, 3, 512)]


def sweep_attention():
    """The paged attention of one layer of the 1B shape (32 heads, 8 KV heads of 64, 16-slot blocks), its split
    length at batch 1 and its tiling everywhere, over enough cache copies that every call reads from HBM."""
    saved_min_split = attention.MIN_SPLIT_LEN
    dev = torch.device("cuda")
    heads, kv_heads, d, block = 32, 8, 64, 16
    for batch, query_len, context in ATTENTION_SHAPES:
        blocks = batch * context // block
        cache_bytes = blocks * block * 2 * kv_heads * d * 2
        caches = [torch.randn(blocks * block, 2, kv_heads, d, device=dev, dtype=torch.bfloat16)
                  for _ in range(max(1, -(-3 * L2_BYTES // cache_bytes)))]
        table = torch.randperm(blocks, device=dev).view(batch, context // block).int()
        tokens = batch * query_len
        q = torch.randn(tokens, heads, d, device=dev, dtype=torch.bfloat16)
        rows = torch.arange(batch, device=dev).repeat_interleave(query_len)
        positions = (context - query_len + torch.arange(query_len, device=dev)).repeat(batch)
        seq_lens = torch.full((tokens,), context, device=dev, dtype=torch.int32)
        floor_us = cache_bytes / 4.3e6
        default = attention.launch_plan(tokens, heads, kv_heads, d, context, query_len)

        def run(plan):
            return graph_us(lambda i: attention.paged_attention_triton(
                q, caches[i % len(caches)], table, rows, positions, seq_lens, block, 0.125, query_len, plan=plan))

        results = []
        for block_n, stages, target in ATTENTION_TILINGS:
            plan = attention.launch_plan(tokens, heads, kv_heads, d, context, query_len, block_n=block_n,
                                         num_stages=stages, target_programs=target)
            mark = " (default)" if plan == default else ""
            results.append((run(plan), f"block_n {block_n:3d} stages {stages} splits {plan['splits']:2d}{mark}"))
        if batch == 1:
            for min_split in (32, 128, 256):
                attention.MIN_SPLIT_LEN = min_split
                plan = attention.launch_plan(tokens, heads, kv_heads, d, context, query_len)
                results.append((run(plan), f"min_split {min_split:3d} splits {plan['splits']:2d}"))
            attention.MIN_SPLIT_LEN = saved_min_split
        for us, what in sorted(results):
            print(f"  attention batch {batch:3d} query_len {query_len} ctx {context:4d} {what}: {us:7.2f} us "
                  f"({us / floor_us:4.2f}x the KV read floor)", flush=True)
        del caches


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5, 8])
    parser.add_argument("--attention", action="store_true",
                        help="also sweep the attention's tilings and, at batch 1, its split length")
    parser.add_argument("--projections", nargs="+", default=list(PROJECTIONS), choices=list(PROJECTIONS))
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.attention:
        sweep_attention()
    sweep_linear(args.rows, args.projections)


if __name__ == "__main__":
    main()

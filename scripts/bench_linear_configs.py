"""GPU time of the models' small-batch projection kernel (specdec_ops/models/linear.py) under candidate tilings, at
the Llama-3.2-1B projections with the fusions the model uses, and of the paged attention under context splits.

Each timing is a CUDA graph of CALLS launches cycling over enough weight copies (> 2x the H200's 50 MB L2) that
every launch streams its weight from HBM; GPU time per launch, median of 5 replays. Prints one line per
(projection, rows, tiling): microseconds and the weight's bandwidth in TB/s. On Hopper the one-row launches use
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
from specdec_ops.models.linear import launch_config, small_batch_linear_triton

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
               (16, 128, 4, 6), (32, 128, 4, 5)]


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


def sweep_attention():
    saved_min_split = attention.MIN_SPLIT_LEN
    dev = torch.device("cuda")
    heads, kv_heads, d, block = 32, 8, 64, 16
    for batch in (1, 8):
        for query_len in (1, 5):
            context = 512
            blocks = batch * context // block
            caches = [torch.randn(blocks * block, 2, kv_heads, d, device=dev, dtype=torch.bfloat16)
                      for _ in range(max(1, -(-3 * L2_BYTES // (blocks * block * 2 * kv_heads * d * 2))))]
            table = torch.randperm(blocks, device=dev).view(batch, context // block).int()
            tokens = batch * query_len
            q = torch.randn(tokens, heads, d, device=dev, dtype=torch.bfloat16)
            rows = torch.arange(batch, device=dev).repeat_interleave(query_len)
            positions = (context - query_len + torch.arange(query_len, device=dev)).repeat(batch)
            seq_lens = torch.full((tokens,), context, device=dev, dtype=torch.int32)
            for min_split in (32, 64, 128, 256, 512):
                attention.MIN_SPLIT_LEN = min_split
                plan = attention.launch_plan(tokens, heads, kv_heads, d, context, query_len)
                us = graph_us(lambda i: attention.paged_attention_triton(
                    q, caches[i % len(caches)], table, rows, positions, seq_lens, block, 0.125, query_len))
                print(f"  attention batch {batch} query_len {query_len} ctx {context} min_split {min_split:3d} "
                      f"splits {plan['splits']:2d}: {us:6.2f} us", flush=True)
    attention.MIN_SPLIT_LEN = saved_min_split


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5, 8])
    parser.add_argument("--attention", action="store_true", help="also sweep the attention's context splits")
    parser.add_argument("--projections", nargs="+", default=list(PROJECTIONS), choices=list(PROJECTIONS))
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.attention:
        sweep_attention()
    sweep_linear(args.rows, args.projections)


if __name__ == "__main__":
    main()

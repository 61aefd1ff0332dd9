"""Prompt prefill A/B: a forward of many tokens with the elementwise kernels (`models/elementwise.py`) against the
plain code, each replayed as a CUDA graph of the eager forward (as `Generator` replays its prefills).

    python scripts/bench_prefill.py                 # H200: bf16, the Llama-3.2-1B-shaped target and its first 2 layers
    python scripts/bench_prefill.py --tokens 128 --json

One request of `--tokens` prompt tokens into an empty paged cache (16-slot blocks); random weights. GPU time per
forward: median over 7 timings of 10 replays (CUDA events), after 3 replays. Also printed: the largest absolute
difference between the two paths' hidden states (bf16 roundings: the norm sums its squares in another order).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specdec_ops.models import LlamaConfig, LlamaModel, elementwise  # noqa: E402
from specdec_ops.models.interface import AttentionMetadata  # noqa: E402

LLAMA_1B = LlamaConfig(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                       intermediate_size=8192, rope_theta=5e5, tie_word_embeddings=True, dtype=torch.bfloat16)
BLOCK_SIZE = 16


def captured_forward(model, tokens: int, plain: bool):
    """(graph, hidden output) of one prefill forward of `tokens` tokens; plain: the plain code's elementwise work."""
    spec = model.kv_cache_spec()
    blocks = -(-tokens // BLOCK_SIZE) + 1  # the request's blocks 1.., after the null block 0
    caches = tuple(torch.zeros(blocks * BLOCK_SIZE, 2, spec.num_kv_heads, spec.head_size, dtype=spec.dtype,
                               device="cuda") for _ in range(spec.num_layers))
    positions = torch.arange(tokens, device="cuda")
    # Position p lives in block p // BLOCK_SIZE + 1 at offset p % BLOCK_SIZE: slot p + BLOCK_SIZE.
    block_table = torch.arange(1, blocks, device="cuda")[None]
    metadata = AttentionMetadata(caches, positions + BLOCK_SIZE, block_table,
                                 torch.zeros(tokens, dtype=torch.int64, device="cuda"), positions + 1, BLOCK_SIZE)
    ids = torch.randint(0, model.vocab_size, (tokens,), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    original = elementwise.runs_elementwise_kernels
    if plain:
        elementwise.runs_elementwise_kernels = lambda x: False
    try:
        with torch.no_grad():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                model(ids, positions, metadata)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = model(ids, positions, metadata)
    finally:
        elementwise.runs_elementwise_kernels = original
    return graph, out


def time_replays(graph) -> float:
    """Median microseconds per replay over 7 timings of 10 replays, after 3 replays."""
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(7):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(10):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 10 * 1e3)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="128,512", help="comma-separated prompt lengths (default 128,512)")
    p.add_argument("--draft-layers", type=int, default=2, help="layers of the target that make the draft")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_prefill: needs a CUDA device", file=sys.stderr)
        return 2
    target = LlamaModel(LLAMA_1B, device="cuda", seed=0)
    rows = []
    for name, model in (("1B-shaped target", target), (f"its first {args.draft_layers} layers",
                                                        target.truncated(args.draft_layers))):
        for tokens in (int(t) for t in args.tokens.split(",")):
            timed = {}
            for variant, plain in (("kernels", False), ("plain", True)):
                graph, out = captured_forward(model, tokens, plain)
                timed[variant] = (time_replays(graph), out.float().clone())
            rows.append(dict(model=name, tokens=tokens, kernels_us=timed["kernels"][0], plain_us=timed["plain"][0],
                             speedup=timed["plain"][0] / timed["kernels"][0],
                             max_abs_diff=(timed["kernels"][1] - timed["plain"][1]).abs().max().item()))
    document = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, dtype="bfloat16", rows=rows)
    if args.json:
        print(json.dumps(document, indent=2))
        return 0
    print(f"## bench_prefill: {document['device']}, torch {document['torch']}, bf16, one request, CUDA graph replays\n")
    print("| model | tokens | kernels (us) | plain code (us) | speedup | max abs difference of the hidden states |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['tokens']} | {r['kernels_us']:.1f} | {r['plain_us']:.1f} | {r['speedup']:.2f}x | "
              f"{r['max_abs_diff']:.3g} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

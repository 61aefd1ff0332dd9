"""Where a LlamaModel step's GPU time goes: the graph-replayed step time and torch.profiler's per-kernel split.

The 1B-shaped target of scripts/bench_model.py (bf16, random weights), one request per row, every request's query
the last tokens of a `--context`-token sequence; the step is the compiled paged forward + logits (fullgraph,
static shapes). Per (batch, query length): the step's time from replays of a CUDA graph of 100 steps
(scripts/_timing.py), then torch.profiler over 10 un-graphed calls of the compiled step: kernels per step, their
summed GPU time (the rest of the graph time is launch gaps) and the largest kernels.

    python3 scripts/profile_model.py [--batches 1 8] [--query-lens 1 5] [--context 512] [--top 12] [--json]
"""
from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from bench_model import TARGET_CONFIG, paged_inputs, set_context, time_step  # noqa: E402  (scripts/ on sys.path)
from specdec_ops.models import LlamaModel


def profile_step(model, batch: int, query_len: int, context: int, top: int) -> dict:
    device = torch.device("cuda")
    buffers, metadata = paged_inputs(model, batch, query_len, context, device)
    set_context(buffers, metadata, query_len, context)

    def step():
        return model.compute_logits(model(buffers["ids"], buffers["positions"], metadata))

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    calls = 10
    with torch.no_grad():
        graph_us = time_step(compiled, device, False) * 1e3
        for _ in range(3):
            compiled()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                compiled()
            torch.cuda.synchronize()
    kernels = []
    for event in prof.key_averages():
        total = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        if total > 0:
            kernels.append(dict(name=event.key, us=total / calls, count=event.count // calls))
    kernels.sort(key=lambda k: -k["us"])
    torch._dynamo.reset()
    return dict(batch=batch, query_len=query_len, context=context, graph_us=graph_us,
                kernels_per_step=sum(k["count"] for k in kernels), kernel_us=sum(k["us"] for k in kernels),
                top=kernels[:top])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="*", default=[1])
    parser.add_argument("--query-lens", type=int, nargs="*", default=[1, 5])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--top", type=int, default=12, help="kernels listed per step")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("profile_model: needs a CUDA device")
        return 2
    for name, value in (("--context", args.context), ("--top", args.top)):
        if value < 1:
            parser.error(f"{name} must be >= 1")
    if any(q < 1 or q > args.context for q in args.query_lens) or any(b < 1 for b in args.batches):
        parser.error("--batches must be >= 1 and --query-lens in [1, --context]")
    torch._dynamo.config.cache_size_limit = 64
    model = LlamaModel(TARGET_CONFIG, device=torch.device("cuda"), seed=0)
    rows = [profile_step(model, batch, query_len, args.context, args.top)
            for batch in args.batches for query_len in args.query_lens]
    if args.json:
        print(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), indent=1))
        return 0
    for row in rows:
        print(f"\n## batch {row['batch']}, {row['query_len']} token(s) per request, context {row['context']}: "
              f"graph {row['graph_us']:.1f} us per step, {row['kernels_per_step']} kernels, kernel sum "
              f"{row['kernel_us']:.1f} us (launch gaps {row['graph_us'] - row['kernel_us']:.1f} us)\n")
        print("| kernel | us per step | launches | us each |\n|---|---:|---:|---:|")
        for k in row["top"]:
            print(f"| {k['name'][:60]} | {k['us']:.1f} | {k['count']} | {k['us'] / max(k['count'], 1):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

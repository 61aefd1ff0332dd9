"""Benchmark of rejection_sample_logits (verification from logits with sampling parameters).

For k = 4, V in 32000 and 128256, B in 1, 16, 64, 256, target logits in bfloat16 and float32, filters passed as
None (``none``: off for the batch, no filter pass; temperature 1), given but off in every row (``off``: top_k 0,
top_p 1, min_p 0) and on (temperature 0.8, top-k 50, top-p 0.9): time per call of

- ``logits``: rejection_sample_logits with draft_logits (the draft's logits in the target's dtype);
- ``probs``: rejection_sample_logits with draft_probs (float32 q, as sample_draft_filtered writes it);
- ``block``: the ``logits`` call with block verification;
- ``torch``: the plain-PyTorch pipeline on the same inputs: temperature, sort-based top-k/top-p and softmax over
  the target and draft logits (writing [B, k+1, V] and [B, k, V] probabilities), then specdec_ops.rejection_sample.

Inputs (``--inputs``): ``peaked`` rows are LLM-like: a bulk of N(0, 2^2) logits and 64 tokens per row lifted by
4 + Exp(mean 4), so that the top token leads the median by about 15 and top-p 0.9 keeps a handful to a few dozen
tokens; ``flat`` rows are N(0, 3^2) everywhere (no leading tokens: top-k's cut-off lies in a dense region, the harder
case for the threshold search); ``outlier`` rows (``--cases``) are N(0, 45^2) with one token lifted by 1300, as the
rows of a random-weight model with tied embeddings look (a token's own embedding dominates): the top-k cut-off lies
far below the maximum. The draft's logits are the target's plus N(0, 1) noise. Filters off, the kernels'
work does not depend on the values, so the default cases time only the filtered rows on both peaked and flat
inputs.

On CUDA the time is GPU microseconds per call from replays of a CUDA graph of 100 calls (scripts/_timing.py), and
"x floor" is the time over the read floor: the target and draft inputs read once at 4.3 TB/s (the ``probs`` row
counts its float32 q). "x read" is the time over a measured read of the same inputs on the same GPU (``torch.amax``
of each input, which streams it once: the floor as this GPU reaches it, launches included), so that a run on a GPU
slower than the floor's 4.3 TB/s (an H100) still says how far from its own memory the op is. On CPU (``--device
cpu``) the time is host wall-clock per call, smaller sizes, for a smoke run of the script itself; the floor and read
columns are then omitted.

    python scripts/bench_logits_sampling.py [--quick] [--device cuda|cpu] [--geometry block_v=2048,num_warps=8]

``--quick``: V = 32000 and B = 1, 64, 256 (the target sizes) only; without it the whole grid (about 4 minutes on an
H200).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import specdec_ops

K = 4
PEAK_BYTES_PER_S = 4.3e12
# none: top_k, top_p and min_p passed as None (off for the whole batch: no filter pass), as the generator does
# without sampling filters; off: the same values as tensors of off values.
FILTERS = {"none": (1.0, None, None, None), "off": (1.0, 0, 1.0, 0.0), "top-k+top-p": (0.8, 50, 0.9, 0.0)}


def make_logits(shape, inputs, gen, device):
    if inputs == "flat":
        return torch.randn(*shape, generator=gen, device=device) * 3
    if inputs == "outlier":
        logits = torch.randn(*shape, generator=gen, device=device) * 45
        logits[..., 17] += 1300
        return logits
    logits = torch.randn(*shape, generator=gen, device=device) * 2
    lead = torch.rand(*shape, generator=gen, device=device).argsort(-1)[..., :64]
    lift = 4 + torch.empty(*shape[:-1], 64, device=device).exponential_(1 / 4, generator=gen)
    return logits.scatter_add_(-1, lead, lift)


def make_inputs(batch, vocab, dtype, filters, device, inputs="peaked", seed=0):
    gen = torch.Generator(device=device).manual_seed(batch * 7 + vocab + seed)
    target = make_logits((batch, K + 1, vocab), inputs, gen, device)
    draft_logits = target[:, :K] + torch.randn(batch, K, vocab, generator=gen, device=device)
    t, top_k, top_p, min_p = FILTERS[filters]
    params = (torch.full((batch,), t, device=device),
              None if top_k is None else torch.full((batch,), top_k, device=device, dtype=torch.int32),
              None if top_p is None else torch.full((batch,), top_p, device=device),
              None if min_p is None else torch.full((batch,), min_p, device=device))
    q = torch.empty(batch, K, vocab, device=device)
    seeds = torch.randint(0, 2**62, (batch,), generator=gen, device=device)
    offsets = torch.randint(0, 2**40, (batch,), generator=gen, device=device)
    draft_logits = draft_logits.to(dtype).contiguous()
    tokens = [specdec_ops.sample_draft_filtered(draft_logits[:, s], *params, seeds, offsets + s, probs=q[:, s])
              for s in range(K)]
    return target.to(dtype), torch.stack(tokens, 1), draft_logits, q, params, seeds, offsets


def torch_processed(logits, temperature, top_k, top_p, filtered: bool):
    """The usual engine pipeline: temperature, then sort-based top-k and top-p masks, then softmax."""
    z = logits.float() / temperature[:, None, None]
    if filtered:
        sorted_z, order = z.sort(-1, descending=True)
        sorted_p = sorted_z.softmax(-1)
        past_p = (sorted_p.cumsum(-1) - sorted_p) > top_p[:, None, None]
        rank = torch.arange(z.shape[-1], device=z.device)
        past_k = (rank >= top_k[:, None, None]) & (top_k[:, None, None] > 0)
        z = torch.empty_like(z).scatter_(-1, order, sorted_z.masked_fill(past_p | past_k, float("-inf")))
    return z.softmax(-1)


def time_us(fn, device, replays):
    if device == "cuda":
        from _timing import graph_us  # noqa: E402  (scripts/ is on sys.path when run as a script)

        return graph_us(fn, replays)
    fn()
    samples = []
    for _ in range(replays):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def bench(batch, vocab, dtype, filters, inputs, device, replays, ops=("logits", "probs", "block"), pipeline=True):
    target, draft, draft_logits, q, params, seeds, offsets = make_inputs(batch, vocab, dtype, filters, device, inputs)
    temperature, top_k, top_p, min_p = params
    counters = torch.zeros(3, dtype=torch.int64, device=device)
    elem = target.element_size()
    calls = {
        "logits": (lambda: specdec_ops.rejection_sample_logits(
            target, draft, *params, seeds, offsets, draft_logits=draft_logits, counters=counters),
            (2 * K + 1) * batch * vocab * elem, (target, draft_logits)),
        "probs": (lambda: specdec_ops.rejection_sample_logits(
            target, draft, *params, seeds, offsets, draft_probs=q, counters=counters),
            (K + 1) * batch * vocab * elem + K * batch * vocab * 4, (target, q)),
        "block": (lambda: specdec_ops.rejection_sample_logits(
            target, draft, *params, seeds, offsets, draft_logits=draft_logits, block_verification=True,
            counters=counters), (2 * K + 1) * batch * vocab * elem, (target, draft_logits)),
    }
    calls = {name: call for name, call in calls.items() if name in ops}
    filtered = filters == "top-k+top-p"

    def torch_pipeline():
        p = torch_processed(target, temperature, top_k, top_p, filtered)
        q_torch = torch_processed(draft_logits, temperature, top_k, top_p, filtered)
        return specdec_ops.rejection_sample(p, draft, q_torch, seeds, offsets, counters=counters)

    if batch <= 16 and vocab <= 32000:  # spot check against the reference (CPU) before timing
        for name, kwargs in (("logits", dict(draft_logits=draft_logits)), ("probs", dict(draft_probs=q)),
                             ("block", dict(draft_logits=draft_logits, block_verification=True))):
            if name not in ops:
                continue
            got = specdec_ops.rejection_sample_logits(target, draft, *params, seeds, offsets, **kwargs)
            cpu = {key: value.cpu() if isinstance(value, torch.Tensor) else value for key, value in kwargs.items()}
            expected = specdec_ops.rejection_sample_logits_reference(
                target.cpu(), draft.cpu(), *(None if t is None else t.cpu() for t in params), seeds.cpu(),
                offsets.cpu(), **cpu)
            if not torch.equal(got.cpu(), expected):
                print(f"note: {name} B={batch} V={vocab} {dtype} {filters} {inputs}: differs from the reference in "
                      f"{int((got.cpu() != expected).any(1).sum())} of {batch} rows (a near-tie, or a bug)")
    torch_us = time_us(torch_pipeline, device, max(3, replays // 2)) if pipeline else None
    rows = []
    read_times = {}  # the logits and block calls read the same inputs: time their read once
    for name, (fn, floor_bytes, read) in calls.items():
        us = time_us(fn, device, replays)
        key = tuple(map(id, read))
        if device == "cuda" and key not in read_times:
            read_times[key] = time_us(lambda: [tensor.amax() for tensor in read], device, replays)
        read_us = read_times.get(key)
        rows.append((name, str(dtype).replace("torch.", ""), filters, inputs, batch, vocab, us, floor_bytes, read_us,
                     torch_us if name == ops[0] else None))
    return rows


HEADER = ("| op | dtype | filters | inputs | B | V | us/call | x floor | read us | x read | torch pipeline us "
          "| speedup |\n"
          "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")


def print_rows(rows, device):
    for name, dtype, filters, inputs, batch, vocab, us, floor_bytes, read_us, torch_us in rows:
        floor = f"{us / (floor_bytes / PEAK_BYTES_PER_S * 1e6):.2f}" if device == "cuda" else "-"
        read = f"{read_us:.2f} | {us / read_us:.2f}" if read_us is not None else "- | -"
        torch_cols = f"{torch_us:.1f} | {torch_us / us:.1f}x" if torch_us is not None else "- | -"
        print(f"| {name} | {dtype} | {filters} | {inputs} | {batch} | {vocab} | {us:.2f} | {floor} | {read} | "
              f"{torch_cols} |",
              flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and replays (smoke run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--geometry", default="", help="override entries of LOGITS_SAMPLING in "
                        "specdec_ops/kernels/geometry.py, e.g. 'block_v=2048,num_warps=8,max_chunk=4096'")
    parser.add_argument("--batches", default="", help="comma-separated B values instead of the default set")
    parser.add_argument("--vocabs", default="", help="comma-separated V values instead of the default set")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated logit dtypes")
    parser.add_argument("--cases", default="none:peaked,off:peaked,top-k+top-p:peaked,top-k+top-p:flat",
                        help="comma-separated filters:inputs pairs (filters none, off or top-k+top-p; inputs peaked, "
                        "flat or outlier)")
    parser.add_argument("--ops", default="logits,probs,block", help="which calls to time (the torch pipeline is "
                        "compared with the first)")
    parser.add_argument("--no-pipeline", action="store_true", help="do not time the plain-PyTorch pipeline")
    args = parser.parse_args()
    from specdec_ops.kernels.geometry import LOGITS_SAMPLING as geometry

    for item in filter(None, args.geometry.split(",")):
        name, value = item.split("=")
        if name not in geometry:
            parser.error(f"--geometry: no entry {name!r} in LOGITS_SAMPLING (specdec_ops/kernels/geometry.py)")
        geometry[name] = int(value)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA device; run with --device cpu for a smoke run")
            return 1
        batches = [1, 64, 256] if args.quick else [1, 16, 64, 256]
        vocabs = [32000] if args.quick else [32000, 128256]
        replays = 5 if args.quick else 10
        print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | triton "
              f"{__import__('triton').__version__} | k = {K} | GPU us per call from CUDA-graph replays; x floor = "
              f"time / (inputs read once at {PEAK_BYTES_PER_S / 1e12:.1f} TB/s) | geometry {geometry}\n")
    else:
        batches = [1, 4] if args.quick else [1, 16]
        vocabs = [2000] if args.quick else [32000]
        replays = 3
        print(f"# CPU smoke run | torch {torch.__version__} | k = {K} | host wall-clock us per call\n")
    batches = [int(b) for b in args.batches.split(",")] if args.batches else batches
    vocabs = [int(v) for v in args.vocabs.split(",")] if args.vocabs else vocabs
    print(HEADER, flush=True)
    for name in args.dtypes.split(","):
        if name not in ("bfloat16", "float16", "float32"):
            parser.error(f"--dtypes: expected bfloat16, float16 or float32, got {name!r}")
    cases = [tuple(case.split(":")) for case in args.cases.split(",")]
    for filters, inputs in cases:
        if filters not in FILTERS or inputs not in ("peaked", "flat", "outlier"):
            parser.error(f"--cases: unknown case {filters}:{inputs}")
    for vocab in vocabs:
        for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
            for filters, inputs in cases:
                for batch in batches:
                    print_rows(bench(batch, vocab, dtype, filters, inputs, args.device, replays,
                                     tuple(args.ops.split(",")), not args.no_pipeline), args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())

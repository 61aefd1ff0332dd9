"""Benchmark of the seed ops: prepare_prefill and create_output (H200; needs CUDA).

For num_reqs (or B) in 1, 8, 64, 256, 1024 with k = 4, reports per call:
- eager: host wall time of a Python loop of calls (dispatch + launch included), after a sync, both for the
  library's wrapper (its eager entry, csrc/eager_entry.cpp) and for the torch.ops call of the op;
- graph: GPU time from replaying a CUDA graph that holds 100 calls, timed with CUDA events (a spin kernel queued
  first keeps the host's submission of the graph out of the span: scripts/_timing.py);
for each op and for a plain-PyTorch formulation of it (vectorized torch ops, no custom kernel).
A second table times prepare_prefill (graph only) on batches with k = 8 or with whole prompts. A third
gives this host's floor at each size (graph only): an empty kernel on each op's grid, and on the same grid
the chains of dependent memory accesses each op's contract cannot avoid. For prepare_prefill: a gather
through idx_mapping (the correction token's two dependent loads, then a store), and the request chain,
every per-request access (five loads indexed by the request, the three loads they address, three stores);
for create_output one load and a store per row. x.add_(1), timed eager before and after the tables, gauges
the host's speed. A fourth table checks the graph timing on the two ops' kernels: the same figure with the host's
submission of the graph inside the span, and the slope between graphs of 100 and 300 calls, from which the fixed
cost of starting a replay cancels out. The last one gives this host's launch floor, which bounds every eager column: an empty Triton launch with 17
arguments through kernel[grid](...), a one-op torch call, torch.empty, and create_output's C++ entry and launch.

    python scripts/bench_ops.py [--quick]
"""
import argparse
import sys

import torch
import triton
import triton.language as tl

import specdec_ops
from _timing import eager_us, graph_slope_us, graph_us  # noqa: E402  (scripts/ is on sys.path when run as a script)
from specdec_ops.kernels import prefill as prefill_kernels
from specdec_ops.kernels.geometry import LAUNCHED_FROM_CPP

# The ops' launch geometry (kernels/geometry.py), so the floor kernels run on the same grids. The floor kernels
# let Triton specialize on their sizes and alignment (the ops' kernels do not), so if anything they are faster.
GEOMETRY = LAUNCHED_FROM_CPP


@triton.jit
def empty_kernel(ptr, n):
    pass


@triton.jit
def empty_kernel_17_args(a, b, c, d, e, f, g, h, i, j, k, l, n1, n2, n3, n4, n5, BLOCK: tl.constexpr):
    pass


@triton.jit
def gather_kernel(index_ptr, values_ptr, out_ptr, n, ROWS: tl.constexpr):
    """out[r] = values[index[r]]: two dependent loads and a store per row."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < n
    index = tl.load(index_ptr + rows, mask=live, other=0)
    tl.store(out_ptr + rows, tl.load(values_ptr + index, mask=live, other=0), mask=live)


@triton.jit
def request_chain_kernel(query_start_loc_ptr, num_rejected_ptr, idx_mapping_ptr, seq_lens_ptr, last_sampled_ptr,
                         positions_ptr, input_ids_ptr, out_token_ptr, out_position_ptr, out_seq_len_ptr, n,
                         ROWS: tl.constexpr):
    """Every per-request access of prepare_prefill, one request per row: five loads indexed by the row, the three
    loads they address (correction token, start position, first token), and three stores."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < n
    start = tl.load(query_start_loc_ptr + rows, mask=live, other=0)
    end = tl.load(query_start_loc_ptr + rows + 1, mask=live, other=0)
    rejected = tl.load(num_rejected_ptr + rows, mask=live, other=0)
    slot = tl.load(idx_mapping_ptr + rows, mask=live, other=0)
    seq_len = tl.load(seq_lens_ptr + rows, mask=live, other=0)
    correction = tl.load(last_sampled_ptr + slot, mask=live, other=0)
    position = tl.load(positions_ptr + start, mask=live, other=0)
    token = tl.load(input_ids_ptr + start, mask=live & (rejected < end - start), other=0)
    tl.store(out_token_ptr + rows, correction + token, mask=live)
    tl.store(out_position_ptr + rows, position, mask=live)
    tl.store(out_seq_len_ptr + rows, seq_len, mask=live)


@triton.jit
def copy_kernel(values_ptr, out_ptr, n, ROWS: tl.constexpr):
    """out[r] = values[r]: one load and a store per row."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < n
    tl.store(out_ptr + rows, tl.load(values_ptr + rows, mask=live, other=0), mask=live)


def floor_rows(num_reqs, k, device, replays):
    """Graph us per call of the floor kernels on the grids prepare_prefill and create_output use for this size."""
    prefill, output = GEOMETRY["prepare_prefill"], GEOMETRY["create_output"]
    prefill_grid = prefill_kernels.grid(num_reqs * (k + 1), num_reqs, num_reqs)  # a decode round's batch
    output_grid = (triton.cdiv(num_reqs, output["block_rows"]),)
    index = torch.randperm(num_reqs, device=device).to(torch.int32)
    values = torch.randint(0, 32000, (num_reqs,), device=device, dtype=torch.int32)
    out = torch.empty_like(values)
    batch = make_prefill_batch(num_reqs, k, device)
    out_token, out_position = torch.empty_like(batch["last_sampled"]), torch.empty_like(batch["last_sampled"])
    request_chain_args = (batch["query_start_loc"], batch["num_rejected"], batch["idx_mapping"], batch["seq_lens"],
                          batch["last_sampled"], batch["positions"], batch["input_ids"], out_token, out_position, out,
                          num_reqs)
    return [
        graph_us(lambda: empty_kernel[prefill_grid](out, num_reqs, num_warps=prefill["num_warps"]), replays),
        graph_us(lambda: gather_kernel[prefill_grid](index, values, out, num_reqs, ROWS=prefill["rows"],
                                                     num_warps=prefill["num_warps"]), replays),
        graph_us(lambda: request_chain_kernel[prefill_grid](*request_chain_args, ROWS=prefill["rows"],
                                                            num_warps=prefill["num_warps"]), replays),
        graph_us(lambda: empty_kernel[output_grid](out, num_reqs, num_warps=output["num_warps"]), replays),
        graph_us(lambda: copy_kernel[output_grid](values, out, num_reqs, ROWS=output["block_rows"],
                                                  num_warps=output["num_warps"]), replays),
    ]


def prepare_prefill_torch(input_ids, positions, query_start_loc, seq_lens, idx_mapping, last_sampled, num_rejected,
                          max_model_len, max_num_reqs):
    """prepare_prefill in plain torch ops (no host sync), the way an engine would write it without a kernel."""
    num_tokens, num_reqs = input_ids.shape[0], seq_lens.shape[0]
    total = num_tokens + num_reqs
    device = input_ids.device
    out_start = query_start_loc[:-1] + torch.arange(num_reqs, device=device, dtype=query_start_loc.dtype)
    slots = torch.arange(total, device=device)
    req = torch.searchsorted(out_start, slots, right=True) - 1
    offset = slots - out_start[req]
    query_len = (query_start_loc[1:] - query_start_loc[:-1])[req]
    num_valid = query_len - num_rejected[req]
    src = (query_start_loc[:-1][req] + offset).clamp(max=num_tokens - 1)
    ids = torch.where(offset < num_valid, input_ids[src],
                      torch.where(offset == num_valid, last_sampled[idx_mapping[req]].to(input_ids.dtype), 0))
    pos = (positions[query_start_loc[:-1][req]] + offset).clamp(max=max_model_len - 1)
    last = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
    last[:num_reqs] = out_start + (query_start_loc[1:] - query_start_loc[:-1]) - num_rejected
    qsl = torch.full((max_num_reqs + 1,), total, dtype=torch.int32, device=device)
    qsl[:num_reqs] = out_start
    lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
    lens[:num_reqs] = (seq_lens + 1).clamp(max=max_model_len)
    return ids, pos, last, qsl, lens


def make_prefill_batch(num_reqs, k, device, long_queries=None):
    """A decode-round batch: each request verified k drafts plus its previous token (query_len = k + 1).

    long_queries maps request index -> query length, for requests that run a prompt's draft prefill instead.
    """
    query_lens = [k + 1] * num_reqs
    for i, length in (long_queries or {}).items():
        query_lens[i] = length
    num_tokens = sum(query_lens)
    gen = torch.Generator().manual_seed(num_reqs)
    start = torch.randint(0, 2000, (num_reqs,), generator=gen)
    lens = torch.tensor(query_lens)
    return dict(
        input_ids=torch.randint(0, 32000, (num_tokens,), generator=gen, dtype=torch.int32).to(device),
        positions=torch.cat([s + torch.arange(q) for s, q in zip(start.tolist(), query_lens)]).to(device),
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(torch.int32).to(device),
        seq_lens=(start + lens).to(torch.int32).to(device),
        idx_mapping=torch.randperm(num_reqs, generator=gen).to(torch.int32).to(device),
        last_sampled=torch.randint(0, 32000, (num_reqs,), generator=gen).to(device),
        num_rejected=torch.cat([torch.randint(0, q + 1, (1,), generator=gen) for q in query_lens])
        .to(torch.int32).to(device),
        max_model_len=4096,
    )


def make_verified(batch, k, device):
    gen = torch.Generator().manual_seed(batch)
    accepted = torch.rand(batch, k, generator=gen) < 0.7
    draft = torch.randint(0, 32000, (batch, k), generator=gen)
    substitute = torch.randint(0, 32000, (batch, k), generator=gen)
    bonus = torch.randint(0, 32000, (batch, 1), generator=gen)
    return [t.to(device) for t in (accepted, substitute, draft, bonus)]


def print_launch_floor(iters):
    """Host time per call of the cheapest launches: what the eager columns cannot go below on this host."""
    tensors = [torch.zeros(8, device="cuda") for _ in range(12)]
    x = torch.zeros(3, device="cuda", dtype=torch.long)
    accepted = torch.rand(64, 4, device="cuda") < 0.7
    ids = torch.randint(0, 32000, (64, 4), device="cuda")
    bonus = torch.randint(0, 32000, (64, 1), device="cuda")
    counters = torch.zeros(3, dtype=torch.int64, device="cuda")
    print("\nLaunch floor on this host (eager us per call).\n")
    print("| what | eager us per call |")
    print("|---|---:|")
    for what, call in [
        ("empty Triton kernel, 17 args, kernel[grid](...)",
         lambda: empty_kernel_17_args[(65,)](*tensors, 1, 2, 3, 4, 5, BLOCK=128, num_warps=1)),
        ("x.add_(1) on a CUDA tensor", lambda: x.add_(1)),
        ("specdec_ops.create_output(B=64, counters), C++ entry and launch",
         lambda: specdec_ops.create_output(accepted, ids, ids, bonus, counters=counters)),
        ("torch.empty(5, device='cuda')", lambda: torch.empty(5, device="cuda")),
    ]:
        print(f"| {what} | {eager_us(call, iters, warmup=50):.1f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and iterations (smoke run)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_ops.py needs a CUDA device; nothing measured.")
        return 0
    sizes = [1, 64] if args.quick else [1, 8, 64, 256, 1024]
    iters, replays = (50, 5) if args.quick else (500, 20)
    k, device = 4, "cuda"
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | "
          f"triton {triton.__version__} | k = {k}\n")
    # The host's own speed moves every eager figure: one cheap torch call, timed before and after the tables.
    scratch = torch.zeros(8, device=device)
    host_reference = [eager_us(lambda: scratch.add_(1), iters)]
    print("| op | num_reqs / B | wrapper eager us | torch.ops eager us | kernel graph us | plain torch eager us | "
          "plain torch graph us |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for num_reqs in sizes:
        batch = make_prefill_batch(num_reqs, k, device)
        positional = list(batch.values())
        # The library's wrapper, called positionally, as the create_output rows call theirs.
        kernel = lambda: specdec_ops.prepare_prefill(*positional)  # noqa: E731
        op_call = lambda: torch.ops.specdec.prepare_prefill.default(*positional, None)  # noqa: E731
        baseline = lambda: prepare_prefill_torch(**batch, max_num_reqs=num_reqs)  # noqa: E731
        for got, via_op, want in zip(kernel(), op_call(), baseline()):
            assert torch.equal(got, want) and torch.equal(via_op, want), "torch baseline disagrees with the kernel"
        print(f"| prepare_prefill | {num_reqs} | {eager_us(kernel, iters):.1f} | {eager_us(op_call, iters):.1f} | "
              f"{graph_us(kernel, replays):.2f} | {eager_us(baseline, iters):.1f} | "
              f"{graph_us(baseline, replays):.2f} |")
    for batch_size in sizes:
        verified = make_verified(batch_size, k, device)
        counters = torch.zeros(3, dtype=torch.int64, device=device)
        kernel = lambda: specdec_ops.create_output(*verified, counters=counters)  # noqa: E731
        op_call = lambda: torch.ops.specdec.create_output.counted(*verified, counters)  # noqa: E731
        baseline = lambda: specdec_ops.create_output_reference(*verified, counters=counters)  # noqa: E731
        assert torch.equal(kernel(), baseline()) and torch.equal(op_call(), baseline())
        print(f"| create_output | {batch_size} | {eager_us(kernel, iters):.1f} | {eager_us(op_call, iters):.1f} | "
              f"{graph_us(kernel, replays):.2f} | {eager_us(baseline, iters):.1f} | "
              f"{graph_us(baseline, replays):.2f} |")
    if not args.quick:
        # Beyond the sizes: a larger k, and batches with whole prompts (queries longer than the
        # kernel's first tile column continue one request at a time).
        print("\n| prepare_prefill batch | kernel graph us | plain torch graph us |")
        print("|---|---:|---:|")
        for label, num_reqs, k_round, long_queries in [
            ("1024 requests, k = 8", 1024, 8, None),
            ("63 requests with k = 4, one prompt of 3000 tokens", 64, 4, {17: 3000}),
            ("61 requests with k = 4, three prompts of 2000 tokens", 64, 4, {3: 2000, 17: 2000, 40: 2000}),
            ("16 prompts of 2000 tokens", 16, 4, dict.fromkeys(range(16), 2000)),
        ]:
            batch = make_prefill_batch(num_reqs, k_round, device, long_queries)
            kernel = lambda: torch.ops.specdec.prepare_prefill(**batch)  # noqa: E731
            baseline = lambda: prepare_prefill_torch(**batch, max_num_reqs=num_reqs)  # noqa: E731
            for got, want in zip(kernel(), baseline()):
                assert torch.equal(got, want), "torch baseline disagrees with the kernel"
            print(f"| {label} | {graph_us(kernel, replays):.2f} | {graph_us(baseline, replays):.2f} |")
    host_reference.append(eager_us(lambda: scratch.add_(1), iters))
    print(f"\nHost reference: x.add_(1) on an 8-element CUDA tensor took {host_reference[0]:.1f} us eager per call "
          f"before the tables and {host_reference[1]:.1f} us after them.")
    print("\nFloor on this host (graph us per call): an empty kernel, and the dependent memory accesses each "
          "contract cannot avoid, on each op's grid.\n")
    print("| num_reqs / B | prepare_prefill grid: empty | gather chain | request chain | create_output grid: empty | "
          "load, store |")
    print("|---:|---:|---:|---:|---:|---:|")
    for num_reqs in sizes:
        print(f"| {num_reqs} | " + " | ".join(f"{us:.2f}" for us in floor_rows(num_reqs, k, device, replays)) + " |")
    print("\nGraph timing check (us per call, three decimals, on graphs captured afresh): timed as in the tables "
          "above; with the host's submission of the graph inside the span; and the slope between graphs of 100 and "
          "300 calls.\n")
    print("| op | num_reqs / B | graph us | submission included | slope 100 to 300 calls |")
    print("|---|---:|---:|---:|---:|")
    for num_reqs in sizes:
        batch = list(make_prefill_batch(num_reqs, k, device).values())
        verified = make_verified(num_reqs, k, device)
        counters = torch.zeros(3, dtype=torch.int64, device=device)
        for name, kernel in [("prepare_prefill", lambda: specdec_ops.prepare_prefill(*batch)),
                             ("create_output", lambda: specdec_ops.create_output(*verified, counters=counters))]:
            print(f"| {name} | {num_reqs} | {graph_us(kernel, replays):.3f} | "
                  f"{graph_us(kernel, replays, cover_submission=False):.3f} | {graph_slope_us(kernel, replays):.3f} |")
    print_launch_floor(200 if args.quick else 2000)
    return 0


if __name__ == "__main__":
    sys.exit(main())

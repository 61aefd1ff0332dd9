"""Paged attention on the H200: our Triton kernel (`specdec_models::paged_attention`) against FlexAttention
(`torch.nn.attention.flex_attention`, compiled) reading the same paged KV cache in place.

Shapes: the Llama-3.2-1B-shaped target's attention (32 query heads, 8 KV heads, head size 64, bf16), cache blocks of
16 slots shuffled across requests, decode (1 query token per request) and verify (5 per request), batch 1, 8, 32,
128, context 512 and 4096 (each request's sequence length after the step; the block-table width is that of the
longest context, as in scripts/bench_model.py, so both contexts share one compiled graph).

FlexAttention reads the cache as K and V of shape [1, kv_heads, slots, 64] (strided views, no copy) under a block
mask built on the device in every step from the block tables: request b visits the physical blocks of its
block-table row (kv_indices = the row, kv_num_blocks = ceil(seq_len / 16)), and the mask_mod maps a physical slot
back to its owner request and logical position (a physical-to-logical block table, scattered from the block
tables in the same step) and keeps the request's own positions <= the query token's position. That is the layout of torch's own
`torch.nn.attention.experimental._paged_attention`, with the cache block as flex's KV block.

Each figure is GPU time per attention call: a CUDA graph of CALLS calls over LAYERS distinct caches (so that the
L2 cache does not hold a layer's KV from the call before), median over replays, divided by CALLS * LAYERS (for
flex, the step's one block-mask build is shared by the LAYERS = 16 layers, as in the 16-layer target); the floor
is the KV bytes read / 4.3 TB/s. Both paths are checked against the gather reference first (max |error|).

    python scripts/bench_attention.py                               # every shape (about a minute on the H200)
    python scripts/bench_attention.py --steps decode --batches 1 32   # a subset
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from specdec_ops.models.attention import launch_plan, paged_attention_reference, paged_attention_triton

from _timing import capture_graph, replay_us  # noqa: E402  (scripts/ is on sys.path as a script)

BANDWIDTH = 4.3e12
BLOCK_SIZE = 16
HEADS, KV_HEADS, HEAD_SIZE = 32, 8, 64
LAYERS = 16
CALLS = 4


def make_inputs(batch: int, query_len: int, max_context: int, layers: int, device, seed: int = 0):
    """Caches (one per layer), block tables and per-token tensors for `batch` requests x `query_len` tokens."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_row = -(-max_context // BLOCK_SIZE)
    num_blocks = 1 + batch * blocks_per_row
    block_tables = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(batch, blocks_per_row).to(device)
    caches = [torch.randn(num_blocks * BLOCK_SIZE, 2, KV_HEADS, HEAD_SIZE, generator=gen).to(device, torch.bfloat16)
              for _ in range(layers)]
    tokens = batch * query_len
    q = torch.randn(tokens, HEADS, HEAD_SIZE, generator=gen).to(device, torch.bfloat16)
    token_rows = torch.arange(tokens, device=device) // query_len
    return dict(q=q, caches=caches, block_tables=block_tables, token_rows=token_rows,
                positions=torch.zeros(tokens, dtype=torch.int64, device=device),
                seq_lens=torch.zeros(tokens, dtype=torch.int32, device=device), query_len=query_len)


def set_context(inputs, context: int) -> None:
    query_len = inputs["query_len"]
    offset = torch.arange(inputs["q"].shape[0], device=inputs["q"].device) % query_len
    inputs["positions"].copy_(context - query_len + offset)
    inputs["seq_lens"].fill_(context)


def flex_step_fn(compiled: bool = True):
    """The FlexAttention path as one compiled step: (q, caches, block tables, positions, seq lens) -> the outputs
    of every layer's cache. The block mask is built once per step and shared by the layers, as a model would."""
    import inspect

    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    # Only the forward's KV-block lists are needed (torch >= 2.6 can skip the transposed ones of the backward).
    no_q_blocks = ({"compute_q_blocks": False}
                   if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters else {})

    def step(q, caches, block_tables, positions, seq_lens, query_len: int, scale: float):
        tokens, heads, head_size = q.shape
        batch, blocks_per_row = tokens // query_len, block_tables.shape[1]
        num_blocks = caches[0].shape[0] // BLOCK_SIZE
        # Physical block -> b * blocks_per_row + its logical index j in the request b that owns it (-1 for none),
        # scattered from the block tables on the device: one gather in the mask gives owner and position.
        physical_to_logical = torch.full((num_blocks,), -1, dtype=torch.int32, device=q.device)
        logical = torch.arange(batch * blocks_per_row, dtype=torch.int32, device=q.device)
        physical_to_logical.scatter_(0, block_tables.long().flatten(), logical)
        query_positions = positions.view(batch, query_len)

        def mask_mod(b, h, q_idx, kv_idx):
            code = physical_to_logical[kv_idx // BLOCK_SIZE]
            logical_pos = (code % blocks_per_row) * BLOCK_SIZE + kv_idx % BLOCK_SIZE
            return (code >= 0) & (code // blocks_per_row == b) & (logical_pos <= query_positions[b, q_idx])

        # Request b visits its row's blocks, as many as its sequence covers; the block lists span every cache
        # block (flex's KV extent is the whole cache), zero-padded past the row.
        row_lens = seq_lens.view(batch, query_len)[:, 0]
        kv_num_blocks = ((row_lens + BLOCK_SIZE - 1) // BLOCK_SIZE).to(torch.int32).view(batch, 1, 1)
        kv_indices = torch.zeros(batch, 1, 1, num_blocks, dtype=torch.int32, device=q.device)
        kv_indices[:, 0, 0, :blocks_per_row] = block_tables.to(torch.int32)
        block_mask = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=(128, BLOCK_SIZE),
                                              mask_mod=mask_mod, seq_lengths=(query_len, caches[0].shape[0]),
                                              **no_q_blocks)
        qf = q.view(batch, query_len, heads, head_size).transpose(1, 2)
        outs = []
        for kv_cache in caches:
            k = kv_cache[:, 0].permute(1, 0, 2).unsqueeze(0)  # [1, kv_heads, slots, d], no copy
            v = kv_cache[:, 1].permute(1, 0, 2).unsqueeze(0)
            out = flex_attention(qf, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
            outs.append(out.transpose(1, 2).reshape(tokens, heads, head_size))
        return outs

    return torch.compile(step, fullgraph=True, dynamic=False) if compiled else step


def graph_ms_per_call(fn, calls: int, replays: int = 5) -> float:
    """GPU milliseconds per call of fn, from replays of one CUDA graph of `calls` calls (median)."""
    graph = capture_graph(fn, calls)
    samples = [replay_us(graph) / 1e3 for _ in range(replays)]
    del graph
    return statistics.median(samples) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description="Triton paged attention vs FlexAttention on the paged cache")
    parser.add_argument("--steps", nargs="*", default=["decode", "verify"], choices=["decode", "verify"])
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32, 128])
    parser.add_argument("--contexts", type=int, nargs="*", default=[512, 4096])
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument("--budget-s", type=float, default=150.0, help="stop starting new shapes after this")
    args = parser.parse_args()
    device = torch.device("cuda")
    contexts = sorted(args.contexts)
    scale = HEAD_SIZE ** -0.5
    torch._dynamo.config.cache_size_limit = 256
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 256
    flex = None if args.no_flex else flex_step_fn()
    started = time.perf_counter()
    rows, skipped = [], []
    for step, query_len in (("decode", 1), ("verify", 5)):
        if step not in args.steps:
            continue
        for batch in args.batches:
            if time.perf_counter() - started > args.budget_s:
                skipped.append(f"{step} batch {batch}: time budget spent")
                continue
            inputs = make_inputs(batch, query_len, contexts[-1], LAYERS, device)
            common = (inputs["block_tables"], inputs["token_rows"], inputs["positions"], inputs["seq_lens"])

            def ours():
                for cache in inputs["caches"]:
                    paged_attention_triton(inputs["q"], cache, *common, BLOCK_SIZE, scale, query_len)

            def theirs():
                return flex(inputs["q"], inputs["caches"], inputs["block_tables"], inputs["positions"],
                            inputs["seq_lens"], query_len, scale)

            for context in contexts:
                set_context(inputs, context)
                want = paged_attention_reference(inputs["q"], inputs["caches"][0], *common, BLOCK_SIZE, scale)
                got = paged_attention_triton(inputs["q"], inputs["caches"][0], *common, BLOCK_SIZE, scale, query_len)
                row = dict(step=step, batch=batch, context=context,
                           floor_ms=batch * context * 2 * KV_HEADS * HEAD_SIZE * 2 / BANDWIDTH * 1e3,
                           ours_err=float((got.float() - want.float()).abs().max()),
                           ours_ms=graph_ms_per_call(ours, CALLS) / LAYERS,
                           plan=launch_plan(batch * query_len, HEADS, KV_HEADS, HEAD_SIZE,
                                            inputs["block_tables"].shape[1] * BLOCK_SIZE, query_len))
                if flex is not None:
                    try:
                        out = theirs()[0]
                        row["flex_err"] = float((out.float() - want.float()).abs().max())
                        row["flex_ms"] = graph_ms_per_call(theirs, CALLS) / LAYERS
                    except Exception as error:  # noqa: BLE001  (reported in the table)
                        row["flex_failed"] = f"{type(error).__name__}: {str(error)[:160]}"
                rows.append(row)
                print(f"  {step} batch {batch} context {context}: ours {row['ours_ms'] * 1e3:.1f} us"
                      + (f", flex {row['flex_ms'] * 1e3:.1f} us" if "flex_ms" in row else
                         f", flex failed: {row.get('flex_failed', 'not run')}"), file=sys.stderr, flush=True)
            del inputs
            torch.cuda.empty_cache()
    print(f"\n## Paged attention ({torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{HEADS} heads / {KV_HEADS} KV heads x {HEAD_SIZE}, bf16, blocks of {BLOCK_SIZE})\n")
    print("| step | batch | context | floor us | Triton us | x floor | splits | FlexAttention us | x floor | "
          "flex / Triton | max err Triton | max err flex |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        flex_cells = (f"{r['flex_ms'] * 1e3:.1f} | {r['flex_ms'] / r['floor_ms']:.2f} | "
                      f"{r['flex_ms'] / r['ours_ms']:.2f} |" if "flex_ms" in r else
                      f"{r.get('flex_failed', 'not run')} | | |")
        print(f"| {r['step']} | {r['batch']} | {r['context']} | {r['floor_ms'] * 1e3:.1f} | {r['ours_ms'] * 1e3:.1f} | "
              f"{r['ours_ms'] / r['floor_ms']:.2f} | {r['plan']['splits']} | {flex_cells} {r['ours_err']:.3g} | "
              f"{r.get('flex_err', float('nan')):.3g} |")
    for s in skipped:
        print(f"- skipped: {s}")
    print(f"- elapsed {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()

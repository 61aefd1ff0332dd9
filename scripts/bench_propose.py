"""Per-propose latency of DraftProposer on the H200: eager vs compiled + one CUDA-graph replay.

Draft model: 4 layers, hidden 1024, 16 heads (4 KV heads), vocab 32000, bf16 (specdec_ops.models.BENCH_CONFIG);
k = 4 drafts per request; every request has 512 tokens of context and a steady-state query
[correction, d_1..d_k] with a random number of rejections; drafts are sampled at temperature 0.8 with their
probabilities written (what the rejection sampler needs).

Three proposers per num_reqs, all with the same ProposerConfig (padded sizes = exactly this batch), the same
block tables and the same round inputs:

- eager (ms): `propose()` of DraftProposer(compile=False, cuda_graphs=False) on the reference model, op by op.
- graph replay (ms): `propose()` of DraftProposer(compile=True) on the reference model: the input copies plus
  one replay of the captured CUDA graph of the compiled step.
- speedup: eager / graph replay.
- null model (ms): `propose()` of DraftProposer(compile=True), compiled and replayed the same way, whose draft
  model is `NullDraftModel`: a stub with the model interface that does almost no work (below).
- non-model share: null model / graph replay.

Why the share is an over-estimate of the time outside the model forwards: the null proposer runs the same
step function, so its graph holds every op of the proposer itself (input copies, padding, prepare_prefill,
block-table lookups and slot mappings, advance_draft_step, sample_draft with probabilities, draft writes) and
its launch gaps, with the model's forwards and logits replaced by the stub's own kernels. The stub reads every
field it is given (ids, positions, slot_mapping, block_tables, token_rows, seq_lens), so the compiler cannot drop any of
the proposer's work as dead code, and its kernels (per forward one small fused integer reduction over
context_slots, per step one [n, V] gather for the logits) add time on top. The one caveat is fusion: inductor
may fuse the proposer's small pointwise ops into different neighbours in the two graphs.

Latencies are medians of CUDA-event timings of single calls. Targets (issue 4): graph replay >= 5x faster than
eager at num_reqs <= 8; non-model share < 10% at num_reqs >= 64.

    python scripts/bench_propose.py [--quick] [--sizes 1 8 64 256]
"""
from __future__ import annotations

import argparse
import random

import torch
from torch import nn

from _timing import median_ms  # noqa: E402  (scripts/ is on sys.path when run as a script)
from specdec_ops.models import BENCH_CONFIG, DraftModel
from specdec_ops.models import AttentionMetadata, KVCacheSpec
from specdec_ops.models.interface import context_slots
from specdec_ops.runtime import BlockPool, DraftProposer, ProposerConfig

K = 4
CONTEXT = 512
BLOCK_SIZE = 16


class NullDraftModel(nn.Module):
    """A draft model that does almost no work: the benchmark's stand-in for "no model".

    It follows the model interface (specdec_ops/models/interface.py) with a given KV-cache spec (the
    proposer allocates the same caches as for the real model; the stub never touches them). Each token's
    hidden state [T, 1] is a row number in [0, rows), a mix of all its inputs, so that every input the
    proposer computes is used; the logits of a row are row `row` of a fixed random [rows, V] table.
    """

    def __init__(self, spec: KVCacheSpec, vocab_size: int, *, device: torch.device | str = "cpu",
                 rows: int = 16, seed: int = 0):
        super().__init__()
        self.vocab_size = vocab_size
        self.spec = spec
        self.rows = rows  # <= 256, so that row numbers are exact in bf16
        gen = torch.Generator().manual_seed(seed)
        table = torch.randn(rows, vocab_size, generator=gen)
        self.register_buffer("logits_table", table.to(device=device, dtype=spec.dtype), persistent=False)

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.spec

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        context = context_slots(attn_metadata).amax(dim=1)  # reads every block-table entry of each token's row
        mix = input_ids.long() + positions + attn_metadata.slot_mapping + attn_metadata.seq_lens + context
        return (mix % self.rows).to(self.spec.dtype)[:, None]  # remainder: in [0, rows) for any id

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits_table[hidden[:, 0].long().clamp(0, self.rows - 1)]


def proposer_config(num_reqs: int) -> ProposerConfig:
    tokens = num_reqs * (K + 1)
    return ProposerConfig(num_speculative_tokens=K, max_num_reqs=num_reqs, max_num_tokens=tokens,
                          max_model_len=CONTEXT + 2 * K + 2, block_size=BLOCK_SIZE, num_slots=num_reqs + 4,
                          batch_sizes=(num_reqs,), token_sizes=(tokens,))


def make_round(num_reqs: int, proposers, seed: int, device="cuda") -> dict:
    """A steady-state round: context CONTEXT per request, query of k + 1 tokens, random rejections.

    Every proposer gets the same block tables; the returned propose() arguments are shared by all of them."""
    rng = random.Random(seed)
    pool = BlockPool(proposers[0].num_blocks, seed=seed)
    blocks_per_req = -(-(CONTEXT + K + 1) // BLOCK_SIZE)
    slots = rng.sample(range(proposers[0].num_slots), num_reqs)
    for slot in slots:
        blocks = pool.allocate(blocks_per_req)
        for proposer in proposers:
            proposer.assign_blocks(slot, blocks)
    query_len = K + 1
    start = CONTEXT - query_len
    positions = [p for _ in range(num_reqs) for p in range(start, CONTEXT)]
    vocab_size = proposers[0].model.vocab_size
    return dict(
        input_ids=torch.randint(0, vocab_size, (num_reqs * query_len,), device=device),
        positions=torch.tensor(positions, device=device),
        query_start_loc=torch.arange(0, num_reqs * query_len + 1, query_len, dtype=torch.int32, device=device),
        seq_lens=torch.full((num_reqs,), CONTEXT, dtype=torch.int32, device=device),
        idx_mapping=torch.tensor(slots, dtype=torch.int32, device=device),
        num_rejected=torch.tensor([rng.randint(0, K) for _ in range(num_reqs)], dtype=torch.int32, device=device),
        last_sampled=torch.randint(0, vocab_size, (proposers[0].num_slots,), device=device),
        temperature=torch.full((num_reqs,), 0.8, device=device),
        seeds=torch.arange(num_reqs, device=device),
    )


def measure(num_reqs: int, model: DraftModel, null_model: NullDraftModel, iters: int, eager_iters: int):
    """(num_reqs, eager ms, graph ms, null-model ms, same drafts) of one round size; see the module docstring."""
    config = proposer_config(num_reqs)
    eager = DraftProposer(model, config, device="cuda", compile=False, cuda_graphs=False)
    graphed = DraftProposer(model, config, device="cuda")
    null = DraftProposer(null_model, config, device="cuda")
    batch = make_round(num_reqs, [eager, graphed, null], seed=num_reqs)
    for proposer in (eager, graphed):  # random context KV (timing does not depend on it, numerics stay sane)
        for cache in proposer.kv_caches:
            cache.normal_()
    eager_ms = median_ms(lambda: eager.propose(**batch), eager_iters, 3)
    graph_ms = median_ms(lambda: graphed.propose(**batch), iters, 3)
    same = torch.equal(eager.propose(**batch)[0], graphed.propose(**batch)[0])
    null_ms = median_ms(lambda: null.propose(**batch), iters, 3)
    print(f"num_reqs={num_reqs}: eager {eager_ms:.3f} ms, graph {graph_ms:.3f} ms, null model {null_ms:.3f} ms",
          flush=True)
    return num_reqs, eager_ms, graph_ms, null_ms, same


def main() -> int:
    parser = argparse.ArgumentParser(description="DraftProposer latency, eager vs CUDA-graph replay (H200)")
    parser.add_argument("--quick", action="store_true", help="fewer timed calls")
    parser.add_argument("--sizes", type=int, nargs="*", default=[1, 8, 64, 256])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_propose.py needs a CUDA GPU (it is meant for the H200); nothing to do here.")
        return 0
    iters, eager_iters = (20, 5) if args.quick else (200, 30)
    model = DraftModel(BENCH_CONFIG, device="cuda", seed=0)
    null_model = NullDraftModel(model.kv_cache_spec(), model.vocab_size, device="cuda")
    rows = []
    for num_reqs in args.sizes:
        rows.append(measure(num_reqs, model, null_model, iters, eager_iters))
        torch.cuda.empty_cache()

    print(f"\nDraftProposer.propose, k={K}, context {CONTEXT}, draft model 4x1024 bf16 vocab 32000, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| num_reqs | eager (ms) | graph replay (ms) | speedup | null model (ms) | non-model share | target | "
          "same drafts |")
    print("|---:|---:|---:|---:|---:|---:|:---|:---|")
    for num_reqs, eager_ms, graph_ms, null_ms, same in rows:
        speedup, share = eager_ms / graph_ms, null_ms / graph_ms
        if num_reqs <= 8:
            target = f"speedup >= 5x: {'met' if speedup >= 5 else 'MISSED'}"
        elif num_reqs >= 64:
            target = f"non-model < 10%: {'met' if share < 0.10 else 'MISSED'}"
        else:
            target = "-"
        print(f"| {num_reqs} | {eager_ms:.3f} | {graph_ms:.3f} | {speedup:.1f}x | {null_ms:.3f} | "
              f"{100 * share:.1f}% | {target} | {'yes' if same else 'no'} |")
    print("\nnon-model share = null model / graph replay: an over-estimate (see the script's docstring). "
          "'same drafts': eager and graph drafts agree exactly (sampled; bf16 numerics of compiled vs eager "
          "kernels may legitimately differ).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

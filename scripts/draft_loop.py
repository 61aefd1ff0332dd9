"""Runs propose rounds of the reference draft model with synthetic target batches, eager and compiled.

Each round a `SyntheticTarget` (tests/support.py) makes a target batch: requests join with short or long
prompts and leave, the target accepts a random number of the previous drafts and samples a correction token.
Two `DraftProposer`s run every round on the same batch: an eager one and a torch.compile(fullgraph=True) one
(replayed as one CUDA graph per call on a GPU). The script prints per-round latency of both, whether their
drafts agree (and, for greedy drafting, whether they equal a cache-free greedy reference), and the drafts of
the first requests.

    python scripts/draft_loop.py                       # CPU, tiny model, greedy
    python scripts/draft_loop.py --device cuda --temperature 0.8
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
import dataclasses
import time

import torch

from specdec_ops.models import BENCH_CONFIG, TINY_CONFIG, DraftModel
from specdec_ops.runtime import DraftProposer, ProposerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support import SyntheticTarget, greedy_reference  # noqa: E402  (the synthetic target of the tests)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", choices=["tiny", "bench"], default="tiny", help="tiny: 2 layers, hidden 64, vocab 512")
    p.add_argument("--dtype", choices=["float32", "float64", "bfloat16"], default=None,
                   help="model dtype (default: the config's; float64 rules out near-tie argmax flips between "
                        "eager, compiled and the reference)")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--k", type=int, default=3, help="draft tokens per request and round")
    p.add_argument("--max-reqs", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy drafting")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show", type=int, default=3, help="print the drafts of this many requests per round")
    p.add_argument("--no-verify", action="store_true", help="skip the cache-free greedy reference check")
    return p.parse_args()


def timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, (time.perf_counter() - start) * 1e3


def main():
    args = parse_args()
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model_config = TINY_CONFIG if args.model == "tiny" else BENCH_CONFIG
    if args.dtype is not None:
        model_config = dataclasses.replace(model_config, dtype=getattr(torch, args.dtype))
    model = DraftModel(model_config, device=device, seed=args.seed)
    # One padded size, so the compiled proposer compiles (and captures) once.
    config = ProposerConfig(num_speculative_tokens=args.k, max_num_reqs=args.max_reqs,
                            max_num_tokens=args.max_tokens, max_model_len=args.max_model_len,
                            num_slots=2 * args.max_reqs, batch_sizes=(args.max_reqs,),
                            token_sizes=(args.max_tokens,))
    eager = DraftProposer(model, config, device=device, compile=False, cuda_graphs=False)
    compiled = DraftProposer(model, config, device=device)  # + CUDA graphs on a GPU
    mode = "compiled + CUDA graph" if compiled.manual_graphs else "compiled"
    sim = SyntheticTarget([eager, compiled], seed=args.seed, vocab_size=model_config.vocab_size,
                          long_prompt_len=min(40, args.max_tokens // 2))
    verify = args.temperature == 0 and not args.no_verify
    print(f"model={args.model} ({model_config.dtype}) device={device} k={args.k} padded to {args.max_reqs} requests, "
          f"{args.max_tokens} tokens; temperature={args.temperature}")
    print(f"{'round':>5} {'reqs':>4} {'tokens':>6} {'eager ms':>9} {mode + ' ms':>26} {'agree':>5}"
          + (f" {'= reference':>11}" if verify else ""))
    eager_ms, compiled_ms, all_agree = [], [], True
    for round_index in range(args.rounds):
        batch = sim.next_batch(device=device, temperature=args.temperature, seed_base=1000 * args.seed)
        n = len(sim.batch_slots)
        drafts, ms_eager = timed(lambda: eager.propose(**batch)[0].clone(), device)
        drafts_compiled, ms_compiled = timed(lambda: compiled.propose(**batch)[0].clone(), device)
        agree = torch.equal(drafts, drafts_compiled)
        all_agree &= agree
        line = f"{round_index:>5} {n:>4} {batch['input_ids'].shape[0]:>6} {ms_eager:>9.2f} {ms_compiled:>26.2f}"
        line += f" {'yes' if agree else 'NO':>5}"
        if verify:
            expected = [greedy_reference(model, sim.true_sequence(s), args.k) for s in sim.batch_slots]
            matches = drafts.tolist() == expected
            all_agree &= matches
            line += f" {'yes' if matches else 'NO':>11}"
        if round_index == 0:
            line += "   (compiled: includes compilation)"
        print(line)
        for row in range(min(args.show, n)):
            print(f"        slot {sim.batch_slots[row]:>2}: drafts {drafts[row].tolist()}")
        eager_ms.append(ms_eager)
        compiled_ms.append(ms_compiled)
        sim.verify(drafts.tolist())
    if args.rounds > 1:
        steady_eager = sorted(eager_ms[1:])[len(eager_ms[1:]) // 2]
        steady_compiled = sorted(compiled_ms[1:])[len(compiled_ms[1:]) // 2]
        print(f"median after round 0: eager {steady_eager:.2f} ms, {mode} {steady_compiled:.2f} ms "
              f"({steady_eager / steady_compiled:.1f}x)")
    print("all drafts agree" if all_agree else "MISMATCH: see the rows marked NO")
    return 0 if all_agree else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Per-step latency of LlamaModel's paged forward + logits on the H200, against the memory-bandwidth floor and
transformers' LlamaForCausalLM on the same weights.

Models (bf16, random weights): "target", shaped like Llama-3.2-1B (hidden 2048, 16 layers, 32 heads, 8 KV heads,
head size 64, intermediate 8192, vocabulary 128256, tied embeddings), and "draft", the 4-layer 1024-wide
`BENCH_CONFIG`. Steps: decode (1 token per request) and verify (5 tokens per request: the last verified token and
k = 4 drafts), batch 1, 8, 32, 128, context 512 and 4096 (the request's sequence length after the step), logits of
every query token. Each step is the compiled paged forward + logits (torch.compile fullgraph, static shapes),
captured in a CUDA graph of CALLS_PER_GRAPH calls and replayed; the figure is GPU time per call, median over
replays (scripts/_timing.py). Every request owns shuffled KV blocks of 16 slots; the block-table width is that of
the longest context, so both contexts of one (model, step, batch) share one compiled graph.

floor = (weight bytes + KV bytes read) / 4.3 TB/s: every weight once (the tied embedding once, as the head) and
every request's context K and V once per layer. Logit writes and activations are not counted.

transformers: LlamaForCausalLM (sdpa attention) with the same weights, one decode step (1 token per request) into a
StaticCache of the context's length, with torch.compile(mode="reduce-overhead", fullgraph=True) for the batches
of --hf-compile-batches ("static+compile") and eager otherwise ("static, eager"), or when compiling fails
("static, eager (compile failed)"); CUDA-event median of single calls.

Runs within a time budget (--budget-s): what is left when it runs out is listed as skipped, as is every
combination whose KV cache would not fit in memory.

    python scripts/bench_model.py                        # the H200 run (about 4 minutes)
    python scripts/bench_model.py --device cpu --quick   # a tiny check on CPU (eager, wall-clock timing)
    options: --models target draft --steps decode verify --batches 1 8 32 128 --contexts 512 4096
             --backend auto|triton|reference
             --no-hf --hf-compile-batches 1 8 --json
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import statistics
import sys
import time

import torch

from _timing import CALLS_PER_GRAPH, capture_graph, median_ms, replay_us  # noqa: E402  (scripts/ is on sys.path as a script)
from specdec_ops.models import BENCH_CONFIG, AttentionMetadata, LlamaConfig, LlamaModel

BANDWIDTH = 4.3e12  # H200 HBM3e, bytes/s
BLOCK_SIZE = 16
VERIFY_TOKENS = 5
TARGET_CONFIG = LlamaConfig(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                            intermediate_size=8192, rope_theta=500000.0, tie_word_embeddings=True,
                            dtype=torch.bfloat16)
# A CPU stand-in for --quick.
QUICK_CONFIG = LlamaConfig(vocab_size=512, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                           intermediate_size=256, tie_word_embeddings=True, dtype=torch.float32)


def weight_bytes(model: LlamaModel) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() counts a tied weight once


def kv_bytes(config: LlamaConfig, batch: int, context: int) -> int:
    return config.num_layers * batch * context * 2 * config.num_kv_heads * config.head_size * config.dtype.itemsize


def paged_inputs(model: LlamaModel, batch: int, query_len: int, max_context: int, device, seed: int = 0):
    """Caches, block tables and static buffers for steps of `batch` requests x `query_len` tokens."""
    config = model.config
    blocks_per_row = -(-max_context // BLOCK_SIZE)
    num_blocks = 1 + batch * blocks_per_row
    gen = torch.Generator().manual_seed(seed)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(batch, blocks_per_row)
    block_tables = order.to(device)
    caches = tuple(torch.zeros(num_blocks * BLOCK_SIZE, 2, config.num_kv_heads, config.head_size,
                               dtype=config.dtype, device=device) for _ in range(config.num_layers))
    tokens = batch * query_len
    buffers = dict(
        ids=torch.randint(0, config.vocab_size, (tokens,), generator=gen).to(device),
        positions=torch.zeros(tokens, dtype=torch.int64, device=device),
        slot_mapping=torch.zeros(tokens, dtype=torch.int64, device=device),
        seq_lens=torch.zeros(tokens, dtype=torch.int32, device=device),
        token_rows=torch.arange(tokens, device=device) // query_len,
    )
    metadata = AttentionMetadata(caches, buffers["slot_mapping"], block_tables, buffers["token_rows"],
                                 buffers["seq_lens"], BLOCK_SIZE, query_len)
    return buffers, metadata


def set_context(buffers, metadata: AttentionMetadata, query_len: int, context: int) -> None:
    """Every request's query is its last query_len positions of a sequence of `context` tokens."""
    tokens = buffers["positions"].shape[0]
    offset = torch.arange(tokens, device=buffers["positions"].device) % query_len
    positions = context - query_len + offset
    rows = buffers["token_rows"]
    blocks = metadata.block_tables[rows, positions // BLOCK_SIZE]
    buffers["positions"].copy_(positions)
    buffers["seq_lens"].fill_(context)
    buffers["slot_mapping"].copy_(blocks * BLOCK_SIZE + positions % BLOCK_SIZE)


def time_step(step, device, quick: bool) -> float:
    """Milliseconds per call: GPU time of a replayed CUDA graph on CUDA, host wall-clock on CPU."""
    if device.type != "cuda":
        for _ in range(3):
            step()
        samples = []
        for _ in range(5 if quick else 10):
            start = time.perf_counter()
            step()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)
    calls = 10 if quick else CALLS_PER_GRAPH
    graph = capture_graph(step, calls)
    samples = [replay_us(graph) / calls / 1e3 for _ in range(3 if quick else 7)]
    del graph
    return statistics.median(samples)


def hf_model_from(model: LlamaModel):
    """transformers' LlamaForCausalLM holding the same weights as `model`."""
    import transformers

    c = model.config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_size, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_word_embeddings, max_position_embeddings=8192)
    hf_config._attn_implementation = "sdpa"
    device = model.embed_tokens.weight.device
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(hf_config)
    hf = hf.to_empty(device=device).to(c.dtype).eval().requires_grad_(False)
    q, kv = c.num_heads * c.head_size, c.num_kv_heads * c.head_size
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(model.embed_tokens.weight)
        hf.model.norm.weight.copy_(model.norm.weight)
        if not c.tie_word_embeddings:
            hf.lm_head.weight.copy_(model.lm_head.weight)
        else:
            hf.lm_head.weight = hf.model.embed_tokens.weight
        for ours, theirs in zip(model.layers, hf.model.layers):
            wq, wk, wv = ours.attn.qkv_proj.weight.split([q, kv, kv])
            theirs.self_attn.q_proj.weight.copy_(wq)
            theirs.self_attn.k_proj.weight.copy_(wk)
            theirs.self_attn.v_proj.weight.copy_(wv)
            theirs.self_attn.o_proj.weight.copy_(ours.attn.o_proj.weight)
            gate, up = ours.gate_up_proj.weight.chunk(2)
            theirs.mlp.gate_proj.weight.copy_(gate)
            theirs.mlp.up_proj.weight.copy_(up)
            theirs.mlp.down_proj.weight.copy_(ours.down_proj.weight)
            theirs.input_layernorm.weight.copy_(ours.input_norm.weight)
            theirs.post_attention_layernorm.weight.copy_(ours.post_attn_norm.weight)
        # The rotary buffer of a meta-built model is empty: recompute it.
        rotary = hf.model.rotary_emb
        inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, c.head_size, 2, device=device).float() / c.head_size)
        rotary.inv_freq = inv_freq
        if hasattr(rotary, "original_inv_freq"):
            rotary.original_inv_freq = inv_freq
    return hf


def check_hf_agrees(model: LlamaModel, hf) -> float:
    """Max |logit difference| of ours vs transformers on one 12-token sequence (checks the weight mapping)."""
    device = model.embed_tokens.weight.device
    ids = torch.randint(0, model.vocab_size, (12,), generator=torch.Generator().manual_seed(5)).to(device)
    with torch.no_grad():
        ours = model.compute_logits(model(ids, torch.arange(12, device=device))).float()
        theirs = hf(ids[None]).logits[0].float()
    return float((ours - theirs).abs().max())


def hf_decode_ms(hf, batch: int, context: int, compile_it: bool, device, quick: bool):
    """(ms, mode) of one transformers decode step at position context - 1 into a StaticCache."""
    import transformers

    cache = transformers.StaticCache(config=hf.config, max_cache_len=context)
    ids = torch.randint(0, hf.config.vocab_size, (batch, 1), device=device)
    position_ids = torch.full((batch, 1), context - 1, device=device)
    forward_params = inspect.signature(hf.forward).parameters
    # transformers renamed past_key_values to cache (5.2x); pass the name this version takes.
    cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
    kwargs = dict(input_ids=ids, position_ids=position_ids, use_cache=True, **{cache_kwarg: cache})
    if "cache_position" in forward_params or "cache_position" in inspect.signature(hf.model.forward).parameters:
        kwargs["cache_position"] = torch.tensor([context - 1], device=device)

    def eager():
        with torch.no_grad():
            return hf(**kwargs).logits

    iters, warmup = (3, 1) if quick else (20, 3)
    timer = median_ms if device.type == "cuda" else _cpu_ms
    if compile_it:
        # transformers 5 allocates a StaticCache's tensors in its first forward: an eager step first keeps them
        # outside the compiled graph (inside it they would be CUDA-graph outputs, overwritten by the next replay).
        eager()
        try:
            compiled = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)

            def step():
                # Each replay overwrites the last one's outputs (the static cache included): say a new step began.
                torch.compiler.cudagraph_mark_step_begin()
                with torch.no_grad():
                    return compiled(**kwargs).logits

            return timer(step, iters, warmup + 2), "static+compile"
        except Exception as error:  # noqa: BLE001  (any failure falls back to eager, and says so)
            print(f"  transformers compile failed at batch {batch}: {type(error).__name__}: {str(error)[:200]}",
                  file=sys.stderr)
            return timer(eager, iters, warmup), "static, eager (compile failed)"
    return timer(eager, iters, warmup), "static, eager"


def _cpu_ms(fn, iters, warmup):
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def fits(config: LlamaConfig, batch: int, max_context: int, device) -> bool:
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info()
    need = kv_bytes(config, batch, max_context)
    return need < 0.6 * free


def main() -> None:
    parser = argparse.ArgumentParser(description="LlamaModel paged step latency vs the bandwidth floor (H200)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny models and sizes (for a CPU check)")
    parser.add_argument("--models", nargs="*", default=["target", "draft"], choices=["target", "draft"])
    parser.add_argument("--steps", nargs="*", default=["decode", "verify"], choices=["decode", "verify"])
    parser.add_argument("--batches", type=int, nargs="*", default=None)
    parser.add_argument("--contexts", type=int, nargs="*", default=None)
    parser.add_argument("--backend", default="auto", choices=["auto", "triton", "reference"],
                        help="attention backend of our model")
    parser.add_argument("--no-compile", action="store_true", help="time the eager forward (still graph-captured)")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    parser.add_argument("--hf-compile-batches", type=int, nargs="*", default=[1, 8],
                        help="batches at which transformers runs compiled (others eager)")
    parser.add_argument("--hf-contexts", type=int, nargs="*", default=[512])
    parser.add_argument("--budget-s", type=float, default=210.0, help="stop starting new combinations after this")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    args = parser.parse_args()
    device = torch.device(args.device)
    quick = args.quick
    batches = args.batches or ([1, 2] if quick else [1, 8, 32, 128])
    contexts = sorted(args.contexts or ([16, 64] if quick else [512, 4096]))
    hf_contexts = [c for c in args.hf_contexts if c in contexts] or contexts[:1]
    started = time.perf_counter()
    configs = {"target": TARGET_CONFIG, "draft": BENCH_CONFIG}
    if quick:
        configs = {"target": QUICK_CONFIG, "draft": dataclasses.replace(QUICK_CONFIG, num_layers=1,
                                                                        tie_word_embeddings=False)}
    if device.type != "cuda":
        configs = {k: dataclasses.replace(v, dtype=torch.float32) for k, v in configs.items()}
    # Every padded (model, step, batch) is one more graph of the one step function.
    torch._dynamo.config.cache_size_limit = 256
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 256

    rows, skipped, notes = [], [], []
    for name in args.models:
        config = configs[name]
        model = LlamaModel(config, device=device, seed=0, attention_backend=args.backend)
        weights = weight_bytes(model)
        hf = None
        if not args.no_hf and name == "target":
            try:
                hf = hf_model_from(model)
                notes.append(f"transformers {__import__('transformers').__version__}: max |logit diff| vs ours on "
                             f"a 12-token sequence: {check_hf_agrees(model, hf):.3g}")
            except Exception as error:  # noqa: BLE001
                notes.append(f"transformers unavailable: {type(error).__name__}: {error}")
                hf = None
        for query_len, step_name in ((1, "decode"), (VERIFY_TOKENS, "verify")):
            if step_name not in args.steps:
                continue
            for batch in batches:
                label = f"{name} {step_name} batch {batch}"
                if time.perf_counter() - started > args.budget_s:
                    skipped.append(f"{label}: time budget ({args.budget_s:.0f} s) spent")
                    continue
                max_context = contexts[-1]
                if not fits(config, batch, max_context, device):
                    skipped.append(f"{label}: KV cache ({kv_bytes(config, batch, max_context) / 1e9:.1f} GB) "
                                   "would not fit")
                    continue
                buffers, metadata = paged_inputs(model, batch, query_len, max_context, device)

                def step():
                    hidden = model(buffers["ids"], buffers["positions"], metadata)
                    return model.compute_logits(hidden)

                fn = step if args.no_compile else torch.compile(step, fullgraph=True, dynamic=False)
                for context in contexts:
                    set_context(buffers, metadata, query_len, context)
                    with torch.no_grad():
                        ms = time_step(fn, device, quick)
                    floor_ms = (weights + kv_bytes(config, batch, context)) / BANDWIDTH * 1e3
                    row = dict(model=name, step=step_name, batch=batch, context=context, tokens=batch * query_len,
                               ms=ms, floor_ms=floor_ms, ratio=ms / floor_ms, hf_ms=None, hf_mode=None)
                    if hf is not None and step_name == "decode" and context in hf_contexts:
                        try:
                            row["hf_ms"], row["hf_mode"] = hf_decode_ms(
                                hf, batch, context, batch in args.hf_compile_batches, device, quick)
                        except Exception as error:  # noqa: BLE001
                            row["hf_mode"] = f"failed: {type(error).__name__}: {str(error)[:120]}"
                    rows.append(row)
                    print(f"  {label} context {context}: {ms:.3f} ms (floor {floor_ms:.3f})"
                          + (f", transformers {row['hf_ms']:.3f} ms ({row['hf_mode']})" if row["hf_ms"] else ""),
                          file=sys.stderr, flush=True)
                del buffers, metadata, fn
                torch._dynamo.reset()  # frees the compiled graph's memory before the next batch
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        del model, hf
    elapsed = time.perf_counter() - started
    result = dict(device=str(torch.cuda.get_device_name() if device.type == "cuda" else device),
                  torch=torch.__version__, backend=args.backend, compiled=not args.no_compile,
                  timing="CUDA graph replay, GPU time per call" if device.type == "cuda" else "CPU wall clock",
                  bandwidth_bytes_per_s=BANDWIDTH, rows=rows, skipped=skipped, notes=notes, elapsed_s=elapsed)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"\n## LlamaModel paged step ({result['device']}, torch {torch.__version__}, attention {args.backend}, "
          f"{'compiled' if not args.no_compile else 'eager'}, {result['timing']})\n")
    print("| model | step | batch | context | ms / step | floor ms | ratio to floor | transformers ms | "
          "transformers path | ours vs transformers |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for r in rows:
        hf_ms = f"{r['hf_ms']:.3f}" if r["hf_ms"] else ""
        speedup = f"{r['hf_ms'] / r['ms']:.1f}x" if r["hf_ms"] else ""
        print(f"| {r['model']} | {r['step']} | {r['batch']} | {r['context']} | {r['ms']:.3f} | {r['floor_ms']:.4g} | "
              f"{r['ratio']:.2f} | {hf_ms} | {r['hf_mode'] or ''} | {speedup} |")
    by_key = {(r["model"], r["step"], r["batch"], r["context"]): r for r in rows}
    print()
    for r in rows:
        if r["step"] == "verify":
            decode = by_key.get((r["model"], "decode", r["batch"], r["context"]))
            if decode:
                print(f"- {r['model']} batch {r['batch']} context {r['context']}: verify / decode = "
                      f"{r['ms'] / decode['ms']:.2f}")
    for note in notes:
        print(f"- {note}")
    for s in skipped:
        print(f"- skipped: {s}")
    print(f"- elapsed {elapsed:.0f} s")


if __name__ == "__main__":
    main()

"""Prints a hash of the code Triton generates for each kernel of the library, without a GPU.

    python scripts/kernel_fingerprint.py [--arch 90] [--stage ptx]

Each kernel is compiled for a CUDA target (default sm_90, the H200) at the specializations the benchmarks run
(scripts/bench_ops.py, scripts/bench_vocab.py, and the propose loop's advance_draft_step), through
`triton.compile(ASTSource(...), target=GPUTarget(...))`, which needs no device. The specialization of each argument
follows Triton's launcher: a pointer is 16-byte aligned, an int equal to 1 is a constant and one divisible by 16 is
marked so, except for the parameters the kernel lists in do_not_specialize / do_not_specialize_on_alignment.

The hash covers the chosen stage's text with line information off and the kernel's own name replaced, so moving a
kernel to another file or renaming it leaves the hash alone, while any change in the generated instructions changes
it. Two checkouts compile to the same code when they print the same hashes. Kernels are found in the module layout
of this tree (specdec_ops/kernels/) or the earlier one (specdec_ops/<family>.py).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITON_DISABLE_LINE_INFO"] = "1"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset; 1 is its default
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

# Where each kernel lives: this tree's layout first, then the one before it.
KERNELS = {
    "prepare_prefill": [("specdec_ops.kernels.prefill", "prepare_prefill_kernel"),
                        ("specdec_ops.prefill", "_prepare_prefill_kernel")],
    "create_output": [("specdec_ops.kernels.output", "create_output_kernel"),
                      ("specdec_ops.output", "_create_output_kernel")],
    "advance_draft_step": [("specdec_ops.kernels.draft_step", "advance_draft_step_kernel"),
                           ("specdec_ops.draft_step", "_advance_draft_step_kernel")],
    "rejection_sample": [("specdec_ops.kernels.sampling", "rejection_sample_kernel"),
                         ("specdec_ops.sampling", "_rejection_sample_kernel")],
    "sample_draft": [("specdec_ops.kernels.sampling", "sample_draft_kernel"),
                     ("specdec_ops.sampling", "_sample_draft_kernel")],
    "verify": [("specdec_ops.kernels.verify", "verify_kernel"), ("specdec_ops.verify", "_verify_kernel")],
}

I32, I64, F32, B1 = "*i32", "*i64", "*fp32", "*i1"
K, V32, V128 = 4, 32000, 128256


def _prefill(num_reqs):
    return dict(input_ids_ptr=I32, positions_ptr=I64, query_start_loc_ptr=I32, seq_lens_ptr=I32,
                idx_mapping_ptr=I32, last_sampled_ptr=I64, num_rejected_ptr=I32, out_ids_ptr=I32,
                out_positions_ptr=I64, out_last_ptr=I64, out_qsl_ptr=I32, out_seq_lens_ptr=I32,
                num_tokens=num_reqs * (K + 1), num_reqs=num_reqs, num_slots=num_reqs, max_num_reqs=num_reqs,
                max_model_len=4096, ROWS=16, SLOTS=16, LONG_SLOTS=1024)


def _output(count):
    return dict(accepted_ptr=B1, substitute_ptr=I64, draft_ptr=I64, bonus_ptr=I64, out_ptr=I64, counters_ptr=I64,
                batch=64, k=K, accepted_row_stride=K, substitute_row_stride=K, draft_row_stride=K, bonus_row_stride=1,
                BLOCK_ROWS=16, BLOCK_COLS=8, COUNT=count)


def _rejection(batch, vocab, has_q, count):
    num_chunks = max(-(-132 // batch), -(-vocab // 8192))  # the H200's 132 SMs, one program each, chunks <= 8192
    chunk_len = -(-(-(-vocab // num_chunks)) // 1024) * 1024
    return dict(p_ptr=F32, draft_ptr=I64, q_ptr=F32, seed_ptr=I64, offset_ptr=I64, bonus_ptr=I64, out_ptr=I64,
                counters_ptr=I64, workspace_ptr=I64, k=K, vocab=vocab, chunk_len=chunk_len,
                p_stride_b=(K + 1) * vocab, p_stride_i=vocab, draft_stride_b=K,
                q_stride_b=K * vocab if has_q else 0, q_stride_i=vocab if has_q else 0,
                seed_stride=1, offset_stride=1, bonus_stride=0,
                HAS_Q=has_q, HAS_BONUS=False, COUNT=count, SPLIT=True, BLOCK_K=8, BLOCK_V=1024, NUM_STAGES=3,
                FAST_LOG=True)


def _draft(vocab, with_probs):
    return dict(logits_ptr=F32, temperature_ptr=F32, seed_ptr=I64, position_ptr=I64, out_ptr=I64, probs_ptr=F32,
                vocab=vocab, logits_stride=vocab, temperature_stride=1, seed_stride=1, position_stride=1,
                probs_stride=vocab if with_probs else 0, WITH_PROBS=with_probs, BLOCK_V=4096, FAST_LOG=True)


def _verify(batch, vocab, typical, count):
    num_chunks = max(1, min(-(-(4 * 132) // (batch * (K + 1))), -(-vocab // 8192)))
    chunk_len = -(-(-(-vocab // num_chunks)) // 4096) * 4096
    num_chunks = -(-vocab // chunk_len)
    return dict(target_ptr=F32, draft_ptr=I64, out_ptr=I64, counters_ptr=I64, part_max_ptr=F32,
                part_argmax_ptr=I32, part_entropy_ptr=F32, tickets_ptr=I64, k=K, vocab=vocab,
                target_batch_stride=(K + 1) * vocab, target_row_stride=vocab, draft_row_stride=K,
                chunk_len=chunk_len, num_chunks=num_chunks, posterior_threshold=0.09, posterior_alpha=0.3,
                TYPICAL=typical, COUNT=count, BLOCK_V=4096, BLOCK_ROWS=8, BLOCK_CHUNKS=max(2, num_chunks))


# (label, kernel, arguments by name, num_warps, num_stages)
SPECIALIZATIONS = [
    ("prepare_prefill R=64", "prepare_prefill", _prefill(64), 4, 3),
    ("create_output", "create_output", _output(False), 4, 3),
    ("create_output counted", "create_output", _output(True), 4, 3),
    ("advance_draft_step", "advance_draft_step",
     dict(sampled_ptr=I64, positions_ptr=I64, seq_lens_ptr=I32, out_ids_ptr=I32, out_positions_ptr=I64,
          out_seq_lens_ptr=I32, n=64, max_model_len=4096, BLOCK=1024), 4, 3),
    *[(f"rejection_sample B={b} V={v}{' q' if q else ''}{' counted' if c else ''}", "rejection_sample",
       _rejection(b, v, q, c), 4, 3)
      for b, v, q, c in [(1, V32, True, False), (64, V32, True, False), (64, V32, False, False),
                         (64, V128, True, True)]],
    *[(f"sample_draft V={v}{' probs' if p else ''}", "sample_draft", _draft(v, p), 16, 3)
      for v, p in [(V32, False), (V32, True), (V128, True)]],
    *[(f"{'typical_acceptance' if t else 'greedy_verify'} B={b} V={v}{' counted' if c else ''}", "verify",
       _verify(b, v, t, c), 8, 3)
      for b, v, t, c in [(1, V32, False, False), (64, V32, False, False), (64, V32, True, False),
                         (64, V128, True, True)]],
]


def find_kernel(name):
    for module_name, attr in KERNELS[name]:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, attr):
            return getattr(module, attr)
    raise LookupError(f"no kernel {name} in {[m for m, _ in KERNELS[name]]}")


def source_for(kernel, args):
    """ASTSource for `kernel` specialized on `args` as Triton's launcher specializes it."""
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        value = args[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        elif isinstance(value, str):  # a pointer
            signature[param.name] = value
            if not param.do_not_specialize_on_alignment:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if not param.do_not_specialize:
                if value == 1:
                    signature[param.name] = "constexpr"
                    constexprs[param.name] = 1
                elif value % 16 == 0:
                    attrs[(index,)] = [["tt.divisibility", 16]]
    return triton.compiler.ASTSource(kernel, signature, constexprs, attrs)


def fingerprint(kernel, args, num_warps, num_stages, arch, stage):
    compiled = triton.compile(source_for(kernel, args), target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    text = compiled.asm[stage]
    text = text.decode() if isinstance(text, bytes) else text
    text = text.replace(kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__, "KERNEL")
    text = re.sub(r"^\s*(\.file|\.loc|#loc).*$", "", text, flags=re.M)  # any line information left
    text = re.sub(r"\s*loc\([^()]*(\([^()]*\)[^()]*)*\)", "", text)
    text = re.sub(r"//.*$", "", text, flags=re.M)  # PTX comments, padded to a column after the name
    text = re.sub(r"[ \t]+", " ", text)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability as one number (default 90)")
    parser.add_argument("--stage", default="ptx", choices=["ttir", "ttgir", "llir", "ptx"], help="what to hash")
    args = parser.parse_args()
    print(f"torch {torch.__version__} | triton {triton.__version__} | sm_{args.arch} | {args.stage}")
    for label, name, kernel_args, num_warps, num_stages in SPECIALIZATIONS:
        digest = fingerprint(find_kernel(name), kernel_args, num_warps, num_stages, args.arch, args.stage)
        print(f"{digest}  {label}", flush=True)


if __name__ == "__main__":
    main()

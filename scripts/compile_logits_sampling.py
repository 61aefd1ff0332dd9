"""Compiles every Triton kernel variant of specdec_ops/kernels/logits_sampling.py for an sm_90 target through
Triton's real compiler (TTIR, TTGIR, LLVM IR, PTX, cubin) without a GPU: catches what the interpreter lets pass
(loop-carried and branch types, constexpr use). Exits 1 if a variant fails. Run from the repository root:

    PYTHONPATH=. python scripts/compile_logits_sampling.py
"""
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # the real compiler, not the interpreter

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import specdec_ops  # noqa: E402,F401
from specdec_ops.kernels import logits_sampling as kernels  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
F32, I32, I64 = "*fp32", "i32", "*i64"


def compile_variant(fn, signature, constexprs, name) -> bool:
    try:
        binary = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=TARGET,
                                options={"num_warps": kernels._NUM_WARPS})
    except Exception as error:  # report every variant, then fail
        print(f"{name}: FAILED: {type(error).__name__}: {str(error)[:3000]}")
        return False
    print(f"{name}: ok ({', '.join(binary.asm)})")
    return True


def main() -> int:
    ok = True
    geometry = {"BLOCK_V": kernels._BLOCK_V, "SEARCH_BLOCK": kernels._SEARCH_BLOCK, "NUM_PROBES": kernels._NUM_PROBES,
                "CAP": kernels._GATHER_CAP}
    for has_draft_logits in (False, True):
        signature = {"target_ptr": "*bf16", "draft_logits_ptr": "*bf16", "temperature_ptr": F32, "top_k_ptr": "*i32",
                     "top_p_ptr": F32, "min_p_ptr": F32, "stats_ptr": "*i32", "scratch_ptr": F32, "k": I32,
                     "vocab": I32, "t_stride_b": I32, "t_stride_i": I32, "d_stride_b": I32, "d_stride_i": I32,
                     "temperature_stride": I32, "top_k_stride": I32, "top_p_stride": I32, "min_p_stride": I32,
                     "HAS_DRAFT_LOGITS": "constexpr", "BLOCK_V": "constexpr", "SEARCH_BLOCK": "constexpr",
                     "NUM_PROBES": "constexpr", "CAP": "constexpr"}
        ok &= compile_variant(kernels._row_stats_kernel, signature, {"HAS_DRAFT_LOGITS": has_draft_logits, **geometry},
                              f"_row_stats_kernel(draft_logits={has_draft_logits})")
    for probs, logits, block in ((True, False, False), (True, False, True), (False, True, False), (False, True, True),
                                 (False, False, False), (False, False, True)):
        signature = {"target_ptr": F32, "draft_ptr": I64, "q_ptr": F32, "temperature_ptr": F32, "min_p_ptr": F32,
                     "seed_ptr": I64, "offset_ptr": I64, "stats_ptr": "*i32", "out_ptr": I64, "logprobs_ptr": F32,
                     "counters_ptr": I64, "k": I32, "vocab": I32, "num_rows": I32, "t_stride_b": I32,
                     "t_stride_i": I32, "draft_stride_b": I32, "q_stride_b": I32, "q_stride_i": I32,
                     "temperature_stride": I32, "min_p_stride": I32, "seed_stride": I32, "offset_stride": I32,
                     "HAS_DRAFT_PROBS": "constexpr", "HAS_DRAFT_LOGITS": "constexpr", "BLOCK": "constexpr",
                     "WITH_LOGPROBS": "constexpr", "COUNT": "constexpr", "BLOCK_K": "constexpr",
                     "BLOCK_V": "constexpr", "FAST_LOG": "constexpr"}
        constexprs = {"HAS_DRAFT_PROBS": probs, "HAS_DRAFT_LOGITS": logits, "BLOCK": block, "WITH_LOGPROBS": True,
                      "COUNT": True, "BLOCK_K": 8, "BLOCK_V": kernels._BLOCK_V, "FAST_LOG": True}
        ok &= compile_variant(kernels._verify_kernel, signature, constexprs,
                              f"_verify_kernel(draft_probs={probs}, draft_logits={logits}, block={block})")
    signature = {"logits_ptr": "*fp16", "temperature_ptr": F32, "top_k_ptr": I64, "top_p_ptr": F32, "min_p_ptr": F32,
                 "seed_ptr": I64, "position_ptr": I64, "out_ptr": I64, "probs_ptr": F32, "scratch_ptr": F32,
                 "vocab": I32, "logits_stride": I32, "temperature_stride": I32, "top_k_stride": I32,
                 "top_p_stride": I32, "min_p_stride": I32, "seed_stride": I32, "position_stride": I32,
                 "probs_stride": I32, "WITH_PROBS": "constexpr", "BLOCK_V": "constexpr", "SEARCH_BLOCK": "constexpr",
                 "NUM_PROBES": "constexpr", "CAP": "constexpr", "FAST_LOG": "constexpr"}
    for with_probs in (False, True):
        ok &= compile_variant(kernels._draft_kernel, signature,
                              {"WITH_PROBS": with_probs, **geometry, "FAST_LOG": True},
                              f"_draft_kernel(with_probs={with_probs})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

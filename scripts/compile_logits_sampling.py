"""Compiles every Triton kernel variant of specdec_ops/kernels/logits_sampling.py for an sm_90 target through
Triton's real compiler (TTIR, TTGIR, LLVM IR, PTX, cubin) without a GPU: catches what the interpreter lets pass
(loop-carried and branch types, constexpr use). Exits 1 if a variant fails. Run from the repository root:

    PYTHONPATH=. python scripts/compile_logits_sampling.py
    PYTHONPATH=. python scripts/compile_logits_sampling.py --gather-loop   # the filter pass's loop, both scans
    PYTHONPATH=. python scripts/compile_logits_sampling.py --registers     # the row passes under register limits

--gather-loop compiles `_filter_kernel` as bench_logits_sampling.py launches it (V = 32000, draft probabilities)
but reading every entry (sub_block 0), for gather_run 8 and 1, disassembles it with the cuobjdump that Triton's
package carries, and prints the size of the gather's loop (the loop that both loads the row and stores candidates):
SASS instructions per 1024-entry block and thread, barriers, shuffles: where the pass is bound by instruction
issue, the count predicts its time (a device call confirms). It also prints the two loops of the gather from
sub-block maxima (geometry sub_block): the listing of the sub-blocks that reach the floor, and the gather over them.

--registers compiles the statistics and filter passes as the benchmark launches them under register limits (ptx
.maxnreg: none, 80, 64) and prints per pass the registers per thread, the programs of its warps that fit an SM's
65536 registers, its local-memory instructions (spills, and arrays the compiler keeps in local memory), and those
inside the loops that read the row.
"""
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the real compiler, not the interpreter

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import specdec_ops  # noqa: E402,F401
from specdec_ops.kernels import logits_sampling as kernels  # noqa: E402
from specdec_ops.kernels.geometry import LOGITS_SAMPLING as GEOMETRY  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)

# Pointer element types by argument name (the rest: int32 scalars, constexprs as given).
POINTERS = {"target_ptr": "*bf16", "draft_logits_ptr": "*bf16", "logits_ptr": "*fp16", "q_ptr": "*fp32",
            "temperature_ptr": "*fp32", "top_k_ptr": "*i32", "top_p_ptr": "*fp32", "min_p_ptr": "*fp32",
            "stats_ptr": "*i32", "partial_ptr": "*i32", "hist_ptr": "*i32", "workspace_ptr": "*i64",
            "candidates_ptr": "*fp32", "counts_ptr": "*i32", "draft_ptr": "*i64", "seed_ptr": "*i64",
            "offset_ptr": "*i64", "position_ptr": "*i64", "out_ptr": "*i64", "logprobs_ptr": "*fp32",
            "counters_ptr": "*i64", "probs_ptr": "*fp32", "stop_ptr": "*i32", "submax_ptr": "*fp32", "subs_ptr": "*i32"}


def compile_variant(fn, constexprs, name, pointers=None, aligned=(), binaries=None, maxnreg=None) -> bool:
    """Compiles fn with the given constexprs; pointers and the integer arguments named in `aligned` are marked
    multiples of 16, as Triton specializes real launches' aligned tensors and sizes. The compiled kernel is appended
    to `binaries` when given. The row passes take the geometry's register limit unless `maxnreg` is given (0: none)."""
    types = {**POINTERS, **(pointers or {})}
    row_passes = (kernels._stats_kernel, kernels._filter_kernel)
    warps = GEOMETRY["stats_num_warps"] if fn in row_passes else GEOMETRY["num_warps"]
    if maxnreg is None and fn in row_passes:  # as _row_statistics launches them: a fused filter takes the filter's
        fused = fn is kernels._stats_kernel and constexprs.get("FUSED_FILTER")
        maxnreg = GEOMETRY["stats_maxnreg" if fn is kernels._stats_kernel and not fused else "filter_maxnreg"]
    signature = {arg: "constexpr" if arg in constexprs else types.get(arg, "i32") for arg in fn.arg_names}
    if fn in (kernels._filter_kernel, kernels._block_residual_kernel):
        signature["partial_ptr"] = "*fp32"  # the kept masses of min-p rows; the residual masses
    try:
        attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names)
                 if signature[arg].startswith("*") or arg in aligned}
        binary = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                target=TARGET,
                                options={"num_warps": warps, "num_stages": GEOMETRY["num_stages"],
                                         "maxnreg": maxnreg or None})
    except Exception as error:  # report every variant, then fail
        print(f"{name}: FAILED: {type(error).__name__}: {str(error)[:3000]}")
        return False
    print(f"{name}: ok ({', '.join(binary.asm)})")
    if binaries is not None:
        binaries.append(binary)
    return True


# The statistics chunks of a row of V = 32000, rounded up to a power of 2 (the row passes' BLOCK_C).
BLOCK_C = triton.next_power_of_2(triton.cdiv(32000, GEOMETRY["stats_chunk"]))


def row_pass_constexprs(gather_run) -> dict:
    """The constexprs the statistics and filter passes share, as the GPU launches them (rows of V = 32000)."""
    return {"BLOCK_V": GEOMETRY["stats_block_v"], "NUM_STAGES": GEOMETRY["stats_num_stages"], "BLOCK_C": BLOCK_C,
            "SEARCH_BLOCK": GEOMETRY["search_block"], "NUM_PROBES": GEOMETRY["num_probes"], "CAP": GEOMETRY["cap"],
            "SMALL_CAP": GEOMETRY["small_cap"], "GATHER_BLOCK": GEOMETRY["gather_block"], "GATHER_RUN": gather_run,
            "SUB_BLOCK": GEOMETRY["sub_block"]}


# The statistics pass's pointers beyond POINTERS.
STATS_POINTERS = {"kept_mass_ptr": "*fp32", "ticket_ptr": "*i64", "draft_ids_ptr": "*i64", "at_draft_ptr": "*fp32"}


def stats_pass_constexprs(has_draft_logits, fused, chunk_is_block, filters, at_draft=False) -> dict:
    """The statistics pass's constexprs, as the GPU launches it (row_pass_constexprs with the default gather);
    at_draft: the accept tests' values stored too (no filter pass), with draft probabilities unless draft logits."""
    return {"HAS_DRAFT_LOGITS": has_draft_logits, **row_pass_constexprs(GEOMETRY["gather_run"]),
            "CHUNK_IS_BLOCK": chunk_is_block, "NUM_BINS": GEOMETRY["hist_bins"], "BIN_SCALE": GEOMETRY["bin_scale"],
            "HIST_GROUP": GEOMETRY["hist_group"], "FUSED_FILTER": fused, "FILTERS": filters, "KEEP_IN_L2": False,
            "AT_DRAFT": at_draft, "HAS_DRAFT_PROBS": at_draft and not has_draft_logits}


# The sub-block size the compile check and --gather-loop use if the geometry's sub_block is 0 (off).
SUB_BLOCK = 32

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
# The launch's specializations for V = 32000, k = 4, draft probabilities: sizes and row strides divisible by 16.
ALIGNED = ("vocab", "chunk_len", "num_chunks", "t_stride_b", "t_stride_i", "d_stride_b", "d_stride_i")


def cuobjdump(binary, flag) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(binary.asm["cubin"])
        cubin.flush()
        return subprocess.run([str(CUOBJDUMP), flag, cubin.name], check=True, capture_output=True, text=True).stdout


def sass_loops(binary) -> tuple[list[str], list[list[str]]]:
    """The kernel's SASS instructions, and the body of each innermost loop: a span closed by a predicated backward
    branch (an unpredicated one can jump back to a shared exit, which closes no loop) holding no other such span."""
    code = [line for line in cuobjdump(binary, "--dump-sass").splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", line)]
    address = [int(re.search(r"/\*([0-9a-f]{4,})\*/", line).group(1), 16) for line in code]
    spans = []
    for end, line in enumerate(code):
        branch = re.search(r"@!?U?P\w+\s+BRA\s+(?:\S+\s+)?0x([0-9a-f]+)", line)
        if branch and int(branch.group(1), 16) in address[:end]:
            spans.append((address.index(int(branch.group(1), 16)), end))
    innermost = [(a, b) for a, b in spans if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)]
    return code, [code[a:b + 1] for a, b in innermost]


def gather_loop() -> int:
    """Prints the SASS size of the filter pass's gather loop for gather_run 8 and 1, and of the loops of its gather
    from sub-block maxima (see the module docstring)."""
    for gather_run in (8, 1):
        # The gather that reads every entry (sub_block 0), whatever the geometry's default.
        constexprs = {"HAS_DRAFT_LOGITS": False, **row_pass_constexprs(gather_run), "SUB_BLOCK": 0}
        binaries = []
        if not compile_variant(kernels._filter_kernel, constexprs, f"_filter_kernel(gather_run={gather_run})",
                               aligned=ALIGNED, binaries=binaries):
            return 1
        for loop in sass_loops(binaries[0])[1]:  # the loop that both loads the row and stores candidates
            body = "\n".join(loop)
            if "LDG" in body and "STG" in body:  # LDGSTS when pipelined, else LDG
                print(f"gather_run={gather_run}: {len(loop)} SASS instructions per "
                      f"{GEOMETRY['gather_block']}-entry block and thread, {body.count('BAR.SYNC')} barriers, "
                      f"{body.count('SHFL')} shuffles")
                break
        else:
            print(f"gather_run={gather_run}: no loop both loads the row and stores candidates")
            return 1
    # The gather from sub-block maxima: a loop listing the sub-blocks that reach the floor, then one reading them.
    sub_block = GEOMETRY["sub_block"] or SUB_BLOCK
    constexprs = {"HAS_DRAFT_LOGITS": False, **row_pass_constexprs(GEOMETRY["gather_run"]), "SUB_BLOCK": sub_block}
    binaries = []
    if not compile_variant(kernels._filter_kernel, constexprs, f"_filter_kernel(sub_block={sub_block})",
                           aligned=ALIGNED, binaries=binaries):
        return 1
    loops = [loop for loop in sass_loops(binaries[0])[1] if "LDG" in "\n".join(loop) and "STG" in "\n".join(loop)]
    if len(loops) < 2:
        print(f"sub_block={sub_block}: expected a listing loop and a gather loop")
        return 1
    per_step = GEOMETRY["gather_block"] // sub_block
    print(f"sub_block={sub_block}: listing {len(loops[0])} SASS instructions per {GEOMETRY['gather_block']} "
          f"sub-blocks and thread; gather {len(loops[1])} per {per_step} sub-blocks ({GEOMETRY['gather_block']} "
          f"entries) and thread, {chr(10).join(loops[1]).count('BAR.SYNC')} barriers")
    return 0


def registers() -> int:
    """Prints the row passes' registers and local-memory use under register limits (see the module docstring)."""
    passes = [(kernels._stats_kernel, stats_pass_constexprs(False, False, True, True), "statistics pass",
               STATS_POINTERS),
              (kernels._stats_kernel, stats_pass_constexprs(False, True, True, True), "statistics pass, filter fused",
               STATS_POINTERS),
              (kernels._filter_kernel, {"HAS_DRAFT_LOGITS": False, **row_pass_constexprs(GEOMETRY["gather_run"])},
               "filter pass", None)]
    threads = 32 * GEOMETRY["stats_num_warps"]
    for fn, constexprs, name, pointers in passes:
        for maxnreg in (0, 80, 64):
            binaries = []
            if not compile_variant(fn, constexprs, f"{name}, maxnreg {maxnreg or 'none'}", pointers, ALIGNED,
                                   binaries, maxnreg=maxnreg):
                return 1
            regs = int(re.search(r"REG:(\d+)", cuobjdump(binaries[0], "--dump-resource-usage")).group(1))
            code, loops = sass_loops(binaries[0])
            local = sum(1 for line in code if re.search(r"\b(LDL|STL)\b", line))
            row_loops = [loop for loop in loops if any("LDG" in line for line in loop)]
            in_loops = sum(1 for loop in row_loops for line in loop if re.search(r"\b(LDL|STL)\b", line))
            # Registers are allocated per warp in units of 256 (8 per thread).
            per_program = -(-regs // 8) * 8 * threads
            print(f"  {regs} registers per thread ({65536 // per_program} programs per SM by registers), "
                  f"{local} local loads and stores, {in_loops} in the {len(row_loops)} loops over the row "
                  f"({', '.join(str(len(loop)) for loop in row_loops)} instructions)")
    return 0


def main() -> int:
    ok = True
    row_pass = row_pass_constexprs(GEOMETRY["gather_run"])
    # The GPU's chunks are one block each (chunk_is_block); a chunk of several blocks, as tests force, takes the
    # online-sum loop: compiled once, fused.
    # FILTERS=False (top_k and top_p passed as None) compiles the histograms out; fused, min-p alone.
    stats_variants = [(logits, fused, True, True) for logits in (False, True) for fused in (False, True)]
    stats_variants += [(True, True, False, True), (False, False, True, False), (True, True, True, False)]
    for has_draft_logits, fused, chunk_is_block, filters in stats_variants:
        constexprs = stats_pass_constexprs(has_draft_logits, fused, chunk_is_block, filters)
        ok &= compile_variant(kernels._stats_kernel, constexprs,
                              f"_stats_kernel(draft_logits={has_draft_logits}, fused_filter={fused}, "
                              f"chunk_is_block={chunk_is_block}, filters={filters})", STATS_POINTERS)
    # The accept tests' values stored by the statistics pass (AT_DRAFT, no filter pass, geometry
    # accept_from_statistics): with draft probabilities, and with draft logits of another dtype than the target's (the
    # row's logit at its draft token loads from either tensor).
    ok &= compile_variant(kernels._stats_kernel, stats_pass_constexprs(False, False, True, False, at_draft=True),
                          "_stats_kernel(draft_probs, filters=None, at_draft=True)", STATS_POINTERS)
    ok &= compile_variant(kernels._stats_kernel, stats_pass_constexprs(True, False, True, False, at_draft=True),
                          "_stats_kernel(draft_logits=float32 beside bf16 target, filters=None, at_draft=True)",
                          {**STATS_POINTERS, "draft_logits_ptr": "*fp32"})
    # The rows loaded with L2's evict_last hint (geometry stats_keep_in_l2_mb).
    ok &= compile_variant(kernels._stats_kernel,
                          {**stats_pass_constexprs(False, False, True, False), "KEEP_IN_L2": True},
                          "_stats_kernel(keep_in_l2=True, filters=None)", STATS_POINTERS)
    for has_draft_logits in (False, True):
        ok &= compile_variant(kernels._filter_kernel, {"HAS_DRAFT_LOGITS": has_draft_logits, **row_pass},
                              f"_filter_kernel(draft_logits={has_draft_logits})")
    # The filter pass's other form, in the passes it changes: reading every entry when the geometry reads sub-blocks
    # (sub_block > 0, the default), else from SUB_BLOCK-entry sub-blocks.
    sub = {"SUB_BLOCK": 0 if GEOMETRY["sub_block"] else SUB_BLOCK}
    for has_draft_logits, fused in ((False, False), (True, True)):
        ok &= compile_variant(kernels._stats_kernel,
                              {**stats_pass_constexprs(has_draft_logits, fused, True, True), **sub},
                              f"_stats_kernel(draft_logits={has_draft_logits}, fused_filter={fused}, "
                              f"sub_block={sub['SUB_BLOCK']})", STATS_POINTERS)
    ok &= compile_variant(kernels._filter_kernel, {"HAS_DRAFT_LOGITS": False, **row_pass, **sub},
                          f"_filter_kernel(sub_block={sub['SUB_BLOCK']})")
    # Both row passes as sample_draft_filtered launches them on V = 32000 (one row per request, k = 0, one value of
    # each filter for the batch: stride 0), with the sizes' specializations: a layout-pass failure of triton 3.6 in
    # a gather variant showed only so (the H200 found it; every variant above compiled).
    draft_launch = {"rows_per_request": 1, "k": 0, "d_stride_i": 0, "temperature_stride": 1, "top_k_stride": 0,
                    "top_p_stride": 0, "min_p_stride": 0}
    aligned = ("vocab", "chunk_len", "t_stride_b", "d_stride_b")
    ok &= compile_variant(kernels._filter_kernel, {"HAS_DRAFT_LOGITS": False, **row_pass, **draft_launch},
                          "_filter_kernel(as sample_draft_filtered launches it)", aligned=aligned)
    ok &= compile_variant(kernels._stats_kernel, {**stats_pass_constexprs(False, False, True, True), **draft_launch},
                          "_stats_kernel(as sample_draft_filtered launches it)", STATS_POINTERS, aligned=aligned)
    for probs, logits in ((True, False), (False, True), (False, False)):
        flags = {"HAS_DRAFT_PROBS": probs, "HAS_DRAFT_LOGITS": logits, "WITH_LOGPROBS": True, "COUNT": True,
                 "BLOCK_K": 8, "BLOCK_V": GEOMETRY["block_v"], "FAST_LOG": True}
        # The GPU's chunk is one block (stats_block_v); the several-block loop compiles for draft logits.
        # AT_DRAFT: the accept tests' p(x_i), q(x_i) from the statistics pass (filters None), else computed here.
        for chunk_is_block, at_draft in ((True, False), (True, True), (False, False)) if logits else \
                ((True, False), (True, True)):
            ok &= compile_variant(kernels._block_residual_kernel,
                                  {"HAS_DRAFT_PROBS": probs, "HAS_DRAFT_LOGITS": logits,
                                   "CHUNK_IS_BLOCK": chunk_is_block, "BLOCK_K": 8, "BLOCK_V": GEOMETRY["stats_block_v"],
                                   "BLOCK_C": BLOCK_C, "NUM_STAGES": GEOMETRY["num_stages"], "AT_DRAFT": at_draft},
                                  f"_block_residual_kernel(draft_probs={probs}, draft_logits={logits}, "
                                  f"chunk_is_block={chunk_is_block}, at_draft={at_draft})",
                                  {"target_ptr": "*fp32", "at_draft_ptr": "*fp32"})
        for block in (False, True):
            for at_draft in (False, True):
                ok &= compile_variant(kernels._race_verify_kernel,
                                      {**flags, "BLOCK": block, "NUM_STAGES": GEOMETRY["num_stages"],
                                       "AT_DRAFT": at_draft},
                                      f"_race_verify_kernel(draft_probs={probs}, draft_logits={logits}, block={block}, "
                                      f"at_draft={at_draft})", {"target_ptr": "*fp32", "at_draft_ptr": "*fp32"})
    for with_probs in (False, True):
        ok &= compile_variant(kernels._draft_race_kernel, {"WITH_PROBS": with_probs, "BLOCK_V": GEOMETRY["block_v"],
                                                           "NUM_STAGES": GEOMETRY["num_stages"], "FAST_LOG": True},
                              f"_draft_race_kernel(with_probs={with_probs})")
    return 0 if ok else 1


if __name__ == "__main__":
    modes = {"--gather-loop": gather_loop, "--registers": registers}
    if sys.argv[1:] and (len(sys.argv) > 2 or sys.argv[1] not in modes):
        sys.exit(f"usage: compile_logits_sampling.py [{' | '.join(modes)}]")
    sys.exit(modes[sys.argv[1]]() if sys.argv[1:] else main())

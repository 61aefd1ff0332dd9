"""Tile geometry of every Triton kernel, in one table (tuned on the H200; benchmarks/RESULTS.md has the figures).

The two kernels launched from C++ (prepare_prefill, create_output) are launched with the numbers of
csrc/triton_launch.h, which `_C._launch_geometry()` reports; tests/test_geometry.py checks that they equal the
entries here, which the Python launch path and the benchmarks use.
"""
from __future__ import annotations

PREPARE_PREFILL = dict(
    rows=16,  # requests per program
    slots=16,  # the tile's first columns: all query_len + 1 = k + 2 slots of a decode round with k up to 14
    long_slots=1024,  # the rest of a longer query (a prompt), one request at a time, this many slots per step
    num_warps=4,
)

CREATE_OUTPUT = dict(
    block_rows=16,  # rows per program: small tiles, many programs
    num_warps=4,
)

ADVANCE_DRAFT_STEP = dict(block=1024, num_warps=4)

# Chosen by a geometry sweep on the H200: 4 warps over 1024-entry blocks (two race segments per thread), three
# pipeline stages, chunks of at most 8192 entries, and at least one program per SM when the batch is small.
REJECTION_SAMPLE = dict(
    block_v=1024,
    num_warps=4,
    num_stages=3,
    max_chunk=8192,  # longer rows are split even when the batch alone fills the GPU
    programs_per_sm=1,
)

# One program per row, so wide blocks keep a row's two passes short.
SAMPLE_DRAFT = dict(block_v=4096, num_warps=16)

# rejection_sample_logits and sample_draft_filtered. The race passes split a row's V into chunks of at most max_chunk
# entries (a multiple of block_v), more when the rows alone would give fewer than programs_per_sm programs per SM.
# The statistics and filter passes use chunks of a fixed length (stats_chunk: a row's sums do not depend on its
# batch), each read as one block of stats_block_v entries, several consecutive chunks per program so that the grid
# has about stats_programs_per_sm programs per SM. The statistics pass also counts each chunk's logits (the maximum of
# each hist_group consecutive ones) in hist_bins bins of width 1 / bin_scale below its maximum, from which the filter
# pass picks the lower bound of its candidates;
# at most cap candidates per row are sorted in registers (small_cap of them when there are that few; more take the
# full threshold search, one program per row, search_block entries by num_probes probes).
LOGITS_SAMPLING = dict(
    block_v=1024,  # the race passes' block
    num_warps=4,
    num_stages=3,
    # The race passes: chunks of at most max_chunk entries, more chunks for small batches. More and shorter chunks
    # (8 programs per SM, 4096 entries) measured slower on the H200 (B = 64: 12.7 us against 12.3).
    max_chunk=8192,
    programs_per_sm=2,
    # The statistics and filter passes (and block verification's residual pass): chunks of a fixed length
    # (batch-invariant sums); 8 chunks of a 32000 row. Against 2048 on an H100, bf16, V = 32000: top-k + top-p
    # 102.9 against 113.7 us at B = 256 with draft probabilities (176.2 against 183.9 with draft logits), 1 to 5 %
    # faster at B = 64 and 1; filters None 2.6 % and 1.7 % slower at B = 64 and 1 with draft probabilities (21.19
    # against 20.65 us at 64), the same or faster with draft logits. A chunk's block reductions and histogram cost
    # the same for twice the entries; the pass takes 127 to 128 registers per thread (72 to 92 at 2048; RESULTS.md).
    stats_chunk=4096,
    stats_block_v=4096,  # = stats_chunk: a chunk is one load, and the loop over a program's chunks is pipelined
    stats_num_warps=4,
    # The statistics and filter passes' software pipelining (loads in flight through shared memory). On the H200,
    # filtered, B = 64: 1 took 42.1 against 42.6 us with draft probabilities but 71.9 against 65.0 with draft logits.
    stats_num_stages=3,
    # The statistics pass loads its rows with L2's evict_last policy when they are at most this many MiB (0: never),
    # so that the race pass finds its row j still in L2 (one-block chunks, the GPU's; longer ones load as before).
    # Not yet timed on a GPU (RESULTS.md, twenty-seventh session).
    stats_keep_in_l2_mb=0,
    # 1: with no filter pass, the statistics pass's last program of each row also stores p(x_i) (and q(x_i)) at the
    # row's draft token, so that the race pass reads them with the row statistics instead of a dependent load of the
    # logits there before it can start (0: the race computes them, as before). Tested in the interpreter and compiled
    # for sm_90, but not yet run or timed on a GPU, so off until a device call measures it (RESULTS.md).
    accept_from_statistics=0,
    stats_programs_per_sm=8,  # 4 or 2: slower at B = 64 (one program per row); 16: within 1 us either way
    interpreter_stats_chunk=64,  # TRITON_INTERPRET: short, so that CPU tests with small blocks split their rows
    hist_bins=64,
    bin_scale=1,  # 63 logits deep: a peaked row's top token may lead its top_k-th by 30 and more
    hist_group=8,  # the histograms count the maximum of each hist_group consecutive entries (1: every entry)
    cap=1024,
    small_cap=256,
    # The filter pass's block: its scan over a 2048-entry block took 121 registers per thread, 96 over 1024 (triton
    # 3.6, sm_90).
    gather_block=1024,
    # The filter pass's scan: 8 = each thread holds runs of 8 consecutive entries (one 16-byte load of bf16) and
    # scans only the runs' counts across threads; 1 = one scan over the whole block. Per block and thread, sm_90:
    # 171 against 422 SASS instructions with triton 3.6 (`scripts/compile_logits_sampling.py --gather-loop`); on an
    # H100, top-k + top-p, bf16, V = 32000, draft probabilities: 44.1 against 57.7 us at B = 64 (RESULTS.md).
    gather_run=8,
    # 0: the filter pass reads every entry of a filtered row again. N (a power of 2): the statistics pass also stores
    # the maximum of each N consecutive entries of a filtered row, and the filter pass reads only the sub-blocks whose
    # maximum reaches its floor (about a tenth of them under top-k 50 or top-p 0.9 of an LLM's logits), listing them
    # first. On an H100 (2048-entry statistics chunks), top-k 50 + top-p 0.9, bf16, V = 32000, draft probabilities:
    # 41.1 against 43.3 us at B = 64 and 113.9 against 138.5 at B = 256 (draft logits: 58.4 against 66.2, 183.5
    # against 229.8); 16 timed the same within 3.4 % and doubles the maxima's memory (RESULTS.md).
    sub_block=32,
    # Register limits (ptx .maxnreg) of the statistics pass and of the filter pass (the statistics pass too where it
    # runs the filter fused); 0: the compiler's choice. With 4096-entry chunks, on sm_90 triton 3.6 (the device
    # image's) gives them 127 and 95 registers per thread (128 fused): 4 and 5 programs of 4 warps per SM; at 64 the
    # statistics pass spills inside its loops over the row (`scripts/compile_logits_sampling.py --registers`). With
    # 2048-entry chunks (92 registers) a limit of 64 timed 1 % faster at B = 64 on an H100 (RESULTS.md).
    stats_maxnreg=0,
    filter_maxnreg=0,
    search_block=256,
    num_probes=16,
    fused_filter=2,  # each row's last statistics program runs the filter pass: 0 never, 1 always, 2 when it is the
    # row's only program (no `_filter_kernel` launch, whose programs cost even when no row is filtered)
    interpreter_sms=4,  # the SM count assumed without CUDA (TRITON_INTERPRET)
)

# greedy_verify and typical_acceptance: 8 warps from 2048-entry blocks on, else 4.
VERIFY = dict(
    max_block_v=4096,
    min_chunk=8192,  # a program reads at least this many entries of a row when V allows
    programs_per_sm=4,
    wide_block_v=2048,
    wide_num_warps=8,
    num_warps=4,
    interpreter_sms=4,  # the SM count assumed without CUDA (TRITON_INTERPRET), so small tests split rows
)

# The entries C++ launches with, by the names `_C._launch_geometry()` uses.
LAUNCHED_FROM_CPP = {"prepare_prefill": PREPARE_PREFILL, "create_output": CREATE_OUTPUT}

"""Where rejection_sample_logits' statistics and filter passes spend their time, program by program.

Writes an instrumented copy of specdec_ops into a temporary folder (the checkout is not touched): there the
statistics and filter kernels store each program's %globaltimer, %clock64 and %smid at its phases (statistics:
start, chunks done, ticket taken, end; filter: start, gather done, ticket taken, the finish's end). Then, on
bench_logits_sampling.py's inputs (V = 32000, bf16, top-k 50 + top-p 0.9), it prints per batch size the whole call's
GPU time (CUDA-graph replays of the instrumented code: the stores add a little), torch.profiler's per-kernel split,
and per pass: programs, span, per-program phase times (median, p90, max), start-time quantiles (waves show as late
starts), programs per SM and the most running on one SM at once.

    python3 scripts/profile_logits_phases.py [--batches 1,16,64] [--inputs peaked] [--ops probs] [--json]
    python3 scripts/profile_logits_phases.py --compile   # no GPU needed: compile the instrumented kernels for sm_90

The patches are text replacements of logits_sampling.py; each must match exactly once, so a change to the kernels
that moves a patched line fails here with the line named, not with wrong timings.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHILD = "SPECDEC_PHASES_CHILD"


def instrument(source: str) -> str:
    """logits_sampling.py's source with the timers added (module globals FILTER_TIMER [rows, programs, 8] and
    STATS_TIMER [rows, programs, 6], int64, allocated per call)."""
    for old, new in PATCHES:
        count = source.count(old)
        if count != 1:
            raise SystemExit(f"profile_logits_phases: the patched line {old.strip().splitlines()[0]!r} appears "
                             f"{count} times in logits_sampling.py (expected once): update the patch")
        source = source.replace(old, new)
    return source


# (the original text, its instrumented replacement), in file order.
PATCHES = [
    ("""\
from .ticket import reset_ticket_tl, take_ticket_tl
""",
     """\
from .ticket import reset_ticket_tl, take_ticket_tl

FILTER_TIMER = None
STATS_TIMER = None


@triton.jit
def _gtime():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _clock():
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _smid():
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
"""),
    ("""\
    KEEP_IN_L2: tl.constexpr, AT_DRAFT: tl.constexpr, HAS_DRAFT_PROBS: tl.constexpr,
):""",
     """\
    KEEP_IN_L2: tl.constexpr, AT_DRAFT: tl.constexpr, HAS_DRAFT_PROBS: tl.constexpr,
    stats_timer_ptr,
):"""),
    ("""\
    g = tl.program_id(0).to(tl.int64)
    num_programs = tl.num_programs(1)
""",
     """\
    g = tl.program_id(0).to(tl.int64)
    num_programs = tl.num_programs(1)
    st_rec = stats_timer_ptr + (g * num_programs + tl.program_id(1)) * 6
    tl.store(st_rec, _gtime())
    tl.store(st_rec + 4, _smid().to(tl.int64))
"""),
    ("""\
    tl.debug_barrier()  # every thread's partials and histograms are stored before the ticket publishes them
    if take_ticket_tl(ticket_ptr + g) == num_programs - 1:
""",
     """\
    tl.debug_barrier()  # every thread's partials and histograms are stored before the ticket publishes them
    tl.store(st_rec + 1, _gtime())
    st_ticket = take_ticket_tl(ticket_ptr + g)
    tl.store(st_rec + 2, _gtime())
    tl.store(st_rec + 5, (st_ticket == num_programs - 1).to(tl.int64))
    tl.store(st_rec + 3, _gtime())
    if st_ticket == num_programs - 1:
"""),
    ("""\
        _store_stats_tl(stats_ptr + g * 4, m, tau, mass, argmax)
""",
     """\
        _store_stats_tl(stats_ptr + g * 4, m, tau, mass, argmax)
        tl.store(st_rec + 3, _gtime())
"""),
    ("""\
                           d_stride_i, BLOCK_V, NUM_STAGES, SEARCH_BLOCK, NUM_PROBES, CAP, SMALL_CAP, BLOCK_C,
                           GATHER_BLOCK, GATHER_RUN, SUB_BLOCK)""",
     """\
                           d_stride_i, BLOCK_V, NUM_STAGES, SEARCH_BLOCK, NUM_PROBES, CAP, SMALL_CAP, BLOCK_C,
                           GATHER_BLOCK, GATHER_RUN, SUB_BLOCK, stats_ptr, 0, 0, False)"""),
    ("""\
                   NUM_PROBES: tl.constexpr, CAP: tl.constexpr, SMALL_CAP: tl.constexpr, BLOCK_C: tl.constexpr,
                   GATHER_BLOCK: tl.constexpr, GATHER_RUN: tl.constexpr, SUB_BLOCK: tl.constexpr):""",
     """\
                   NUM_PROBES: tl.constexpr, CAP: tl.constexpr, SMALL_CAP: tl.constexpr, BLOCK_C: tl.constexpr,
                   GATHER_BLOCK: tl.constexpr, GATHER_RUN: tl.constexpr, SUB_BLOCK: tl.constexpr,
                   timer_ptr, t_start, c_start, TIMED: tl.constexpr):"""),
    ("""\
        tl.debug_barrier()  # every thread's candidates and masses are stored before the ticket publishes them
        if take_ticket_tl(workspace_ptr + g) == num_programs - 1:
""",
     """\
        tl.debug_barrier()  # every thread's candidates and masses are stored before the ticket publishes them
        c_gather = _clock()
        f_ticket = take_ticket_tl(workspace_ptr + g)
        c_ticket = _clock()
        rec = timer_ptr + (g * num_programs + program) * 8
        if TIMED:
            tl.store(rec, t_start)
            tl.store(rec + 1, _gtime())
            tl.store(rec + 2, c_gather - c_start)
            tl.store(rec + 3, c_ticket - c_gather)
            tl.store(rec + 4, 0)
            tl.store(rec + 5, _smid().to(tl.int64))
            tl.store(rec + 6, (f_ticket == num_programs - 1).to(tl.int64))
            tl.store(rec + 7, 0)
        if f_ticket == num_programs - 1:
"""),
    ("""\
            tl.store(stats_ptr + g * 4 + 1 + which, tl.where(which == 0, tau, mass.to(tl.int32, bitcast=True)))
""",
     """\
            tl.store(stats_ptr + g * 4 + 1 + which, tl.where(which == 0, tau, mass.to(tl.int32, bitcast=True)))
            if TIMED:
                tl.store(rec + 4, _clock() - c_ticket)
                tl.store(rec + 7, _gtime())
"""),
    ("""\
    NUM_PROBES: tl.constexpr, CAP: tl.constexpr, SMALL_CAP: tl.constexpr, BLOCK_C: tl.constexpr,
    GATHER_BLOCK: tl.constexpr, GATHER_RUN: tl.constexpr, SUB_BLOCK: tl.constexpr,
):""",
     """\
    NUM_PROBES: tl.constexpr, CAP: tl.constexpr, SMALL_CAP: tl.constexpr, BLOCK_C: tl.constexpr,
    GATHER_BLOCK: tl.constexpr, GATHER_RUN: tl.constexpr, SUB_BLOCK: tl.constexpr, timer_ptr,
):"""),
    ("""\
    g = tl.program_id(0).to(tl.int64)
    program = tl.program_id(1)
    c_first = program * chunks_per_program
""",
     """\
    t_start = _gtime()
    c_start = _clock()
    g = tl.program_id(0).to(tl.int64)
    program = tl.program_id(1)
    c_first = program * chunks_per_program
"""),
    ("""\
                   SEARCH_BLOCK, NUM_PROBES, CAP, SMALL_CAP, BLOCK_C, GATHER_BLOCK, GATHER_RUN, SUB_BLOCK)
""",
     """\
                   SEARCH_BLOCK, NUM_PROBES, CAP, SMALL_CAP, BLOCK_C, GATHER_BLOCK, GATHER_RUN, SUB_BLOCK, timer_ptr,
                   t_start, c_start, True)
"""),
    ("""\
    grid = (rows, programs)
    common = (k, vocab,""",
     """\
    grid = (rows, programs)
    global FILTER_TIMER, STATS_TIMER
    FILTER_TIMER = torch.zeros((rows, programs, 8), dtype=torch.int64, device=device)
    STATS_TIMER = torch.zeros((rows, programs, 6), dtype=torch.int64, device=device)
    common = (k, vocab,"""),
    ("""\
        KEEP_IN_L2=keep_in_l2, AT_DRAFT=at_draft_given, HAS_DRAFT_PROBS=at_draft_given and draft_probs is not None,
        **search,""",
     """\
        KEEP_IN_L2=keep_in_l2, AT_DRAFT=at_draft_given, HAS_DRAFT_PROBS=at_draft_given and draft_probs is not None,
        stats_timer_ptr=STATS_TIMER, **search,"""),
    ("""\
            HAS_DRAFT_LOGITS=has_logits, BLOCK_V=block_v, NUM_STAGES=geometry["stats_num_stages"], BLOCK_C=block_c,
            **search, num_warps""",
     """\
            HAS_DRAFT_LOGITS=has_logits, BLOCK_V=block_v, NUM_STAGES=geometry["stats_num_stages"], BLOCK_C=block_c,
            timer_ptr=FILTER_TIMER, **search, num_warps""")
]


def quantile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


def spread(values):
    return {"median": quantile(values, 0.5), "p90": quantile(values, 0.9), "max": max(values)}


def per_sm(spans):
    """Programs per SM and the most live on one SM at once, from (start, end, sm) spans."""
    by_sm = {}
    for start, end, sm in spans:
        by_sm.setdefault(sm, []).append((start, end))
    peaks = []
    for items in by_sm.values():
        live = peak = 0
        for _, step in sorted([(start, 1) for start, _ in items] + [(end, -1) for _, end in items]):
            live += step
            peak = max(peak, live)
        peaks.append(peak)
    counts = [len(items) for items in by_sm.values()]
    return {"sms": len(by_sm), "programs_per_sm": spread(counts), "peak_live_per_sm": spread(peaks)}


def phases(kernels) -> dict:
    """The passes' per-program records of the last call, summarized (times in us)."""
    stats = [row for row in kernels.STATS_TIMER.cpu().reshape(-1, 6).tolist() if row[0] > 0]
    start = min(row[0] for row in stats)
    stats_end = max(row[3] for row in stats)
    result = {"statistics": {
        "programs": len(stats), "span_us": (stats_end - start) / 1e3,
        "chunks_us": spread([(row[1] - row[0]) / 1e3 for row in stats]),
        "ticket_us": spread([(row[2] - row[1]) / 1e3 for row in stats]),
        "last_program_finish_us": spread([(row[3] - row[2]) / 1e3 for row in stats if row[5]]),
        "start_offset_us": spread([(row[0] - start) / 1e3 for row in stats]),
        **per_sm([(row[0], row[3], row[4]) for row in stats])}}
    filt = [row for row in kernels.FILTER_TIMER.cpu().reshape(-1, 8).tolist() if row[0] > 0]
    if not filt:  # fused into the statistics pass, or no row filtered
        return result
    start = min(row[0] for row in filt)
    # %clock64 counts SM cycles: the ratio to %globaltimer over each program's gather and ticket gives the clock.
    ghz = quantile([(row[2] + row[3]) / max(1, row[1] - row[0]) for row in filt], 0.5)
    result["filter"] = {
        "programs": len(filt), "span_us": (max(max(row[1], row[7]) for row in filt) - start) / 1e3,
        "gap_after_statistics_us": (start - stats_end) / 1e3, "clock_ghz": ghz,
        "program_us": spread([(row[1] - row[0]) / 1e3 for row in filt]),
        "gather_us": spread([row[2] / ghz / 1e3 for row in filt]),
        "ticket_us": spread([row[3] / ghz / 1e3 for row in filt]),
        "last_program_finish_us": spread([row[4] / ghz / 1e3 for row in filt if row[6]] or [0]),
        "start_offset_us": spread([(row[0] - start) / 1e3 for row in filt]),
        **per_sm([(row[0], max(row[1], row[7]), row[5]) for row in filt])}
    return result


def run_child(args) -> int:
    sys.path.insert(0, str(ROOT / "scripts"))
    if args.compile:
        import compile_logits_sampling

        compile_logits_sampling.POINTERS.update({"stats_timer_ptr": "*i64", "timer_ptr": "*i64"})
        return compile_logits_sampling.main()
    import torch

    import bench_logits_sampling as bench
    import specdec_ops
    from _timing import graph_us
    from specdec_ops.kernels import logits_sampling as kernels

    assert hasattr(kernels, "FILTER_TIMER"), "the instrumented copy was not imported"
    if not torch.cuda.is_available():
        print("profile_logits_phases: no CUDA device (--compile checks the instrumented kernels without one)")
        return 1
    report = []
    for batch in (int(b) for b in args.batches.split(",")):
        target, draft, draft_logits, q, params, seeds, offsets = bench.make_inputs(
            batch, 32000, torch.bfloat16, "top-k+top-p", "cuda", args.inputs)
        for op in args.ops.split(","):
            given = dict(draft_probs=q) if op == "probs" else dict(draft_logits=draft_logits)

            def call():
                return specdec_ops.rejection_sample_logits(target, draft, *params, seeds, offsets, **given)

            us = graph_us(call, 20)
            for _ in range(3):
                call()
            torch.cuda.synchronize()
            calls = 20
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    call()
                torch.cuda.synchronize()
            per_kernel = {}
            for event in prof.events():
                if event.device_type == torch.autograd.DeviceType.CUDA:
                    per_kernel[event.name] = per_kernel.get(event.name, 0.0) + event.device_time / calls
            call()
            torch.cuda.synchronize()
            report.append({"batch": batch, "op": op, "inputs": args.inputs, "graph_us": us,
                           "kernels_us": per_kernel, **phases(kernels)})
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    for item in report:
        kernels_us = ", ".join(f"{name} {us:.1f}" for name, us in item["kernels_us"].items())
        print(f"B = {item['batch']}, {item['op']}, {item['inputs']}: {item['graph_us']:.2f} us per call | {kernels_us}"
              " | phases: median/p90/max")
        for name in ("statistics", "filter"):
            if name in item:
                fields = "; ".join(f"{key} {format_value(value)}" for key, value in item[name].items())
                print(f"  {name}: {fields}")
    return 0


def format_value(value):
    if isinstance(value, dict):
        return "/".join(format_value(v) for v in value.values())
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,16,64", help="comma-separated B values")
    parser.add_argument("--inputs", default="peaked", choices=["peaked", "flat", "outlier"])
    parser.add_argument("--ops", default="probs", help="probs (draft probabilities given), logits, or both")
    parser.add_argument("--compile", action="store_true", help="only compile the instrumented kernels for sm_90")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args()
    for op in args.ops.split(","):
        if op not in ("probs", "logits"):
            parser.error(f"--ops: expected probs or logits, got {op!r}")
    if os.environ.get(CHILD):
        return run_child(args)
    with tempfile.TemporaryDirectory() as folder:
        copy = Path(folder) / "specdec_ops"
        shutil.copytree(ROOT / "specdec_ops", copy, ignore=shutil.ignore_patterns("__pycache__"))
        source = copy / "kernels" / "logits_sampling.py"
        source.write_text(instrument(source.read_text()))
        env = {**os.environ, CHILD: "1", "PYTHONPATH": os.pathsep.join([folder, os.environ.get("PYTHONPATH", "")])}
        return subprocess.call([sys.executable, __file__, *sys.argv[1:]], env=env)


if __name__ == "__main__":
    sys.exit(main())

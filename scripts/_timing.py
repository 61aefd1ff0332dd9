"""Timing helpers shared by the benchmark scripts (run them from the repository root)."""
import statistics
import time

import torch

CALLS_PER_GRAPH = 100


def eager_us(fn, iters: int, warmup: int = 10, warmup_s: float = 0.3) -> float:
    """Host wall-clock microseconds per call of a Python loop (dispatch and launch included), median of 7.

    Warms up for at least `warmup` calls and `warmup_s` seconds first, to time a steady state.
    """
    start = time.perf_counter()
    calls = 0
    while calls < warmup or time.perf_counter() - start < warmup_s:
        fn()
        calls += 1
    torch.cuda.synchronize()
    samples = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / iters * 1e6)
    return statistics.median(samples)


def graph_us(fn, replays: int) -> float:
    """GPU microseconds per call: one CUDA graph of CALLS_PER_GRAPH calls, median over replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles kernels) outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(replays):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end) * 1e3 / CALLS_PER_GRAPH)
    del graph
    return statistics.median(samples)


def median_ms(fn, iters: int, warmup: int) -> float:
    """Milliseconds per call between CUDA events recorded around it (one call at a time), median over iters."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)

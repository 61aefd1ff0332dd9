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


# Cycles of the spin kernel (torch.cuda._sleep, a private torch API) queued before a timed replay: about 100 us at
# the H200's 1980 MHz, meant to outlast the host's submission of the graph. Should the host take longer, part of the
# submission stays in the span: the figure then errs high, never low.
_SUBMIT_COVER_CYCLES = 200_000


def capture_graph(fn, calls: int = CALLS_PER_GRAPH) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` calls of fn, warmed up (kernels compiled) outside the capture and replayed once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, cover_submission: bool = True) -> float:
    """GPU microseconds of one replay, between CUDA events recorded around it.

    With cover_submission, a spin kernel runs first, so the GPU is still busy when the host has submitted the
    replay, and the begin event is not stamped while the GPU waits for the host: the time is GPU time only (NVBench's
    blocking kernel serves the same end).
    Without it, the span also holds the host's submission of the graph.
    """
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if cover_submission:
        torch.cuda._sleep(_SUBMIT_COVER_CYCLES)
    begin.record()
    graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) * 1e3


def graph_us(fn, replays: int, cover_submission: bool = True) -> float:
    """Microseconds per call of one CUDA graph of CALLS_PER_GRAPH calls, median over replays: GPU time, or with
    cover_submission=False GPU time plus the host's submission of the graph (see replay_us)."""
    graph = capture_graph(fn)
    samples = [replay_us(graph, cover_submission) / CALLS_PER_GRAPH for _ in range(replays)]
    del graph
    return statistics.median(samples)


def graph_slope_us(fn, replays: int, calls: int = 3 * CALLS_PER_GRAPH) -> float:
    """GPU microseconds per call from the difference between a graph of `calls` calls and one of CALLS_PER_GRAPH:
    what each further call adds, with the cost of starting a replay cancelled out (medians over replays)."""
    assert calls > CALLS_PER_GRAPH, "the second graph must hold more calls than the first"
    short, long = capture_graph(fn), capture_graph(fn, calls)
    short_us = statistics.median([replay_us(short) for _ in range(replays)])
    long_us = statistics.median([replay_us(long) for _ in range(replays)])
    del short, long
    return (long_us - short_us) / (calls - CALLS_PER_GRAPH)


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

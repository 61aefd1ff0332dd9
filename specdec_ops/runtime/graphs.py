"""`StepGraphs`: one step function run eagerly, compiled, or compiled and replayed as one CUDA graph per size.

The proposer and the generator each have a step that reads and writes only persistent buffers and takes static
padded sizes as its arguments (``step(*sizes)``). `StepGraphs` holds what runs it:

- ``compile=False``: the step itself, eagerly.
- ``compile=True``: ``torch.compile(step, fullgraph=True, dynamic=False)``: one graph per distinct sizes.
- ``cuda_graphs=True`` (the default on CUDA): the compiled step is warmed up twice on a side stream (compiling,
  autotuning, JIT-ing the Triton kernels), then captured into one ``torch.cuda.CUDAGraph`` per sizes, all in one
  memory pool; a call replays it. The step writes only persistent buffers, so a replay is all a call needs.
- ``cuda_graphs="reduce-overhead"``: torch.compile's own CUDA-graph trees (the caller marks its buffers static).

``run(*sizes)`` is the whole host-side cost of a call once a size is captured: a dict lookup and a replay.
"""
from __future__ import annotations

from typing import Callable

import torch


def check_graph_mode(owner: str, device: torch.device, compile: bool, cuda_graphs) -> bool | str:
    """The resolved cuda_graphs mode (None -> True on CUDA, False elsewhere); ValueError on a bad combination."""
    if cuda_graphs is None:
        cuda_graphs = device.type == "cuda"
    if cuda_graphs not in (True, False, "reduce-overhead"):
        raise ValueError(f"{owner}: cuda_graphs must be True, False, None or 'reduce-overhead', got {cuda_graphs!r}")
    if cuda_graphs and device.type != "cuda":
        raise ValueError(f"{owner}: cuda_graphs needs a CUDA device")
    if cuda_graphs == "reduce-overhead" and not compile:
        raise ValueError(f"{owner}: cuda_graphs='reduce-overhead' needs compile=True")
    return cuda_graphs


def raise_recompile_limit(graphs: int) -> None:
    """Raises dynamo's per-function recompile limit by `graphs`.

    Every padded size is one more graph of one step function (one code object), and every owner of such a step
    adds its own sizes, so each raises the limit by its count instead of setting it.
    """
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, getattr(config, name) + graphs)


class StepGraphs:
    """Runs ``step(*sizes)`` eagerly, compiled, or as one captured CUDA graph per sizes (module docstring).

    Args:
        step: the step function; it must touch only persistent tensors and take only static ints.
        device: the device the step runs on.
        compile: whether to torch.compile the step (fullgraph, static shapes).
        cuda_graphs: True, False, None (True on CUDA) or "reduce-overhead"; see `check_graph_mode`.
        num_sizes: how many distinct sizes will run (raises the recompile limit by that many).
        owner: the name used in error messages.
    """

    def __init__(self, step: Callable[..., None], *, device: torch.device, compile: bool, cuda_graphs,
                 num_sizes: int, owner: str):
        self.device = device
        self.mode = check_graph_mode(owner, device, compile, cuda_graphs)
        if compile:
            raise_recompile_limit(num_sizes)
        if not compile:
            self.step = step
        elif self.mode == "reduce-overhead":
            self.step = torch.compile(step, fullgraph=True, dynamic=False, mode="reduce-overhead")
        else:
            self.step = torch.compile(step, fullgraph=True, dynamic=False)
        self.manual_graphs = self.mode is True
        self.graphs: dict[tuple[int, ...], torch.cuda.CUDAGraph] = {}
        self._pool = None

    def run(self, *sizes: int) -> None:
        """One call of the step at `sizes`: a replay of its graph (captured on the first call) or a plain call."""
        if not self.manual_graphs:
            self.step(*sizes)
            return
        graph = self.graphs.get(sizes)
        if graph is None:
            graph = self.capture(*sizes)
        graph.replay()

    def capture(self, *sizes: int) -> torch.cuda.CUDAGraph:
        """Runs the step twice at `sizes` on a side stream (compiling it), then records it (recording runs nothing)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.step(*sizes)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            self.step(*sizes)
        self.graphs[sizes] = graph
        return graph

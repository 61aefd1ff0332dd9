"""How the op tests run an op: on a backend (the C++ kernel or the Triton kernel), with bad inputs, in a CUDA graph.

`Backend` is what the `backend` fixture (conftest.py) gives: ``backend.<op>(*args, **kwargs)`` calls the op with the
public wrapper's arguments, on CPU tensors, and returns CPU results. The "cpp" backend is the wrapper on CPU, which
runs the C++ kernel. The "triton" backend runs the Triton kernel: on a CUDA machine through the wrapper on copies of
the arguments on the GPU (copying mutated arguments back), elsewhere through the kernel module's entry under
TRITON_INTERPRET.
"""
from __future__ import annotations

import functools
import inspect

import pytest
import torch

import specdec_ops
from specdec_ops._triton import HAS_TRITON

HAS_CUDA = torch.cuda.is_available()


def _triton_entries():
    from specdec_ops.kernels import draft_step, output, prefill, sampling, verify

    return {
        "prepare_prefill": lambda *a, **k: specdec_ops.PrefillInputs(*prefill.prepare_prefill_triton(*a, **k)),
        "prepare_prefill_into": prefill.prepare_prefill_into_triton,
        "create_output": output.create_output_triton,
        "rejection_sample": sampling.rejection_sample_triton,
        "sample_draft": sampling.sample_draft_triton,
        "greedy_verify": verify.greedy_verify_triton,
        "typical_acceptance": verify.typical_acceptance_triton,
        "advance_draft_step": draft_step.advance_draft_step_triton,
    }


def _call_triton_entry(op, args, kwargs):
    """The Triton entry of `op` with the wrapper's arguments (an entry takes them positionally, in that order)."""
    bound = inspect.signature(getattr(specdec_ops, op)).bind(*args, **kwargs)
    bound.apply_defaults()
    return _triton_entries()[op](*bound.args)


def _to(value, device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _to_cpu(result):
    if isinstance(result, torch.Tensor):
        return result.cpu()
    if isinstance(result, tuple):
        return type(result)(*(_to_cpu(r) for r in result)) if hasattr(result, "_fields") else \
            tuple(_to_cpu(r) for r in result)
    return result


class Backend:
    def __init__(self, name: str):
        assert name in ("cpp", "triton")
        self.name = name

    def __repr__(self):
        return self.name

    def __getattr__(self, op: str):
        if op.startswith("_"):
            raise AttributeError(op)
        return functools.partial(self.call, op)

    def call(self, op: str, *args, **kwargs):
        if self.name == "cpp":
            return getattr(specdec_ops, op)(*args, **kwargs)
        if not HAS_CUDA:
            return _call_triton_entry(op, args, kwargs)
        cuda_args = [_to(a, "cuda") for a in args]
        cuda_kwargs = {k: _to(v, "cuda") for k, v in kwargs.items()}
        pairs = [(o, c) for o, c in [*zip(args, cuda_args), *((kwargs[k], cuda_kwargs[k]) for k in kwargs)]
                 if isinstance(o, torch.Tensor)]
        versions = [c._version for _, c in pairs]
        result = getattr(specdec_ops, op)(*cuda_args, **cuda_kwargs)
        # The arguments the op mutated (counters, probs, prepare_prefill_into's buffers: their version counters
        # moved) are copied back.
        for (original, copy), version in zip(pairs, versions):
            if copy._version != version:
                original.copy_(copy)
        return _to_cpu(result)


BACKENDS = [pytest.param("cpp", id="cpp"),
            pytest.param("triton", id="triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="needs triton"))]


def check_bad_input(op: str, args, kwargs=None, *, match: str, triton: bool = True) -> None:
    """The op, called through its wrapper with `args`, raises a ValueError matching `match` eagerly (the C++ kernel's
    checks, on CPU), on meta tensors (the fake kernel, as tracing runs it) and, with `triton`, from the Triton entry
    (the launcher's checks)."""
    kwargs = kwargs or {}
    wrapper = getattr(specdec_ops, op)
    with pytest.raises(ValueError, match=match):
        wrapper(*args, **kwargs)
    with pytest.raises(ValueError, match=match):
        wrapper(*[_to(a, "meta") for a in args], **{k: _to(v, "meta") for k, v in kwargs.items()})
    if triton and HAS_TRITON:  # the checks run before any launch, so CPU tensors do on a CUDA machine too
        with pytest.raises(ValueError, match=match):
            _call_triton_entry(op, args, kwargs)


def capture_graph(fn):
    """(graph, fn's result): fn is called once on a side stream (which compiles its kernels), then captured into a
    CUDA graph; the result's tensors are the graph's static outputs, rewritten by each replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result

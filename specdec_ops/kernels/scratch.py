"""The persistent zeroed scratch of the ticket kernels, and the SM count their launch plans read.

rejection_sample, greedy_verify, typical_acceptance, rejection_sample_logits and sample_draft_filtered combine their
programs' results (atomic maxima, slot counters and the last-program tickets of kernels/ticket.py) through one int64
buffer per device that every kernel leaves zeroed, so a call (or a CUDA-graph replay) needs no memset launch.
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached: the query is slow for a hot path)."""
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


SCRATCH_CAPACITY = 1 << 17  # int64 entries (1 MiB) per device
_scratch: dict[torch.device, torch.Tensor] = {}
_outgrown_scratch: list[torch.Tensor] = []  # kept alive: captured CUDA graphs may still point at them


def zeroed_scratch(device: torch.device, numel: int) -> torch.Tensor:
    """A persistent int64 buffer of at least `numel` zeros on `device`, shared by the ticket kernels.

    A kernel that combines its programs' results through it (atomic tickets and maxima) must set every entry it
    touched back to 0 before it finishes, so each call and each CUDA-graph replay starts from zeros without a
    memset. Calls are ordered by their stream: two streams running such kernels (rejection_sample, greedy_verify,
    typical_acceptance, the logits samplers) at the same time on one device would share the buffer, which is not supported.
    """
    scratch = _scratch.get(device)
    if scratch is not None and scratch.numel() >= numel:
        return scratch
    grown = torch.zeros(max(numel, SCRATCH_CAPACITY), dtype=torch.int64, device=device)
    if device.type == "cuda" and (torch.cuda.is_current_stream_capturing() or not _in_default_pool(grown)):
        # Memory of a CUDA-graph pool (a capture, or torch.compile's cudagraph warmup) can be reclaimed by the
        # graph machinery behind a tensor it does not track: these zeros serve this call only (a captured graph
        # replays their memset), and a later call outside any pool allocates the persistent buffer.
        return grown
    if scratch is not None:
        _outgrown_scratch.append(scratch)
    _scratch[device] = grown
    return grown


def _in_default_pool(t: torch.Tensor) -> bool:
    """Whether t's memory is in the CUDA caching allocator's default pool (one snapshot: call rarely)."""
    address = t.data_ptr()
    for segment in torch.cuda.memory_snapshot():
        if segment["address"] <= address < segment["address"] + segment["total_size"]:
            return tuple(segment.get("segment_pool_id", (0, 0))) == (0, 0)
    return False


_filter_off: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def filter_off_values(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Persistent one-entry tensors of the filters' off values on `device`: top_k 0 (int64), top_p 1.0 and min_p
    0.0 (float32), which the logits samplers read (with stride 0) for a filter the caller passed as None. Never
    written. Built during a CUDA-graph capture, they serve that call only, as `zeroed_scratch` explains."""
    values = _filter_off.get(device)
    if values is not None:
        return values
    values = (torch.zeros(1, dtype=torch.int64, device=device), torch.ones(1, device=device),
              torch.zeros(1, device=device))
    if device.type == "cuda" and (torch.cuda.is_current_stream_capturing() or not _in_default_pool(values[0])):
        return values
    _filter_off[device] = values
    return values

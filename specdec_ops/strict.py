"""Strict mode: every `torch.ops.specdec.*` call also validates the values it is given.

The ops check shapes, dtypes and devices always, but not values: that would need a host sync, and out-of-range
values are clamped or masked so that no kernel reads or writes out of bounds. Strict mode is the debugging
counterpart: while it is on, each specdec op call first checks its argument values on the host and raises a
``ValueError`` naming the op, the argument, the first offending index and its value:

- token ids (``draft_token_ids``, ``bonus_token_ids``, ``substitute_token_ids``, ``last_sampled``,
  ``sampled_token_ids``) within ``[0, V)``, where V comes from the op's probabilities or logits (ids of
  ``create_output``, which sees no vocabulary, and of ``prepare_prefill`` must be non-negative);
  ``draft_token_ids`` of ``create_output`` may be -1 (no draft);
- probabilities (``target_probs``, ``draft_probs``, the latter of ``rejection_sample_logits`` too) finite,
  non-negative and each row summing to 1 within ``PROB_SUM_TOLERANCE``;
- logits (``logits``, ``target_logits``, ``draft_logits``) free of NaN and +inf (-inf is a masked token);
- ``query_start_loc`` starting at 0, non-decreasing and at most the token count; ``num_rejected`` within
  ``[0, query_len]`` of each request; ``idx_mapping`` within the request slots (``last_sampled``);
  ``seq_lens`` at least each query's length; positions non-negative;
- sampling parameters: ``temperature`` finite and >= 0 (0 = greedy); for ``rejection_sample_logits`` and
  ``sample_draft_filtered`` also ``top_k`` >= 0 (0 = off), ``top_p`` in (0, 1] (1 = off) and ``min_p`` in
  [0, 1] (0 = off); ``posterior_threshold`` and ``posterior_alpha`` finite and >= 0.

Ops with checks: prepare_prefill (and prepare_prefill_into), create_output, rejection_sample,
rejection_sample_logits, sample_draft, sample_draft_filtered, greedy_verify, typical_acceptance,
advance_draft_step, every overload of each. Any other specdec op runs unchecked in strict mode.

Turn it on with ``with specdec_ops.strict_mode(): ...`` or for a whole program by setting the environment
variable ``SPECDEC_STRICT=1`` before ``import specdec_ops`` (it then applies to the importing thread).

Cost: each op call synchronizes with the host (values are read back) and runs a few reductions over its
inputs, and while the mode is on every torch call passes through one Python check (it is a
``TorchFunctionMode``). With the mode off nothing of this runs: no extra launch, no sync. Strict mode refuses
to run inside ``torch.compile`` tracing and inside CUDA-graph capture (it would need a sync there): run the
code eagerly to debug it, e.g. ``DraftProposer(..., compile=False, cuda_graphs=False)``.
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

ENV_VAR = "SPECDEC_STRICT"
# |sum(p) - 1| allowed per probability row: float32 sums over a 128k vocabulary err by ~1e-5, bf16 inputs by
# ~1e-3; logits passed as probabilities miss by far more.
PROB_SUM_TOLERANCE = 1e-2

_TOKEN_ARGS = ("draft_token_ids", "bonus_token_ids", "substitute_token_ids", "sampled_token_ids", "last_sampled",
               "input_ids")


class _StrictError(ValueError):
    pass


def _fail(op: str, name: str, what: str, index, value) -> None:
    raise _StrictError(f"{op} (strict mode): argument '{name}' {what}; first offending index {index} holds {value}")


def _first_bad(bad: torch.Tensor):
    """Index (a tuple, or an int for 1-D) of the first True of `bad`, or None."""
    if not bool(bad.any()):
        return None
    flat = int(bad.reshape(-1).to(torch.uint8).argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), bad.shape))
    return index[0] if len(index) == 1 else index


def _value(t: torch.Tensor, index):
    value = t[index]
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value.tolist()


def _check(op: str, name: str, t: torch.Tensor, bad: torch.Tensor, what: str) -> None:
    index = _first_bad(bad)
    if index is not None:
        _fail(op, name, what, index, _value(t, index))


def _check_ids(op: str, name: str, ids: torch.Tensor | None, vocab: int | None, allow_minus_one=False) -> None:
    if ids is None:
        return
    ids = ids.long()
    low = -1 if allow_minus_one else 0
    bad = ids < low
    if vocab is not None:
        bad = bad | (ids >= vocab)
    what = f"must hold token ids in [{low}, {vocab})" if vocab is not None else f"must hold token ids >= {low}"
    _check(op, name, ids, bad, what)


def _check_probs(op: str, name: str, probs: torch.Tensor | None) -> None:
    if probs is None:
        return
    p = probs.double()
    _check(op, name, p, ~torch.isfinite(p) | (p < 0), "must hold finite, non-negative probabilities")
    sums = p.sum(-1)
    row = _first_bad((sums - 1).abs() > PROB_SUM_TOLERANCE)
    if row is not None:
        _fail(op, name, f"must sum to 1 within {PROB_SUM_TOLERANCE} over its last dimension (logits passed as "
              f"probabilities?); row sums", row, _value(sums, row))


def _check_logits(op: str, name: str, logits: torch.Tensor | None) -> None:
    if logits is None:
        return
    x = logits.float()
    _check(op, name, x, torch.isnan(x) | (x == math.inf), "must hold no NaN or +inf logits")


def _check_nonnegative_scalar(op: str, name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise _StrictError(f"{op} (strict mode): argument '{name}' must be finite and >= 0, got {value}")


# --- per-op checks; each takes the op's arguments by name ---------------------------------------------------


def _prepare_prefill(op: str, a: dict[str, Any]) -> None:
    qsl = a["query_start_loc"].long()
    num_tokens = a["input_ids"].shape[0]
    if qsl.numel() and int(qsl[0]) != 0:
        _fail(op, "query_start_loc", "must start at 0", 0, int(qsl[0]))
    _check(op, "query_start_loc", qsl, qsl > num_tokens, f"must lie within the token count {num_tokens}")
    steps = qsl.diff()
    _check(op, "query_start_loc", qsl[1:], steps < 0, "must be non-decreasing")
    num_rejected = a["num_rejected"].long()
    _check(op, "num_rejected", num_rejected, (num_rejected < 0) | (num_rejected > steps),
           "must lie in [0, query_len] of each request")
    num_slots = a["last_sampled"].shape[0]
    idx = a["idx_mapping"].long()
    _check(op, "idx_mapping", idx, (idx < 0) | (idx >= num_slots), f"must index the {num_slots} request slots")
    seq_lens = a["seq_lens"].long()
    _check(op, "seq_lens", seq_lens, seq_lens < steps, "must be at least each request's query length")
    positions = a["positions"].long()
    _check(op, "positions", positions, positions < 0, "must be non-negative")
    _check_ids(op, "input_ids", a["input_ids"], None)
    _check_ids(op, "last_sampled", a["last_sampled"], None)
    if a["max_model_len"] < 1:
        raise _StrictError(f"{op} (strict mode): argument 'max_model_len' must be >= 1, got {a['max_model_len']}")


def _create_output(op: str, a: dict[str, Any]) -> None:
    _check_ids(op, "draft_token_ids", a["draft_token_ids"], None, allow_minus_one=True)
    _check_ids(op, "substitute_token_ids", a["substitute_token_ids"], None)
    _check_ids(op, "bonus_token_ids", a["bonus_token_ids"], None)


def _rejection_sample(op: str, a: dict[str, Any]) -> None:
    vocab = a["target_probs"].shape[-1]
    _check_probs(op, "target_probs", a["target_probs"])
    _check_probs(op, "draft_probs", a.get("draft_probs"))
    _check_ids(op, "draft_token_ids", a["draft_token_ids"], vocab)
    _check_ids(op, "bonus_token_ids", a.get("bonus_token_ids"), vocab)


def _check_temperature(op: str, a: dict[str, Any]) -> None:
    t = a["temperature"].float()
    _check(op, "temperature", t, ~torch.isfinite(t) | (t < 0), "must be finite and >= 0 (0 = greedy)")


def _check_sampling_params(op: str, a: dict[str, Any]) -> None:
    # The ranges of ops.logits_sampling.check_sampling_params (whose messages name no op, index or value),
    # temperature as sample_draft's (NaN and inf refused too).
    _check_temperature(op, a)
    if a["top_k"] is not None:  # a filter given as None is off
        top_k = a["top_k"].long()
        _check(op, "top_k", top_k, top_k < 0, "must be >= 0 (0 = off)")
    if a["top_p"] is not None:
        top_p = a["top_p"].float()
        _check(op, "top_p", top_p, ~((top_p > 0) & (top_p <= 1)), "must lie in (0, 1] (1 = off)")
    if a["min_p"] is not None:
        min_p = a["min_p"].float()
        _check(op, "min_p", min_p, ~((min_p >= 0) & (min_p <= 1)), "must lie in [0, 1] (0 = off)")


def _check_positions(op: str, name: str, positions: torch.Tensor) -> None:
    positions = positions.long()
    _check(op, name, positions, positions < 0, "must be non-negative")


def _sample_draft(op: str, a: dict[str, Any]) -> None:
    _check_logits(op, "logits", a["logits"])
    _check_temperature(op, a)
    _check_positions(op, "positions", a["positions"])


def _sample_draft_filtered(op: str, a: dict[str, Any]) -> None:
    _check_logits(op, "logits", a["logits"])
    _check_sampling_params(op, a)
    _check_positions(op, "positions", a["positions"])


def _rejection_sample_logits(op: str, a: dict[str, Any]) -> None:
    vocab = a["target_logits"].shape[-1]
    _check_logits(op, "target_logits", a["target_logits"])
    _check_ids(op, "draft_token_ids", a["draft_token_ids"], vocab)
    _check_probs(op, "draft_probs", a.get("draft_probs"))
    _check_logits(op, "draft_logits", a.get("draft_logits"))
    _check_sampling_params(op, a)


def _greedy_verify(op: str, a: dict[str, Any]) -> None:
    _check_logits(op, "target_logits", a["target_logits"])
    _check_ids(op, "draft_token_ids", a["draft_token_ids"], a["target_logits"].shape[-1])


def _typical_acceptance(op: str, a: dict[str, Any]) -> None:
    _check_probs(op, "target_probs", a["target_probs"])
    _check_ids(op, "draft_token_ids", a["draft_token_ids"], a["target_probs"].shape[-1])
    _check_nonnegative_scalar(op, "posterior_threshold", a["posterior_threshold"])
    _check_nonnegative_scalar(op, "posterior_alpha", a["posterior_alpha"])


def _advance_draft_step(op: str, a: dict[str, Any]) -> None:
    _check_ids(op, "sampled_token_ids", a["sampled_token_ids"], None)
    for name in ("positions", "seq_lens"):
        t = a[name].long()
        _check(op, name, t, t < 0, "must be non-negative")
    if a["max_model_len"] < 1:
        raise _StrictError(f"{op} (strict mode): argument 'max_model_len' must be >= 1, got {a['max_model_len']}")


_CHECKS: dict[str, Callable[[str, dict[str, Any]], None]] = {
    "prepare_prefill": _prepare_prefill,
    "prepare_prefill_into": _prepare_prefill,
    "create_output": _create_output,
    "rejection_sample": _rejection_sample,
    "sample_draft": _sample_draft,
    "rejection_sample_logits": _rejection_sample_logits,
    "sample_draft_filtered": _sample_draft_filtered,
    "greedy_verify": _greedy_verify,
    "typical_acceptance": _typical_acceptance,
    "advance_draft_step": _advance_draft_step,
}


def _bind(func, args, kwargs) -> tuple[str, dict[str, Any]] | None:
    """(op name, arguments by schema name) of a specdec op call, or None for any other function."""
    if isinstance(func, torch._ops.OpOverloadPacket):
        if not func._qualified_op_name.startswith("specdec::"):
            return None
        overloads = [getattr(func, name) for name in func.overloads()]
    elif isinstance(func, torch._ops.OpOverload):
        if func.namespace != "specdec":
            return None
        overloads = [func]
    else:
        return None
    for overload in overloads:
        schema = overload._schema
        names = [arg.name for arg in schema.arguments]
        if len(args) > len(names) or any(key not in names for key in kwargs):
            continue
        bound = dict(zip(names, args))
        bound.update(kwargs)
        required = [arg.name for arg in schema.arguments if not arg.has_default_value()]
        if all(name in bound for name in required):
            for arg in schema.arguments:
                if arg.name not in bound and arg.has_default_value():
                    bound[arg.name] = arg.default_value
            return schema.name.split("::")[-1], bound
    return None


class StrictMode(TorchFunctionMode):
    """The torch function mode behind `strict_mode` (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            raise RuntimeError("specdec strict mode reads values on the host and cannot run inside torch.compile: "
                               "leave strict mode off around compiled code, or run it eagerly (e.g. "
                               "DraftProposer(..., compile=False))")
        bound = _bind(func, args, kwargs)
        if bound is not None:
            name, arguments = bound
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"specdec strict mode reads values on the host and cannot run during CUDA-graph "
                                   f"capture ({name}): leave strict mode off while capturing")
            check = _CHECKS.get(name)  # an op without value checks runs unchecked
            if check is not None:
                check(name, arguments)
        return func(*args, **kwargs)


@contextlib.contextmanager
def strict_mode():
    """Within the block, every specdec op call validates its argument values (see the module docstring)."""
    with StrictMode():
        yield


def strict_mode_enabled() -> bool:
    """True while a `strict_mode` (or SPECDEC_STRICT=1) is active in this thread."""
    from torch.overrides import _get_current_function_mode_stack

    return any(isinstance(mode, StrictMode) for mode in _get_current_function_mode_stack())


def _enable_from_environment() -> None:
    if os.environ.get(ENV_VAR, "").strip() not in ("", "0"):
        StrictMode().__enter__()  # for the rest of the importing thread's life

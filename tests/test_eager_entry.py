"""The eager entries of the C++-launched ops (csrc/eager_entry.cpp), which the wrappers call instead of torch.ops.

They must give what the torch.ops call gives (outputs, mutations, errors), keep the dispatcher in the path (Python
dispatch modes see the op), and hand the call to torch.ops where __torch_function__ needs it.
"""
import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import specdec_ops
from specdec_ops import _C
from specdec_ops.ops import output, prefill

from samples import make_batch, make_verified
from test_prefill import BAD_INPUTS

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


class Tagged(torch.Tensor):
    """A subclass with torch's default __torch_function__: torch.ops returns Tagged outputs for Tagged inputs."""


# Each case: make(seed, device) -> inputs; run(inputs, through_entry) -> the tensors to compare (outputs and
# mutated arguments); the op overload it calls.
def prefill_inputs(seed, device):
    num_reqs = seed % 6  # 0 to 5 requests
    batch = make_batch(seed, num_reqs, long_query=seed % 3 == 0, device=device)
    # max_num_reqs: the default (None) or at or past num_reqs
    return [*batch.values(), None if seed % 4 == 0 else num_reqs + seed % 4]


def run_prefill(inputs, through_entry):
    if through_entry:
        return tuple(specdec_ops.prepare_prefill(*inputs))
    return tuple(torch.ops.specdec.prepare_prefill.default(*inputs))


def prefill_into_inputs(seed, device):
    inputs = prefill_inputs(seed, device)
    *tensors, max_model_len, max_num_reqs = inputs
    num_reqs = tensors[2].shape[0] - 1
    max_num_reqs = num_reqs if max_num_reqs is None else max_num_reqs
    total = tensors[0].shape[0] + num_reqs
    spare = seed % 3  # persistent buffers may be longer than needed

    def buffer(size, dtype):
        return torch.full((size,), -7, dtype=dtype, device=device)

    buffers = [buffer(total + spare, tensors[0].dtype), buffer(total + spare, torch.int64),
               buffer(max_num_reqs, torch.int64), buffer(max_num_reqs + 1, torch.int32),
               buffer(max_num_reqs, torch.int32)]
    return [*tensors, max_model_len, *buffers]


def run_prefill_into(inputs, through_entry):
    buffers = [b.clone() for b in inputs[8:]]
    args = [*inputs[:8], *buffers]
    result = specdec_ops.prepare_prefill_into(*args) if through_entry else \
        torch.ops.specdec.prepare_prefill_into.default(*args)
    assert result is None
    return tuple(buffers)


def verified_inputs(seed, device):
    batch = [0, 1, 7, 300][seed % 4]
    return [t.to(device) for t in make_verified(seed, batch, 1 + seed % 8, bonus_2d=seed % 2 == 0)]


def run_create_output(inputs, through_entry):
    if through_entry:
        return (specdec_ops.create_output(*inputs),)
    return (torch.ops.specdec.create_output.default(*inputs),)


def run_create_output_counted(inputs, through_entry):
    counters = torch.tensor([3, 5, 7], device=inputs[0].device)
    if through_entry:
        out = specdec_ops.create_output(*inputs, counters=counters)
    else:
        out = torch.ops.specdec.create_output.counted(*inputs, counters)
    return out, counters


CASES = {
    "prepare_prefill": (prefill_inputs, run_prefill, torch.ops.specdec.prepare_prefill.default),
    "prepare_prefill_into": (prefill_into_inputs, run_prefill_into, torch.ops.specdec.prepare_prefill_into.default),
    "create_output": (verified_inputs, run_create_output, torch.ops.specdec.create_output.default),
    "create_output.counted": (verified_inputs, run_create_output_counted, torch.ops.specdec.create_output.counted),
}


def assert_same(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert type(a) is type(e)
        assert a.dtype == e.dtype and a.device == e.device
        assert torch.equal(a.as_subclass(torch.Tensor), e.as_subclass(torch.Tensor)), f"\n{a}\n!=\n{e}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", range(8))
def test_entry_matches_torch_ops(device, case, seed):
    make, run, _ = CASES[case]
    inputs = make(seed, device)
    assert_same(run(inputs, True), run(inputs, False))


class Recorder:
    """A mode that records the ops it sees and runs them unchanged."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def record(self, func, args, kwargs):
        self.calls.append(func)
        return func(*args, **(kwargs or {}))


class RecordDispatch(Recorder, TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.record(func, args, kwargs)


class RecordFunction(Recorder, TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.record(func, args, kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode_type", [RecordDispatch, RecordFunction], ids=["dispatch_mode", "function_mode"])
def test_python_modes_see_the_op(device, case, mode_type):
    """A dispatch mode sees the entry's dispatcher call; a torch function mode makes the entry take the torch.ops
    path (only a torch.ops call reaches __torch_function__)."""
    make, run, op = CASES[case]
    inputs = make(5, device)
    expected = run(inputs, False)
    with mode_type() as mode:
        actual = run(inputs, True)
    assert op in mode.calls
    assert_same(actual, expected)


@pytest.mark.parametrize("case", CASES)
def test_tensor_subclass_takes_the_torch_ops_path(case):
    make, run, _ = CASES[case]
    inputs = [x.as_subclass(Tagged) if isinstance(x, torch.Tensor) else x for x in make(5, "cpu")]
    actual, expected = run(inputs, True), run(inputs, False)
    if case != "prepare_prefill_into":  # its outputs are the caller's buffers
        assert type(actual[0]) is Tagged
    assert_same(actual, expected)


@pytest.mark.parametrize("case", CASES)
def test_only_plain_calls_skip_the_fallback(case):
    """With plain tensors and ints the entry calls the op itself: a fallback that fails is not reached. One Tensor
    subclass among the arguments, in any position, sends the call to it."""
    name = case.split(".")[0]
    originals = {"prepare_prefill": (prefill._prepare_prefill_ops, prefill.PrefillInputs),
                 "prepare_prefill_into": (prefill._prepare_prefill_into_ops,),
                 "create_output": (output._create_output_ops,)}[name]

    def failing(*args):
        raise AssertionError("fallback called")

    make, run, _ = CASES[case]
    inputs = make(5, "cpu")
    _C.register_eager(name, failing, *originals[1:])
    try:
        run(inputs, True)
        if case == "prepare_prefill":
            run([*inputs[:8], None], True)  # the default max_num_reqs
        for position, value in enumerate(inputs):
            if isinstance(value, torch.Tensor):
                tagged = [*inputs[:position], value.as_subclass(Tagged), *inputs[position + 1:]]
                with pytest.raises(AssertionError, match="fallback called"):
                    run(tagged, True)
    finally:
        _C.register_eager(name, *originals)


@pytest.mark.parametrize("case", ["prepare_prefill", "prepare_prefill_into"])
@pytest.mark.parametrize("max_model_len", [np.int64(4096), np.int32(300), True, 4096.0, 2**70])
def test_other_int_types_get_the_torch_ops_answer(case, max_model_len):
    """Ints torch.ops would convert (or refuse) are handed to it: the same result or the same error."""
    make, run, _ = CASES[case]
    inputs = make(5, "cpu")
    inputs[7] = max_model_len
    try:
        expected = run(inputs, False)
    except Exception as error:  # noqa: BLE001 (compare whatever torch.ops raises)
        with pytest.raises(type(error)) as raised:
            run(inputs, True)
        assert str(raised.value) == str(error)
    else:
        assert_same(run(inputs, True), expected)


@pytest.mark.parametrize("name,mutate,message", BAD_INPUTS, ids=[b[0] + str(i) for i, b in enumerate(BAD_INPUTS)])
def test_bad_inputs_raise_what_torch_ops_raises(name, mutate, message):
    batch = make_batch(51, 3)
    mutate(batch)
    with pytest.raises(ValueError) as from_ops:
        torch.ops.specdec.prepare_prefill.default(*batch.values(), None)
    with pytest.raises(ValueError, match=f"'{name}'") as from_entry:
        specdec_ops.prepare_prefill(*batch.values())
    assert str(from_entry.value) == str(from_ops.value)


def test_create_output_bad_input_raises_what_torch_ops_raises():
    accepted, substitute, draft, bonus = make_verified(3, 4, 3)
    for bad in ([accepted[:, :2], substitute, draft, bonus], [accepted, substitute, draft.float(), bonus]):
        with pytest.raises(ValueError) as from_ops:
            torch.ops.specdec.create_output.default(*bad)
        with pytest.raises(ValueError) as from_entry:
            specdec_ops.create_output(*bad)
        assert str(from_entry.value) == str(from_ops.value)


def test_entries_check_their_argument_count():
    with pytest.raises(TypeError, match="takes 9 positional arguments but 2 were given"):
        _C.eager_prepare_prefill(1, 2)
    with pytest.raises(TypeError, match="takes 13 positional arguments"):
        _C.eager_prepare_prefill_into()
    with pytest.raises(TypeError, match="takes 5 positional arguments"):
        _C.eager_create_output(None)

"""How the ops meet autograd (csrc/ops.cpp): every mutated tensor's version counter is bumped, as aten's in-place
ops do, so autograd reports a tensor it saved for backward that one of the ops then overwrote."""
import pytest
import torch

import specdec_ops

from samples import make_batch, make_verified


def counters():
    return torch.zeros(3, dtype=torch.int64)


def prefill_into_args():
    batch = make_batch(3, 4)
    total = batch["input_ids"].shape[0] + 4
    buffers = [torch.zeros(total, dtype=batch["input_ids"].dtype), torch.zeros(total, dtype=torch.int64),
               torch.zeros(4, dtype=torch.int64), torch.zeros(5, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)]
    return [*batch.values(), *buffers], buffers


def mutating_calls():
    """(name, call, mutated tensors) for every overload with a Tensor(a!) argument, through torch.ops."""
    gen = torch.Generator().manual_seed(0)
    batch, k, vocab = 3, 2, 11
    draft = torch.randint(0, vocab, (batch, k), generator=gen)
    target_probs = torch.rand(batch, k + 1, vocab, generator=gen).softmax(-1)
    seeds, offsets = torch.arange(batch), torch.zeros(batch, dtype=torch.int64)
    into_args, buffers = prefill_into_args()
    yield "prepare_prefill_into", lambda: torch.ops.specdec.prepare_prefill_into(*into_args), buffers
    verified = make_verified(1, batch, k)
    output_counters, sample_counters, greedy_counters, typical_counters = (counters() for _ in range(4))
    probs = torch.zeros(batch, vocab)
    yield ("create_output.counted", lambda: torch.ops.specdec.create_output.counted(*verified, output_counters),
           [output_counters])
    yield ("rejection_sample.counted",
           lambda: torch.ops.specdec.rejection_sample.counted(target_probs, draft, None, seeds, offsets, None,
                                                               sample_counters), [sample_counters])
    yield ("sample_draft.with_probs",
           lambda: torch.ops.specdec.sample_draft.with_probs(torch.randn(batch, vocab), torch.ones(batch), seeds,
                                                            offsets, probs), [probs])
    yield ("greedy_verify.counted",
           lambda: torch.ops.specdec.greedy_verify.counted(target_probs.log(), draft, greedy_counters),
           [greedy_counters])
    yield ("typical_acceptance.counted",
           lambda: torch.ops.specdec.typical_acceptance.counted(target_probs, draft, 0.09, 0.3, typical_counters),
           [typical_counters])


CALLS = {name: (call, mutated) for name, call, mutated in mutating_calls()}


@pytest.mark.parametrize("name", CALLS)
def test_mutated_tensors_bump_their_versions(name):
    call, mutated = CALLS[name]
    before = [t._version for t in mutated]
    call()
    assert [t._version for t in mutated] == [v + 1 for v in before]


def test_overwriting_a_tensor_saved_for_backward_is_reported():
    weights = torch.randn(8, requires_grad=True)
    stats = counters()
    picked = weights.gather(0, stats)  # saves stats (the index) for backward
    specdec_ops.create_output(*make_verified(2, 4, 3), counters=stats)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        picked.sum().backward()


def test_inference_tensors_are_mutated_without_a_version():
    with torch.inference_mode():
        stats = counters()
    out = specdec_ops.create_output(*make_verified(2, 4, 3), counters=stats)  # outside inference mode
    assert int(stats[2]) == 4 * 3 and out.shape == (4, 4)

"""Strict mode: one bad value per checked argument raises a ValueError naming op, argument, index and value;
good inputs pass and give the same result as without the mode; the mode refuses torch.compile and graph capture."""
import os
import subprocess
import sys

import pytest
import torch

import specdec_ops
from specdec_ops import strict_mode

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
B, K, V = 3, 4, 11


def _probs(*shape, device):
    return torch.rand(*shape, device=device).softmax(-1)


def _cases(device):
    """(op name, call, {argument: (bad-value mutation, expected message part)})."""
    gen_ids = lambda: torch.randint(0, V, (B, K), device=device)  # noqa: E731
    seeds = torch.arange(B, device=device)
    offsets = torch.zeros(B, dtype=torch.int64, device=device)

    def rejection(target_probs=None, draft_token_ids=None, draft_probs=None, bonus_token_ids=None):
        return specdec_ops.rejection_sample(
            _probs(B, K + 1, V, device=device) if target_probs is None else target_probs,
            gen_ids() if draft_token_ids is None else draft_token_ids,
            _probs(B, K, V, device=device) if draft_probs is None else draft_probs,
            seeds, offsets,
            torch.zeros(B, dtype=torch.int64, device=device) if bonus_token_ids is None else bonus_token_ids)

    def with_bad(t, index, value):
        t = t.clone()
        t[index] = value
        return t

    ids = gen_ids()
    cases = [
        ("rejection_sample", lambda: rejection(draft_token_ids=with_bad(ids, (1, 2), V)), "draft_token_ids", "(1, 2)"),
        ("rejection_sample", lambda: rejection(draft_token_ids=with_bad(ids, (0, 1), -3)), "draft_token_ids", "-3"),
        ("rejection_sample", lambda: rejection(bonus_token_ids=torch.tensor([0, V + 5, 0], device=device)),
         "bonus_token_ids", str(V + 5)),
        ("rejection_sample", lambda: rejection(target_probs=with_bad(_probs(B, K + 1, V, device=device),
                                                                     (2, 1, 3), float("nan"))),
         "target_probs", "(2, 1, 3)"),
        ("rejection_sample", lambda: rejection(target_probs=torch.randn(B, K + 1, V, device=device)),
         "target_probs", "first offending index"),
        ("rejection_sample", lambda: rejection(draft_probs=_probs(B, K, V, device=device) * 1.5), "draft_probs",
         "sum to 1"),
        ("typical_acceptance", lambda: specdec_ops.typical_acceptance(_probs(B, K + 1, V, device=device),
                                                                      with_bad(ids, (2, 3), V)),
         "draft_token_ids", "(2, 3)"),
        ("typical_acceptance", lambda: specdec_ops.typical_acceptance(
            _probs(B, K + 1, V, device=device).log(), ids), "target_probs", "first offending index"),
        ("greedy_verify", lambda: specdec_ops.greedy_verify(torch.randn(B, K + 1, V, device=device),
                                                            with_bad(ids, (0, 0), 99)), "draft_token_ids", "99"),
        ("greedy_verify", lambda: specdec_ops.greedy_verify(
            with_bad(torch.randn(B, K + 1, V, device=device), (1, 1, 1), float("nan")), ids), "target_logits",
         "(1, 1, 1)"),
        ("sample_draft", lambda: specdec_ops.sample_draft(torch.randn(B, V, device=device),
                                                          torch.tensor([0.5, -1.0, 0.0], device=device), seeds,
                                                          torch.zeros(B, dtype=torch.int64, device=device)),
         "temperature", "index 1 holds -1.0"),
        ("sample_draft", lambda: specdec_ops.sample_draft(torch.randn(B, V, device=device),
                                                          torch.tensor([0.5, float("nan"), 0.0], device=device),
                                                          seeds, torch.zeros(B, dtype=torch.int64, device=device)),
         "temperature", "index 1"),
        ("sample_draft", lambda: specdec_ops.sample_draft(
            with_bad(torch.randn(B, V, device=device), (2, 4), float("inf")), torch.ones(B, device=device), seeds,
            torch.zeros(B, dtype=torch.int64, device=device)), "logits", "(2, 4)"),
        ("create_output", lambda: specdec_ops.create_output(torch.ones(B, K, dtype=torch.bool, device=device),
                                                            ids, with_bad(ids, (1, 0), -5), ids[:, 0]),
         "draft_token_ids", "-5"),
        ("advance_draft_step", lambda: specdec_ops.advance_draft_step(
            torch.tensor([1, -2, 3], device=device), torch.zeros(B, dtype=torch.int64, device=device),
            torch.ones(B, dtype=torch.int32, device=device), 10), "sampled_token_ids", "-2"),
    ]
    return cases


def _prefill_args(device, **bad):
    """A valid 3-request prepare_prefill call (query lens 2, 3, 1), with some arguments replaced."""
    args = dict(input_ids=torch.arange(6, device=device), positions=torch.tensor([4, 5, 0, 1, 2, 7], device=device),
                query_start_loc=torch.tensor([0, 2, 5, 6], dtype=torch.int32, device=device),
                seq_lens=torch.tensor([6, 3, 8], dtype=torch.int32, device=device),
                idx_mapping=torch.tensor([2, 0, 1], dtype=torch.int32, device=device),
                last_sampled=torch.tensor([9, 8, 7, 6], device=device),
                num_rejected=torch.tensor([1, 0, 1], dtype=torch.int32, device=device), max_model_len=32)
    args.update(bad)
    return args


PREFILL_BAD = [
    ("query_start_loc", torch.tensor([0, 3, 2, 6], dtype=torch.int32), "non-decreasing"),
    ("query_start_loc", torch.tensor([0, 2, 5, 9], dtype=torch.int32), "token count"),
    ("query_start_loc", torch.tensor([1, 2, 5, 6], dtype=torch.int32), "start at 0"),
    ("num_rejected", torch.tensor([1, 4, 0], dtype=torch.int32), "index 1 holds 4"),
    ("num_rejected", torch.tensor([-1, 0, 0], dtype=torch.int32), "index 0 holds -1"),
    ("idx_mapping", torch.tensor([2, 4, 1], dtype=torch.int32), "index 1 holds 4"),
    ("seq_lens", torch.tensor([6, 2, 8], dtype=torch.int32), "index 1 holds 2"),
    ("positions", torch.tensor([4, 5, -1, 1, 2, 7]), "index 2 holds -1"),
]


@pytest.mark.parametrize("device", DEVICES)
def test_each_bad_value_is_named_in_strict_mode_and_passes_silently_without_it(device):
    for op, call, argument, detail in _cases(device):
        call()  # strict mode off: plausible-looking output, no error
        with strict_mode(), pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert message.startswith(f"{op} (strict mode): argument '{argument}'"), message
        assert detail in message, message


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("argument,value,detail", PREFILL_BAD, ids=[f"{a}-{i}" for i, (a, _, _) in
                                                                    enumerate(PREFILL_BAD)])
def test_prepare_prefill_values(device, argument, value, detail):
    args = _prefill_args(device, **{argument: value.to(device)})
    specdec_ops.prepare_prefill(**args)
    with strict_mode(), pytest.raises(ValueError, match=f"prepare_prefill \\(strict mode\\): argument '{argument}'") \
            as info:
        specdec_ops.prepare_prefill(**args)
    assert detail in str(info.value)
    with strict_mode(), pytest.raises(ValueError, match=f"argument '{argument}'"):
        torch.ops.specdec.prepare_prefill(*args.values())  # the raw op is checked too


@pytest.mark.parametrize("device", DEVICES)
def test_good_inputs_pass_and_match_the_unchecked_result(device):
    torch.manual_seed(0)
    target = _probs(B, K + 1, V, device=device)
    draft = _probs(B, K, V, device=device)
    ids = torch.randint(0, V, (B, K), device=device)
    seeds = torch.arange(B, device=device)
    offsets = torch.zeros(B, dtype=torch.int64, device=device)
    plain = specdec_ops.rejection_sample(target, ids, draft, seeds, offsets)
    args = _prefill_args(device)
    with strict_mode():
        assert specdec_ops.strict_mode_enabled()
        assert torch.equal(specdec_ops.rejection_sample(target, ids, draft, seeds, offsets), plain)
        expanded = specdec_ops.prepare_prefill(**args)
        specdec_ops.typical_acceptance(target, ids)
        specdec_ops.greedy_verify(target.log(), ids)  # -inf free logits
    assert not specdec_ops.strict_mode_enabled()
    assert torch.equal(expanded.expanded_input_ids, specdec_ops.prepare_prefill(**args).expanded_input_ids)


def test_strict_mode_refuses_torch_compile():
    @torch.compile(fullgraph=True, backend="eager")
    def verify(logits, ids):
        return torch.ops.specdec.greedy_verify(logits, ids)

    with strict_mode(), pytest.raises(Exception, match="strict mode reads values on the host"):
        verify(torch.randn(B, K + 1, V), torch.zeros(B, K, dtype=torch.int64))


@pytest.mark.cuda
def test_strict_mode_refuses_graph_capture():
    logits, ids = torch.randn(B, K + 1, V, device="cuda"), torch.zeros(B, K, dtype=torch.int64, device="cuda")
    specdec_ops.greedy_verify(logits, ids)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="CUDA-graph capture"):
        with strict_mode(), torch.cuda.graph(graph):
            specdec_ops.greedy_verify(logits, ids)


def test_environment_variable_turns_strict_mode_on():
    code = ("import torch, specdec_ops\n"
            "assert specdec_ops.strict_mode_enabled()\n"
            "try:\n"
            "    specdec_ops.greedy_verify(torch.randn(1, 2, 5), torch.tensor([[7]]))\n"
            "except ValueError as e:\n"
            "    print(e)\n")
    env = dict(os.environ, SPECDEC_STRICT="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "greedy_verify (strict mode): argument 'draft_token_ids'" in out.stdout, out.stdout + out.stderr

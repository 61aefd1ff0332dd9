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
    return cases + _logits_cases(device)


def _logits_cases(device):
    """rejection_sample_logits and sample_draft_filtered: one bad value per checked argument."""
    seeds = torch.arange(B, device=device)
    zeros = torch.zeros(B, dtype=torch.int64, device=device)

    def good_params():
        return dict(temperature=torch.tensor([0.7, 0.0, 1.3], device=device),
                    top_k=torch.tensor([0, 3, 5], device=device),
                    top_p=torch.tensor([1.0, 0.5, 0.9], device=device),
                    min_p=torch.tensor([0.0, 0.1, 1.0], device=device))

    def with_bad(t, index, value):
        t = t.clone()
        t[index] = value
        return t

    gen = torch.Generator().manual_seed(3)
    target = torch.randn(B, K + 1, V, generator=gen).to(device)
    draft_logits = torch.randn(B, K, V, generator=gen).to(device)
    draft_probs = torch.rand(B, K, V, generator=gen).softmax(-1).to(device)
    ids = torch.randint(0, V, (B, K), generator=gen).to(device)
    row_logits = torch.randn(B, V, generator=gen).to(device)

    def verify(target_logits=target, draft_token_ids=ids, draft_probs=None, draft_logits=None, block=False,
               **params):
        p = good_params()
        p.update(params)
        return specdec_ops.rejection_sample_logits(target_logits, draft_token_ids, p["temperature"], p["top_k"],
                                                   p["top_p"], p["min_p"], seeds, zeros, draft_probs=draft_probs,
                                                   draft_logits=draft_logits, block_verification=block)

    def draft(logits=row_logits, positions=zeros, probs=None, **params):
        p = good_params()
        p.update(params)
        return specdec_ops.sample_draft_filtered(logits, p["temperature"], p["top_k"], p["top_p"], p["min_p"],
                                                 seeds, positions, probs)

    def param(name, index, value):
        return {name: with_bad(good_params()[name], index, value)}

    rs, sd = "rejection_sample_logits", "sample_draft_filtered"
    nan, inf = float("nan"), float("inf")
    return [
        (rs, lambda: verify(target_logits=with_bad(target, (1, 2, 3), nan)), "target_logits", "(1, 2, 3)"),
        (rs, lambda: verify(target_logits=with_bad(target, (2, 0, 4), inf), block=True), "target_logits",
         "(2, 0, 4) holds inf"),
        (rs, lambda: verify(draft_token_ids=with_bad(ids, (0, 3), V)), "draft_token_ids", f"(0, 3) holds {V}"),
        (rs, lambda: verify(draft_token_ids=with_bad(ids, (2, 1), -1), block=True), "draft_token_ids",
         "(2, 1) holds -1"),
        (rs, lambda: verify(draft_probs=with_bad(draft_probs, (1, 1, 1), -0.5)), "draft_probs", "(1, 1, 1)"),
        (rs, lambda: verify(draft_probs=with_bad(draft_probs, (0, 2, 7), nan)), "draft_probs", "(0, 2, 7)"),
        (rs, lambda: verify(draft_probs=draft_probs * 2), "draft_probs", "sum to 1"),
        (rs, lambda: verify(draft_logits=with_bad(draft_logits, (2, 3, 0), nan)), "draft_logits", "(2, 3, 0)"),
        (rs, lambda: verify(**param("temperature", 2, -0.5)), "temperature", "index 2 holds -0.5"),
        (rs, lambda: verify(**param("temperature", 0, nan)), "temperature", "index 0 holds nan"),
        (rs, lambda: verify(**param("temperature", 1, inf)), "temperature", "index 1 holds inf"),
        (rs, lambda: verify(**param("top_k", 1, -2)), "top_k", "index 1 holds -2"),
        (rs, lambda: verify(**param("top_p", 2, 0.0)), "top_p", "index 2 holds 0.0"),
        (rs, lambda: verify(**param("top_p", 0, 1.5)), "top_p", "index 0 holds 1.5"),
        (rs, lambda: verify(**param("top_p", 1, nan)), "top_p", "index 1 holds nan"),
        (rs, lambda: verify(**param("min_p", 0, -0.1)), "min_p", "index 0"),
        (rs, lambda: verify(**param("min_p", 2, 1.5)), "min_p", "index 2 holds 1.5"),
        # Filters given as None (off for the batch) are skipped by the checks; the others still run.
        (rs, lambda: verify(top_k=None, top_p=None, min_p=None, **param("temperature", 2, -0.5)), "temperature",
         "index 2 holds -0.5"),
        (rs, lambda: verify(top_k=None, min_p=None, **param("top_p", 0, 1.5)), "top_p", "index 0 holds 1.5"),
        (sd, lambda: draft(logits=with_bad(row_logits, (1, 6), nan)), "logits", "(1, 6)"),
        (sd, lambda: draft(logits=with_bad(row_logits, (0, 2), inf), probs=torch.empty(B, V, device=device)),
         "logits", "(0, 2) holds inf"),
        (sd, lambda: draft(**param("temperature", 1, -1.0)), "temperature", "index 1 holds -1.0"),
        (sd, lambda: draft(**param("temperature", 2, nan)), "temperature", "index 2 holds nan"),
        (sd, lambda: draft(**param("top_k", 0, -1)), "top_k", "index 0 holds -1"),
        (sd, lambda: draft(**param("top_p", 1, -0.2)), "top_p", "index 1"),
        (sd, lambda: draft(**param("top_p", 2, 2.0), probs=torch.empty(B, V, device=device)), "top_p",
         "index 2 holds 2.0"),
        (sd, lambda: draft(**param("min_p", 1, nan)), "min_p", "index 1 holds nan"),
        (sd, lambda: draft(**param("min_p", 0, 1.01)), "min_p", "index 0"),
        (sd, lambda: draft(top_k=None, top_p=None, **param("min_p", 0, 1.01)), "min_p", "index 0"),
        (sd, lambda: draft(positions=torch.tensor([0, -4, 2], device=device)), "positions", "index 1 holds -4"),
    ]


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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("filters", ["given", "none"])
def test_logits_ops_good_inputs_pass_and_match_the_unchecked_result(device, filters):
    """rejection_sample_logits (every overload, both modes, each draft distribution) and sample_draft_filtered
    (both overloads) with valid inputs, the edges of every range included, the filters given or passed as None: no
    error, results as without the mode."""
    gen = torch.Generator().manual_seed(11)
    target = torch.randn(B, K + 1, V, generator=gen).to(device)
    target[0, 1, 2] = float("-inf")  # a masked token is fine
    draft_logits = torch.randn(B, K, V, generator=gen).to(device)
    draft_probs = torch.rand(B, K, V, generator=gen).softmax(-1).to(device)
    ids = torch.randint(0, V, (B, K), generator=gen).to(device)
    params = (torch.tensor([0.7, 0.0, 1.3], device=device), torch.tensor([0, 3, V + 2], device=device),
              torch.tensor([1.0, 0.5, 1e-6], device=device), torch.tensor([0.0, 1.0, 0.3], device=device))
    if filters == "none":
        params = (params[0], None, None, None)
    seeds = torch.arange(B, device=device)
    offsets = torch.tensor([0, 5, 2**40], device=device)

    def calls():
        results = []
        for block in (False, True):
            for dp, dl in ((None, None), (draft_probs, None), (None, draft_logits)):
                counters = torch.zeros(3, dtype=torch.int64, device=device)
                out, lp = specdec_ops.rejection_sample_logits(target, ids, *params, seeds, offsets, draft_probs=dp,
                                                              draft_logits=dl, block_verification=block,
                                                              counters=counters, return_logprobs=True)
                results += [out, lp, counters,
                            specdec_ops.rejection_sample_logits(target, ids, *params, seeds, offsets,
                                                                draft_probs=dp, draft_logits=dl,
                                                                block_verification=block)]
        probs = torch.empty(B, V, device=device)
        results += [specdec_ops.sample_draft_filtered(target[:, 0], *params, seeds, offsets),
                    specdec_ops.sample_draft_filtered(target[:, 0], *params, seeds, offsets, probs), probs]
        return results

    plain = calls()
    with strict_mode():
        checked = calls()
    for a, b in zip(plain, checked):
        assert torch.equal(a, b)


def test_an_op_without_checks_runs_unchecked(monkeypatch):
    """An op with no entry in the checks table passes through strict mode (it once raised KeyError)."""
    from specdec_ops import strict

    monkeypatch.delitem(strict._CHECKS, "greedy_verify")
    logits, ids = torch.randn(B, K + 1, V), torch.full((B, K), V + 3)
    with strict_mode():
        out = specdec_ops.greedy_verify(logits, ids)  # out-of-vocabulary ids: unchecked, so no error
    assert torch.equal(out, specdec_ops.greedy_verify(logits, ids))


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

"""The elementwise kernels of a many-token (prefill) layer, specdec_ops/models/elementwise.py, and the model path
that uses them.

The kernels where they run (the GPU with CUDA, else the Triton interpreter): RMSNorm with and without the residual
add and silu(gate) * up against their references on odd shapes (hidden sizes not a power of two, 1, 17 and 130 rows),
strided rows and no rows. float32 to 1e-6 relative (the norm's sum of squares runs in another order; the
interpreter's exp is numpy's); float16 within two float16 ulps (2**-9 relative) with at least 99 % of the entries
bit-identical (a sum of squares in another order moves 1 / rms by about one float32 ulp, which flips a float16
rounding now and then); the residual sum exactly. The ops' schemas and fakes (opcheck), their contiguous outputs,
their input errors. A model forward with the prefill dispatch forced on: through the ops' CPU paths (the references)
bit-identical to the plain path in float32 and float16, paged and dense, and traceable fullgraph; through the Triton
kernels within 1e-5 in float32 (logits and cache).
CUDA: the kernels against the references in bfloat16 and float16 (two ulps, 99 % bit-identical) and float32, and
a bf16 ragged prefill through the new path, eager, captured in a CUDA graph and compiled (as the rounds' steps of
more than 16 tokens run), against the plain bf16 path and a float32 copy.
"""
import dataclasses
import types

import pytest
import torch

from conftest import sync_forbidden
from harness import capture_graph
from specdec_ops.models import AttentionMetadata, LlamaConfig, LlamaModel
from specdec_ops.models import attention as attention_mod
from specdec_ops.models import elementwise
from specdec_ops.models import llama as llama_mod
from specdec_ops.models.attention import rope_write_kv_triton
from specdec_ops.models.elementwise import (add_rms_norm_reference, add_rms_norm_triton, rms_norm_reference,
                                            rms_norm_triton, silu_mul_reference, silu_mul_triton)
from test_models_fused import paged_batch

HALF_RTOL = 2.0 ** -9  # two float16 ulps
FLOAT32_RTOL = 1e-6


def assert_matches(got, want):
    """float32: to 1e-6 relative; float16: within two ulps, and at most 1 % of the entries differ at all."""
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=FLOAT32_RTOL, atol=FLOAT32_RTOL)
    else:
        torch.testing.assert_close(got, want, rtol=HALF_RTOL, atol=2.0 ** -24)
        assert (got != want).float().mean().item() <= 0.01


def norm_inputs(tokens, hidden, dtype, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(tokens, hidden, generator=gen)).to(device, dtype)
    residual = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    weight = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(device, dtype)
    return x, residual, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [1, 17, 130])
@pytest.mark.parametrize("hidden", [100, 257])
def test_rms_norm_matches_reference(dtype, tokens, hidden, kernel_device):
    x, _, weight = norm_inputs(tokens, hidden, dtype, device=kernel_device)
    assert_matches(rms_norm_triton(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [1, 17, 130])
@pytest.mark.parametrize("hidden", [100, 257])
def test_add_rms_norm_matches_reference(dtype, tokens, hidden, kernel_device):
    x, residual, weight = norm_inputs(tokens, hidden, dtype, seed=1, device=kernel_device)
    normed, summed = add_rms_norm_triton(x, residual, weight, 1e-6)
    want_normed, want_summed = add_rms_norm_reference(x, residual, weight, 1e-6)
    assert torch.equal(summed, want_summed) and summed.is_contiguous()
    assert_matches(normed, want_normed)


def test_rms_norm_reference_is_the_models_norm():
    norm = llama_mod.RMSNorm(100, 1e-5, dtype=torch.float16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(100))
    x, residual, _ = norm_inputs(9, 100, torch.float16)
    assert torch.equal(rms_norm_reference(x, norm.weight, norm.eps), norm(x))
    # The sum rounded to float16 first, as the layer's x = x + attn(...) stores it.
    normed, summed = add_rms_norm_reference(x, residual, norm.weight, norm.eps)
    assert torch.equal(summed, x + residual) and torch.equal(normed, norm(x + residual))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [1, 17, 130])
@pytest.mark.parametrize("intermediate", [80, 1500])  # 1500: two column blocks, the second masked
def test_silu_mul_matches_reference(dtype, tokens, intermediate, kernel_device):
    gen = torch.Generator().manual_seed(tokens + intermediate)
    gate_up = (4 * torch.randn(tokens, 2 * intermediate, generator=gen)).to(kernel_device, dtype)
    assert_matches(silu_mul_triton(gate_up), silu_mul_reference(gate_up))


def test_kernels_take_strided_rows_and_no_rows(kernel_device):
    x, residual, weight = norm_inputs(6, 40, torch.float32, device=kernel_device)
    wide = torch.zeros(6, 100, device=kernel_device)
    wide[:, 10:50] = x  # row stride 100
    torch.testing.assert_close(rms_norm_triton(wide[:, 10:50], weight, 1e-5), rms_norm_reference(x, weight, 1e-5),
                               rtol=FLOAT32_RTOL, atol=FLOAT32_RTOL)
    gate_up = torch.randn(5, 2 * 24, generator=torch.Generator().manual_seed(0)).to(kernel_device)
    wide = torch.zeros(5, 70, device=kernel_device)
    wide[:, 3:51] = gate_up
    torch.testing.assert_close(silu_mul_triton(wide[:, 3:51]), silu_mul_reference(gate_up), rtol=FLOAT32_RTOL,
                               atol=FLOAT32_RTOL)
    empty = torch.zeros(0, 40, device=kernel_device)
    assert rms_norm_triton(empty, weight, 1e-5).shape == (0, 40)
    normed, summed = add_rms_norm_triton(empty, empty, weight, 1e-5)
    assert normed.shape == summed.shape == (0, 40)
    assert silu_mul_triton(torch.zeros(0, 8, device=kernel_device)).shape == (0, 4)


def test_ops_trace_and_their_fakes_run():
    x, residual, weight = norm_inputs(5, 24, torch.float32)
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_static")
    torch.library.opcheck(torch.ops.specdec_models.rms_norm, (x, weight, 1e-5), test_utils=utils)
    torch.library.opcheck(torch.ops.specdec_models.add_rms_norm, (x, residual, weight, 1e-5), test_utils=utils)
    torch.library.opcheck(torch.ops.specdec_models.silu_mul, (torch.randn(5, 16),), test_utils=utils)


def test_ops_outputs_are_contiguous_like_their_fakes():
    # Strided inputs: the CPU paths (the references) would take their layout; the ops return what the fakes say.
    x, residual, weight = norm_inputs(5, 24, torch.float16)
    strided_x, strided_residual = x.T.contiguous().T, residual.T.contiguous().T
    assert not strided_x.is_contiguous()
    ops = torch.ops.specdec_models
    normed = ops.rms_norm(strided_x, weight, 1e-5)
    normed_sum, summed = ops.add_rms_norm(strided_x, strided_residual, weight, 1e-5)
    assert normed.is_contiguous() and normed_sum.is_contiguous() and summed.is_contiguous()
    assert torch.equal(normed, rms_norm_reference(x, weight, 1e-5))
    assert torch.equal(summed, x + residual) and torch.equal(normed_sum, rms_norm_reference(x + residual, weight, 1e-5))
    gate_up = torch.randn(16, 5).T.to(torch.float16)
    act = ops.silu_mul(gate_up)
    assert act.is_contiguous() and torch.equal(act, silu_mul_reference(gate_up))


def test_bad_inputs_raise():
    x, residual, weight = norm_inputs(3, 16, torch.float32)
    ops = torch.ops.specdec_models
    # The Triton entries and the ops' CPU paths check the same.
    for rms_norm, add_rms_norm, silu_mul in ((rms_norm_triton, add_rms_norm_triton, silu_mul_triton),
                                             (ops.rms_norm, ops.add_rms_norm, ops.silu_mul)):
        with pytest.raises(ValueError, match=r"rms_norm: x must be \[T, H\]"):
            rms_norm(x[0], weight, 1e-5)
        with pytest.raises(ValueError, match="rms_norm: x must be a floating tensor"):
            rms_norm(x.int(), weight.int(), 1e-5)
        with pytest.raises(ValueError, match=r"rms_norm: weight must be \[16\]"):
            rms_norm(x, weight[:15], 1e-5)
        with pytest.raises(ValueError, match="rms_norm: weight .* must share x's dtype"):
            rms_norm(x, weight.half(), 1e-5)
        with pytest.raises(ValueError, match="add_rms_norm: residual must have x's shape"):
            add_rms_norm(x, residual[:2], weight, 1e-5)
        with pytest.raises(ValueError, match="add_rms_norm: residual .* must share x's dtype"):
            add_rms_norm(x, residual.half(), weight, 1e-5)
        with pytest.raises(ValueError, match=r"silu_mul: gate_up must be \[T, 2 \* I\]"):
            silu_mul(torch.zeros(3, 7))
        with pytest.raises(ValueError, match=r"silu_mul: gate_up must be \[T, 2 \* I\]"):
            silu_mul(torch.zeros(8))
        with pytest.raises(ValueError, match="silu_mul: gate_up must be a floating tensor"):
            silu_mul(torch.zeros(3, 8, dtype=torch.int32))
    # float64 runs the references (the CPU paths, and the ops on CUDA); the kernels refuse it.
    with pytest.raises(ValueError, match="rms_norm: the Triton kernel takes float32, float16 or bfloat16"):
        rms_norm_triton(x.double(), weight.double(), 1e-5)
    with pytest.raises(ValueError, match="silu_mul: the Triton kernel takes float32"):
        silu_mul_triton(torch.zeros(3, 8, dtype=torch.float64))


def test_elementwise_kernels_only_for_many_half_precision_cuda_rows(monkeypatch):
    def stand_in(rows, dtype, device="cuda"):  # what runs_elementwise_kernels reads of a tensor (no CUDA here)
        return types.SimpleNamespace(device=torch.device(device), dtype=dtype, shape=(rows, 64), dim=lambda: 2)

    assert elementwise.runs_elementwise_kernels(stand_in(17, torch.bfloat16))
    assert elementwise.runs_elementwise_kernels(stand_in(2048, torch.float16))
    assert not elementwise.runs_elementwise_kernels(stand_in(16, torch.bfloat16))  # linear.py's fused projections
    assert not elementwise.runs_elementwise_kernels(stand_in(17, torch.float32))
    assert not elementwise.runs_elementwise_kernels(stand_in(17, torch.bfloat16, "cpu"))
    assert not elementwise.runs_elementwise_kernels(torch.zeros(40, 8, dtype=torch.float16))
    # Compiled too (the rounds' steps of more than 16 tokens), where they beat inductor's fusion of the plain code.
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert elementwise.runs_elementwise_kernels(stand_in(17, torch.bfloat16))


# --- the model ------------------------------------------------------------------------------------------------


def force_prefill_path(monkeypatch, triton_kernels: bool) -> list:
    """Sends a CPU model's forwards of more than 16 tokens down the prefill path: through the ops' CPU paths (the
    references), or with triton_kernels through the Triton kernels in the interpreter. Returns the list that
    counts the layer calls of that path."""
    calls = []
    original = llama_mod.DecoderLayer.forward_deferred_residual
    monkeypatch.setattr(llama_mod.DecoderLayer, "forward_deferred_residual",
                        lambda self, *a: calls.append(1) or original(self, *a))
    monkeypatch.setattr(elementwise, "runs_elementwise_kernels", lambda x: x.dim() == 2 and x.shape[0] > 16)
    if triton_kernels:
        monkeypatch.setattr(elementwise, "rms_norm", rms_norm_triton)
        monkeypatch.setattr(elementwise, "add_rms_norm", add_rms_norm_triton)
        monkeypatch.setattr(elementwise, "silu_mul", silu_mul_triton)
        monkeypatch.setattr(attention_mod, "rope_write_kv", rope_write_kv_triton)
    return calls


def model_and_batch(dtype, seed=3, attention_bias=True):
    config = LlamaConfig(vocab_size=300, hidden_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
                         intermediate_size=80, attention_bias=attention_bias, tie_word_embeddings=True,
                         dtype=dtype)
    model = LlamaModel(config, seed=seed)
    ids, positions, metadata = paged_batch(model, rows=2, query_len=10, context=13)  # 20 tokens
    return model, ids, positions, metadata


def run_paged(model, ids, positions, metadata, caches):
    own = metadata._replace(kv_caches=tuple(c.clone() for c in caches))
    return model.compute_logits(model(ids, positions, own)), own.kv_caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_path_through_references_equals_plain_path(dtype, monkeypatch):
    """The folded residual adds and the ops' CPU paths change no bit: paged (rotary + cache write through
    rope_write_kv) and dense."""
    model, ids, positions, metadata = model_and_batch(dtype)
    caches = metadata.kv_caches
    want, want_caches = run_paged(model, ids, positions, metadata, caches)
    dense_ids, dense_positions = ids[:17], torch.arange(17)
    want_dense = model(dense_ids, dense_positions)

    calls = force_prefill_path(monkeypatch, triton_kernels=False)
    got, got_caches = run_paged(model, ids, positions, metadata, caches)
    assert len(calls) == model.config.num_layers
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(got_caches, want_caches))
    assert torch.equal(model(dense_ids, dense_positions), want_dense)
    assert len(calls) == 2 * model.config.num_layers
    # 16 tokens keep the layer's own forward under the forced dispatch (the real dispatch's 16-token threshold is
    # test_elementwise_kernels_only_for_many_half_precision_cuda_rows's).
    model(ids[:16], positions[:16], metadata._replace(kv_caches=tuple(c.clone() for c in caches),
                                                      slot_mapping=metadata.slot_mapping[:16],
                                                      token_rows=metadata.token_rows[:16],
                                                      seq_lens=metadata.seq_lens[:16], uniform_query_len=None))
    assert len(calls) == 2 * model.config.num_layers


def test_prefill_path_traces_fullgraph(monkeypatch):
    model, ids, positions, metadata = model_and_batch(torch.float32)
    want, _ = run_paged(model, ids, positions, metadata, metadata.kv_caches)
    calls = force_prefill_path(monkeypatch, triton_kernels=False)
    own = metadata._replace(kv_caches=tuple(c.clone() for c in metadata.kv_caches))
    torch._dynamo.reset()
    compiled = torch.compile(lambda: model.compute_logits(model(ids, positions, own)), fullgraph=True,
                             dynamic=False, backend="aot_eager")
    got = compiled()
    assert calls  # traced through the prefill path
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


@pytest.mark.interpreter
def test_prefill_path_through_triton_kernels_matches_plain_float32(monkeypatch):
    model, ids, positions, metadata = model_and_batch(torch.float32, seed=5)
    caches = metadata.kv_caches
    want, want_caches = run_paged(model, ids, positions, metadata, caches)
    calls = force_prefill_path(monkeypatch, triton_kernels=True)
    got, got_caches = run_paged(model, ids, positions, metadata, caches)
    assert len(calls) == model.config.num_layers
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(got_caches, want_caches):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# --- CUDA -------------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_kernels_match_references(dtype):
    """The kernels on CUDA against PyTorch's: float32 to 1e-6 relative; half dtypes within two ulps with at most
    1 % of the entries differing at all (the norm sums its squares in another order; silu computes PyTorch's
    float32 x / (1 + expf(-x)) with the same expf and a correctly rounded division, meant to differ nowhere, but
    FTZ and FMA contraction are the compilers', so it is held to the same bound); the residual sum exactly."""
    rtol = {torch.float32: FLOAT32_RTOL, torch.float16: HALF_RTOL, torch.bfloat16: 2.0 ** -6}[dtype]  # two ulps

    def assert_close_on_cuda(got, want):
        assert got.is_contiguous() and got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=rtol, atol=1e-6)
        if dtype != torch.float32:
            assert (got != want).float().mean().item() <= 0.01

    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up = 4 * torch.randn(2048, 2 * 1500, generator=gen, device="cuda").to(dtype)
    assert_close_on_cuda(torch.ops.specdec_models.silu_mul(gate_up), silu_mul_reference(gate_up))
    x = 3 * torch.randn(300, 2049, generator=gen, device="cuda").to(dtype)
    residual = torch.randn(300, 2049, generator=gen, device="cuda").to(dtype)
    weight = (1 + 0.2 * torch.randn(2049, generator=gen, device="cuda")).to(dtype)
    normed, summed = torch.ops.specdec_models.add_rms_norm(x, residual, weight, 1e-5)
    want_normed, want_summed = add_rms_norm_reference(x, residual, weight, 1e-5)
    assert torch.equal(summed, want_summed)
    assert_close_on_cuda(normed, want_normed)
    assert_close_on_cuda(torch.ops.specdec_models.rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5))


def ragged_prefill(model, prompt_lens, num_pad, block_size=16, seed=0):
    """Ragged prompts (one request row each) and `num_pad` padding tokens of a spare all-null row writing the null
    block, over shuffled blocks of stale cache contents."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(prompt_lens)
    blocks_per_row = -(-max(prompt_lens) // block_size) + 1
    table = torch.zeros(rows + 1, blocks_per_row, dtype=torch.int64)
    table[:rows] = (torch.randperm(rows * blocks_per_row, generator=gen) + 1).view(rows, blocks_per_row)
    spec = model.kv_cache_spec()
    caches = tuple(torch.randn((rows * blocks_per_row + 1) * block_size, 2, spec.num_kv_heads, spec.head_size,
                               generator=gen).to("cuda", spec.dtype) for _ in range(spec.num_layers))
    positions = torch.cat([torch.arange(n) for n in prompt_lens] + [torch.zeros(num_pad, dtype=torch.int64)])
    token_rows = torch.cat([torch.full((n,), r) for r, n in enumerate(prompt_lens)] + [torch.full((num_pad,), rows)])
    seq_lens = torch.cat([torch.full((n,), n) for n in prompt_lens] + [torch.zeros(num_pad, dtype=torch.int64)])
    slots = table[token_rows, positions // block_size] * block_size + positions % block_size
    ids = torch.randint(0, model.vocab_size, (positions.shape[0],), generator=gen)
    metadata = AttentionMetadata(caches, slots.cuda(), table.cuda(), token_rows.cuda(), seq_lens.int().cuda(),
                                 block_size)
    return ids.cuda(), positions.cuda(), metadata


@pytest.mark.cuda
def test_cuda_prefill_path_matches_plain_and_captures(monkeypatch):
    """bf16, 1B-like widths (2 layers, q/k/v bias), a ragged prefill of 3 prompts and padding (130 tokens): the
    new path eager, replayed as a CUDA graph of the eager forward (as the generator's prefill runs) and compiled
    (as the rounds' larger steps run), against the plain bf16 path: its error against a float32 copy
    is at most twice the plain path's plus 1e-3 of the largest logit, and the cache rows it writes agree to bf16
    rounding."""
    config = LlamaConfig(vocab_size=2048, hidden_size=2048, num_layers=2, num_heads=32, num_kv_heads=8,
                         intermediate_size=8192, rope_theta=5e5, tie_word_embeddings=True, attention_bias=True,
                         dtype=torch.bfloat16)
    model = LlamaModel(config, device="cuda", seed=0)
    ids, positions, metadata = ragged_prefill(model, [17, 40, 70], num_pad=3)
    live = ids.shape[0] - 3
    caches_before = tuple(c.clone() for c in metadata.kv_caches)
    calls = []
    original = llama_mod.DecoderLayer.forward_deferred_residual
    monkeypatch.setattr(llama_mod.DecoderLayer, "forward_deferred_residual",
                        lambda self, *a: calls.append(1) or original(self, *a))

    def forward(m, caches):
        own = metadata._replace(kv_caches=caches)
        with torch.no_grad():
            return m.compute_logits(m(ids, positions, own))

    eager_caches = tuple(c.clone() for c in caches_before)
    eager = forward(model, eager_caches)
    assert len(calls) == config.num_layers

    graph_caches = tuple(c.clone() for c in caches_before)
    graph, out = capture_graph(lambda: forward(model, graph_caches))
    for c, before in zip(graph_caches, caches_before):
        c.copy_(before)
    with sync_forbidden():
        graph.replay()
    torch.cuda.synchronize()

    compiled_caches = tuple(c.clone() for c in caches_before)
    calls_before_compile = len(calls)
    torch._dynamo.reset()
    compiled = torch.compile(lambda: forward(model, compiled_caches), fullgraph=True, dynamic=False)
    compiled_graph, compiled_out = capture_graph(compiled)
    for c, before in zip(compiled_caches, caches_before):
        c.copy_(before)
    with sync_forbidden():
        compiled_graph.replay()
    torch.cuda.synchronize()
    assert len(calls) > calls_before_compile  # compiled, the model takes the kernels too

    exact_model = LlamaModel(dataclasses.replace(config, dtype=torch.float32), device="cuda", init_weights=False)
    with torch.no_grad():
        for a, b in zip(exact_model.parameters(), model.parameters()):
            a.copy_(b)
    calls_before = len(calls)
    with monkeypatch.context() as patch:
        patch.setattr(elementwise, "runs_elementwise_kernels", lambda x: False)
        plain_caches = tuple(c.clone() for c in caches_before)
        plain = forward(model, plain_caches)
        exact = forward(exact_model, tuple(c.float() for c in caches_before))
    assert len(calls) == calls_before  # the plain runs took the plain path
    plain, exact = plain[:live].float(), exact[:live].float()
    err_plain = (plain - exact).abs().max().item()
    # The replays are held to the eager run's bound (not bit-identity: cuBLAS on the capture's side stream, and
    # inductor's code around the kernels when compiled).
    for got in (eager, out, compiled_out):
        err_new = (got[:live].float() - exact).abs().max().item()
        assert err_new <= 2 * err_plain + 1e-3 * exact.abs().max().item(), (err_new, err_plain)
        assert (got[:live].float().argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9
    # Every block but the null one (block 0): the padding tokens all write its slot 0, in an order no path fixes.
    for caches in (eager_caches, graph_caches, compiled_caches):
        for a, b in zip(caches, plain_caches):
            torch.testing.assert_close(a[16:].float(), b[16:].float(), atol=3e-2, rtol=3e-2)

"""The model's fused kernels for few tokens (specdec_ops/models/linear.py's fused projections and
attention.py's rope_write_kv) against the unfused math.

Where the kernel runs (the GPU with CUDA, else the Triton interpreter): rope_write_kv against its reference
(interpreter: float32 to 1e-6, float16 exactly, the same float32 products rounded once; GPU: float32 to 4e-6 and
float16 within an ulp, 99 % bit-identical, as FMAs contract the products), several heads per program bit for bit
as one, and slots outside the cache skipped. Interpreter only: a float32 model whose decoder layers take the fused
path against the same model's unfused path, to 1e-5. CUDA (bf16): the compiled, graph-captured fused decode and
verify steps against the unfused bf16 path and a float32 copy.
"""
import pytest
import torch

from conftest import sync_forbidden
from harness import capture_graph
from specdec_ops.models import AttentionMetadata, LlamaConfig, LlamaModel
from specdec_ops.models import attention as attention_mod
from specdec_ops.models import linear as linear_mod
from specdec_ops.models import llama as llama_mod
from specdec_ops.models.attention import rope_write_kv_reference, rope_write_kv_triton


# rope_write_kv's float32 tolerance on the GPU, where the rotation's products may contract into FMAs (values of a
# few units: about 4 float32 ulps); the interpreter computes the reference's products, to 1e-6.
ROPE_GPU_FLOAT32_ATOL = 4e-6


def rope_inputs(tokens, heads, kv_heads, d, slots, dtype, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen).to(device, dtype)
    angles = torch.rand(tokens, d // 2, generator=gen) * 50
    cache = torch.randn(slots, 2, kv_heads, d, generator=gen).to(device, dtype)
    slot_mapping = torch.randperm(slots, generator=gen)[:tokens].to(device)
    return qkv, angles.cos().to(device), angles.sin().to(device), cache, slot_mapping


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
# More than attention.ROPE_ONE_HEAD_TOKENS tokens take several heads per program: (20, 6, 2, 10) has 10 heads, so
# its second program per token holds 2 heads and 6 masked ones.
@pytest.mark.parametrize("tokens,heads,kv_heads,d", [(1, 8, 2, 64), (5, 4, 4, 24), (3, 6, 2, 10), (20, 6, 2, 10),
                                                     (17, 32, 8, 64), (33, 4, 1, 8)])
def test_rope_write_kv_matches_reference(dtype, tokens, heads, kv_heads, d, kernel_device):
    qkv, cos, sin, cache, slots = rope_inputs(tokens, heads, kv_heads, d, 80, dtype, device=kernel_device)
    want_cache = cache.clone()
    want = rope_write_kv_reference(qkv, cos, sin, want_cache, slots, heads, kv_heads)
    got = rope_write_kv_triton(qkv, cos, sin, cache, slots, heads, kv_heads)
    assert got.shape == (tokens, heads, d) and got.dtype == dtype
    for got_values, want_values in ((got, want), (cache, want_cache)):
        if kernel_device.type == "cpu":
            # The interpreter computes the reference's float32 products: float32 to 1e-6, float16 exactly.
            torch.testing.assert_close(got_values, want_values, atol=1e-6 if dtype == torch.float32 else 0, rtol=0)
        elif dtype == torch.float32:
            torch.testing.assert_close(got_values, want_values, atol=ROPE_GPU_FLOAT32_ATOL, rtol=0)
        else:
            # An FMA's float32 result flips a float16 rounding now and then: one ulp, rarely.
            torch.testing.assert_close(got_values, want_values, atol=0, rtol=2.0 ** -10)
            assert (got_values != want_values).float().mean().item() <= 0.01


@pytest.mark.parametrize("tokens", [4, 20])  # one head per program, several heads per program
def test_rope_write_kv_skips_slots_outside_the_cache(tokens, kernel_device):
    atol = ROPE_GPU_FLOAT32_ATOL if kernel_device.type == "cuda" else 1e-6
    qkv, cos, sin, cache, _ = rope_inputs(tokens, 4, 2, 16, 8, torch.float32, seed=1)
    slots = torch.tensor([3, -1, 8, 10 ** 9] + [-5] * (tokens - 4))
    before = cache.clone()
    want_cache = cache.clone()
    rope_write_kv_reference(qkv[:1], cos[:1], sin[:1], want_cache, slots[:1], 4, 2)
    on_device = [t.to(kernel_device) for t in (qkv, cos, sin, cache, slots)]
    q = rope_write_kv_triton(*on_device, 4, 2).cpu()
    cache = on_device[3].cpu()
    torch.testing.assert_close(cache, want_cache, atol=atol, rtol=0)
    assert torch.equal(cache[torch.arange(8) != 3], before[torch.arange(8) != 3])
    torch.testing.assert_close(q, rope_write_kv_reference(qkv, cos, sin, before.clone(), torch.zeros(tokens).long(),
                                                          4, 2))


@pytest.mark.parametrize("tokens,heads,kv_heads,d", [(3, 8, 2, 64), (20, 6, 2, 10), (5, 2, 1, 14), (33, 4, 1, 8)])
def test_rope_write_kv_head_blocks_equal_single_heads(monkeypatch, tokens, heads, kv_heads, d, kernel_device):
    # Several heads per program compute what one head per program does, bit for bit, whatever the token count:
    # (5, 2, 1, 14) has 4 heads in all, a block of 4; (20, 6, 2, 10) a second block of 2 heads and 6 masked ones.
    results = []
    for one_head_tokens in (10 ** 9, 0):
        monkeypatch.setattr(attention_mod, "ROPE_ONE_HEAD_TOKENS", one_head_tokens)
        qkv, cos, sin, cache, slots = rope_inputs(tokens, heads, kv_heads, d, 80, torch.float16, seed=2,
                                                  device=kernel_device)
        slots[::4] = -1  # outside the cache: not written
        results.append((rope_write_kv_triton(qkv, cos, sin, cache, slots, heads, kv_heads), cache))
    (q_one, cache_one), (q_block, cache_block) = results
    assert torch.equal(q_one, q_block) and torch.equal(cache_one, cache_block)


def test_rope_write_kv_bad_inputs_raise():
    qkv, cos, sin, cache, slots = rope_inputs(2, 4, 2, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="qkv must be"):
        rope_write_kv_triton(qkv[:, :-2], cos, sin, cache, slots, 4, 2)
    with pytest.raises(ValueError, match="kv_cache must be"):
        rope_write_kv_triton(qkv, cos, sin, cache, slots, 2, 4)
    with pytest.raises(ValueError, match="sin must be"):
        rope_write_kv_triton(qkv, cos, sin[:, :3], cache, slots, 4, 2)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        rope_write_kv_triton(qkv, cos, sin, cache, slots[:1], 4, 2)
    with pytest.raises(ValueError, match="slot_mapping must be int32 or int64"):
        rope_write_kv_triton(qkv, cos, sin, cache, slots.float(), 4, 2)
    with pytest.raises(ValueError, match="cos and sin must share a floating dtype"):
        rope_write_kv_triton(qkv, cos, sin.double(), cache, slots, 4, 2)
    # The op's CPU path (the reference) checks the same.
    with pytest.raises(ValueError, match="slot_mapping must be int32 or int64"):
        torch.ops.specdec_models.rope_write_kv(qkv, cos, sin, cache, slots.float(), 4, 2)


def paged_batch(model, rows, query_len, context, block_size=4, seed=0, device="cpu"):
    """A uniform step: `rows` requests of `context` tokens each, the last query_len of them new, shuffled blocks
    (block 0 stays the null block)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_row = -(-context // block_size)
    table = (torch.randperm(rows * blocks_per_row, generator=gen) + 1).view(rows, blocks_per_row)
    spec = model.kv_cache_spec()
    caches = tuple(torch.randn((rows * blocks_per_row + 1) * block_size, 2, spec.num_kv_heads, spec.head_size,
                               generator=gen).to(device, spec.dtype) for _ in range(spec.num_layers))
    positions = torch.arange(context - query_len, context).repeat(rows)
    token_rows = torch.arange(rows).repeat_interleave(query_len)
    slots = table[token_rows, positions // block_size] * block_size + positions % block_size
    ids = torch.randint(0, model.vocab_size, (rows * query_len,), generator=gen)
    metadata = AttentionMetadata(caches, slots.to(device), table.to(device), token_rows.to(device),
                                 torch.full((rows * query_len,), context, dtype=torch.int32, device=device),
                                 block_size, query_len)
    return ids.to(device), positions.to(device), metadata


def force_fused_layers(monkeypatch) -> list:
    """Sends a CPU float32 model's layers of up to 16 tokens down the fused path, its kernels in the interpreter;
    returns the list that counts the fused layer calls."""
    fused_calls = []
    original = llama_mod.DecoderLayer._forward_fused
    monkeypatch.setattr(llama_mod.DecoderLayer, "_forward_fused",
                        lambda self, *a: fused_calls.append(1) or original(self, *a))
    monkeypatch.setattr(linear_mod, "takes_kernel", lambda x, w: x.dim() == 2 and 0 < x.shape[0] <= 16)
    monkeypatch.setattr(linear_mod, "fused_linear", linear_mod.small_batch_linear_triton)
    return fused_calls


@pytest.mark.interpreter
def test_fused_layers_match_unfused_float32_cpu(monkeypatch):
    # A float32 model with q/k/v bias; the fused path with its kernels in the interpreter.
    config = LlamaConfig(vocab_size=300, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=96, attention_bias=True, tie_word_embeddings=True)
    model = LlamaModel(config, seed=3)
    ids, positions, metadata = paged_batch(model, rows=3, query_len=2, context=9)
    caches_before = tuple(c.clone() for c in metadata.kv_caches)
    want = model.compute_logits(model(ids, positions, metadata))
    want_caches = metadata.kv_caches

    fused_calls = force_fused_layers(monkeypatch)
    monkeypatch.setattr(attention_mod, "rope_write_kv", rope_write_kv_triton)
    metadata = metadata._replace(kv_caches=tuple(c.clone() for c in caches_before))
    got = model.compute_logits(model(ids, positions, metadata))
    assert len(fused_calls) == config.num_layers
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(metadata.kv_caches, want_caches):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.interpreter
def test_fused_layers_with_dense_attention_match_unfused_float32_cpu(monkeypatch):
    """No paged cache (attn_metadata None: dense causal attention over one sequence): the fused projections with
    the plain rotary, as a short prompt of a half-precision CUDA model runs them."""
    config = LlamaConfig(vocab_size=300, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=96, tie_word_embeddings=False)
    model = LlamaModel(config, seed=4)
    ids = torch.randint(0, config.vocab_size, (7,), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(7)
    want = model.compute_logits(model(ids, positions))
    fused_calls = force_fused_layers(monkeypatch)
    got = model.compute_logits(model(ids, positions))
    assert len(fused_calls) == config.num_layers
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("rows,query_len", [(1, 1), (1, 5), (8, 1), (3, 5)])
def test_cuda_fused_step_compiled_in_a_graph_matches_unfused(rows, query_len, monkeypatch):
    """bf16, 1B-like widths (2 layers): the fused step compiled fullgraph in a CUDA graph, no host sync, against
    the unfused bf16 path (cuBLAS, inductor's norms, rotary and cache write): its error against a float32 copy
    of the model is at most twice the unfused path's own, plus 1e-3 of the largest logit."""
    config = LlamaConfig(vocab_size=2048, hidden_size=2048, num_layers=2, num_heads=32, num_kv_heads=8,
                         intermediate_size=8192, rope_theta=5e5, tie_word_embeddings=True, dtype=torch.bfloat16)
    model = LlamaModel(config, device="cuda", seed=0)
    ids, positions, metadata = paged_batch(model, rows, query_len, context=80, block_size=16, device="cuda")
    caches_before = tuple(c.clone() for c in metadata.kv_caches)

    def step():
        return model.compute_logits(model(ids, positions, metadata))

    graph, out = capture_graph(torch.compile(step, fullgraph=True, dynamic=False))
    for c, before in zip(metadata.kv_caches, caches_before):
        c.copy_(before)
    with sync_forbidden():
        graph.replay()
    torch.cuda.synchronize()
    fused_caches = tuple(c.clone() for c in metadata.kv_caches)

    def unfused_logits(m, dtype):
        own = metadata._replace(kv_caches=tuple(c.clone().to(dtype) for c in caches_before))
        with monkeypatch.context() as patch:
            patch.setattr(linear_mod, "takes_kernel", lambda x, w: False)
            with torch.no_grad():
                return m.compute_logits(m(ids, positions, own)).float(), own.kv_caches

    exact_model = LlamaModel(config.__class__(**{**config.__dict__, "dtype": torch.float32}), device="cuda",
                             init_weights=False)
    with torch.no_grad():
        for a, b in zip(exact_model.parameters(), model.parameters()):
            a.copy_(b)
    unfused, unfused_caches = unfused_logits(model, torch.bfloat16)
    exact, _ = unfused_logits(exact_model, torch.float32)
    err_fused = (out.float() - exact).abs().max().item()
    err_unfused = (unfused - exact).abs().max().item()
    assert err_fused <= 2 * err_unfused + 1e-3 * exact.abs().max().item(), (err_fused, err_unfused)
    assert (out.float().argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9
    for a, b in zip(fused_caches, unfused_caches):
        # The cache rows written differ by the projections' rounding only.
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=3e-2)


def test_dependent_launch_only_on_cuda():
    from specdec_ops.models import dependent_launch
    assert dependent_launch.launch_options(torch.device("cpu")) == {"USE_PDL": False}


@pytest.mark.cuda
@pytest.mark.parametrize("rows,query_len", [(1, 1), (2, 5), (2, 24)])
def test_cuda_dependent_launch_changes_no_bit(rows, query_len, monkeypatch):
    """The same compiled bf16 step captured twice, with programmatic dependent launch (the default on Hopper) and
    with SPECDEC_PDL=0: identical logits and caches over several replays (where a missing wait may show as a
    race). 2 x 24 tokens: a compiled step of more than 16 tokens (cuBLAS projections, the elementwise kernels of
    elementwise.py and the paged-attention kernel)."""
    from specdec_ops.models import dependent_launch
    config = LlamaConfig(vocab_size=2048, hidden_size=1024, num_layers=3, num_heads=16, num_kv_heads=4,
                         intermediate_size=4096, tie_word_embeddings=True, dtype=torch.bfloat16)
    model = LlamaModel(config, device="cuda", seed=1)
    ids, positions, metadata = paged_batch(model, rows, query_len, context=200, block_size=16, device="cuda")
    caches_before = tuple(c.clone() for c in metadata.kv_caches)
    step = torch.compile(lambda: model.compute_logits(model(ids, positions, metadata)), fullgraph=True,
                         dynamic=False)

    def replayed(pdl: str):
        monkeypatch.setenv(dependent_launch.ENV_VAR, pdl)
        assert dependent_launch.enabled(ids.device) == (pdl == "1" and torch.cuda.get_device_capability()[0] >= 9)
        graph, out = capture_graph(step)
        results = []
        for _ in range(3):
            for c, before in zip(metadata.kv_caches, caches_before):
                c.copy_(before)
            with sync_forbidden():
                graph.replay()
            torch.cuda.synchronize()
            results.append((out.clone(), tuple(c.clone() for c in metadata.kv_caches)))
        return results

    with_pdl, without = replayed("1"), replayed("0")
    for (logits_a, caches_a), (logits_b, caches_b) in zip(with_pdl, without):
        assert torch.equal(logits_a, logits_b)
        assert all(torch.equal(a, b) for a, b in zip(caches_a, caches_b))

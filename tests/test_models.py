"""LlamaModel against transformers: random checkpoints saved and loaded, and the real SmolLM2-135M GGUF.

- Random LlamaForCausalLM / Qwen2ForCausalLM checkpoints (untied with GQA; tied with llama3 rope scaling and an
  explicit head_dim; Qwen2 with q/k/v biases), built and saved in the test, loaded by `load_model` in float32:
  logits equal transformers' on sequences of different lengths through the dense forward, and through our
  paged path (the prompts prefilled as one ragged batch with padding, then decode steps and a verify step of
  k + 1 tokens per request), within 1e-4 absolute (logits are O(1); the paths differ only in summation order).
- The real model: our logits on a chat prompt equal transformers' from the same GGUF within 2e-3 (logits reach
  about 40), and greedy continuations through our paged path equal transformers' greedy `generate`.
- Every loader error names what is wrong.
"""
import dataclasses
import json

import pytest
import torch

from conftest import sync_forbidden
from specdec_ops.models import (AttentionMetadata, LlamaConfig, LlamaModel, check_draft_matches_target,
                                load_model, load_tokenizer, smollm2_gguf_path)
from specdec_ops.runtime import BlockPool


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # These models run tiny single-sequence steps: one intra-op thread is as fast, and it does not stall when
    # other processes hold the cores (two spinning threads can then take 100x longer).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _transformers():
    # Imported where needed, so that the CUDA tests run on a machine without transformers.
    return pytest.importorskip("transformers")

LOGITS_ATOL = 1e-4


class PagedRunner:
    """Drives a model's paged forward as a scheduler would: shuffled blocks, stale cache contents, a spare
    all-null padding row, padded tokens writing the null block."""

    def __init__(self, model, *, num_rows, block_size=4, blocks_per_row=16, seed=0, device="cpu"):
        spec = model.kv_cache_spec()
        self.model, self.block_size, self.device = model, block_size, device
        num_blocks = 1 + num_rows * blocks_per_row
        gen = torch.Generator().manual_seed(seed)
        # Stale values in every slot (reused slots): only masking keeps them out of attention.
        self.kv_caches = tuple(
            torch.randn(num_blocks * block_size, 2, spec.num_kv_heads, spec.head_size, generator=gen)
            .to(device=device, dtype=spec.dtype) for _ in range(spec.num_layers))
        self.pool = BlockPool(num_blocks, seed=seed)
        self.block_tables = torch.zeros(num_rows + 1, blocks_per_row, dtype=torch.int64)  # + the padding row
        self.lengths = [0] * num_rows
        self.spare = num_rows

    def _grow(self, row, length):
        have = int((self.block_tables[row] != 0).sum())
        need = -(-length // self.block_size)
        if need > have:
            self.block_tables[row, have:need] = torch.tensor(self.pool.allocate(need - have))

    def metadata(self, row_tokens, num_pad_tokens=0, uniform_query_len=None):
        """row_tokens: [(row, number of new tokens)]; returns (positions, metadata) for the new tokens."""
        rows, positions, seq_lens, slots = [], [], [], []
        for row, count in row_tokens:
            start = self.lengths[row]
            self._grow(row, start + count)
            for p in range(start, start + count):
                rows.append(row)
                positions.append(p)
                seq_lens.append(start + count)
                slots.append(int(self.block_tables[row, p // self.block_size]) * self.block_size + p % self.block_size)
            self.lengths[row] += count
        for i in range(num_pad_tokens):
            rows.append(self.spare)
            positions.append(0)
            seq_lens.append(0)
            slots.append(i % self.block_size)  # the null block
        t = lambda v: torch.tensor(v, dtype=torch.int64, device=self.device)  # noqa: E731
        metadata = AttentionMetadata(self.kv_caches, t(slots), self.block_tables.to(self.device), t(rows),
                                     t(seq_lens).int(), self.block_size, uniform_query_len)
        return t(positions), metadata

    def step(self, row_tokens, token_ids, num_pad_tokens=0, uniform_query_len=None):
        """Runs the new tokens (token_ids, flat, plus padding) and returns their logits [tokens, V]."""
        positions, metadata = self.metadata(row_tokens, num_pad_tokens, uniform_query_len)
        ids = torch.tensor(list(token_ids) + [10 ** 6] * num_pad_tokens, device=self.device)  # pads out of vocab
        with torch.no_grad():
            logits = self.model.compute_logits(self.model(ids, positions, metadata))
        assert torch.isfinite(logits).all()
        return logits[: len(token_ids)]


# --- random transformers checkpoints -------------------------------------------------------------------------

HF_CASES = {
    "llama-untied-gqa": ("LlamaConfig", dict(rope_theta=5e5, tie_word_embeddings=False)),
    "llama-tied-llama3-rope": ("LlamaConfig", dict(
        tie_word_embeddings=True, head_dim=24, rope_theta=5e5,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16})),
    "qwen2-bias": ("Qwen2Config", dict(tie_word_embeddings=False)),
}


@pytest.fixture(scope="module", params=list(HF_CASES))
def hf_checkpoint(request, tmp_path_factory):
    transformers = _transformers()
    config_cls, extra = HF_CASES[request.param]
    config = getattr(transformers, config_cls)(
        vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, **extra)
    torch.manual_seed(0)
    model_cls = transformers.Qwen2ForCausalLM if config_cls == "Qwen2Config" else transformers.LlamaForCausalLM
    hf = model_cls(config).float().eval()
    with torch.no_grad():  # larger than the default init, so that the comparison sees every weight
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "bias" in name:
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, path, hf


SEQUENCE_LENS = [7, 1, 23, 12]


def random_sequences(vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in SEQUENCE_LENS]


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_loaded_config_matches_checkpoint(hf_checkpoint):
    name, path, hf = hf_checkpoint
    model = load_model(path, dtype=torch.float32)
    c = model.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.hidden_size) == (2, 6, 2, 48)
    assert c.tie_word_embeddings == hf.config.tie_word_embeddings
    assert c.attention_bias == name.startswith("qwen2")
    assert c.head_size == (24 if "head_dim" in json.loads((path / "config.json").read_text())
                           and name == "llama-tied-llama3-rope" else 8)
    if c.tie_word_embeddings:
        assert model.lm_head is None and model.head_weight is model.embed_tokens.weight
    assert (c.rope_scaling is not None) == ("llama3" in name)


def test_dense_forward_matches_transformers(hf_checkpoint):
    _, path, hf = hf_checkpoint
    model = load_model(path, dtype=torch.float32)
    for ids in random_sequences(hf.config.vocab_size):
        with torch.no_grad():
            ours = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))
        torch.testing.assert_close(ours, hf_logits(hf, ids), atol=LOGITS_ATOL, rtol=0)


def paged_prefill_decode_verify(hf_checkpoint):
    """The ragged prefill, 3 decode steps and one verify step of k = 4 drafts + 1, each step's logits checked
    against transformers'. Returns (hf, runner, rows, sequences, gen, k, starts): starts[i] is the position of
    request i's first token in that verify step."""
    _, path, hf = hf_checkpoint
    model = load_model(path, dtype=torch.float32, )
    model.attention_backend = "reference"
    vocab = hf.config.vocab_size
    prompts = random_sequences(vocab)
    runner = PagedRunner(model, num_rows=len(prompts) + 2)
    rows = [1, 0, 3, 4]  # request rows, not in batch order; row 2 stays unused (its blocks are null)
    gen = torch.Generator().manual_seed(1)
    sequences = [list(p) for p in prompts]

    def expect(index, count):
        return hf_logits(hf, sequences[index])[-count:]

    # Prefill: all prompts as one ragged batch, plus padded tokens.
    logits = runner.step([(r, len(p)) for r, p in zip(rows, prompts)], [t for p in prompts for t in p],
                         num_pad_tokens=5)
    start = 0
    for i, p in enumerate(prompts):
        torch.testing.assert_close(logits[start: start + len(p)], expect(i, len(p)), atol=LOGITS_ATOL, rtol=0)
        start += len(p)
    # Decode steps: one token per request (uniform layout), one padded row.
    for _ in range(3):
        new = torch.randint(0, vocab, (len(prompts),), generator=gen).tolist()
        for seq, t in zip(sequences, new):
            seq.append(t)
        logits = runner.step([(r, 1) for r in rows], new, num_pad_tokens=1, uniform_query_len=1)
        for i in range(len(prompts)):
            torch.testing.assert_close(logits[i: i + 1], expect(i, 1), atol=LOGITS_ATOL, rtol=0)
    # A verify step: the last verified token plus k = 4 drafts per request.
    k = 4
    new = [torch.randint(0, vocab, (k + 1,), generator=gen).tolist() for _ in prompts]
    for seq, ts in zip(sequences, new):
        seq.extend(ts)
    logits = runner.step([(r, k + 1) for r in rows], [t for ts in new for t in ts], num_pad_tokens=k + 1,
                         uniform_query_len=k + 1)
    for i in range(len(prompts)):
        torch.testing.assert_close(logits[i * (k + 1): (i + 1) * (k + 1)], expect(i, k + 1), atol=LOGITS_ATOL,
                                   rtol=0)
    starts = [len(seq) - (k + 1) for seq in sequences]
    return hf, runner, rows, sequences, gen, k, starts


def test_paged_prefill_decode_verify_match_transformers(hf_checkpoint):
    paged_prefill_decode_verify(hf_checkpoint)


def test_paged_verify_after_rejections_overwrites_kv_and_matches_transformers(hf_checkpoint):
    """After the first verify step, 3 more as speculative decoding runs them: each request accepts a seeded random
    number a of its k drafts (0..k), so the next verify step starts at position start + 1 + a, its k + 1 tokens
    written over the KV of the rejected positions in the paged cache (the blocks stay allocated). Every new token
    differs from the one it replaces at its position (the rejected draft), so KV left from a rejected token would
    change the logits. Each step's logits equal transformers' on the whole sequence (the accepted prefix plus the
    new tokens) from scratch, within LOGITS_ATOL (1e-4 absolute, fp32). Requests of different lengths (prompts of
    7, 1, 23 and 12 tokens, then different accepted counts); block_size 4, so rewinds cross block boundaries."""
    hf, runner, rows, sequences, gen, k, starts = paged_prefill_decode_verify(hf_checkpoint)
    vocab = hf.config.vocab_size
    overwritten = 0
    for step in range(3):
        accepted = torch.randint(0, k + 1, (len(rows),), generator=gen).tolist()
        accepted[step % len(rows)] = min(accepted[step % len(rows)], k - 1)  # a rejection in every step
        new = []
        for i, (row, a) in enumerate(zip(rows, accepted)):
            start = starts[i] + 1 + a
            stale = sequences[i][start:]  # the rejected drafts, at positions start .. start + k - 1 - a
            overwritten += len(stale)
            tokens = torch.randint(0, vocab, (k + 1,), generator=gen).tolist()
            tokens = [(t + 1 + int(torch.randint(0, vocab - 1, (1,), generator=gen))) % vocab  # any other id
                      if j < len(stale) and t == stale[j] else t for j, t in enumerate(tokens)]
            assert all(t != old for t, old in zip(tokens, stale))
            del sequences[i][start:]
            sequences[i].extend(tokens)
            runner.lengths[row] = start  # rewind: the next tokens go to the rejected positions' slots
            starts[i] = start
            new.append(tokens)
        logits = runner.step([(r, k + 1) for r in rows], [t for ts in new for t in ts], num_pad_tokens=k + 1,
                             uniform_query_len=k + 1)
        for i, seq in enumerate(sequences):
            torch.testing.assert_close(logits[i * (k + 1): (i + 1) * (k + 1)], hf_logits(hf, seq)[-(k + 1):],
                                       atol=LOGITS_ATOL, rtol=0, msg=lambda m: f"step {step}, request {i}, "
                                       f"accepted {accepted[i]}, start {starts[i]}: {m}")
    assert overwritten >= 3


@pytest.mark.interpreter
def test_paged_path_through_triton_kernel_matches_transformers(hf_checkpoint, monkeypatch):
    # The model's paged path with the Triton kernel (the interpreter) in place of the reference, on CPU tensors.
    from specdec_ops.models import attention

    _, path, hf = hf_checkpoint
    model = load_model(path, dtype=torch.float32)
    model.attention_backend = "reference"
    monkeypatch.setattr(attention, "paged_attention_reference",
                        lambda *args: attention.paged_attention_triton(*args, uniform_query_len=0))
    prompts = random_sequences(hf.config.vocab_size, seed=3)[:2]
    runner = PagedRunner(model, num_rows=3)
    logits = runner.step([(0, len(prompts[0])), (2, len(prompts[1]))], prompts[0] + prompts[1], num_pad_tokens=2)
    torch.testing.assert_close(logits[: len(prompts[0])], hf_logits(hf, prompts[0]), atol=LOGITS_ATOL, rtol=0)
    torch.testing.assert_close(logits[len(prompts[0]):], hf_logits(hf, prompts[1]), atol=LOGITS_ATOL, rtol=0)


def test_truncated_model_shares_weights_and_matches_first_layers(hf_checkpoint):
    _, path, hf = hf_checkpoint
    model = load_model(path, dtype=torch.float32)
    draft = model.truncated(1)
    assert len(draft.layers) == 1 and draft.config.num_layers == 1 and draft.kv_cache_spec().num_layers == 1
    assert draft.layers[0] is model.layers[0] and draft.embed_tokens is model.embed_tokens
    assert draft.head_weight.data_ptr() == model.head_weight.data_ptr() and len(model.layers) == 2
    loaded = load_model(path, dtype=torch.float32, num_layers=1)
    ids = torch.tensor(random_sequences(hf.config.vocab_size)[0])
    with torch.no_grad():
        a = draft.compute_logits(draft(ids, torch.arange(len(ids))))
        b = loaded.compute_logits(loaded(ids, torch.arange(len(ids))))
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="num_layers"):
        model.truncated(3)


def test_loads_sharded_checkpoint_and_half_dtypes(hf_checkpoint, tmp_path):
    name, path, hf = hf_checkpoint
    if name != "llama-untied-gqa":
        pytest.skip("one case is enough")
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    sharded = load_model(tmp_path, dtype=torch.float32)
    whole = load_model(path, dtype=torch.float32)
    for (n, a), (_, b) in zip(sharded.named_parameters(), whole.named_parameters()):
        assert torch.equal(a, b), n
    for dtype in (torch.bfloat16, "float16"):
        half = load_model(path, dtype=dtype)
        assert half.embed_tokens.weight.dtype == (torch.bfloat16 if dtype is torch.bfloat16 else torch.float16)


def write_gguf_like_llama_cpp(hf, path, *, metadata=None, extra_tensors=None):
    """A float32 GGUF of a transformers model, laid out as llama.cpp's converter does: llama q/k rows permuted
    into its rope layout, Llama 3 rope scaling as rope_freqs divisors, no output.weight when tied. metadata:
    more uint32 fields; extra_tensors: more tensors, by name."""
    gguf = pytest.importorskip("gguf")
    from specdec_ops.models.llama import rotary_inv_freq

    c = hf.config
    arch = "qwen2" if c.model_type == "qwen2" else "llama"
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = getattr(c, "rope_parameters", None) or {"rope_theta": c.rope_theta}
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_vocab_size(c.vocab_size)
    for key, value in (metadata or {}).items():
        writer.add_uint32(key, value)

    def permute(w, heads):
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    def add(name, tensor):
        writer.add_tensor(name, tensor.detach().float().numpy().copy())

    sd = hf.state_dict()
    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    if not c.tie_word_embeddings:
        add("output.weight", sd["lm_head.weight"])
    if rope.get("rope_type") == "llama3":
        ours = LlamaConfig(hidden_size=c.hidden_size, num_heads=c.num_attention_heads,
                           num_kv_heads=c.num_key_value_heads, head_size=head_dim, rope_theta=rope["rope_theta"])
        base = rotary_inv_freq(ours)
        scaled = rotary_inv_freq(dataclasses.replace(ours, rope_scaling=dict(rope)))
        add("rope_freqs.weight", (base / scaled).float())
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for ours_name, hf_name, heads in (("attn_q", "q_proj", c.num_attention_heads),
                                          ("attn_k", "k_proj", c.num_key_value_heads), ("attn_v", "v_proj", None)):
            for kind in ("weight", "bias"):
                tensor = sd.get(f"{p}self_attn.{hf_name}.{kind}")
                if tensor is None:
                    continue
                if arch == "llama" and heads is not None:
                    tensor = permute(tensor, heads)
                add(f"blk.{i}.{ours_name}.{kind}", tensor)
        add(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        add(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        add(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        add(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
        add(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        add(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
    for name, tensor in (extra_tensors or {}).items():
        add(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_written_like_llama_cpp_matches_transformers(hf_checkpoint, tmp_path):
    # The GGUF path on every case: un-permuted llama q/k rows, qwen2 biases, rope_freqs, tied heads.
    name, _, hf = hf_checkpoint
    model = load_model(write_gguf_like_llama_cpp(hf, tmp_path / f"{name}.gguf"))
    assert model.config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert model.config.architecture == ("Qwen2ForCausalLM" if name.startswith("qwen2") else "LlamaForCausalLM")
    for ids in random_sequences(hf.config.vocab_size, seed=7)[:2]:
        with torch.no_grad():
            ours = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))
        torch.testing.assert_close(ours, hf_logits(hf, ids), atol=LOGITS_ATOL, rtol=0)


def test_gguf_end_of_turn_ids_and_unused_tensors(hf_checkpoint, tmp_path):
    name, _, hf = hf_checkpoint
    if name != "llama-untied-gqa":
        pytest.skip("one case is enough")
    ids = {"tokenizer.ggml.eos_token_id": 3, "tokenizer.ggml.eot_token_id": 7, "tokenizer.ggml.eom_token_id": 7}
    model = load_model(write_gguf_like_llama_cpp(hf, tmp_path / "eot.gguf", metadata=ids))
    assert model.config.eos_token_id == 3 and model.config.eos_token_ids == (3, 7)
    # A layer the config does not count: an error, unless the caller asked for fewer layers.
    sd = hf.state_dict()
    extra = {"blk.2.attn_norm.weight": sd["model.layers.0.input_layernorm.weight"]}
    path = write_gguf_like_llama_cpp(hf, tmp_path / "extra.gguf", extra_tensors=extra)
    with pytest.raises(ValueError, match=r"holds tensors the config \(LlamaForCausalLM, 2 layers\) does not use: "
                       r"blk\.2\.attn_norm\.weight"):
        load_model(path)
    assert load_model(path, num_layers=1).config.num_layers == 1
    # ... but a tensor of a kept layer that the model has no place for is refused when truncating too.
    odd = write_gguf_like_llama_cpp(hf, tmp_path / "odd.gguf", extra_tensors={
        "blk.0.attn_q_norm.weight": sd["model.layers.0.input_layernorm.weight"]})
    with pytest.raises(ValueError, match=r"does not use: blk\.0\.attn_q_norm\.weight"):
        load_model(odd, num_layers=1)


# --- loader errors -------------------------------------------------------------------------------------------


def test_loader_errors(hf_checkpoint, tmp_path):
    import shutil

    name, path, _ = hf_checkpoint
    if name != "qwen2-bias":
        pytest.skip("one case is enough")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="without config.json"):
        load_model(tmp_path / "empty")
    (tmp_path / "text.bin").write_text("x")
    with pytest.raises(ValueError, match="neither a directory nor a .gguf"):
        load_model(tmp_path / "text.bin")

    def copy(tag, edit=None, drop=None):
        target = tmp_path / tag
        shutil.copytree(path, target)
        if edit:
            config = json.loads((target / "config.json").read_text())
            edit(config)
            (target / "config.json").write_text(json.dumps(config))
        if drop:
            (target / drop).unlink()
        return target

    no_weights = copy("no_weights", drop="model.safetensors")
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_model(no_weights)
    mistral = copy("mistral", edit=lambda c: c.update(architectures=["MistralForCausalLM"]))
    with pytest.raises(ValueError, match=r"`architectures` is \['MistralForCausalLM'\]"):
        load_model(mistral)
    wider = copy("wider", edit=lambda c: c.update(intermediate_size=96))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj.weight \(80, 48\) \+ "
                       r"model.layers.0.mlp.up_proj.weight \(80, 48\) gives layers.0.gate_up_proj.weight shape "
                       r"\(160, 48\), the config expects \(192, 48\)"):
        load_model(wider)
    deeper = copy("deeper", edit=lambda c: c.update(num_hidden_layers=3))
    with pytest.raises(ValueError, match="no tensor model.layers.2"):
        load_model(deeper)
    shallower = copy("shallower", edit=lambda c: c.update(num_hidden_layers=1))
    with pytest.raises(ValueError, match=r"holds tensors the config \(Qwen2ForCausalLM, 1 layers\) does not use: "
                       r"model\.layers\.1\.input_layernorm\.weight, .* and \d+ more"):
        load_model(shallower)
    assert load_model(path, num_layers=1).config.num_layers == 1
    bad_json = copy("bad_json")
    (bad_json / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
        load_model(bad_json)
    no_map = copy("no_map", drop="model.safetensors")
    (no_map / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match=r"has no `weight_map` object"):
        load_model(no_map)
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_model(path, dtype="int8")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(path)


def test_generation_config_adds_eos_ids(hf_checkpoint, tmp_path):
    # Llama 3 Instruct checkpoints list <|eot_id|> in generation_config.json, not always in config.json.
    import shutil

    name, path, _ = hf_checkpoint
    if name != "llama-untied-gqa":
        pytest.skip("one case is enough")
    target = tmp_path / "ckpt"
    shutil.copytree(path, target)
    config = json.loads((target / "config.json").read_text())
    config["eos_token_id"] = 2
    (target / "config.json").write_text(json.dumps(config))
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 2, 9]}))
    model = load_model(target)
    assert model.config.eos_token_id == 2 and model.config.eos_token_ids == (2, 5, 9)
    (target / "generation_config.json").unlink()
    assert load_model(target).config.eos_token_ids == (2,)
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": ["eos"]}))
    with pytest.raises(ValueError, match=r"generation_config.json: config key `eos_token_id` must be an int"):
        load_model(target)


def test_gguf_loader_errors(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    def write(name, arch, tensors):
        writer = gguf.GGUFWriter(str(tmp_path / name), arch)
        writer.add_block_count(1)
        writer.add_embedding_length(8)
        writer.add_feed_forward_length(16)
        writer.add_head_count(2)
        writer.add_head_count_kv(1)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_vocab_size(11)
        for tensor_name, shape in tensors.items():
            writer.add_tensor(tensor_name, np.zeros(shape, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return tmp_path / name

    with pytest.raises(ValueError, match="`general.architecture` is 'gpt2'"):
        load_model(write("gpt2.gguf", "gpt2", {"token_embd.weight": (11, 8)}))
    with pytest.raises(ValueError, match=r"has no tensor blk\.0\.attn_norm\.weight"):
        load_model(write("missing.gguf", "llama", {"token_embd.weight": (11, 8)}))
    with pytest.raises(ValueError, match=r"token_embd.weight \(12, 8\) gives embed_tokens.weight shape \(12, 8\), "
                       r"the config expects \(11, 8\)"):
        load_model(write("shape.gguf", "llama", {"token_embd.weight": (12, 8)}))
    # Files the gguf package cannot parse: an error naming the file, from the model and the tokenizer loader.
    pytest.importorskip("transformers")  # load_tokenizer's
    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "noise.gguf").write_bytes(bytes(range(256)) * 4)
    for name in ("empty.gguf", "noise.gguf"):
        for load in (load_model, load_tokenizer):
            with pytest.raises(ValueError, match=f"{load.__name__}: .*{name} is not a readable GGUF file"):
                load(tmp_path / name)


LLAMA_32_1B_CONFIG = {  # config.json of Llama-3.2-1B (transformers 4 layout)
    "architectures": ["LlamaForCausalLM"], "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": True,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "torch_dtype": "bfloat16", "vocab_size": 128256}


def test_llama_32_config_and_rope_scaling_match_transformers():
    from specdec_ops.models import config_from_hf
    from specdec_ops.models.llama import rotary_inv_freq

    transformers = _transformers()
    config = config_from_hf(LLAMA_32_1B_CONFIG)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_size) == (16, 32, 8, 64)
    assert config.dtype == torch.bfloat16 and config.tie_word_embeddings and config.rope_theta == 500000.0
    assert config.eos_token_id == 128001 and config.eos_token_ids == (128001, 128008, 128009)
    hf_config = transformers.LlamaConfig(**{k: v for k, v in LLAMA_32_1B_CONFIG.items() if k != "architectures"})
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config)
    assert rotary.attention_scaling == 1.0
    torch.testing.assert_close(rotary_inv_freq(config).float(), rotary.inv_freq.float(), atol=0, rtol=1e-6)
    # Scaling matters here: the plain frequencies differ.
    plain = rotary_inv_freq(dataclasses.replace(config, rope_scaling=None)).float()
    assert (plain - rotary.inv_freq).abs().max() > 1e-4
    with pytest.raises(ValueError, match="`use_sliding_window`"):
        config_from_hf({**LLAMA_32_1B_CONFIG, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True})
    with pytest.raises(ValueError, match="missing config key `hidden_size`"):
        config_from_hf({k: v for k, v in LLAMA_32_1B_CONFIG.items() if k != "hidden_size"})


def test_vocab_mismatch_is_named():
    target = LlamaModel(LlamaConfig(vocab_size=100))
    check_draft_matches_target(target, LlamaModel(LlamaConfig(vocab_size=100)))
    with pytest.raises(ValueError, match="target's vocab_size is 100, the draft's is 99"):
        check_draft_matches_target(target, LlamaModel(LlamaConfig(vocab_size=99)))


def test_bad_configs_raise():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        LlamaConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="rope_scaling type 'yarn'"):
        LlamaConfig(rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="attention_backend"):
        LlamaModel(attention_backend="flash")


# --- the real model: SmolLM2-135M-Instruct (GGUF) ------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    try:
        path = smollm2_gguf_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    pytest.importorskip("gguf")
    transformers = _transformers()
    ours = load_model(path, dtype=torch.float32)
    tokenizer = load_tokenizer(path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    return ours, tokenizer, theirs


def test_gguf_tokenizer_of_another_vocabulary_is_refused(smollm2, monkeypatch):
    # What transformers < 5.6 does with SmolLM2's GGUF tokenizer (5 tokens more, another encoding), simulated.
    from transformers import PreTrainedTokenizerFast

    real = PreTrainedTokenizerFast.from_pretrained

    def with_extra_tokens(*args, **kwargs):
        tokenizer = real(*args, **kwargs)
        tokenizer.add_tokens(["<PRE>", "<MID>"], special_tokens=True)
        return tokenizer

    monkeypatch.setattr(PreTrainedTokenizerFast, "from_pretrained", with_extra_tokens)
    with pytest.raises(ValueError, match=r"built a tokenizer of 49154 tokens from .*, whose vocabulary has 49152 "
                       r"\(transformers before 5.6"):
        load_tokenizer(smollm2_gguf_path())


def test_gguf_tokenizer_takes_the_files_eos(smollm2, monkeypatch):
    # transformers 5.6 to 5.17 report SmolLM2's <|im_start|> (1) as its EOS; the file says <|im_end|> (2).
    from transformers import PreTrainedTokenizerFast

    real = PreTrainedTokenizerFast.from_pretrained

    def wrong_eos(*args, **kwargs):
        tokenizer = real(*args, **kwargs)
        tokenizer.eos_token = "<|im_start|>"
        return tokenizer

    monkeypatch.setattr(PreTrainedTokenizerFast, "from_pretrained", wrong_eos)
    tokenizer = load_tokenizer(smollm2_gguf_path())
    assert (tokenizer.eos_token_id, tokenizer.bos_token_id) == (2, 1)


def chat_ids(tokenizer, question):
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}]))


def greedy_paged(model, prompt, max_new_tokens, eos):
    """Our greedy generation: prefill through the paged path, then one-token decode steps."""
    runner = PagedRunner(model, num_rows=1, block_size=16, blocks_per_row=(len(prompt) + max_new_tokens) // 16 + 1)
    logits = runner.step([(0, len(prompt))], prompt)
    out = []
    while True:
        token = int(logits[-1].argmax())
        out.append(token)
        if token == eos or len(out) == max_new_tokens:
            return out
        logits = runner.step([(0, 1)], [token], uniform_query_len=1)


def test_smollm2_config_and_tokenizer(smollm2):
    ours, tokenizer, theirs = smollm2
    c = ours.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings and ours.lm_head is None and c.rope_theta == 100000.0
    assert tokenizer.vocab_size == 49152 and tokenizer.eos_token_id == 2
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in text
    assert tokenizer.decode(tokenizer.encode("Paris is nice.")) == "Paris is nice."
    # Spaces before punctuation survive (the file asks for the clean-up that transformers < 5.7 would apply).
    spaced = "Hello , world . It ' s n't"
    assert tokenizer.decode(tokenizer.encode(spaced, add_special_tokens=False)) == spaced


def test_tokenizer_from_a_checkpoint_directory(smollm2, tmp_path):
    # The GGUF's tokenizer saved as a Hugging Face directory (tokenizer.json + config) loads the same.
    _, tokenizer, _ = smollm2
    tokenizer._tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    again = load_tokenizer(tmp_path)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert again.apply_chat_template(messages) == tokenizer.apply_chat_template(messages)
    text = "Speculative decoding , exactly: 12 tokens/s -> 40 !"
    assert again.encode(text) == tokenizer.encode(text) and again.decode(again.encode(text)) == text
    assert (again.eos_token_id, again.vocab_size) == (tokenizer.eos_token_id, tokenizer.vocab_size)


def test_smollm2_logits_match_transformers(smollm2):
    ours, tokenizer, theirs = smollm2
    ids = chat_ids(tokenizer, "What is the capital of France?")
    with torch.no_grad():
        want = theirs(torch.tensor([ids])).logits[0]
        dense = ours.compute_logits(ours(torch.tensor(ids), torch.arange(len(ids))))
    torch.testing.assert_close(dense, want, atol=2e-3, rtol=0)
    runner = PagedRunner(ours, num_rows=2, block_size=16, blocks_per_row=4)
    paged = runner.step([(1, len(ids))], ids, num_pad_tokens=3)
    torch.testing.assert_close(paged, want, atol=2e-3, rtol=0)


@pytest.mark.parametrize("question,max_new,expected_text", [
    ("What is the capital of France?", 40, "The capital of France is Paris."),
    ("Write a short poem about the sea.", 40, None),
])
def test_smollm2_greedy_matches_transformers_generate(smollm2, question, max_new, expected_text):
    ours, tokenizer, theirs = smollm2
    ids = chat_ids(tokenizer, question)
    with torch.no_grad():
        want = theirs.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    want = want[0, len(ids):].tolist()
    got = greedy_paged(ours, ids, max_new, tokenizer.eos_token_id)
    text = tokenizer.decode(got, skip_special_tokens=True)
    assert got == want, f"ours: {text!r}\ntransformers: {tokenizer.decode(want, skip_special_tokens=True)!r}"
    if expected_text is not None:
        assert text.strip() == expected_text
    else:
        assert len(got) >= 32 and tokenizer.eos_token_id not in got[:32]


# --- CUDA ------------------------------------------------------------------------------------------------------


def fp32_copy(model):
    """The same weights in float32 (the exact reference for a bf16 model)."""
    copy = LlamaModel(dataclasses.replace(model.config, dtype=torch.float32), device="cuda", init_weights=False,
                      attention_backend="reference")
    with torch.no_grad():
        for a, b in zip(copy.parameters(), model.parameters()):
            a.copy_(b)
    return copy


def assert_bf16_close(got, reference_bf16, exact):
    """The Triton path's error against the float32 model is within twice the bf16 reference path's own error."""
    got, reference_bf16, exact = got.float(), reference_bf16.float(), exact.float()
    err_got = (got - exact).abs().max().item()
    err_ref = (reference_bf16 - exact).abs().max().item()
    assert err_got <= 2 * err_ref + 1e-3 * exact.abs().max().item(), (err_got, err_ref)
    assert (got.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9


def run_three(models, ids, positions, metadata, caches):
    """Logits of each model on its own copy of the caches (float32 caches for the float32 model)."""
    outs = []
    with torch.no_grad():
        for m in models:
            own = tuple(c.clone().to(m.config.dtype) for c in caches)
            outs.append(m.compute_logits(m(ids, positions, metadata._replace(kv_caches=own))))
    return outs


@pytest.mark.cuda
@pytest.mark.parametrize("query_len", [1, 5])
def test_cuda_triton_backend_compiled_graph_matches_reference(query_len):
    """bf16 model, paged forward + logits compiled fullgraph and captured in a CUDA graph: no cudagraph skips, no
    host sync during replay, Triton attention as accurate as the reference attention (against float32)."""
    from torch._dynamo.utils import counters

    config = LlamaConfig(vocab_size=1000, hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=2,
                         intermediate_size=512, dtype=torch.bfloat16, tie_word_embeddings=True)
    model = LlamaModel(config, device="cuda", seed=0, attention_backend="triton")
    reference = LlamaModel(config, device="cuda", seed=0, attention_backend="reference")
    exact = fp32_copy(model)
    runner = PagedRunner(model, num_rows=9, block_size=16, blocks_per_row=8, device="cuda")
    prompts = random_sequences(config.vocab_size)
    rows = [0, 3, 5, 8]
    # Ragged prefill, eager.
    caches_before = tuple(c.clone() for c in runner.kv_caches)
    positions, metadata = runner.metadata([(r, len(p)) for r, p in zip(rows, prompts)], num_pad_tokens=4)
    ids = torch.tensor([t for p in prompts for t in p] + [0] * 4, device="cuda")
    with torch.no_grad():
        got = model.compute_logits(model(ids, positions, metadata))  # writes the prefill KV into the runner's cache
    want_bf16, want_fp32 = run_three([reference, exact], ids, positions, metadata, caches_before)
    live = ids.shape[0] - 4
    assert_bf16_close(got[:live], want_bf16[:live], want_fp32[:live])
    # A decode- or verify-shaped step (query_len tokens per row, a padded row) as a static graph.
    positions, metadata = runner.metadata([(r, query_len) for r in rows], num_pad_tokens=query_len,
                                          uniform_query_len=query_len)
    ids = torch.randint(0, config.vocab_size, (positions.shape[0],), device="cuda")
    caches_before = tuple(c.clone() for c in runner.kv_caches)

    def step():
        return model.compute_logits(model(ids, positions, metadata))

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            compiled()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = compiled()
    with sync_forbidden():
        graph.replay()
        graph.replay()
    torch.cuda.synchronize()
    live = query_len * len(rows)
    want_bf16, want_fp32 = run_three([reference, exact], ids, positions, metadata, caches_before)
    assert_bf16_close(out[:live], want_bf16[:live], want_fp32[:live])

    # Inductor's own CUDA graphs (reduce-overhead) take the whole step: zero cudagraph skips.
    for buf in (*runner.kv_caches, ids, positions, metadata.slot_mapping, metadata.block_tables,
                metadata.token_rows, metadata.seq_lens):
        torch._dynamo.mark_static_address(buf)
    skips = counters["inductor"]["cudagraph_skips"]
    torch._dynamo.reset()
    reduce = torch.compile(step, fullgraph=True, dynamic=False, mode="reduce-overhead")
    for _ in range(3):
        reduce()
    with sync_forbidden():
        again = reduce()
    torch.cuda.synchronize()
    assert counters["inductor"]["cudagraph_skips"] == skips
    assert_bf16_close(again[:live], want_bf16[:live], want_fp32[:live])


def test_auto_attention_backend_choice():
    # auto: the Triton kernel on CUDA for float32/16/bf16 models; the reference on CPU and for float64 models.
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert LlamaModel(LlamaConfig(dtype=torch.float32))._backend(cuda) == "triton"
    assert LlamaModel(LlamaConfig(dtype=torch.bfloat16))._backend(cuda) == "triton"
    assert LlamaModel(LlamaConfig(dtype=torch.float64))._backend(cuda) == "reference"
    assert LlamaModel(LlamaConfig(dtype=torch.float32))._backend(cpu) == "reference"
    assert LlamaModel(attention_backend="triton")._backend(cpu) == "triton"

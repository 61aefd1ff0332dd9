"""DraftProposer: greedy drafts equal a cache-free reference over many rounds; eager == compiled; sampling; graphs.

One inductor compile of the reference model for the whole CPU module (module-scoped fixture, one padded size) and
one of the benchmark's null model: compiles are the slow part.
"""
import sys
from pathlib import Path

import pytest
import torch

import specdec_ops
from specdec_ops.models import DraftModel, DraftModelConfig
from support import SyntheticTarget, greedy_reference
from specdec_ops.models import AttentionMetadata, KVCacheSpec
from specdec_ops.runtime import BlockPool, DraftProposer, ProposerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from bench_propose import NullDraftModel  # noqa: E402  (the benchmark's stand-in model)


K = 3
# float64 so that paged vs dense attention cannot flip a near-tied argmax.
MODEL_CONFIG = DraftModelConfig(dtype=torch.float64)
PROPOSER_CONFIG = ProposerConfig(num_speculative_tokens=K, max_num_reqs=5, max_num_tokens=64, max_model_len=80,
                                 block_size=8, num_slots=8, num_blocks=90, batch_sizes=(5,), token_sizes=(64,))


@pytest.fixture(scope="module")
def model():
    return DraftModel(MODEL_CONFIG, seed=1)


@pytest.fixture(scope="module")
def eager(model):
    return DraftProposer(model, PROPOSER_CONFIG, device="cpu", compile=False)


@pytest.fixture(scope="module")
def compiled(model):
    return DraftProposer(model, PROPOSER_CONFIG, device="cpu", compile=True)


def expected_drafts(model, sim):
    return [greedy_reference(model, sim.true_sequence(slot), K) for slot in sim.batch_slots]


def test_greedy_drafts_match_cache_free_reference_eager_and_compiled(model, eager, compiled):
    from torch._dynamo.utils import counters

    sim = SyntheticTarget([eager, compiled], seed=0, vocab_size=MODEL_CONFIG.vocab_size)
    frames_before = counters["stats"]["unique_graphs"]
    batch_sizes, rejections, padded_tokens, longest_query = set(), set(), 0, 0
    for round_index in range(24):
        batch = sim.next_batch(ids_dtype=torch.int64 if round_index % 2 else torch.int32)
        n = len(sim.batch_slots)
        batch_sizes.add(n)
        rejections.update(batch["num_rejected"].tolist())
        padded_tokens += batch["input_ids"].shape[0] > int(batch["query_start_loc"][-1])
        longest_query = max(longest_query, int(batch["query_start_loc"].diff().max()))
        want = expected_drafts(model, sim)
        got_eager, probs = eager.propose(**batch)
        assert got_eager.shape == (n, K) and probs.shape == (n, K, MODEL_CONFIG.vocab_size)
        assert got_eager.tolist() == want, f"round {round_index}: eager drafts differ from the reference"
        # Greedy rows: probs are one-hot at the drafted token.
        assert torch.equal(probs.argmax(-1), got_eager) and torch.equal(probs.sum(-1), torch.ones(n, K))
        # After the first (compiling) call, a new num_reqs within the padded size must not recompile.
        with torch._dynamo.config.patch(error_on_recompile=round_index > 0):
            got_compiled, _ = compiled.propose(**batch)
        assert got_compiled.tolist() == want, f"round {round_index}: compiled drafts differ from the reference"
        sim.verify(got_eager.tolist())
    assert counters["stats"]["unique_graphs"] - frames_before == 1  # one graph for the one padded size
    # The simulation did exercise what it is meant to.
    assert len(batch_sizes) >= 3 and max(rejections) == K and 0 in rejections and padded_tokens > 0
    assert sim.num_joined > PROPOSER_CONFIG.num_slots and longest_query >= 20  # slots reused, long prompts
    # Blocks never handed out stay untouched: padded rows and tokens only ever write the null block.
    untouched = sorted(set(range(1, eager.num_blocks)) - sim.allocated)
    assert untouched, "test setup: some blocks should never be allocated"
    for proposer in (eager, compiled):
        for cache in proposer.kv_caches:
            blocks = cache.view(proposer.num_blocks, proposer.block_size, -1)
            assert blocks[untouched].eq(0).all()
        assert proposer.kv_caches[0].view(proposer.num_blocks, -1)[0].ne(0).any()  # the null block took padding


def test_sampled_drafts_follow_the_model_and_are_deterministic(model, eager, compiled):
    sim = SyntheticTarget([eager, compiled], seed=5, vocab_size=MODEL_CONFIG.vocab_size, leave_prob=0.0,
                          skip_prob=0.0)
    for _ in range(3):  # a few greedy rounds to build up state
        batch = sim.next_batch()
        drafts, _ = eager.propose(**batch)
        compiled.propose(**batch)
        sim.verify(drafts.tolist())
    batch = sim.next_batch()
    n = len(sim.batch_slots)
    assert n >= 3, "test setup: want greedy and random rows"
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.5, 2.0][:n])
    batch["temperature"] = temperature
    tokens, probs = (t.clone() for t in eager.propose(**batch))
    # Deterministic: the same round again (it rewrites the same KV) gives the same draws, compiled too.
    again, probs_again = eager.propose(**batch)
    assert torch.equal(tokens, again) and torch.equal(probs, probs_again)
    compiled_tokens, compiled_probs = compiled.propose(**batch)
    assert torch.equal(compiled_tokens, tokens)
    torch.testing.assert_close(compiled_probs, probs, atol=1e-6, rtol=0)
    # Tokens in range, rows are distributions that give the drawn token positive mass.
    assert tokens.ge(0).all() and tokens.lt(MODEL_CONFIG.vocab_size).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(n, K, dtype=torch.float32), atol=1e-5, rtol=0)
    assert probs.gather(2, tokens[:, :, None]).gt(0).all()
    # Each step's distribution is softmax(logits / T) of the cache-free model on the sequence so far.
    for row, slot in enumerate(sim.batch_slots):
        sequence = sim.true_sequence(slot)
        for step in range(K):
            context = sequence + tokens[row, :step].tolist()
            ids = torch.tensor(context)
            logits = model.compute_logits(model(ids, torch.arange(len(context)), None)[-1]).float()
            if temperature[row] > 0:
                want = torch.softmax(logits / temperature[row], -1)
            else:
                want = torch.nn.functional.one_hot(logits.argmax(), MODEL_CONFIG.vocab_size).float()
            torch.testing.assert_close(probs[row, step], want, atol=1e-6, rtol=1e-5)
    # Other seeds give other draws on the random rows.
    batch["seeds"] = batch["seeds"] + 1000
    reseeded, _ = eager.propose(**batch)
    random_rows = temperature > 0
    assert torch.equal(reseeded[~random_rows], tokens[~random_rows])
    assert not torch.equal(reseeded[random_rows], tokens[random_rows])


def test_round_copies_are_kept_per_size_and_bounded(model, monkeypatch):
    # propose() keeps its copy views per round size; with room for two sizes, rounds of many sizes must still
    # draft what the cache-free reference drafts, and a repeated round must reuse its size's entry.
    monkeypatch.setattr(specdec_ops.runtime.proposer, "MAX_CACHED_ROUND_SIZES", 2)
    proposer = DraftProposer(model, PROPOSER_CONFIG, device="cpu", compile=False)
    sim = SyntheticTarget([proposer], seed=3, vocab_size=MODEL_CONFIG.vocab_size)
    sizes = []
    for round_index in range(12):
        batch = sim.next_batch()
        sizes.append((len(sim.batch_slots), batch["input_ids"].shape[0]))
        drafts = proposer.propose(**batch)[0].tolist()
        assert drafts == expected_drafts(model, sim), f"round {round_index}"
        assert len(proposer._round_copies) <= 2
        # The same round again (it rewrites the same KV) reuses the entry its first call made.
        kept = dict(proposer._round_copies)
        assert proposer.propose(**batch)[0].tolist() == drafts
        assert kept.keys() == proposer._round_copies.keys()
        assert all(proposer._round_copies[key] is entry for key, entry in kept.items())
        sim.verify(drafts)
    assert len(set(sizes)) > 2, "test setup: want more sizes than the cache holds"


# --- inputs the proposer rejects --------------------------------------------------------


def small_batch(n, t):
    return dict(input_ids=torch.zeros(t, dtype=torch.int32), positions=torch.arange(t),
                query_start_loc=torch.linspace(0, t, n + 1).int(), seq_lens=torch.ones(n, dtype=torch.int32),
                idx_mapping=torch.arange(n, dtype=torch.int32), num_rejected=torch.zeros(n, dtype=torch.int32),
                last_sampled=torch.zeros(8, dtype=torch.int64), temperature=torch.zeros(n),
                seeds=torch.zeros(n, dtype=torch.int64))


def test_oversized_batches_are_rejected(eager):
    with pytest.raises(ValueError, match="num_reqs = 6 exceeds"):
        eager.propose(**small_batch(6, 12))
    with pytest.raises(ValueError, match="num_tokens = 65 exceeds"):
        eager.propose(**small_batch(2, 65))
    batch = small_batch(2, 4)
    batch["last_sampled"] = torch.zeros(9, dtype=torch.int64)
    with pytest.raises(ValueError, match="last_sampled has 9 entries"):
        eager.propose(**batch)


def test_bad_configuration_is_rejected(model):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        DraftProposer(model, ProposerConfig(0, 2, 8, 16), device="cpu", compile=False)
    with pytest.raises(ValueError, match="padded sizes"):
        DraftProposer(model, ProposerConfig(2, 2, 8, 16, batch_sizes=(4,)), device="cpu", compile=False)
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device"):
        DraftProposer(model, ProposerConfig(2, 2, 8, 16), device="cpu", cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs must be"):
        DraftProposer(model, ProposerConfig(2, 2, 8, 16), device="cpu", cuda_graphs="max-autotune")
    proposer = DraftProposer(model, ProposerConfig(2, 2, 8, 16, block_size=4), device="cpu", compile=False)
    with pytest.raises(ValueError, match="slot must lie in"):
        proposer.assign_blocks(2, [1])
    with pytest.raises(ValueError, match="at most blocks_per_req = 4"):
        proposer.assign_blocks(1, [1, 2, 3, 4, 5])


def test_without_probs(model):
    proposer = DraftProposer(model, PROPOSER_CONFIG, device="cpu", compile=False, with_probs=False)
    sim = SyntheticTarget([proposer], seed=9, vocab_size=MODEL_CONFIG.vocab_size)
    for _ in range(2):
        drafts, probs = proposer.propose(**sim.next_batch())
        assert probs is None
        assert drafts.tolist() == expected_drafts(model, sim)
        sim.verify(drafts.tolist())


def test_filtered_drafts(model):
    # Filters off: the same drafts and probabilities as the unfiltered sampler (the drafts' logits are float64,
    # cast to float32 for the filtered op, hence the tolerance). top_k = 1 at any temperature: the greedy drafts.
    plain = DraftProposer(model, PROPOSER_CONFIG, device="cpu", compile=False)
    filtered = DraftProposer(model, PROPOSER_CONFIG, device="cpu", compile=False, filters=True)
    sim = SyntheticTarget([plain, filtered], seed=5, vocab_size=MODEL_CONFIG.vocab_size)
    for _ in range(4):
        batch = sim.next_batch(temperature=0.9, seed_base=3)
        n = len(sim.batch_slots)
        off = dict(top_k=torch.zeros(n, dtype=torch.int64), top_p=torch.ones(n), min_p=torch.zeros(n))
        want, want_probs = (t.clone() for t in plain.propose(**batch))
        got, probs = filtered.propose(**batch, **off)
        assert got.tolist() == want.tolist()
        torch.testing.assert_close(probs, want_probs, atol=1e-6, rtol=0)
        sim.verify(got.tolist())
    greedy = DraftProposer(model, PROPOSER_CONFIG, device="cpu", compile=False, filters=True)
    sim = SyntheticTarget([greedy], seed=6, vocab_size=MODEL_CONFIG.vocab_size)
    for _ in range(4):
        batch = sim.next_batch(temperature=0.9)
        n = len(sim.batch_slots)
        drafts, probs = greedy.propose(**batch, top_k=torch.ones(n, dtype=torch.int32), top_p=torch.full((n,), 0.5),
                                       min_p=torch.zeros(n))
        assert drafts.tolist() == expected_drafts(model, sim)
        assert torch.equal(probs.argmax(-1), drafts) and torch.equal(probs.amax(-1), torch.ones(n, K))
        sim.verify(drafts.tolist())
    with pytest.raises(ValueError, match="argument 'top_k' is required: the proposer has filters=True"):
        greedy.propose(**batch)
    with pytest.raises(ValueError, match="argument 'top_p' must be a float tensor"):
        greedy.propose(**batch, top_k=torch.ones(n, dtype=torch.int32), top_p=torch.ones(n, dtype=torch.int64),
                       min_p=torch.zeros(n))
    with pytest.raises(ValueError, match="argument 'top_k' needs a proposer built with filters=True"):
        plain.propose(**batch, top_k=torch.ones(n, dtype=torch.int32))
    with pytest.raises(ValueError, match=rf"argument 'top_p' must have shape \[{n}\]"):  # not broadcast
        greedy.propose(**batch, top_k=torch.ones(n, dtype=torch.int32), top_p=torch.ones(n + 1), min_p=torch.zeros(n))
    with pytest.raises(ValueError, match="argument 'stream_offsets' needs a proposer built with round_streams=True"):
        plain.propose(**batch, stream_offsets=torch.zeros(n, dtype=torch.int64))


def test_padded_sizes_and_block_pool():
    proposer_sizes = DraftProposer(DraftModel(), ProposerConfig(2, 20, 100, 64), device="cpu", compile=False)
    assert proposer_sizes.batch_sizes == [1, 2, 4, 8, 16, 20]
    assert proposer_sizes.token_sizes == [16, 32, 64, 100]
    assert proposer_sizes.padded_sizes(5, 33) == (8, 64)
    pool = BlockPool(6, seed=3)
    blocks = pool.allocate(5)
    assert sorted(blocks) == [1, 2, 3, 4, 5]  # never the null block 0
    with pytest.raises(ValueError, match="1 blocks requested, 0 free"):
        pool.allocate(1)
    pool.release(blocks[:2])
    assert sorted(pool.allocate(2)) == sorted(blocks[:2])


def test_model_paged_attention_matches_dense_on_one_sequence(model):
    # One request, whole sequence in one step-0-like forward through the paged cache.
    tokens = torch.randint(0, MODEL_CONFIG.vocab_size, (21,))
    positions = torch.arange(21)
    block_size, blocks = 4, torch.tensor([7, 2, 5, 9, 1, 3])
    kv_caches = tuple(torch.zeros(10 * block_size, 2, 2, 16, dtype=torch.float64) for _ in range(2))
    slot_mapping = blocks[positions // block_size] * block_size + positions % block_size
    metadata = AttentionMetadata(kv_caches, slot_mapping, blocks[None], torch.zeros(21, dtype=torch.long),
                                 torch.full((21,), 21), block_size)
    paged = model(tokens, positions, metadata)
    dense = model(tokens, positions, None)
    torch.testing.assert_close(paged, dense, atol=1e-12, rtol=0)
    for cache in kv_caches:
        assert cache.view(10, block_size, -1)[[0, 4, 6, 8]].eq(0).all()  # blocks outside the table untouched
        assert cache.view(10, block_size, -1)[blocks].ne(0).any(-1).sum() == 21  # one slot per token


# --- the benchmark's null model (scripts/bench_propose.py) ---------------------------------


def test_null_model_reads_every_input():
    # If the stub ignored an input, compiled code would drop the proposer's work that produces it (dead code),
    # and the benchmark's null-model time would no longer cover all of the proposer's own cost.
    null = NullDraftModel(KVCacheSpec(2, 2, 16, torch.float32), 512)
    t, c = 6, 16
    gen = torch.Generator().manual_seed(0)
    inputs = dict(input_ids=torch.randint(0, 512, (t,), generator=gen, dtype=torch.int32),
                  positions=torch.randint(0, 64, (t,), generator=gen),
                  slot_mapping=torch.randint(0, 1000, (t,), generator=gen),
                  block_tables=torch.randint(0, 1000, (3, c), generator=gen),
                  token_rows=torch.randint(0, 3, (t,), generator=gen),
                  seq_lens=torch.randint(1, 64, (t,), generator=gen, dtype=torch.int32))

    def hidden(values):
        metadata = AttentionMetadata((), values["slot_mapping"], values["block_tables"], values["token_rows"],
                                     values["seq_lens"], 4)
        return null(values["input_ids"], values["positions"], metadata)

    base = hidden(inputs)
    assert base.shape == (t, 1) and base.dtype == torch.float32
    for name, value in inputs.items():
        bumped = value.clone()
        if name == "block_tables":
            bumped[torch.arange(3), value.argmax(1)] += 1  # raise each row's maximum
        elif name == "token_rows":
            bumped = (value + 1) % 3  # every token to another row
        else:
            bumped += 1
        assert not torch.equal(hidden({**inputs, name: bumped}), base), f"the null model ignores {name}"


def test_null_model_runs_through_the_proposer_eager_and_compiled():
    # What the GPU benchmark does, on CPU: the same stub in a DraftProposer, eager and compiled, for a few
    # rounds at temperature 0 and 0.8, so that an interface mismatch fails here and not on the H200.
    vocab = MODEL_CONFIG.vocab_size
    null = NullDraftModel(KVCacheSpec(2, 2, 16, torch.float32), vocab, seed=3)
    eager_null = DraftProposer(null, PROPOSER_CONFIG, device="cpu", compile=False)
    compiled_null = DraftProposer(null, PROPOSER_CONFIG, device="cpu", compile=True)
    row_argmax = set(null.logits_table.argmax(-1).tolist())
    sim = SyntheticTarget([eager_null, compiled_null], seed=11, vocab_size=vocab)
    for round_index in range(4):
        temperature = 0.8 if round_index % 2 else 0.0
        batch = sim.next_batch(temperature=temperature, seed_base=round_index)
        n = len(sim.batch_slots)
        drafts, probs = eager_null.propose(**batch)
        assert drafts.shape == (n, K) and drafts.dtype == torch.int64
        assert probs.shape == (n, K, vocab) and probs.dtype == torch.float32
        assert drafts.ge(0).all() and drafts.lt(vocab).all()
        torch.testing.assert_close(probs.sum(-1), torch.ones(n, K))
        if temperature == 0:  # greedy: every draft is the argmax of one row of the stub's logits table
            assert set(drafts.flatten().tolist()) <= row_argmax
        compiled_drafts, compiled_probs = compiled_null.propose(**batch)
        assert torch.equal(compiled_drafts, drafts)  # exact: the stub's logits are table rows
        torch.testing.assert_close(compiled_probs, probs, atol=1e-6, rtol=0)
        sim.verify(drafts.tolist())


# --- CUDA --------------------------------------------------------------------------------------

CUDA_CONFIG = ProposerConfig(num_speculative_tokens=K, max_num_reqs=6, max_num_tokens=64, max_model_len=80,
                             block_size=8, num_slots=9, num_blocks=100, batch_sizes=(4, 6), token_sizes=(64,))


@pytest.mark.cuda
def test_cuda_graph_replay_matches_eager_and_reference():
    model = DraftModel(MODEL_CONFIG, device="cuda", seed=2)
    eager = DraftProposer(model, CUDA_CONFIG, device="cuda", compile=False, cuda_graphs=False)
    graphed = DraftProposer(model, CUDA_CONFIG, device="cuda")  # compiled, manual CUDA graphs
    assert graphed.manual_graphs
    sim = SyntheticTarget([eager, graphed], seed=11, vocab_size=MODEL_CONFIG.vocab_size)
    sizes_seen = set()
    for round_index in range(20):
        batch = sim.next_batch(device="cuda")
        n, t = len(sim.batch_slots), batch["input_ids"].shape[0]
        size = graphed.padded_sizes(n, t)
        want = expected_drafts(model, sim)
        got_eager, _ = eager.propose(**batch)
        captured = size in graphed.graphs
        torch.cuda.set_sync_debug_mode("error" if captured else 0)  # capture syncs; replays must not
        try:
            with torch._dynamo.config.patch(error_on_recompile=captured):
                got, probs = graphed.propose(**batch)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        sizes_seen.add(size)
        assert got_eager.tolist() == want and got.tolist() == want, f"round {round_index}"
        assert torch.equal(probs.argmax(-1), got)
        sim.verify(got.tolist())
    assert set(graphed.graphs) == sizes_seen and len(sizes_seen) == 2  # one CUDA graph per padded size


@pytest.mark.cuda
def test_cuda_reduce_overhead_records_without_skips_or_recompiles():
    from torch._dynamo.utils import counters

    counters.clear()
    model = DraftModel(MODEL_CONFIG, device="cuda", seed=3)
    eager = DraftProposer(model, CUDA_CONFIG, device="cuda", compile=False, cuda_graphs=False)
    graphed = DraftProposer(model, CUDA_CONFIG, device="cuda", cuda_graphs="reduce-overhead")
    sim = SyntheticTarget([eager, graphed], seed=13, vocab_size=MODEL_CONFIG.vocab_size)
    calls_per_size = {}
    for round_index in range(16):
        batch = sim.next_batch(device="cuda")
        size = graphed.padded_sizes(len(sim.batch_slots), batch["input_ids"].shape[0])
        calls_per_size[size] = calls_per_size.get(size, 0) + 1
        got_eager, _ = eager.propose(**batch)
        warm = calls_per_size[size] > 2  # call 1 compiles and warms up, call 2 records
        torch.cuda.set_sync_debug_mode("error" if warm else 0)
        try:
            with torch._dynamo.config.patch(error_on_recompile=calls_per_size[size] > 1):
                got, _ = graphed.propose(**batch)
                got = got.clone()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert got.tolist() == got_eager.tolist() == expected_drafts(model, sim), f"round {round_index}"
        sim.verify(got.tolist())
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert counters["stats"]["unique_graphs"] == len(calls_per_size)  # one graph per padded size


@pytest.mark.cuda
def test_cuda_sampled_drafts_are_deterministic_and_normalized():
    model = DraftModel(MODEL_CONFIG, device="cuda", seed=4)
    graphed = DraftProposer(model, CUDA_CONFIG, device="cuda")
    sim = SyntheticTarget([graphed], seed=15, vocab_size=MODEL_CONFIG.vocab_size, leave_prob=0.0)
    batch = sim.next_batch(device="cuda")
    n = len(sim.batch_slots)
    batch["temperature"] = torch.linspace(0.0, 1.5, n, device="cuda")
    tokens, probs = (t.clone() for t in graphed.propose(**batch))
    again, _ = graphed.propose(**batch)
    assert torch.equal(tokens, again)
    assert tokens.ge(0).all() and tokens.lt(MODEL_CONFIG.vocab_size).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(n, K, device="cuda"), atol=1e-5, rtol=0)

"""Generator: speculative output equals target-only output (greedy) for every k with requests joining and leaving;
compiled == eager; rejection sampling and block verification keep the target's distribution, with and without
top-k / top-p / min-p (chi-square, with negative controls); typical acceptance; EOS / max tokens / max_model_len
stops; slot and block reuse; the generated tokens' log-probabilities against a dense reference; bad inputs.

Models are the random-weight reference `DraftModel` in float64 (paged vs dense attention and verify vs decode
shapes cannot flip an argmax). The draft is the target's first layer(s) (shared modules); the target's later layers
are damped so that drafts are often accepted and whole rounds (bonus token included) occur.
"""
import dataclasses
import math

import pytest
import torch

from specdec_ops.models import DraftModel, DraftModelConfig
from specdec_ops.ops.logits_sampling import Processed, processed_distribution
from specdec_ops.runtime.generator import Generator, GeneratorConfig, Request
from support import greedy_reference, prefix_draft

CONFIG = DraftModelConfig(num_layers=3, dtype=torch.float64)


def damped_target(config: DraftModelConfig, seed: int, keep_layers: int, scale: float, device="cpu") -> DraftModel:
    """A random target whose layers past `keep_layers` add `scale` times their usual residual update."""
    model = DraftModel(config, seed=seed, device=device)
    with torch.no_grad():
        for layer in model.layers[keep_layers:]:
            layer.attn.o_proj.weight.mul_(scale)
            layer.down_proj.weight.mul_(scale)
    return model


@pytest.fixture(scope="module")
def target():
    return damped_target(CONFIG, seed=1, keep_layers=1, scale=0.3)


@pytest.fixture(scope="module")
def draft(target):
    return prefix_draft(target, 1)


def mixed_requests(seed: int, count: int, *, vocab: int = CONFIG.vocab_size, **kwargs) -> list[Request]:
    gen = torch.Generator().manual_seed(seed)
    requests = []
    for _ in range(count):
        prompt_len = int(torch.randint(1, 21, (), generator=gen))
        max_new = int(torch.randint(1, 14, (), generator=gen))
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        requests.append(Request(prompt, max_new, **kwargs))
    return requests


def small_config(k: int, **kwargs) -> GeneratorConfig:
    values = dict(num_speculative_tokens=k, max_num_reqs=3, max_model_len=64, block_size=4, batch_sizes=(2, 3),
                  read_every=2)
    values.update(kwargs)
    return GeneratorConfig(**values)


@pytest.fixture(scope="module")
def joined_requests(target):
    """7 requests through 3 slots (they join and leave), their cache-free greedy continuations, and the
    target-only generator's output (no cap binds: max_model_len 64 > prompt + new tokens + 8)."""
    requests = mixed_requests(11, 7)
    want = [greedy_reference(target, r.prompt_ids, r.max_new_tokens) for r in requests]
    plain = Generator(target, None, small_config(1), device="cpu", compile=False).generate(requests)
    return requests, want, plain


def test_target_only_equals_the_cache_free_reference(joined_requests):
    requests, want, plain = joined_requests
    assert [r.token_ids for r in plain.requests] == want
    assert plain.metrics.mean_emitted_per_round == 1.0 and plain.metrics.acceptance_rate is None
    assert plain.metrics.generated_tokens == sum(r.max_new_tokens for r in requests)


@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_speculative_equals_target_only(target, draft, joined_requests, k):
    requests, want, plain = joined_requests
    spec = Generator(target, draft, small_config(k), device="cpu", compile=False).generate(requests)
    for index in range(len(requests)):
        assert spec.requests[index].token_ids == plain.requests[index].token_ids == want[index], \
            f"speculative k={k}, request {index}"
        assert spec.requests[index].finish_reason == "max_tokens"
    metrics = spec.metrics
    assert metrics.generated_tokens == sum(r.max_new_tokens for r in requests)
    assert len(metrics.acceptance_per_position) == k
    # Per request: its rounds add up to the row-rounds; its acceptance is its own share.
    assert sum(r.num_rounds for r in spec.requests) == metrics.row_rounds
    assert all(r.num_rounds >= -(-(len(r.token_ids) - 1) // (k + 1)) for r in spec.requests)
    rates = [r.acceptance_rate for r in spec.requests if r.num_rounds]
    assert min(rates) <= metrics.acceptance_rate <= max(rates) and min(rates) < max(rates)
    assert [r.num_rounds for r in plain.requests] == [len(r.token_ids) - 1 for r in plain.requests]
    assert all(r.acceptance_rate is None for r in plain.requests)
    # The damped target accepts the prefix draft often, so the test covers accepted and rejected drafts.
    assert 0.3 < metrics.acceptance_rate < 1.0
    assert metrics.mean_emitted_per_round > 1.0
    assert all(a >= b for a, b in zip(metrics.acceptance_per_position, metrics.acceptance_per_position[1:]))


@pytest.fixture(scope="module")
def float32_pair():
    """The damped target and its one-layer draft in float32, and 7 requests through 3 slots with their
    target-only output."""
    target = damped_target(dataclasses.replace(CONFIG, dtype=torch.float32), seed=1, keep_layers=1, scale=0.3)
    requests = mixed_requests(11, 7)
    plain = Generator(target, None, small_config(1), device="cpu", compile=False).generate(requests)
    return target, prefix_draft(target, 1), requests, plain


@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_speculative_equals_target_only_in_float32(float32_pair, k):
    # In float32 the verify forward (k + 1 tokens per request) and the decode forward (1) sum in other orders,
    # which no argmax of these models is close enough to notice.
    target, draft, requests, plain = float32_pair
    spec = Generator(target, draft, small_config(k), device="cpu", compile=False).generate(requests)
    assert [r.token_ids for r in spec.requests] == [r.token_ids for r in plain.requests]
    assert 0.3 < spec.metrics.acceptance_rate < 1.0


def test_full_acceptance_emits_the_bonus_token(target):
    # The draft is the target itself: every draft is accepted, every round emits k + 1 tokens (until the cap).
    k = 3
    requests = [Request([5, 6, 7], 12), Request([9], 8)]
    out = Generator(target, target, small_config(k), device="cpu", compile=False).generate(requests)
    for request, result in zip(requests, out.requests):
        assert result.token_ids == greedy_reference(target, request.prompt_ids, request.max_new_tokens)
    assert out.metrics.acceptance_rate == 1.0 and out.metrics.acceptance_per_position == [1.0] * k


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "block-filtered"])
def test_compiled_equals_eager_without_recompiling(target, draft, sampling):
    # One padded size, so one compile per generator; the live batch changes from round to round within it.
    # "block-filtered": block verification, every request sampled with its own filters (one greedy).
    k = 3
    config = small_config(k, batch_sizes=(3,), logprobs="raw")
    requests = mixed_requests(20, 6)
    if sampling:
        config = dataclasses.replace(config, method="block", sampling_filters=True, logprobs="processed")
        requests = [dataclasses.replace(r, temperature=0.0 if i == 0 else 0.7 + 0.1 * i, seed=i, top_k=(0, 8)[i % 2],
                                        top_p=(1.0, 0.9, 0.7)[i % 3], min_p=0.02 * (i % 2))
                    for i, r in enumerate(requests)]
    eager = Generator(target, draft, config, device="cpu", compile=False).generate(requests)
    compiled = Generator(target, draft, config, device="cpu", compile=True)
    compiled.warm_up()
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = compiled.generate(requests)
    assert [r.token_ids for r in out.requests] == [r.token_ids for r in eager.requests]
    assert out.metrics.acceptance_per_position == eager.metrics.acceptance_per_position
    for got, want_lp in zip(out.requests, eager.requests):
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want_lp.logprobs), atol=1e-5, rtol=0)
    plain = Generator(target, None, config, device="cpu", compile=True)
    plain.warm_up()
    with torch._dynamo.config.patch(error_on_recompile=True):
        plain_out = plain.generate(requests)
    # Greedy: the speculative output is the target-only one; sampled, the target-only path's own eager output.
    want = eager if not sampling else Generator(target, None, config, device="cpu", compile=False).generate(requests)
    assert [r.token_ids for r in plain_out.requests] == [r.token_ids for r in want.requests]
    for got, want_lp in zip(plain_out.requests, want.requests):
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want_lp.logprobs), atol=1e-5, rtol=0)


def test_eos_max_tokens_and_length_stop_independently(target, draft):
    k = 2
    prompt_a, prompt_b = [3, 4, 5], [11, 12]
    ref_a = greedy_reference(target, prompt_a, 10)
    eos = ref_a[3]
    ref_b = greedy_reference(target, prompt_b, 10)
    # A token that request b does not produce within 10 tokens, and that a produces first at index 3.
    assert eos not in ref_b and eos not in ref_a[:3], "test setup: pick other prompts"
    config = small_config(k, max_model_len=24)
    requests = [
        Request(prompt_a, 10, eos_token_id=eos),  # stops at its EOS
        Request(prompt_b, 10, eos_token_id=eos),  # runs to max tokens
        Request(list(range(1, 16)), 30),  # max_model_len - k = 22 caps it at 7 new tokens
        Request(prompt_a, 1),  # finishes at its first token
        Request(prompt_b, 5, eos_token_id=ref_b[0]),  # its first token is its EOS
    ]
    out = Generator(target, draft, config, device="cpu", compile=False).generate(requests)
    a, b, c, d, e = out.requests
    assert a.token_ids == ref_a[:4] and a.finish_reason == "eos"
    assert b.token_ids == ref_b and b.finish_reason == "max_tokens"
    assert c.token_ids == greedy_reference(target, list(range(1, 16)), 7) and c.finish_reason == "length"
    assert d.token_ids == ref_a[:1] and d.finish_reason == "max_tokens"
    assert e.token_ids == ref_b[:1] and e.finish_reason == "eos"
    plain = Generator(target, None, config, device="cpu", compile=False).generate(requests)
    assert [r.token_ids for r in plain.requests] == [r.token_ids for r in out.requests]
    assert [r.finish_reason for r in plain.requests] == [r.finish_reason for r in out.requests]


@pytest.mark.parametrize("draft_model", [False, True])
def test_several_eos_ids_stop_at_the_first_of_them(target, draft, draft_model):
    # eos_token_id as a list (Llama 3 ends a turn with any of three ids): the request stops at the first
    # generated token that is any of them, in any round column, at its first token too; [] stops at none.
    requests = mixed_requests(23, 8)
    refs = [greedy_reference(target, r.prompt_ids, r.max_new_tokens) for r in requests]
    unused = next(t for t in range(CONFIG.vocab_size) if all(t not in ref for ref in refs))
    with_later = [i for i, ref in enumerate(refs) if len(set(ref)) > 3]
    assert len(with_later) >= 3, "test setup: pick other requests"
    for index in with_later[:3]:  # a later id listed first, the third token's id second
        ref = refs[index]
        later = next(t for t in ref[3:] if t not in ref[:3])
        requests[index].eos_token_id = [unused, later, ref[2]]
    first_stop = next(i for i in range(len(requests) - 1) if i not in with_later[:3])
    requests[first_stop].eos_token_id = (unused, refs[first_stop][0])  # stops at its first token
    requests[-1].eos_token_id = []
    want, reasons = [], []
    for request, ref in zip(requests, refs):
        ids = request.eos_token_id if isinstance(request.eos_token_id, (list, tuple)) else []
        stop = next((i for i, t in enumerate(ref) if t in ids), None)
        want.append(ref if stop is None else ref[: stop + 1])
        reasons.append("max_tokens" if stop is None else "eos")
    assert reasons.count("eos") == 4 and len(want[first_stop]) == 1
    config = small_config(2, max_model_len=64)
    out = Generator(target, draft if draft_model else None, config, device="cpu", compile=False).generate(requests)
    assert [r.token_ids for r in out.requests] == want
    assert [r.finish_reason for r in out.requests] == reasons


class RecordingGenerator(Generator):
    """Checks, at every admission, that no two live requests share a block and that the new slot was free."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.admissions = []

    def _admit(self, slots, requests):
        live = {s: self.block_table.blocks(s) for s in range(self.num_slots) if self.block_table.blocks(s)}
        assert not set(slots) & set(live), f"slots {slots} admitted while one still holds blocks"
        assert len(set(slots)) == len(slots)
        live_blocks = [b for blocks in live.values() for b in blocks]
        assert len(live_blocks) == len(set(live_blocks))
        super()._admit(slots, requests)
        new_blocks = [b for slot in slots for b in self.block_table.blocks(slot)]
        assert len(new_blocks) == len(set(new_blocks)), "two admitted requests share a block"
        assert not set(new_blocks) & set(live_blocks), "a new request got a live request's block"
        self.admissions.extend((slot, tuple(self.block_table.blocks(slot))) for slot in slots)


def test_slot_and_block_reuse_keeps_live_requests_intact(target, draft):
    k = 3
    requests = mixed_requests(7, 10)
    generator = RecordingGenerator(target, draft, small_config(k, batch_sizes=(3,), max_model_len=256), device="cpu",
                                   compile=False)
    out = generator.generate(requests)
    for index, request in enumerate(requests):
        assert out.requests[index].token_ids == greedy_reference(target, request.prompt_ids, request.max_new_tokens)
    slots = [slot for slot, _ in generator.admissions]
    assert len(slots) == 10 and set(slots) == {0, 1, 2}  # every slot reused
    assert generator.pool.num_free == generator.num_blocks - 1  # every block given back
    # Blocks never handed out were never written: rounds of idle or padded rows write only the null block.
    used = {b for _, blocks in generator.admissions for b in blocks}
    untouched = sorted(set(range(1, generator.num_blocks)) - used)
    assert untouched, "test setup: some blocks should stay unused"
    for cache in generator.kv_caches + generator.proposer.kv_caches:
        assert cache.view(generator.num_blocks, generator.block_size, -1)[untouched].eq(0).all()


@pytest.mark.parametrize("read_every, overlap", [(1, False), (1, True), (3, True), (5, False), (5, True)])
def test_overlapped_host_loop_gives_the_same_outputs(target, draft, read_every, overlap):
    # 9 requests through 3 slots (joins and leaves), some stopping at an EOS mid-group, one at its first token:
    # whether the host runs a group behind the device, and how many rounds a group holds, changes nothing.
    k = 2
    requests = mixed_requests(41, 9)
    refs = [greedy_reference(target, r.prompt_ids, r.max_new_tokens) for r in requests]
    for index in [i for i, ref in enumerate(refs) if len(ref) > 3 and i != 7][:3]:  # stop at their 3rd token's
        requests[index].eos_token_id = refs[index][2]  # first occurrence
    requests[7].eos_token_id = refs[7][0]  # stops at its first token
    want = []
    for request, ref in zip(requests, refs):
        eos = request.eos_token_id
        want.append(ref[: ref.index(eos) + 1] if eos is not None else ref)
    config = small_config(k, read_every=read_every, overlap=overlap, max_model_len=64)
    out = Generator(target, draft, config, device="cpu", compile=False).generate(requests)
    assert [r.token_ids for r in out.requests] == want
    for request, result in zip(requests, out.requests):
        stopped_at_eos = request.eos_token_id is not None and result.token_ids[-1] == request.eos_token_id
        assert result.finish_reason == ("eos" if stopped_at_eos else "max_tokens")
    assert sum(r.finish_reason == "eos" for r in out.requests) >= 2
    plain = Generator(target, None, config, device="cpu", compile=False).generate(requests)
    assert [r.token_ids for r in plain.requests] == want


@pytest.mark.parametrize("speculative, read_every, overlap", [(True, 1, True), (True, 3, False), (False, 2, True)])
def test_stream_gives_each_requests_tokens_in_order(target, draft, speculative, read_every, overlap):
    # 9 requests through 3 slots, two stopping at an EOS: each request's streamed pieces, in order, are its
    # output, a piece per host read that saw new tokens, never empty; long requests arrive in several pieces.
    requests = mixed_requests(41, 9)
    refs = [greedy_reference(target, r.prompt_ids, r.max_new_tokens) for r in requests]
    for index in [i for i, ref in enumerate(refs) if len(ref) > 3][:2]:
        requests[index].eos_token_id = refs[index][2]
    pieces = {i: [] for i in range(len(requests))}
    finished_before = []

    def stream(index, token_ids):
        assert token_ids, "an empty piece"
        pieces[index].append(list(token_ids))

    def progress(new_tokens, finished):
        finished_before.append(finished)

    config = small_config(2, read_every=read_every, overlap=overlap)
    out = Generator(target, draft if speculative else None, config, device="cpu", compile=False).generate(
        requests, progress=progress, stream=stream)
    for index, result in enumerate(out.requests):
        assert [t for piece in pieces[index] for t in piece] == result.token_ids
    longest = max(range(len(requests)), key=lambda i: len(out.requests[i].token_ids))
    assert len(out.requests[longest].token_ids) >= 8 and len(pieces[longest]) >= 2
    assert sum(r.finish_reason == "eos" for r in out.requests) == 2
    assert finished_before[-1] == len(requests)


@pytest.mark.parametrize("speculative", [True, False])
def test_stream_can_end_requests_early(target, draft, speculative):
    # The callback ends some requests at their 5th token (a stop string, a cancelled client) and one at once
    # (keep 0): those keep exactly what it said; the others, some of which take the freed slots while the
    # ended rows' rounds are still queued, are unaffected; every block comes back.
    requests = mixed_requests(41, 9)
    refs = [greedy_reference(target, r.prompt_ids, r.max_new_tokens) for r in requests]
    cut = {i: 5 for i, ref in enumerate(refs) if len(ref) > 6 and i % 2 == 0}
    cut[next(i for i in range(len(requests)) if i not in cut and len(refs[i]) > 1)] = 0
    assert len(cut) >= 3, "test setup: pick other requests"
    seen = {i: 0 for i in range(len(requests))}

    def stream(index, token_ids):
        before, seen[index] = seen[index], seen[index] + len(token_ids)
        if index in cut and seen[index] >= cut[index]:
            return cut[index] - before
        return None

    generator = Generator(target, draft if speculative else None, small_config(2, read_every=2), device="cpu",
                          compile=False)
    reported = []
    out = generator.generate(requests, stream=stream, progress=lambda new_tokens, finished: reported.append(new_tokens))
    assert min(reported) >= 0 and sum(reported) == sum(len(r.token_ids) for r in out.requests)
    for index, (ref, result) in enumerate(zip(refs, out.requests)):
        if index in cut:
            assert result.token_ids == ref[:cut[index]] and result.finish_reason == "stop"
        else:
            assert result.token_ids == ref and result.finish_reason == "max_tokens"
    assert generator.pool.num_free == generator.num_blocks - 1 and not generator.active.any()
    # One slot: the second request is admitted (its first token written) before a snapshot shows it; ended at
    # once, it never counted in the progress.
    one_slot = Generator(target, draft if speculative else None, small_config(2, max_num_reqs=1, batch_sizes=(1,)),
                         device="cpu", compile=False)
    reported = []
    out = one_slot.generate([Request([1, 2, 3], 40, eos_token_id=151), Request([4, 5, 6], 10)],
                            stream=lambda i, ids: 0 if i else None,
                            progress=lambda new_tokens, finished: reported.append(new_tokens))
    first, second = out.requests
    assert second.token_ids == [] and first.finish_reason == "eos"  # it stops mid-group
    assert min(reported) >= 0 and sum(reported) == len(first.token_ids)
    with pytest.raises(ValueError, match=r"stream returned 99 for requests\[0\]; expected None or an int"):
        generator.generate(requests, stream=lambda index, token_ids: 99)
    assert [r.token_ids for r in generator.generate(requests).requests] == refs


class Interrupted(Exception):
    pass


def test_generator_runs_again_after_an_interrupted_generate(target, draft):
    # A progress callback that raises (a cancelled client, Ctrl-C) while requests are live and groups are in
    # flight: the generator gives every block back and stops every row, and the next generate is exact.
    requests = mixed_requests(3, 5)
    want = [greedy_reference(target, r.prompt_ids, r.max_new_tokens) for r in requests]
    generator = Generator(target, draft, small_config(2), device="cpu", compile=False)

    def progress(new_tokens, finished):
        raise Interrupted

    def stream(index, token_ids):
        raise Interrupted

    for callbacks in (dict(progress=progress), dict(stream=stream)):
        with pytest.raises(Interrupted):
            generator.generate(requests, **callbacks)
        assert generator.pool.num_free == generator.num_blocks - 1 and not generator.active.any()
        assert [r.token_ids for r in generator.generate(requests).requests] == want


def test_warm_up_refuses_while_requests_are_live(target, draft):
    # The guard reads the host's record of admitted requests (their blocks), so that warm_up (and so generate)
    # never waits for the device. A request whose first token is its EOS is stopped on the device at once, but
    # it holds its blocks until the host retires it, so warm_up still refuses (the device flags alone would let
    # it through). A retirement, or an abandoned generate, frees it again.
    generator = Generator(target, draft, small_config(2), device="cpu", compile=False)
    generator.warm_up()
    prompt = [5, 6, 7]
    first = greedy_reference(target, prompt, 1)[0]
    for request in (Request(prompt, 4), Request(prompt, 4, eos_token_id=first)):
        generator._admit([0], [generator._prepare(0, request)])
        assert bool(generator.active[0]) == (request.eos_token_id is None)
        with pytest.raises(RuntimeError, match="requests are live; warm up before generating"):
            generator.warm_up()
        generator._retire(0)
        generator.warm_up()
    generator._admit([1], [generator._prepare(0, Request(prompt, 4))])
    generator._abandon()
    generator.warm_up()


class _Replay:
    """Stands in for a captured prefill graph on the CPU: replay() reruns the recorded forward into its output."""

    def __init__(self, forward):
        self.forward, self.out = forward, forward()

    def replay(self):
        self.out.copy_(self.forward())


class EmulatedPrefillGraphs(Generator):
    """The CUDA-graph prefill path (`_prefill_replayed`: static buffers, padding, chunks) run eagerly on the CPU;
    records the blocks handed out."""

    def _allocate_state(self, blocks_per_req):
        self.cuda_graphs = True  # the prefill buffers and graphs; the rounds keep the runner made without graphs
        self.handed_out = set()
        super()._allocate_state(blocks_per_req)

    def _admit(self, slots, requests):
        super()._admit(slots, requests)
        self.handed_out.update(b for slot in slots for b in self.block_table.blocks(slot))

    def _prefill_graph(self, name, size):
        if (name, size) not in self._prefill_graphs:
            model, kv_caches = self._model(name)

            def forward():
                return self._prefill_forward(model, kv_caches, self._prefill_block_rows, self._prefill_ids[:size],
                                             self._prefill_positions[:size], self._prefill_rows[:size])

            graph = _Replay(forward)
            self._prefill_graphs[(name, size)] = (graph, graph.out)
        return self._prefill_graphs[(name, size)]


def test_prefill_graph_replays_pad_into_the_null_block(target, draft, monkeypatch, joined_requests):
    # Graphs of 2, 4 and 8 tokens: every admission's packed prompts (up to 3 requests, prompts of 1 to 20 tokens)
    # span several chunks of the largest graph, requests straddle chunks, the last chunk is padded.
    from specdec_ops.runtime import generator as generator_module

    requests, want, _ = joined_requests
    requests = requests + [Request([7], 3), Request([8], 2)]  # one-token prompts: no draft prefill tokens
    want = want + [greedy_reference(target, [7], 3), greedy_reference(target, [8], 2)]
    monkeypatch.setattr(generator_module, "PREFILL_CHUNK_CUDA", 8)
    monkeypatch.setattr(generator_module, "PREFILL_MIN_GRAPH", 2)
    for model_draft in (draft, None):
        generator = EmulatedPrefillGraphs(target, model_draft, small_config(2, max_model_len=256), device="cpu",
                                          compile=False)
        out = generator.generate(requests)
        assert [r.token_ids for r in out.requests] == want
        names = ("target", "draft") if model_draft is not None else ("target",)
        assert set(generator._prefill_graphs) == {(n, s) for n in names for s in (2, 4, 8)}
        # Padding tokens (and the warm-up runs) write only the null block: blocks never handed out stay zero.
        untouched = sorted(set(range(1, generator.num_blocks)) - generator.handed_out)
        assert untouched, "test setup: some blocks should stay unused"
        caches = generator.kv_caches + (generator.proposer.kv_caches if model_draft is not None else ())
        for cache in caches:
            assert cache.view(generator.num_blocks, generator.block_size, -1)[untouched].eq(0).all()


def test_target_only_runs_no_round_past_the_last_token(target):
    # One token per live row and round: the host sizes every group from what the requests still need, so a
    # request of n new tokens (the first from its prefill) takes exactly n - 1 rounds, however groups fall.
    for read_every in (1, 4, 7):
        config = small_config(1, read_every=read_every, batch_sizes=(3,))
        out = Generator(target, None, config, device="cpu", compile=False).generate([Request([1, 2, 3], 17)])
        assert len(out.requests[0].token_ids) == 17
        assert out.metrics.rounds == 16 and out.metrics.row_rounds == 16
        metrics = out.metrics
        assert 0.0 <= metrics.admission_share <= metrics.host_share <= 1.0
        assert 0.0 < metrics.launch_s < metrics.wall_s  # the rounds' calls, inside the call's wall time
        # On the CPU the device is the host: it waits outside the round calls and the admissions.
        assert metrics.device_wait_share == pytest.approx(metrics.host_share - metrics.admission_share, abs=1e-9)


def test_typical_acceptance_runs_and_stops(target, draft):
    k = 3
    requests = mixed_requests(30, 6)
    for index, request in enumerate(requests):
        request.temperature = 0.0 if index % 2 == 0 else 0.8
        request.seed = index
    out = Generator(target, draft, small_config(k, method="typical"), device="cpu", compile=False).generate(requests)
    again = Generator(target, draft, small_config(k, method="typical"), device="cpu", compile=False).generate(requests)
    for index, (request, result) in enumerate(zip(requests, out.requests)):
        assert len(result.token_ids) == request.max_new_tokens and result.finish_reason == "max_tokens"
        assert all(0 <= t < CONFIG.vocab_size for t in result.token_ids)
        if request.temperature == 0:  # one-hot target probabilities: typical acceptance is greedy
            assert result.token_ids == greedy_reference(target, request.prompt_ids, request.max_new_tokens)
        assert again.requests[index].token_ids == result.token_ids  # seeded: deterministic
    assert 0 < out.metrics.acceptance_rate <= 1


# --- rejection sampling keeps the target's distribution ------------------------------------------------

TINY = DraftModelConfig(vocab_size=6, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                        intermediate_size=32, dtype=torch.float64)
PROMPT = [1, 4, 2]
NEW_TOKENS = 4
SAMPLES = 1500


# Filters that each cut something from TINY's 6-token rows at temperature 1 (top-k alone keeps 4 tokens).
FILTERS = dict(top_k=4, top_p=0.8, min_p=0.1)


def exact_marginals(model, prompt, steps, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """P(token at generated position j = v) for j < steps under target-only sampling from the processed
    distribution (temperature, then the filters), by enumerating prefixes."""
    params = (torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))
    marginals, frontier = [], {(): 1.0}
    for _ in range(steps):
        marginal = torch.zeros(model.vocab_size, dtype=torch.float64)
        next_frontier = {}
        for prefix, weight in frontier.items():
            sequence = prompt + list(prefix)
            hidden = model(torch.tensor(sequence), torch.arange(len(sequence)), None)
            # float32 logits, as the generator's rounds take them
            logits = model.compute_logits(hidden[-1]).float()[None]
            probs = processed_distribution(logits, *params)[0].double()
            marginal += weight * probs
            for token in range(model.vocab_size):
                if probs[token] > 0:
                    next_frontier[prefix + (token,)] = weight * float(probs[token])
        marginals.append(marginal)
        frontier = next_frontier
    return marginals


def chi_square_pvalues(model, outputs, temperature, **filters):
    from scipy.stats import chisquare

    pvalues = []
    for position, marginal in enumerate(exact_marginals(model, PROMPT, NEW_TOKENS, temperature, **filters)):
        counts = torch.bincount(torch.tensor([o.token_ids[position] for o in outputs]), minlength=model.vocab_size)
        expected = marginal * len(outputs)
        # A token the filters cut has probability 0: any count of it fails the test outright.
        if bool((counts[marginal == 0] > 0).any()):
            pvalues.append(0.0)
            continue
        keep = expected >= 5  # pool the rare tokens into one bin
        observed = torch.cat([counts[keep].double(), counts[~keep].sum().double().view(1)])
        expected = torch.cat([expected[keep], expected[~keep].sum().view(1)])
        if expected[-1] < 5:
            observed, expected = observed[:-1], expected[:-1]
            expected = expected * observed.sum() / expected.sum()
        pvalues.append(float(chisquare(observed.numpy(), expected.numpy()).pvalue))
    return pvalues


class OffByOneGenerator(Generator):
    """A wrong sampler: draft i is verified against the draft distribution of position i - 1 (an indexing bug).

    (Ignoring the draft probabilities altogether would not do: treating the draft as a point mass is itself a
    valid proposal, and the output keeps the target's distribution.)"""

    def _verify_part(self, batch, active, inputs, drafts, draft_probs, logits):
        super()._verify_part(batch, active, inputs, drafts, draft_probs.roll(1, dims=1), logits)


class UnfilteredVerifyGenerator(Generator):
    """A wrong sampler: the draft and the target-only path apply the filters, verification does not (the filters
    never reach the verifier), so what it emits follows the unfiltered target distribution."""

    def _verify_part(self, batch, active, inputs, drafts, draft_probs, logits):
        saved = self.top_k.clone(), self.top_p.clone(), self.min_p.clone()
        self.top_k.zero_(), self.top_p.fill_(1.0), self.min_p.zero_()
        try:
            super()._verify_part(batch, active, inputs, drafts, draft_probs, logits)
        finally:
            for buffer, value in zip((self.top_k, self.top_p, self.min_p), saved):
                buffer.copy_(value)


def sampling_run(method: str, filters: dict, generator_class=Generator, draft=True):
    """SAMPLES requests of PROMPT at temperature 1 through TINY (an unrelated draft: acceptance well below 1,
    so residual draws matter): (target, output)."""
    target = DraftModel(TINY, seed=3)
    requests = [Request(PROMPT, NEW_TOKENS, temperature=1.0, seed=1000 + i, **filters) for i in range(SAMPLES)]
    config = GeneratorConfig(num_speculative_tokens=3, method=method, max_num_reqs=64, max_model_len=16,
                             block_size=4, batch_sizes=(64,), read_every=2, sampling_filters=bool(filters))
    model_draft = DraftModel(TINY, seed=4) if draft else None
    return target, generator_class(target, model_draft, config, device="cpu", compile=False).generate(requests)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["rejection", "block"])
@pytest.mark.parametrize("filters", [{}, FILTERS], ids=["no-filters", "top-k+top-p+min-p"])
def test_sampling_matches_the_target_distribution(method, filters):
    target, out = sampling_run(method, filters)
    assert all(len(o.token_ids) == NEW_TOKENS for o in out.requests)
    assert 0.2 < out.metrics.acceptance_rate < 0.95
    pvalues = chi_square_pvalues(target, out.requests, 1.0, **filters)
    assert min(pvalues) > 1e-3, f"speculative samples differ from the target's distribution: p = {pvalues}"
    _, plain = sampling_run(method, filters, draft=False)
    assert min(chi_square_pvalues(target, plain.requests, 1.0, **filters)) > 1e-3
    # Negative controls: the same test rejects a sampler with an off-by-one in the draft probabilities, and one
    # whose verification drops the filters.
    wrong_class = UnfilteredVerifyGenerator if filters else OffByOneGenerator
    _, wrong = sampling_run(method, filters, wrong_class)
    assert min(chi_square_pvalues(target, wrong.requests, 1.0, **filters)) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("filters", [{}, FILTERS], ids=["no-filters", "top-k+top-p+min-p"])
def test_block_verification_accepts_at_least_as_many_drafts(filters):
    # In expectation block verification accepts at least as many drafts per round as token-wise; 1500 requests
    # give a standard error of about 0.02 tokens per round on each mean.
    _, tokenwise = sampling_run("rejection", filters)
    _, block = sampling_run("block", filters)
    print(f"mean emitted per round: token-wise {tokenwise.metrics.mean_emitted_per_round:.3f}, "
          f"block {block.metrics.mean_emitted_per_round:.3f}")
    assert block.metrics.mean_emitted_per_round >= tokenwise.metrics.mean_emitted_per_round - 0.06


@pytest.mark.parametrize("method", ["rejection", "block"])
def test_block_verification_never_reuses_a_draft_random_number(target, draft, monkeypatch, method):
    # Block verification's stop point depends on every draft of the round, so a later round drafting with the
    # same random numbers would propose from a distribution skewed by that outcome: each live draft draw of a
    # request must have its own stream position. Token-wise rounds draft at the positions they continue from,
    # which repeat across rounds (the outcome never depends on the drafts after the first rejection).
    from specdec_ops.runtime.proposer import DraftProposer

    draws = []
    original = DraftProposer._draw_positions

    def recording(self, inputs, positions, step):
        drawn = original(self, inputs, positions, step)
        live = inputs.idx_mapping < self.num_slots
        draws.extend(zip(inputs.seeds[live].tolist(), drawn[live].tolist()))
        return drawn

    monkeypatch.setattr(DraftProposer, "_draw_positions", recording)
    requests = [dataclasses.replace(r, max_new_tokens=20, temperature=0.8, seed=100 + i)
                for i, r in enumerate(mixed_requests(12, 5))]
    out = Generator(target, draft, small_config(3, method=method), device="cpu", compile=False).generate(requests)
    assert out.metrics.rounds > 8 and len(draws) > 60
    repeated = len(draws) - len(set(draws))
    assert (repeated == 0) if method == "block" else (repeated > 0), repeated


@pytest.mark.parametrize("method", ["rejection", "block"])
def test_verification_streams_advance_per_round(target, draft, monkeypatch, method):
    # Block verification runs the block verifier at offsets 0, k + 1, 2 (k + 1), .. of each request (a new request
    # in a used slot starts at 0 again); token-wise rejection sampling at its drafts' positions.
    from specdec_ops.runtime import generator as generator_module

    k, calls = 3, []
    original = generator_module.rejection_sample_logits

    def recording(*args, **kwargs):
        calls.append((kwargs["block_verification"], args[6].tolist(), args[7].tolist()))  # seeds, offsets
        return original(*args, **kwargs)

    monkeypatch.setattr(generator_module, "rejection_sample_logits", recording)
    requests = [dataclasses.replace(r, temperature=0.8, seed=100 + i) for i, r in enumerate(mixed_requests(13, 6))]
    Generator(target, draft, small_config(k, method=method), device="cpu", compile=False).generate(requests)
    assert calls and all(block == (method == "block") for block, _, _ in calls)
    offsets = {}  # seed -> the offsets its row was verified at, in order (a finished row repeats its last one)
    for _, seeds, row_offsets in calls:
        for seed, offset in zip(seeds, row_offsets):
            if seed >= 100:
                offsets.setdefault(seed, []).append(offset)
    assert len(offsets) == len(requests) and any(len(set(o)) > 2 for o in offsets.values())
    for seed, seen in offsets.items():
        distinct = sorted(set(seen))
        if method == "block":
            assert distinct == [i * (k + 1) for i in range(len(distinct))], (seed, seen)
        else:
            assert distinct[0] == len(requests[seed - 100].prompt_ids) + 1, (seed, seen)  # the first draft's position


@pytest.mark.parametrize("method", ["rejection", "block"])
def test_top_k_1_and_min_p_1_sample_the_greedy_continuation(target, draft, joined_requests, method):
    # top_k = 1 (or min_p = 1) keeps only the most probable token: at any temperature the output is the greedy
    # continuation, so the filters must reach the first token, the draft and the verifier alike. The draft then
    # proposes its argmax, so the acceptance counts equal greedy verification's.
    requests, want, _ = joined_requests
    config = small_config(3, method=method, sampling_filters=True)
    greedy = Generator(target, draft, small_config(3), device="cpu", compile=False).generate(requests)
    for filters in (dict(top_k=1), dict(min_p=1.0, top_p=0.5)):
        sampled = [dataclasses.replace(r, temperature=0.9, seed=7 + i, **filters) for i, r in enumerate(requests)]
        out = Generator(target, draft, config, device="cpu", compile=False).generate(sampled)
        assert [r.token_ids for r in out.requests] == want, filters
        assert out.metrics.acceptance_per_position == greedy.metrics.acceptance_per_position
        plain = Generator(target, None, config, device="cpu", compile=False).generate(sampled)
        assert [r.token_ids for r in plain.requests] == want, filters


# --- bad inputs ---------------------------------------------------------------------------------------------


def reference_logprobs(model, request: Request, token_ids: list[int], mode: str) -> torch.Tensor:
    """float32 [n]: the log-probabilities of a request's generated tokens from one dense cache-free forward over
    its prompt and tokens: raw (log_softmax of the logits) or processed (the `Processed` reference)."""
    device = model.embed_tokens.weight.device
    ids = torch.tensor(list(request.prompt_ids) + token_ids, device=device)
    with torch.no_grad():
        logits = model.compute_logits(model(ids, torch.arange(len(ids), device=device))).float().cpu()
    rows, tokens = logits[len(request.prompt_ids) - 1: -1], torch.tensor(token_ids)
    if mode == "raw":
        return torch.log_softmax(rows, dim=-1).gather(1, tokens[:, None])[:, 0]
    n = len(token_ids)
    processed = Processed(rows[:, None], torch.full((n,), float(request.temperature)), torch.full((n,), request.top_k),
                          torch.full((n,), float(request.top_p)), torch.full((n,), float(request.min_p)))
    return processed.logprob(0, tokens)


def logprob_requests(method: str, seed: int = 31) -> list[Request]:
    """6 mixed requests; for the sampled methods one greedy and five sampled ones, with filters where the method
    takes them."""
    requests = mixed_requests(seed, 6)
    if method == "greedy":
        return requests
    filters = method in ("rejection", "block")
    return [dataclasses.replace(r, temperature=0.0 if i == 1 else 0.6 + 0.2 * (i % 3), seed=i,
                                **(dict(top_k=(0, 12)[i % 2], top_p=(1.0, 0.85)[i % 2 == 0 and i > 0],
                                        min_p=0.02 * (i % 3)) if filters else {}))
            for i, r in enumerate(requests)]


def assert_logprobs_match(model, requests, outputs, mode):
    for index, (request, result) in enumerate(zip(requests, outputs)):
        assert len(result.logprobs) == len(result.token_ids)
        want = reference_logprobs(model, request, result.token_ids, mode)
        torch.testing.assert_close(torch.tensor(result.logprobs), want, atol=1e-5, rtol=0,
                                   msg=lambda m: f"request {index}: {m}")
        if mode == "processed" and request.temperature == 0:
            assert result.logprobs == [0.0] * len(result.token_ids)  # greedy: one-hot
        elif mode == "raw":
            assert all(value < 0 for value in result.logprobs)
        else:  # a filter can leave one token: log 1 = 0
            assert all(value <= 0 for value in result.logprobs)


# Target-only generation has no verifier: its "rejection" run covers "block" too.
@pytest.mark.parametrize("method, speculative", [(m, True) for m in ("greedy", "rejection", "block", "typical")]
                         + [(m, False) for m in ("greedy", "rejection", "typical")])
@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_logprobs_match_a_dense_reference(target, draft, method, mode, speculative):
    # Requests join and leave 3 slots; sampled methods mix greedy and sampled requests, with filters where the
    # method takes them, so every path that writes a logprob runs: the first token, accepted drafts, substitutes
    # and bonus tokens (the verifier's own logprobs for rejection sampling's processed mode), target-only rounds.
    config = small_config(3, method=method, sampling_filters=method in ("rejection", "block"), logprobs=mode)
    requests = logprob_requests(method)
    out = Generator(target, draft if speculative else None, config, device="cpu", compile=False).generate(requests)
    assert [len(r.token_ids) for r in out.requests] == [r.max_new_tokens for r in requests]
    assert_logprobs_match(target, requests, out.requests, mode)


@pytest.mark.parametrize("method", ["greedy", "rejection"])
def test_logprobs_at_eos_and_length_stops(target, draft, method):
    # A request stopping at an EOS mid-round (its EOS's logprob included), one whose first token is its EOS, and
    # caps from max_model_len: the logprobs end where the tokens do.
    config = small_config(3, method=method, sampling_filters=method == "rejection", logprobs="processed",
                          max_model_len=24)
    for model_draft in (draft, None):
        generator = Generator(target, model_draft, config, device="cpu", compile=False)
        requests = [dataclasses.replace(r, prompt_ids=r.prompt_ids[:12], max_new_tokens=12)
                    for r in logprob_requests(method, seed=41)]
        # Seeded: the same tokens up to where an EOS stops them (sampled speculative output is not target-only's).
        free = generator.generate(requests).requests
        requests[0].eos_token_id = free[0].token_ids[2]
        requests[3].eos_token_id = free[3].token_ids[0]
        out = generator.generate(requests).requests
        assert out[0].finish_reason == "eos" and out[0].token_ids[-1] == requests[0].eos_token_id
        assert out[3].finish_reason == "eos" and len(out[3].token_ids) == 1
        assert "length" in [r.finish_reason for r in out]
        assert_logprobs_match(target, requests, out, "processed")


def test_no_logprobs_unless_asked(target, draft):
    out = Generator(target, draft, small_config(3), device="cpu", compile=False).generate([Request([1, 2], 3)])
    assert out.requests[0].logprobs is None


def test_bad_requests_and_configs_are_refused(target, draft):
    generator = Generator(target, draft, small_config(2), device="cpu", compile=False)
    rejection = Generator(target, draft, small_config(2, method="rejection"), device="cpu", compile=False)
    filtered = Generator(target, draft, small_config(2, method="block", sampling_filters=True), device="cpu",
                         compile=False)
    cases = [
        (generator, Request(torch.tensor([1.0, 2.0]), 4), "integer token ids"),
        (generator, Request(torch.tensor([1, 2], device="meta"), 4), "must be on the CPU or on cpu"),
        (generator, Request([1, 2.5], 4), r"prompt_ids\[1\] must be an int"),
        (generator, Request([], 4), "empty"),
        (generator, Request([1, CONFIG.vocab_size], 4), "outside the vocabulary"),
        (generator, Request(list(range(62)), 4), "holds at most 61"),
        (generator, Request([1], 0), "max_new_tokens must be an int >= 1"),
        (rejection, Request([1], 4, temperature=-0.5), "temperature must be a finite number >= 0"),
        (rejection, Request([1], 4, temperature=math.nan), "temperature must be a finite number >= 0"),
        (generator, Request([1], 4, temperature=0.7), "method 'greedy' verifies by argmax"),
        (generator, Request([1], 4, seed=-1), "seed must be an int"),
        (generator, Request([1], 4, eos_token_id=CONFIG.vocab_size), "eos_token_id must be None, an int"),
        (generator, Request([1], 4, eos_token_id=[3, -1]), "eos_token_id must be None, an int"),
        (generator, Request([1], 4, eos_token_id=[3, True]), "eos_token_id must be None, an int"),
        (generator, Request([1], 4, eos_token_id=list(range(9))), "a list or tuple of at most 8 such ints"),
        (generator, Request([1], 4, eos_token_id="2"), "eos_token_id must be None, an int"),
        (filtered, Request([1], 4, top_k=-1), r"top_k must be an int >= 0"),
        (filtered, Request([1], 4, top_k=2.0), r"top_k must be an int >= 0"),
        (filtered, Request([1], 4, top_p=0.0), r"top_p must be a number in \(0, 1\]"),
        (filtered, Request([1], 4, top_p=1.5), r"top_p must be a number in \(0, 1\]"),
        (filtered, Request([1], 4, top_p=math.nan), r"top_p must be a number in \(0, 1\]"),
        (filtered, Request([1], 4, min_p=-0.1), r"min_p must be a number in \[0, 1\]"),
        (filtered, Request([1], 4, min_p=2.0), r"min_p must be a number in \[0, 1\]"),
        (rejection, Request([1], 4, temperature=0.5, top_k=5), "built without filters"),
    ]
    for gen, request, message in cases:
        with pytest.raises(ValueError, match=message):
            gen.generate([Request([1, 2], 2), request])
    with pytest.raises(ValueError, match="num_speculative_tokens must be an int >= 1"):
        Generator(target, draft, small_config(0), device="cpu")
    with pytest.raises(ValueError, match="method must be one of"):
        Generator(target, draft, small_config(2, method="beam"), device="cpu")
    with pytest.raises(ValueError, match="posterior_threshold must be a finite number"):
        Generator(target, draft, small_config(2, posterior_threshold=-1.0), device="cpu")
    with pytest.raises(ValueError, match="posterior_alpha must be a finite number"):
        Generator(target, draft, small_config(2, posterior_alpha=True), device="cpu")
    with pytest.raises(ValueError, match="batch_sizes"):
        Generator(target, draft, small_config(2, batch_sizes=(4,)), device="cpu")
    for sizes in ((2.5, 3), (True, 3), "3"):  # not silently truncated (2.5 -> 2, True -> 1, "3" -> chars)
        with pytest.raises(ValueError, match=r"config.batch_sizes\[0\] must be an int"):
            Generator(target, draft, small_config(2, batch_sizes=sizes), device="cpu")
    with pytest.raises(ValueError, match="config.read_every must be an int >= 1"):
        Generator(target, draft, small_config(2, read_every=0), device="cpu")
    with pytest.raises(ValueError, match="config.overlap must be a bool"):
        Generator(target, draft, small_config(2, overlap=1), device="cpu")
    with pytest.raises(ValueError, match="config.sampling_filters must be a bool"):
        Generator(target, draft, small_config(2, sampling_filters="yes"), device="cpu")
    with pytest.raises(ValueError, match="config.logprobs must be one of"):
        Generator(target, draft, small_config(2, logprobs="yes"), device="cpu")
    with pytest.raises(ValueError, match="method 'typical' takes the temperature only"):
        Generator(target, draft, small_config(2, method="typical", sampling_filters=True), device="cpu")
    other_vocab = DraftModel(dataclasses.replace(CONFIG, vocab_size=100))
    with pytest.raises(ValueError, match="draft vocab_size 100 != target vocab_size 512"):
        Generator(target, other_vocab, small_config(2), device="cpu")
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device"):
        Generator(target, draft, small_config(2), device="cpu", cuda_graphs=True)


# --- CUDA -----------------------------------------------------------------------------------------------------


def cuda_models():
    config = dataclasses.replace(CONFIG, dtype=torch.float32)
    target = damped_target(config, seed=1, keep_layers=1, scale=0.3, device="cuda")
    return target, prefix_draft(target, 1)


@pytest.mark.cuda
def test_cuda_one_graph_per_size_no_recompiles_and_greedy_identity():
    target, draft = cuda_models()
    config = small_config(3, max_num_reqs=4, batch_sizes=(2, 4), max_model_len=64)
    requests = mixed_requests(5, 9)
    wants = [greedy_reference(target, r.prompt_ids, r.max_new_tokens) for r in requests]
    # The first two requests of 4 tokens or more stop at an EOS (their 3rd token's first occurrence), mid-group.
    for index in [i for i, want in enumerate(wants) if len(want) > 3][:2]:
        requests[index].eos_token_id = wants[index][2]
        wants[index] = wants[index][: wants[index].index(wants[index][2]) + 1]
    outputs = {}
    for name, model_draft in (("speculative", draft), ("target-only", None)):
        generator = Generator(target, model_draft, config, device="cuda")
        generator.warm_up()
        assert set(generator.runner.graphs) == {(2,), (4,)}  # one CUDA graph per padded size, whole round
        with torch._dynamo.config.patch(error_on_recompile=True):
            outputs[name] = generator.generate(requests)
            # The same graphs with the host waiting for every single round: the same outputs.
            generator.config = dataclasses.replace(config, read_every=1, overlap=False)
            outputs[name + ", synchronous"] = generator.generate(requests)
        assert set(generator.runner.graphs) == {(2,), (4,)}  # the live batch changed; nothing was re-recorded
    for index, want in enumerate(wants):
        got = {name: out.requests[index].token_ids for name, out in outputs.items()}
        assert got["target-only"] == want, f"request {index}: target-only != the dense cache-free reference"
        assert all(tokens == want for tokens in got.values()), f"request {index}: {got} != {want}"
    assert outputs["speculative"].metrics.acceptance_rate > 0.3
    metrics = outputs["speculative"].metrics
    assert 0.0 <= metrics.admission_share <= metrics.host_share
    # Admissions queued ahead of the device count as its work: the wait lies between the two shares.
    assert metrics.host_share - metrics.admission_share - 1e-9 <= metrics.device_wait_share <= metrics.host_share


@pytest.mark.cuda
@pytest.mark.parametrize("k", range(1, 9))
def test_cuda_greedy_speculative_equals_target_only_for_every_k(k):
    """fp32 on CUDA, compiled and graph-replayed: 7 requests of mixed lengths through 3 slots (joining and leaving)
    give the dense cache-free reference's greedy tokens, speculative at this k and target-only alike."""
    target, draft = cuda_models()
    requests = mixed_requests(11, 7)
    wants = [greedy_reference(target, r.prompt_ids, r.max_new_tokens) for r in requests]
    config = small_config(k, batch_sizes=(3,))
    outputs = {name: Generator(target, model_draft, config, device="cuda").generate(requests)
               for name, model_draft in (("speculative", draft), ("target-only", None))}
    for name, out in outputs.items():
        assert [r.token_ids for r in out.requests] == wants, f"k={k}, {name}"
    assert 0.3 < outputs["speculative"].metrics.acceptance_rate < 1.0  # accepted and rejected drafts both occur


@pytest.mark.cuda
def test_cuda_many_refills_keep_outputs_exact():
    # Many requests with long prompts and few new tokens through 3 slots: most admissions queue behind rounds the
    # host has not read yet and reuse the blocks of requests that just stopped. The dense cache-free reference
    # fixes every token.
    target, draft = cuda_models()
    gen = torch.Generator().manual_seed(3)
    requests = [Request(torch.randint(0, CONFIG.vocab_size, (int(torch.randint(30, 50, (), generator=gen)),),
                                      generator=gen).tolist(), int(torch.randint(1, 7, (), generator=gen)))
                for _ in range(18)]
    wants = [greedy_reference(target, r.prompt_ids, r.max_new_tokens) for r in requests]
    config = small_config(3, max_num_reqs=3, batch_sizes=(3,), read_every=1)
    for model_draft in (draft, None):
        generator = Generator(target, model_draft, config, device="cuda")
        generator.warm_up()
        for _ in range(2):
            out = generator.generate(requests)
            assert [r.token_ids for r in out.requests] == wants


@pytest.mark.cuda
def test_cuda_rounds_do_not_sync():
    from conftest import sync_forbidden

    target, draft = cuda_models()
    generator = Generator(target, draft, small_config(3, max_num_reqs=4, batch_sizes=(4,)), device="cuda")
    generator.warm_up()
    requests = [Request([3 + i] * (1 + 3 * i), 20) for i in range(4)]
    prepared = [generator._prepare(i, r) for i, r in enumerate(requests)]
    torch.cuda.synchronize()
    with sync_forbidden():  # admission (prefills, first tokens, device state) and the rounds: no host sync
        generator._admit(list(range(4)), prepared)
        for _ in range(6):
            generator.runner.run(4)
    torch.cuda.synchronize()
    plain = Generator(target, None, small_config(3, max_num_reqs=4, batch_sizes=(4,)), device="cuda")
    want = plain.generate([Request(r.prompt_ids, 20) for r in requests]).requests
    for slot, request in enumerate(requests):
        length = int(generator.length[slot])
        got = generator.tokens_2d[slot, len(request.prompt_ids):length].tolist()
        assert len(got) > 6 and got == want[slot].token_ids[:len(got)], f"slot {slot}"


@pytest.mark.cuda
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "rejection-filters-logprobs-stream"])
def test_cuda_generate_with_refills_does_not_sync(sampled):
    # The whole host loop (admissions into freed slots, retirements, round groups, snapshot reads, the stream
    # callback, the metrics) waits for the device only on events, which the sync debug mode does not flag, and
    # on the explicit synchronize at its end: a retirement that synced once made the host drain the device before
    # every refill.
    from conftest import sync_forbidden

    target, draft = cuda_models()
    requests = mixed_requests(7, 6)
    extra = {}
    if sampled:
        requests = [dataclasses.replace(r, temperature=0.8, seed=i, top_k=20, top_p=0.9) for i, r in
                    enumerate(requests)]
        extra = dict(method="rejection", sampling_filters=True, logprobs="processed")
    for model_draft in (draft, None):
        generator = Generator(target, model_draft, small_config(3, max_num_reqs=2, batch_sizes=(2,), **extra),
                              device="cuda")
        generator.warm_up()
        want = generator.generate(requests)  # JIT-compiles the admissions' eager kernels
        streamed = [[] for _ in requests]
        with sync_forbidden():
            got = generator.generate(requests, stream=lambda index, ids: streamed[index].extend(ids))
        assert [r.token_ids for r in got.requests] == [r.token_ids for r in want.requests]  # seeded
        assert streamed == [r.token_ids for r in got.requests]
        assert got.metrics.generated_tokens == want.metrics.generated_tokens > 0


@pytest.mark.cuda
def test_cuda_bf16_rounds_of_more_than_16_tokens_take_the_elementwise_kernels_without_sync(monkeypatch):
    """bf16 models, 8 slots, k = 3: the round's verify forward has 32 tokens, so the compiled round runs the
    layers' elementwise kernels (elementwise.py) around cuBLAS; its graph replays with no host sync and every
    request's first token (from the shared prefill path) equals target-only generation's. bf16 verify and decode
    round differently, so later tokens are only checked to be in the vocabulary."""
    from conftest import sync_forbidden
    from specdec_ops.models import llama as llama_mod

    traced = []
    original = llama_mod.DecoderLayer.forward_deferred_residual
    monkeypatch.setattr(llama_mod.DecoderLayer, "forward_deferred_residual",
                        lambda self, *a: traced.append(torch.compiler.is_compiling()) or original(self, *a))
    config = dataclasses.replace(CONFIG, dtype=torch.bfloat16)
    target = damped_target(config, seed=1, keep_layers=1, scale=0.3, device="cuda")
    draft = prefix_draft(target, 1)
    generator = Generator(target, draft, small_config(3, max_num_reqs=8, batch_sizes=(8,)), device="cuda")
    generator.warm_up()
    assert any(traced), "the compiled round's 32-token verify forward did not take the elementwise kernels"
    requests = [Request([3 + i] * (2 + 2 * i), 12) for i in range(8)]
    prepared = [generator._prepare(i, r) for i, r in enumerate(requests)]
    torch.cuda.synchronize()
    with sync_forbidden():
        generator._admit(list(range(8)), prepared)
        for _ in range(4):
            generator.runner.run(8)
    torch.cuda.synchronize()
    plain = Generator(target, None, small_config(3, max_num_reqs=8, batch_sizes=(8,)), device="cuda")
    want = plain.generate(requests).requests
    for slot, request in enumerate(requests):
        length = int(generator.length[slot])
        got = generator.tokens_2d[slot, len(request.prompt_ids):length].tolist()
        assert len(got) > 4 and got[0] == want[slot].token_ids[0], f"slot {slot}"
        assert all(0 <= token < config.vocab_size for token in got)


@pytest.mark.cuda
@pytest.mark.parametrize("method", ["rejection", "block"])
def test_cuda_filtered_sampling_one_graph_no_recompiles_no_sync(method):
    from conftest import sync_forbidden

    target, draft = cuda_models()
    config = small_config(3, method=method, sampling_filters=True, max_num_reqs=4, batch_sizes=(4,),
                          logprobs="processed")
    requests = mixed_requests(8, 6)
    wants = [greedy_reference(target, r.prompt_ids, r.max_new_tokens) for r in requests]
    # Even requests: top_k = 1 at a positive temperature, which is the greedy continuation; odd ones: all filters.
    sampled = [dataclasses.replace(r, temperature=0.9, seed=i, top_k=1) if i % 2 == 0 else
               dataclasses.replace(r, temperature=0.8, seed=i, top_k=20, top_p=0.9, min_p=0.05)
               for i, r in enumerate(requests)]
    generator = Generator(target, draft, config, device="cuda")
    generator.warm_up()
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = generator.generate(sampled)
        again = generator.generate(sampled)
    assert set(generator.runner.graphs) == {(4,)}
    for index, (request, result) in enumerate(zip(sampled, out.requests)):
        assert again.requests[index].token_ids == result.token_ids  # seeded: the same tokens
        assert len(result.token_ids) == request.max_new_tokens
        want_logprobs = reference_logprobs(target, request, result.token_ids, "processed").cpu()
        torch.testing.assert_close(torch.tensor(result.logprobs), want_logprobs, atol=1e-4, rtol=0)
        if index % 2 == 0:
            assert result.token_ids == wants[index], f"request {index}"
            assert result.logprobs == [0.0] * len(result.token_ids)  # top_k = 1: one-hot
    prepared = [generator._prepare(i, r) for i, r in enumerate(sampled[:4])]
    torch.cuda.synchronize()
    with sync_forbidden():  # admission and the rounds: no host sync
        generator._admit(list(range(4)), prepared)
        for _ in range(4):
            generator.runner.run(4)
    torch.cuda.synchronize()


# --- the command ----------------------------------------------------------------------------------------------


def test_command_json_on_the_random_model(capsys):
    import json

    from specdec_ops.generate import main

    argv = ["--target", "random", "--prompt-ids", "1,2,3", "--prompt-ids", "4,5,6,7,8", "--prompt-ids", "9",
            "--max-new-tokens", "6", "--k", "2", "--draft-layers", "2", "--batch-sizes", "2", "--json"]
    assert main(argv) == 0
    document = json.loads(capsys.readouterr().out)
    assert [r["prompt_token_ids"] for r in document["requests"]] == [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    for entry in document["requests"]:
        assert len(entry["token_ids"]) == 6 and entry["finish_reason"] == "max_tokens"
        assert entry["matches_target_only"] and entry["text"] == " ".join(map(str, entry["token_ids"]))
        assert entry["num_rounds"] >= 2 and 0 <= entry["acceptance_rate"] <= 1
    assert document["speculative"]["generated_tokens"] == 18 == document["target_only"]["generated_tokens"]
    assert len(document["speculative"]["acceptance_per_position"]) == 2
    assert document["config"]["method"] == "greedy" and document["config"]["batch_sizes"] == [2]
    # Sampling with the filters, verified by block verification: top_k = 1 keeps only the argmax, so the output
    # is still the greedy one.
    assert "logprobs" not in document["requests"][0]
    # ... and the logprobs of the processed distribution: 0 for each token, since top_k = 1 makes it one-hot.
    assert main(argv + ["--temperature", "0.8", "--top-k", "1", "--top-p", "0.9", "--method", "block",
                        "--logprobs", "processed"]) == 0
    sampled = json.loads(capsys.readouterr().out)
    assert sampled["config"]["method"] == "block" and sampled["config"]["top_k"] == 1
    assert [r["token_ids"] for r in sampled["requests"]] == [r["token_ids"] for r in document["requests"]]
    assert [r["logprobs"] for r in sampled["requests"]] == [[0.0] * 6] * 3


def test_command_stops_on_the_tokenizers_and_the_checkpoints_eos_ids():
    from types import SimpleNamespace

    from specdec_ops.generate import _eos_ids
    from specdec_ops.runtime.generator import decode_generated

    target = SimpleNamespace(vocab_size=100, config=SimpleNamespace(eos_token_ids=(5, 9, 2, 100)))
    tokenizer = SimpleNamespace(eos_token_id=2, decode=lambda ids, skip_special_tokens: " ".join(map(str, ids)))
    assert _eos_ids(target, tokenizer) == [2, 5, 9]  # the out-of-vocabulary 100 dropped
    assert _eos_ids(SimpleNamespace(vocab_size=100, config=SimpleNamespace()), tokenizer) == [2]
    assert decode_generated(tokenizer, [3, 4, 9], [2, 5, 9]) == "3 4"
    assert decode_generated(tokenizer, [9, 3], [2, 5, 9]) == "9 3"


class LetterTokenizer:
    """Token t is the letter chr(97 + t % 26); 25 ('z') is its EOS, left out of the text."""

    eos_token_id = 25

    def encode(self, text: str) -> list[int]:
        return [ord(letter) - 97 for letter in text]

    def decode(self, ids, *, skip_special_tokens: bool = False):
        return "".join(chr(97 + t % 26) for t in ids if not (skip_special_tokens and t == 25))


def test_text_prompts_and_outputs_with_a_tokenizer(target, draft):
    """With a tokenizer, a request's prompt may be text (encoded as given) and every output carries its generated
    text: the same tokens as the prompt's ids give, decoded without special tokens and a closing EOS."""
    from specdec_ops.runtime.generator import decode_generated

    tokenizer = LetterTokenizer()
    prompts = ["hello", "speculative", "a", "decodingdrafts"]
    # The first request stops at an EOS: its third greedy token, made an end-of-sequence id beside 25.
    eos = [25, greedy_reference(target, tokenizer.encode(prompts[0]), 9)[2]]
    with_text = Generator(target, draft, small_config(3), device="cpu", compile=False, tokenizer=tokenizer)
    by_text = with_text.generate([Request(p, 9, eos_token_id=eos) for p in prompts])
    by_ids = Generator(target, draft, small_config(3), device="cpu", compile=False).generate(
        [Request(tokenizer.encode(p), 9, eos_token_id=eos) for p in prompts])
    for prompt, text_out, ids_out in zip(prompts, by_text.requests, by_ids.requests):
        assert text_out.prompt_ids == tokenizer.encode(prompt) == ids_out.prompt_ids
        assert text_out.token_ids == ids_out.token_ids and ids_out.text is None
        ends_at_eos = text_out.finish_reason == "eos"
        assert text_out.text == tokenizer.decode(text_out.token_ids[:-1] if ends_at_eos else text_out.token_ids,
                                                 skip_special_tokens=True)
    assert by_text.requests[0].finish_reason == "eos" and by_text.requests[0].token_ids[-1] == eos[1]
    assert decode_generated(tokenizer, [7, 0, 25], [25]) == "ha"  # EOS 25 closes it; an inner 25 is special
    assert decode_generated(tokenizer, [7, 25, 0], [25]) == "ha"
    with pytest.raises(ValueError, match=r"requests\[0\]\.prompt_ids is text; the Generator has no tokenizer"):
        Generator(target, draft, small_config(3), device="cpu", compile=False).generate([Request("abc", 3)])
    with pytest.raises(ValueError, match="tokenizer must have encode and decode"):
        Generator(target, draft, small_config(3), device="cpu", compile=False, tokenizer=object())


def test_stop_strings_end_requests_at_the_token_that_completes_them(target, draft, capsys):
    from specdec_ops.generate import _TextTracker

    tokenizer = LetterTokenizer()
    requests = mixed_requests(5, 9)
    refs = [greedy_reference(target, r.prompt_ids, r.max_new_tokens) for r in requests]
    texts = [tokenizer.decode(ref) for ref in refs]
    # Stop strings of two letters from the middle of two requests' texts (a token boundary inside them).
    long_ones = [i for i, text in enumerate(texts) if len(text) >= 8][:2]
    assert len(long_ones) == 2, "test setup: pick other requests"
    stops = [texts[i][4:6] for i in long_ones]
    want = []
    for text, ref in zip(texts, refs):
        found = [i for i in (text.find(stop) for stop in stops) if i >= 0]
        want.append(ref if not found else ref[: min(found) + 2])  # a token per letter: stop + 2 tokens
    tracker = _TextTracker(tokenizer, [], stops)
    out = Generator(target, draft, small_config(3, read_every=3), device="cpu", compile=False).generate(
        requests, stream=tracker)
    assert [r.token_ids for r in out.requests] == want
    for index, (result, ref) in enumerate(zip(out.requests, refs)):
        assert result.finish_reason == ("stop" if result.token_ids != ref else "max_tokens")
        text = tracker.text(result.token_ids)
        assert not any(stop in text for stop in stops)
        assert text == texts[index][: len(result.token_ids) - (2 if result.finish_reason == "stop" else 0)]
    assert sum(r.finish_reason == "stop" for r in out.requests) >= 2
    # Echo holds back what may begin a stop string, and a closing EOS is not text.
    echo = _TextTracker(tokenizer, [25], ["cd"], echo=True)
    assert echo(0, [0, 1, 2]) is None and capsys.readouterr().out == "ab"
    assert echo(0, [4, 2, 3, 5]) == 3 and capsys.readouterr().out == "ce"
    # A stop string longer than the text so far: nothing of it shows, even when it never completes.
    long_stop = _TextTracker(tokenizer, [], ["abcdefghij"], echo=True)
    assert long_stop(0, [0, 1, 2, 3, 4, 5]) is None and capsys.readouterr().out == ""
    assert long_stop(0, list(range(6, 10))) == 4 and capsys.readouterr().out == ""
    plain = _TextTracker(tokenizer, [25], [], echo=True)
    assert plain(0, [7, 8]) is None and plain(0, [25]) is None and capsys.readouterr().out == "hi"


def test_command_stop_strings(target, draft, capsys, monkeypatch):
    import json

    from specdec_ops import generate

    monkeypatch.setattr(generate, "build_models", lambda args, dtype, device: (target, draft, LetterTokenizer()))
    argv = ["--target", "letters", "--prompt-ids", "4,5,6", "--prompt-ids", "7", "--max-new-tokens", "12", "--json"]
    assert generate.main(argv) == 0
    free = json.loads(capsys.readouterr().out)["requests"]
    assert free[0]["text"] == LetterTokenizer().decode(free[0]["token_ids"]) and len(free[0]["text"]) == 12
    stop = free[0]["text"][5:7]
    assert generate.main(argv + ["--stop", stop]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["config"]["stop"] == [stop]
    for entry, before in zip(document["requests"], free):
        cut = before["text"].find(stop)
        assert entry["text"] == (before["text"] if cut < 0 else before["text"][:cut])
        assert entry["token_ids"] == (before["token_ids"] if cut < 0 else before["token_ids"][:cut + 2])
        assert entry["finish_reason"] == ("max_tokens" if cut < 0 else "stop") and entry["matches_target_only"]
    assert document["requests"][0]["finish_reason"] == "stop"


def save_tiny_checkpoint(path, *, layers: int, vocab: int = 64, seed: int = 0, word: str = "w", context: int = 128):
    """A Llama checkpoint directory as transformers writes it (random weights, max_position_embeddings = context)
    with a word-level tokenizer.json: token i is the word f"{word}{i}", 1 the EOS."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    words = {"<unk>": 0, "</s>": 1, **{f"{word}{i}": i for i in range(2, vocab)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                                      eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_command_with_checkpoint_directories(tmp_path, capsys):
    import json

    from specdec_ops.generate import main

    target = save_tiny_checkpoint(tmp_path / "target", layers=3)
    draft = save_tiny_checkpoint(tmp_path / "draft", layers=1, seed=1)
    argv = ["--target", str(target), "--draft", str(draft), "--prompt", "w5 w9 w3", "--prompt", "w7",
            "--max-new-tokens", "8", "--k", "3", "--json", "--split"]
    assert main(argv) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["config"]["draft"] == str(draft) and document["config"]["eos_token_ids"] == [1]
    for entry in document["requests"]:
        assert entry["matches_target_only"] and 1 <= entry["num_tokens"] <= 8
        assert entry["text"].split() == [f"w{t}" for t in entry["token_ids"] if t != 1]
    assert document["requests"][0]["prompt_token_ids"][-3:] == [5, 9, 3]
    split = document["speculative"]["split_ms"]
    assert set(split) >= {"draft", "target", "verify"} and all(value > 0 for value in split.values())
    # A draft of another vocabulary, and --draft-layers beside --draft, are refused with what was expected.
    other = save_tiny_checkpoint(tmp_path / "other", layers=1, vocab=80)
    assert main(["--target", str(target), "--draft", str(other), "--prompt", "w5"]) == 2
    assert (f"the target's ({target}) vocab_size is 64, the draft's ({other}) is 80"
            in capsys.readouterr().err)
    renamed = save_tiny_checkpoint(tmp_path / "renamed", layers=1, word="v")  # same size, other tokens
    assert main(["--target", str(target), "--draft", str(renamed), "--prompt", "w5"]) == 2
    assert "its tokenizer differs from the target's: token 'v10' has id None in the target's and 10" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--target", str(target), "--draft", str(draft), "--draft-layers", "1"])
    assert "--draft-layers makes the default draft" in capsys.readouterr().err


def test_command_errors_name_the_flag_and_generation_stops_at_the_context(tmp_path, capsys):
    import json
    import shutil

    from specdec_ops.generate import main

    target = save_tiny_checkpoint(tmp_path / "target", layers=2, context=16)
    quick = ["--max-new-tokens", "30", "--k", "2", "--draft-layers", "1"]
    assert main(["--target", str(target), "--draft", str(tmp_path / "missing"), "--prompt", "w5"]) == 2
    assert f"--draft: load_model: {tmp_path / 'missing'} does not exist" in capsys.readouterr().err
    assert main(["--target", str(target), "--prompt-ids", "5,99999999999999999999"]) == 2
    assert "--prompt-ids: token id 99999999999999999999 is outside the target's vocabulary of 64" in \
        capsys.readouterr().err
    # A prompt and --max-new-tokens past the model's 16 positions: the request ends at the context ("length",
    # its last round's k positions included), unless its EOS comes first.
    assert main(["--target", str(target), "--prompt", "w5 w6", "--json"] + quick) == 0
    for entry in json.loads(capsys.readouterr().out)["requests"]:
        assert len(entry["prompt_token_ids"]) + entry["num_tokens"] <= 16 - 2
        assert entry["finish_reason"] == "length" or entry["token_ids"][-1] == 1
    assert main(["--target", str(target), "--prompt", "w5", "--max-model-len", "64"] + quick) == 2
    assert "max_model_len = 64 exceeds the target's context of 16 positions" in capsys.readouterr().err
    # Token ids need no tokenizer; with --no-plain the table has no target-only column.
    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(target, no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    assert main(["--target", str(no_tokenizer), "--prompt-ids", "5,6", "--no-plain", "--max-new-tokens", "4",
                 "--k", "2", "--draft-layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "### 5 6\n" in out
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert table[0].split() == ["|", "|", "speculative", "|"] and all(line.count("|") == 3 for line in table)


def test_command_streams_the_text_of_one_request(capsys, monkeypatch):
    import json

    from specdec_ops import generate

    argv = ["--target", "random", "--prompt-ids", "4,5,6", "--max-new-tokens", "9", "--k", "2", "--draft-layers",
            "2"]
    assert generate.main(argv + ["--json"]) == 0
    token_ids = json.loads(capsys.readouterr().out)["requests"][0]["token_ids"]
    pieces = []
    original = generate._TextTracker.__call__

    def recording(self, index, ids):
        pieces.append(list(ids))
        return original(self, index, ids)

    monkeypatch.setattr(generate._TextTracker, "__call__", recording)
    assert generate.main(argv + ["--stream"]) == 0
    out = capsys.readouterr().out
    text = " ".join(map(str, token_ids))
    assert out.startswith(f"\n### 4 5 6\n{text}\n[9 tokens, max_tokens, same as target-only: True]")
    assert len(pieces) >= 2 and [t for piece in pieces for t in piece] == token_ids


@pytest.mark.parametrize("argv, message", [
    (["--k", "0"], "expected an integer >= 1"),
    (["--temperature", "-1"], "expected a finite number >= 0"),
    (["--temperature", "nan"], "expected a finite number >= 0"),
    (["--max-new-tokens", "0"], "expected an integer >= 1"),
    (["--batch-sizes", "2,x"], "comma-separated integers"),
    (["--method", "greedy", "--temperature", "0.5"], "--method greedy verifies by argmax"),
    (["--seed", "-3"], r"in \[0, 2\*\*63\)"),
    (["--target", "random", "--prompt", "hi"], "has no tokenizer"),
    (["--top-k", "-1"], "expected an integer >= 0"),
    (["--top-p", "0"], r"expected a number in \(0, 1\]"),
    (["--min-p", "1.5"], r"expected a number in \[0, 1\]"),
    (["--method", "typical", "--temperature", "0.5", "--top-p", "0.9"], "--method typical takes the temperature"),
    (["--top-k", "50"], "give --temperature > 0"),
    (["--stream"], "give one --prompt"),
    (["--stop", ""], "a stop string must not be empty"),
    (["--target", "random", "--prompt-ids", "1", "--stop", "x"], "--stop needs a tokenizer"),
    (["--stream", "--json", "--prompt", "hi"], "--stream prints text as it is generated"),
    (["--prompt-ids", "4,-1"], "expected token ids >= 0"),
    (["--prompt", ""], "--prompt: a prompt must not be empty"),
    (["--draft", "random"], "--draft random goes with --target random"),
])
def test_command_refuses_bad_flags(argv, message, capsys):
    from specdec_ops.generate import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message.replace("\\", "") in capsys.readouterr().err or pytest.fail(f"no {message!r} in the error")


def test_chunked_prefill_gives_the_same_tokens(target, draft, monkeypatch, joined_requests):
    from specdec_ops.runtime import generator as generator_module

    requests, want, _ = joined_requests
    monkeypatch.setattr(generator_module, "PREFILL_CHUNK", 3)  # every prompt over 3 tokens is chunked
    out = Generator(target, draft, small_config(2), device="cpu", compile=False).generate(requests)
    assert [r.token_ids for r in out.requests] == want
    assert max(len(r.prompt_ids) for r in requests) > 6


@pytest.mark.parametrize("read_every", [1, 3, 8])
def test_speculative_runs_no_round_past_the_last_token(target, draft, read_every):
    # Groups end by the first round at which a request could reach its cap (k + 1 tokens per round at most):
    # one request that stops at its cap has a live row in every round, whatever its acceptance does.
    k = 3
    config = small_config(k, read_every=read_every, batch_sizes=(3,))
    generator = Generator(target, draft, config, device="cpu", compile=False)
    for prompt, new_tokens in (([1, 2, 3], 23), ([5, 9], 40)):
        out = generator.generate([Request(prompt, new_tokens)])
        assert out.requests[0].finish_reason == "max_tokens" and len(out.requests[0].token_ids) == new_tokens
        assert out.metrics.rounds == out.metrics.row_rounds
        assert out.metrics.rounds >= -(-(new_tokens - 1) // (k + 1))
        assert 0 < out.metrics.acceptance_rate < 1  # drafts sometimes rejected: the rate per round varies

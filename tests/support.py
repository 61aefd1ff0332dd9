"""Test helpers: a cache-free greedy reference and a synthetic target that drives proposers over many rounds."""
from __future__ import annotations

import random

import torch
from torch import nn

from specdec_ops.runtime.kv import BlockPool


@torch.no_grad()
def greedy_reference(model: nn.Module, token_ids: list[int], num_tokens: int) -> list[int]:
    """Greedy continuation of one whole sequence, re-running the model from scratch for every token."""
    device = next(model.parameters()).device
    sequence, drafts = list(token_ids), []
    for _ in range(num_tokens):
        ids = torch.tensor(sequence, device=device)
        hidden = model(ids, torch.arange(len(sequence), device=device), None)
        # Argmax of the float32 logits, first index on ties: what sample_draft does for greedy rows.
        token = int(model.compute_logits(hidden[-1:]).float().argmax(-1))
        drafts.append(token)
        sequence.append(token)
    return drafts


class SyntheticTarget:
    """Plays the target model and the scheduler around a `DraftProposer`, with random decisions.

    A request's first round has its prompt as query, no rejections, and the
    target's first sampled token as ``last_sampled``. After each round the
    target "accepts" a random a in [0, k] of the k drafts and samples a random
    new token: the request's true sequence grows by d_1..d_a and that token,
    and its next query is [previous correction token, d_1..d_k] starting at the
    correction token's position, with ``num_rejected = k - a``. Requests join
    (short or long prompts) and leave at random, skip rounds, take a free
    request slot (slots are reused), and get KV blocks from a shuffled
    `BlockPool` as their sequences grow; some batches carry padding tokens past
    ``query_start_loc[n]``. ``true_sequence(slot)`` is what greedy drafting must
    continue (`greedy_reference`).
    """

    def __init__(self, proposers, *, seed: int, vocab_size: int, max_prompt_len: int = 8,
                 long_prompt_len: int = 40, leave_prob: float = 0.15, skip_prob: float = 0.1,
                 extra_tokens_prob: float = 0.2):
        self.proposers = list(proposers)
        first = self.proposers[0]
        self.k, self.block_size = first.k, first.block_size
        self.max_num_reqs, self.max_num_tokens = first.config.max_num_reqs, first.config.max_num_tokens
        self.max_model_len, self.num_slots = first.max_model_len, first.num_slots
        self.rng = random.Random(seed)
        self.pool = BlockPool(first.num_blocks, seed=seed)
        for proposer in self.proposers:  # a new simulation owns the proposers' block tables
            for slot in range(proposer.num_slots):
                proposer.release_slot(slot)
        self.vocab_size = vocab_size
        self.max_prompt_len, self.long_prompt_len = max_prompt_len, long_prompt_len
        self.leave_prob, self.skip_prob, self.extra_tokens_prob = leave_prob, skip_prob, extra_tokens_prob
        self.requests: dict[int, dict] = {}  # slot -> state
        self.num_joined = 0
        self.allocated: set[int] = set()  # every block ever handed out
        self.last_sampled = [0] * self.num_slots
        self.batch_slots: list[int] = []

    def true_sequence(self, slot: int) -> list[int]:
        return self.requests[slot]["true"]

    def _token(self) -> int:
        return self.rng.randrange(self.vocab_size)

    def _leave(self, slot: int) -> None:
        blocks = self.requests.pop(slot)["blocks"]
        for proposer in self.proposers:
            assert proposer.release_slot(slot) == blocks
        self.pool.release(blocks)

    def _join(self, slot: int, tokens_left: int) -> None:
        long = self.rng.random() < 0.25
        length = self.rng.randint(1, self.long_prompt_len if long else self.max_prompt_len)
        prompt = [self._token() for _ in range(min(length, tokens_left))]
        first = self._token()
        self.requests[slot] = dict(true=prompt + [first], query=prompt, start=0, num_rejected=0, blocks=[])
        self.num_joined += 1
        self.last_sampled[slot] = first

    def _grow_blocks(self, slot: int) -> None:
        # Cover every position this round writes: the expanded query and k - 1 decode steps.
        req = self.requests[slot]
        needed = -(-(req["start"] + len(req["query"]) + self.k) // self.block_size)
        if needed > len(req["blocks"]):
            new = self.pool.allocate(needed - len(req["blocks"]), owner=slot)
            self.allocated.update(new)
            req["blocks"] += new
            for proposer in self.proposers:
                proposer.assign_blocks(slot, req["blocks"])

    def next_batch(self, *, temperature: float = 0.0, device="cpu", ids_dtype=torch.int32, seed_base: int = 0) -> dict:
        """The next round's propose() arguments (every row at `temperature`); batch row order is random."""
        rng, k = self.rng, self.k
        for slot in list(self.requests):
            too_long = len(self.true_sequence(slot)) + 2 * k + 3 > self.max_model_len
            if too_long or rng.random() < self.leave_prob:
                self._leave(slot)
        free = [s for s in range(self.num_slots) if s not in self.requests]
        rng.shuffle(free)
        budget = self.max_num_tokens - 4  # room for padding tokens past the last request
        for slot in free[: rng.randint(0, len(free))]:
            tokens_left = budget - sum(len(r["query"]) for r in self.requests.values())
            if tokens_left > 0 and len(self.requests) < self.max_num_reqs:
                self._join(slot, tokens_left)
        slots = [s for s in self.requests if rng.random() >= self.skip_prob] or list(self.requests)[:1]
        rng.shuffle(slots)
        batch, used = [], 0
        for slot in slots:
            query_len = len(self.requests[slot]["query"])
            if len(batch) < self.max_num_reqs and used + query_len <= budget:
                batch.append(slot)
                used += query_len
        self.batch_slots = batch
        input_ids, positions, qsl, seq_lens, num_rejected = [], [], [0], [], []
        for slot in batch:
            self._grow_blocks(slot)
            req = self.requests[slot]
            input_ids += req["query"]
            positions += range(req["start"], req["start"] + len(req["query"]))
            qsl.append(len(input_ids))
            seq_lens.append(req["start"] + len(req["query"]))
            num_rejected.append(req["num_rejected"])
        if rng.random() < self.extra_tokens_prob:  # padding tokens past query_start_loc[n]
            extra = rng.randint(1, 4)
            input_ids += [self._token() for _ in range(extra)]
            positions += [rng.randrange(self.max_model_len) for _ in range(extra)]
        n = len(batch)

        def t(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        return dict(
            input_ids=t(input_ids, ids_dtype), positions=t(positions, torch.int64), query_start_loc=t(qsl, torch.int32),
            seq_lens=t(seq_lens, torch.int32), idx_mapping=t(batch, torch.int32),
            num_rejected=t(num_rejected, torch.int32), last_sampled=t(self.last_sampled, torch.int64),
            temperature=t([temperature] * n, torch.float32),
            seeds=t([seed_base + s for s in batch], torch.int64),
        )

    def verify(self, drafts: list[list[int]]) -> None:
        """The target's decision on this round's drafts (one list per batch row)."""
        k = self.k
        for slot, draft in zip(self.batch_slots, drafts):
            req = self.requests[slot]
            accepted = self.rng.randint(0, k)
            new_token = self._token()
            req["query"] = [req["true"][-1]] + list(draft)
            req["start"] = len(req["true"]) - 1
            req["num_rejected"] = k - accepted
            req["true"] = req["true"] + list(draft[:accepted]) + [new_token]
            self.last_sampled[slot] = new_token


def prefix_draft(target: nn.Module, num_layers: int) -> nn.Module:
    """A `DraftModel` made of the target's embedding, first `num_layers` decoder layers, final norm and head
    (shared modules, no copy): a cheap draft whose acceptance against its target is well above random."""
    if hasattr(target, "truncated"):
        return target.truncated(num_layers)
    import dataclasses

    from specdec_ops.models import DraftModel

    config = dataclasses.replace(target.config, num_layers=num_layers)
    draft = DraftModel(dataclasses.replace(config, vocab_size=8, hidden_size=config.hidden_size,
                                           intermediate_size=8, dtype=config.dtype),
                       device=next(target.parameters()).device)
    draft.config, draft.vocab_size = config, config.vocab_size
    draft.embed_tokens, draft.norm, draft.lm_head = target.embed_tokens, target.norm, target.lm_head
    draft.layers = nn.ModuleList(list(target.layers[:num_layers]))
    return draft

"""`DraftProposer`: the whole draft-model propose step, compiled, one CUDA-graph replay per call.

A round of speculative decoding with a separate draft model (vLLM's
PlainDraftModelSpeculator): the target verified the previous drafts; the
draft model now catches up on what the target accepted and proposes k new
tokens per request.

- Step 0: ``specdec::prepare_prefill`` expands the target batch (accepted
  tokens, the correction token ``last_sampled[slot]``, the rejected slots), one
  draft-model forward runs over it (writing KV for every expanded slot; those
  of rejected slots hold garbage that a later round overwrites), and
  ``specdec::sample_draft`` draws draft 1 at each request's correction token.
- Steps 1..k-1: ``specdec::advance_draft_step`` feeds each request's last draft
  back one position further on (positions clamped to ``max_model_len - 1``,
  sequence lengths to ``max_model_len``), one single-token forward per
  request, and ``sample_draft`` draws the next draft. Decoding starts at the
  correction token's position with ``seq_lens - num_rejected + 1``.

Inputs of `DraftProposer.propose` (one round; n requests, t tokens):
``input_ids`` [t] and ``positions`` [t] (the target's flattened query
tokens), ``query_start_loc`` [n + 1], ``seq_lens`` [n] (target sequence
lengths, query included), ``idx_mapping`` [n] (batch row -> request slot),
``num_rejected`` [n], ``last_sampled`` [num_slots] (per request slot: the
target's newest token), ``temperature`` [n] float (0 = greedy) and ``seeds``
[n] int64 (per batch row). Integer inputs may be int32 or int64, all on the
proposer's device (host tensors would make the input copies synchronize);
``input_ids`` may run past ``query_start_loc[n]`` (padding). It returns
``draft_tokens`` [n, k] int64 and, with ``with_probs``, ``draft_probs``
[n, k, V] float32 (softmax(logits / T), one-hot for greedy rows) for the
rejection sampler. Both are views of persistent buffers, valid until the
next call.

KV cache. Paged: ``kv_caches``, one tensor per layer, [num_blocks * block_size,
2, num_kv_heads, head_size] (block b holds cache slots ``b * block_size`` to
``(b + 1) * block_size - 1``); ``block_tables`` [num_slots + 1, blocks_per_req]
int32, one row per request slot, filled by the caller when a request joins
(`assign_blocks`; `BlockPool` is a small free list). Block 0 is the null
block: no request owns it, and every write of a padded row or padded token
lands there. Row ``num_slots`` is the spare slot that padded rows map to (all
zeros: the null block). Slot mappings (``block * block_size + offset``) are
computed on the device from positions and block tables.

Padding and graphs. Inputs are copied into persistent buffers sized
``max_num_reqs`` / ``max_num_tokens``. A batch is padded to the smallest
captured size (B requests from ``batch_sizes``, T tokens from
``token_sizes``); the live counts n and t travel as a device tensor, so
changing n or t within a size neither recompiles nor re-records. Padded rows
get an empty query, temperature 0, seed 0, no rejections and the spare slot;
padded tokens (and tokens past ``query_start_loc[n]``) write the null block.
No host sync, no data-dependent shape: each (B, T) is one compiled graph and,
on CUDA, one captured CUDA graph replayed per call (``cuda_graphs=True``, the
default there), or a torch.compile(mode="reduce-overhead") graph
(``cuda_graphs="reduce-overhead"``).

The draft model follows the model interface of `specdec_ops.models.interface`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from ..ops.draft_step import advance_draft_step
from ..models.interface import AttentionMetadata, KVCacheSpec  # noqa: F401  (KVCacheSpec re-exported)
from ..ops.prefill import prepare_prefill
from .kv import NULL_BLOCK, BlockPool  # noqa: F401  (BlockPool re-exported)


# Round sizes whose copy views a proposer keeps (see DraftProposer._round_copy); past this many, it starts over.
MAX_CACHED_ROUND_SIZES = 128


@dataclass(frozen=True)
class ProposerConfig:
    """Static sizes of a `DraftProposer`: its buffers, KV cache and captured graphs."""

    num_speculative_tokens: int  # k drafts per request and round
    max_num_reqs: int  # requests per round
    max_num_tokens: int  # target tokens per round
    max_model_len: int
    block_size: int = 16
    num_slots: int | None = None  # request slots; default max_num_reqs
    num_blocks: int | None = None  # KV blocks incl. the null block; default: enough for every slot
    batch_sizes: Sequence[int] | None = None  # padded request counts; default powers of two + max
    token_sizes: Sequence[int] | None = None  # padded token counts; default powers of two + max

    @property
    def slots(self) -> int:
        return self.num_slots if self.num_slots is not None else self.max_num_reqs

    @property
    def blocks_per_req(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def total_blocks(self) -> int:
        return self.num_blocks if self.num_blocks is not None else 1 + self.slots * self.blocks_per_req


def _size_classes(sizes: Sequence[int] | None, maximum: int, smallest: int) -> list[int]:
    if sizes is None:
        sizes, size = [], smallest
        while size < maximum:
            sizes.append(size)
            size *= 2
        sizes.append(maximum)
    sizes = sorted(set(int(s) for s in sizes))
    if not sizes or sizes[0] < 1 or sizes[-1] > maximum:
        raise ValueError(f"DraftProposer: padded sizes {sizes} must lie in [1, {maximum}]")
    return sizes


def _pick(sizes: list[int], n: int, what: str) -> int:
    for size in sizes:
        if size >= n:
            return size
    raise ValueError(f"DraftProposer.propose: {what} = {n} exceeds the largest padded size {sizes[-1]}")


class _RoundCopy(NamedTuple):
    """What `DraftProposer.propose` needs for a round of given sizes."""

    batch: int  # the padded sizes the round runs at
    tokens: int
    buffers: list[torch.Tensor]  # where the round's inputs and live counts are copied
    live_counts: list[torch.Tensor]  # the live counts, views of the device-side arange


class DraftProposer:
    """Runs propose rounds of a draft model; see the module docstring."""

    def __init__(self, model: torch.nn.Module, config: ProposerConfig, *, device: torch.device | str,
                 compile: bool = True, cuda_graphs: bool | str | None = None, with_probs: bool = True):
        device = torch.device(device)
        if config.num_speculative_tokens < 1:
            raise ValueError("DraftProposer: num_speculative_tokens must be >= 1")
        if cuda_graphs is None:
            cuda_graphs = device.type == "cuda"
        if cuda_graphs not in (True, False, "reduce-overhead"):
            raise ValueError(f"DraftProposer: cuda_graphs must be True, False, None or 'reduce-overhead', "
                             f"got {cuda_graphs!r}")
        if cuda_graphs and device.type != "cuda":
            raise ValueError("DraftProposer: cuda_graphs needs a CUDA device")
        if cuda_graphs == "reduce-overhead" and not compile:
            raise ValueError("DraftProposer: cuda_graphs='reduce-overhead' needs compile=True")
        self.model = model
        self.config = config
        self.device = device
        self.with_probs = with_probs
        self.k = config.num_speculative_tokens
        self.max_model_len = config.max_model_len
        self.block_size = config.block_size
        self.num_slots = config.slots
        self.num_blocks = config.total_blocks
        self.batch_sizes = _size_classes(config.batch_sizes, config.max_num_reqs, 1)
        self.token_sizes = _size_classes(config.token_sizes, config.max_num_tokens, 16)

        spec = model.kv_cache_spec()
        max_reqs, max_tokens = config.max_num_reqs, config.max_num_tokens

        def zeros(*shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        # Persistent inputs (the caller's tensors are copied in; graphs read them here).
        self.input_ids = zeros(max_tokens, dtype=torch.int32)
        self.positions = zeros(max_tokens, dtype=torch.int64)
        self.query_start_loc = zeros(max_reqs + 1, dtype=torch.int32)
        self.seq_lens = zeros(max_reqs, dtype=torch.int32)
        self.idx_mapping = zeros(max_reqs, dtype=torch.int32)
        self.num_rejected = zeros(max_reqs, dtype=torch.int32)
        self.temperature = zeros(max_reqs, dtype=torch.float32)
        self.seeds = zeros(max_reqs, dtype=torch.int64)
        self.last_sampled = zeros(self.num_slots + 1, dtype=torch.int64)  # + the spare slot
        self.live_counts = zeros(2, dtype=torch.int64)  # (n, t) of the current round
        # Device-side arange: live counts are copied from it, so no host->device copy (and no sync).
        self._counts_table = torch.arange(max(max_reqs, max_tokens) + 1, dtype=torch.int64, device=device)
        # State.
        self.block_tables = zeros(self.num_slots + 1, config.blocks_per_req, dtype=torch.int32)
        self.kv_caches = tuple(zeros(self.num_blocks * self.block_size, 2, spec.num_kv_heads, spec.head_size,
                                     dtype=spec.dtype) for _ in range(spec.num_layers))
        # Outputs.
        self.draft_tokens = zeros(max_reqs, self.k, dtype=torch.int64)
        self.draft_probs = zeros(max_reqs, self.k, model.vocab_size if with_probs else 1, dtype=torch.float32)

        if cuda_graphs == "reduce-overhead":
            # cudagraph trees copy non-static inputs and skip graphs that mutate them: mark ours static.
            for buf in (self.input_ids, self.positions, self.query_start_loc, self.seq_lens, self.idx_mapping,
                        self.num_rejected, self.temperature, self.seeds, self.last_sampled, self.live_counts,
                        self.block_tables, self.draft_tokens, self.draft_probs, *self.kv_caches):
                torch._dynamo.mark_static_address(buf)
        if compile:
            self._raise_recompile_limit(len(self.batch_sizes) * len(self.token_sizes))
        if not compile:
            self._step = self.propose_step
        elif cuda_graphs == "reduce-overhead":
            self._step = torch.compile(self.propose_step, fullgraph=True, dynamic=False, mode="reduce-overhead")
        else:
            self._step = torch.compile(self.propose_step, fullgraph=True, dynamic=False)
        self.manual_graphs = cuda_graphs is True
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._round_copies: dict[tuple[int, int, int], _RoundCopy] = {}
        self._graph_pool = None

    @staticmethod
    def _raise_recompile_limit(graphs: int) -> None:
        # Every padded (B, T) of every proposer is one more graph of the one step function (one code
        # object), so each compiled proposer raises dynamo's per-function limit by its count.
        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, name, getattr(config, name) + graphs)

    # --- request bookkeeping (host side, outside the graphs) ---------------------------------

    def assign_blocks(self, slot: int, blocks: Sequence[int]) -> None:
        """Gives request slot `slot` the KV blocks `blocks` (in position order); the rest of its row is null."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"DraftProposer.assign_blocks: slot must lie in [0, {self.num_slots}), got {slot}")
        if len(blocks) > self.block_tables.shape[1]:
            raise ValueError(f"DraftProposer.assign_blocks: {len(blocks)} blocks given, a request holds at most "
                             f"blocks_per_req = {self.block_tables.shape[1]}")
        row = torch.full((self.block_tables.shape[1],), NULL_BLOCK, dtype=torch.int32)
        row[: len(blocks)] = torch.tensor(list(blocks), dtype=torch.int32)
        self.block_tables[slot].copy_(row)

    # --- one round -------------------------------------------------------------------------------

    def padded_sizes(self, num_reqs: int, num_tokens: int) -> tuple[int, int]:
        """The captured (B, T) a batch of num_reqs requests and num_tokens tokens runs at."""
        return _pick(self.batch_sizes, num_reqs, "num_reqs"), _pick(self.token_sizes, num_tokens, "num_tokens")

    @torch.no_grad()
    def propose(self, input_ids, positions, query_start_loc, seq_lens, idx_mapping, num_rejected, last_sampled,
                temperature, seeds):
        """One propose round; returns (draft_tokens [n, k], draft_probs [n, k, V] or None)."""
        num_reqs, num_tokens = query_start_loc.shape[0] - 1, input_ids.shape[0]
        copy = self._round_copy(num_reqs, num_tokens, last_sampled.shape[0])
        # One multi-tensor copy; stale entries past n and t are masked inside the step.
        torch._foreach_copy_(copy.buffers, [input_ids, positions, query_start_loc, seq_lens, idx_mapping,
                                            num_rejected, temperature, seeds, last_sampled, *copy.live_counts])
        if self.manual_graphs:
            self._replay(copy.batch, copy.tokens)
        else:
            self._step(copy.batch, copy.tokens)
        probs = self.draft_probs[:num_reqs] if self.with_probs else None
        return self.draft_tokens[:num_reqs], probs

    def _round_copy(self, num_reqs: int, num_tokens: int, num_last_sampled: int) -> _RoundCopy:
        """The padded sizes and copy views of a round of these sizes, made on their first round.

        Making the dozen views of a round costs host time on the way to the copy's and the graph's launches
        (benchmarks/RESULTS.md times it), so they are kept per sizes; they never leave the proposer.
        """
        key = (num_reqs, num_tokens, num_last_sampled)
        copy = self._round_copies.get(key)
        if copy is not None:
            return copy
        batch, tokens = self.padded_sizes(num_reqs, num_tokens)
        if num_last_sampled > self.num_slots:
            raise ValueError(f"DraftProposer.propose: last_sampled has {num_last_sampled} entries, "
                             f"more than num_slots = {self.num_slots}")
        if len(self._round_copies) >= MAX_CACHED_ROUND_SIZES:
            self._round_copies.clear()
        copy = _RoundCopy(
            batch, tokens,
            [self.input_ids[:num_tokens], self.positions[:num_tokens], self.query_start_loc[: num_reqs + 1],
             self.seq_lens[:num_reqs], self.idx_mapping[:num_reqs], self.num_rejected[:num_reqs],
             self.temperature[:num_reqs], self.seeds[:num_reqs], self.last_sampled[:num_last_sampled],
             self.live_counts[0:1], self.live_counts[1:2]],
            [self._counts_table[num_reqs: num_reqs + 1], self._counts_table[num_tokens: num_tokens + 1]],
        )
        self._round_copies[key] = copy
        return copy

    def _replay(self, batch: int, tokens: int) -> None:
        graph = self.graphs.get((batch, tokens))
        if graph is None:
            graph = self._capture(batch, tokens)
        graph.replay()

    def _capture(self, batch: int, tokens: int) -> torch.cuda.CUDAGraph:
        # Warm up (compiles, autotunes, JITs the Triton kernels) on a side stream, then record.
        # The step writes only persistent buffers, so replaying it is all a call needs.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(batch, tokens)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            self._step(batch, tokens)
        self.graphs[(batch, tokens)] = graph
        return graph

    # --- the traced step ---------------------------------------------------------------------------

    def padded_inputs(self, batch: int, tokens: int):
        """The round's inputs at padded sizes: live rows from the buffers, padding rows made harmless."""
        num_reqs, num_tokens = self.live_counts[0], self.live_counts[1]
        rows = torch.arange(batch, device=self.device)
        live = rows < num_reqs
        live_tokens = torch.arange(tokens, device=self.device) < num_tokens
        # Padded requests: empty queries placed after the last live one.
        qsl = self.query_start_loc[: batch + 1]
        query_end = qsl.gather(0, num_reqs.view(1))
        qsl = torch.where(torch.arange(batch + 1, device=self.device) <= num_reqs, qsl, query_end)
        input_ids = torch.where(live_tokens, self.input_ids[:tokens], 0)
        positions = torch.where(live_tokens, self.positions[:tokens], 0)
        spare = self.num_slots
        idx_mapping = torch.where(live, self.idx_mapping[:batch].clamp(0, spare), spare)
        seq_lens = torch.where(live, self.seq_lens[:batch], 0)
        num_rejected = torch.where(live, self.num_rejected[:batch], 0)
        temperature = torch.where(live, self.temperature[:batch], 0.0)
        seeds = torch.where(live, self.seeds[:batch], 0)
        return input_ids, positions, qsl, seq_lens, idx_mapping, num_rejected, temperature, seeds

    def _block_tables(self) -> torch.Tensor:
        # Clamped so that no block-table value can index outside the cache.
        return self.block_tables.clamp(0, self.num_blocks - 1).long()

    def _slot_mapping(self, blocks: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat cache slot of each token, from its request's block row and its position."""
        position = positions.clamp(0, self.max_model_len - 1)
        block_index = torch.div(position, self.block_size, rounding_mode="floor").clamp(max=blocks.shape[1] - 1)
        block = blocks.gather(1, block_index[:, None])[:, 0]
        return block * self.block_size + position % self.block_size

    def step0_inputs(self, batch: int, tokens: int):
        """Step 0's expanded batch: (input_ids, positions, attn_metadata, last_token_indices, padded inputs)."""
        inputs = self.padded_inputs(batch, tokens)
        input_ids, positions, qsl, seq_lens, idx_mapping, num_rejected, _, _ = inputs
        expanded = prepare_prefill(input_ids, positions, qsl, seq_lens, idx_mapping, self.last_sampled,
                                   num_rejected, self.max_model_len, max_num_reqs=batch)
        total = tokens + batch
        token = torch.arange(total, device=self.device, dtype=torch.int32)
        # Each expanded token's request; tokens past the last request (padding) write the null block.
        token_req = torch.searchsorted(expanded.expanded_query_start_loc, token, right=True) - 1
        token_req = token_req.clamp(0, batch - 1)
        token_live = token < qsl[batch] + batch
        block_rows = self._block_tables()[idx_mapping.long()]
        token_req = token_req.long()
        slot_mapping = self._slot_mapping(block_rows[token_req], expanded.expanded_positions)
        slot_mapping = torch.where(token_live, slot_mapping, NULL_BLOCK * self.block_size)
        metadata = AttentionMetadata(self.kv_caches, slot_mapping, block_rows, token_req,
                                     expanded.expanded_seq_lens[token_req], self.block_size)
        return (expanded.expanded_input_ids, expanded.expanded_positions, metadata,
                expanded.last_token_indices, inputs)

    def _sample(self, logits, temperature, seeds, positions, step: int, batch: int) -> torch.Tensor:
        if self.with_probs:
            ids = torch.ops.specdec.sample_draft.with_probs(logits, temperature, seeds, positions,
                                                            self.draft_probs[:batch, step])
        else:
            ids = torch.ops.specdec.sample_draft.default(logits, temperature, seeds, positions)
        self.draft_tokens[:batch, step] = ids
        return ids

    def propose_step(self, batch: int, tokens: int) -> None:
        """The whole round at padded sizes, reading and writing only persistent buffers (what is traced)."""
        with torch.no_grad():
            input_ids, positions, metadata, last_token_indices, inputs = self.step0_inputs(batch, tokens)
            _, _, _, seq_lens, idx_mapping, num_rejected, temperature, seeds = inputs
            hidden = self.model(input_ids, positions, metadata)
            logits = self.model.compute_logits(hidden[last_token_indices])
            positions = positions[last_token_indices]
            sampled = self._sample(logits, temperature, seeds, positions, 0, batch)

            seq_lens = torch.clamp(seq_lens - num_rejected + 1, max=self.max_model_len)
            blocks = self._block_tables()[idx_mapping.long()]
            rows = torch.arange(batch, device=self.device)
            for step in range(1, self.k):
                input_ids, positions, seq_lens = advance_draft_step(sampled, positions, seq_lens,
                                                                    self.max_model_len)
                metadata = AttentionMetadata(self.kv_caches, self._slot_mapping(blocks, positions), blocks, rows,
                                             seq_lens, self.block_size, uniform_query_len=1)
                hidden = self.model(input_ids, positions, metadata)
                sampled = self._sample(self.model.compute_logits(hidden), temperature, seeds, positions, step, batch)

"""`DraftProposer`: the whole draft-model propose step, compiled, one CUDA-graph replay per call.

A round of speculative decoding with a separate draft model (vLLM's
PlainDraftModelSpeculator): the target verified the previous drafts; the
draft model now catches up on what the target accepted and proposes k new
tokens per request.

- Step 0: ``specdec::prepare_prefill`` expands the target batch (accepted
  tokens, the correction token ``last_sampled[slot]``, the rejected slots), one
  draft-model forward runs over it (writing KV for every expanded slot; those
  of rejected slots hold garbage that a later round overwrites), and
  ``specdec::sample_draft`` (``sample_draft_filtered`` with ``filters``) draws
  draft 1 at each request's correction token.
- Steps 1..k-1: ``specdec::advance_draft_step`` feeds each request's last draft
  back one position further on (positions clamped to ``max_model_len - 1``,
  sequence lengths to ``max_model_len``), one single-token forward per
  request, and the sampler draws the next draft. Decoding starts at the
  correction token's position with ``seq_lens - num_rejected + 1``.

Inputs of `DraftProposer.propose` (one round; n requests, t tokens):
``input_ids`` [t] and ``positions`` [t] (the target's flattened query
tokens), ``query_start_loc`` [n + 1], ``seq_lens`` [n] (target sequence
lengths, query included), ``idx_mapping`` [n] (batch row -> request slot),
``num_rejected`` [n], ``last_sampled`` [num_slots] (per request slot: the
target's newest token), ``temperature`` [n] float (0 = greedy) and ``seeds``
[n] int64 (per batch row); with ``filters``, also ``top_k`` [n] int, ``top_p``
[n] float and ``min_p`` [n] float (per batch row; off: 0, 1 and 0); with
``round_streams``, also ``stream_offsets`` [n] int. Integer inputs may be
int32 or int64, all on the proposer's device (host tensors would make the
input copies synchronize); ``input_ids`` may run past ``query_start_loc[n]``
(padding). Float ids or tensors on another device are refused with a
ValueError. It returns ``draft_tokens`` [n, k] int64 and, with
``with_probs``, ``draft_probs`` [n, k, V] float32 (softmax(logits / T),
one-hot for greedy rows; with ``filters``, the processed distribution that
`sample_draft_filtered` draws from) for the rejection sampler. Both are views
of persistent buffers, valid until the next call.

KV cache. Paged: ``kv_caches``, one tensor per layer, [num_blocks * block_size,
2, num_kv_heads, head_size] (block b holds cache slots ``b * block_size`` to
``(b + 1) * block_size - 1``); ``block_tables`` [num_slots + 1, blocks_per_req]
int32, one row per request slot, filled by the caller when a request joins
(`assign_blocks`, which refuses blocks outside the pool or held by another
slot; `release_slot` empties a row; `BlockPool` is the free list). Block 0 is the null
block: no request owns it, and every write of a padded row or padded token
lands there. Row ``num_slots`` is the spare slot that padded rows map to (all
zeros: the null block). Slot mappings (``block * block_size + offset``) are
computed on the device from positions and block tables.

Padding and graphs. Inputs are copied into persistent buffers sized
``max_num_reqs`` / ``max_num_tokens``. A batch is padded to the smallest
captured size (B requests from ``batch_sizes``, T tokens from
``token_sizes``); the live counts n and t travel as a device tensor, so
changing n or t within a size neither recompiles nor re-records. Padded rows
get an empty query, temperature 0, seed 0, no rejections, no filters and the spare slot;
padded tokens (and tokens past ``query_start_loc[n]``) write the null block.
No host sync, no data-dependent shape: each (B, T) is one compiled graph and,
on CUDA, one captured CUDA graph replayed per call (``cuda_graphs=True``, the
default there), or a torch.compile(mode="reduce-overhead") graph
(``cuda_graphs="reduce-overhead"``); `graphs.StepGraphs` runs them.

Reading order below: `propose` (one round from the host), then the traced
`propose_step` and the pieces it calls (`padded_inputs`, `step0_inputs`,
`_sample`), then construction and bookkeeping.

The draft model follows the model interface of `specdec_ops.models.interface`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from ..ops.draft_step import advance_draft_step
from ..models.interface import AttentionMetadata, KVCacheSpec  # noqa: F401  (KVCacheSpec re-exported)
from ..ops.prefill import prepare_prefill
from .graphs import StepGraphs, check_graph_mode
from .kv import NULL_BLOCK, BlockPool, BlockTable  # noqa: F401  (BlockPool re-exported)


# Round sizes whose copy views a proposer keeps (see DraftProposer._round_copy); past this many, it starts over.
MAX_CACHED_ROUND_SIZES = 128

_INT_DTYPES = (torch.int32, torch.int64)
_INPUT_NAMES = ("input_ids", "positions", "query_start_loc", "seq_lens", "idx_mapping", "num_rejected",
                "last_sampled", "temperature", "seeds")
_FILTER_NAMES = ("top_k", "top_p", "min_p")
_OPTIONAL_INPUTS = (("filters", _FILTER_NAMES), ("round_streams", ("stream_offsets",)))
_FLOAT_INPUTS = ("temperature", "top_p", "min_p")


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


class PaddedInputs(NamedTuple):
    """A round's inputs at padded sizes (B rows, T tokens): live rows from the buffers, padding made harmless."""

    input_ids: torch.Tensor  # [T] int32, 0 on padded tokens
    positions: torch.Tensor  # [T] int64, 0 on padded tokens
    query_start_loc: torch.Tensor  # [B + 1] int32; padded rows are empty queries after the last live one
    seq_lens: torch.Tensor  # [B] int32, 0 on padded rows
    idx_mapping: torch.Tensor  # [B] int32, the spare slot on padded rows
    num_rejected: torch.Tensor  # [B] int32, 0 on padded rows
    temperature: torch.Tensor  # [B] float32, 0 (greedy) on padded rows
    seeds: torch.Tensor  # [B] int64, 0 on padded rows
    # With filters (else None): [B] top_k int64, top_p and min_p float32; off (0, 1, 0) on padded rows.
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    stream_offsets: torch.Tensor | None = None  # with round_streams: [B] int64, 0 on padded rows


class Step0Batch(NamedTuple):
    """Step 0's expanded batch: the accepted tokens, the correction token and the rejected slots of each row."""

    input_ids: torch.Tensor  # [T + B] int32
    positions: torch.Tensor  # [T + B] int64
    metadata: AttentionMetadata  # paged attention over the draft cache
    last_token_indices: torch.Tensor  # [B] int64, each row's correction token (where draft 1 is sampled)


class _RoundCopy(NamedTuple):
    """What `DraftProposer.propose` needs for a round of given sizes."""

    batch: int  # the padded sizes the round runs at
    tokens: int
    buffers: list[torch.Tensor]  # where the round's inputs and live counts are copied
    live_counts: list[torch.Tensor]  # the live counts, views of the device-side arange


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


def resolve_device(device: torch.device | str) -> torch.device:
    """The device with its index filled in (cuda -> cuda:current), so tensors' devices compare equal to it."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def check_round_inputs(owner: str, device: torch.device, named: dict) -> None:
    """Refuses round inputs on another device or of the wrong kind: ids, counts and top_k integer; temperature,
    top_p and min_p float."""
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{owner}: argument '{name}' must be a tensor, got {type(tensor).__name__}")
        if tensor.device != device:
            raise ValueError(f"{owner}: argument '{name}' must be on {device}, got {tensor.device}")
        if name in _FLOAT_INPUTS:
            if not tensor.is_floating_point():
                raise ValueError(f"{owner}: argument '{name}' must be a float tensor, got {tensor.dtype}")
        elif tensor.dtype not in _INT_DTYPES:
            raise ValueError(f"{owner}: argument '{name}' must be int32 or int64, got {tensor.dtype}")


class DraftProposer:
    """Runs propose rounds of a draft model; see the module docstring.

    Args:
        model: the draft model (specdec_ops.models.interface).
        config: static sizes (`ProposerConfig`).
        device: where buffers, caches and graphs live; every propose() input must be there.
        compile: torch.compile the step (fullgraph, one graph per padded size).
        cuda_graphs: True (default on CUDA): one captured CUDA graph per padded size; "reduce-overhead":
            torch.compile's CUDA-graph trees; False: no graphs.
        with_probs: also write the draft distributions (needed by the rejection sampler).
        filters: draw each draft from the processed distribution of its logits (temperature, then top-k, top-p
            and min-p; `specdec_ops.sample_draft_filtered`), so propose() takes top_k, top_p and min_p too.
            False: softmax(logits / T) (`specdec_ops.sample_draft`), which is what the filters give when off.
        round_streams: draw draft step s of a row at random-stream position ``stream_offsets[row] + s`` instead of
            at the position of the token it is fed, so propose() takes stream_offsets. Block verification needs it:
            its stop point depends on the drafts after it, so a later round must not reuse their random numbers,
            as drafting at the positions it continues from would.
    """

    def __init__(self, model: torch.nn.Module, config: ProposerConfig, *, device: torch.device | str,
                 compile: bool = True, cuda_graphs: bool | str | None = None, with_probs: bool = True,
                 filters: bool = False, round_streams: bool = False):
        device = resolve_device(device)
        if config.num_speculative_tokens < 1:
            raise ValueError("DraftProposer: num_speculative_tokens must be >= 1")
        cuda_graphs = check_graph_mode("DraftProposer", device, compile, cuda_graphs)
        self.model = model
        self.config = config
        self.device = device
        self.with_probs = with_probs
        self.filters = filters
        self.round_streams = round_streams
        self.k = config.num_speculative_tokens
        self.max_model_len = config.max_model_len
        self.block_size = config.block_size
        self.num_slots = config.slots
        self.num_blocks = config.total_blocks
        self.batch_sizes = _size_classes(config.batch_sizes, config.max_num_reqs, 1)
        self.token_sizes = _size_classes(config.token_sizes, config.max_num_tokens, 16)
        self._allocate_buffers(cuda_graphs)
        self.runner = StepGraphs(self.propose_step, device=device, compile=compile, cuda_graphs=cuda_graphs,
                                 num_sizes=len(self.batch_sizes) * len(self.token_sizes), owner="DraftProposer")
        self._round_copies: dict[tuple[int, int, int], _RoundCopy] = {}

    @property
    def manual_graphs(self) -> bool:
        return self.runner.manual_graphs

    @property
    def graphs(self) -> dict:
        return self.runner.graphs

    # --- one round, from the host ------------------------------------------------------------------

    @torch.no_grad()
    def propose(self, input_ids, positions, query_start_loc, seq_lens, idx_mapping, num_rejected, last_sampled,
                temperature, seeds, *, top_k=None, top_p=None, min_p=None, stream_offsets=None):
        """One propose round; returns (draft_tokens [n, k] int64, draft_probs [n, k, V] float32 or None).

        The arguments are described in the module docstring; all are tensors on the proposer's device. top_k,
        top_p and min_p are required with ``filters`` and refused without; stream_offsets likewise with
        ``round_streams``.
        """
        named = dict(zip(_INPUT_NAMES, (input_ids, positions, query_start_loc, seq_lens, idx_mapping, num_rejected,
                                        last_sampled, temperature, seeds)))
        given = dict(top_k=top_k, top_p=top_p, min_p=min_p, stream_offsets=stream_offsets)
        optional = []
        for flag, names in _OPTIONAL_INPUTS:
            on = getattr(self, flag)
            for name in names:
                if (given[name] is None) == on:
                    raise ValueError(f"DraftProposer.propose: argument '{name}' " + (
                        f"is required: the proposer has {flag}=True" if on else
                        f"needs a proposer built with {flag}=True"))
                if on:
                    named[name] = given[name]
                    optional.append(given[name])
        num_reqs, num_tokens = query_start_loc.shape[0] - 1, input_ids.shape[0]
        for name in ("temperature", "seeds") + tuple(n for n in given if given[n] is not None):
            tensor = named.get(name)
            if isinstance(tensor, torch.Tensor) and tuple(tensor.shape) != (num_reqs,):
                raise ValueError(f"DraftProposer.propose: argument '{name}' must have shape [{num_reqs}] (one entry "
                                 f"per request), got {tuple(tensor.shape)}")
        check_round_inputs("DraftProposer.propose", self.device, named)
        copy = self._round_copy(num_reqs, num_tokens, last_sampled.shape[0])
        # One multi-tensor copy; stale entries past n and t are masked inside the step.
        torch._foreach_copy_(copy.buffers, [input_ids, positions, query_start_loc, seq_lens, idx_mapping,
                                            num_rejected, temperature, seeds, last_sampled, *optional,
                                            *copy.live_counts])
        self.runner.run(copy.batch, copy.tokens)
        probs = self.draft_probs[:num_reqs] if self.with_probs else None
        return self.draft_tokens[:num_reqs], probs

    # --- the traced step ---------------------------------------------------------------------------

    def propose_step(self, batch: int, tokens: int) -> None:
        """The whole round at padded sizes, reading and writing only persistent buffers (what is traced).

        Step 0 runs the draft over the expanded target batch and samples draft 1 at each correction token;
        steps 1..k-1 feed each row's last draft back one position further on.
        """
        with torch.no_grad():
            inputs = self.padded_inputs(batch, tokens)
            step0 = self.step0_inputs(inputs, batch, tokens)
            hidden = self.model(step0.input_ids, step0.positions, step0.metadata)
            logits = self.model.compute_logits(hidden[step0.last_token_indices])
            positions = step0.positions[step0.last_token_indices]
            sampled = self._sample(logits, inputs, positions, 0, batch)

            seq_lens = torch.clamp(inputs.seq_lens - inputs.num_rejected + 1, max=self.max_model_len)
            blocks = self._block_tables()[inputs.idx_mapping.long()]
            rows = torch.arange(batch, device=self.device)
            for step in range(1, self.k):
                input_ids, positions, seq_lens = advance_draft_step(sampled, positions, seq_lens,
                                                                    self.max_model_len)
                metadata = AttentionMetadata(self.kv_caches, self._slot_mapping(blocks, positions), blocks, rows,
                                             seq_lens, self.block_size, uniform_query_len=1)
                hidden = self.model(input_ids, positions, metadata)
                logits = self.model.compute_logits(hidden)
                sampled = self._sample(logits, inputs, positions, step, batch)

    def padded_inputs(self, batch: int, tokens: int) -> PaddedInputs:
        """The round's inputs at padded sizes: live rows from the buffers, padding rows made harmless."""
        num_reqs, num_tokens = self.live_counts[0], self.live_counts[1]
        live = torch.arange(batch, device=self.device) < num_reqs
        live_tokens = torch.arange(tokens, device=self.device) < num_tokens
        # Padded requests: empty queries placed after the last live one.
        qsl = self.query_start_loc[: batch + 1]
        query_end = qsl.gather(0, num_reqs.view(1))
        qsl = torch.where(torch.arange(batch + 1, device=self.device) <= num_reqs, qsl, query_end)
        spare = self.num_slots
        optional = {}
        if self.filters:
            optional.update(top_k=torch.where(live, self.top_k[:batch], 0),
                            top_p=torch.where(live, self.top_p[:batch], 1.0),
                            min_p=torch.where(live, self.min_p[:batch], 0.0))
        if self.round_streams:
            optional["stream_offsets"] = torch.where(live, self.stream_offsets[:batch], 0)
        return PaddedInputs(
            input_ids=torch.where(live_tokens, self.input_ids[:tokens], 0),
            positions=torch.where(live_tokens, self.positions[:tokens], 0),
            query_start_loc=qsl,
            seq_lens=torch.where(live, self.seq_lens[:batch], 0),
            idx_mapping=torch.where(live, self.idx_mapping[:batch].clamp(0, spare), spare),
            num_rejected=torch.where(live, self.num_rejected[:batch], 0),
            temperature=torch.where(live, self.temperature[:batch], 0.0),
            seeds=torch.where(live, self.seeds[:batch], 0),
            **optional,
        )

    def step0_inputs(self, inputs: PaddedInputs, batch: int, tokens: int) -> Step0Batch:
        """Step 0's expanded batch (`prepare_prefill`) and its attention metadata over the draft cache."""
        expanded = prepare_prefill(inputs.input_ids, inputs.positions, inputs.query_start_loc, inputs.seq_lens,
                                   inputs.idx_mapping, self.last_sampled, inputs.num_rejected, self.max_model_len,
                                   max_num_reqs=batch)
        token = torch.arange(tokens + batch, device=self.device, dtype=torch.int32)
        # Each expanded token's request; tokens past the last request (padding) write the null block.
        token_req = torch.searchsorted(expanded.expanded_query_start_loc, token, right=True) - 1
        token_req = token_req.clamp(0, batch - 1).long()
        token_live = token < inputs.query_start_loc[batch] + batch
        block_rows = self._block_tables()[inputs.idx_mapping.long()]
        slot_mapping = self._slot_mapping(block_rows[token_req], expanded.expanded_positions)
        slot_mapping = torch.where(token_live, slot_mapping, NULL_BLOCK * self.block_size)
        metadata = AttentionMetadata(self.kv_caches, slot_mapping, block_rows, token_req,
                                     expanded.expanded_seq_lens[token_req], self.block_size)
        return Step0Batch(expanded.expanded_input_ids, expanded.expanded_positions, metadata,
                          expanded.last_token_indices)

    def _sample(self, logits, inputs: PaddedInputs, positions, step: int, batch: int) -> torch.Tensor:
        """Draft `step` of every row, written into draft_tokens (and draft_probs); returns the ids [batch].
        positions: the fed tokens' positions, where the draws are, unless round_streams places them."""
        probs = (self.draft_probs[:batch, step],) if self.with_probs else ()
        positions = self._draw_positions(inputs, positions, step)
        if self.filters:
            op = torch.ops.specdec.sample_draft_filtered
            if logits.dtype == torch.float64:  # a float64 model (the tests' reference precision)
                logits = logits.float()
            ids = (op.with_probs if self.with_probs else op.default)(
                logits, inputs.temperature, inputs.top_k, inputs.top_p, inputs.min_p, inputs.seeds, positions, *probs)
        else:
            op = torch.ops.specdec.sample_draft
            ids = (op.with_probs if self.with_probs else op.default)(logits, inputs.temperature, inputs.seeds,
                                                                     positions, *probs)
        self.draft_tokens[:batch, step] = ids
        return ids

    def _draw_positions(self, inputs: PaddedInputs, positions: torch.Tensor, step: int) -> torch.Tensor:
        """[B] int64: where in each row's random stream draft `step` is drawn (the fed tokens' positions, or
        stream_offsets + step with round_streams)."""
        return inputs.stream_offsets + step if self.round_streams else positions

    def _block_tables(self) -> torch.Tensor:
        # Clamped so that no block-table value can index outside the cache.
        return self.block_tables.clamp(0, self.num_blocks - 1).long()

    def _slot_mapping(self, blocks: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat cache slot of each token, from its request's block row [T, blocks_per_req] and its position [T]."""
        return slot_mapping(blocks, positions, self.block_size, self.max_model_len)

    # --- construction and host-side bookkeeping (outside the graphs) --------------------------------

    def _allocate_buffers(self, cuda_graphs) -> None:
        config, device = self.config, self.device
        spec = self.model.kv_cache_spec()
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
        # The filters (read with filters=True only), off by default.
        self.top_k = zeros(max_reqs, dtype=torch.int64)
        self.top_p = torch.ones(max_reqs, dtype=torch.float32, device=device)
        self.min_p = zeros(max_reqs, dtype=torch.float32)
        self.stream_offsets = zeros(max_reqs, dtype=torch.int64)  # read with round_streams=True only
        self.last_sampled = zeros(self.num_slots + 1, dtype=torch.int64)  # + the spare slot
        self.live_counts = zeros(2, dtype=torch.int64)  # (n, t) of the current round
        # Device-side arange: live counts are copied from it, so no host->device copy (and no sync).
        self._counts_table = torch.arange(max(max_reqs, max_tokens) + 1, dtype=torch.int64, device=device)
        # State: block-table rows (with the owner of every block) and the paged cache.
        self.block_table = BlockTable(self.num_slots, config.blocks_per_req, self.num_blocks, device)
        self.block_tables = self.block_table.tensor
        self.kv_caches = tuple(zeros(self.num_blocks * self.block_size, 2, spec.num_kv_heads, spec.head_size,
                                     dtype=spec.dtype) for _ in range(spec.num_layers))
        # Outputs.
        self.draft_tokens = zeros(max_reqs, self.k, dtype=torch.int64)
        self.draft_probs = zeros(max_reqs, self.k, self.model.vocab_size if self.with_probs else 1,
                                 dtype=torch.float32)
        if cuda_graphs == "reduce-overhead":
            # cudagraph trees copy non-static inputs and skip graphs that mutate them: mark ours static.
            for buf in (self.input_ids, self.positions, self.query_start_loc, self.seq_lens, self.idx_mapping,
                        self.num_rejected, self.temperature, self.seeds, self.top_k, self.top_p, self.min_p,
                        self.stream_offsets, self.last_sampled, self.live_counts,
                        self.block_tables, self.draft_tokens, self.draft_probs, *self.kv_caches):
                torch._dynamo.mark_static_address(buf)

    def assign_blocks(self, slot: int, blocks: Sequence[int]) -> None:
        """Gives request slot `slot` the KV blocks `blocks` (in position order); the rest of its row is null.

        Refuses a slot outside [0, num_slots), a block id outside [1, num_blocks) and a block another slot holds
        (`kv.BlockTable.assign`); the slot's previous blocks are given up.
        """
        self.block_table.assign(slot, blocks, where="DraftProposer.assign_blocks")

    def release_slot(self, slot: int) -> list[int]:
        """Empties `slot`'s block-table row and returns the blocks it held (give them back to the pool)."""
        return self.block_table.clear(slot)

    def padded_sizes(self, num_reqs: int, num_tokens: int) -> tuple[int, int]:
        """The captured (B, T) a batch of num_reqs requests and num_tokens tokens runs at."""
        return _pick(self.batch_sizes, num_reqs, "num_reqs"), _pick(self.token_sizes, num_tokens, "num_tokens")

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
             *([self.top_k[:num_reqs], self.top_p[:num_reqs], self.min_p[:num_reqs]] if self.filters else []),
             *([self.stream_offsets[:num_reqs]] if self.round_streams else []),
             self.live_counts[0:1], self.live_counts[1:2]],
            [self._counts_table[num_reqs: num_reqs + 1], self._counts_table[num_tokens: num_tokens + 1]],
        )
        self._round_copies[key] = copy
        return copy


def slot_mapping(blocks: torch.Tensor, positions: torch.Tensor, block_size: int, max_model_len: int) -> torch.Tensor:
    """Flat cache slot of each token.

    Args:
        blocks: [T, blocks_per_req] int64, each token's request's block-table row (already clamped into the cache).
        positions: [T] int64, each token's position (clamped to [0, max_model_len - 1]).
        block_size: cache slots per block.
        max_model_len: the longest sequence.

    Returns [T] int64: ``blocks[t, position // block_size] * block_size + position % block_size``.
    """
    position = positions.clamp(0, max_model_len - 1)
    block_index = torch.div(position, block_size, rounding_mode="floor").clamp(max=blocks.shape[1] - 1)
    block = blocks.gather(1, block_index[:, None])[:, 0]
    return block * block_size + position % block_size

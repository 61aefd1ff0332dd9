"""`Generator`: speculative (or target-only) generation with continuous batching, one graph per round.

A generator owns a target model, optionally a draft model (``draft=None`` is the target-only path through the
same code), one `BlockPool` and one `BlockTable` that both models' paged caches share (same block size, same
block ids: a request's block b holds its target KV and its draft KV at the same slots of two caches), and a
fixed set of request slots. Row r of every round is slot r: a round at padded size B covers slots 0..B-1, and a
device flag ``active[slot]`` says which rows are live, so requests joining and leaving change tensor contents
only, never shapes (no recompilation, no re-recording).

Prefill (host-driven, eager, outside the round graph; `_admit`): the requests that take free slots together get
all the KV blocks they can ever need, and are prefilled together: their prompts are packed into target forwards
of up to PREFILL_CHUNK tokens (PREFILL_CHUNK_CUDA on CUDA), each token attending to its own request's cache; the
target samples each first token, and the draft runs each prompt minus its last token through the draft cache.
The slots' device state is then set on the device: tokens, ``length`` (prompt + generated), ``cap`` (where it
stops), ``last_token``, the stop flags (a first token that is the EOS stops its request) and the proposer's query
for the first round: [last prompt token, k placeholders] at the last prompt position with all k "rejected", so
the proposer's step 0 writes the last prompt token's draft KV, then the first token's, and drafts from there.
Admission never waits for the device: its host values travel in pinned memory with non-blocking copies, and
nothing is read back.

A speculative round (`_round`, one torch.compile(fullgraph) graph and, on CUDA, one CUDA graph per B):

1. propose (`DraftProposer.propose_step`, traced inline): the proposer's input buffers are filled from the
   previous round's verified batch, per slot: query = [last token, d_1..d_k] of that round at its positions,
   ``num_rejected = k - accepted``, ``last_sampled`` = the newest token; it writes draft KV and k new drafts
   (and their probabilities for rejection sampling).
2. target: one forward over [last token, d_1..d_k] of every row (uniform_query_len = k + 1) into the target
   cache; float32 logits at all k + 1 positions.
3. verify: ``greedy_verify`` on the logits; ``rejection_sample_logits`` straight from the logits and each
   request's temperature, top-k, top-p and min-p, against the draft's probabilities (token-wise, or with block
   verification); or ``typical_acceptance`` on softmax(logits / T). All give the create_output layout [B, k+1].
4. bookkeeping on the device (`_commit`): emitted tokens (cut after an EOS and at the request's cap) are
   appended to the slot's row of ``tokens``, ``length`` and ``last_token`` advance, the verified batch is kept
   as the next round's proposer query, stop flags and reasons are set, acceptance counters accumulate; with
   ``GeneratorConfig.logprobs`` each emitted token's log-probability is written beside it (the verifier's own,
   ``rejection_sample_logits``' logprobs output, for rejection sampling's processed mode; a gather and a
   logsumexp over the round's logits otherwise).

A target-only round (`_plain_round`) is step 2 with one token per row (uniform_query_len = 1), ``sample_draft``
on the logits (argmax for temperature 0, a seeded draw otherwise; ``sample_draft_filtered`` with
``sampling_filters``), and step 4.

The host (`generate`, `_HostLoop`) runs groups: a group is up to ``read_every`` round replays, then a copy of
``length``, ``stop_reason`` and ``tokens`` (and ``token_logprobs`` with logprobs) into one of two pinned host buffer
sets, with an event. It keeps two groups queued: it launches the next group before it waits for the oldest group's
event, then reads that snapshot, retires the requests it shows stopped (their slots and blocks are freed), admits
waiting ones into free slots and reports progress, while the device runs the next group (with a stream callback, it
streams each request's new tokens as it reads them, which may end requests too). A
request that stopped on the device while the host was a group behind has emitted nothing since (its row is
inactive), so its tokens are read exactly; snapshots taken before a slot's admission are skipped for it. The last
groups are sized from the rounds the live requests are expected to need, so few rounds run with no live row. No
round reads anything on the host.

Stopping and max_model_len. A round writes KV at positions up to ``length - 1 + k`` (target and draft alike), so
a request's length is capped at ``min(prompt + max_new_tokens, max_model_len - k)``: it finishes ("length") before
any position would reach max_model_len, and the ops' clamping of positions never applies. Both modes use the same
cap, so they stop at the same token. A prompt longer than ``max_model_len - k - 1`` is refused.

Randomness: every draw is a pure function of (the request's seed, a position or round, the op's purpose), so a
request's tokens do not depend on the other requests in the batch or on when it was admitted. The draft draws at
the positions of the tokens it is fed and the token-wise rejection sampler at the drafts' positions (its own
purposes); with block verification both draw at offsets that advance by k + 1 per round of the request instead
(the verifier from ``verify_offset``, the draft from it + BLOCK_DRAFT_STREAM_OFFSET), because its stop point
depends on every ACCEPT number and every draft of the round, so no later round may reuse one of their random
numbers; the target's own draws (first token, target-only rounds) are at the new token's position +
TARGET_STREAM_OFFSET. So no two draws that must be independent share a random number.

Sampling parameters. Each request has a temperature and, with ``sampling_filters``, top-k, top-p and min-p: the
processed distribution of `specdec_ops.ops.logits_sampling` is what the target samples (first token, target-only
rounds) and what the draft samples its drafts from (``sample_draft_filtered``, whose probabilities are the q of
verification), and rejection sampling verifies against the processed target distribution, so speculative output is
distributed as target-only output with the same parameters.
"""
from __future__ import annotations

import math
import operator
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import torch

from ..models.interface import AttentionMetadata
from ..ops.logits_sampling import rejection_sample_logits, sample_draft_filtered
from ..ops.sampling import sample_draft
from ..ops.verify import greedy_verify, typical_acceptance
from .graphs import StepGraphs, check_graph_mode
from .kv import BlockPool, BlockTable
from .proposer import DraftProposer, ProposerConfig, resolve_device, slot_mapping

METHODS = ("greedy", "rejection", "block", "typical")
LOGPROB_MODES = (None, "raw", "processed")
SAMPLING_METHODS = ("rejection", "block")  # verified by rejection_sample_logits against the draft's probabilities
# stop_reason codes on the device, and their names
RUNNING, STOP_EOS, STOP_MAX_TOKENS, STOP_LENGTH = 0, 1, 2, 3
STOP_BY_CALLER = 4  # host only: the generate call's stream callback ended the request
STOP_NAMES = {STOP_EOS: "eos", STOP_MAX_TOKENS: "max_tokens", STOP_LENGTH: "length", STOP_BY_CALLER: "stop"}
# The target's own draws (a request's first token, target-only rounds) use sample_draft at the new token's
# position plus this offset: the draft draws at the positions of the tokens it is fed, and a shared random number
# would correlate a draft with the token it continues, which biases rejection sampling.
TARGET_STREAM_OFFSET = 1 << 40
# With block verification the draft draws step s of a round at verify_offset + s plus this offset (clear of the
# target's positions + TARGET_STREAM_OFFSET): the round's stop point depends on all its drafts, so the next round
# must not draft with the numbers that made them, as drafting at the positions it continues from would.
BLOCK_DRAFT_STREAM_OFFSET = 1 << 41
# End-of-sequence ids a request may stop on (Llama 3 checkpoints list three); unused entries are -1.
MAX_EOS_TOKEN_IDS = 8
# Prompt tokens per prefill forward (the admitted prompts are packed, longer ones split): on the CPU the attention
# is the reference gather, which builds [T, C] context slots; on CUDA the Triton kernel reads the cache in place.
PREFILL_CHUNK = 256
PREFILL_CHUNK_CUDA = 2048
# With CUDA graphs, a prefill forward replays a graph captured at its token count padded to a power of two from
# PREFILL_MIN_GRAPH to PREFILL_CHUNK_CUDA (padding tokens write only the null block).
PREFILL_MIN_GRAPH = 16


@dataclass(frozen=True)
class GeneratorConfig:
    """Static sizes and settings of a `Generator`.

    num_speculative_tokens: k drafts per request and round (ignored by the target-only path, except for the
        length cap, which both paths share).
    method: "greedy" (greedy_verify; temperature must be 0), "rejection" (token-wise rejection sampling,
        rejection_sample_logits), "block" (block verification, rejection_sample_logits with block_verification:
        lossless too, and accepting at least as many drafts in expectation) or "typical" (typical_acceptance,
        with posterior_threshold and posterior_alpha; temperature only).
    sampling_filters: build the rounds with top-k, top-p and min-p, so that the requests' top_k, top_p and min_p
        apply (the draft then samples with sample_draft_filtered, the target-only path too). False: requests
        must leave them off, and the draft and target-only sampling skip the filter passes.
    max_num_reqs: request slots (the largest batch).
    max_model_len: the longest sequence (prompt + generated) the caches hold; at most the models' context
        (max_position_embeddings, where their config gives one).
    block_size: cache slots per KV block (both caches).
    batch_sizes: padded batch sizes, one graph each (default: powers of two up to max_num_reqs, and it).
    read_every: rounds per group: the host reads the device state once per group. A finished request's slot
        waits one to two groups for the host to see it and admit the next, and every group leaves the device
        about 40 us outside the round spans (the snapshot copy and the gap between replays). The default, 2,
        halves that cost against reading every round and is within 0.5 % of 8 at batch 1; reading every round
        refills sooner, which at batch 8 with refills won the one H200 run that compared both, though read_every 2
        ran faster still in another run with its own calibration (benchmarks/RESULTS.md, generation).
    overlap: the host keeps two groups queued, launching the next one before it reads the previous one's
        snapshot (False: it waits for each group before launching the next; the outputs are the same).
    logprobs: also return each generated token's log-probability (`RequestOutput.logprobs`, float32 values):
        None (default, not computed), "raw" (under softmax of the target's unscaled logits, what engines return
        by default) or "processed" (under the target's processed distribution at the token's position:
        temperature, then the filters; the distribution that rejection sampling's output follows, though a
        substitute token is drawn from a residual of it; 0 for a greedy request, whose distribution is one-hot;
        with typical acceptance, softmax(logits / T)). Either way the value is the target's, whether the token
        was a draft the target accepted or one the target chose.
    """

    num_speculative_tokens: int = 4
    method: str = "greedy"
    max_num_reqs: int = 8
    max_model_len: int = 512
    block_size: int = 16
    batch_sizes: Sequence[int] | None = None
    read_every: int = 2
    overlap: bool = True
    sampling_filters: bool = False
    logprobs: str | None = None
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3


@dataclass
class Request:
    """One generation request.

    prompt_ids: the prompt's token ids (list of ints, or a 1-D integer tensor on the CPU or the generator's
        device), at least one, each in [0, vocab_size); or its text (a str) when the Generator has a tokenizer,
        which encodes it as given (apply the model's chat template first where it expects one).
    max_new_tokens: tokens to generate at most (>= 1).
    temperature: 0 for greedy, else sampling from softmax(logits / temperature) (finite, >= 0).
    seed: the request's random stream (an int in [0, 2**63)).
    eos_token_id: generation stops after this token: an int, a list or tuple of up to MAX_EOS_TOKEN_IDS ints (it
        stops at the first of them, as Llama 3's several end-of-turn ids need), or None (no EOS stop).
    top_k: keep the top_k most probable tokens (an int >= 0; 0 = off). Needs GeneratorConfig.sampling_filters.
    top_p: keep the smallest set of most probable tokens whose probability reaches top_p (in (0, 1]; 1 = off).
    min_p: keep the tokens of probability >= min_p times the most probable one's (in [0, 1]; 0 = off).
        The three filters follow the processed distribution of `specdec_ops.ops.logits_sampling` (ties at a
        cut-off are kept together); a greedy request (temperature 0) ignores them.
    """

    prompt_ids: Sequence[int] | torch.Tensor | str
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0
    eos_token_id: int | list[int] | tuple[int, ...] | None = None
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0


@dataclass
class RequestOutput:
    """A finished request: its prompt's ids, the generated ids (EOS included when it stopped there), why it
    stopped ("eos", "max_tokens", "length": max_model_len, or "stop": the stream callback ended it) and, with
    GeneratorConfig.logprobs, each generated token's log-probability (None otherwise). text: with a Generator
    tokenizer, the generated ids decoded (`decode_generated`: special tokens skipped, a closing EOS dropped); None
    without one.

    num_rounds: the rounds its row was live in (its first token comes from the prefill, so a request that ran to
    its end emitted len(token_ids) - 1 tokens in them); acceptance_rate: its accepted / tested drafts (as
    GenerationMetrics.acceptance_rate; None for target-only generation or a request that ran no round). A
    request ended by the stream callback counts the rounds up to the snapshot that the host ended it on; the
    call's metrics also count those its row ran after it.
    """

    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    logprobs: list[float] | None = None
    num_rounds: int = 0
    acceptance_rate: float | None = None
    text: str | None = None


def decode_generated(tokenizer, token_ids: Sequence[int], eos_token_ids: Sequence[int]) -> str:
    """The text of generated ids: a closing end-of-sequence id (one of eos_token_ids) dropped, special tokens
    skipped; RequestOutput.token_ids keep the EOS."""
    token_ids = list(token_ids)
    if token_ids and token_ids[-1] in eos_token_ids:
        token_ids = token_ids[:-1]
    return tokenizer.decode(token_ids, skip_special_tokens=True)


@dataclass
class GenerationMetrics:
    """What one `Generator.generate` call measured.

    generated_tokens: all requests' generated tokens. wall_s: the call's wall time (warm-up excluded);
    prefill_s: host time spent queuing admissions (the prefills run on the device meanwhile); launch_s: host time
    spent queuing the round groups (graph replays on CUDA; a launch_s close to the groups' device time means the
    launches wait for the device, so the host cannot run ahead of it); tokens_per_s =
    generated_tokens / wall_s. rounds: rounds run;
    row_rounds: (live row, round) pairs; mean_emitted_per_round: tokens emitted per live row and round.
    acceptance_per_position[i]: share of live row-rounds whose draft i + 1 was accepted (a prefix: draft i + 1
    accepted implies drafts 1..i were); acceptance_rate: accepted / tested drafts, where a row-round tests its
    drafts up to and including the first rejected one (the per-draft alpha of Leviathan et al.).
    host_share: share of wall time in which no round ran on the device (CUDA: wall minus the CUDA-event time of
    the round groups; CPU: wall minus the time inside the round calls); admissions count in it.
    admission_share: the part of it spent in admissions (CUDA: the CUDA-event spans from an admission's first
    prefill kernel to its last state write; CPU: host time), so host_share - admission_share is the time between
    round groups outside admissions (a lower bound of the device's wait for the host). device_wait_share: share
    of wall time in which the device ran neither a round group nor an admission that the host had queued ahead of
    it (CUDA: an admission whose queuing ended before the device reached its first kernel, so that its span is
    device work alone; CPU: host time outside the rounds and admissions). It errs high: an admission that was
    not queued ahead counts whole, prefill kernels included (always the first one of a call, which finds the
    device idle), and so do the snapshot copies after each group; round groups always count as device work.
    split_ms: per-round time of the draft, target and verification parts, opt-in: filled only after
    `Generator.measure_split`, which times each part in rounds of its own at one batch size (not during this
    call); None otherwise.
    """

    speculative: bool
    method: str
    k: int
    num_requests: int = 0
    generated_tokens: int = 0
    wall_s: float = 0.0
    prefill_s: float = 0.0
    launch_s: float = 0.0
    rounds: int = 0
    row_rounds: int = 0
    mean_emitted_per_round: float = 0.0
    acceptance_per_position: list[float] = field(default_factory=list)
    acceptance_rate: float | None = None
    tokens_per_s: float = 0.0
    host_share: float = 0.0
    admission_share: float = 0.0
    device_wait_share: float = 0.0
    split_ms: dict[str, float] | None = None


class GenerationOutput(NamedTuple):
    requests: list[RequestOutput]  # in the order of the given requests
    metrics: GenerationMetrics


class _Prepared(NamedTuple):
    prompt: list[int]
    max_new_tokens: int
    temperature: float
    seed: int
    eos: tuple[int, ...]  # MAX_EOS_TOKEN_IDS ids, -1 for none
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0


def model_context(model) -> int | None:
    """The positions a model was trained for (its config's max_position_embeddings); None where it states none."""
    return getattr(getattr(model, "config", None), "max_position_embeddings", None) or None


def _pick(sizes: list[int], n: int) -> int:
    for size in sizes:
        if size >= n:
            return size
    raise ValueError(f"Generator: {n} live slots exceed the largest padded batch size {sizes[-1]}")


class Generator:
    """Speculative generation of a target with a draft model (or target-only with ``draft=None``).

    Args:
        target: the target model (specdec_ops.models.interface).
        draft: the draft model, or None for target-only generation. Its vocabulary must match the target's.
        config: `GeneratorConfig`.
        device: where the models, caches and graphs are.
        compile: torch.compile each round (fullgraph, one graph per padded batch size).
        cuda_graphs: True (default on CUDA): one captured CUDA graph per padded batch size; False: none.
        tokenizer: optional, with ``encode(text) -> list[int]`` and ``decode(ids, skip_special_tokens=...)``
            (`specdec_ops.models.load_tokenizer`'s): requests may then give their prompt as text, and every
            RequestOutput carries its generated text.
    """

    def __init__(self, target: torch.nn.Module, draft: torch.nn.Module | None, config: GeneratorConfig, *,
                 device: torch.device | str, compile: bool = True, cuda_graphs: bool | None = None,
                 tokenizer=None):
        device = resolve_device(device)
        k = config.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"Generator: num_speculative_tokens must be an int >= 1, got {k!r}")
        if config.method not in METHODS:
            raise ValueError(f"Generator: method must be one of {METHODS}, got {config.method!r}")
        for name in ("max_num_reqs", "max_model_len", "block_size", "read_every"):
            value = getattr(config, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Generator: config.{name} must be an int >= 1, got {value!r}")
        for name in ("overlap", "sampling_filters"):
            if not isinstance(getattr(config, name), bool):
                raise ValueError(f"Generator: config.{name} must be a bool, got {getattr(config, name)!r}")
        if config.logprobs not in LOGPROB_MODES:
            raise ValueError(f"Generator: config.logprobs must be one of {LOGPROB_MODES}, got {config.logprobs!r}")
        if config.sampling_filters and config.method == "typical":
            raise ValueError("Generator: method 'typical' takes the temperature only; sampling_filters needs "
                             "method 'rejection' or 'block' (or 'greedy', where temperature 0 ignores them)")
        for name in ("posterior_threshold", "posterior_alpha"):
            value = getattr(config, name)
            if isinstance(value, bool) or not (
                    isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"Generator: config.{name} must be a finite number >= 0, got {value!r}")
        if config.max_model_len < k + 2:
            raise ValueError(f"Generator: max_model_len = {config.max_model_len} leaves no room for a prompt and "
                             f"a round of k = {k} (needs >= k + 2)")
        for role, model in (("target", target), ("draft", draft)):
            # Positions past a model's context are outside what it was trained on (rotary angles it never saw).
            context = model_context(model)
            if context and config.max_model_len > context:
                raise ValueError(f"Generator: max_model_len = {config.max_model_len} exceeds the {role}'s context "
                                 f"of {context} positions (its max_position_embeddings)")
        if tokenizer is not None and not (callable(getattr(tokenizer, "encode", None))
                                          and callable(getattr(tokenizer, "decode", None))):
            raise ValueError(f"Generator: tokenizer must have encode and decode methods, got {type(tokenizer)!r}")
        if draft is not None and draft.vocab_size != target.vocab_size:
            raise ValueError(f"Generator: draft vocab_size {draft.vocab_size} != target vocab_size "
                             f"{target.vocab_size}")
        cuda_graphs = check_graph_mode("Generator", device, compile, cuda_graphs)
        if cuda_graphs == "reduce-overhead":
            raise ValueError("Generator: cuda_graphs must be True, False or None")
        self.target, self.draft, self.config, self.device = target, draft, config, device
        self.tokenizer = tokenizer
        self.speculative = draft is not None
        self.k = k
        self.vocab_size = target.vocab_size
        self.num_slots = config.max_num_reqs
        self.max_model_len = config.max_model_len
        self.block_size = config.block_size
        sizes = list(config.batch_sizes or self._default_sizes())
        for index, size in enumerate(sizes):
            if isinstance(size, bool) or not hasattr(size, "__index__"):
                raise ValueError(f"Generator: config.batch_sizes[{index}] must be an int, got {size!r}")
        self.batch_sizes = sorted(set(operator.index(b) for b in sizes))
        if self.batch_sizes[0] < 1 or self.batch_sizes[-1] > self.num_slots:
            raise ValueError(f"Generator: batch_sizes {self.batch_sizes} must lie in [1, {self.num_slots}]")
        if self.batch_sizes[-1] != self.num_slots:
            self.batch_sizes.append(self.num_slots)
        blocks_per_req = -(-self.max_model_len // self.block_size)
        self.num_blocks = 1 + self.num_slots * blocks_per_req
        self.compile, self.cuda_graphs = compile, cuda_graphs
        self._allocate_state(blocks_per_req)
        step = self._round if self.speculative else self._plain_round
        self.runner = StepGraphs(step, device=device, compile=compile, cuda_graphs=cuda_graphs,
                                 num_sizes=len(self.batch_sizes), owner="Generator")
        self.warmed: set[int] = set()
        self.split_ms: dict[int, dict[str, float]] = {}

    def _default_sizes(self) -> list[int]:
        sizes, size = [], 1
        while size < self.config.max_num_reqs:
            sizes.append(size)
            size *= 2
        return sizes + [self.config.max_num_reqs]

    def _allocate_state(self, blocks_per_req: int) -> None:
        device, slots, k, length = self.device, self.num_slots, self.k, self.max_model_len

        def zeros(*shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        if self.speculative:
            config = ProposerConfig(
                num_speculative_tokens=k, max_num_reqs=slots, max_num_tokens=slots * (k + 1), max_model_len=length,
                block_size=self.block_size, num_slots=slots, num_blocks=self.num_blocks,
                batch_sizes=self.batch_sizes, token_sizes=[b * (k + 1) for b in self.batch_sizes])
            # The generator traces the proposer's step inside its own round: the proposer itself is eager.
            self.proposer = DraftProposer(self.draft, config, device=device, compile=False, cuda_graphs=False,
                                          with_probs=self.config.method in SAMPLING_METHODS,
                                          filters=self.config.sampling_filters,
                                          round_streams=self.config.method == "block")
            self.block_table = self.proposer.block_table
        else:
            self.proposer = None
            self.block_table = BlockTable(slots, blocks_per_req, self.num_blocks, device)
        self.pool = BlockPool(self.num_blocks)
        spec = self.target.kv_cache_spec()
        self.kv_caches = tuple(zeros(self.num_blocks * self.block_size, 2, spec.num_kv_heads, spec.head_size,
                                     dtype=spec.dtype) for _ in range(spec.num_layers))
        # Per-slot state. tokens is flat [slots * (length + 1)]: column `length` of each row takes masked writes.
        self.tokens = zeros(slots * (length + 1), dtype=torch.int64)
        self.tokens_2d = self.tokens.view(slots, length + 1)
        # With config.logprobs: each token's log-probability, in the same layout (prompt columns unused).
        self.token_logprobs = zeros(slots * (length + 1), dtype=torch.float32) if self.config.logprobs else None
        self.length = torch.ones(slots, dtype=torch.int64, device=device)  # prompt + generated, >= 1
        self.cap = torch.ones(slots, dtype=torch.int64, device=device)
        self.cap_is_length = zeros(slots, dtype=torch.bool)  # the cap comes from max_model_len
        self.stop_reason = zeros(slots, dtype=torch.int64)
        self.active = zeros(slots, dtype=torch.bool)
        self.eos = torch.full((slots, MAX_EOS_TOKEN_IDS), -1, dtype=torch.int64, device=device)
        self.temperature = zeros(slots, dtype=torch.float32)
        self.top_k = zeros(slots, dtype=torch.int64)  # the filters, off until a request sets them
        self.top_p = torch.ones(slots, dtype=torch.float32, device=device)
        self.min_p = zeros(slots, dtype=torch.float32)
        self.seeds = zeros(slots, dtype=torch.int64)
        self.verify_offset = zeros(slots, dtype=torch.int64)  # block verification's stream offset per slot
        self.last_token = zeros(slots, dtype=torch.int64)
        # The previous round's verified batch: the proposer's next query.
        self.query_tokens = zeros(slots, k + 1, dtype=torch.int64)
        self.query_start = zeros(slots, dtype=torch.int64)
        self.num_rejected = zeros(slots, dtype=torch.int32)
        # Counters: accepted drafts per position, tested drafts, live row-rounds, emitted tokens.
        self.accepted_at = zeros(k, dtype=torch.int64)
        self.counts = zeros(3, dtype=torch.int64)  # (tested drafts, live row-rounds, emitted tokens)
        self.request_counts = zeros(slots, 3, dtype=torch.int64)  # per slot: (live rounds, tested, accepted drafts)
        # Split timing: the target part's logits for the verification part.
        self._split_logits = None
        self._split_runners: dict[str, StepGraphs] = {}
        self.cap_host = [1] * slots  # each slot's cap, on the host
        # Prefill graphs (CUDA graphs only): their inputs, padded; row `slots` of the block rows stays null.
        self._prefill_graphs: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if self.cuda_graphs:
            size = PREFILL_CHUNK_CUDA
            self._prefill_ids = zeros(size, dtype=torch.int64)
            self._prefill_positions = zeros(size, dtype=torch.int64)
            self._prefill_rows = torch.full((size,), slots, dtype=torch.int64, device=device)
            self._prefill_block_rows = zeros(slots + 1, blocks_per_req, dtype=torch.int64)

    # --- one round (traced) ---------------------------------------------------------------------------

    def _round(self, batch: int) -> None:
        """A speculative round at padded batch size `batch`, reading and writing only persistent buffers."""
        with torch.no_grad():
            active = self.active[:batch].clone()  # the round's live rows (_commit updates the flags)
            drafts, draft_probs = self._propose_part(batch, active)
            inputs, logits = self._target_part(batch, active, drafts)
            self._verify_part(batch, active, inputs, drafts, draft_probs, logits)

    def _propose_part(self, batch: int, active: torch.Tensor):
        """Fills the proposer's inputs from the previous verified batch and runs its step; (drafts, probs)."""
        proposer, k = self.proposer, self.k
        tokens = batch * (k + 1)
        rows = torch.arange(batch, device=self.device)
        offsets = torch.arange(k + 1, device=self.device)
        proposer.input_ids[:tokens] = self.query_tokens[:batch].reshape(-1).to(torch.int32)
        proposer.positions[:tokens] = (self.query_start[:batch, None] + offsets).reshape(-1)
        proposer.query_start_loc[: batch + 1] = (torch.arange(batch + 1, device=self.device) * (k + 1)).int()
        proposer.seq_lens[:batch] = (self.query_start[:batch] + k + 1).int()
        proposer.idx_mapping[:batch] = torch.where(active, rows, self.num_slots).int()
        proposer.num_rejected[:batch] = self.num_rejected[:batch]
        proposer.temperature[:batch] = self.temperature[:batch]
        if proposer.filters:
            proposer.top_k[:batch] = self.top_k[:batch]
            proposer.top_p[:batch] = self.top_p[:batch]
            proposer.min_p[:batch] = self.min_p[:batch]
        proposer.seeds[:batch] = self.seeds[:batch]
        if proposer.round_streams:
            proposer.stream_offsets[:batch] = self.verify_offset[:batch] + BLOCK_DRAFT_STREAM_OFFSET
        proposer.last_sampled[:batch] = self.last_token[:batch]
        proposer.live_counts[0] = batch
        proposer.live_counts[1] = tokens
        proposer.propose_step(batch, tokens)
        probs = proposer.draft_probs[:batch] if proposer.with_probs else None
        return proposer.draft_tokens[:batch], probs

    def _block_rows(self, batch: int, active: torch.Tensor) -> torch.Tensor:
        """[batch, blocks_per_req] int64 block rows of the round's slots; inactive rows get the null row."""
        table = self.block_table.tensor.clamp(0, self.num_blocks - 1).long()
        return torch.where(active[:, None], table[:batch], table[self.num_slots])

    def _target_part(self, batch: int, active: torch.Tensor, drafts: torch.Tensor):
        """The target forward over [last token, d_1..d_k] of every row: (input ids [B, k+1], logits [B, k+1, V])."""
        k, query = self.k, self.k + 1
        start = self.length[:batch] - 1  # the last token's position (its KV is not written yet)
        inputs = torch.cat([self.last_token[:batch, None], drafts], dim=1)
        positions = (start[:, None] + torch.arange(query, device=self.device)).reshape(-1)
        block_rows = self._block_rows(batch, active)
        token_rows = torch.arange(batch * query, device=self.device) // query
        metadata = AttentionMetadata(
            self.kv_caches, slot_mapping(block_rows[token_rows], positions, self.block_size, self.max_model_len),
            block_rows, token_rows, (start + k + 1)[token_rows], self.block_size, uniform_query_len=query)
        hidden = self.target(inputs.reshape(-1), positions, metadata)
        logits = self.target.compute_logits(hidden).float().view(batch, query, self.vocab_size)
        return inputs, logits

    def _target_probs(self, logits: torch.Tensor, batch: int) -> torch.Tensor:
        """softmax(logits / T) per row, one-hot at the argmax for greedy rows: [B, k+1, V] float32."""
        temperature = self.temperature[:batch, None, None]
        scaled = torch.softmax(logits / torch.where(temperature > 0, temperature, 1.0), dim=-1)
        greedy = torch.nn.functional.one_hot(logits.argmax(-1), self.vocab_size).float()
        return torch.where(temperature > 0, scaled, greedy)

    def _verify_part(self, batch, active, inputs, drafts, draft_probs, logits) -> None:
        """Verification, then the bookkeeping of the round and the proposer's next query."""
        k = self.k
        start = self.length[:batch] - 1
        method = self.config.method
        temperature = self.temperature[:batch]
        logprobs = None
        if method == "greedy":
            out = greedy_verify(logits, drafts)
        elif method in SAMPLING_METHODS:
            block = method == "block"
            offsets = self.verify_offset[:batch] if block else start + 1
            processed = self.config.logprobs == "processed"
            # Without sampling_filters no request sets one: None lets the op skip the filter pass.
            filters = ((self.top_k[:batch], self.top_p[:batch], self.min_p[:batch]) if self.config.sampling_filters
                       else (None, None, None))
            out = rejection_sample_logits(logits, drafts, temperature, *filters, self.seeds[:batch], offsets,
                                          draft_probs=draft_probs, block_verification=block,
                                          return_logprobs=processed)
            if processed:
                out, logprobs = out
            if block:
                self.verify_offset[:batch] += torch.where(active, k + 1, 0)
        else:
            out = typical_acceptance(self._target_probs(logits, batch), drafts, self.config.posterior_threshold,
                                     self.config.posterior_alpha)
        if self.config.logprobs and logprobs is None:
            # greedy and typical: no filters, so the processed distribution is softmax(logits / T) (one-hot when
            # greedy); with "raw", rejection sampling's rows too.
            logprobs = self._logprobs(logits, out.clamp(min=0), temperature[:, None])
        accepted = (out != -1).sum(1) - 1  # in [0, k]: every row emits the substitute or the bonus
        positions = torch.arange(k, device=self.device)
        self.accepted_at += (active[:, None] & (accepted[:, None] > positions)).sum(0)
        tested = torch.where(active, torch.clamp(accepted + 1, max=k), 0)
        self.counts[0] += tested.sum()
        self.request_counts[:batch, 1] += tested
        self.request_counts[:batch, 2] += torch.where(active, accepted, 0)
        self._commit(out, batch, active, logprobs)
        self.query_tokens[:batch] = torch.where(active[:, None], inputs, self.query_tokens[:batch])
        self.query_start[:batch] = torch.where(active, start, self.query_start[:batch])
        self.num_rejected[:batch] = torch.where(active, k - accepted, self.num_rejected[:batch].long()).int()

    def _plain_round(self, batch: int) -> None:
        """A target-only round: one token per live row, sampled by sample_draft (argmax for temperature 0)."""
        with torch.no_grad():
            active = self.active[:batch].clone()  # the round's live rows (_commit updates the flags)
            start = self.length[:batch] - 1
            block_rows = self._block_rows(batch, active)
            rows = torch.arange(batch, device=self.device)
            metadata = AttentionMetadata(
                self.kv_caches, slot_mapping(block_rows, start, self.block_size, self.max_model_len), block_rows,
                rows, start + 1, self.block_size, uniform_query_len=1)
            hidden = self.target(self.last_token[:batch], start, metadata)
            logits = self.target.compute_logits(hidden).float()
            token, logprob = self._sample_target(logits, self.temperature[:batch], self.top_k[:batch],
                                                 self.top_p[:batch], self.min_p[:batch], self.seeds[:batch],
                                                 start + 1 + TARGET_STREAM_OFFSET)
            self._commit(token[:, None], batch, active, None if logprob is None else logprob[:, None])

    def _sample_target(self, logits, temperature, top_k, top_p, min_p, seeds, positions):
        """The target's own draw of one token per row (first tokens, target-only rounds) from logits [n, V]
        float32: (int64 [n], its float32 [n] log-probability as config.logprobs says, or None)."""
        mode = self.config.logprobs
        if not self.config.sampling_filters:
            token = sample_draft(logits, temperature, seeds, positions)
        elif mode != "processed":
            token = sample_draft_filtered(logits, temperature, top_k, top_p, min_p, seeds, positions)
        else:  # the filtered distribution itself gives the processed log-probability
            probs = torch.empty_like(logits)
            token = sample_draft_filtered(logits, temperature, top_k, top_p, min_p, seeds, positions, probs)
            logprob = torch.log(probs.gather(1, token[:, None])[:, 0])
            return token, torch.where(temperature > 0, logprob, 0.0)
        if mode is None:
            return token, None
        return token, self._logprobs(logits, token, temperature)

    def _logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        """float32 log-probabilities of tokens [..., q] (in [0, V)) under logits [..., q, V] float32, without
        filters: "raw", softmax(logits); "processed", softmax(logits / T), 0 where T <= 0 (greedy: one-hot).
        temperature broadcasts against tokens."""
        if self.config.logprobs == "processed":
            logits = logits / torch.where(temperature > 0, temperature, 1.0)[..., None]
        logprob = logits.gather(-1, tokens[..., None])[..., 0] - torch.logsumexp(logits, dim=-1)
        if self.config.logprobs == "processed":
            logprob = torch.where(temperature > 0, logprob, 0.0)
        return logprob

    def _commit(self, out: torch.Tensor, batch: int, active: torch.Tensor, logprobs: torch.Tensor | None) -> None:
        """Appends each live row's emitted tokens (out [B, q], -1 = none) and, with config.logprobs, their
        log-probabilities (logprobs [B, q] float32; None without), and sets its stop flags, on the device."""
        q, width = out.shape[1], self.max_model_len + 1
        columns = torch.arange(q, device=self.device)
        length, cap = self.length[:batch], self.cap[:batch]
        emitted = torch.where(active, (out != -1).sum(1), 0)
        # -1 (no token) equals the unused EOS entries, but lies past `emitted`.
        is_eos = (out[:, :, None] == self.eos[:batch, None, :]).any(2) & (columns < emitted[:, None])
        eos_column = torch.where(is_eos.any(1), is_eos.int().argmax(1), q)
        emitted = torch.minimum(torch.minimum(emitted, eos_column + 1), (cap - length).clamp(min=0))
        hit_eos = eos_column < emitted
        write = columns < emitted[:, None]
        rows = torch.arange(batch, device=self.device)
        index = rows[:, None] * width + torch.where(write, (length[:, None] + columns).clamp(max=width - 1),
                                                     width - 1)
        self.tokens.index_put_((index.reshape(-1),), out.reshape(-1).long())
        if self.token_logprobs is not None:
            self.token_logprobs.index_put_((index.reshape(-1),), logprobs.reshape(-1))
        new_length = length + emitted
        newest = out.gather(1, (emitted - 1).clamp(min=0)[:, None])[:, 0].long()
        self.last_token[:batch] = torch.where(emitted > 0, newest, self.last_token[:batch])
        at_cap = new_length >= cap
        reason = torch.where(hit_eos, STOP_EOS, torch.where(
            at_cap, torch.where(self.cap_is_length[:batch], STOP_LENGTH, STOP_MAX_TOKENS), RUNNING))
        stops = active & (reason != RUNNING)
        self.stop_reason[:batch] = torch.where(stops, reason, self.stop_reason[:batch])
        self.active[:batch] = active & ~stops
        self.length[:batch] = new_length
        self.counts[1] += active.sum()
        self.counts[2] += emitted.sum()
        self.request_counts[:batch, 0] += active.long()

    # --- warm-up and timing ---------------------------------------------------------------------------

    def warm_up(self, progress: Callable[[str], None] | None = None) -> None:
        """Compiles (and on CUDA captures) the round at every padded size, with no live request.

        Rounds with no live row change nothing but the null block and the dump column, so this is safe while
        requests wait; it must run before requests are live, because a capture first runs the round twice.
        """
        if self.pool.owners:  # an admitted request holds blocks until it retires (the host's record, no sync)
            raise RuntimeError("Generator.warm_up: requests are live; warm up before generating")
        self._warm_up_prefill(progress)
        for batch in self.batch_sizes:
            if batch in self.warmed:
                continue
            if progress is not None:
                progress(f"warm-up: {'speculative' if self.speculative else 'target-only'} round at batch "
                         f"{batch} ({self.batch_sizes.index(batch) + 1}/{len(self.batch_sizes)})")
            start = time.perf_counter()
            self.runner.run(batch)
            self._sync()
            self.warmed.add(batch)
            if progress is not None:
                progress(f"  batch {batch} ready in {time.perf_counter() - start:.1f} s")

    @torch.no_grad()
    def _warm_up_prefill(self, progress) -> None:
        """With CUDA graphs: captures the prefill graphs of every padded size (the buffers hold null-row tokens,
        so the capture's run writes only the null block), so admissions never capture (a capture syncs)."""
        names = ("target", "draft") if self.speculative else ("target",)
        missing = [(n, s) for n in names for s in self._prefill_sizes() if (n, s) not in self._prefill_graphs] \
            if self.cuda_graphs else []
        if not missing:
            return
        if progress is not None:
            progress(f"warm-up: prefill graphs ({len(missing)})")
        self._prefill_ids.zero_()
        self._prefill_positions.zero_()
        self._prefill_rows.fill_(self.num_slots)
        self._prefill_block_rows.zero_()
        for name, size in missing:
            self._prefill_graph(name, size)
        self._sync()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def measure_split(self, batch: int, repeats: int = 10,
                      parts: Sequence[str] = ("draft", "target", "verify")) -> dict[str, float]:
        """Per-round milliseconds of the draft, target and verification parts at padded size `batch`.

        `parts` picks which of them to time (each costs one more compile per size); the whole round always is.

        Each part is its own step (compiled and graph-captured as the round is) over the same buffers, run with no
        live row (rows still compute at the padded size; only their writes are masked), timed by CUDA events
        around `repeats` replays (wall clock on CPU). Also times the whole round. Call it with no live request.
        """
        if self.pool.owners:  # as warm_up: the host's record of admitted requests
            raise RuntimeError("Generator.measure_split: requests are live")
        k = self.k
        if self._split_logits is None:
            self._split_logits = torch.zeros(self.num_slots, k + 1, self.vocab_size, device=self.device)
            self._split_drafts = torch.zeros(self.num_slots, k, dtype=torch.int64, device=self.device)

        def draft_part(b):
            with torch.no_grad():
                self._propose_part(b, self.active[:b])

        def target_part(b):
            with torch.no_grad():
                drafts = self.proposer.draft_tokens[:b] if self.speculative else self._split_drafts[:b]
                _, logits = self._target_part(b, self.active[:b], drafts)
                self._split_logits[:b] = logits

        def verify_part(b):
            with torch.no_grad():
                drafts = self.proposer.draft_tokens[:b]
                inputs = torch.cat([self.last_token[:b, None], drafts], dim=1)
                probs = self.proposer.draft_probs[:b] if self.proposer.with_probs else None
                self._verify_part(b, self.active[:b], inputs, drafts, probs, self._split_logits[:b])

        runners = {"round": self.runner}
        if self.speculative:
            for name, fn in (("draft", draft_part), ("target", target_part), ("verify", verify_part)):
                if name not in parts:
                    continue
                if name not in self._split_runners:
                    self._split_runners[name] = StepGraphs(
                        fn, device=self.device, compile=self.compile, cuda_graphs=self.cuda_graphs,
                        num_sizes=len(self.batch_sizes), owner="Generator.measure_split")
                runners[name] = self._split_runners[name]
        result = {}
        for name, runner in runners.items():
            runner.run(batch)  # compile / capture outside the timing
            self._sync()
            result[name] = self._time(lambda: runner.run(batch), repeats)
        self.split_ms[batch] = result
        return result

    def _time(self, fn, repeats: int) -> float:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / repeats
        begin = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - begin) * 1e3 / repeats

    # --- requests (host) ------------------------------------------------------------------------------

    def _prepare(self, index: int, request: Request) -> _Prepared:
        where = f"Generator.generate: requests[{index}]"
        prompt = request.prompt_ids
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{where}.prompt_ids is text; the Generator has no tokenizer to encode it "
                                 f"(Generator(..., tokenizer=load_tokenizer(path)), or pass token ids)")
            prompt = list(self.tokenizer.encode(prompt))
        if isinstance(prompt, torch.Tensor):
            if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
                raise ValueError(f"{where}.prompt_ids must hold integer token ids, got dtype {prompt.dtype}")
            if prompt.device.type != "cpu" and prompt.device != self.device:
                raise ValueError(f"{where}.prompt_ids must be on the CPU or on {self.device}, got {prompt.device}")
            if prompt.dim() != 1:
                raise ValueError(f"{where}.prompt_ids must be 1-D, got shape {tuple(prompt.shape)}")
            prompt = prompt.tolist()
        else:
            prompt = list(prompt)
            for position, token in enumerate(prompt):
                if isinstance(token, bool) or not isinstance(token, int):
                    raise ValueError(f"{where}.prompt_ids[{position}] must be an int token id, got {token!r}")
        if not prompt:
            raise ValueError(f"{where}.prompt_ids is empty; a prompt needs at least one token")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{where}.prompt_ids holds {bad[0]}, outside the vocabulary [0, {self.vocab_size})")
        longest = self.max_model_len - self.k - 1
        if len(prompt) > longest:
            raise ValueError(f"{where}: prompt of {len(prompt)} tokens; with max_model_len = {self.max_model_len} "
                             f"and k = {self.k} a prompt holds at most {longest}")
        max_new = request.max_new_tokens
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
            raise ValueError(f"{where}.max_new_tokens must be an int >= 1, got {max_new!r}")
        temperature = request.temperature
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
                math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"{where}.temperature must be a finite number >= 0, got {temperature!r}")
        if self.speculative and self.config.method == "greedy" and temperature > 0:
            raise ValueError(f"{where}.temperature = {temperature}: method 'greedy' verifies by argmax; use "
                             f"method 'rejection' or 'block' (or 'typical') for temperature > 0")
        top_k, top_p, min_p = request.top_k, request.top_p, request.min_p
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"{where}.top_k must be an int >= 0 (0 = off), got {top_k!r}")
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise ValueError(f"{where}.top_p must be a number in (0, 1] (1 = off), got {top_p!r}")
        if isinstance(min_p, bool) or not isinstance(min_p, (int, float)) or not 0 <= min_p <= 1:
            raise ValueError(f"{where}.min_p must be a number in [0, 1] (0 = off), got {min_p!r}")
        if (top_k, top_p, min_p) != (0, 1, 0) and not self.config.sampling_filters:
            raise ValueError(f"{where} sets top_k = {top_k}, top_p = {top_p}, min_p = {min_p}: the generator was "
                             f"built without filters (GeneratorConfig.sampling_filters=True applies them)")
        seed = request.seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63:
            raise ValueError(f"{where}.seed must be an int in [0, 2**63), got {seed!r}")
        eos = self._eos_ids(where, request.eos_token_id)
        return _Prepared(prompt, max_new, float(temperature), seed, eos, top_k, float(top_p), float(min_p))

    def _eos_ids(self, where: str, eos) -> tuple[int, ...]:
        """Request.eos_token_id as MAX_EOS_TOKEN_IDS ids padded with -1."""
        expected = (f"None, an int in [0, {self.vocab_size}) or a list or tuple of at most {MAX_EOS_TOKEN_IDS} "
                    f"such ints")
        if eos is None:
            ids = []
        elif isinstance(eos, int) and not isinstance(eos, bool):
            ids = [eos]
        elif isinstance(eos, (list, tuple)) and len(eos) <= MAX_EOS_TOKEN_IDS:
            ids = list(eos)
        else:
            raise ValueError(f"{where}.eos_token_id must be {expected}, got {eos!r}")
        for token in ids:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size:
                raise ValueError(f"{where}.eos_token_id must be {expected}, got {eos!r}")
        return tuple(ids) + (-1,) * (MAX_EOS_TOKEN_IDS - len(ids))

    def _to_device(self, values: torch.Tensor) -> torch.Tensor:
        """A host tensor on the generator's device: on CUDA through pinned memory with a non-blocking copy, so the
        host does not wait for the rounds queued before it (the caching host allocator keeps the pinned buffer
        until the copy has run)."""
        if self.device.type != "cuda":
            return values.to(self.device)
        return values.pin_memory().to(self.device, non_blocking=True)

    @torch.no_grad()
    def _admit(self, slots: Sequence[int], requests: Sequence[_Prepared]) -> None:
        """Prefills `requests` into the free `slots` (slots[i] takes requests[i]) and sets their device state.

        One batched prefill per model: all prompts' tokens are packed into forwards of up to the prefill chunk,
        each token attending to its own request's cache. Nothing here waits for the device: the prompts and the
        per-request values travel in one pinned non-blocking copy, the first tokens are sampled and written on
        the device, and a request whose first token is its EOS is stopped on the device (the host learns it from
        the next snapshot; a stop at the cap the host knows already).
        """
        k, width = self.k, self.max_model_len + 1
        ids: list[int] = []
        positions: list[int] = []
        token_rows: list[int] = []
        draft_tokens: list[int] = []  # indices into the packed tokens the draft prefills (each prompt but its last)
        # per request: slot, length, cap, cap_is_length, seed, stop unless EOS, last, top_k, its EOS ids
        fields: list[int] = []
        temperatures: list[float] = []
        top_ps: list[float] = []
        min_ps: list[float] = []
        for row, (slot, request) in enumerate(zip(slots, requests)):
            prompt = request.prompt
            length = len(prompt)
            cap = min(length + request.max_new_tokens, self.max_model_len - k)
            # Every position the request's rounds can write: up to cap - 1 + k.
            blocks = self.pool.allocate(-(-min(cap + k, self.max_model_len) // self.block_size), owner=slot)
            self.block_table.assign(slot, blocks, where="Generator")
            self.cap_host[slot] = cap
            cap_is_length = cap < length + request.max_new_tokens
            stop = RUNNING if length + 1 < cap else (STOP_LENGTH if cap_is_length else STOP_MAX_TOKENS)
            first = len(ids)
            draft_tokens.extend(range(first, first + length - 1))
            ids.extend(prompt)
            positions.extend(range(length))
            token_rows.extend([row] * length)
            fields.extend((slot, length, cap, int(cap_is_length), request.seed, stop, first + length - 1,
                           request.top_k, *request.eos))
            temperatures.append(request.temperature)
            top_ps.append(request.top_p)
            min_ps.append(request.min_p)
        count, num_tokens, num_draft = len(slots), len(ids), len(draft_tokens)
        packed = self._to_device(torch.tensor(ids + positions + token_rows + draft_tokens + fields,
                                              dtype=torch.int64))
        temperature, top_p_d, min_p_d = self._to_device(
            torch.tensor(temperatures + top_ps + min_ps, dtype=torch.float32)).view(3, count).unbind(0)
        ids_d, positions_d, rows_d = packed[:3 * num_tokens].view(3, num_tokens).unbind(0)
        draft_d = packed[3 * num_tokens: 3 * num_tokens + num_draft]
        per_request = packed[3 * num_tokens + num_draft:].view(count, 8 + MAX_EOS_TOKEN_IDS)
        slot_d, length_d, cap_d, cap_is_length_d, seed_d, stop_d, last_d, top_k_d = per_request[:, :8].unbind(1)
        eos_d = per_request[:, 8:]
        block_rows = self.block_table.tensor.long()[slot_d]  # [count, blocks_per_req]

        hidden = self._prefill("target", block_rows, ids_d, positions_d, rows_d, keep=True)
        logits = self.target.compute_logits(hidden[last_d]).float()
        first, first_logprob = self._sample_target(logits, temperature, top_k_d, top_p_d, min_p_d, seed_d,
                                                   length_d + TARGET_STREAM_OFFSET)
        if self.speculative and num_draft:
            self._prefill("draft", block_rows, ids_d[draft_d], positions_d[draft_d], rows_d[draft_d], keep=False)

        self.tokens_2d.index_fill_(0, slot_d, 0)
        self.tokens.index_put_((slot_d[rows_d] * width + positions_d,), ids_d)
        self.tokens.index_put_((slot_d * width + length_d,), first)
        if self.token_logprobs is not None:
            self.token_logprobs.index_put_((slot_d * width + length_d,), first_logprob)
        stop = torch.where((first[:, None] == eos_d).any(1), STOP_EOS, stop_d)
        self.length.index_copy_(0, slot_d, length_d + 1)
        self.cap.index_copy_(0, slot_d, cap_d)
        self.cap_is_length.index_copy_(0, slot_d, cap_is_length_d.bool())
        self.stop_reason.index_copy_(0, slot_d, stop)
        self.active.index_copy_(0, slot_d, stop == RUNNING)
        self.eos.index_copy_(0, slot_d, eos_d)
        self.temperature.index_copy_(0, slot_d, temperature)
        self.top_k.index_copy_(0, slot_d, top_k_d)
        self.top_p.index_copy_(0, slot_d, top_p_d)
        self.min_p.index_copy_(0, slot_d, min_p_d)
        self.verify_offset.index_fill_(0, slot_d, 0)
        self.request_counts.index_fill_(0, slot_d, 0)
        self.seeds.index_copy_(0, slot_d, seed_d)
        self.last_token.index_copy_(0, slot_d, first)
        self.query_start.index_copy_(0, slot_d, length_d - 1)
        self.num_rejected.index_fill_(0, slot_d, k)
        # The proposer's first query: [last prompt token, k placeholders], all k "rejected".
        query = torch.zeros(count, k + 1, dtype=torch.int64, device=self.device)
        query[:, 0] = ids_d[last_d]
        self.query_tokens.index_copy_(0, slot_d, query)

    def _model(self, name: str):
        """(model, its KV caches) of "target" or "draft"."""
        if name == "target":
            return self.target, self.kv_caches
        return self.draft, self.proposer.kv_caches

    def _prefill(self, name: str, block_rows, ids, positions, token_rows, keep: bool):
        """Packed prompt tokens through the `name` model's paged cache, in forwards of up to the prefill chunk
        (eager, or replays of captured graphs with CUDA graphs); token t belongs to request row token_rows[t] of
        block_rows and attends to its positions <= positions[t] (earlier chunks wrote the earlier ones).
        Returns the hidden states [T, H] when `keep`, else None."""
        if self.cuda_graphs:
            return self._prefill_replayed(name, block_rows, ids, positions, token_rows, keep)
        model, kv_caches = self._model(name)
        chunk = PREFILL_CHUNK_CUDA if self.device.type == "cuda" else PREFILL_CHUNK
        hidden = []
        for begin in range(0, ids.shape[0], chunk):
            end = begin + chunk
            out = self._prefill_forward(model, kv_caches, block_rows, ids[begin:end], positions[begin:end],
                                        token_rows[begin:end])
            if keep:
                hidden.append(out)
        return torch.cat(hidden) if keep else None

    def _prefill_forward(self, model, kv_caches, block_rows, ids, positions, token_rows):
        metadata = AttentionMetadata(
            kv_caches, slot_mapping(block_rows[token_rows], positions, self.block_size, self.max_model_len),
            block_rows, token_rows, positions + 1, self.block_size)
        return model(ids, positions, metadata)

    def _prefill_sizes(self) -> list[int]:
        sizes, size = [], PREFILL_MIN_GRAPH
        while size < PREFILL_CHUNK_CUDA:
            sizes.append(size)
            size *= 2
        return sizes + [PREFILL_CHUNK_CUDA]

    def _prefill_graph(self, name: str, size: int):
        """The captured prefill forward of `name` over the first `size` entries of the prefill buffers (captured
        on first use: a run on a side stream, which JIT-compiles its kernels, then the recording)."""
        key = (name, size)
        if key not in self._prefill_graphs:
            model, kv_caches = self._model(name)

            def forward():
                return self._prefill_forward(model, kv_caches, self._prefill_block_rows, self._prefill_ids[:size],
                                             self._prefill_positions[:size], self._prefill_rows[:size])

            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                forward()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                hidden = forward()
            self._prefill_graphs[key] = (graph, hidden)
        return self._prefill_graphs[key]

    def _prefill_replayed(self, name, block_rows, ids, positions, token_rows, keep: bool):
        """`_prefill` by graph replays: each chunk is copied into the prefill buffers, padded to its graph's size
        with tokens of the null row (position 0), whose KV writes land in the null block."""
        count, total = block_rows.shape[0], ids.shape[0]
        self._prefill_block_rows.zero_()
        self._prefill_block_rows[:count] = block_rows
        hidden = None
        for begin in range(0, total, PREFILL_CHUNK_CUDA):
            n = min(PREFILL_CHUNK_CUDA, total - begin)
            size = next(s for s in self._prefill_sizes() if s >= n)
            self._prefill_ids[:n] = ids[begin: begin + n]
            self._prefill_positions[:n] = positions[begin: begin + n]
            self._prefill_rows[:n] = token_rows[begin: begin + n]
            self._prefill_ids[n:size] = 0
            self._prefill_positions[n:size] = 0
            self._prefill_rows[n:size] = self.num_slots
            graph, out = self._prefill_graph(name, size)
            graph.replay()
            if keep:
                if hidden is None:
                    hidden = torch.empty(total, out.shape[1], dtype=out.dtype, device=out.device)
                hidden[begin: begin + n] = out[:n]
        return hidden

    def _retire(self, slot: int) -> None:
        self.pool.release(self.block_table.clear(slot))
        # fill_ on a slice: `self.active[slot] = False` copies a host scalar into the 0-dim view, which on CUDA
        # waits for every round in flight (the host could not run ahead of the device at a retirement).
        self.active[slot: slot + 1].fill_(False)

    # --- the host loop --------------------------------------------------------------------------------

    def generate(self, requests: Sequence[Request], *, progress: Callable[[int, int], None] | None = None,
                 stream: Callable[[int, list[int]], int | None] | None = None,
                 warm_up_progress: Callable[[str], None] | None = None) -> GenerationOutput:
        """Generates every request with continuous batching; returns their outputs (in order) and the metrics.

        progress(new_tokens, finished_requests) is called after every host read.

        stream(index, token_ids), when given, receives each request's tokens as the host reads them: after every
        read, for each request that generated tokens since its last call (index: its place in `requests`), the
        new ones in order. It returns None to go on, or an int n in [0, len(token_ids)] to end the request after
        the first n of these tokens (finish reason "stop": a stop string, a cancelled client); its slot and blocks
        are freed at once, and the rounds already queued for it change nothing that another request reads. A
        request's calls together give its RequestOutput.token_ids, but for the tokens past n of the call that
        ended it.

        When the call raises (a bad request, a raising callback, an interrupt), its requests are dropped and the
        generator is ready for the next call.
        """
        prepared = [self._prepare(i, r) for i, r in enumerate(requests)]
        self.warm_up(warm_up_progress)
        self.accepted_at.zero_()
        self.counts.zero_()
        self.stop_reason.zero_()
        try:
            return _HostLoop(self, prepared, progress, stream).run()
        except BaseException:  # an error or an interrupt (a raising progress callback, Ctrl-C) mid-generation
            self._abandon()
            raise

    def _abandon(self) -> None:
        """Stops every request on the device and gives all blocks back, so that the generator runs again after an
        interrupted `generate`. Like a normal retirement, the writes queue behind the rounds already launched, and
        the next admissions behind them."""
        for slot in range(self.num_slots):
            if self.block_table.blocks(slot):
                self._retire(slot)
        if self.pool.owners:  # allocated, not yet in a block-table row (interrupted inside an admission)
            self.pool.release(list(self.pool.owners))
        self.active.zero_()

    def _metrics(self, outputs, wall: float, prefill_s: float, rounds: int, round_s: float,
                 admission_s: float, launch_s: float, busy_s: float) -> GenerationMetrics:
        counts, accepted_at = (t.tolist() for t in _read_to_host(self.counts, self.accepted_at))
        generated = sum(len(o.token_ids) for o in outputs)
        tested, row_rounds, emitted = counts
        metrics = GenerationMetrics(
            speculative=self.speculative, method=self.config.method if self.speculative else "target-only",
            k=self.k if self.speculative else 0, num_requests=len(outputs), generated_tokens=generated,
            wall_s=wall, prefill_s=prefill_s, launch_s=launch_s, rounds=rounds, row_rounds=row_rounds,
            mean_emitted_per_round=emitted / row_rounds if row_rounds else 0.0,
            tokens_per_s=generated / wall if wall > 0 else 0.0,
            host_share=max(0.0, 1.0 - round_s / wall) if wall > 0 else 0.0,
            admission_share=min(1.0, admission_s / wall) if wall > 0 else 0.0,
            device_wait_share=max(0.0, 1.0 - busy_s / wall) if wall > 0 else 0.0)
        if self.speculative and row_rounds:
            metrics.acceptance_per_position = [a / row_rounds for a in accepted_at]
            metrics.acceptance_rate = sum(accepted_at) / tested if tested else 0.0
        if self.split_ms:
            metrics.split_ms = dict(self.split_ms[max(self.split_ms)])
        return metrics


class _HostLoop:
    """The host side of one `Generator.generate` call: admissions, round groups, snapshot reads, retirements.

    A group is n rounds (n <= read_every; n = 0 for a snapshot alone) and a snapshot of the device state. With
    config.overlap, the host keeps two groups queued: it launches the next group before it waits for the oldest
    one's snapshot, so the device runs a group while the host reads, retires, admits and launches. The last groups
    are sized from what the live requests still need: a live row emits at most k + 1 tokens per round, so a group
    ends no later than the first round at which the longest request could reach its cap, and no round runs past
    a request's last token (a round with no live row costs as much as a full one); a request that emits less
    costs one more, shorter group, and the device waits for the host between such groups.
    """

    def __init__(self, generator: Generator, prepared: list[_Prepared], progress, stream):
        self.g, self.prepared, self.progress, self.stream = generator, prepared, progress, stream
        self.streamed = [0] * len(prepared)  # per request: generated tokens given to `stream`
        self.request_counts = None  # the newest snapshot's per-slot counters
        self.on_cuda = generator.device.type == "cuda"
        self.snapshot = _Snapshot(generator, pinned=self.on_cuda)
        self.outputs: list[RequestOutput | None] = [None] * len(prepared)
        self.waiting = deque(range(len(prepared)))
        self.free = list(range(generator.num_slots))
        self.live: dict[int, int] = {}  # slot -> request index
        self.admitted_after: dict[int, int] = {}  # slot -> groups launched before its admission
        self.known_length: dict[int, int] = {}  # slot -> its length as of the newest snapshot that covers it
        self.read_length: dict[int, int] = {}  # slot -> the same, but from snapshots only (not its admission)
        self.known_at: dict[int, int] = {}  # slot -> rounds launched before that snapshot
        self.in_flight: deque = deque()  # (group number, rounds launched through it, snapshot handle)
        self.groups = self.rounds = 0
        self.round_spans: list = []  # CUDA: (begin, end) events of each group's rounds
        self.admission_spans: list = []  # CUDA: (begin, end) events of each admission
        self.queued_ahead: list[bool] = []  # CUDA, per admission: all queued before the device reached it
        self.round_s = self.admission_s = 0.0  # host time inside the round calls / the admissions
        self.finished = self.finished_tokens = self.reported = 0

    def _begin(self):
        if not self.on_cuda:
            return None
        begin = torch.cuda.Event(enable_timing=True)
        begin.record()
        return begin

    def _end(self, begin, spans: list) -> None:
        if begin is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            spans.append((begin, end))

    def admit_waiting(self) -> None:
        """Admits waiting requests into the free slots, lowest slots first (keeps the padded batch small)."""
        count = min(len(self.waiting), len(self.free))
        if not count:
            return
        self.free.sort()
        slots, self.free = self.free[:count], self.free[count:]
        indices = [self.waiting.popleft() for _ in range(count)]
        begin, t0 = self._begin(), time.perf_counter()
        self.g._admit(slots, [self.prepared[i] for i in indices])
        self.admission_s += time.perf_counter() - t0
        self._end(begin, self.admission_spans)
        if begin is not None:
            self.queued_ahead.append(not begin.query())  # the device has not reached the admission yet
        for slot, index in zip(slots, indices):
            self.live[slot] = index
            self.admitted_after[slot] = self.groups
            self.known_at[slot] = self.rounds
            self.known_length[slot] = len(self.prepared[index].prompt) + 1
            self.read_length.pop(slot, None)

    def rounds_wanted(self) -> int:
        """Rounds for the next group: read_every, or fewer when every live request may stop sooner (beyond the
        rounds already launched); <= 0 when none can need another round before the next snapshot."""
        # A live row emits at most k + 1 tokens per round (one target-only): a group never outlasts the earliest
        # round at which the request that needs the most rounds could reach its token cap.
        most_per_round = self.g.k + 1 if self.g.speculative else 1
        need = 0
        for slot in self.live:
            remaining = self.g.cap_host[slot] - self.known_length[slot]
            need = max(need, math.ceil(remaining / most_per_round) - (self.rounds - self.known_at[slot]))
        return min(self.g.config.read_every, need)

    def launch(self, rounds: int) -> None:
        """Queues `rounds` rounds (at the padded size of the highest live slot) and a snapshot after them."""
        if rounds > 0:
            batch = _pick(self.g.batch_sizes, max(self.live) + 1)
            begin, t0 = self._begin(), time.perf_counter()
            for _ in range(rounds):
                self.g.runner.run(batch)
            self.round_s += time.perf_counter() - t0
            self._end(begin, self.round_spans)
        self.groups += 1
        self.rounds += max(rounds, 0)
        self.in_flight.append((self.groups, self.rounds, self.snapshot.take()))

    def read(self) -> None:
        """Waits for the oldest group's snapshot, then retires the requests it shows stopped (a stopped row
        emits nothing in later rounds, so its tokens are final however far the device has run ahead)."""
        group, rounds, handle = self.in_flight.popleft()
        length, stop_reason, tokens, self.request_counts, *logprobs = self.snapshot.wait(handle)
        lengths, stops = length.tolist(), stop_reason.tolist()
        for slot in list(self.live):
            if group <= self.admitted_after[slot]:
                continue  # this snapshot predates the slot's request
            index = self.live[slot]
            self.known_length[slot], self.known_at[slot] = lengths[slot], rounds
            self.read_length[slot] = lengths[slot]
            prompt_len = len(self.prepared[index].prompt)
            if self.stream is not None and lengths[slot] > prompt_len + self.streamed[index]:
                # Tokens up to a row's length are final: later rounds only append.
                begin = prompt_len + self.streamed[index]
                keep = self.stream(index, tokens[slot, begin: lengths[slot]].tolist())
                if keep is not None:
                    if isinstance(keep, bool) or not isinstance(keep, int) or not 0 <= keep <= lengths[slot] - begin:
                        raise ValueError(f"Generator.generate: stream returned {keep!r} for requests[{index}]; "
                                         f"expected None or an int in [0, {lengths[slot] - begin}]")
                    # Its row may still be live on the device: retiring it queues behind the rounds in flight
                    # (which write only its own blocks), and no snapshot is read for it again.
                    del self.live[slot]
                    kept = slice(prompt_len, begin + keep)
                    self.finish(slot, index, tokens[slot, kept].tolist(), STOP_BY_CALLER,
                                logprobs[0][slot, kept].tolist() if logprobs else None)
                    continue
                self.streamed[index] = lengths[slot] - prompt_len
            if stops[slot] != RUNNING:
                del self.live[slot]
                generated = slice(prompt_len, lengths[slot])
                self.finish(slot, index, tokens[slot, generated].tolist(), stops[slot],
                            logprobs[0][slot, generated].tolist() if logprobs else None)
        if self.progress is not None:
            # Tokens the host has read: a request that the stream callback ends keeps at least those it was shown.
            total = self.finished_tokens + sum(self.read_length.get(s, len(self.prepared[i].prompt)) -
                                               len(self.prepared[i].prompt) for s, i in self.live.items())
            self.progress(total - self.reported, self.finished)
            self.reported = total

    def finish(self, slot: int, index: int, tokens: list[int], reason: int, logprobs: list[float] | None) -> None:
        rounds, tested, accepted = self.request_counts[slot].tolist()
        acceptance = accepted / tested if self.g.speculative and tested else None
        prepared = self.prepared[index]
        text = None if self.g.tokenizer is None else decode_generated(self.g.tokenizer, tokens, prepared.eos)
        self.outputs[index] = RequestOutput(prepared.prompt, tokens, STOP_NAMES[reason], logprobs, rounds,
                                            acceptance, text)
        self.g._retire(slot)
        self.free.append(slot)
        self.finished += 1
        self.finished_tokens += len(tokens)

    def run(self) -> GenerationOutput:
        depth = 2 if self.g.config.overlap else 1
        start = time.perf_counter()
        while self.waiting or self.live:
            self.admit_waiting()
            if self.live:
                while len(self.in_flight) < depth:
                    rounds = self.rounds_wanted()
                    if rounds <= 0:
                        break
                    self.launch(rounds)
                if not self.in_flight:
                    self.launch(0)  # every live request is known to stop: a snapshot to retire them
            if self.in_flight:
                self.read()
        while self.in_flight:  # groups launched for requests that turned out to stop earlier
            self.snapshot.wait(self.in_flight.popleft()[2])
        self.g._sync()
        wall = time.perf_counter() - start
        if self.on_cuda:
            round_s = sum(b.elapsed_time(e) for b, e in self.round_spans) / 1e3
            spans = [b.elapsed_time(e) / 1e3 for b, e in self.admission_spans]
            admission_s = sum(spans)
            busy_s = round_s + sum(span for span, ahead in zip(spans, self.queued_ahead) if ahead)
        else:
            round_s, admission_s = self.round_s, self.admission_s
            busy_s = round_s + admission_s
        metrics = self.g._metrics(self.outputs, wall, self.admission_s, self.rounds, round_s, admission_s,
                                  self.round_s, busy_s)
        return GenerationOutput(self.outputs, metrics)


def _read_to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Host copies of device tensors: on CUDA pinned non-blocking copies and an event the host waits for (as the
    snapshots wait; torch's sync debug mode does not flag it), else clones."""
    if not tensors or tensors[0].device.type != "cuda":
        return [t.detach().cpu().clone() for t in tensors]
    copies = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for dst, src in zip(copies, tensors):
        dst.copy_(src, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    event.synchronize()
    return copies


class _Snapshot:
    """Host copies of the generator's length, stop_reason, tokens, request_counts and (with logprobs)
    token_logprobs, in two sets used in turn (a group's snapshot is read while the next group's is taken).

    On CUDA the sets are pinned, each copy is queued without a sync and followed by an event that `wait`
    synchronizes with; elsewhere a copy is plain.
    """

    def __init__(self, generator: Generator, pinned: bool):
        self.sources = (generator.length, generator.stop_reason, generator.tokens_2d, generator.request_counts)
        if generator.token_logprobs is not None:
            self.sources += (generator.token_logprobs.view(generator.tokens_2d.shape),)
        self.pinned = pinned
        self.sets = [[torch.empty(s.shape, dtype=s.dtype, pin_memory=pinned) for s in self.sources]
                     for _ in range(2)]
        self.turn = 0

    def take(self):
        buffers = self.sets[self.turn]
        self.turn = (self.turn + 1) % len(self.sets)
        for dst, src in zip(buffers, self.sources):
            dst.copy_(src, non_blocking=self.pinned)
        event = None
        if self.pinned:
            event = torch.cuda.Event()
            event.record()
        return buffers, event

    def wait(self, handle):
        buffers, event = handle
        if event is not None:
            event.synchronize()
        return buffers

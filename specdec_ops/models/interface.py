"""The model interface that `DraftProposer` and the generator drive: one definition for draft and target.

A model is any ``nn.Module`` with these members:

- ``vocab_size: int``
- ``kv_cache_spec() -> KVCacheSpec(num_layers, num_kv_heads, head_size, dtype)``: what its paged cache holds.
- ``forward(input_ids [T] int32/int64, positions [T] int64, attn_metadata) -> hidden [T, H]``.
  With an `AttentionMetadata`, layer i first writes each token's K and V to
  ``kv_caches[i][slot_mapping[t]]`` (``index_put_`` straight into the cache tensor, not into a view of it, so
  that inductor updates it in place), then token t attends to its request's context: context position c of
  token t lives at cache slot ``block_tables[token_rows[t], c // block_size] * block_size + c % block_size``
  and is visible when ``c <= positions[t]`` and ``c < seq_lens[t]``. With ``attn_metadata=None`` the model runs
  dense causal attention over one whole sequence and keeps no cache (the readable, cache-free statement of what
  the paged path must compute).
  Ids may be out of the vocabulary on padded rows: clamp before the embedding lookup. The paged forward must
  trace with ``torch.compile(fullgraph=True)`` and be CUDA-graph safe (static shapes, no host sync).
- ``compute_logits(hidden [n, H]) -> logits [n, V]`` in the model dtype; callers pass the rows they need
  (``hidden[last_token_indices]`` for a prefill, every row of a verify batch).

`specdec_ops.models.LlamaModel` implements it for target and draft alike (its ``attention_backend`` picks the
gather reference or the Triton kernel that reads the cache in place, `attention.py`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class KVCacheSpec(NamedTuple):
    """What a model needs from its paged KV cache."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype


class AttentionMetadata(NamedTuple):
    """Per-token paged-attention inputs of one forward (see the module docstring)."""

    kv_caches: tuple[torch.Tensor, ...]  # per layer [num_blocks * block_size, 2, num_kv_heads, head_size]
    slot_mapping: torch.Tensor  # [T] int64, cache slot each token's K/V is written to
    block_tables: torch.Tensor  # [R, blocks_per_req] int64, block ids of each request row, all inside the cache
    token_rows: torch.Tensor  # [T] int64, the block_tables row of each token's request
    seq_lens: torch.Tensor  # [T], each token's request's sequence length (visible context is c < seq_lens[t])
    block_size: int
    # When every row's tokens are exactly `uniform_query_len` consecutive tokens (token t in row t // q), a
    # static int that lets an attention kernel use a dense [R, q] query layout; None for ragged batches.
    uniform_query_len: int | None = None


def context_slots(metadata: AttentionMetadata) -> torch.Tensor:
    """Cache slot of every context position of every token, [T, blocks_per_req * block_size] int64."""
    offsets = torch.arange(metadata.block_size, device=metadata.block_tables.device)
    rows = metadata.block_tables.long()[metadata.token_rows]
    return (rows[:, :, None] * metadata.block_size + offsets).flatten(1)

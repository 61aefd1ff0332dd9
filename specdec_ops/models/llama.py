"""A small Llama-style reference draft model that runs inside `DraftProposer`.

RMSNorm, rotary embeddings (NeoX layout), grouped-query attention and a
SwiGLU MLP, in plain PyTorch, with random seeded weights. It follows the
model interface of specdec_ops/models/interface.py: ``vocab_size``,
``kv_cache_spec()``, ``forward(input_ids, positions, attn_metadata)`` and
``compute_logits(hidden)``.

Attention over the paged cache works for the varlen step-0 batch and the
one-token decode steps alike, with static shapes only: each layer first
writes every token's K and V at its slot, then gathers each token's request
context through its block-table row (`interface.context_slots`) up to a static length
(blocks_per_req * block_size) and masks context positions ``c > position`` or ``c >=
seq_len``. Masked scores use the dtype's most negative finite value, not
-inf, so padding rows whose whole context is masked stay finite (a NaN
written to the null block could otherwise leak into live requests through
0 * NaN). With ``attn_metadata=None`` the model runs dense causal attention
over one whole sequence and keeps no cache: the tests' `greedy_reference` uses that as
the naive, cache-free statement of what greedy drafting must produce.

Cost: the gather materializes [T, C] context rows per layer, so the varlen
step 0 (T = tokens + requests) moves T * C * 2 * kv_heads * head_size
elements per layer; decode steps (T = requests) are cheap. A fused paged
attention kernel would avoid that copy; this model favours plain, compilable
PyTorch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .interface import AttentionMetadata, KVCacheSpec, context_slots


@dataclass(frozen=True)
class DraftModelConfig:
    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    dtype: torch.dtype = torch.float32

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads


# For CPU demos and tests.
TINY_CONFIG = DraftModelConfig()
# The benchmark's draft model (scripts/bench_propose.py).
BENCH_CONFIG = DraftModelConfig(vocab_size=32000, hidden_size=1024, num_layers=4, num_heads=16, num_kv_heads=4,
                                intermediate_size=2816, dtype=torch.bfloat16)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return x32.to(x.dtype) * self.weight


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX-style rotation of x [T, heads, head_size] by per-token angles (cos, sin [T, head_size / 2])."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].to(cos.dtype), x[..., half:].to(cos.dtype)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: DraftModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_size = config.head_size
        h, d = config.hidden_size, config.head_size
        self.qkv_proj = nn.Linear(h, (config.num_heads + 2 * config.num_kv_heads) * d, bias=False)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=False)
        self.scale = d ** -0.5

    def forward(self, x, cos, sin, positions, metadata: AttentionMetadata | None):
        tokens, d = x.shape[0], self.head_size
        q, k, v = self.qkv_proj(x).split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], -1)
        q = apply_rotary(q.view(tokens, self.num_heads, d), cos, sin)
        k = apply_rotary(k.view(tokens, self.num_kv_heads, d), cos, sin)
        v = v.view(tokens, self.num_kv_heads, d)
        if metadata is None:
            out = self._dense(q, k, v, positions)
        else:
            out = self._paged(q, k, v, positions, metadata)
        return self.o_proj(out.reshape(tokens, self.num_heads * d))

    def _attend(self, q, keys, values, visible):
        """q [T, heads, d]; keys, values [T, C, kv_heads, d]; visible [T, C] -> [T, heads, d]."""
        tokens, group = q.shape[0], self.num_heads // self.num_kv_heads
        q = q.view(tokens, self.num_kv_heads, group, self.head_size)
        scores = torch.einsum("tkgd,tckd->tkgc", q, keys)
        if scores.dtype in (torch.float16, torch.bfloat16):
            scores = scores.float()  # softmax in float32
        scores = scores * self.scale
        scores = scores.masked_fill(~visible[:, None, None, :], torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        return torch.einsum("tkgc,tckd->tkgd", probs, values).reshape(tokens, self.num_heads, self.head_size)

    def _dense(self, q, k, v, positions):
        # One whole sequence, no cache: every token sees the tokens at positions <= its own.
        tokens = q.shape[0]
        visible = positions[None, :] <= positions[:, None]
        keys = k[None].expand(tokens, -1, -1, -1)
        values = v[None].expand(tokens, -1, -1, -1)
        return self._attend(q, keys, values, visible)

    def _paged(self, q, k, v, positions, metadata: AttentionMetadata):
        cache = metadata.kv_caches[self.layer_index]  # [num_blocks * block_size, 2, kv_heads, d]
        # Into the cache tensor itself (not a view), so that compiled code updates it in place.
        cache.index_put_((metadata.slot_mapping,), torch.stack((k, v), dim=1).to(cache.dtype))
        # Each token's request context, through its block-table row: [T, C, 2, kv_heads, d].
        context = cache[context_slots(metadata)]
        c = torch.arange(context.shape[1], device=q.device)
        visible = (c[None, :] <= positions[:, None]) & (c[None, :] < metadata.seq_lens[:, None])
        return self._attend(q, context[:, :, 0].to(q.dtype), context[:, :, 1].to(q.dtype), visible)


class DecoderLayer(nn.Module):
    def __init__(self, config: DraftModelConfig, layer_index: int):
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer_index)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x, cos, sin, positions, metadata):
        x = x + self.attn(self.input_norm(x), cos, sin, positions, metadata)
        gate, up = self.gate_up_proj(self.post_attn_norm(x)).chunk(2, dim=-1)
        return x + self.down_proj(nn.functional.silu(gate) * up)


class DraftModel(nn.Module):
    """The reference draft model; random weights drawn from `seed`."""

    def __init__(self, config: DraftModelConfig = TINY_CONFIG, *, device: torch.device | str = "cpu",
                 seed: int = 0):
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._init_weights(seed)
        self.to(device=device, dtype=config.dtype)
        self.requires_grad_(False)
        # Rotary angles in float32 (float64 for a float64 model), never in half precision.
        half = config.head_size // 2
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(half, dtype=torch.float64) / half)
        angle_dtype = torch.float64 if config.dtype == torch.float64 else torch.float32
        self.register_buffer("inv_freq", inv_freq.to(device=device, dtype=angle_dtype), persistent=False)

    def _init_weights(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                continue
            fan_in = p.shape[1] if p.dim() == 2 and "embed" not in name else 1
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in ** 0.5)

    def kv_cache_spec(self) -> KVCacheSpec:
        c = self.config
        return KVCacheSpec(c.num_layers, c.num_kv_heads, c.head_size, c.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata | None = None) -> torch.Tensor:
        # Padded rows may carry any id; clamping keeps the lookup in bounds.
        x = self.embed_tokens(input_ids.long().clamp(0, self.vocab_size - 1))
        angles = positions.to(self.inv_freq.dtype)[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()
        for layer in self.layers:
            x = layer(x, cos, sin, positions, attn_metadata)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

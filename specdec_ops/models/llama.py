"""One Llama-family decoder for target and draft: Llama 2/3, Qwen2, SmolLM2 (the Llama architecture).

RMSNorm, rotary embeddings (NeoX layout, the layout of Hugging Face checkpoints; Llama 3 rope scaling),
grouped-query attention (optional bias on the q/k/v projections, as in Qwen2) and a SwiGLU MLP, in plain
PyTorch. The q/k/v projections are one fused matrix ``qkv_proj`` and gate/up one ``gate_up_proj``
(checkpoints are concatenated at load time, `loading.py`); the nn.Linear modules hold the weights and every
projection runs through `linear.linear` (a Triton kernel for 1 to 16 rows of a half-precision CUDA model,
F.linear otherwise). Embeddings are tied or untied. Weights are
random and seeded (`LlamaModel(config, seed=...)`) or loaded (`loading.load_model`).

For 1 to 16 tokens of a float16/bfloat16 CUDA model (decode and verify steps) a decoder layer runs fused: four
projection kernels (RMSNorm in the prologue of q/k/v and of gate/up, silu(gate) * up and the residual adds in
the epilogues, `linear.fused_linear`) and one kernel for the rotary embedding of q and k and the cache write
of k and v (`attention.rope_write_kv`), in place of about a dozen kernels.

For more than 16 tokens of such a model (prompt prefills, and the rounds' larger verify and decode steps;
`elementwise.runs_elementwise_kernels` decides) the four projections stay cuBLAS GEMMs and the work between them
runs in Triton kernels (`elementwise.py`): RMSNorm with the residual add before it (`add_rms_norm`: the add after
attention folds into the post-attention norm, the add after the MLP into the next layer's input norm or the model's
final norm), silu(gate) * up, and with a paged cache the same rotary + cache-write kernel. A layer is then the 4
GEMMs, 2 norm kernels, the rotary + cache write, silu(gate) * up and attention (1 kernel, or 2 when the context is
split): 9 or 10 kernels, where the plain code launches 47 or 48 (eight per norm, ten per rotary of q and of k, two
for the cache write, one per residual add, two for silu and the product; the final norm: one kernel in place of
eight).

Everything else (CPU, float32 and float64 models; the rotary of the cache-free dense path) runs the plain code
below, which is also the statement of what both fused paths compute.

It follows the model interface of specdec_ops/models/interface.py: ``vocab_size``, ``kv_cache_spec()``,
``forward(input_ids, positions, attn_metadata)`` and ``compute_logits(hidden)``.

Attention over the paged cache: each layer first writes every token's K and V at its slot (``index_put_``
into the cache tensor; in the fused paths, the rotary + cache-write kernel), then attends through
`attention.py`, chosen by ``attention_backend``:

- ``"reference"``: gathers each token's request context through its block-table row up to a static length
  (blocks_per_row * block_size) and masks positions ``c > position`` or ``c >= seq_len`` (the most negative
  finite value, not -inf, so fully masked padding rows stay finite: a NaN written to the null block could
  otherwise leak into live requests through 0 * NaN). Plain, compilable PyTorch; it materializes [T, C]
  context rows per layer.
- ``"triton"``: ``torch.ops.specdec_models.paged_attention``, the Triton kernel on CUDA that reads the cache
  in place (the reference on other devices).
- ``"auto"`` (default): triton on CUDA for float32/float16/bfloat16 models, reference otherwise (CPU, float64).

With ``attn_metadata=None`` the model runs dense causal attention over one whole sequence and keeps no cache:
the cache-free statement of what the paged path must compute.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from . import attention as _attention
from . import elementwise as _elementwise
from .attention import apply_rotary
from . import linear as _linear
from .linear import linear
from .interface import AttentionMetadata, KVCacheSpec

ATTENTION_BACKENDS = ("auto", "reference", "triton")


@dataclass(frozen=True)
class LlamaConfig:
    """Shapes and constants of a Llama-family decoder.

    head_size defaults to hidden_size // num_heads (checkpoints may set it, as ``head_dim``). rope_scaling is
    None (plain rotary), or a dict with ``rope_type`` "llama3" (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings) or "linear" (factor). eos_token_id is the checkpoint's first end-of-sequence
    id, eos_token_ids all of them.
    """

    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    dtype: torch.dtype = torch.float32
    head_size: int | None = None
    rope_scaling: dict | None = field(default=None, hash=False)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # every id that ends generation (Llama 3 lists several)
    max_position_embeddings: int | None = None
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self):
        if self.head_size is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"LlamaConfig: hidden_size ({self.hidden_size}) must be a multiple of num_heads "
                                 f"({self.num_heads}) when head_size is not given")
            object.__setattr__(self, "head_size", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"LlamaConfig: num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.head_size % 2:
            raise ValueError(f"LlamaConfig: head_size must be even for rotary embeddings, got {self.head_size}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "linear", "default"):
                raise ValueError(f"LlamaConfig: rope_scaling type {kind!r} is not supported "
                                 "(expected 'llama3', 'linear' or 'default')")


# The proposer's name for the same configuration.
DraftModelConfig = LlamaConfig

# For CPU demos and tests.
TINY_CONFIG = LlamaConfig()
# The benchmark's draft model (scripts/bench_propose.py).
BENCH_CONFIG = LlamaConfig(vocab_size=32000, hidden_size=1024, num_layers=4, num_heads=16, num_kv_heads=4,
                           intermediate_size=2816, dtype=torch.bfloat16)


def rotary_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse rotary frequencies [head_size / 2] float64, with the config's rope scaling applied."""
    half = config.head_size // 2
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(half, dtype=torch.float64) / half)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend in between.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled)
    return inv_freq


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, **factory):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, **factory))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return x32.to(x.dtype) * self.weight

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(x + residual), x + residual) in one kernel (`elementwise.add_rms_norm`; the sum rounded to x's
        dtype first, as ``x = x + ...`` stores it); residual None: (self(x), x) (`elementwise.rms_norm`).
        x, residual [T, size] in the weight's dtype."""
        if residual is None:
            return _elementwise.rms_norm(x, self.weight, self.eps), x
        return _elementwise.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_index: int, **factory):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_size = config.head_size
        h, d = config.hidden_size, config.head_size
        self.qkv_proj = nn.Linear(h, (config.num_heads + 2 * config.num_kv_heads) * d, bias=config.attention_bias,
                                  **factory)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=False, **factory)
        self.scale = d ** -0.5

    def takes_rope_kernel(self, qkv: torch.Tensor, metadata: AttentionMetadata | None) -> bool:
        """Whether `attend` can run fused (`attention.rope_write_kv`): a paged cache of qkv's dtype."""
        return metadata is not None and metadata.kv_caches[self.layer_index].dtype == qkv.dtype

    def forward(self, x, cos, sin, positions, metadata: AttentionMetadata | None, backend: str):
        qkv = linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        return linear(self.attend(qkv, cos, sin, positions, metadata, backend), self.o_proj.weight)

    def attend(self, qkv, cos, sin, positions, metadata: AttentionMetadata | None, backend: str,
               fused: bool = False) -> torch.Tensor:
        """Rotary embedding, the cache write and attention of the projected qkv [T, (heads + 2 kv_heads) * d];
        returns [T, heads * d]. fused: rotary and cache write in one kernel (`attention.rope_write_kv`)."""
        tokens, d = qkv.shape[0], self.head_size
        if metadata is not None and fused:
            cache = metadata.kv_caches[self.layer_index]
            q = _attention.rope_write_kv(qkv, cos, sin, cache, metadata.slot_mapping, self.num_heads,
                                         self.num_kv_heads)
            out = self._attend_cache(q, cache, positions, metadata, backend)
            return out.reshape(tokens, self.num_heads * d)
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], -1)
        q = apply_rotary(q.view(tokens, self.num_heads, d), cos, sin)
        k = apply_rotary(k.view(tokens, self.num_kv_heads, d), cos, sin)
        v = v.view(tokens, self.num_kv_heads, d)
        if metadata is None:
            out = self._dense(q, k, v, positions)
        else:
            out = self._paged(q, k, v, positions, metadata, backend)
        return out.reshape(tokens, self.num_heads * d)

    def _dense(self, q, k, v, positions):
        # One whole sequence, no cache: every token sees the tokens at positions <= its own.
        tokens, group = q.shape[0], self.num_heads // self.num_kv_heads
        visible = positions[None, :] <= positions[:, None]
        qg = q.view(tokens, self.num_kv_heads, group, self.head_size)
        scores = torch.einsum("tkgd,ckd->tkgc", qg, k)
        if scores.dtype in (torch.float16, torch.bfloat16):
            scores = scores.float()
        scores = (scores * self.scale).masked_fill(~visible[:, None, None, :], torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        return torch.einsum("tkgc,ckd->tkgd", probs, v).reshape(tokens, self.num_heads, self.head_size)

    def _paged(self, q, k, v, positions, metadata: AttentionMetadata, backend: str):
        cache = metadata.kv_caches[self.layer_index]  # [num_blocks * block_size, 2, kv_heads, d]
        # Into the cache tensor itself (not a view), so that compiled code updates it in place.
        cache.index_put_((metadata.slot_mapping,), torch.stack((k, v), dim=1).to(cache.dtype))
        return self._attend_cache(q, cache, positions, metadata, backend)

    def _attend_cache(self, q, cache, positions, metadata: AttentionMetadata, backend: str):
        args = (q, cache, metadata.block_tables, metadata.token_rows, positions, metadata.seq_lens,
                metadata.block_size, self.scale)
        if backend == "reference":
            return _attention.paged_attention_reference(*args)
        return torch.ops.specdec_models.paged_attention(*args, metadata.uniform_query_len or 0)


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer_index: int, **factory):
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.attn = Attention(config, layer_index, **factory)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False, **factory)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False, **factory)

    def forward(self, x, cos, sin, positions, metadata, backend):
        if _linear.takes_kernel(x, self.gate_up_proj.weight):
            return self._forward_fused(x, cos, sin, positions, metadata, backend)
        x = x + self.attn(self.input_norm(x), cos, sin, positions, metadata, backend)
        gate, up = linear(self.post_attn_norm(x), self.gate_up_proj.weight).chunk(2, dim=-1)
        return x + linear(nn.functional.silu(gate) * up, self.down_proj.weight)

    def _forward_fused(self, x, cos, sin, positions, metadata, backend):
        # The same math in four projection kernels (norms in the prologues of q/k/v and gate/up, silu(gate) * up
        # and the residual adds in the epilogues) and one rotary + cache-write kernel.
        attn = self.attn
        qkv = _linear.fused_linear(x, attn.qkv_proj.weight, norm_weight=self.input_norm.weight,
                                   eps=self.input_norm.eps, bias=attn.qkv_proj.bias)
        out = attn.attend(qkv, cos, sin, positions, metadata, backend, fused=attn.takes_rope_kernel(qkv, metadata))
        x = _linear.fused_linear(out, attn.o_proj.weight, residual=x)
        act = _linear.fused_linear(x, self.gate_up_proj.weight, norm_weight=self.post_attn_norm.weight,
                                   eps=self.post_attn_norm.eps, gated=True)
        return _linear.fused_linear(act, self.down_proj.weight, residual=x)

    def forward_deferred_residual(self, x, residual, cos, sin, positions, metadata, backend):
        """The plain forward's math with its elementwise work in Triton kernels
        (`elementwise.runs_elementwise_kernels`: a forward of many tokens of a half-precision CUDA model) and each
        residual add folded into the norm after it.

        The layer's input is x + residual: x [T, hidden] the previous layer's MLP output, residual [T, hidden]
        the residual stream it adds to (None for the first layer, whose x is the embedding). Returns
        (mlp_out, residual), whose sum (rounded to the model dtype) is what `forward` returns; the next layer's
        input norm, or the model's final norm, adds them.
        """
        attn = self.attn
        h, residual = self.input_norm.add_and_norm(x, residual)
        qkv = linear(h, attn.qkv_proj.weight, attn.qkv_proj.bias)
        out = attn.attend(qkv, cos, sin, positions, metadata, backend, fused=attn.takes_rope_kernel(qkv, metadata))
        h, residual = self.post_attn_norm.add_and_norm(linear(out, attn.o_proj.weight), residual)
        act = _elementwise.silu_mul(linear(h, self.gate_up_proj.weight))
        return linear(act, self.down_proj.weight), residual


class LlamaModel(nn.Module):
    """A Llama-family decoder; random weights drawn from `seed` (``init_weights=False`` leaves them
    uninitialized, for a loader to fill).

    config: the shapes; device: where the weights live; attention_backend: "auto", "reference" or "triton"
    (see the module docstring; settable later through the attribute of the same name).
    """

    def __init__(self, config: LlamaConfig = TINY_CONFIG, *, device: torch.device | str = "cpu", seed: int = 0,
                 attention_backend: str = "auto", init_weights: bool = True):
        super().__init__()
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"LlamaModel: attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {attention_backend!r}")
        device = torch.device(device)
        self.config = config
        self.vocab_size = config.vocab_size
        self.attention_backend = attention_backend
        # Built on the meta device and then allocated: no throwaway default initialization of large weights.
        factory = dict(device="meta", dtype=config.dtype)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, **factory)
        self.layers = nn.ModuleList(DecoderLayer(config, i, **factory) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **factory)
        self.to_empty(device=device)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        if init_weights:
            self._init_weights(seed, device)
        self.requires_grad_(False)
        # Rotary angles in float32 (float64 for a float64 model), never in half precision.
        angle_dtype = torch.float64 if config.dtype == torch.float64 else torch.float32
        self.register_buffer("inv_freq", rotary_inv_freq(config).to(device=device, dtype=angle_dtype),
                             persistent=False)

    def _init_weights(self, seed: int, device: torch.device) -> None:
        # Drawn on the CPU for CPU models (reproducible across machines), on the device otherwise (fast).
        gen_device = device if device.type == "cuda" else torch.device("cpu")
        gen = torch.Generator(device=gen_device).manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                continue
            fan_in = p.shape[1] if p.dim() == 2 and "embed" not in name else 1
            with torch.no_grad():
                values = torch.randn(p.shape, generator=gen, device=gen_device, dtype=torch.float32)
                if name.endswith("bias"):
                    values *= 0.1
                p.copy_(values / fan_in ** 0.5)

    @property
    def head_weight(self) -> torch.Tensor:
        """The output projection [vocab, hidden] (the embedding when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def kv_cache_spec(self) -> KVCacheSpec:
        c = self.config
        return KVCacheSpec(len(self.layers), c.num_kv_heads, c.head_size, c.dtype)

    def _backend(self, device: torch.device) -> str:
        if self.attention_backend == "auto":
            # The kernel computes in float32: a float64 model (exactness tests) keeps the float64 reference.
            fast = device.type == "cuda" and self.config.dtype in _attention.KERNEL_DTYPES
            return "triton" if fast else "reference"
        return self.attention_backend

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata | None = None) -> torch.Tensor:
        """input_ids [T] int32/int64 (clamped into the vocabulary), positions [T] int64, attn_metadata: the
        paged cache (None: dense causal attention over one sequence). Returns hidden states [T, hidden]."""
        backend = self._backend(input_ids.device)
        # Padded rows may carry any id; clamping keeps the lookup in bounds.
        x = self.embed_tokens(input_ids.long().clamp(0, self.vocab_size - 1))
        angles = positions.to(self.inv_freq.dtype)[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()
        if _elementwise.runs_elementwise_kernels(x):
            residual = None
            for layer in self.layers:
                x, residual = layer.forward_deferred_residual(x, residual, cos, sin, positions, attn_metadata,
                                                              backend)
            return self.norm.add_and_norm(x, residual)[0]
        for layer in self.layers:
            x = layer(x, cos, sin, positions, attn_metadata, backend)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, vocab] in the model dtype."""
        return linear(hidden, self.head_weight)

    def truncated(self, num_layers: int) -> "LlamaModel":
        """A model of the first `num_layers` decoder layers sharing this one's embedding, final norm and head
        (no weight copy): the built-in draft of a target."""
        if not 1 <= num_layers <= len(self.layers):
            raise ValueError(f"LlamaModel.truncated: num_layers must lie in [1, {len(self.layers)}], "
                             f"got {num_layers}")
        new = copy.copy(self)
        new._modules = dict(self._modules)
        new._parameters = dict(self._parameters)
        new._buffers = dict(self._buffers)
        new.layers = nn.ModuleList(list(self.layers)[:num_layers])
        new.config = dataclasses.replace(self.config, num_layers=num_layers)
        return new


# The proposer's name for the same model.
DraftModel = LlamaModel

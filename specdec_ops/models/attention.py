"""Paged attention over the KV cache of `interface.AttentionMetadata`: a readable reference and a Triton kernel.

Both compute, for every query token t and head h,

    out[t, h] = softmax_c(q[t, h] . K[c] * scale) @ V[c]   over visible context positions c,

where context position c of token t lives at cache slot
``block_tables[token_rows[t], c // block_size] * block_size + c % block_size`` and is visible when
``c <= positions[t]`` and ``c < seq_lens[t]``; query head h reads KV head ``h // (heads / kv_heads)``.

- `paged_attention_reference`: gathers each token's whole context ([T, C] slots, C = blocks_per_row *
  block_size) and runs a masked softmax in plain PyTorch. The CPU path and the statement of the semantics.
  A token with no visible position gets the mean of its gathered values (finite, never used).
- The Triton kernel (`paged_attention_triton`) reads the cache in place. One program handles a tile of
  consecutive query tokens times the query heads of one KV head (GQA heads share every K/V load) over one
  split of the context, with an online softmax in float32. When every token of a tile belongs to the same
  request row (always true for the uniform decode / verify layout) the tile streams that row's blocks once;
  a tile that straddles rows (ragged prefill) takes each of its tokens in turn. Long contexts with few programs
  are split (flash-decoding) and the partial results combined by a second kernel. A token with no visible
  position gets zeros.
- `torch.ops.specdec_models.paged_attention`: the op models call; a `torch.library.custom_op` with a fake kernel,
  so torch.compile(fullgraph=True) traces it as one node and CUDA graphs capture its launches (with dependent
  launch on Hopper, dependent_launch.py). Off CUDA, and for dtypes other than float32/float16/bfloat16, it runs
  the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import dependent_launch
from .dependent_launch import release_and_wait

# What the kernel takes (it accumulates in float32); other dtypes run the reference.
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Aim for about this many programs per launch before splitting the context (a few waves on an H200's 132 SMs).
TARGET_PROGRAMS = 512
MAX_SPLITS = 64
# The shortest context split worth a program. Measured on the H200 (2026-12-01, 32/8 heads x 64, bf16, table of
# 4096 positions): a batch-1 decode step's layer takes 6.0 us with 64 splits of 64 against 9.2 us with 16 of 256;
# batches of 8 and more keep their splits (TARGET_PROGRAMS decides), where more splits measured slower.
MIN_SPLIT_LEN = 64
# Query rows (tokens x query heads of one KV head) of a tile at most, before a uniform layout falls back to the
# ragged tiling (register pressure).
MAX_TILE_ROWS = 128
# Software-pipelining depth of the context loop (Triton's default on CUDA).
NUM_STAGES = 3
# Verify steps (a uniform layout of several tokens per request, one request per tile) read 128 context positions
# per loop step, two stages deep: the 1B-shaped target's verify step at batch 8 measured 1.469 ms against 1.526
# at context 512 and 1.790 against 1.903 at 4096 (H200, 2026-12-02, benchmarks/RESULTS.md). Decode steps keep 64
# and NUM_STAGES.
VERIFY_BLOCK_N = 128
VERIFY_NUM_STAGES = 2
# rope_write_kv: steps of up to this many tokens (decode, small verify batches) take one head per program, the
# shortest programs; longer ones take ROPE_HEADS_PER_PROGRAM heads per program, fewer and fuller. On the H200
# (2026-12-02) the 1B-shaped target's 128-token prefill took 2.1 against 5.4 us per layer in this kernel, and its
# verify steps at context 512 1.211 against 1.236 ms (batch 8) and 1.619 against 1.760 (batch 32).
ROPE_ONE_HEAD_TOKENS = 16
ROPE_HEADS_PER_PROGRAM = 8


def _check_inputs(q, kv_cache, block_tables, token_rows, positions, seq_lens, block_size):
    if q.dim() != 3:
        raise ValueError(f"paged_attention: q must be [T, heads, head_size], got shape {tuple(q.shape)}")
    if kv_cache.dim() != 4 or kv_cache.shape[1] != 2 or kv_cache.shape[3] != q.shape[2]:
        raise ValueError(f"paged_attention: kv_cache must be [slots, 2, kv_heads, {q.shape[2]}], "
                         f"got shape {tuple(kv_cache.shape)}")
    if q.shape[1] % kv_cache.shape[2]:
        raise ValueError(f"paged_attention: heads ({q.shape[1]}) must be a multiple of kv_heads "
                         f"({kv_cache.shape[2]})")
    if block_tables.dim() != 2:
        raise ValueError(f"paged_attention: block_tables must be [R, blocks_per_row], got {tuple(block_tables.shape)}")
    tokens = q.shape[0]
    for name, t in (("token_rows", token_rows), ("positions", positions), ("seq_lens", seq_lens)):
        if t.shape != (tokens,):
            raise ValueError(f"paged_attention: {name} must have shape [{tokens}], got {tuple(t.shape)}")
    if block_size < 1 or kv_cache.shape[0] % block_size:
        raise ValueError(f"paged_attention: kv_cache slots ({kv_cache.shape[0]}) must be a multiple of "
                         f"block_size ({block_size})")
    if tokens > 0 and (block_tables.shape[0] == 0 or kv_cache.shape[0] == 0):
        raise ValueError(f"paged_attention: {tokens} tokens need at least one block_tables row and one cache "
                         f"block, got block_tables {tuple(block_tables.shape)} and kv_cache {tuple(kv_cache.shape)}")
    for name, t in (("kv_cache", kv_cache), ("block_tables", block_tables), ("token_rows", token_rows),
                    ("positions", positions), ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"paged_attention: {name} is on {t.device}, expected {q.device} like q")


def paged_attention_reference(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                              token_rows: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                              block_size: int, scale: float) -> torch.Tensor:
    """Paged attention by gathering each token's context (see the module docstring).

    q [T, heads, d] (any float dtype); kv_cache [num_blocks * block_size, 2, kv_heads, d];
    block_tables [R, blocks_per_row] int32/int64, values inside the cache; token_rows [T] int, values in [0, R);
    positions [T] int64; seq_lens [T] int; block_size: slots per cache block; scale: softmax scale.
    Returns [T, heads, d] in q's dtype (softmax in float32 for half dtypes).
    """
    tokens, heads, d = q.shape
    kv_heads = kv_cache.shape[2]
    offsets = torch.arange(block_size, device=q.device)
    slots = (block_tables.long()[token_rows.long()][:, :, None] * block_size + offsets).flatten(1)
    context = kv_cache[slots]  # [T, C, 2, kv_heads, d]
    keys, values = context[:, :, 0].to(q.dtype), context[:, :, 1].to(q.dtype)
    c = torch.arange(slots.shape[1], device=q.device)
    visible = (c[None, :] <= positions[:, None]) & (c[None, :] < seq_lens[:, None])
    qg = q.view(tokens, kv_heads, heads // kv_heads, d)
    scores = torch.einsum("tkgd,tckd->tkgc", qg, keys)
    if scores.dtype in (torch.float16, torch.bfloat16):
        scores = scores.float()
    scores = scores * scale
    # The most negative finite value, not -inf: a row with nothing visible stays finite.
    scores = scores.masked_fill(~visible[:, None, None, :], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.einsum("tkgc,tckd->tkgd", probs, values).reshape(tokens, heads, d)


@triton.jit
def _attend_range(acc, m_i, l_i, q, kv_head, row, limit, active, start, end,
                  cache_ptr, block_tables_ptr, stride_slot, stride_kv, stride_head, stride_table_row,
                  max_block, scale,
                  HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, FP32: tl.constexpr):
    """Online softmax of the tile's queries over context positions [start, min(end, max visible)) of `row`."""
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_SIZE
    hi = tl.minimum(end, tl.max(tl.where(active, limit, 0), axis=0))
    table = block_tables_ptr + row.to(tl.int64) * stride_table_row
    for c0 in range(start, hi, BLOCK_N):
        c = c0 + tl.arange(0, BLOCK_N)
        c_valid = c < hi
        block = tl.load(table + c // BLOCK_SIZE, mask=c_valid, other=0).to(tl.int64)
        block = tl.minimum(tl.maximum(block, 0), max_block)
        slot = block * BLOCK_SIZE + c % BLOCK_SIZE
        kv_offsets = slot[:, None] * stride_slot + kv_head * stride_head + d[None, :]
        kv_mask = c_valid[:, None] & d_mask[None, :]
        k = tl.load(cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(cache_ptr + stride_kv + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)
        if FP32:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        visible = (c[None, :] < limit[:, None]) & active[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP32:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _store_tile(acc, m_i, l_i, mask, token, head, split, num_tokens, num_heads,
                out_ptr, stride_out_token, stride_out_head, part_acc_ptr, part_max_ptr, part_sum_ptr,
                HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_SIZE
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        offsets = token.to(tl.int64)[:, None] * stride_out_token + head[:, None] * stride_out_head + d[None, :]
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask[:, None] & d_mask[None, :])
    else:
        index = (split * num_tokens + token.to(tl.int64)) * num_heads + head
        tl.store(part_acc_ptr + index[:, None] * HEAD_SIZE + d[None, :], acc, mask=mask[:, None] & d_mask[None, :])
        tl.store(part_max_ptr + index, m_i, mask=mask)
        tl.store(part_sum_ptr + index, l_i, mask=mask)


@triton.jit
def _paged_attention_kernel(
        q_ptr, cache_ptr, block_tables_ptr, token_rows_ptr, positions_ptr, seq_lens_ptr,
        out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
        num_tokens, num_heads, num_rows, context_len, split_len, max_block,
        stride_q_token, stride_q_head, stride_slot, stride_kv, stride_head, stride_table_row,
        stride_out_token, stride_out_head, scale,
        GROUP: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, TILE_TOKENS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
        FP32: tl.constexpr, USE_PDL: tl.constexpr):
    release_and_wait(USE_PDL)
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    m = tl.arange(0, BLOCK_M)
    token_in_tile = m // GROUP
    token = tile * TILE_TOKENS + token_in_tile
    row_valid = (token_in_tile < TILE_TOKENS) & (token < num_tokens)
    token = tl.where(row_valid, token, 0)
    head = kv_head * GROUP + m % GROUP
    position = tl.load(positions_ptr + token, mask=row_valid, other=-1)
    seq_len = tl.load(seq_lens_ptr + token, mask=row_valid, other=0)
    # Visible context: c < limit.
    limit = tl.minimum(tl.minimum(position + 1, seq_len.to(position.dtype)), context_len).to(tl.int32)
    limit = tl.where(row_valid, limit, 0)
    rows = tl.load(token_rows_ptr + token, mask=row_valid, other=0).to(tl.int32)
    rows = tl.minimum(tl.maximum(rows, 0), num_rows - 1)
    d = tl.arange(0, BLOCK_D)
    q_offsets = token.to(tl.int64)[:, None] * stride_q_token + head[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_valid[:, None] & (d[None, :] < HEAD_SIZE), other=0.0)
    start = split * split_len
    end = tl.minimum(start + split_len, context_len)
    first_row = tl.min(tl.where(row_valid, rows, num_rows), axis=0)
    last_row = tl.max(tl.where(row_valid, rows, -1), axis=0)
    if first_row == last_row:
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        m_i = tl.full((BLOCK_M,), -1e30, dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc, m_i, l_i = _attend_range(acc, m_i, l_i, q, kv_head, first_row, limit, row_valid, start, end,
                                      cache_ptr, block_tables_ptr, stride_slot, stride_kv, stride_head,
                                      stride_table_row, max_block, scale,
                                      HEAD_SIZE, BLOCK_D, BLOCK_N, BLOCK_SIZE, FP32)
        _store_tile(acc, m_i, l_i, row_valid, token, head, split, num_tokens, num_heads,
                    out_ptr, stride_out_token, stride_out_head, part_acc_ptr, part_max_ptr, part_sum_ptr,
                    HEAD_SIZE, BLOCK_D, NUM_SPLITS)
    else:
        # The tile straddles request rows: one token at a time (only at the rows' boundaries of a ragged batch).
        for j in range(TILE_TOKENS):
            active = row_valid & (token_in_tile == j)
            row = tl.max(tl.where(active, rows, -1), axis=0)
            if row >= 0:
                acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
                m_i = tl.full((BLOCK_M,), -1e30, dtype=tl.float32)
                l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
                acc, m_i, l_i = _attend_range(acc, m_i, l_i, q, kv_head, row, limit, active, start, end,
                                              cache_ptr, block_tables_ptr, stride_slot, stride_kv, stride_head,
                                              stride_table_row, max_block, scale,
                                              HEAD_SIZE, BLOCK_D, BLOCK_N, BLOCK_SIZE, FP32)
                _store_tile(acc, m_i, l_i, active, token, head, split, num_tokens, num_heads,
                            out_ptr, stride_out_token, stride_out_head, part_acc_ptr, part_max_ptr,
                            part_sum_ptr, HEAD_SIZE, BLOCK_D, NUM_SPLITS)


@triton.jit
def _combine_splits_kernel(part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr, num_tokens, num_heads,
                           stride_out_token, stride_out_head,
                           HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                           BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr):
    release_and_wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_mask = s < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_SIZE
    index = (s * num_tokens + token) * num_heads + head
    m_s = tl.load(part_max_ptr + index, mask=s_mask, other=-1e30)
    l_s = tl.load(part_sum_ptr + index, mask=s_mask, other=0.0)
    acc_s = tl.load(part_acc_ptr + index[:, None] * HEAD_SIZE + d[None, :], mask=s_mask[:, None] & d_mask[None, :],
                    other=0.0)
    m = tl.max(m_s, axis=0)
    w = tl.exp(m_s - m)
    total = tl.sum(l_s * w, axis=0)
    out = tl.sum(acc_s * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token * stride_out_token + head * stride_out_head + d, out.to(out_ptr.dtype.element_ty),
             mask=d_mask)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def launch_plan(num_tokens: int, num_heads: int, kv_heads: int, head_size: int, context_len: int,
                uniform_query_len: int, *, block_n: int | None = None, num_stages: int | None = None,
                target_programs: int = TARGET_PROGRAMS) -> dict:
    """Static tiling of one launch (from shapes only, so traced graphs stay static). block_n (context positions
    per loop step), num_stages and target_programs replace the defaults (scripts/bench_linear_configs.py
    --attention sweeps them)."""
    group = num_heads // kv_heads
    one_row_tiles = 0 < uniform_query_len and uniform_query_len * group <= MAX_TILE_ROWS
    verify = one_row_tiles and uniform_query_len > 1  # the measured verify tiling: one request's tokens per tile
    if one_row_tiles:
        tile_tokens = uniform_query_len  # one request row per tile
    else:
        tile_tokens = max(1, 64 // _next_power_of_2(group))
    block_m = max(16, _next_power_of_2(tile_tokens * group))
    block_d = max(16, _next_power_of_2(head_size))
    if block_n is None:
        block_n = (VERIFY_BLOCK_N if verify else 64) if block_d <= 128 else 32
    if num_stages is None:
        num_stages = VERIFY_NUM_STAGES if verify and block_d <= 128 else NUM_STAGES
    tiles = -(-num_tokens // tile_tokens)
    programs = max(1, tiles * kv_heads)
    splits = 1
    if programs < target_programs:
        splits = min(MAX_SPLITS, -(-target_programs // programs), max(1, context_len // MIN_SPLIT_LEN))
    split_len = -(-(-(-context_len // splits)) // block_n) * block_n
    splits = max(1, -(-context_len // split_len)) if context_len > 0 else 1
    num_warps = 8 if block_m * block_d >= 8192 else 4
    return dict(group=group, tile_tokens=tile_tokens, block_m=block_m, block_d=block_d, block_n=block_n,
                tiles=tiles, splits=splits, split_len=split_len, num_warps=num_warps, num_stages=num_stages)


def paged_attention_triton(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           token_rows: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                           block_size: int, scale: float, uniform_query_len: int = 0,
                           plan: dict | None = None) -> torch.Tensor:
    """The Triton paged attention (arguments as `paged_attention_reference`).

    uniform_query_len: > 0 when token t belongs to row t // uniform_query_len (decode = 1, verify = k + 1),
    which sets the tile to one row's tokens; 0 for ragged batches. Runs on any device Triton runs on (CPU
    through the interpreter, TRITON_INTERPRET=1). plan: a `launch_plan` of these shapes to use instead of the
    default one (benchmarks). Returns [T, heads, d] in q's dtype.
    """
    _check_inputs(q, kv_cache, block_tables, token_rows, positions, seq_lens, block_size)
    if q.dtype not in KERNEL_DTYPES:
        raise ValueError(f"paged_attention_triton: q must be float32, float16 or bfloat16, got {q.dtype}")
    tokens, heads, head_size = q.shape
    kv_heads = kv_cache.shape[2]
    q = q.contiguous()
    if kv_cache.stride(3) != 1:
        raise ValueError("paged_attention: kv_cache's last dimension must be contiguous")
    # The kernel indexes these with unit strides (an expanded or strided view would be read wrongly).
    block_tables, token_rows = block_tables.contiguous(), token_rows.contiguous()
    positions, seq_lens = positions.contiguous(), seq_lens.contiguous()
    context_len = block_tables.shape[1] * block_size
    plan = plan or launch_plan(tokens, heads, kv_heads, head_size, context_len, int(uniform_query_len))
    out = torch.empty_like(q)
    if tokens == 0:
        return out
    splits = plan["splits"]
    if splits > 1:
        part_acc = torch.empty((splits, tokens, heads, head_size), dtype=torch.float32, device=q.device)
        part_max = torch.empty((splits, tokens, heads), dtype=torch.float32, device=q.device)
        part_sum = torch.empty((splits, tokens, heads), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_max = part_sum = out  # unused
    launch_kwargs = dependent_launch.launch_options(q.device)
    _paged_attention_kernel[(plan["tiles"], kv_heads, splits)](
        q, kv_cache, block_tables, token_rows, positions, seq_lens,
        out, part_acc, part_max, part_sum,
        tokens, heads, block_tables.shape[0], context_len, plan["split_len"],
        kv_cache.shape[0] // block_size - 1,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), float(scale),
        GROUP=plan["group"], HEAD_SIZE=head_size, BLOCK_D=plan["block_d"], TILE_TOKENS=plan["tile_tokens"],
        BLOCK_M=plan["block_m"], BLOCK_N=plan["block_n"], BLOCK_SIZE=block_size, NUM_SPLITS=splits,
        FP32=q.dtype == torch.float32, num_warps=plan["num_warps"], num_stages=plan["num_stages"],
        **launch_kwargs)
    if splits > 1:
        _combine_splits_kernel[(tokens, heads)](
            part_acc, part_max, part_sum, out, tokens, heads, out.stride(0), out.stride(1),
            HEAD_SIZE=head_size, BLOCK_D=plan["block_d"], NUM_SPLITS=splits,
            BLOCK_S=max(2, _next_power_of_2(splits)), num_warps=4, **launch_kwargs)
    return out


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX-style rotation of x [T, heads, head_size] by per-token angles (cos, sin [T, head_size / 2]), computed in
    cos's dtype and rounded once to x's."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].to(cos.dtype), x[..., half:].to(cos.dtype)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rope_write_kv_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                            slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Rotary embedding of q and k and the cache write of k and v, as the model's unfused path computes them.

    qkv [T, (num_heads + 2 * num_kv_heads) * d] (the fused projection's output, q then k then v); cos, sin
    [T, d / 2] float32 (per-token rotary angles); kv_cache [slots, 2, num_kv_heads, d] (written in place: token t's
    rotated k and its v at slot_mapping[t]); slot_mapping [T] int64, values in [0, slots). Returns the rotated q
    [T, num_heads, d] in qkv's dtype (NeoX rotation, computed in cos's dtype, rounded once).
    """
    tokens, d = qkv.shape[0], kv_cache.shape[3]
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], -1)
    q = apply_rotary(q.reshape(tokens, num_heads, d), cos, sin)
    k = apply_rotary(k.reshape(tokens, num_kv_heads, d), cos, sin)
    kv_cache.index_put_((slot_mapping,), torch.stack((k, v.reshape(tokens, num_kv_heads, d)), dim=1).to(kv_cache.dtype))
    return q


@triton.jit
def _rope_write_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr, q_out_ptr, num_slots,
                          stride_qkv, stride_cos, stride_sin, stride_slot, stride_kv, stride_head, stride_q_token,
                          stride_q_head,
                          NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                          BLOCK_H: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr, USE_PDL: tl.constexpr):
    # One program per (token, HEADS_PER_PROGRAM consecutive heads of [q heads, k heads, v heads]).
    release_and_wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_H)
    if HEADS_PER_PROGRAM == 1:
        # A scalar head, q, k and v each in its own branch: the code decode steps ran before the head blocks
        # (kept as it was measured there; the blocks were timed only on steps of more than 16 tokens).
        head = tl.program_id(1)
        j_mask = j < HALF
        src = qkv_ptr + token * stride_qkv + head * (2 * HALF)
        x1 = tl.load(src + j, mask=j_mask, other=0.0)
        x2 = tl.load(src + HALF + j, mask=j_mask, other=0.0)
        if head < NUM_HEADS + NUM_KV_HEADS:
            c = tl.load(cos_ptr + token * stride_cos + j, mask=j_mask, other=0.0)
            s = tl.load(sin_ptr + token * stride_sin + j, mask=j_mask, other=0.0)
            a, b = x1.to(c.dtype), x2.to(c.dtype)
            y1 = (a * c - b * s).to(x1.dtype)
            y2 = (b * c + a * s).to(x1.dtype)
        else:
            y1, y2 = x1, x2
        if head < NUM_HEADS:
            dst = q_out_ptr + token * stride_q_token + head * stride_q_head
            tl.store(dst + j, y1, mask=j_mask)
            tl.store(dst + HALF + j, y2, mask=j_mask)
        else:
            slot = tl.load(slot_ptr + token).to(tl.int64)
            # A slot outside the cache is not written (the reference would fault on it).
            in_cache = (slot >= 0) & (slot < num_slots)
            kv_index = head - NUM_HEADS
            which = kv_index // NUM_KV_HEADS
            dst = (cache_ptr + tl.where(in_cache, slot, 0) * stride_slot + which * stride_kv
                   + (kv_index % NUM_KV_HEADS) * stride_head)
            write = j < tl.where(in_cache, HALF, 0)
            tl.store(dst + j, y1.to(cache_ptr.dtype.element_ty), mask=write)
            tl.store(dst + HALF + j, y2.to(cache_ptr.dtype.element_ty), mask=write)
    else:
        # A block of heads: the same arithmetic per element, each head's kind as a row mask.
        head = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)  # [P]
        head_valid = head < NUM_HEADS + 2 * NUM_KV_HEADS
        mask = head_valid[:, None] & (j < HALF)[None, :]  # [P, BLOCK_H]
        src = qkv_ptr + token * stride_qkv + head[:, None] * (2 * HALF) + j[None, :]
        x1 = tl.load(src, mask=mask, other=0.0)
        x2 = tl.load(src + HALF, mask=mask, other=0.0)
        c = tl.load(cos_ptr + token * stride_cos + j, mask=j < HALF, other=0.0)[None, :]
        s = tl.load(sin_ptr + token * stride_sin + j, mask=j < HALF, other=0.0)[None, :]
        a, b = x1.to(c.dtype), x2.to(c.dtype)
        rotated = (head < NUM_HEADS + NUM_KV_HEADS)[:, None]  # q and k turn; v passes through
        y1 = tl.where(rotated, (a * c - b * s).to(x1.dtype), x1)
        y2 = tl.where(rotated, (b * c + a * s).to(x1.dtype), x2)
        is_q = (head < NUM_HEADS)[:, None]
        dst = q_out_ptr + token * stride_q_token + tl.where(is_q, head[:, None], 0) * stride_q_head + j[None, :]
        tl.store(dst, y1, mask=mask & is_q)
        tl.store(dst + HALF, y2, mask=mask & is_q)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        in_cache = (slot >= 0) & (slot < num_slots)
        kv_index = tl.maximum(head - NUM_HEADS, 0)
        which = kv_index // NUM_KV_HEADS
        dst = (cache_ptr + tl.where(in_cache, slot, 0) * stride_slot + (which * stride_kv
               + (kv_index % NUM_KV_HEADS) * stride_head)[:, None] + j[None, :])
        write = (head_valid & (head >= NUM_HEADS))[:, None] & (j < tl.where(in_cache, HALF, 0))[None, :]
        tl.store(dst, y1.to(cache_ptr.dtype.element_ty), mask=write)
        tl.store(dst + HALF, y2.to(cache_ptr.dtype.element_ty), mask=write)


def _check_rope_inputs(qkv, cos, sin, kv_cache, slot_mapping, num_heads, num_kv_heads) -> None:
    """rope_write_kv's argument checks (both paths): a ValueError naming the argument and what was expected."""
    tokens = qkv.shape[0]
    if kv_cache.dim() != 4 or kv_cache.shape[1] != 2 or kv_cache.shape[2] != num_kv_heads:
        raise ValueError(f"rope_write_kv: kv_cache must be [slots, 2, {num_kv_heads}, head_size], "
                         f"got {tuple(kv_cache.shape)}")
    d = kv_cache.shape[3]
    if d % 2 or qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * d:
        raise ValueError(f"rope_write_kv: qkv must be [T, {(num_heads + 2 * num_kv_heads) * d}] for {num_heads} "
                         f"heads and {num_kv_heads} KV heads of (even) size {d}, got {tuple(qkv.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (tokens, d // 2):
            raise ValueError(f"rope_write_kv: {name} must be [{tokens}, {d // 2}], got {tuple(t.shape)}")
    if slot_mapping.shape != (tokens,):
        raise ValueError(f"rope_write_kv: slot_mapping must be [{tokens}], got {tuple(slot_mapping.shape)}")
    if kv_cache.stride(3) != 1:
        raise ValueError("rope_write_kv: kv_cache's last dimension must be contiguous")
    for name, t in (("qkv", qkv), ("cos", cos), ("sin", sin), ("slot_mapping", slot_mapping)):
        if t.device != kv_cache.device:
            raise ValueError(f"rope_write_kv: {name} must be on kv_cache's device {kv_cache.device}, got {t.device}")
    if not (cos.is_floating_point() and sin.is_floating_point() and cos.dtype == sin.dtype):
        raise ValueError(f"rope_write_kv: cos and sin must share a floating dtype, got {cos.dtype} and {sin.dtype}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rope_write_kv: slot_mapping must be int32 or int64, got {slot_mapping.dtype}")


def rope_write_kv_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """`rope_write_kv_reference` in one Triton kernel (arguments as there; a slot outside the cache is skipped)."""
    _check_rope_inputs(qkv, cos, sin, kv_cache, slot_mapping, num_heads, num_kv_heads)
    tokens, d = qkv.shape[0], kv_cache.shape[3]
    qkv = qkv.contiguous()
    cos, sin, slot_mapping = cos.contiguous(), sin.contiguous(), slot_mapping.contiguous()
    q = torch.empty((tokens, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    total_heads = num_heads + 2 * num_kv_heads
    per_program = 1 if tokens <= ROPE_ONE_HEAD_TOKENS else min(ROPE_HEADS_PER_PROGRAM,
                                                                _next_power_of_2(total_heads))
    _rope_write_kv_kernel[(tokens, -(-total_heads // per_program))](
        qkv, cos, sin, kv_cache, slot_mapping, q, kv_cache.shape[0],
        qkv.stride(0), cos.stride(0), sin.stride(0), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        q.stride(0), q.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=d // 2, BLOCK_H=max(16, _next_power_of_2(d // 2)),
        HEADS_PER_PROGRAM=per_program, num_warps=1 if per_program == 1 else 4,
        **dependent_launch.launch_options(qkv.device))
    return q


@torch.library.custom_op("specdec_models::rope_write_kv", mutates_args=("kv_cache",))
def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Rotary q and k, k and v into the cache: the Triton kernel on CUDA, the reference elsewhere (arguments as
    `rope_write_kv_reference`)."""
    if qkv.device.type != "cuda":
        _check_rope_inputs(qkv, cos, sin, kv_cache, slot_mapping, num_heads, num_kv_heads)
        return rope_write_kv_reference(qkv, cos, sin, kv_cache, slot_mapping, num_heads, num_kv_heads)
    return rope_write_kv_triton(qkv, cos, sin, kv_cache, slot_mapping, num_heads, num_kv_heads)


@rope_write_kv.register_fake
def _rope_write_kv_fake(qkv, cos, sin, kv_cache, slot_mapping, num_heads, num_kv_heads):
    _check_rope_inputs(qkv, cos, sin, kv_cache, slot_mapping, num_heads, num_kv_heads)
    return qkv.new_empty((qkv.shape[0], num_heads, kv_cache.shape[3]))


@torch.library.custom_op("specdec_models::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    token_rows: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                    block_size: int, scale: float, uniform_query_len: int) -> torch.Tensor:
    """Paged attention: the Triton kernels on CUDA, the reference elsewhere (arguments as
    `paged_attention_triton`)."""
    if q.device.type != "cuda" or q.dtype not in KERNEL_DTYPES:
        return paged_attention_reference(q, kv_cache, block_tables, token_rows, positions, seq_lens,
                                         block_size, scale)
    return paged_attention_triton(q, kv_cache, block_tables, token_rows, positions, seq_lens, block_size,
                                  scale, uniform_query_len)


@paged_attention.register_fake
def _paged_attention_fake(q, kv_cache, block_tables, token_rows, positions, seq_lens, block_size, scale,
                          uniform_query_len):
    _check_inputs(q, kv_cache, block_tables, token_rows, positions, seq_lens, block_size)
    return torch.empty_like(q, memory_format=torch.contiguous_format)

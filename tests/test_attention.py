"""Paged attention: the Triton kernel (the interpreter on CPU, the GPU on CUDA) equals the gather reference.

Batches are built as a scheduler would: requests own shuffled cache blocks (the rest of their block-table row is
the null block 0), the cache holds stale values of earlier requests everywhere (reused slots), padded tokens map
to a spare row of null blocks with sequence length 0, and rows may be ragged (prefill) or uniform (decode, verify).
Tolerances: float32 1e-5, float16 2e-3 absolute (outputs are O(1)), bfloat16 on CUDA 2e-2.
"""
import pytest
import torch

from conftest import HAS_CUDA, sync_forbidden
from specdec_ops.models.attention import (MAX_SPLITS, MIN_SPLIT_LEN, launch_plan, paged_attention_reference,
                                          paged_attention_triton)

DEVICE = "cuda" if HAS_CUDA else "cpu"


def make_batch(*, query_lens, context_lens, heads, kv_heads, head_size, block_size, blocks_per_row,
               num_pad_tokens=0, dtype=torch.float32, seed=0, device=DEVICE):
    """A paged batch: request r has query_lens[r] tokens ending at context length context_lens[r]."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs = len(query_lens)
    num_blocks = 1 + sum(-(-c // block_size) for c in context_lens) + 3
    order = torch.randperm(num_blocks - 1, generator=gen) + 1  # shuffled real blocks, block 0 is null
    tables = torch.zeros(num_reqs + 1, blocks_per_row, dtype=torch.int32)  # last row: the padding row
    used = 0
    for r, c in enumerate(context_lens):
        n = -(-c // block_size)
        tables[r, :n] = order[used: used + n].int()
        used += n
    rows, positions, seq_lens = [], [], []
    for r, (q, c) in enumerate(zip(query_lens, context_lens)):
        rows += [r] * q
        positions += list(range(c - q, c))
        seq_lens += [c] * q
    rows += [num_reqs] * num_pad_tokens
    positions += [0] * num_pad_tokens
    seq_lens += [0] * num_pad_tokens
    tokens = len(rows)
    # Stale values everywhere (earlier requests' KV, the null block's garbage): only masking keeps them out.
    cache = torch.randn(num_blocks * block_size, 2, kv_heads, head_size, generator=gen).to(dtype)
    q = torch.randn(tokens, heads, head_size, generator=gen).to(dtype)
    t = lambda v, dt: torch.tensor(v, dtype=dt, device=device)  # noqa: E731
    batch = dict(q=q.to(device), kv_cache=cache.to(device), block_tables=tables.to(device),
                 token_rows=t(rows, torch.int64), positions=t(positions, torch.int64),
                 seq_lens=t(seq_lens, torch.int32), block_size=block_size, scale=head_size ** -0.5)
    return batch, tokens - num_pad_tokens


def check(batch, live, uniform_query_len, atol):
    want = paged_attention_reference(**batch)
    got = paged_attention_triton(**batch, uniform_query_len=uniform_query_len)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[:live].float(), want[:live].float(), atol=atol, rtol=0)
    if live < got.shape[0]:  # padded tokens see nothing: zeros
        assert (got[live:] == 0).all()
    return got


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_ragged_prefill_batch(dtype, atol):
    # Mixed prompt lengths (some spanning a tile boundary), a chunked prefill that starts mid-context, padding.
    batch, live = make_batch(query_lens=[5, 1, 19, 3, 9], context_lens=[5, 7, 19, 40, 9], heads=8, kv_heads=2,
                             head_size=64, block_size=16, blocks_per_row=4, num_pad_tokens=6, dtype=dtype)
    check(batch, live, 0, atol)


def test_decode_batch_with_padded_rows():
    batch, live = make_batch(query_lens=[1] * 6, context_lens=[1, 17, 64, 33, 2, 50], heads=8, kv_heads=2,
                             head_size=64, block_size=16, blocks_per_row=4, num_pad_tokens=2)
    check(batch, live, 1, 1e-5)


def test_verify_batch_odd_shapes():
    # k + 1 = 5 tokens per row, 3 query heads per KV head, head size 48 (not a power of two), 8-slot blocks.
    batch, live = make_batch(query_lens=[5] * 4, context_lens=[5, 12, 30, 21], heads=9, kv_heads=3, head_size=48,
                             block_size=8, blocks_per_row=5, num_pad_tokens=5)
    check(batch, live, 5, 1e-5)


def test_long_context_splits_and_combines():
    # Few programs and a long context: the launch splits the context and combines the splits.
    batch, live = make_batch(query_lens=[1, 1], context_lens=[700, 1023], heads=4, kv_heads=1, head_size=32,
                             block_size=16, blocks_per_row=64, num_pad_tokens=1)
    assert launch_plan(3, 4, 1, 32, 64 * 16, 1)["splits"] > 1
    check(batch, live, 1, 1e-5)
    # The same tokens as a ragged batch (tiles of several tokens straddling rows).
    check(batch, live, 0, 1e-5)


def test_batch_one_takes_the_most_splits_and_empty_splits_combine():
    # One decode token over a wide block table: MAX_SPLITS splits of MIN_SPLIT_LEN positions, most of them past
    # the sequence (nothing to attend: they must drop out of the combination), one cut mid-split.
    blocks_per_row = MAX_SPLITS * MIN_SPLIT_LEN // 8
    plan = launch_plan(1, 4, 1, 16, blocks_per_row * 8, 1)
    assert plan["splits"] == MAX_SPLITS and plan["split_len"] == MIN_SPLIT_LEN
    for context in (1, MIN_SPLIT_LEN + 3, 5 * MIN_SPLIT_LEN):
        batch, live = make_batch(query_lens=[1], context_lens=[context], heads=4, kv_heads=1, head_size=16,
                                 block_size=8, blocks_per_row=blocks_per_row, seed=context)
        check(batch, live, 1, 1e-5)


@pytest.mark.parametrize("block_n,num_stages,target_programs,split", [(128, 2, 2048, True), (32, 4, 64, True),
                                                                      (16, 3, 1, False)])
def test_other_launch_plans_match_the_reference(block_n, num_stages, target_programs, split):
    # The tilings a benchmark sweeps (a plan passed in): other context steps, pipelining depths and split counts
    # compute the same attention, for decode rows, a uniform verify batch and a ragged (prefill) batch.
    for query_lens, context_lens, uniform in (([1, 1, 1], [700, 5, 130], 1), ([5, 5], [37, 260], 5),
                                              ([9, 3, 14], [9, 300, 40], 0)):
        batch, live = make_batch(query_lens=query_lens, context_lens=context_lens, heads=4, kv_heads=2,
                                 head_size=16, block_size=16, blocks_per_row=48, num_pad_tokens=2)
        tokens = batch["q"].shape[0]
        plan = launch_plan(tokens, 4, 2, 16, 48 * 16, uniform, block_n=block_n, num_stages=num_stages,
                           target_programs=target_programs)
        assert plan["block_n"] == block_n and (plan["splits"] > 1) == split
        want = paged_attention_reference(**batch)
        got = paged_attention_triton(**batch, uniform_query_len=uniform, plan=plan)
        torch.testing.assert_close(got[:live], want[:live], atol=1e-5, rtol=0)
        assert (got[live:] == 0).all()


def test_verify_steps_take_the_longer_context_step():
    # Decode layouts keep 64 positions per loop step and 3 stages; uniform verify layouts take 128 and 2 (their
    # kernels are the ones the verify tests above run).
    decode = launch_plan(8, 32, 8, 64, 4096, 1)
    verify = launch_plan(40, 32, 8, 64, 4096, 5)
    assert (decode["block_n"], decode["num_stages"]) == (64, 3)
    assert (verify["block_n"], verify["num_stages"]) == (128, 2)
    assert launch_plan(40, 32, 8, 64, 4096, 0)["block_n"] == 64  # ragged batches (prefill) keep the default
    assert launch_plan(80, 32, 8, 64, 4096, 40)["block_n"] == 64  # so do rows too long for one tile
    assert launch_plan(40, 32, 8, 256, 4096, 5)["block_n"] == 32  # wide heads keep the narrow step


def test_tokens_of_one_row_need_not_be_contiguous():
    # The kernel reads each token's row from token_rows; a tile holding tokens of several rows still works.
    batch, live = make_batch(query_lens=[3, 4], context_lens=[10, 20], heads=4, kv_heads=2, head_size=16,
                             block_size=4, blocks_per_row=5)
    perm = torch.tensor([0, 3, 1, 4, 2, 5, 6], device=DEVICE)
    for key in ("q", "token_rows", "positions", "seq_lens"):
        batch[key] = batch[key][perm]
    check(batch, live, 0, 1e-5)


def test_op_traces_fullgraph_and_matches_reference():
    # The custom op dispatches to the reference off CUDA; compiling it must trace in one graph either way.
    from specdec_ops.models import paged_attention

    batch, live = make_batch(query_lens=[2, 3], context_lens=[4, 9], heads=4, kv_heads=2, head_size=16,
                             block_size=4, blocks_per_row=3, num_pad_tokens=1)
    args = (batch["q"], batch["kv_cache"], batch["block_tables"], batch["token_rows"], batch["positions"],
            batch["seq_lens"], batch["block_size"], batch["scale"], 0)
    eager = paged_attention(*args)
    compiled = torch.compile(paged_attention, fullgraph=True, dynamic=False)(*args)
    want = paged_attention_reference(**batch)
    torch.testing.assert_close(eager[:live], want[:live], atol=1e-5, rtol=0)
    torch.testing.assert_close(compiled[:live], want[:live], atol=1e-5, rtol=0)
    # Schema, fake kernel and AOT dispatch of the registered op (on CUDA: the Triton path's fake).
    results = torch.library.opcheck(torch.ops.specdec_models.paged_attention.default, args)
    assert all(v == "SUCCESS" for v in results.values()), results


def test_bad_inputs_raise():
    batch, _ = make_batch(query_lens=[2], context_lens=[4], heads=4, kv_heads=2, head_size=16, block_size=4,
                          blocks_per_row=2)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        paged_attention_triton(**{**batch, "q": batch["q"][:, :3]})
    with pytest.raises(ValueError, match="positions must have shape"):
        paged_attention_triton(**{**batch, "positions": batch["positions"][:1]})
    with pytest.raises(ValueError, match="kv_cache must be"):
        paged_attention_triton(**{**batch, "kv_cache": batch["kv_cache"][..., :8]})


@pytest.mark.cuda
@pytest.mark.parametrize("uniform", [0, 1, 5])
def test_bf16_matches_reference_on_cuda(uniform):
    if uniform == 0:
        q_lens, c_lens = [17, 1, 70, 3, 128], [17, 300, 70, 900, 4000]
    else:
        q_lens = [uniform] * 33
        c_lens = [uniform + 37 * i for i in range(33)]
    batch, live = make_batch(query_lens=q_lens, context_lens=c_lens, heads=32, kv_heads=8, head_size=64,
                             block_size=16, blocks_per_row=256, num_pad_tokens=3, dtype=torch.bfloat16)
    want = paged_attention_reference(**batch)
    with sync_forbidden():  # the launch itself never waits for the device
        got = paged_attention_triton(**batch, uniform_query_len=uniform)
    torch.cuda.synchronize()
    torch.testing.assert_close(got[:live].float(), want[:live].float(), atol=2e-2, rtol=0)
    assert (got[live:] == 0).all()


def test_long_uniform_queries_fall_back_to_ragged_tiles():
    # 40 tokens per row x 4 query heads per KV head exceed one tile: the uniform layout takes the ragged tiling.
    assert launch_plan(80, 8, 2, 16, 64, 40)["tile_tokens"] != 40
    batch, live = make_batch(query_lens=[40, 40], context_lens=[40, 57], heads=8, kv_heads=2, head_size=16,
                             block_size=8, blocks_per_row=8, num_pad_tokens=0)
    check(batch, live, 40, 1e-5)

"""KV bookkeeping refuses what would let two requests share a block; the proposer refuses float ids and inputs on
another device."""
import pytest
import torch

from specdec_ops.models import DraftModel
from specdec_ops.runtime import BlockPool, BlockTable, DraftProposer, ProposerConfig


def test_block_pool_hands_out_each_block_once_and_tracks_owners():
    pool = BlockPool(8, seed=2)
    a = pool.allocate(3, owner="a")
    b = pool.allocate(4, owner="b")
    assert sorted(a + b) == list(range(1, 8)) and pool.num_free == 0  # never the null block 0
    assert {pool.owner(x) for x in a} == {"a"} and {pool.owner(x) for x in b} == {"b"}
    with pytest.raises(ValueError, match="3 blocks requested, 0 free"):
        pool.allocate(3)
    pool.release(a)
    with pytest.raises(ValueError, match="is not allocated"):
        pool.owner(a[0])
    assert sorted(pool.allocate(3, owner="c")) == sorted(a)


def test_block_pool_refuses_bad_releases_without_releasing_anything():
    pool = BlockPool(6)
    blocks = pool.allocate(3)
    pool.release(blocks[:1])
    with pytest.raises(ValueError, match=r"blocks\[1\] = .* is not allocated \(released twice"):
        pool.release([blocks[1], blocks[0]])
    assert pool.owner(blocks[1]) is None  # the refused call released nothing
    with pytest.raises(ValueError, match="null block"):
        pool.release([0])
    with pytest.raises(ValueError, match=r"blocks\[0\] = 6 lies outside the pool's block ids \[1, 6\)"):
        pool.release([6])
    with pytest.raises(ValueError, match="outside the pool"):
        pool.release([-1])
    with pytest.raises(ValueError, match="more than once"):
        pool.release([blocks[1], blocks[1]])
    with pytest.raises(ValueError, match="must be an int block id"):
        pool.release([1.0])
    with pytest.raises(ValueError, match="count must be an int >= 0"):
        pool.allocate(-1)
    with pytest.raises(ValueError, match="num_blocks must be an int >= 1"):
        BlockPool(0)
    # A block released twice is never handed to two requests: after the refusals, every block once.
    pool.release(blocks[1:])
    assert sorted(pool.allocate(5)) == [1, 2, 3, 4, 5]


def test_block_table_refuses_foreign_blocks_and_slots():
    table = BlockTable(num_slots=3, blocks_per_req=4, num_blocks=10, device="cpu")
    table.assign(0, [5, 2])
    assert table.tensor[0].tolist() == [5, 2, 0, 0] and table.blocks(0) == [5, 2]
    with pytest.raises(ValueError, match=r"blocks\[1\] = 5 belongs to slot 0, not to slot 1"):
        table.assign(1, [3, 5])
    assert table.tensor[1].tolist() == [0, 0, 0, 0] and table.blocks(1) == []  # refused: nothing changed
    with pytest.raises(ValueError, match=r"lies outside the pool's block ids \[1, 10\)"):
        table.assign(1, [10])
    with pytest.raises(ValueError, match="null block"):
        table.assign(1, [0])
    with pytest.raises(ValueError, match=r"slot must lie in \[0, 3\)"):
        table.assign(3, [1])  # row 3 is the spare slot of padded rows: never assignable
    with pytest.raises(ValueError, match=r"slot must lie in \[0, 3\)"):
        table.assign(-1, [1])
    with pytest.raises(ValueError, match="at most blocks_per_req = 4"):
        table.assign(1, [1, 3, 4, 6, 7])
    # Re-assigning a slot gives up its old blocks; clearing frees them for other slots.
    table.assign(0, [5, 2, 7])
    table.assign(0, [7])
    table.assign(1, [5, 2])
    assert table.clear(0) == [7] and table.tensor[0].eq(0).all()
    table.assign(2, [7])
    assert table.tensor.tolist() == [[0, 0, 0, 0], [5, 2, 0, 0], [7, 0, 0, 0], [0, 0, 0, 0]]


def proposer_batch(n, t, **overrides):
    batch = dict(input_ids=torch.zeros(t, dtype=torch.int32), positions=torch.arange(t),
                 query_start_loc=torch.linspace(0, t, n + 1).int(), seq_lens=torch.ones(n, dtype=torch.int32),
                 idx_mapping=torch.arange(n, dtype=torch.int32), num_rejected=torch.zeros(n, dtype=torch.int32),
                 last_sampled=torch.zeros(4, dtype=torch.int64), temperature=torch.zeros(n),
                 seeds=torch.zeros(n, dtype=torch.int64))
    batch.update(overrides)
    return batch


def test_proposer_refuses_float_ids_other_devices_and_foreign_blocks():
    proposer = DraftProposer(DraftModel(), ProposerConfig(2, 4, 16, 32, block_size=4, num_slots=4), device="cpu",
                             compile=False)
    proposer.propose(**proposer_batch(2, 6))  # the valid batch runs
    with pytest.raises(ValueError, match="argument 'input_ids' must be int32 or int64, got torch.float32"):
        proposer.propose(**proposer_batch(2, 6, input_ids=torch.zeros(6)))
    with pytest.raises(ValueError, match="argument 'seeds' must be int32 or int64"):
        proposer.propose(**proposer_batch(2, 6, seeds=torch.zeros(2)))
    with pytest.raises(ValueError, match="argument 'temperature' must be a float tensor"):
        proposer.propose(**proposer_batch(2, 6, temperature=torch.zeros(2, dtype=torch.int64)))
    with pytest.raises(ValueError, match="argument 'positions' must be on cpu, got meta"):
        proposer.propose(**proposer_batch(2, 6, positions=torch.arange(6, device="meta")))
    with pytest.raises(ValueError, match="argument 'last_sampled' must be a tensor"):
        proposer.propose(**proposer_batch(2, 6, last_sampled=[0, 0]))
    proposer.assign_blocks(0, [3, 4])
    with pytest.raises(ValueError, match="DraftProposer.assign_blocks: blocks\\[0\\] = 4 belongs to slot 0"):
        proposer.assign_blocks(1, [4])
    with pytest.raises(ValueError, match="outside the pool"):
        proposer.assign_blocks(1, [proposer.num_blocks])
    assert proposer.release_slot(0) == [3, 4]
    proposer.assign_blocks(1, [4])

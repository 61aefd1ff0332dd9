"""A randomized soak of the runtime under strict mode: many propose rounds with requests joining, leaving and
running up to max_model_len, checking after every round that no two live requests share a KV block (in the pool, in
the proposer's block table and in the cache tensors' ownership) and that every request's drafts equal the cache-free
reference."""
import pytest
import torch

from specdec_ops import strict_mode
from specdec_ops.models import DraftModel, DraftModelConfig
from specdec_ops.runtime import DraftProposer, ProposerConfig

from support import SyntheticTarget, greedy_reference

ROUNDS = 2000
K = 2
CONFIG = ProposerConfig(num_speculative_tokens=K, max_num_reqs=4, max_num_tokens=40, max_model_len=32,
                        block_size=4, num_slots=6, batch_sizes=(4,), token_sizes=(40,))
# One small layer in float64: the reference's argmax cannot flip on rounding, and thousands of rounds stay cheap.
MODEL = DraftModelConfig(vocab_size=48, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                         intermediate_size=16, dtype=torch.float64)


@pytest.mark.slow
def test_runtime_soak_under_strict_mode():
    torch.manual_seed(0)
    model = DraftModel(MODEL, seed=5)
    proposer = DraftProposer(model, CONFIG, device="cpu", compile=False)
    sim = SyntheticTarget([proposer], seed=7, vocab_size=MODEL.vocab_size, max_prompt_len=6, long_prompt_len=20,
                          leave_prob=0.03, skip_prob=0.1)
    longest = 0
    for round_index in range(ROUNDS):
        batch = sim.next_batch(ids_dtype=torch.int64 if round_index % 3 else torch.int32)
        with strict_mode():  # every op of the round validates its values
            drafts, _ = proposer.propose(**batch)
        # No two live requests share a block, and the proposer's table holds exactly each request's blocks.
        owned = {}
        for slot, request in sim.requests.items():
            assert proposer.block_table.blocks(slot) == request["blocks"], f"round {round_index}: slot {slot}"
            for block in request["blocks"]:
                assert block != 0 and block not in owned, f"round {round_index}: block {block} shared"
                assert sim.pool.owner(block) == slot
                owned[block] = slot
        want = [greedy_reference(model, sim.true_sequence(slot), K) for slot in sim.batch_slots]
        assert drafts.tolist() == want, f"round {round_index}: drafts differ from the cache-free reference"
        sim.verify(drafts.tolist())
        longest = max([longest] + [len(sim.true_sequence(slot)) for slot in sim.requests])
    # The soak did what it is for: many requests, slots reused, sequences up to the limit.
    assert sim.num_joined > 10 * CONFIG.slots
    assert longest + 2 * K + 3 > CONFIG.max_model_len  # requests ran until the next round would pass the limit
